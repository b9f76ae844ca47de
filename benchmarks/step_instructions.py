"""How many instructions does nbaccel add to a training step? Counted, not timed.

``overhead.py`` times nbaccel's step against raw PyTorch's; this counts the instructions the
two execute, with Valgrind's callgrind, which makes a count that the machine's load cannot move:
one run is the answer. The loops are ``overhead.py``'s (an MLP 512 wide, batch 64, SGD, one
thread), in "plain" and "accumulation 4" mode. Not in bf16: under Valgrind the CPU does not
announce its bf16 instructions, so oneDNN runs its reference kernels instead, another step.

In one process under callgrind, each variant ("raw", "nbaccel", "raw again") is built, warmed up
for ``WARM`` steps, and only its next ``--steps`` steps are counted: a small C helper, compiled
here, turns the counting on and off around them (callgrind's client requests) and writes one
count per variant. nbaccel's recorder does no periodic work in the counted steps (under Valgrind
a quarter second passes in a few steps, and in a normal run that work is 4 times a second, well
under 0.1% of the loop). "raw again" shows how far two counts of the same loop differ.

Together with ``overhead.py``'s times: what nbaccel adds is a share of the step's instructions,
and a larger share of its time, because its Python runs between operators whose tensors (4 MiB
of weights and gradients) have pushed it out of the core's caches.

Needs ``valgrind`` and a C compiler (Debian: ``apt-get install valgrind gcc``); it takes about
20 minutes (one core).

    python benchmarks/step_instructions.py [--steps 20]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("plain", "accumulation 4")
VARIANTS = ("raw", "nbaccel", "raw again")
WARM = 12  # steps before the counted ones: the allocator, autograd's graph, Python's caches
HELPER = """#include <valgrind/callgrind.h>
void toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""


def child(steps: int, helper: str) -> None:
    """Under callgrind: count each variant's ``steps`` steps, one dump per variant."""
    import torch

    sys.path.insert(0, str(HERE))
    import overhead

    counter = ctypes.CDLL(helper)
    torch.set_num_threads(1)
    for mode in MODES:
        accum, precision = overhead.MODES[mode]
        for name in VARIANTS:
            # one pass, longer than needed: its end (which brings the recorder's periodic work
            # forward) falls after the counted steps
            batches = 4 * (WARM + steps)
            if name == "nbaccel":
                loop = overhead.nbaccel_loop(batches, accum, precision)
                recorder = loop.gi_frame.f_locals["accelerator"].recorder
                recorder.next_tick = float("inf")  # no periodic work in the counted steps
            else:
                loop = overhead.raw(batches, accum, precision)
            for _ in range(WARM):
                next(loop)
            counter.toggle()
            for _ in range(steps):
                next(loop)
            counter.toggle()
            counter.dump(f"{mode}|{name}".encode())
    os._exit(0)  # the counts are written; nothing of the exit needs counting


def count(steps: int) -> dict:
    """Run ``child`` under callgrind; the instructions per step of each mode and variant."""
    with tempfile.TemporaryDirectory(prefix="nbaccel-instructions-") as folder:
        source, helper = Path(folder, "counter.c"), Path(folder, "counter.so")
        source.write_text(HELPER)
        subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", helper, source], check=True)
        command = [
            *("valgrind", "--tool=callgrind", "--collect-atstart=no"),
            f"--callgrind-out-file={folder}/callgrind.out",
            *(sys.executable, __file__, "--child", str(steps), "--helper", str(helper)),
        ]
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1")  # no idle BLAS threads to count
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
        counts: dict[str, dict[str, float]] = {mode: {} for mode in MODES}
        for dump in Path(folder).glob("callgrind.out.*"):
            text = dump.read_text(errors="replace")
            label = re.search(r"^desc: Trigger: Client Request: (.*)$", text, re.M)
            total = re.search(r"^(?:totals|summary): (\d+)", text, re.M)
            if label and total:
                mode, name = label.group(1).split("|")
                counts[mode][name] = int(total.group(1)) / steps
    missing = [f"{m}: {v}" for m in MODES for v in VARIANTS if v not in counts[m]]
    if missing:
        sys.exit(f"callgrind wrote no count for {', '.join(missing)}")
    return counts


def to_markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"CPU: {m['cpu']}, {m['cores']} cores; torch.set_num_threads(1); torch {m['torch']}; "
        f"Python {m['python']}; nbaccel {m['nbaccel']}; {m['date']}; {m['valgrind']}.",
        f"`overhead.py`'s loop; {report['steps']} steps counted per variant after {WARM} "
        "not counted. Instructions per step (all of the process's, Python's and torch's).",
        "",
        "| mode | raw | nbaccel | nbaccel adds | share of raw's step | raw again |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, c in report["counts"].items():
        added = c["nbaccel"] - c["raw"]
        lines.append(
            f"| {mode} | {c['raw']:,.0f} | {c['nbaccel']:,.0f} | {added:,.0f} | "
            f"{added / c['raw']:.2%} | {c['raw again'] - c['raw']:+,.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps counted per variant")
    parser.add_argument("--out", default=str(HERE / "results" / "step-instructions-cpu.json"))
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--helper", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.helper)
        return
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    for tool in ("valgrind", "cc"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} not found: install valgrind and a C compiler (apt-get install "
                     "valgrind gcc) to count instructions")  # fmt: skip
    sys.path.insert(0, str(HERE))
    from overhead import machine, write

    info = machine(1)
    info["valgrind"] = subprocess.run(
        ["valgrind", "--version"], capture_output=True, text=True
    ).stdout.strip()
    report = {"machine": info, "steps": args.steps, "counts": count(args.steps)}
    write(Path(args.out), report, to_markdown(report), "Instructions per training step")


if __name__ == "__main__":
    main()
