"""A real Jupyter kernel (ipykernel, driven by jupyter_client) for notebook-path tests."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import psutil
from jupyter_client.manager import start_new_kernel


@dataclass
class Result:
    stdout: str = ""
    stderr: str = ""
    value: str | None = None
    error: dict | None = None  # ename, evalue, traceback
    images: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # displayed text (the live progress line)
    number: int | None = None  # the cell's execution count, as its prompt shows it (run only)


class Kernel:
    def __init__(self, cwd: str, env: dict[str, str] | None = None) -> None:
        """A kernel in ``cwd``; ``env`` adds to (or overrides) this process's environment."""
        environ = {**os.environ, **(env or {})}
        self.manager, self.client = start_new_kernel(kernel_name="python3", cwd=cwd, env=environ)

    @property
    def pid(self) -> int:
        """The kernel process's pid: a restart (``manager.restart_kernel``) starts a new one."""
        return self.manager.provisioner.process.pid

    def run(self, code: str, timeout: float = 120) -> Result:
        result = Result()
        reply = self.client.execute_interactive(
            code, timeout=timeout, output_hook=lambda msg: _collect(msg, result)
        )
        assert reply["content"]["status"] in ("ok", "error")
        result.number = reply["content"].get("execution_count")
        return result

    def start(self, code: str) -> str:
        return self.client.execute(code)

    def wait_for_output(self, *texts: str, timeout: float = 60) -> str:
        """Read the kernel's output until every one of ``texts`` appeared (in any order);
        return what was read."""
        deadline = time.monotonic() + timeout
        seen = ""
        while time.monotonic() < deadline:
            try:
                msg = self.client.get_iopub_msg(timeout=1)
            except Exception:
                continue
            if msg["msg_type"] == "stream":
                seen += msg["content"]["text"]
                if all(text in seen for text in texts):
                    return seen
        raise AssertionError(f"{texts!r} never all appeared; saw {seen!r}")

    def finish(self, msg_id: str, timeout: float = 60) -> Result:
        """Collect the outputs of a cell started with ``start`` until it is idle."""
        result = Result()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self.client.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            _collect(msg, result)
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return result
        raise AssertionError("the cell never finished")

    def workers(self) -> list[psutil.Process]:
        """Every process below the kernel except the fork server itself. (A worker is forked
        from the server, so its command line is the server's: tell them apart by parent.)"""
        servers = {p.pid for p in self.servers()}
        kernel = psutil.Process(self.pid)
        return [p for p in kernel.children(recursive=True) if p.pid not in servers]

    def servers(self) -> list[psutil.Process]:
        return [p for p in psutil.Process(self.pid).children() if _is_server(p)]

    def shutdown(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=False)  # lets atexit close the fork server


@contextlib.contextmanager
def kernel_with(cwd: str, *cells: str, env: dict[str, str] | None = None) -> Iterator[Kernel]:
    """A kernel that ran ``cells``; shut down after, and its fork server checked gone."""
    kernel = Kernel(cwd=cwd, env=env)
    try:
        for cell in cells:
            kernel.run(cell)
        yield kernel
    except BaseException:  # a failed test leaves no kernel or server behind either
        servers = []
        with contextlib.suppress(psutil.Error):
            servers = kernel.servers()
        kernel.shutdown()
        psutil.wait_procs(servers, timeout=15)
        raise
    servers = kernel.servers()
    kernel.shutdown()
    _, alive = psutil.wait_procs(servers, timeout=15)
    assert not alive, "the fork server outlived its kernel"


def no_workers_left(kernel: Kernel, timeout: float = 15) -> None:
    """Fail if any process below the kernel but its fork server is still alive."""
    _, alive = psutil.wait_procs(kernel.workers(), timeout=timeout)
    assert not alive, f"processes left behind: {alive}"


def _is_server(process: psutil.Process) -> bool:
    try:
        return "nbaccel.launch.forkserver" in " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return False


def _collect(msg: dict, result: Result) -> None:
    kind, content = msg["msg_type"], msg["content"]
    if kind == "stream":
        if content["name"] == "stdout":
            result.stdout += content["text"]
        else:
            result.stderr += content["text"]
    elif kind == "error":
        result.error = content
    elif kind in ("execute_result", "display_data"):
        if "image/png" in content["data"]:
            result.images.append(content["data"]["image/png"])
        elif kind == "display_data" and "text/plain" in content["data"]:
            result.texts.append(content["data"]["text/plain"])
        if kind == "execute_result":
            result.value = content["data"].get("text/plain")
