"""Experiment trackers in Accelerate's sense, behind ``Accelerator(log_with=...)``.

* ``general``: ``GeneralTracker`` (subclass it for your own), ``LoggerType`` and
  ``on_main_process``;
* ``builtin``: TensorBoard, MLflow and wandb;
* ``registry``: ``LOGGER_TYPE_TO_CLASS``, the class each ``log_with`` name makes, and
  ``register_tracker_class`` to name yours; Accelerate's other trackers, which nbaccel refuses;
* ``log_with``: the Accelerator's holder of its trackers: which ones ``log_with`` names, started
  by ``init_trackers``, written to by ``log``.

A tracker writes where the user asked (files, a server); the live view is a separate branch of
the flow (``nbaccel.observe``), which needs none of them.
"""
