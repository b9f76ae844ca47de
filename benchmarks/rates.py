"""The progress line's samples/s against a known truth: a paced run, the new window, the old one.

Two CPU workers run a loop that trains nothing and keeps time: step i starts no earlier than
its deadline (sleep until then), logs a loss and ``samples=BATCH`` through a
``Recorder(live=False)``, so each rank's true rate is the schedule's: RATE samples/s for the
first half of the run, RATE / 2 for the second (a phase change, to see how long the shown rate
takes to follow). Two schedules: "even" (every step the same length) and "uneven" (step
lengths drawn from a seeded distribution, 5% of them five times the mean, each half rescaled so
that its rate is still exact). The workers return their own clocks, to check they kept up.

From each run's records, at every samples-counter record time, as the launching side would
have it (the records up to that time), the headline the line shows: new, the library's
``Run.live_samples_per_s()`` (every rank's samples over its last ``RATE_WINDOW_S`` of records);
old, the sum over ranks of the rate between each rank's last two counter records (the
definition before issue 30, reimplemented here). Reported: the relative error against the
truth in steady state (median, 95th percentile, max), the signed bias, the lag after the phase
change, and the number shown once the run ended (new: ``Run.throughput()``, the training
window; old: the last interval's rate). Then the cost: microseconds per call of ``progress``,
of each rate and of ``Run.rates()`` (the panel's curves) on a 10-minute run's records built by
hand, interleaved.

    python benchmarks/rates.py [--repeats 5] [--seconds 12] [--cost-repeats 15] \
        [--out benchmarks/results/rates-cpu.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import nbaccel
from nbaccel import Run, notebook_launcher
from nbaccel.observe.channel import MIN_RATE_SPAN_S, RATE_WINDOW_S, SAMPLES, STEPS, Record
from nbaccel.observe.live.line import progress

BATCH = 32  # samples per step, per rank
RATE = 1600.0  # samples/s per rank in the first half (50 steps/s); the second half: RATE / 2
SCHEDULES = ("even", "uneven")
SETTLED = 0.10  # the lag ends when the shown rate stays within 10% of the new truth
KEPT_UP = 0.98  # a run whose achieved rate fell below 98% of the schedule is flagged


def paced(phases: list[tuple[float, float]], uneven: bool, seed: int) -> dict:
    """One rank's paced loop. ``phases``: ``[(seconds, samples/s), ...]``. Returns the schedule
    and this rank's own clock, in wall-clock seconds (the records' clock)."""
    import random
    import time

    from nbaccel import Recorder

    rank = int(os.environ["RANK"])
    rng = random.Random(seed * 100 + rank)
    slots = []  # per phase: each step's length in seconds
    for seconds, rate in phases:
        n = round(seconds * rate / BATCH)
        if uneven:  # a heavy tail (a slow batch, a collection), the phase's total kept exact
            draws = [5.0 if rng.random() < 0.05 else rng.uniform(0.5, 1.5) for _ in range(n)]
            slots.append([seconds / sum(draws) * d for d in draws])
        else:
            slots.append([seconds / n] * n)
    recorder = Recorder(live=False)
    wall0, t0 = time.time(), time.perf_counter()
    deadline, late, starts, step = t0, 0.0, [], 0  # starts: each phase's first step, actual
    for phase in slots:
        for i, length in enumerate(phase):
            time.sleep(max(deadline - time.perf_counter(), 0.0))
            now = time.perf_counter()
            late = max(late, now - deadline)
            if i == 0:
                starts.append(now)
            recorder.log({"loss": 1.0 / (1.0 + step)}, samples=BATCH)
            deadline += length
            step += 1
    time.sleep(max(deadline - time.perf_counter(), 0.0))  # the last step's slot
    end = time.perf_counter()
    recorder.close()
    bounds = [*starts, end]
    return {
        "rank": rank,
        "start": wall0,  # the schedule's phase boundaries, wall clock
        "switches": [wall0 + sum(s for s, _ in phases[: k + 1]) for k in range(len(phases))],
        "rates": [rate for _, rate in phases],
        "steps": [len(phase) for phase in slots],
        # achieved per phase, from this rank's own clock: its samples over the seconds from the
        # phase's first step to the next phase's (to the end of the last slot)
        "achieved": [
            len(phase) * BATCH / (b - a)
            for phase, a, b in zip(slots, bounds[:-1], bounds[1:], strict=True)
        ],
        "last_step": wall0 + (now - t0),
        "end": wall0 + (end - t0),
        "max_late_s": late,
    }


def launch(schedule: str, seconds: float, seed: int) -> tuple[Run, list[dict]]:
    run = Run()
    half = seconds / 2
    phases = [(half, RATE), (half, RATE / 2)]
    ranks = notebook_launcher(
        paced,
        args=(phases, schedule == "uneven", seed),
        num_processes=2,
        cpu=True,
        run=run,
        live=False,
        return_all=True,
    )
    return run, sorted(ranks, key=lambda r: r["rank"])


def old_samples_per_s(run: Run) -> float:
    """The progress line's rate before issue 30: every rank's rate between its last two
    samples-counter records, summed (``Run.samples_per_s`` then; the same private index)."""
    return sum(
        (rs[-1].value - rs[-2].value) / (rs[-1].time - rs[-2].time)
        for rs in run._by_rank(SAMPLES).values()
        if len(rs) > 1 and rs[-1].time > rs[-2].time
    )


def old_rates(run: Run) -> dict[int, tuple[list[float], list[float]]]:
    """``Run.rates()`` before issue 30: one point per counter interval."""
    out = {}
    for rank, rs in run._by_rank(SAMPLES).items():
        pairs = [
            (b.time - run.started, (b.value - a.value) / (b.time - a.time))
            for a, b in itertools.pairwise(rs)
            if b.time > a.time
        ]
        out[rank] = ([t for t, _ in pairs], [v for _, v in pairs])
    return out


def truth(ranks: list[dict], moment: float) -> float:
    """The schedule's samples/s, summed over ranks, at a wall-clock moment."""
    total = 0.0
    for r in ranks:
        begin = r["start"]
        for switch, rate in zip(r["switches"], r["rates"], strict=True):
            if begin <= moment < switch:
                total += rate
            begin = switch
    return total


