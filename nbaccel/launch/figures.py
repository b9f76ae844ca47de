"""matplotlib's backend on a rank of a ranks session: figures go to the notebook as PNG.

The session sets ``MPLBACKEND`` to this module on each rank (``cells.BACKEND``). It draws with
Agg, and ``plt.show()`` sends the open figures to the cell and closes them, as the inline backend
does in a kernel; a cell's end sends what is left open. Without it a rank has no display: the
inline backend outside a kernel prints ``Figure(640x480)``, and Agg warns that it cannot show.
"""

from __future__ import annotations

from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg

FigureCanvas = FigureCanvasAgg
FigureManager = FigureManagerBase


def show(*args, **kwargs) -> None:
    from .cells import send_figures

    send_figures()
