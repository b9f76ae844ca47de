"""Plausible mistakes that lesson 6's checks must catch (tests/lessons/test_exercises.py)."""

MUTANTS = [
    # (the check cell's first line, exactly; code run before the check's source; the mistake)
    (
        "# Check: each process holds, to within a few hundred bytes, what the formula with this"
        " setup's",
        "runs = {**runs, 'ZeRO 1': [{**r, 'state': {**r['state'], 'gradients': 0}}"
        " for r in runs['ZeRO 1']]}",
        "ZeRO 1's bytes read after the engine's step, which freed its gradients: 8 bytes per "
        "parameter, not the paper's 10",
    ),
    (
        "# Check: ZeRO's stages, measured while their gradients exist, keep the paper's order on"
        " every",
        "runs = {**runs, **{s: [{**r, 'state': {**r['state'], 'gradients': 0}} for r in runs[s]]"
        " for s in ('ZeRO 1', 'ZeRO 2')}}",
        "stages 1 and 2 read after the engine's step (gradients freed): all three stages tie at "
        "8 bytes per parameter",
    ),
    # wrong answers to the exercises
    (
        "# Check: exercise 1: each GPU's model state for 7B parameters on 8 GPUs, and what fits"
        " in 80 GB",
        "per_gpu_gb = {**per_gpu_gb, 'DDP': 7e9 * (2 + 2 + 8) / 1e9}",
        "Adam's state without the float32 master weights (K = 8, not 12)",
    ),
    (
        "# Check: exercise 2: the parameter bytes each process kept under the default threshold",
        "predicted_param_bytes = sum(2 * s for s in sizes if s <= 100_000)",
        "the persistent tensors' whole copies, without the partitions DeepSpeed keeps beside them",
    ),
    (
        "# Check: exercise 3: ZeRO 2 with accumulation ends on the weights of one plain step per"
        " window",
        "set_seed(0)\n"
        "zero2_flat = torch.cat([w.detach().flatten()"
        " for w in MLP(64, 64, 10).state_dict().values()])",
        "the weights as initialised: a ZeRO 2 run that never stepped",
    ),
]
