"""A DataLoader prepared for several ranks: each rank's share of every batch, on its device.

* ``sharding``: ``DataLoaderConfiguration`` and ``prepare_dataloader``, the rules of the split;
* ``samplers``: the samplers that draw each rank's batches, and a shuffle seeded per epoch;
* ``streams``: an IterableDataset that every rank reads, keeping its slices;
* ``dispatch``: rank 0 reads, every rank gets its slice (``dispatch_batches=True``);
* ``loader``: the prepared loader, which knows its last batch, and how an interrupted pass
  resumes;
* ``prepare``: Accelerate's free ``prepare_data_loader``, on the same pieces;
* ``adapters``: Accelerate's classes by name (``DataLoaderShard``, ``DataLoaderDispatcher``,
  ``SkipDataLoader``) and ``skip_first_batches``: the prepared loader is one of them;
* ``resumable``: ``use_stateful_dataloader``, the loader on torchdata's StatefulDataLoader.
"""
