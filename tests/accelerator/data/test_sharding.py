"""Sharding rules, checked on indices alone (no processes needed)."""

from __future__ import annotations

from collections import namedtuple

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from nbaccel.accelerator.data.loader import LoopState, PreparedDataLoader
from nbaccel.accelerator.data.samplers import ShardedBatchSampler
from nbaccel.accelerator.data.sharding import DataLoaderConfiguration, shard_dataloader
from nbaccel.tensors import send_to_device


def shards(n: int, batch_size: int, world_size: int, drop_last: bool = False):
    sampler = SequentialSampler(range(n))
    return [
        list(ShardedBatchSampler(BatchSampler(sampler, batch_size, drop_last), rank, world_size))
        for rank in range(world_size)
    ]


def test_a_global_step_is_one_big_batch_in_order():
    ranks = shards(250, batch_size=8, world_size=2)
    assert len(ranks[0]) == len(ranks[1]) == 16  # even: nobody waits in an all-reduce
    steps = [a + b for a, b in zip(*ranks, strict=True)]
    flat = [i for step in steps for i in step]
    assert flat[:250] == list(range(250))  # rank order = data order
    assert flat[250:] == list(range(6))  # topped up with the epoch's first samples


def test_distinct_samples_on_every_rank():
    ranks = shards(96, batch_size=4, world_size=3)
    seen = [i for rank in ranks for batch in rank for i in batch]
    assert sorted(seen) == list(range(96))


def test_drop_last_drops_the_partial_step():
    ranks = shards(250, batch_size=8, world_size=2, drop_last=True)
    assert len(ranks[0]) == 15 and max(max(b) for r in ranks for b in r) == 239
    sampler = ShardedBatchSampler(BatchSampler(SequentialSampler(range(250)), 8, True), 0, 2)
    assert len(sampler) == 15 and sampler.remainder is None


def test_a_tiny_dataset_still_fills_every_rank():
    ranks = shards(3, batch_size=2, world_size=2)
    assert ranks == [[[0, 1]], [[2, 0]]]


def test_shuffling_uses_the_shared_seed_like_a_plain_loader():
    data = list(range(50))
    torch.manual_seed(3)
    expected = list(torch.utils.data.RandomSampler(data))
    torch.manual_seed(3)
    seed = int(torch.empty((), dtype=torch.int64).random_().item())
    batches = BatchSampler(torch.utils.data.RandomSampler(data), 5, False)
    sampler = ShardedBatchSampler(batches, 0, 1, shared_seed=lambda: seed)
    assert [i for batch in sampler for i in batch] == expected


def test_send_to_device_keeps_the_structure():
    Pair = namedtuple("Pair", "a b")
    batch = {"x": [torch.ones(1), (torch.zeros(2), "text")], "p": Pair(torch.ones(1), 2)}
    moved = send_to_device(batch, torch.device("cpu"))
    assert isinstance(moved["p"], Pair) and moved["p"].b == 2 and moved["x"][1][1] == "text"
    assert isinstance(moved["x"][1], tuple)


def test_send_to_device_calls_no_operator_for_a_tensor_already_there():
    """Tensors on the device are kept as they are (what ``to`` returns), without an
    ``aten::to`` call per tensor per step; others move."""
    batch = (torch.ones(2, 3), torch.zeros(2, dtype=torch.int64))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        moved = send_to_device(batch, torch.device("cpu"))
    assert all(a is b for a, b in zip(moved, batch, strict=True))
    assert not [e.name for e in profile.events() if e.name.startswith("aten::")]
    meta = send_to_device(batch, torch.device("meta"))
    assert [t.device.type for t in meta] == ["meta", "meta"]


def test_send_to_device_moves_a_flat_batch_with_one_tensor_elsewhere():
    """A tuple or list of tensors all on the device comes back as it is; one tensor elsewhere,
    or anything that is not a tensor, and the batch is walked and moved as before."""
    meta = torch.device("meta")
    there, here = torch.ones(2, device=meta), torch.ones(2)
    mixed = send_to_device((there, here), meta)
    assert type(mixed) is tuple and [t.device.type for t in mixed] == ["meta", "meta"]
    assert mixed[0] is there  # kept, not copied
    with_text = send_to_device([here, "text", 3], meta)
    assert type(with_text) is list and with_text[0].device == meta and with_text[1:] == ["text", 3]
    nested = send_to_device((there, (here,)), meta)
    assert nested[1][0].device == meta


def test_the_loader_knows_its_last_batch():
    state = LoopState()
    loader = PreparedDataLoader(DataLoader(range(5), batch_size=2), torch.device("cpu"), state)
    flags = [state.end_of_dataloader for _ in loader]
    assert flags == [False, False, True]
    assert not state.end_of_dataloader and not state.active  # the pass is over


def test_an_iterable_dataset_is_read_whole_by_each_rank_which_keeps_its_slices():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(5)

    config = DataLoaderConfiguration(dispatch_batches=False)
    ranks = [
        [
            b.tolist()
            for b in shard_dataloader(DataLoader(Stream(), batch_size=2), r, 2, None, config)
        ]
        for r in range(2)
    ]
    assert ranks == [[[0, 1], [4, 0]], [[2, 3], [1, 2]]]  # the last step topped up from the first


def test_a_custom_batch_sampler_is_sharded_like_batch_size():
    custom = DataLoader(range(9), batch_sampler=BatchSampler(SequentialSampler(range(9)), 2, False))
    plain = DataLoader(range(9), batch_size=2)
    for rank in range(2):
        got = [b.tolist() for b in shard_dataloader(custom, rank, 2, None)]
        assert got == [b.tolist() for b in shard_dataloader(plain, rank, 2, None)]
