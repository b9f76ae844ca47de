"""Where a launch's workers meet: torch's TCPStore, hosted by the launching process, and the
environment that sends each worker there (``worker_envs``).

The store listens on a socket this process bound itself (port 0: the OS picks a free one, no
race), on loopback unless ``num_nodes > 1``; workers join it as clients, exactly as under
torchrun's agent. The store, and so the port, go away when the ``rendezvous`` block ends.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import sys
import threading
from contextlib import contextmanager

from ..config import LaunchConfig
from ..errors import NbaccelError

logger = logging.getLogger(__name__)


def meeting(config: LaunchConfig):
    """``config``'s rendezvous (a new store each time it is entered); yields the port. A launch
    meets at a new one for every attempt, a ranks session at one for its life."""
    addr = config.master_addr or "127.0.0.1"
    return rendezvous(config.num_nodes, config.node_rank, addr, config.master_port)


def worker_envs(config: LaunchConfig, port: int, attempt: int) -> tuple[dict[str, str], ...]:
    """Each local worker's environment: torchrun's variables at this rendezvous, in this
    attempt, and the launch's own (``LaunchConfig.to_environ``)."""
    common = {
        **os.environ,
        **config.to_environ(),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the store we host is the rendezvous
        "MASTER_ADDR": config.master_addr or "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(config.world_size),
        "LOCAL_WORLD_SIZE": str(config.num_processes),
        "GROUP_RANK": str(config.node_rank),
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
    }
    loopback = loopback_interface() if config.num_nodes == 1 else None
    if loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
        common["GLOO_SOCKET_IFNAME"] = loopback  # gloo's own sockets stay on this machine too
    first = config.node_rank * config.num_processes
    return tuple(
        {**common, "RANK": str(first + local), "LOCAL_RANK": str(local)}
        for local in range(config.num_processes)
    )


@contextmanager
def rendezvous(num_nodes: int, node_rank: int, master_addr: str, master_port: int | None):
    """Host the TCPStore on node 0; yield the port the workers meet on.

    With several nodes, node 0 keeps the store until every node's workers are done (each node
    says so on its way out), as torchrun's agents do: a node whose workers finish first must
    not pull the store from under the others.
    """
    import torch.distributed as dist

    if node_rank != 0:
        try:
            yield master_port
        finally:
            say_done(master_addr, master_port, node_rank)
        return
    host = "127.0.0.1" if num_nodes == 1 else "0.0.0.0"  # loopback unless asked for more
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, master_port or 0))
    except OSError as err:
        sock.close()
        raise NbaccelError(
            f"cannot listen on {host}:{master_port}: {err.strerror}. Another job holds that port; "
            "pick another master_port, or leave it out on one machine to get a free one."
        ) from err
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, master_listen_fd=sock.detach(), wait_for_workers=False
    )
    succeeded = False
    try:
        yield port
        succeeded = True
    finally:
        if num_nodes > 1:
            keys = [f"nbaccel/done/{k}" for k in range(1, num_nodes)]
            wait = datetime.timedelta(seconds=120 if succeeded else 5)
            try:
                store.wait(keys, wait)
            except Exception:  # a node that died never says so; it has had its time
                logger.warning("not every node reported back within %s; closing the store", wait)
        del store  # closes the listening socket: the port is free again


def import_torch_distributed() -> None:
    """Import ``torch.distributed`` (and torch) with the stop button held until it is done: an
    import cut short by KeyboardInterrupt leaves torch broken in this process until a restart
    (its C++ registries filled, its module half made: "Only a single TORCH_LIBRARY can be
    used..."). A press meanwhile is raised as soon as the import is whole."""
    if "torch.distributed" in sys.modules:
        return
    with interrupt_held():
        import torch.distributed  # noqa: F401


@contextmanager
def interrupt_held():
    """The stop button held until the block is done, then raised: what the block makes (an
    import, a started process and its handle) is never left half made. On the main thread
    only, where Python runs signal handlers; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed: list = []
    previous = signal.signal(signal.SIGINT, lambda *sig: pressed.append(sig))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed and callable(previous):
        previous(*pressed[0])  # the stop, now that the block is whole: KeyboardInterrupt
    elif pressed and previous == signal.SIG_DFL:
        signal.raise_signal(signal.SIGINT)


def say_done(master_addr: str, master_port: int | None, node_rank: int) -> None:
    import torch.distributed as dist

    try:
        client = dist.TCPStore(
            master_addr, master_port, is_master=False, timeout=datetime.timedelta(seconds=10)
        )
        client.set(f"nbaccel/done/{node_rank}", "1")
    except Exception:
        pass  # node 0 is already gone: nothing waits for us


def loopback_interface() -> str | None:
    """The network interface that holds 127.0.0.1 ("lo" on Linux, "lo0" on macOS)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            return name
    return None
