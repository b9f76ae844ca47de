"""Plausible mistakes that lesson 6's checks must catch (tests/lessons/test_exercises.py)."""

MUTANTS = [
    # (a check in the lesson's body, its first line exactly; code run before it; the mistake)
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
]

EXERCISE_1 = (
    "# Check: exercise 1 -- each GPU's model state for 7B parameters on 8 GPUs, and what fits in"
    " 80 GB"
)
EXERCISE_2 = (
    "# Check: exercise 2 -- parameter bytes under the default threshold; a threshold for hidden"
    " layers"
)
EXERCISE_3 = (
    "# Check: exercise 3 -- ZeRO 2 with accumulation ends on the weights of one plain step per"
    " window"
)

# Exercise 3's ZeRO 2 run, as the solution writes it (with `mixed_precision` to vary)
ZERO2_RUN = """\
def zero2_weights(accumulation, batch_size, steps=10):
    from nbaccel import Accelerator, DeepSpeedPlugin

    set_seed(0)
    plugin = DeepSpeedPlugin(zero_stage=2)
    accelerator = Accelerator(
        mixed_precision="no", gradient_accumulation_steps=accumulation, deepspeed_plugin=plugin
    )
    model = MLP(64, 64, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(DIGITS["train"], batch_size=batch_size)  # no shuffling
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _, (images, labels) in zip(range(steps * accumulation), loader):
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(images), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    weights = accelerator.get_state_dict(model)
    accelerator.end_training()
    return torch.cat([w.flatten() for w in weights.values()])


zero2_flat = None
if needs("deepspeed", "exercise 3's ZeRO 2 run"):
    zero2_flat = notebook_launcher(
        zero2_weights, args=(2, 8), num_processes=WORKERS, cpu=not USE_CUDA
    )
"""


def plain_run(batch: str = "2 * 8 * WORKERS", zero_grad: bool = True) -> str:
    """Exercise 3's plain PyTorch run, with its batch size or its zero_grad varied."""
    return (
        "set_seed(0)\n"
        "net = MLP(64, 64, 10)\n"
        "sgd = torch.optim.SGD(net.parameters(), lr=0.5)\n"
        f"for _, (images, labels) in zip(range(10), DataLoader(DIGITS['train'], {batch})):\n"
        "    F.cross_entropy(net(images), labels).backward()\n"
        "    sgd.step()\n" + ("    sgd.zero_grad()\n" if zero_grad else "") + "plain_flat = "
        "torch.cat([w.detach().flatten() for w in net.state_dict().values()])\n"
    )


WRONG = [
    # (an exercise's check, its first line exactly; a complete learner's cell; the mistake)
    (
        EXERCISE_1,
        "stages = {'DDP': 0, 'ZeRO 2': 2, 'ZeRO 3': 3}\n"
        "per_gpu_gb = {name: sum(predicted(stage, 7e9, 8, k=8).values()) / 1e9"
        " for name, stage in stages.items()}\n"
        "fitting = {name for name, gb in per_gpu_gb.items() if gb < 80}\n",
        "Adam's state without the float32 master weights (K = 8, not 12)",
    ),
    (
        EXERCISE_1,
        "stages = {'DDP': 0, 'ZeRO 2': 2, 'ZeRO 3': 3}\n"
        "per_gpu_gb = {name: sum(predicted(stage, 7e9, 8, weight=4, grad=4, k=8).values()) / 1e9"
        " for name, stage in stages.items()}\n"
        "fitting = {name for name, gb in per_gpu_gb.items() if gb < 80}\n",
        "float32 training's split (4 + 4 + 8 bytes), not bf16 AdamW's 2 + 2 + 12",
    ),
    (
        EXERCISE_1,
        "stages = {'DDP': 0, 'ZeRO 2': 2, 'ZeRO 3': 3}\n"
        "per_gpu_gb = {name: sum(predicted(stage, 7e9, 8).values()) / 1e9"
        " for name, stage in stages.items()}\n"
        "fitting = {'ZeRO 3'}  # only stage 3 shards the parameters\n",
        "only ZeRO 3 counted as fitting: ZeRO 2 fits too",
    ),
    (
        EXERCISE_2,
        "predicted_param_bytes = sum(2 * s for s in sizes if s <= 100_000)"
        " + sum(2 * s / WORKERS for s in sizes)\n"
        "shard_threshold = 0  # shard everything\n",
        "threshold 0: it shards the hidden layers, but every bias and small layer too",
    ),
    (
        EXERCISE_2,
        "predicted_param_bytes = sum(2 * s for s in sizes if s <= 100_000)"
        " + sum(2 * s / WORKERS for s in sizes)\n"
        "shard_threshold = HIDDEN * HIDDEN\n",
        "off by one: a tensor of exactly the threshold's elements persists, so the hidden "
        "matrices stay whole",
    ),
    (
        EXERCISE_2,
        "predicted_param_bytes = sum(2 * s for s in sizes if s <= 100_000)\n"
        "shard_threshold = HIDDEN * HIDDEN - 1\n",
        "the persistent tensors' whole copies, without the partitions DeepSpeed keeps beside them",
    ),
    (
        EXERCISE_2,
        "predicted_param_bytes = 2 * PSI / WORKERS  # the paper's 2 Psi / N\n"
        "shard_threshold = HIDDEN * HIDDEN - 1\n",
        "the paper's 2Ψ / N, as if the default threshold sharded every tensor",
    ),
    (
        EXERCISE_3,
        "set_seed(0)\n"
        "zero2_flat = torch.cat([w.detach().flatten()"
        " for w in MLP(64, 64, 10).state_dict().values()])\n" + plain_run(),
        "the weights as initialised: a ZeRO 2 run that never stepped",
    ),
    (
        EXERCISE_3,
        ZERO2_RUN + plain_run(batch="8 * WORKERS"),
        "the plain run on batches of 8 x WORKERS: one micro-batch per step, the accumulation "
        "forgotten",
    ),
    (
        EXERCISE_3,
        ZERO2_RUN + plain_run(zero_grad=False),
        "the plain run never zeroes its gradients: each step adds the earlier steps' gradients",
    ),
]
