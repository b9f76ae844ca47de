"""Process groups destroyed in a launcher's worker live on until the worker exits.

Its own module, not the fork server's: the server runs as ``__main__``, where a worker's function
importing ``nbaccel.launch.forkserver`` would find another copy.
"""

from __future__ import annotations

# The process groups destroyed in this worker, freed only by its os._exit. Process-wide, as
# torch's default group is: destroy_process_group may be called from anywhere in the worker.
KEPT_GROUPS: list = []


def keep_groups_until_exit() -> None:
    """Make ``destroy_process_group`` keep a reference to the groups it destroys, in this worker.

    With gloo (torch 2.13), a DDP model freed after ``destroy_process_group()`` frees the group's
    last owner in its Reducer's destructor, which then joins gloo's threads while holding Python's
    lock: now and then (3 launches in 150 on 2 cores) the worker hangs there. The canonical loop
    (``destroy_process_group()``, then the function returns and its DDP model is freed) meets it.
    Kept here, the group outlives every Reducer, and the worker's ``os._exit`` ends it without a
    destructor; the group is still destroyed for torch (no collective can use it)."""
    import torch.distributed as dist

    destroy = dist.destroy_process_group

    def destroy_process_group(group=None):
        try:
            KEPT_GROUPS.append(group if group is not None else dist.group.WORLD)
        except Exception:
            pass
        return destroy(group)

    destroy_process_group.__wrapped__ = destroy
    destroy_process_group.__doc__ = destroy.__doc__
    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group
