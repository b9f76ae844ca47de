"""Plausible mistakes that lesson 2's checks must catch (tests/lessons/test_exercises.py)."""

_PART_5 = (
    "# Check: every rank ends on the same weights, and they match one process on the global batch"
)
_PART_6 = (
    "# Check: the ranks' local gradients differ; after DDP's backward both ranks hold their"
    " average,"
)
MUTANTS = [
    # (the check cell's first line, exactly; code run before the check's source; the mistake)
    (
        _PART_5,
        "states = [train_single(EPOCHS, HIDDEN, LR, [b[:BATCH] for b in batches]).state_dict()]"
        " * WORKERS",
        "every rank trained on rank 0's shard (a sampler built with rank=0): half the data",
    ),
    (
        _PART_5,
        "states = [states[0], train_single(EPOCHS, HIDDEN, LR, [b[BATCH:] for b in batches])"
        ".state_dict()]",
        "rank 1 trained alone on its shard: a model not wrapped in DDP, no all-reduce",
    ),
    (
        _PART_5,
        "_slow = train_single(EPOCHS, HIDDEN, LR / 2, batches)\n"
        "single, states = _slow, [_slow.state_dict()] * WORKERS",
        "both runs at half the learning rate (the loss divided by N on top of DDP's average):"
        " the two agree with each other, not with one process at the lesson's learning rate",
    ),
    # section 6: the gradients of one step, pulled from the ranks (local_grads, ddp_grads)
    (
        _PART_6,
        "ddp_grads = local_grads",
        "the model not wrapped in DDP: each rank kept its own local gradient",
    ),
    (
        _PART_6,
        "ddp_grads = [local_grads[0] + local_grads[1]] * 2",
        "the gradients summed across the ranks, not averaged",
    ),
    (
        _PART_6,
        "ddp_grads = [grad / 2 for grad in ddp_grads]",
        "each rank's loss divided by N on top of DDP's average: half the gradient",
    ),
    (
        _PART_6,
        "local_grads = ddp_grads",
        "the local gradients read after DDP's backward (the copy sharing DDP's parameters)",
    ),
    (
        _PART_6,
        "local_grads = ddp_grads = [local_grads[0]] * 2",
        "every rank took rank 0's batch (a slice not chosen by rank): nothing to average",
    ),
]

_EXERCISE_1 = (
    "# Check: exercise 1 -- with unequal batches DDP's gradient is not one process's gradient on"
)
_EXERCISE_2 = (
    "# Check: exercise 2 -- every rank's own loss on its share, in rank order, and their mean"
)
_EXERCISE_3 = (
    "# Check: exercise 3 -- after broadcast_from_rank0, and after DDP's constructor, every rank"
    " holds"
)


def _unequal_step(split: int, scaled: str) -> str:
    """Exercise 1's learner cell: rank 0 takes the first ``split`` of 50 digits; ``scaled`` is
    the weighted loss, written with ``loss``, ``count`` (B_r), ``total`` (sum(B)), ``world``."""
    return f"""\
# Exercise 1: define plain_grads and weighted_grads (rank 0's gradients, unscaled and scaled)
def unequal_step(weighted):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    set_seed(0)
    model = DistributedDataParallel(MLP(64, HIDDEN, 10))
    inputs, labels = load_digits("train")[:50]
    mine = slice(0, {split}) if rank == 0 else slice({split}, 50)
    loss = F.cross_entropy(model(inputs[mine]), labels[mine])
    if weighted:
        count = torch.tensor(float(len(labels[mine])))
        total = count.clone()
        dist.all_reduce(total)
        loss = {scaled}
    loss.backward()
    grads = [p.grad.clone() for p in model.module.parameters()]
    del model
    dist.destroy_process_group()
    return grads


plain_grads, weighted_grads = (
    notebook_launcher(unequal_step, args=(weighted,), num_processes=2, cpu=True)
    for weighted in (False, True)
)
"""


def _gather_losses(sampler: str, mean: str) -> str:
    """Exercise 2's learner cell with its sampler and its mean written as given."""
    return f"""\
# Exercise 2: define rank_losses and reduced_mean (every rank's own loss, and their mean)
def gather_losses():
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    set_seed(0)
    model = MLP(64, HIDDEN, 10)
    train = load_digits("train")
    inputs, labels = {sampler}
    with torch.no_grad():
        local = F.cross_entropy(model(inputs), labels)
    everyone = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(everyone, local)
    mean = local.clone()
    dist.all_reduce(mean)
{mean}    dist.destroy_process_group()
    return torch.stack(everyone), mean


rank_losses, reduced_mean = notebook_launcher(gather_losses, num_processes=2, cpu=True)
"""


_OWN_SHARE = "train[torch.tensor(list(DistributedSampler(train, shuffle=False)))]"


def _broadcast(body: str) -> str:
    """Exercise 3's learner cell: ``body`` is the function's body."""
    return (
        "# Exercise 3: define broadcast_from_rank0(model) (rank 0's weights and buffers on every"
        " rank)\ndef broadcast_from_rank0(model):\n" + body
    )


WRONG = [
    # (the exercise check's first line; the learner's whole cell, a wrong answer; the mistake)
    (
        _EXERCISE_1,
        _unequal_step(30, "loss * count / total"),
        "each rank's loss scaled by B_r / sum(B), without the factor N: DDP's division halves it",
    ),
    (
        _EXERCISE_1,
        _unequal_step(30, "loss * count"),
        "each rank's loss scaled by its own count B_r only (its summed loss), not divided by"
        " the global count sum(B)",
    ),
    (
        _EXERCISE_1,
        _unequal_step(25, "loss * world * count / total"),
        "the right scaling, but on an even 25 + 25 split: the unequal batches never tried, so"
        " plain_grads already matches one process",
    ),
    (
        _EXERCISE_2,
        _gather_losses("train[:]", "    mean /= world\n"),
        "every rank's loss over the whole training set (no DistributedSampler)",
    ),
    (
        _EXERCISE_2,
        _gather_losses(
            "train[torch.tensor(list(DistributedSampler(train)))]", "    mean /= world\n"
        ),
        "DistributedSampler with its default shuffle=True: each rank's share is not the one"
        " asked for",
    ),
    (
        _EXERCISE_2,
        _gather_losses(_OWN_SHARE, ""),
        "reduced_mean is the all-reduced sum, never divided by N",
    ),
    (
        _EXERCISE_3,
        _broadcast(
            "    set_seed(0)  # the same seed on every rank: the same weights, nothing to send\n"
            "    for module in model.modules():\n"
            "        if hasattr(module, 'reset_parameters'):\n"
            "            module.reset_parameters()\n"
        ),
        "set_seed(0) on every rank and no broadcast: the ranks agree by seeding alone, on"
        " weights that are not rank 0's",
    ),
    (
        _EXERCISE_3,
        _broadcast(
            "    for tensor in model.state_dict().values():\n"
            "        dist.broadcast(tensor, src=1)\n"
        ),
        "dist.broadcast with src=1: every rank ends on rank 1's weights",
    ),
    (
        _EXERCISE_3,
        _broadcast("    for p in model.parameters():\n        dist.broadcast(p.detach(), src=0)\n"),
        "the parameters only: BatchNorm's running statistics (buffers) stay each rank's own",
    ),
    (
        _EXERCISE_3,
        _broadcast(
            "    for tensor in model.state_dict().values():\n"
            "        dist.broadcast(tensor.clone(), src=0)\n"
        ),
        "broadcast into copies: rank 1 receives rank 0's values into clones, its model unchanged",
    ),
]
