"""Experiments built on the launcher, the Accelerator and what they record.

* ``scaling``: one function measured at several process counts, with its table and figure;
* ``projection/``: data-parallel scaling beyond the machine you have, checked against a
  measured point.
"""
