"""The GPU tier (``pytest -m gpu tests/gpu``): every CUDA path, skipped with a reason without
CUDA. Runs standalone on a machine with no nbval: ``python3 -m pytest -o addopts="" -p
no:cacheprovider -m gpu tests/gpu`` with ``PYTHONPATH`` at the repository root."""
