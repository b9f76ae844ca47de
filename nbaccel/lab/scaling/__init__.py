"""Run one training function at several process counts and show how it scales, honestly.

>>> result = measure_scaling(train, counts=(1, 2), cpu=True)   # doctest: +SKIP
>>> result            # in a notebook: the table and the figure

**What is compared.** Every count runs in worker processes (one process too), each worker with
the same number of torch threads (``threads``; default the cores / the largest count), so a
larger count adds workers, not threads. Each count runs ``repeats`` times (default 3), the
counts in turn (1, 2, 1, 2, 1, 2), so a slow stretch of the machine falls on all of them.

**One launch's numbers** come from the samples counter that the prepared DataLoader keeps on
each rank (it counts a batch as it hands it to the loop, and the counter is recorded at its
first batch, about every quarter second, and at the end of each epoch). The launch's clock
splits at the first and the last of those records (``Timing``):

* **start-up**: from the launch to the first batch handed out on any rank: starting workers,
  imports, the process group, building and preparing the model;
* **training**: from there to the last record on any rank, so it starts with the first
  training step (whose one-time costs it includes) and ends with the last epoch;
* **finish**: ``end_training``, the workers' exit and their results coming back.

The three add up to the wall clock of the launch. A launch's throughput is the samples every
rank trained in the training window, summed, over the training seconds.

**A count's numbers.** Its throughput is the median of its repeats' throughputs; its *spread*
is (max - min) / median. Its *median run* (of an even number, the lower middle one) is the one
whose throughput is the median: its times, breakdown and loss are the ones shown
(``Scaling.runs``; every run is in ``Scaling.repeats``). Scaling efficiency is
``throughput(N) / (N * throughput(1))``: 1.0 is perfect, and with equal threads per worker
above 1 is impossible, because each worker of N does the same work per sample as the lone one,
and communicates besides.

**Spoiled measurements are flagged, not shown as results.** During every launch a ``Load``
meter (``load.py``) reads the busy seconds of the cores we may use, less those of this process
and its descendants: ``other_cores``, the mean cores other programs took. A row is flagged
(``flags.py``; ``THRESHOLDS``, copied into ``Scaling.thresholds``) when:

* *busy*: other processes kept more than 0.25 cores busy, in the median of the count's launches
  (most of them were disturbed; the median throughput survives one disturbed launch) or in the
  median run itself (the one the row shows). Why 0.25: an idle machine measures a few
  hundredths; a quarter of a core taken from workers that fill the cores moves a 2-process
  efficiency by more than 10 %.
* *too short*: the run it shows trained for under 0.25 s, too short a window to time.
* *wide spread*: its spread exceeds 20 %. Repeats on a quiet machine agree within a few
  percent; a fifth of the median means the machine changed under them.
* *spoiled baseline*: the smallest count's row, which every efficiency divides by, is flagged.
* *slow baseline*: the smallest count's time per sample on data, compute and other (all but
  communication) exceeds 1.15 x that of a worker at this count (only when the ranks timed their
  loops, ``Run.breakdown``). At equal threads a worker does the same work per sample at every
  count and is no faster with company than alone; 15 % is beyond the jitter of per-sample times
  taken from seconds of loop, so the lone worker was slowed down.
* *above 1*: a row whose efficiency exceeds 1.05 is flagged always, with its cause: the other
  flags, or, without one, that it is impossible beyond noise (on a CPU: rerun on an idle
  machine). 5 % is the noise allowed a ratio of two medians.

So no row shows an efficiency above 1.05 without a flag. The table marks a flagged row's
efficiency "(!k)" and lists its flags in note k under it; the figure draws it hollow and grey,
"spoiled: <cause>", off the "measured" line. ``Scaling.flags()`` lists them all and
``Scaling.trusted`` is True when there are none.

**Where the time goes**: each run keeps every rank's breakdown of its training loop into data,
compute, communication and other seconds (``Run.breakdown``). The table gives the median run's
mean shares of the loop per process count (``data %``, ``compute %``, ``comm %``, ``other %``),
so it shows where efficiency is lost, not only that it is: on one process nothing waits for
gradients; at two, the communication share is the price of keeping the replicas in step.

The live progress line shows something else while a run goes: every rank's rate over its last
few seconds of counter records, summed. ``Scaling.live_rate`` reads that last rate from the
median run's records. Both rates are defined once, with the records (``Run.timing``,
``Run.live_samples_per_s``). The figure (``view.py``) draws the same numbers with
matplotlib's object API (no pyplot), imported only when something is drawn.
"""

from .contention import Load
from .flags import THRESHOLDS
from .measure import measure_scaling
from .result import Scaling
from .view import figure, shares

__all__ = ["THRESHOLDS", "Load", "Scaling", "figure", "measure_scaling", "shares"]
