"""Hugging Face Accelerate's own unit tests, run against nbaccel with only their imports changed.

Accelerate's test files are not installed with the package; they come with its source
distribution on the package index. ``sdist()`` fetches the pinned one (``constraints.txt``'s
version) with pip, once, into a cache (``$NBACCEL_CACHE``, else ``~/.cache/nbaccel``); nothing
of them is copied into this repository.

``prepare()`` unpacks the sdist's ``tests/`` folder twice into a working folder:
as published (``control/``), and ``port/`` with the eleven files of ``FILES`` rewritten by
``accelerate_scripts.rewrite_imports`` (the one import rule the script cases use: a name
comes from ``nbaccel`` or ``nbaccel.utils`` where nbaccel has it, else stays Accelerate's;
``accelerate.test_utils`` stays Accelerate's because nbaccel has none of its names). ``run()``
runs each side's files with pytest in a CPU process of its own, the sides at the same time;
``units_probe.py``, a pytest plugin,
writes each test's outcome and whether its body ran nbaccel's code.

    python -m tests.compat.accelerate_units            # both sides, then what differs
    python -m tests.compat.accelerate_units -k save    # only tests whose id contains it
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .accelerate_scripts import rewrite_imports

ROOT = Path(__file__).resolve().parents[2]
FILES = (
    "test_accelerator",
    "test_state_checkpointing",
    "test_data_loader",
    "test_scheduler",
    "test_optimizer",
    "test_kwargs_handlers",
    "test_tracking",
    "test_grad_sync",
    "test_memory_utils",
    "test_logging",
    "test_utils",
)
RUN_SECONDS = 1500  # one side's run; it catches a hang, not slowness


def pinned_version() -> str:
    text = (ROOT / "constraints.txt").read_text()
    match = re.search(r"^accelerate==(\S+)$", text, re.M)
    if match is None:
        raise RuntimeError("constraints.txt pins no accelerate version")
    return match.group(1)


def cache_folder() -> Path:
    folder = os.environ.get("NBACCEL_CACHE") or Path.home() / ".cache" / "nbaccel"
    return Path(folder)


def sdist(version: str | None = None) -> Path:
    """The pinned Accelerate source distribution, fetched by pip on first use."""
    version = version or pinned_version()
    name = f"accelerate-{version}.tar.gz"
    cached = cache_folder() / name
    if cached.exists():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent) as into:
        command = [sys.executable, "-m", "pip", "download", f"accelerate=={version}"]
        command += ["--no-binary", ":all:", "--no-deps", "--quiet", "--dest", into]
        subprocess.run(command, check=True, timeout=600)
        os.replace(Path(into) / name, cached)  # whole or not at all
    return cached


def prepare(folder: Path) -> dict[str, Path]:
    """Unpack the sdist's tests into ``folder``: the control and the port, by side."""
    archive = sdist()
    sides = {"accelerate": folder / "control", "nbaccel": folder / "port"}
    with tarfile.open(archive) as tar:
        prefix = tar.getnames()[0].split("/")[0] + "/tests/"
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.isfile()]
        for side in sides.values():
            for member in members:
                target = side / member.name[len(prefix) :]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
    for name in FILES:
        path = sides["nbaccel"] / f"{name}.py"
        path.write_text(rewrite_imports(path.read_text())[0])
    return sides


@dataclass(frozen=True)
class Result:
    id: str  # "test_accelerator.py::AcceleratorTester::test_save_model_0"
    outcome: str  # passed, failed, skipped
    message: str = ""
    nbaccel: bool = False  # the test's own body called into nbaccel (units_probe.py)


def run(*sides: Path, select: str | None = None) -> list[dict[str, Result]]:
    """Each test's outcome, by side, when each side's files run with pytest in one CPU process.
    The sides run at the same time, one process each."""
    processes = [_start(side, select) for side in sides]
    try:
        for process in processes:
            process.wait(timeout=RUN_SECONDS)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return [_read(side) for side in sides]


def _start(side: Path, select: str | None) -> subprocess.Popen:
    report = side / "report.jsonl"
    report.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "NBACCEL_"))}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", NBACCEL_UNITS_REPORT=str(report))
    env["PYTHONPATH"] = os.pathsep.join([str(side), str(ROOT)])
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-p", "no:nbval"]
    command += ["-p", "tests.compat.units_probe", "--rootdir", str(side), "-c", os.devnull]
    if select:
        command += ["-k", select]
    command += [f"{name}.py" for name in FILES]
    return subprocess.Popen(command, cwd=side, env=env, stdout=subprocess.DEVNULL)


def _read(side: Path) -> dict[str, Result]:
    report = side / "report.jsonl"
    results = {}
    for line in report.read_text().splitlines() if report.exists() else []:
        result = Result(**json.loads(line))
        results[result.id] = result
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-k", dest="select", help="only the tests whose id matches (pytest -k)")
    parser.add_argument("--side", choices=("both", "nbaccel"), default="both")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it")
    args = parser.parse_args(argv)
    folder = args.keep or Path(tempfile.mkdtemp(prefix="nbaccel-units-"))
    try:
        sides = prepare(folder)
        if args.side == "both":
            ours, theirs = run(sides["nbaccel"], sides["accelerate"], select=args.select)
        else:
            (ours,), theirs = run(sides["nbaccel"], select=args.select), {}
        control = [i for i, r in theirs.items() if r.outcome == "passed"] or list(ours)
        passed = [i for i in control if i in ours and ours[i].outcome == "passed"]
        for test_id in control:
            result = ours.get(test_id)
            if result is None or result.outcome != "passed":
                why = result.message if result else "not run"
                print(f"FAIL {test_id}: {why.splitlines()[0] if why else ''}")
        body = sum(ours[i].nbaccel for i in passed)
        print(f"nbaccel passes {len(passed)} of the {len(control)} tests Accelerate passes")
        print(f"in {body} of the {len(passed)}, nbaccel's code ran in the test's own body")
    finally:
        if args.keep is None:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