def shown(run: Run) -> list[tuple[float, float | None, float]]:
    """``(time, new, old)`` at every samples-counter record, from the records up to it: the
    records are fed in time order to a fresh ``Run``, as the launching side receives them."""
    view = Run(world_size=run.world_size, started=run.started)
    out = []
    for record in sorted(run.records, key=lambda r: r.time):
        view.add([record])
        if record.name == SAMPLES:
            out.append((record.time, view.live_samples_per_s(), old_samples_per_s(view)))
    return out


def analyse(run: Run, ranks: list[dict]) -> dict:
    moments = shown(run)
    first_switch = min(r["switches"][0] for r in ranks)
    switch = max(r["switches"][0] for r in ranks)
    settled = RATE_WINDOW_S + 0.25  # the window reaches back to the record at least 3 s older
    last = min(r["last_step"] for r in ranks)
    steady = [
        (t, new, old)
        for t, new, old in moments
        if (max(r["start"] for r in ranks) + settled <= t < first_switch)
        or (switch + settled <= t <= last)
    ]
    out: dict = {"moments": len(moments), "steady_moments": len(steady)}
    for kind, column in (("new", 1), ("old", 2)):
        errors = [m[column] / truth(ranks, m[0]) - 1 for m in steady if m[column] is not None]
        absolute = sorted(abs(e) for e in errors)
        after = [
            (t, m[column] / truth(ranks, t))
            for m in moments
            if switch < (t := m[0]) <= last and m[column] is not None
        ]
        out[kind] = {
            "abs_error_median": statistics.median(absolute),
            "abs_error_p95": absolute[min(round(0.95 * (len(absolute) - 1)), len(absolute) - 1)],
            "abs_error_max": absolute[-1],
            "bias_median": statistics.median(errors),
            "lag_s": _lag(after, switch),
            "first_within_s": next((t - switch for t, x in after if abs(x - 1) <= SETTLED), None),
        }
    total = sum(sum(r["steps"]) * BATCH / (r["end"] - r["start"]) for r in ranks)  # schedule
    achieved = [a / rate for r in ranks for a, rate in zip(r["achieved"], r["rates"], strict=True)]
    final_rate = truth(ranks, last)
    run_line = progress(run)
    new_final, old_final = run.throughput(), old_samples_per_s(run)
    assert new_final is not None and f"{new_final:,.0f} samples/s (training window" in run_line
    counted = run._by_rank(SAMPLES)
    out["final"] = {
        "truth_run": total,
        "truth_at_end": final_rate,
        "new_throughput": new_final,
        "new_ratio": new_final / total,
        "old_last_interval": old_final,
        "old_ratio": old_final / total,
        "old_ratio_to_end_rate": old_final / final_rate,
        "last_interval_s": {
            rank: rs[-1].time - rs[-2].time for rank, rs in counted.items() if len(rs) > 1
        },
        "training_window_s": run.timing().training,
        "line": run_line,
    }
    out["kept_up"] = {
        "achieved_over_schedule_min": min(achieved),
        "max_late_ms": 1000 * max(r["max_late_s"] for r in ranks),
        "flagged": min(achieved) < KEPT_UP,
        "start_skew_ms": 1000 * (max(r["start"] for r in ranks) - min(r["start"] for r in ranks)),
    }
    return out


