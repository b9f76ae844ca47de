"""Hugging Face Accelerate's own test scripts, run against nbaccel with only their imports changed.

The scripts ship inside the installed ``accelerate`` package (``accelerate/test_utils/scripts/``);
they are read from there at run time and never copied into this repository. The cases counted
are the 63 of ``../shared/ACCELERATE-CASES.md`` (issue 32): the ones Accelerate 1.15 itself
passes on 2 CPU processes.

The import rule. Only ``import`` statements of ``accelerate`` modules change, and each imported
name on its own: ``from accelerate.X import name`` becomes ``from nbaccel import name`` or
``from nbaccel.utils import name`` when that module has ``name`` (``getattr`` at run time, so a
name nbaccel gains later is picked up without touching this file), and otherwise stays
Accelerate's. A name imported from ``accelerate.utils...`` looks in ``nbaccel.utils`` first, any
other in ``nbaccel`` first. Private names and modules (``nbaccel.utils`` itself imports ``torch``)
never map. So ``Accelerator``, ``DataLoaderConfiguration`` or ``gather`` come from nbaccel, and
``RegressionModel``, ``assert_exception`` or any name nbaccel lacks (``AcceleratorState`` today)
from Accelerate. A rewritten statement keeps its line count, so the line numbers of a traceback
are those of the installed script.

How a case runs. One case is one test function with one parametrisation, called as the script's
``main()`` calls it, after the prelude: what ``main()`` runs before its tests (usually
``accelerator = Accelerator()``). To spare launches, the cases of one script run in order in one
launch of ``nbaccel launch -n 2 --cpu`` (``case_runner.py`` is the script it runs, in a temporary
folder with the rewritten script), each reported on its own. When a case fails, that launch
stops after it, and the case runs again first in a fresh launch, right after the prelude, as
ACCELERATE-CASES.md runs every case: only that result counts. The cases after it continue in the
same fresh launch. So a failure is always measured alone, and a case that fails only after
another one is reported as passing, with a note naming the one it followed. ``test_notebook``'s
cases call ``notebook_launcher`` themselves: they run the same way in one plain parent process,
with ``ACCELERATE_NUM_PROCESSES=2``. A case passes when every rank ends it without an exception;
a launch where no rank makes progress for ``HANG_SECONDS`` is stopped, and the running case
fails as hung.

    python -m tests.compat.accelerate_scripts                 # every case, then a table
    python -m tests.compat.accelerate_scripts --case test_ops  # cases whose id contains it
    python -m tests.compat.accelerate_scripts --imports        # the rewritten imports only
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

HANG_SECONDS = 120  # a case during which no rank reports anything for this long is hung
RUNNER = Path(__file__).with_name("case_runner.py")
NUM_PROCESSES = 2


@dataclass(frozen=True)
class Case:
    """One test function with one parametrisation; ``code`` calls it as ``main()`` does."""

    script: str  # "test_sync"
    name: str  # "test_gradient_accumulation[split=0,dispatch=0,sync_each=0]"
    function: str  # the script's function that must exist for the case to exist
    code: str

    @property
    def id(self) -> str:
        return f"{self.script}::{self.name}"


# What each script's main() runs before its first test, in the names main() gives it.
PRELUDES = {
    "test_sync": "accelerator = Accelerator()\nstate = accelerator.state",
    "test_ops": "state = PartialState()\nstate.print(f'State: {state}')",
    "test_distributed_data_loop": (
        "accelerator = create_accelerator()\ntorch.manual_seed(accelerator.process_index)"
    ),
    "test_script": "accelerator = Accelerator()\nstate = accelerator.state",
    "test_notebook": "",
}
IN_PARENT = {"test_notebook"}  # its cases call notebook_launcher from one process


def _call(script: str, function: str, args: str = "", name: str | None = None) -> Case:
    return Case(script, name or function, function, f"{function}({args})")


def _flags() -> list[tuple[int, int, int]]:
    return list(itertools.product((0, 1), repeat=3))


def _loader_case(name: str, make_loader: str) -> Case:
    code = f"dataset = DummyDataset()\n{make_loader}\ntest_data_loader(loader, accelerator)"
    return Case("test_distributed_data_loop", name, "test_data_loader", code)


def _case_table() -> list[Case]:
    sync = [
        Case("test_sync", "main_prelude", "main", ""),
        _call("test_sync", "test_dataloader_break"),
        _call("test_sync", "test_distributed_sync", "accelerator"),
        _call("test_sync", "test_distributed_sync_multiple_fwd", "accelerator"),
    ]
    for function in (
        "test_gradient_accumulation",
        "test_gradient_accumulation_with_opt_and_scheduler",
    ):
        for split, dispatch, each in _flags():
            name = f"{function}[split={split},dispatch={dispatch},sync_each={each}]"
            args = f"{bool(split)}, {bool(dispatch)}, {bool(each)}"
            sync.append(_call("test_sync", function, args, name))
    ops = [
        _call("test_ops", f, "state")
        for f in (
            "test_gather",
            "test_gather_object",
            "test_gather_non_contiguous",
            "test_broadcast",
            "test_pad_across_processes",
            "test_reduce_sum",
            "test_reduce_mean",
            "test_reduce_max",
            "test_op_checker",
            "test_copy_tensor_to_devices",
        )
    ]
    batch_sampler = (
        "sampler = BatchSampler(RandomSampler(dataset), batch_size=BATCH_SIZE, drop_last=False)"
    )
    loop = [
        Case("test_distributed_data_loop", "main_prelude", "main", ""),
        _call("test_distributed_data_loop", "test_default_ensures_even_batch_sizes"),
        _call("test_distributed_data_loop", "test_can_disable_even_batches"),
        Case(
            "test_distributed_data_loop",
            "test_join_raises_warning_for_non_ddp_distributed",
            "test_join_raises_warning_for_non_ddp_distributed",
            "original_state = accelerator.state.distributed_type\n"
            "accelerator.state.distributed_type = DistributedType.FSDP\n"
            "test_join_raises_warning_for_non_ddp_distributed(accelerator)\n"
            "accelerator.state.distributed_type = original_state",
        ),
        _call("test_distributed_data_loop", "test_pickle_accelerator"),
        _loader_case(
            "test_data_loader[shuffle=False]",
            "loader = DataLoader(dataset, shuffle=False, batch_size=BATCH_SIZE, "
            "num_workers=NUM_WORKERS)",
        ),
        _loader_case(
            "test_data_loader[shuffle=True]",
            "loader = DataLoader(dataset, shuffle=True, batch_size=BATCH_SIZE, "
            "num_workers=NUM_WORKERS)",
        ),
        _loader_case(
            "test_data_loader[batch_sampler]",
            f"{batch_sampler}\n"
            "loader = DataLoader(dataset, batch_sampler=sampler, num_workers=NUM_WORKERS)",
        ),
        _loader_case(
            "test_data_loader[sampler=BatchSampler]",
            f"{batch_sampler}\nloader = DataLoader(dataset, sampler=sampler, batch_size=None, "
            "collate_fn=default_collate, num_workers=NUM_WORKERS)",
        ),
    ]
    script = [Case("test_script", "main_prelude", "main", "")]
    script += [
        _call("test_script", f)
        for f in (
            "init_state_check",
            "process_execution_check",
            "test_split_between_processes_list",
            "test_split_between_processes_nested_dict",
            "test_split_between_processes_tensor",
            "test_split_between_processes_evenly",
            "rng_sync_check",
            "dl_preparation_check",
            "central_dl_preparation_check",
            "custom_sampler_check",
            "check_seedable_sampler",
            "check_seedable_sampler_with_data_seed",
            "check_seedable_sampler_in_batch_sampler_shard",
        )
    ]
    script += [
        _call(
            "test_script",
            "training_check",
            "use_seedable_sampler=False",
            "training_check[seedable=False]",
        ),
        _call(
            "test_script",
            "training_check",
            "use_seedable_sampler=True",
            "training_check[seedable=True]",
        ),
        _call("test_script", "test_trigger"),
        _call("test_script", "test_reinstantiated_state"),
    ]
    notebook = [
        _call("test_notebook", f)
        for f in (
            "test_can_initialize",
            "test_clean_cuda_fork",
            "test_static_rdzv_backend",
            "test_c10d_rdzv_backend",
            "test_fault_tolerant",
            "test_monitoring",
        )
    ]
    return sync + ops + loop + script + notebook


# -- the scripts and their imports --------------------------------------------------------------


def scripts_folder() -> Path:
    spec = importlib.util.find_spec("accelerate.test_utils.scripts")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("accelerate is not installed: pip install -e '.[test]'")
    return Path(next(iter(spec.submodule_search_locations)))


def read_script(script: str) -> str:
    return (scripts_folder() / f"{script}.py").read_text()


def discover() -> list[Case]:
    """The cases whose function exists in the installed scripts, in the table's order: a case
    renamed or removed upstream drops out, and the test comparing with the 63 ids notices."""
    functions: dict[str, set[str]] = {}
    cases = []
    for case in _case_table():
        if case.script not in functions:
            tree = ast.parse(read_script(case.script))
            functions[case.script] = {
                n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            }
        if case.function in functions[case.script]:
            cases.append(case)
    return cases


def nbaccel_home(name: str, accelerate_module: str) -> str | None:
    """``nbaccel`` or ``nbaccel.utils`` if that module has ``name`` (see the module docstring)."""
    if name.startswith("_"):
        return None
    homes = ["nbaccel", "nbaccel.utils"]
    if accelerate_module == "accelerate.utils" or accelerate_module.startswith("accelerate.utils."):
        homes.reverse()
    for home in homes:
        try:
            value = getattr(importlib.import_module(home), name, None)
        except ImportError:  # a name nbaccel leaves out on purpose (errors.NOT_PORTED)
            value = None
        if value is not None and not isinstance(value, types.ModuleType):
            return home
    return None


@dataclass(frozen=True)
class Mapping:
    name: str
    accelerate_module: str
    home: str  # the module it is imported from after the rewrite


def rewrite_imports(source: str) -> tuple[str, list[Mapping]]:
    """``source`` with each ``from accelerate... import`` statement split by where each name now
    comes from; every other line unchanged, and every line number kept."""
    lines = source.splitlines(keepends=True)
    mappings = []
    edits = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
            continue
        if node.module != "accelerate" and not node.module.startswith("accelerate."):
            continue
        first, last = lines[node.lineno - 1], lines[node.end_lineno - 1]
        if first[: node.col_offset].strip() or last[node.end_col_offset :].strip()[:1] not in (
            "",
            "#",
        ):
            raise ValueError(f"line {node.lineno}: an import shares its line with other code")
        by_home: dict[str, list[str]] = {}
        for alias in node.names:
            home = nbaccel_home(alias.name, node.module) or node.module
            mappings.append(Mapping(alias.name, node.module, home))
            text = alias.name if alias.asname is None else f"{alias.name} as {alias.asname}"
            by_home.setdefault(home, []).append(text)
        statements = "; ".join(f"from {home} import {', '.join(n)}" for home, n in by_home.items())
        edits.append((node.lineno, node.end_lineno, " " * node.col_offset + statements + "\n"))
    for start, end, text in sorted(edits, reverse=True):
        lines[start - 1 : end] = [text] + ["\n"] * (end - start)
    return "".join(lines), mappings


# -- running cases ------------------------------------------------------------------------------


@dataclass
class Outcome:
    case: Case
    passed: bool
    rank: int | None = None
    error: str = ""
    at: str = ""
    note: str = ""


@dataclass
class _Launch:
    """What one launch left: each rank's end record per step, and its output."""

    ends: dict[str, dict[int, dict]] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)
    returncode: int | None = None
    hung: bool = False
    output: str = ""


