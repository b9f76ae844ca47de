"""``python -m nbaccel ...``: the command line through this interpreter, whatever PATH says.

A Jupyter kernel registered from an environment (``python -m ipykernel install``) runs that
environment's Python without its ``bin`` on PATH, so a lesson's ``!nbaccel ...`` finds nothing;
``!{sys.executable} -m nbaccel ...`` always runs the nbaccel of the kernel's own environment.
"""

import sys

from .cli import main

sys.exit(main())
