"""The cluster path: ``cluster.py`` (SlurmCluster, its options and checks) and ``job.py``
(submit, watch, cancel, the verdict) on the notebook's side; ``node.py`` on each node."""

from .cluster import SlurmCluster
from .job import launch

__all__ = ["SlurmCluster", "launch"]
