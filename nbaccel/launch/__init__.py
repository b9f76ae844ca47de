"""(1) Start, watch and stop workers.

* ``launcher``: ``notebook_launcher``, one cell's launch (and its restarts);
* ``supervisor``: one attempt (``Attempt``): starts the workers, relays their output, collects
  results and failures; ``verdict``: what they say, the values or one ``LaunchError`` naming
  the root cause;
* ``forkserver`` and ``client``: the fresh interpreter that forks the workers, and the
  launcher's handle on it;
* ``protocol``: every message between them, one frozen dataclass each;
* ``rendezvous``: the store where the ranks meet, and each worker's environment;
* ``torchrun``: the script path, torch's own elastic launcher as a child process;
* ``session`` and ``waiter``: a ranks session (``Ranks``, ``%%ranks``), workers that stay
  across cells, and one request to them; ``cells`` and ``figures``: a session's rank.

This folder imports the base modules and ``nbaccel.observe``; ``nbaccel.accelerator`` only in
the fork server, to import it once before forking.
"""
