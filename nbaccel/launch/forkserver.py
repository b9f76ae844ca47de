"""The worker side of the launcher: a fork server, and what each worker runs.

Why a fork server (measured on 2 cores, see ``launcher.py``): a notebook kernel that already trained
with torch has a live OpenMP thread pool; forking it can deadlock the children, and a kernel that
touched CUDA cannot fork usable CUDA workers at all. Spawning fresh interpreters is safe but pays
the torch import (seconds) on every launch. So the launcher starts this module once per kernel as a
fresh interpreter (``python -m nbaccel.launch.forkserver FD``) that imports torch and then only
waits: it never runs a torch op, so it has no thread pool and no CUDA context, and forking it is
safe and fast. Workers receive the notebook's function serialised by value (cloudpickle), so
functions and classes defined in cells work.

Memory: the workers share the server's pages (torch's import) until they write to them. A
garbage collection writes to every object it visits, so a worker's first full collection would
copy every page that holds one. The server freezes what it has loaded (``gc.freeze()``): the
workers' collections skip those objects, and the pages stay shared. Measured on 2 cores
(``benchmarks/launch.py``), the own memory (USS) of 2 workers after 20 training steps and
``gc.collect()``: 153 MiB without the freeze, 24 MiB with it. What each preload costs an idle
tree and saves workers that train (``benchmarks/preload.py``): ``torch._dynamo`` 72 MiB idle,
against 132 MiB and 0.8 s a launch saved when the workers build an optimizer.

The messages, their framing and the exception-as-data they carry live in ``protocol.py``, which
the launcher's side (``supervisor.py``) imports too.
"""

from __future__ import annotations

import gc
import os
import resource
import selectors
import signal
import socket
import sys
from dataclasses import replace

from ..env import CHANNEL_VAR
from ..observe.stacks import listen_from_environ
from .descriptors import raise_limit, refusal
from .kept_groups import keep_groups_until_exit
from .protocol import (
    FDS_PER_WORKER,
    ExceptionData,
    Exited,
    Failure,
    MissingDescriptors,
    Refused,
    Result,
    Signal,
    Signalled,
    Start,
    Started,
    WorkerSpec,
    encode,
    is_collective_failure,
    recv,
    returned,
    send,
    unpack_call,
)


