"""The live view: a ``Run`` drawn while the workers train, in a notebook or as one line of text.

* ``view``: ``LiveView``: when to redraw, and where (the notebook's display handles, or a
  console line);
* ``line``: the progress line, one sentence about the run;
* ``panel``: the figure, loss and throughput, redrawn in place;
* ``bars``: where each rank's time goes, as stacked bars on the panel.

Nothing here imports torch: the launching process draws without it.
"""