def run_cases(cases: list[Case], workdir: Path | None = None, echo=None) -> list[Outcome]:
    """Run ``cases`` (any scripts, any order) and return their outcomes in the same order."""
    outcomes: dict[str, Outcome] = {}
    with tempfile.TemporaryDirectory(prefix="nbaccel-compat-") as tmp:
        root = Path(workdir or tmp)
        for script in dict.fromkeys(c.script for c in cases):
            todo = [c for c in cases if c.script == script]
            for outcome in _run_script(script, todo, root / script, echo):
                outcomes[outcome.case.id] = outcome
    return [outcomes[c.id] for c in cases]


def _run_script(script: str, cases: list[Case], folder: Path, echo) -> list[Outcome]:
    folder.mkdir(parents=True, exist_ok=True)
    source, _ = rewrite_imports(read_script(script))
    (folder / f"{script}.py").write_text(source)
    shutil.copy(RUNNER, folder / RUNNER.name)
    pending, outcomes, notes = list(cases), [], {}
    for attempt in itertools.count():
        if not pending:
            break
        launch = _launch(script, pending, folder / f"launch{attempt}")
        prelude = launch.ends.get("prelude", {})
        if len(prelude) < _world(script) or not all(e["ok"] for e in prelude.values()):
            # The prelude ran first in a fresh launch: no case of this script can run after it.
            for case in pending:
                outcomes.append(_failure(case, prelude, launch, in_prelude=True))
                if echo:
                    echo(outcomes[-1])
            break
        for position, case in enumerate(pending):
            ends = launch.ends.get(case.name, {})
            if len(ends) == _world(script) and all(e["ok"] for e in ends.values()):
                outcomes.append(Outcome(case, True, note=notes.pop(case.id, "")))
                if echo:
                    echo(outcomes[-1])
                continue
            if position > 0:  # measure it alone, first after the prelude, in a fresh launch
                notes[case.id] = f"failed when run after {pending[position - 1].name}"
                pending = pending[position:]
                break
            outcomes.append(_failure(case, ends, launch))
            if echo:
                echo(outcomes[-1])
            pending = pending[1:]
            break
        else:
            pending = []
    return outcomes


