"""Live plots for loops written for other libraries: ``tracker`` (``LiveTracker``, for Hugging
Face Accelerate's own ``Accelerator``), ``callback`` (``LiveCallback``, for transformers'
``Trainer``) and ``common``, what they share."""
