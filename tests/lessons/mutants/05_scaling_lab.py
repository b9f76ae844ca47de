"""Plausible mistakes that lesson 5's checks must catch (tests/lessons/test_exercises.py)."""

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
    # wrong answers to the exercises
    (
        "# Check: exercise 1: `wide` measured the 4x wider model at every process count",
        "wide = scaling",
        "section 3's measurement, at hidden=HIDDEN, given as the wide model's",
    ),
    (
        "# Check: exercise 2: the predicted bytes, and the 1-epoch run that measures them",
        "predicted_bytes = 2 * predicted_bytes",
        "the bytes of both processes together, not of one",
    ),
    (
        "# Check: exercise 3: `scaled` trained on 2 processes with twice the learning rate",
        "scaled = scaling",
        "the 2-process run at the unscaled learning rate",
    ),
    (
        "# Check: exercise 4: the answers are the smallest accumulations that reach the efficiency",
        "k_ndr = k_ndr + 1",
        "an accumulation that reaches 0.8 but is not the smallest",
    ),
]
