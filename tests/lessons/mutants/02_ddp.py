"""Plausible mistakes that lesson 2's checks must catch (tests/lessons/test_exercises.py)."""

_PART_5 = (
    "# Check: every rank ends on the same weights, and they match one process on the global batch"
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
    (
        "# Check: exercise 1 -- with unequal batches DDP's gradient is not one process's"
        " gradient on",
        "weighted_grads = [g / 2 for g in weighted_grads]",
        "each rank's loss scaled by B_r / sum(B), without the factor N: DDP's division halves it",
    ),
    (
        "# Check: exercise 2 -- every rank's own loss on its share, in rank order, and their mean",
        "set_seed(0)\n"
        "_inputs, _labels = load_digits('train')[:]\n"
        "_whole = F.cross_entropy(MLP(64, HIDDEN, 10)(_inputs), _labels).detach()\n"
        "rank_losses, reduced_mean = torch.stack([_whole, _whole]), _whole",
        "every rank's loss over the whole training set (no DistributedSampler)",
    ),
    (
        "# Check: exercise 3 -- after dist.broadcast, and after DDP's constructor, every rank"
        " holds",
        "set_seed(1)\n"
        "_rank1 = MLP(64, HIDDEN, 10).state_dict()\n"
        "broadcast_results = [(_rank1, wrapped) for _, wrapped in broadcast_results]",
        "dist.broadcast with src=1: every rank ends on rank 1's weights",
    ),
]
