"""One rank of a compatibility launch: runs cases of one rewritten Accelerate script, in order.

``accelerate_scripts.py`` copies this file next to the rewritten script and starts it, with a
plan, under ``nbaccel launch -n 2 --cpu`` (or as a plain parent process for ``test_notebook``).
It imports nothing of nbaccel or of this repository, only what the script imports.

    python case_runner.py PLAN.json

The plan names the script and its steps: the prelude (what the script's ``main()`` runs before
its tests) first, then one step per case. The script's body runs as ``__main__`` (as it does
under ``accelerate launch``), without its closing ``if __name__ == "__main__": main()`` block;
each step runs in that same namespace, so ``accelerator`` from the prelude is there for the
cases, as the locals of ``main()`` are there for its calls.

Every step writes two lines to ``rank<R>.jsonl`` in the plan's results folder, flushed: a
``start`` and an ``end`` with ``ok``, the error and where it was raised. After a step that
passed, a rank waits for every other rank's ``end`` of it before the next step, so a rank never
enters a case that a peer did not survive. A rank whose step failed exits at once with code 1
(its peers may be blocked in a collective waiting for it; the launcher ends them).
"""

from __future__ import annotations

import ast
import json
import os
import sys
import time
import traceback
import types


def main(plan_path: str) -> int:
    with open(plan_path) as file:
        plan = json.load(file)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    records = os.path.join(plan["results"], f"rank{rank}.jsonl")
    script = plan["script"]
    with open(records, "a") as out:

        def write(record: dict) -> None:
            out.write(json.dumps({"rank": rank, **record}) + "\n")
            out.flush()

        namespace = _load(script)
        for step in plan["steps"]:
            write({"step": step["id"], "event": "start"})
            try:
                exec(compile(step["code"], f"<case {step['id']}>", "exec"), namespace)
            except BaseException as err:  # SystemExit too: a case that exits did not pass
                write({"step": step["id"], "event": "end", "ok": False, **_describe(err, script)})
                sys.stdout.flush()
                return 1
            write({"step": step["id"], "event": "end", "ok": True})
            sys.stdout.flush()
            if not _peers_passed(plan["results"], step["id"], world_size):
                return 1
    return 0


def _load(script: str) -> dict:
    """Run the script's body as module ``__main__``, leaving out its ``__main__`` block."""
    with open(script) as file:
        tree = ast.parse(file.read(), filename=script)
    tree.body = [node for node in tree.body if not _is_main_block(node)]
    module = types.ModuleType("__main__")
    module.__file__ = script
    sys.modules["__main__"] = module  # pickle and cloudpickle look classes up here, as they would
    sys.argv = [script]
    exec(compile(tree, script, "exec"), module.__dict__)
    return module.__dict__


def _is_main_block(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
    )


def _describe(err: BaseException, script: str) -> dict:
    """The error's first line, the innermost frame, and the script's own deepest frame."""
    message = str(err).strip().splitlines()
    frames = traceback.extract_tb(err.__traceback__)
    in_script = [f for f in frames if f.filename == script]
    return {
        "error": f"{type(err).__name__}: {message[0] if message else ''}".rstrip(": "),
        "at": _where(frames[-1]) if frames else "",
        "script_at": _where(in_script[-1]) if in_script else "",
    }


def _where(frame: traceback.FrameSummary) -> str:
    path = frame.filename
    for marker in ("site-packages/", "/nbaccel/"):
        if marker in path:
            path = path[path.index(marker) + len(marker) :]
            if marker == "/nbaccel/":
                path = "nbaccel/" + path
            break
    return (
        f"{os.path.basename(path) if path.startswith('/') else path}:{frame.lineno} in {frame.name}"
    )


def _peers_passed(results: str, step: str, world_size: int) -> bool:
    """Wait for every rank's end of ``step``; True when all passed. A peer that never reports
    is the parent's business: it ends the launch after its hang timeout."""
    while True:
        ends = {}
        for rank in range(world_size):
            try:
                with open(os.path.join(results, f"rank{rank}.jsonl")) as file:
                    for line in file:
                        if not line.endswith("\n"):
                            break  # a line still being written
                        record = json.loads(line)
                        if record["step"] == step and record["event"] == "end":
                            ends[rank] = record["ok"]
            except FileNotFoundError:
                pass
        if not all(ends.values()):
            return False
        if len(ends) == world_size:
            return True
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
