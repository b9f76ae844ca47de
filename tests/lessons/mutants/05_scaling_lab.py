"""Plausible mistakes that lesson 5's checks must catch (tests/lessons/test_exercises.py).

MUTANTS: mistakes once let through by a check in the lesson's body, run before that check.
WRONG: plausible wrong answers to the exercises, each the learner's whole cell as a learner
might write it, with the mistake it makes; the check must fail it with a message.
"""

MUTANTS = [
    # (the check cell's first line, exactly; code run before the check's source; the mistake)
    (
        "# Check: the table's numbers are the medians of interleaved repeats at equal threads, as",
        "class _WallClock(type(scaling)):\n"
        "    def throughputs(self, n):\n"
        "        return [sum(r.timing().samples.values()) / r.timing().wall"
        " for r in self.repeats[n]]\n"
        "scaling = _WallClock(scaling.runs, scaling.repeats, scaling.other_cores,"
        " scaling.threads)",
        "a table whose throughput counts start-up: samples over the whole launch",
    ),
    (
        "# Check: every run reached the target, at the epoch the"
        " losses each rank logged say, and an",
        "per_run = {**per_run, 2: {**per_run[2], 'epochs': per_run[2]['epochs'] + 1}}",
        "a table that reads the epoch after the one that reached the target",
    ),
    (
        "# Check: the drawn timelines keep DDP's rules, and with"
        " many buckets they are the model that",
        "_drawn = ddp_step_segments\n"
        "def ddp_step_segments(compute, allreduce, buckets, overlap, share=2 / 3):\n"
        "    segments, end = _drawn(compute, allreduce, buckets, overlap, share)\n"
        "    if not overlap:\n"
        "        return segments, end\n"
        "    early = share * compute / buckets\n"
        "    segments = [(lane, what, k, start - early * (lane == 'all-reduce'), n)"
        " for lane, what, k, start, n in segments]\n"
        "    return segments, max(compute, max(s + n for _, _, _, s, n in segments))",
        "a timeline that all-reduces each bucket as backward starts it, before its gradients exist",
    ),
    (
        "# Check: the projection starts from the 1-worker"
        " measurement; its 2-worker point is the formula",
        "import dataclasses\n"
        "check = projection.check(compute, grad_bytes, BATCH,"
        " dataclasses.replace(here, bandwidth=2 * here.bandwidth), measured, spoiled=spoiled)",
        "a projection that counts each gradient byte once around the ring, not 2(N-1)/N times",
    ),
]

EXERCISE_1 = "# Check: exercise 1 -- `wide` measured the 4x wider model at every process count"
EXERCISE_2 = (
    "# Check: exercise 2 -- the predicted bytes of one epoch at K = 8, against a 1-epoch run"
)
EXERCISE_3 = "# Check: exercise 3 -- `scaled` trained on 2 processes with twice the learning rate"
EXERCISE_4 = (
    "# Check: exercise 4 -- the smallest accumulations that reach 0.8 efficiency at 64 workers"
)

LEARNER_1 = (
    "# Exercise 1: define wide (train measured at hidden=4 * HIDDEN, epochs=2, every count)\n"
)
LEARNER_2 = (
    "# Exercise 2: define predicted_bytes (what one process all-reduces in one epoch at K = 8)\n"
)
LEARNER_3 = "# Exercise 3: define scaled (measure_scaling of train on 2 processes at lr=2 * LR)\n"
LEARNER_4 = (
    "# Exercise 4: define k_ethernet and k_ndr"
    " (the smallest K reaching 0.8 at 64 workers, or None)\n"
)

# Exercise 4: the search, with the what-if's inputs (`inputs`) and projection's overlap
SEARCH = '''\
def smallest_accumulation(link, workers=64, target=0.8, most=1024):
    """The smallest K whose projected efficiency reaches target."""
    for k in range(1, most + 1):
        p = projection.project({inputs}, BATCH, link, workers, {overlap}accumulation=k)
        if p.efficiency >= target:
            return k
    return None


'''
WHAT_IF = "compute * 100 / 100, grad_bytes * 100"
ETHERNET = 'smallest_accumulation(projection.PRESETS["100 Gb Ethernet"])'
NDR = 'smallest_accumulation(projection.PRESETS["InfiniBand NDR"])'

