"""Plausible mistakes that lesson 1's checks must catch (tests/lessons/test_exercises.py)."""

MUTANTS = [
    # (the check cell's first line, exactly; code run before the check's source; the mistake)
    (
        "# Check: exercise 1 -- over uneven chunks, the gathered loss (a) and the share-weighted"
        " losses",
        "gradients = {**gradients, 'c': gradients['b']}",
        "(c) weights each chunk's loss by 1/3 instead of its share of the batch: it is then (b)",
    ),
    (
        "# Check: exercise 2 -- averaging the replicas' gradients gives the full-batch gradient"
        " divided",
        "averaged = reduce_add(replicas)",
        "the replicas' gradients summed, not averaged",
    ),
    (
        "# Check: exercise 3 -- one backward through differentiable copies fills the model's .grad",
        "set_seed(0)\nautograd_net = MLP(64, HIDDEN, 10)",
        "copies made with p.detach().clone(): backward never reaches the model's .grad",
    ),
]
