"""(2) Inside each worker: the ``Accelerator``, what it is made of, and how it prepares a loop.

* ``accelerator``: the ``Accelerator`` itself, the course's last lesson;
* ``state``: ``PartialState``, where this process stands (rank, device, process group);
* ``accumulation``, ``optim``, ``precision``: the accumulation window, the optimizer and
  scheduler wrappers that follow it, and one mixed-precision policy;
* ``collectives``, ``join``: gather, reduce and friends; uneven batches;
* ``saving``, ``checkpoint``, ``project``: the Accelerator's files, what a checkpoint folder
  holds, and how checkpoint folders are named;
* ``data/``: shard a DataLoader, its samplers, the prepared loader;
* ``strategies/``: how the ranks share the model (one process, DDP, FSDP2, DeepSpeed).

This folder imports the base modules and ``nbaccel.observe`` (to record and to time), never
the launcher.
"""
