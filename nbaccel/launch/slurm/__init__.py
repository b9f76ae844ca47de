"""The cluster path: ``job.py`` on the notebook's side, ``node.py`` on each node (SLURM)."""

from .job import SlurmCluster, launch

__all__ = ["SlurmCluster", "launch"]
