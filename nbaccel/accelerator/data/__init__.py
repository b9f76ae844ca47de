"""A DataLoader prepared for several ranks: each rank's share of every batch, on its device.

* ``sharding``: ``DataLoaderConfiguration`` and ``prepare_dataloader``, the rules of the split;
* ``samplers``: the samplers that draw each rank's batches, and a shuffle seeded per epoch;
* ``loader``: the prepared loader, one batch ahead, and how an interrupted pass resumes.
"""
