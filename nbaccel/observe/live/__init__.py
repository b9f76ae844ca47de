"""The live view: a ``Run`` drawn while the workers train, in a notebook or as one line of text.

* ``view``: ``LiveView``, its front ends, the panel and the progress line;
* ``bars``: where each rank's time goes, as stacked bars on the panel.

Nothing here imports torch: the launching process draws without it.
"""