def _world(script: str) -> int:
    return 1 if script in IN_PARENT else NUM_PROCESSES


def _failure(case: Case, ends: dict[int, dict], launch: _Launch, in_prelude=False) -> Outcome:
    failed = sorted((r, e) for r, e in ends.items() if not e["ok"])
    if failed:
        rank, end = failed[0]
        at = end["at"]
        if end.get("script_at") and end["script_at"] != at:
            at += f" (script: {end['script_at']})"
        error = ("prelude: " if in_prelude else "") + end["error"]
        return Outcome(case, False, rank, error, at)
    silent = sorted(set(range(_world(case.script))) - set(ends))
    if launch.hung:
        error = f"hung: no rank reported for {HANG_SECONDS} s"
    else:
        error = f"no result (launch exited with code {launch.returncode})"
    if in_prelude:
        error = f"prelude: {error}"
    return Outcome(case, False, silent[0] if silent else None, error, _blame(launch.output))


_BLAME = re.compile(r"EnforceNotMet|Signal|SIG[A-Z]+|Error|Exception|exit code", re.IGNORECASE)


def _blame(output: str) -> str:
    """The launch output's last line that looks like a cause, for a rank that reported nothing."""
    lines = [line.strip() for line in output.splitlines() if _BLAME.search(line)]
    return lines[-1][:200] if lines else ""