def _lag(after: list[tuple[float, float]], switch: float) -> float | None:
    """Seconds from the phase change to the first moment from which the shown rate stays
    within ``SETTLED`` of the truth; None if it never does."""
    settled_at = None
    for t, ratio in after:
        if abs(ratio - 1) > SETTLED:
            settled_at = None
        elif settled_at is None:
            settled_at = t
    return None if settled_at is None else settled_at - switch


# The cost of the line on a long run --------------------------------------------------------


def long_run(seconds: float, ranks: int = 2, per_s: float = 4.0, steps_per_s: float = 20.0) -> Run:
    """A run's records built by hand: per rank, samples and optimizer-step counters ``per_s``
    times a second and a loss every step, interleaved in time order; still going."""
    run = Run(world_size=ranks, started=0.0)
    counters = [
        Record(rank, i, 1.0 + i / per_s + 0.003 * rank, name, value)
        for i in range(int(seconds * per_s))
        for rank in range(ranks)
        for name, value in (
            (SAMPLES, BATCH * steps_per_s * i / per_s + BATCH),
            (STEPS, steps_per_s * i / per_s + 1),
        )
    ]
    losses = [
        Record(rank, s, 1.0 + s / steps_per_s + 0.001 * rank, "loss", 1 / (1 + s))
        for s in range(int(seconds * steps_per_s))
        for rank in range(ranks)
    ]
    run.add(sorted(counters + losses, key=lambda r: r.time))
    return run


def cost(repeats: int) -> dict:
    """Microseconds per call on a 10-minute run and a 10-second one, interleaved: each repeat
    times every (length, call) once, in an order that rotates; medians over the repeats."""
    runs = {"10 min": long_run(600.0), "10 s": long_run(10.0)}
    now = {name: run.records[-1].time for name, run in runs.items()}
    calls = {
        "progress (new line)": lambda run, name: progress(run, now=now[name]),
        "new rate: live_samples_per_s": lambda run, name: run.live_samples_per_s(),
        "old rate: last interval": lambda run, name: old_samples_per_s(run),
        "new rates(), first draw": lambda run, name: Run(
            world_size=run.world_size, started=run.started, records=run.records
        ).rates(),
        "new rates(), redraw": lambda run, name: run.rates(),
        "old rates() (one point per interval)": lambda run, name: old_rates(run),
    }
    cases = [(length, call) for length in runs for call in calls]
    batch = {}
    for case in cases:  # warm up (the index is built once) and size each batch to ~20 ms
        length, call = case
        n, spent = 1, 0.0
        while spent < 0.02:
            n *= 2
            start = time.perf_counter()
            for _ in range(n):
                calls[call](runs[length], length)
            spent = time.perf_counter() - start
        batch[case] = n
    us: dict = {case: [] for case in cases}
    for i in range(repeats):
        for case in cases[i % len(cases) :] + cases[: i % len(cases)]:
            length, call = case
            f, run, n = calls[call], runs[length], batch[case]
            start = time.perf_counter()
            for _ in range(n):
                f(run, length)
            us[case].append(1e6 * (time.perf_counter() - start) / n)
    return {"repeats": repeats} | {
        length: {
            "samples_records_per_rank": len(runs[length]._by_rank(SAMPLES)[0]),
            "records": len(runs[length].records),
            "us_per_call": {call: statistics.median(us[length, call]) for call in calls},
            "us_quartiles": {call: statistics.quantiles(us[length, call], n=4) for call in calls},
        }
        for length in runs
    }


def _brief(got: dict) -> str:
    new, old, final = got["new"], got["old"], got["final"]

    def lag(s: float | None) -> str:
        return "never" if s is None else f"{s:.2f} s"

    return (
        f"steady |error| median new {new['abs_error_median']:.3f} old "
        f"{old['abs_error_median']:.3f}; lag new {lag(new['lag_s'])} old {lag(old['lag_s'])}; "
        f"final / truth new {final['new_ratio']:.4f} old {final['old_ratio']:.3f}"
        + ("; FELL BEHIND" if got["kept_up"]["flagged"] else "")
    )