WRONG = [
    # (the exercise check's first line, exactly; the learner's whole cell; the mistake)
    (
        EXERCISE_1,
        LEARNER_1 + "wide = scaling\n",
        "section 2's measurement of the narrow model, given as the wide one",
    ),
    (
        EXERCISE_1,
        LEARNER_1 + "wide = measure_scaling(\n"
        "    train, kwargs=dict(hidden=2 * HIDDEN, epochs=2), counts=COUNTS, cpu=CPU, repeats=1\n"
        ")\n",
        "a model 2x wider, not 4x",
    ),
    (
        EXERCISE_1,
        LEARNER_1 + "wide = measure_scaling(\n"
        "    train, kwargs=dict(hidden=4 * HIDDEN, epochs=2), counts=(2,), cpu=CPU, repeats=1\n"
        ")\n",
        "the wide model on 2 processes only: no 1-process baseline for its efficiency",
    ),
    (
        EXERCISE_2,
        LEARNER_2 + 'predicted_bytes = 2 * math.ceil(B / 8) * buckets * base["allreduce_bytes"]'
        ' / base["allreduce_calls"]\n',
        "the bytes of both processes together, not of one",
    ),
    (
        EXERCISE_2,
        LEARNER_2 + 'predicted_bytes = base["allreduce_bytes"] / 8\n',
        "K = 1's bytes over 8, forgetting that section 6's counts cover ACC_EPOCHS epochs",
    ),
    (
        EXERCISE_2,
        LEARNER_2 + 'per_call = base["allreduce_bytes"] / base["allreduce_calls"]\n'
        "predicted_bytes = math.ceil(B / 8) * buckets * per_call / 1e6  # MB\n",
        "the right count in MB, not bytes",
    ),
    (
        EXERCISE_2,
        LEARNER_2 + 'predicted_bytes = base["allreduce_bytes"] / ACC_EPOCHS\n',
        "an epoch at K = 1: every micro-batch all-reducing, as without accumulation",
    ),
    (
        EXERCISE_3,
        LEARNER_3 + "scaled = scaling\n",
        "section 2's 2-process run, at the unscaled learning rate",
    ),
    (
        EXERCISE_3,
        LEARNER_3 + "scaled = measure_scaling(\n"
        "    train,\n"
        "    kwargs=dict(hidden=HIDDEN, epochs=EPOCHS, lr=LR * 2**0.5),\n"
        "    counts=(2,),\n"
        "    cpu=CPU,\n"
        "    repeats=1,\n"
        ")\n",
        "the square-root rule (Adam's starting point), not the linear rule for SGD",
    ),
    (
        EXERCISE_3,
        LEARNER_3 + "scaled = measure_scaling(\n"
        "    train, kwargs=dict(hidden=HIDDEN, epochs=EPOCHS, lr=2 * LR), counts=(1,), cpu=CPU,"
        " repeats=1\n"
        ")\n",
        "the doubled rate on 1 process, whose batch did not grow",
    ),
    (
        EXERCISE_4,
        LEARNER_4
        + SEARCH.format(inputs=WHAT_IF, overlap="")
        + f"k_ethernet = {ETHERNET}\nk_ndr = {NDR} + 1\n",
        "an accumulation over NDR that reaches 0.8 but is not the smallest",
    ),
    (
        EXERCISE_4,
        LEARNER_4
        + SEARCH.format(inputs=WHAT_IF, overlap="")
        + f"k_ethernet, k_ndr = {NDR}, {ETHERNET}\n",
        "the two links' answers swapped",
    ),
    (
        EXERCISE_4,
        LEARNER_4
        + SEARCH.format(inputs=WHAT_IF, overlap="overlap=False, ")
        + f"k_ethernet = {ETHERNET}\nk_ndr = {NDR}\n",
        "the what-if without overlap, which the question assumes",
    ),
    (
        EXERCISE_4,
        LEARNER_4
        + SEARCH.format(inputs="compute, grad_bytes", overlap="")
        + f"k_ethernet = {ETHERNET}\nk_ndr = {NDR}\n",
        "this lesson's model as measured, not the what-if's 100x network on 100x faster devices",
    ),
]