def _launch(script: str, cases: list[Case], folder: Path) -> _Launch:
    results = folder / "results"
    results.mkdir(parents=True)
    steps = [{"id": "prelude", "code": PRELUDES[script]}]
    steps += [{"id": c.name, "code": c.code} for c in cases]
    plan = folder / "plan.json"
    plan.write_text(
        json.dumps(
            {"script": str(folder.parent / f"{script}.py"), "steps": steps, "results": str(results)}
        )
    )
    runner = str(folder.parent / RUNNER.name)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if script in IN_PARENT:
        command = [sys.executable, runner, str(plan)]
        env["ACCELERATE_NUM_PROCESSES"] = str(NUM_PROCESSES)
    else:
        command = [
            sys.executable, "-m", "nbaccel", "launch", "-n", str(NUM_PROCESSES), "--cpu",
            "--no-fsdp", "--no-deepspeed", "--mixed-precision", "no", runner, str(plan),
        ]  # fmt: skip
    launch = _Launch()
    log = folder / "output.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            command,
            cwd=folder,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            launch.returncode, launch.hung = _watch(process, results, launch)
        finally:
            _stop(process)
    _read(results, launch)
    launch.output = log.read_text(errors="replace")
    return launch


def _watch(process: subprocess.Popen, results: Path, launch: _Launch) -> tuple[int | None, bool]:
    """Wait for the launch; stop it when nothing is reported for HANG_SECONDS."""
    seen, last = -1, time.monotonic()
    while process.poll() is None:
        time.sleep(0.5)
        size = sum(p.stat().st_size for p in results.glob("*.jsonl"))
        if size != seen:
            seen, last = size, time.monotonic()
        elif time.monotonic() - last > HANG_SECONDS:
            return None, True
    return process.returncode, False