# Report ------------------------------------------------------------------------------------


def summary(runs: list[dict]) -> dict:
    """Medians over the repeats of each run's figures."""
    out: dict = {}
    for kind in ("new", "old"):
        out[kind] = {
            key: statistics.median(r[kind][key] for r in runs)
            for key in ("abs_error_median", "abs_error_p95", "abs_error_max", "bias_median")
        }
        for key in ("lag_s", "first_within_s"):  # a run that never did counts as the longest
            got = [r[kind][key] for r in runs]
            middle = statistics.median(x if x is not None else float("inf") for x in got)
            out[kind][key + "_median"] = None if middle == float("inf") else middle
            out[kind][key + "_never"] = got.count(None)
    final = [r["final"] for r in runs]
    for key in ("new_ratio", "old_ratio", "old_ratio_to_end_rate"):
        out[key] = statistics.median(f[key] for f in final)
        out[key + "_range"] = [min(f[key] for f in final), max(f[key] for f in final)]
    out["flagged_runs"] = sum(r["kept_up"]["flagged"] for r in runs)
    out["achieved_over_schedule_min"] = min(
        r["kept_up"]["achieved_over_schedule_min"] for r in runs
    )
    out["max_late_ms"] = max(r["kept_up"]["max_late_ms"] for r in runs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=12.0, help="per run, two halves")
    parser.add_argument("--cost-repeats", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/results/rates-cpu.json")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    launch("even", 1.0, seed=0)  # warm up: the fork server, imports
    runs: dict[str, list[dict]] = {schedule: [] for schedule in SCHEDULES}
    for i in range(args.repeats):
        order = SCHEDULES if i % 2 == 0 else SCHEDULES[::-1]
        for schedule in order:
            run, ranks = launch(schedule, args.seconds, seed=i + 1)
            got = analyse(run, ranks)
            got["repeat"] = i
            runs[schedule].append(got)
            print(f"repeat {i}, {schedule}: {_brief(got)}", flush=True)
    print("timing the calls ...", flush=True)
    calls = cost(args.cost_repeats)
    result = {
        "machine": {
            "cpu": _cpu_model(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "nbaccel": _revision(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "load_1min": {"before": load_before, "after": os.getloadavg()[0]},
            "note": "shared 2-core machine, not idle",
        },
        "setup": {
            "ranks": 2,
            "batch": BATCH,
            "rate_per_rank": [RATE, RATE / 2],
            "seconds": args.seconds,
            "repeats": args.repeats,
            "rate_window_s": RATE_WINDOW_S,
            "min_rate_span_s": MIN_RATE_SPAN_S,
            "settled_within": SETTLED,
        },
        "schedules": {schedule: summary(got) for schedule, got in runs.items()},
        "runs": runs,
        "cost": calls,
    }
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out} and {out.with_suffix('.md')}")


def markdown(result: dict) -> str:
    m, s = result["machine"], result["setup"]
    rows = []
    for schedule, got in result["schedules"].items():
        for kind, name in (
            ("new", f"new: last {s['rate_window_s']:.0f} s"),
            ("old", "old: last interval"),
        ):
            k = got[kind]
            first, lag = (_seconds(k, key, s["repeats"]) for key in ("first_within_s", "lag_s"))
            final = got["new_ratio" if kind == "new" else "old_ratio"]
            lo, hi = got[("new_ratio" if kind == "new" else "old_ratio") + "_range"]
            rows.append(
                f"| {schedule} | {name} | {100 * k['abs_error_median']:.1f}% "
                f"| {100 * k['abs_error_p95']:.1f}% | {100 * k['abs_error_max']:.1f}% "
                f"| {100 * k['bias_median']:+.1f}% | {first} | {lag} "
                f"| **{final:.4f}** ({lo:.4f}-{hi:.4f}) |"
            )
    kept = "; ".join(
        f"{schedule}: lowest achieved/schedule {got['achieved_over_schedule_min']:.3f}, latest "
        f"step start {got['max_late_ms']:.1f} ms after its deadline, {got['flagged_runs']} run(s) "
        "flagged"
        for schedule, got in result["schedules"].items()
    )
    old_end = "; ".join(
        f"{schedule} {got['old_ratio_to_end_rate']:.3f}"
        for schedule, got in result["schedules"].items()
    )
    cost_rows = []
    lengths = [n for n in result["cost"] if n != "repeats"]
    for call in result["cost"][lengths[0]]["us_per_call"]:
        cells = " | ".join(f"{result['cost'][n]['us_per_call'][call]:,.1f}" for n in lengths)
        cost_rows.append(f"| {call} | {cells} |")
    records = ", ".join(
        f"{n}: {c['samples_records_per_rank']:,} samples records per rank, {c['records']:,} in all"
        for n, c in result["cost"].items()
        if n != "repeats"
    )
    half = s["seconds"] / 2
    steps = round(half * (s["rate_per_rank"][0] + s["rate_per_rank"][1]) / s["batch"])
    even, uneven = result["schedules"]["even"], result["schedules"]["uneven"]
    long_cost, short_cost = (result["cost"][n]["us_per_call"] for n in lengths)
    curves = [
        c["new rates(), redraw"] / c["old rates() (one point per interval)"]
        for c in (long_cost, short_cost)
    ]
    skew = max(r["kept_up"]["start_skew_ms"] for runs in result["runs"].values() for r in runs)
    err = {kind: 100 * uneven[kind]["abs_error_median"] for kind in ("new", "old")}
    bias = {kind: 100 * uneven[kind]["bias_median"] for kind in ("new", "old")}
    noise = {
        name: [schedule_noise(span, rate) for rate in s["rate_per_rank"]]
        for name, span in (("window", s["rate_window_s"]), ("interval", 0.25))
    }
    return f"""# The progress line's samples/s against a known truth (CPU)

CPU: {m["cpu"]}, {m["cores"]} cores ({m["note"]}); Python {m["python"]}; torch {m["torch"]};
nbaccel {m["nbaccel"]}; {m["date"]}; 1-min load {m["load_1min"]["before"]:.1f} before,
{m["load_1min"]["after"]:.1f} after.
Setup: {s["ranks"]} CPU workers through `notebook_launcher`, each a loop paced by a deadline
clock, `Recorder.log(..., samples={s["batch"]})` per step: {s["rate_per_rank"][0]:,.0f} samples/s
per rank for {half:.0f} s, then {s["rate_per_rank"][1]:,.0f} for {half:.0f} s (true total
{2 * s["rate_per_rank"][0]:,.0f}, then {2 * s["rate_per_rank"][1]:,.0f}); "even": every step the
same length, "uneven": seeded step lengths, 5% of them 5x the mean, each half's rate exact.
{s["repeats"]} repeats, the two schedules interleaved; figures are medians over the repeats.

At every samples-counter record, from the records up to it, the headline the line would show:
new, `Run.live_samples_per_s()` (every rank over its last {s["rate_window_s"]:.0f} s of records);
old, the sum of each rank's rate between its last two counter records (before issue 30). (A
notebook gets the records up to a quarter second late, in batches: not modelled here.)
Error: |shown / truth - 1| in steady state (the window wholly inside one half); bias: the median
signed error; after the change of rate (to half), the seconds until the shown rate first comes
within {100 * s["settled_within"]:.0f}% of the new truth, and until it stays there (the lag; a
run where it never does counts as the longest); final: the number shown once the run ended
(new: `Run.throughput()`, the training window; old: the last interval's rate) over the run's true
mean rate.

| schedule | shown | error median | p95 | max | bias | within 10% | stays within | final / truth |
|---|---|---:|---:|---:|---:|---:|---:|---:|
{chr(10).join(rows)}

The old final number against the true rate at the end (the second half's) instead of the run's
mean: {old_end}. Kept up (the workers' own clocks): {kept}.

## Reading it

- "even" is the old definition's best case: a loop paced to the microsecond makes every counter
  interval exact, so both read the truth there. Training loops have uneven steps; "uneven" is the
  comparison that matters.
- Under uneven steps the true rate itself varies over a short span, and that variation is the
  error against the half's rate. Predicted from the step distribution alone (median
  |error|, 2 ranks): {100 * noise["window"][0]:.1f}-{100 * noise["window"][1]:.1f}% over
  {s["rate_window_s"]:.0f} s, {100 * noise["interval"][0]:.0f}-{100 * noise["interval"][1]:.0f}%
  over one quarter-second interval (first half - second half); measured: new {err["new"]:.1f}%,
  old {err["old"]:.1f}%. The median signed errors (bias): new {bias["new"]:+.1f}%, old
  {bias["old"]:+.1f}%.
- The window's price is its lag. A rate that halves reads within 10% once at most 10% of the
  window still holds the old rate: about {0.9 * s["rate_window_s"]:.1f}-{s["rate_window_s"]:.1f} s
  (the window reaches back to the record at least {s["rate_window_s"]:.0f} s older); the old
  definition comes within 10% after one interval, and under uneven steps it stays within 10%
  {_seconds(uneven["old"], "lag_s", s["repeats"])} after the change (the second half lasts
  {half:.0f} s).
- The final number: the training window (first to last samples-counter record) holds every
  sample counted. Its one edge: a step counted at its start (as here, and as a prepared
  DataLoader counts a batch handed out) whose end is never recorded, because the last `log`
  recorded the counters and `close` found nothing new, leaves that step's time out of the
  window: at most one step, +1/(steps - 1) ({steps} steps per rank here:
  +{100 / (steps - 1):.2f}% at most); measured {_span(even["new_ratio_range"], 4)} (even) and
  {_span(uneven["new_ratio_range"], 4)} (uneven) of the truth, the window running from the first
  rank's first record to the last rank's last (the ranks started up to {skew:.1f} ms apart).
  The old final number was whatever the last interval held;
  here the closing record's interval holds one step's slot more than its steps (the samples were
  counted at each step's start, the closing record came at the last slot's end), so it read
  {_span(even["old_ratio_to_end_rate_range"])}x the rate at the end in the even runs and
  {_span(uneven["old_ratio_to_end_rate_range"])}x in the uneven ones (about half the run's mean,
  since the run had slowed); an interval that ends just after a
  batch was counted reads high instead, as the 1.6x of issue 30 did.

## What it costs

Microseconds per call (median of {result["cost"]["repeats"]} interleaved
repeats' per-call means; records built by hand, 2 ranks, counters 4 a second, a loss every step
at 20 steps/s; {records}):

| call | {" | ".join(lengths)} |
|---|{"---:|" * len(lengths)}
{chr(10).join(cost_rows)}

The line's cost does not grow with the run: `progress` reads each rank's latest records and
binary-searches the window's start, {long_cost["new rate: live_samples_per_s"]:.1f} us against
{long_cost["old rate: last interval"]:.1f} us for the last interval, within a
{long_cost["progress (new line)"]:.0f}-us line. The panel's curves: `Run.rates()`
computes each windowed point once (a binary search each) and keeps it, since a point depends
only on the records before it. A first draw of 10 minutes of records (the index built too) costs
{long_cost["new rates(), first draw"] / 1000:.1f} ms; each redraw after it computes only the new
points and copies the curves, {long_cost["new rates(), redraw"] / 1000:.2f} ms, against
{long_cost["old rates() (one point per interval)"] / 1000:.2f} ms for the old per-interval curves
recomputed every time ({curves[0]:.1f}x; at 10 s: {curves[1]:.1f}x);
the panel redraws at most once a second.

CPU figures only; no GPU was available to this run.
"""


def _span(low_high: list[float], digits: int = 2) -> str:
    low, high = (f"{x:.{digits}f}" for x in low_high)
    return low if low == high else f"{low}-{high}"


def _seconds(figures: dict, key: str, repeats: int) -> str:
    middle, never = figures[key + "_median"], figures[key + "_never"]
    text = "never" if middle is None else f"{middle:.2f} s"
    return text + (f" ({never} of {repeats} never)" if never else "")


def schedule_noise(window: float, rate: float) -> float:
    """The "uneven" schedule's own variation: the expected median |relative error| of the
    true samples/s over ``window`` seconds at ``rate`` per rank, 2 ranks, against the phase's
    rate (normal approximation). Steps: 95% uniform(0.5, 1.5), 5% at 5, rescaled."""
    mean = 0.95 * 1.0 + 0.05 * 5.0
    variance = 0.95 * (1.0 + 1 / 12) + 0.05 * 25.0 - mean**2
    steps = window * rate / BATCH
    return 0.6745 * (variance**0.5 / mean) / (2 * steps) ** 0.5


def _revision() -> str:
    """The commit measured; "-dirty" when ``nbaccel/observe`` (the code measured) differs."""
    package = Path(nbaccel.__file__).resolve().parent
    git = ["git", "-C", str(package)]
    try:
        out = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", "observe"]).returncode
    except OSError:
        return "unknown"
    return out.stdout.strip() + "-dirty" * (dirty != 0) if out.returncode == 0 else "unknown"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
