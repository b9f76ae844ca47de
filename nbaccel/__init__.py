"""nbaccel: run distributed PyTorch training from a notebook cell, and see what happens inside.

>>> from nbaccel import Accelerator, set_seed
"""

from .accelerator import Accelerator, set_seed
from .data import send_to_device
from .errors import CheckpointError, LaunchError, NbaccelError
from .launcher import notebook_launcher

__all__ = [
    "Accelerator",
    "CheckpointError",
    "LaunchError",
    "NbaccelError",
    "notebook_launcher",
    "send_to_device",
    "set_seed",
]
__version__ = "0.1.0"