# -- the server ----------------------------------------------------------------------------------
def serve(control_fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Jupyter's interrupt is for the kernel
    import cloudpickle  # noqa: F401  # preloaded so that every worker starts warm
    import torch
    import torch._dynamo  # building an optimizer imports it: 0.8 s a launch otherwise
    import torch.distributed
    import torch.nn  # noqa: F401

    import nbaccel.accelerator.accelerator  # noqa: F401

    gc.freeze()  # what is loaded stays shared with the workers: their collections skip it
    limits = raise_limit()  # room for big launches' descriptors; each worker gets these back
    control = socket.socket(fileno=control_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select() through the pipe
    launches: dict[int, list[int]] = {}  # launch id -> pids not yet reaped
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    try:
        while True:
            for key, _ in selector.select():
                if key.fileobj is control:
                    try:
                        message, fds = recv(control)
                    except MissingDescriptors as err:  # forked, they would fail: say why
                        send(control, Refused(err.start.launch, refusal(err)))
                        continue
                    _handle(control, message, fds, launches, wake_r, wake_w, limits)
                else:
                    os.read(wake_r, 4096)
            _reap(control, launches)
    except (EOFError, ConnectionError):
        pass  # the launching process is gone: take the workers with us
    finally:
        for pids in launches.values():
            for pid in pids:
                _signal_group(pid, signal.SIGKILL)


def _handle(control, message, fds, launches, wake_r, wake_w, limits) -> None:
    if isinstance(message, Start):
        pids, server = [], os.getpid()
        for i, spec in enumerate(message.workers):
            mine = fds[FDS_PER_WORKER * i : FDS_PER_WORKER * (i + 1)]
            pid = os.fork()
            if pid == 0:  # the worker: never returns to the server's loop
                code = 1
                try:
                    _die_with(server)
                    resource.setrlimit(resource.RLIMIT_NOFILE, limits)  # the kernel gave us these
                    os.close(wake_r)
                    os.close(wake_w)
                    control.close()
                    for fd in fds:
                        if fd not in mine:
                            os.close(fd)
                    code = _worker(spec, *mine)
                except BaseException:  # a failure before the worker's own reporting is set up
                    import traceback

                    traceback.print_exc()  # into the cell when stderr is already redirected
                finally:
                    os._exit(code)
            pids.append(pid)
        for fd in fds:
            os.close(fd)
        launches[message.launch] = pids
        send(control, Started(message.launch, tuple(pids)))
    elif isinstance(message, Signal):
        for pid in launches.get(message.launch, []):
            if message.group:
                _signal_group(pid, message.signal)
            else:
                try:
                    os.kill(pid, message.signal)
                except ProcessLookupError:
                    pass
        if not message.group:
            send(control, Signalled(message.launch))


def _reap(control, launches) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        for launch, pids in list(launches.items()):
            if pid in pids:
                pids.remove(pid)
                if not pids:
                    del launches[launch]
        code = os.waitstatus_to_exitcode(status)
        send(control, Exited(pid, code))


def _signal_group(pid: int, sig: int) -> None:
    """Signal a worker and what it started (DataLoader workers): its own process group."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


# -- a worker ------------------------------------------------------------------------------------
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with(server: int) -> None:
    """Make the kernel SIGKILL this worker when the fork server dies, however it dies.

    The server's own cleanup runs only when it sees the launcher go (EOF); killed itself (the
    OOM killer, a process monitor), it cleans up nothing, and workers in process groups of their
    own would train on as orphans. Linux only; elsewhere the launcher's sweep at the end of the
    launch (``supervisor.py``) is what ends them.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != server:  # it died between the fork and the prctl: no signal will come
        os._exit(1)


def _worker(spec: WorkerSpec, out_fd: int, err_fd: int, messages_fd: int, metrics_fd: int) -> int:
    os.setpgid(0, 0)  # one group per worker, so a stop reaches its DataLoader workers too
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    sys.stdout.reconfigure(line_buffering=True)  # whole lines reach the notebook
    sys.stderr.reconfigure(line_buffering=True)
    return run_worker(spec, messages_fd, metrics_fd)


def run_worker(spec: WorkerSpec, messages_fd: int, metrics_fd: int) -> int:
    """Set up this process as the spec says, run the function, report; returns the exit code."""
    import faulthandler
    from multiprocessing.connection import Connection

    import cloudpickle
    import torch
    import torch.distributed as dist

    from ..observe.rank_recorder import close_all

    faulthandler.enable()  # a segfault still prints a Python traceback into the cell
    os.environ.clear()
    os.environ.update(spec.env, **{CHANNEL_VAR: str(metrics_fd)})
    os.chdir(spec.cwd)
    sys.path[:] = spec.sys_path
    torch.set_num_threads(spec.threads)
    listen_from_environ()  # answers "where are you?" while the function runs (stacks.py)
    keep_groups_until_exit()
    messages = Connection(messages_fd)
    if spec.session:  # a ranks session's rank: cells until the kernel lets go
        from .cells import serve_cells

        return serve_cells(messages)
    try:
        function, args, kwargs = unpack_call(messages.recv_bytes())
        sys.argv[:] = [getattr(function, "__qualname__", repr(function))]  # not the server's
        value = function(*args, **kwargs)
        close_all()  # the last records reach the notebook before the result does
        messages.send_bytes(encode(returned(value)))
        code = 0
    except SystemExit as exit_:
        close_all()
        code, shown = _exit_status(exit_)
        if code == 0:  # sys.exit(0) as a way out: the value is None, the launcher says so
            messages.send_bytes(encode(Result(cloudpickle.dumps(None), "NoneType", exited=True)))
        else:  # what Python prints for it, and where it was raised
            data = replace(_describe(exit_), message=shown)
            messages.send_bytes(encode(Failure(data, exit_code=code)))
    except BaseException as err:
        close_all()  # the records up to the failure reach the notebook before it does
        data = _describe(err)
        messages.send_bytes(encode(Failure(data, is_collective_failure(err, data.message))))
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if dist.is_available() and dist.is_initialized():
        try:  # the function forgot end_training(); leave cleanly so peers are not stuck
            dist.destroy_process_group()
        except Exception:
            pass
    return code


def _describe(err: BaseException) -> ExceptionData:
    """``err`` as data; should even that fail (no memory left), its class's name alone."""
    try:
        return ExceptionData.of(err, hide=__file__)
    except Exception:
        return ExceptionData(type(err).__qualname__, str(type(err).__module__), "")


def _exit_status(exit_: SystemExit) -> tuple[int, str]:
    """The exit code and the message of ``raise SystemExit(code)``, as Python's own exit
    handling has them: ``None`` is 0, an int is itself, anything else is printed and is 1."""
    if exit_.code is None:
        return 0, ""
    if isinstance(exit_.code, int):
        return exit_.code, ""
    try:
        return 1, str(exit_.code)
    except Exception:
        return 1, f"<unprintable {type(exit_.code).__name__}>"


if __name__ == "__main__":
    serve(int(sys.argv[1]))
