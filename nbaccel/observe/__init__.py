"""(3) Seeing inside: what each rank records, how it reaches the notebook, and how it is drawn.

Numbers flow one way, from every worker to the launching process::

    rank_recorder (each rank) --> channel (a datagram socket) --> records (the launching side)
                                                                   --> live/ (the view)

* ``rank_recorder``: the ``Recorder`` on each rank counts samples, steps and logged numbers;
* ``channel``: the ``Record`` and the socket it travels on, and the counters' names;
* ``records``: the ``Run``, what the launching side received, with its questions and exports;
* ``breakdown``: where each rank's time goes (data, compute, communication, the rest);
* ``stacks`` and ``hang``: where a hung rank is stuck, and why, in words;
* ``live/``: the panel and the progress line (no torch);
* ``trackers/``: TensorBoard, MLflow and wandb behind ``Accelerator(log_with=...)``.

This folder imports only the base modules (``env``, ``config``, ``errors``, ``tensors``).
"""
