"""Plausible wrong answers that lesson 1's exercise checks must catch (test_exercises.py).

Each WRONG entry is the learner's whole cell, as a learner might write it, with the mistake it
makes; the check must fail it with an AssertionError that says what to fix.
"""

EXERCISE_1 = (
    "# Check: exercise 1 -- over uneven chunks, the gathered loss (a) and the share-weighted losses"
)
EXERCISE_2 = (
    "# Check: exercise 2 -- averaging the replicas' gradients gives the full-batch gradient divided"
)
EXERCISE_3 = (
    "# Check: exercise 3 -- one backward through two replicas' differentiable copies fills net's"
    " .grad"
)

# Exercise 1's solution up to the losses: three uneven chunks, three replicas, their summed gradient
UNEVEN = """\
# Exercise 1: define gradients (the replicas' summed gradient for each way (a), (b), (c))
sizes = [30, 20, 14]
input_chunks, label_chunks = torch.split(inputs, sizes), torch.split(labels, sizes)


def summed_gradient(combine):
    replicas = [copy.deepcopy(model) for _ in sizes]
    outputs = [replica(chunk) for replica, chunk in zip(replicas, input_chunks)]
    combine(outputs).backward()
    return reduce_add(replicas)


def chunk_losses(outputs):
    return [F.cross_entropy(out, y) for out, y in zip(outputs, label_chunks)]


"""

# Exercise 3: the two replicas' differentiable copies and chunks, then a loss of `outputs`
COPIES = """\
# Exercise 3: define backward_through_copies(net, inputs, labels) (backward through copies)
from torch.func import functional_call


def backward_through_copies(net, inputs, labels):
    replica_params = [{{name: {copy} for name, p in net.named_parameters()}} for _ in range(2)]
    chunks = {chunks}
    outputs = [functional_call(net, ps, (chunk,)) for ps, chunk in zip(replica_params, chunks)]
    {backward}
"""
GATHERED = "F.cross_entropy(torch.cat(outputs), labels).backward()"

MUTANTS = []  # no check of the lesson's body was once too weak

WRONG = [
    # (the exercise check's first line, exactly; the learner's whole cell; the mistake)
    (
        EXERCISE_1,
        UNEVEN
        + """\
gradients = {
    "a": summed_gradient(lambda outs: F.cross_entropy(torch.cat(outs), labels)),
    "b": summed_gradient(lambda outs: sum(chunk_losses(outs)) / 3),
    "c": summed_gradient(lambda outs: sum(loss / 3 for loss in chunk_losses(outs))),
}
""",
        "(c) weights each chunk's loss by 1/3 instead of its share of the batch: it is then (b)",
    ),
    (
        EXERCISE_1,
        UNEVEN
        + """\
gradients = {
    "a": summed_gradient(lambda outs: F.cross_entropy(torch.cat(outs), labels)),
    "b": summed_gradient(lambda outs: sum(chunk_losses(outs)) / 3),
    "c": summed_gradient(
        lambda outs: sum(size * loss for size, loss in zip(sizes, chunk_losses(outs)))
    ),
}
""",
        "(c) weights each chunk's mean loss by its size n_k, not by its share n_k / n",
    ),
    (
        EXERCISE_1,
        UNEVEN
        + """\
gradients = {
    "a": summed_gradient(lambda outs: sum(chunk_losses(outs)) / 3),
    "b": summed_gradient(lambda outs: sum(chunk_losses(outs)) / 3),
    "c": summed_gradient(lambda outs: sum(chunk_losses(outs)) / 3),
}
""",
        "(a) as the mean of the chunks' mean losses, not one loss over the gathered outputs",
    ),
    (
        EXERCISE_1,
        UNEVEN.replace("sizes = [30, 20, 14]", "sizes = [32, 32]")
        + """\
gradients = {
    "a": summed_gradient(lambda outs: F.cross_entropy(torch.cat(outs), labels)),
    "b": summed_gradient(lambda outs: sum(chunk_losses(outs)) / len(sizes)),
    "c": summed_gradient(lambda outs: sum(loss * 32 / 64 for loss in chunk_losses(outs))),
}
""",
        "even chunks (32 and 32): the plain average (b) then matches, and shows nothing",
    ),
    (
        EXERCISE_2,
        "# Exercise 2: define averaged (the replicas' gradients, averaged instead of summed)\n"
        "averaged = reduce_add(replicas)\n",
        "the replicas' gradients summed, not averaged",
    ),
    (
        EXERCISE_2,
        "# Exercise 2: define averaged (the replicas' gradients, averaged instead of summed)\n"
        "averaged = [summed / len(inputs) for summed in reduce_add(replicas)]\n",
        "divided by the batch size (an average over the samples), not by the number of replicas",
    ),
    (
        EXERCISE_2,
        "# Exercise 2: define averaged (the replicas' gradients, averaged instead of summed)\n"
        "averaged = [p.grad for p in replicas[0].parameters()]\n",
        "one replica's gradient taken for the average, as if the replicas' gradients were equal",
    ),
    (
        EXERCISE_3,
        """\
# Exercise 3: define backward_through_copies(net, inputs, labels) (backward through copies)
def backward_through_copies(net, inputs, labels):
    F.cross_entropy(net(inputs), labels).backward()  # the full batch, once: no replicas
""",
        "a single full-batch backward with no replicas: the right .grad, but nothing replicated",
    ),
    (
        EXERCISE_3,
        COPIES.format(
            copy="p.detach().clone()", chunks="torch.chunk(inputs, 2)", backward=GATHERED
        ),
        "copies made with p.detach().clone(): backward never reaches net's .grad",
    ),
    (
        EXERCISE_3,
        COPIES.format(
            copy="p.clone()",
            chunks="[inputs, inputs]",
            backward=GATHERED.replace("labels)", "torch.cat([labels, labels]))"),
        ),
        "each replica runs on the whole batch instead of its own chunk",
    ),
    (
        EXERCISE_3,
        COPIES.format(
            copy="p.clone()",
            chunks="torch.chunk(inputs, 2)",
            backward="sum(F.cross_entropy(out, y) for out, y in zip(outputs, labels.chunk(2)))"
            ".backward()",
        ),
        "the two chunks' mean losses added, not one loss over the gathered outputs: twice the grad",
    ),
    (
        EXERCISE_3,
        """\
# Exercise 3: define backward_through_copies(net, inputs, labels) (backward through copies)
def backward_through_copies(net, inputs, labels):
    replicas = [copy.deepcopy(net) for _ in range(2)]  # section 2's way: independent copies
    outputs = [replica(chunk) for replica, chunk in zip(replicas, torch.chunk(inputs, 2))]
    F.cross_entropy(torch.cat(outputs), labels).backward()
    for param, summed in zip(net.parameters(), reduce_add(replicas)):
        param.grad = summed  # the reduce-add loop, by hand
""",
        "deepcopy replicas and section 2's reduce-add loop: autograd does not do the sum",
    ),
]
