"""A partition's limits as SLURM shows them, and a request held against them.

``check_request`` refuses only what can never start: more nodes than the partition has, more
CPUs, memory or GPUs per node than any of its nodes, a longer time than its MaxTime, a
partition that is not UP. SLURM would queue some of these forever (reason PartitionNodeLimit,
PartitionTimeLimit) rather than refuse them. What the commands do not show (a cluster may hide
details) is not checked: a refusal is never a guess. The readers are pure functions of the
commands' text (``scontrol show partition NAME -o``, ``sinfo -h -N -p NAME -o "%N|%c|%m|%G"``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import NbaccelError

#: SLURM's forms of a time limit (``sbatch --time``), as the errors list them.
TIME_FORMS = (
    '"minutes", "minutes:seconds", "hours:minutes:seconds", "days-hours", '
    '"days-hours:minutes", "days-hours:minutes:seconds", or "UNLIMITED"'
)
#: What a partition in each state other than UP does with a job (``scontrol show partition``).
NOT_UP = {
    "DOWN": "it queues jobs but starts none until an administrator sets it UP",
    "DRAIN": "it takes no new jobs",
    "INACTIVE": "it neither takes nor starts jobs",
}


def minutes(time: int | str) -> float | None:
    """A SLURM time limit in minutes (``sbatch --time``'s forms); None for UNLIMITED.

    >>> minutes(45), minutes("90:30"), minutes("1-02:30:00"), minutes("infinite")
    (45.0, 90.5, 1590.0, None)
    """
    if isinstance(time, int) and not isinstance(time, bool) and time >= 0:
        return float(time)
    text = time.strip() if isinstance(time, str) else ""
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    days, dash, clock = text.rpartition("-")
    numbers = [days, *clock.split(":")] if dash else clock.split(":")
    if len(numbers) > (4 if dash else 3) or not all(re.fullmatch("[0-9]+", n) for n in numbers):
        raise ValueError(f"{time!r} is not a SLURM time limit; SLURM's forms: {TIME_FORMS}")
    values = [int(n) for n in numbers]
    if dash:  # days-hours[:minutes[:seconds]]
        d, h, m, s = [*values, 0, 0][:4]
    else:  # minutes, minutes:seconds, hours:minutes:seconds
        d, h, m, s = [0, 0, *values, 0][:4] if len(values) < 3 else [0, *values]
    return d * 1440 + h * 60 + m + s / 60


@dataclass(frozen=True)
class Partition:
    """A partition as ``scontrol show partition NAME -o`` shows it; a limit is None where it
    says UNLIMITED or nothing readable (either way, nothing to check)."""

    name: str
    state: str | None
    total_nodes: int | None
    max_nodes: int | None
    max_time: str | None  # SLURM's text, e.g. "1-12:00:00"
    max_cpus_per_node: int | None


@dataclass(frozen=True)
class Node:
    """A node as ``sinfo -N -o "%N|%c|%m|%G"`` shows it."""

    name: str
    cpus: int
    memory_mb: int
    gpus: int | None  # None: GRES in a form not read here


def read_partition(scontrol: str) -> Partition | None:
    """``scontrol show partition NAME -o``'s line, or None where it shows no partition."""
    fields = dict(f.split("=", 1) for f in scontrol.split() if "=" in f)
    if not fields.get("PartitionName"):
        return None

    def number(key: str) -> int | None:
        value = fields.get(key, "")
        return int(value) if value.isascii() and value.isdigit() else None

    max_time = fields.get("MaxTime", "")
    try:
        max_time = max_time if minutes(max_time) is not None else None  # None: UNLIMITED
    except ValueError:
        max_time = None
    return Partition(
        fields["PartitionName"],
        fields.get("State"),
        number("TotalNodes"),
        number("MaxNodes"),
        max_time,
        number("MaxCPUsPerNode"),
    )


def read_nodes(sinfo: str) -> list[Node] | None:
    """The lines of ``sinfo -h -N -p NAME -o "%N|%c|%m|%G"``, or None if any is unreadable."""
    nodes = []
    for line in sinfo.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 4 or not all(f.isascii() and f.isdigit() for f in fields[1:3]):
            return None
        nodes.append(Node(fields[0], int(fields[1]), int(fields[2]), gres_gpus(fields[3])))
    return nodes or None


def gres_gpus(gres: str) -> int | None:
    """The GPUs in a node's GRES as sinfo prints it ("gpu:4", "gpu:a100:4(S:0-1)", "(null)");
    None where a GPU entry has no readable count."""
    found = 0
    for entry in re.sub(r"\([^)]*\)", "", gres).split(","):
        name, *rest = entry.strip().split(":")
        if name != "gpu":
            continue
        if not rest or not (rest[-1].isascii() and rest[-1].isdigit()):
            return None
        found += int(rest[-1])
    return found


def memory_mb(mem: int | str | None) -> float | None:
    """``--mem`` in MB (SLURM's units: K, M, G, T of 1024; none is M); None where it is not
    one of those forms, or 0 (all of a node's memory)."""
    if isinstance(mem, int) and not isinstance(mem, bool):
        mem = str(mem)
    found = (
        re.fullmatch(r"([0-9]+)([KMGT]?)", mem.strip().upper()) if isinstance(mem, str) else None
    )
    if found is None or int(found[1]) == 0:
        return None
    return int(found[1]) * 1024.0 ** ("KMGT".index(found[2] or "M") - 1)


def check_request(
    cluster, num_nodes: int, partition: Partition | None, nodes: list[Node] | None
) -> None:
    """Refuse a request (``cluster``, a ``SlurmCluster``) that ``partition`` and its ``nodes``
    can never run, naming the limit, the value asked and the option to change; what SLURM did
    not show is not checked."""
    if partition is None:
        return
    where = f"SLURM partition {partition.name!r}"
    other = "choose another partition with SlurmCluster(partition=...) (`sinfo -s` lists them)"
    if partition.state not in (None, "UP"):
        why = NOT_UP.get(partition.state, "it is not UP")
        raise NbaccelError(f"{where} is {partition.state} ({why}): {other}")
    limits = [
        (partition.total_nodes, "has {}"),
        (partition.max_nodes, "allows {} per job (MaxNodes)"),
    ]
    for limit, says in limits:
        if limit is not None and num_nodes > limit:
            count = f"{limit} node{'s' * (limit != 1)}"
            raise NbaccelError(
                f"{where} {says.format(count)}; num_nodes={num_nodes} can never start: ask for "
                f"at most {limit} (num_nodes={limit}), or {other}"
            )
    asked = minutes(cluster.time)
    if partition.max_time is not None and asked is not None and asked > minutes(partition.max_time):
        raise NbaccelError(
            f"{where} runs a job for at most {partition.max_time} (MaxTime); time={cluster.time!r} "
            f"can never start: ask for at most that, SlurmCluster(time={partition.max_time!r}), "
            f"or {other}"
        )
    if nodes is not None:
        _check_nodes(_per_node(cluster, partition, nodes), num_nodes, where, other)


#: How an error says an amount of each per-node option, and how the option is written.
AMOUNTS = {
    "cpus_per_task": ("{:g} CPUs", "{:g}"),
    "mem": ("{:g} MB of memory", "'{:g}M'"),
    "gpus_per_node": ("{:g} GPUs", "{:g}"),
}


def _per_node(cluster, partition: Partition, nodes: list[Node]) -> list[tuple]:
    """(option, its value as given, as a number, what each node has) for each per-node option
    the request sets; a node's None: not known, so never counted against the request."""
    asks = []
    if isinstance(cluster.cpus_per_task, int) and cluster.cpus_per_task > 0:
        cap = partition.max_cpus_per_node
        has = [n.cpus if cap is None else min(n.cpus, cap) for n in nodes]
        asks.append(("cpus_per_task", cluster.cpus_per_task, cluster.cpus_per_task, has))
    mem = memory_mb(cluster.options.get("mem"))
    if mem is not None:
        asks.append(("mem", cluster.options["mem"], mem, [n.memory_mb for n in nodes]))
    if cluster.gpus_per_node:
        has = [n.gpus for n in nodes]
        asks.append(("gpus_per_node", cluster.gpus_per_node, cluster.gpus_per_node, has))
    return asks


def _check_nodes(asks: list[tuple], num_nodes: int, where: str, other: str) -> None:
    able = set(range(len(asks[0][3]))) if asks else set()  # nodes that can hold one task
    for option, given, value, has in asks:
        amount, spelled = AMOUNTS[option]
        enough = {i for i, h in enumerate(has) if h is None or h >= value}
        able &= enough
        if not enough:
            most = max(has)
            fix = f"ask for at most {amount.format(most)} (SlurmCluster({option}="
            fix += f"{spelled.format(most)})), or "
            raise NbaccelError(
                f"the nodes of {where} have at most {amount.format(most)}; {option}={given!r} "
                f"can never start: {fix if most else ''}{other}"
            )
        if len(enough) < num_nodes:
            most = sorted((h for h in has if h is not None), reverse=True)[num_nodes - 1]
            raise NbaccelError(
                f"only {len(enough)} of the nodes of {where} have {amount.format(value)}; "
                f"num_nodes={num_nodes} with {option}={given!r} can never start: ask for at most "
                f"{len(enough)} nodes (num_nodes={len(enough)}), or for at most "
                f"{amount.format(most)} each (SlurmCluster({option}={spelled.format(most)}))"
            )
    if asks and len(able) < num_nodes:
        each = " and ".join(AMOUNTS[option][0].format(value) for option, _, value, _ in asks)
        fix = f"at most {len(able)} nodes (num_nodes={len(able)}), or for " if able else ""
        raise NbaccelError(
            f"only {len(able)} of the nodes of {where} have {each} at once; num_nodes="
            f"{num_nodes} can never start: ask for {fix}less on each node, or {other}"
        )