def _stop(process: subprocess.Popen) -> None:
    """End the launch we started and everything it started, by process group, then by pid."""
    if process.poll() is not None:
        return
    try:
        import psutil

        children = psutil.Process(process.pid).children(recursive=True)
    except Exception:
        children = []
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            process.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    for child in children:
        try:
            child.kill()
        except Exception:
            pass


def _read(results: Path, launch: _Launch) -> None:
    for path in results.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # the last line of a rank that was killed mid-write
            if record["event"] == "start":
                launch.started.add(record["step"])
            else:
                launch.ends.setdefault(record["step"], {})[record["rank"]] = record


# -- the command line ---------------------------------------------------------------------------


def table(outcomes: list[Outcome], width: int = 160) -> str:
    """A Markdown table, errors cut to ``width`` characters."""
    rows = ["| case | result | rank | error | at |", "|---|---|---|---|---|"]
    for o in outcomes:
        result = "pass" if o.passed else "FAIL"
        detail = o.error or o.note
        detail = detail if len(detail) <= width else detail[: width - 1] + "…"
        rank = "" if o.rank is None else str(o.rank)
        rows.append(f"| {o.case.id} | {result} | {rank} | {detail.replace('|', '/')} | {o.at} |")
    passed = sum(o.passed for o in outcomes)
    rows.append(f"\n{passed}/{len(outcomes)} pass")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.compat.accelerate_scripts")
    parser.add_argument("--case", action="append", help="run the cases whose id contains this")
    parser.add_argument(
        "--imports", action="store_true", help="print the import mapping, run nothing"
    )
    parser.add_argument(
        "--keep", type=Path, help="keep the rewritten scripts and logs in this folder"
    )
    args = parser.parse_args(argv)
    cases = discover()
    if args.case:
        cases = [c for c in cases if any(pattern in c.id for pattern in args.case)]
    if args.imports:
        for script in dict.fromkeys(c.script for c in cases):
            for m in rewrite_imports(read_script(script))[1]:
                print(f"{script}: {m.accelerate_module}.{m.name} -> {m.home}")
        return 0

    def echo(outcome: Outcome) -> None:
        status = "pass" if outcome.passed else f"FAIL  {outcome.error}  [{outcome.at}]"
        print(f"{outcome.case.id}: {status}", file=sys.stderr, flush=True)

    start = time.monotonic()
    outcomes = run_cases(cases, args.keep, echo)
    print(table(outcomes))
    print(f"{time.monotonic() - start:.0f} s")
    return 0 if all(o.passed for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
