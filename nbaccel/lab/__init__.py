"""Experiments built on the launcher, the Accelerator and what they record.

* ``scaling/``: one function measured at several process counts (equal threads per worker,
  repeated, interleaved), with its table and figure, and flags where the machine spoiled it;
* ``projection/``: data-parallel scaling beyond the machine you have, checked against a
  measured point.
"""
