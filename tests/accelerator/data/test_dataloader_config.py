"""DataLoaderConfiguration: every rank gets exactly the batches that Hugging Face Accelerate's
``prepare_data_loader`` gives it (Accelerate is the oracle), and what nbaccel cannot mean is
refused. One process: each rank's loader is built and read here, one after the other."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)
from torch.utils.data.distributed import DistributedSampler

from nbaccel.accelerator.data.loader import LoopState, PreparedDataLoader
from nbaccel.accelerator.data.sharding import DataLoaderConfiguration, shard_dataloader

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def keeps_torch_rng():
    """Iterating a DataLoader draws from torch's global RNG (and Accelerate may draw a seed):
    every test here leaves it as it was."""
    with torch.random.fork_rng(devices=[]):
        yield


@pytest.fixture
def accelerate_prepare():
    """Accelerate's prepare_data_loader; the singletons it creates (PartialState,
    GradientState) are put back as they were afterwards."""
    from accelerate.data_loader import prepare_data_loader
    from accelerate.state import AcceleratorState, GradientState, PartialState

    singletons = (PartialState, AcceleratorState, GradientState)
    saved = [dict(cls._shared_state) for cls in singletons]
    yield prepare_data_loader
    for cls, state in zip(singletons, saved, strict=True):
        cls._shared_state.clear()
        cls._shared_state.update(state)


def read(loader, epochs: int = 1, set_epoch: bool = False) -> list[list[list[int]]]:
    """Each epoch's batches as index lists (every dataset here holds its own indices)."""
    passes = []
    for epoch in range(epochs):
        if set_epoch:
            loader.set_epoch(2 * epoch + 1)  # not what a complete pass would count on to
        passes.append([batch.tolist() for batch in loader])
    return passes


def accelerate_ranks(prepare, make_loader, world_size, epochs=1, set_epoch=False, **options):
    return [
        read(
            prepare(
                make_loader(),  # a fresh loader per rank: Accelerate changes the one it gets
                num_processes=world_size,
                process_index=rank,
                put_on_device=False,
                **options,
            ),
            epochs,
            set_epoch,
        )
        for rank in range(world_size)
    ]


def nbaccel_ranks(make_loader, world_size, epochs=1, set_epoch=False, **options):
    config = DataLoaderConfiguration(**options)
    ranks = []
    for rank in range(world_size):
        sharded = shard_dataloader(make_loader(), rank, world_size, None, config)
        loader = PreparedDataLoader(sharded, CPU, LoopState())
        ranks.append(read(loader, epochs, set_epoch))
        assert [len(loader)] * epochs == [len(batches) for batches in ranks[-1]]
    return ranks


class Batches:
    """A custom batch sampler: fixed batches, of any size unless ``batch_size`` is given."""

    def __init__(self, batches, drop_last=False, batch_size=None):
        self.batches, self.drop_last = batches, drop_last
        if batch_size is not None:
            self.batch_size = batch_size

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


GRID = [
    (n, batch_size, world_size, drop_last, split, even)
    for n, batch_size, world_size in itertools.product((1, 5, 12, 23), (1, 2, 4, 6), (2, 3))
    for drop_last, split, even in itertools.product((False, True), repeat=3)
    if not split or batch_size % world_size == 0
]


def test_the_grid_covers_the_edges():
    assert any(n < bs * ws for n, bs, ws, *_ in GRID)  # fewer samples than one global batch
    assert any(split and bs // ws > 1 for _, bs, ws, _, split, _ in GRID)


@pytest.mark.parametrize(
    "sampling", ["in order", "seeded generator", "batch_sampler=", "sampler=BatchSampler"]
)
def test_every_rank_gets_accelerates_batches(accelerate_prepare, sampling):
    def make(n, batch_size, drop_last):
        if sampling == "in order":
            return lambda: DataLoader(range(n), batch_size=batch_size, drop_last=drop_last)
        if sampling == "seeded generator":  # every rank seeds its own generator alike
            return lambda: DataLoader(
                range(n),
                batch_size=batch_size,
                drop_last=drop_last,
                sampler=RandomSampler(range(n), generator=torch.Generator().manual_seed(n)),
            )
        batches = lambda: BatchSampler(SequentialSampler(range(n)), batch_size, drop_last)  # noqa: E731
        if sampling == "sampler=BatchSampler":  # the sampler yields batches; the data takes them
            return lambda: DataLoader(torch.arange(n), sampler=batches(), batch_size=None)
        return lambda: DataLoader(range(n), batch_sampler=batches())

    epochs = 2 if sampling == "seeded generator" else 1
    for n, batch_size, world_size, drop_last, split, even in GRID:
        options = dict(split_batches=split, even_batches=even)
        make_loader = make(n, batch_size, drop_last)
        got = nbaccel_ranks(make_loader, world_size, epochs, **options)
        if split and sampling == "sampler=BatchSampler":  # Accelerate refuses; nbaccel splits
            twin = functools.partial(in_batches, n, batch_size, drop_last)  # as batch_sampler=
            assert got == nbaccel_ranks(twin, world_size, epochs, **options)
            continue
        expected = accelerate_ranks(accelerate_prepare, make_loader, world_size, epochs, **options)
        assert got == expected, (n, batch_size, world_size, drop_last, options)


def in_batches(n, batch_size, drop_last):
    return DataLoader(range(n), batch_sampler=BatchSampler(range(n), batch_size, drop_last))


def shuffled(n, batch_size, drop_last, custom):
    if custom:
        batches = BatchSampler(RandomSampler(range(n)), batch_size, drop_last)
        return DataLoader(range(n), batch_sampler=batches)
    return DataLoader(range(n), batch_size=batch_size, shuffle=True, drop_last=drop_last)


@pytest.mark.parametrize("data_seed", [None, 7])
@pytest.mark.parametrize(("set_epoch", "custom"), [(False, False), (True, False), (True, True)])
def test_the_seedable_sampler_shuffles_like_accelerates(
    accelerate_prepare, data_seed, set_epoch, custom
):
    torch.manual_seed(1234)  # data_seed=None means torch.initial_seed() (restored afterwards)
    options = dict(use_seedable_sampler=True, data_seed=data_seed)
    for n, batch_size, world_size, drop_last, split, even in GRID[::7]:
        options.update(split_batches=split, even_batches=even)
        make_loader = functools.partial(shuffled, n, batch_size, drop_last, custom)
        expected = accelerate_ranks(
            accelerate_prepare, make_loader, world_size, 3, set_epoch, **options
        )
        got = nbaccel_ranks(make_loader, world_size, 3, set_epoch, **options)
        assert got == expected, (n, batch_size, world_size, drop_last, options)
    first, second, _ = got[0]
    assert first != second  # the order changes with the epoch


def test_the_seedable_sampler_on_one_process(accelerate_prepare):
    original = DataLoader(range(10), batch_size=3, shuffle=True)
    sampler = original.batch_sampler.sampler
    options = dict(use_seedable_sampler=True, data_seed=3)
    got = nbaccel_ranks(lambda: original, 1, epochs=3, **options)
    fresh = functools.partial(DataLoader, range(10), batch_size=3, shuffle=True)
    expected = accelerate_ranks(accelerate_prepare, fresh, 1, 3, **options)
    assert got == expected
    assert original.batch_sampler.sampler is sampler  # the user's loader is left as it was


def test_the_seedable_order_ignores_the_global_rng_and_the_shared_seed():
    def no_shared_seed() -> int:
        raise AssertionError("the seeded shuffle asked for rank 0's draw")

    config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=11)
    orders = []
    for draws in (0, 5):
        torch.rand(draws)
        loader = DataLoader(range(20), batch_size=4, shuffle=True)
        sharded = shard_dataloader(loader, 1, 2, no_shared_seed, config)
        orders.append([b.tolist() for b in sharded])
    assert orders[0] == orders[1]


def test_batches_of_any_size_are_dealt_out_whole(accelerate_prepare):
    sizes = [[0], [1, 2], [3, 4, 5], [6], [7, 8], [9, 10, 11, 12], [13]]
    for batches, world_size, drop_last, even in itertools.product(
        (sizes, sizes[:2], sizes[:5]), (2, 3), (False, True), (True, False)
    ):
        options = dict(even_batches=even)
        make_loader = functools.partial(
            DataLoader, range(14), batch_sampler=Batches(batches, drop_last)
        )
        expected = accelerate_ranks(accelerate_prepare, make_loader, world_size, **options)
        got = nbaccel_ranks(make_loader, world_size, **options)
        assert got == expected, (len(batches), world_size, drop_last, even)


def test_remainder_counts_the_real_samples_of_a_topped_up_step(accelerate_prepare):
    """gather_for_metrics keeps the first ``remainder`` samples of the last gathered step: they
    must be exactly the data that the earlier steps did not cover."""
    cases = [
        (DataLoader(range(n), batch_size=bs), ws, split)
        for n, bs, ws, _, split, even in GRID
        if even and n < 23
    ]
    cases.append((DataLoader(range(14), batch_sampler=Batches([[0, 1, 2], [3], [4, 5]])), 2, False))
    as_sampler = BatchSampler(range(5), 2, drop_last=False)  # a sampler that yields batches
    cases.append((DataLoader(torch.arange(5), sampler=as_sampler, batch_size=None), 2, False))
    for loader, world_size, split in cases:
        config = DataLoaderConfiguration(split_batches=split)
        steps, remainders = [], set()
        for rank in range(world_size):
            state = LoopState()
            sharded = shard_dataloader(loader, rank, world_size, None, config)
            batches = []
            for batch in PreparedDataLoader(sharded, CPU, state):
                batches.append(batch.tolist())
                if state.end_of_dataloader:
                    remainders.add(state.remainder)
            steps.append(batches)
        (remainder,) = remainders  # the same on every rank
        gathered = [[i for rank in step for i in rank] for step in zip(*steps, strict=True)]
        if remainder is not None:
            gathered[-1] = gathered[-1][:remainder]
        expected = [i for batch in (loader.batch_sampler or loader.sampler) for i in batch]
        if loader.drop_last:
            expected = expected[: len(gathered) * len(gathered[0])]
        assert [i for step in gathered for i in step] == expected, (len(expected), world_size)
        if loader.batch_size is not None and not loader.drop_last:  # Accelerate's own count
            acc = accelerate_prepare(
                loader, num_processes=world_size, process_index=0, split_batches=split
            )
            read(acc)
            assert remainder == (acc.remainder or None)


def test_remainder_is_none_when_nothing_was_repeated():
    for even, drop_last in [(False, False), (True, True)]:
        state = LoopState()
        loader = DataLoader(range(10), batch_size=4, drop_last=drop_last)
        config = DataLoaderConfiguration(even_batches=even)
        sharded = PreparedDataLoader(shard_dataloader(loader, 0, 2, None, config), CPU, state)
        ends = [state.remainder for _ in sharded if state.end_of_dataloader]
        assert ends == [None]


def test_split_batches_gives_each_rank_a_slice():
    loader = DataLoader(range(16), batch_size=8)
    config = DataLoaderConfiguration(split_batches=True)
    prepared = PreparedDataLoader(shard_dataloader(loader, 1, 2, None, config), CPU, LoopState())
    assert prepared.batch_size == 4 and len(prepared) == 2
    assert [b.tolist() for b in prepared] == [[4, 5, 6, 7], [12, 13, 14, 15]]


def test_one_process_keeps_the_loader_unless_the_order_changes():
    loader = DataLoader(range(10), batch_size=4, shuffle=False)
    for options in (
        {},
        dict(split_batches=True),
        dict(even_batches=False),
        dict(use_seedable_sampler=True),  # in order: nothing to seed
    ):
        assert shard_dataloader(loader, 0, 1, None, DataLoaderConfiguration(**options)) is loader
    shuffled = DataLoader(range(10), batch_size=4, shuffle=True)
    seeded = DataLoaderConfiguration(use_seedable_sampler=True)
    assert shard_dataloader(shuffled, 0, 1, None) is shuffled
    assert shard_dataloader(shuffled, 0, 1, None, seeded) is not shuffled


@pytest.mark.parametrize(("batch_size", "world_size"), [(3, 2), (1, 2), (4, 3)])
def test_split_batches_needs_a_multiple_of_the_processes(
    accelerate_prepare, batch_size, world_size
):
    def loader():
        return DataLoader(range(12), batch_size=batch_size)

    with pytest.raises(ValueError, match="round multiple"):  # Accelerate refuses it too
        accelerate_prepare(loader(), num_processes=world_size, process_index=0, split_batches=True)
    config = DataLoaderConfiguration(split_batches=True)
    with pytest.raises(ValueError, match=rf"batch_size must be a multiple of {world_size}"):
        shard_dataloader(loader(), 0, world_size, None, config)


@pytest.mark.parametrize("world_size", [1, 2])
def test_split_batches_needs_a_batch_size(accelerate_prepare, world_size):
    def loader():
        return DataLoader(range(4), batch_sampler=Batches([[0, 1], [2, 3]]))

    with pytest.raises(ValueError, match="batch_size"):  # Accelerate refuses it too
        accelerate_prepare(loader(), num_processes=world_size, process_index=0, split_batches=True)
    config = DataLoaderConfiguration(split_batches=True)
    with pytest.raises(ValueError, match=r"needs a fixed batch size.*\(Batches\)"):
        shard_dataloader(loader(), 0, world_size, None, config)


def test_a_fixed_batch_size_allows_only_a_short_last_batch():
    batches = Batches([[0, 1], [2], [3, 4]], batch_size=2)
    sharded = shard_dataloader(DataLoader(range(5), batch_sampler=batches), 0, 2, None)
    with pytest.raises(ValueError, match=r"has batch_size=2 but yielded a batch of 2 samples"):
        list(sharded)


def test_even_batches_false_is_refused_where_it_cannot_apply():
    class Stream(IterableDataset):
        def __iter__(self):
            yield from range(4)

    config = DataLoaderConfiguration(even_batches=False)
    with pytest.raises(ValueError, match="even_batches=False cannot apply to dispatched"):
        shard_dataloader(DataLoader(Stream()), 0, 2, None, config)  # unset: a stream dispatches
    config.dispatch_batches = False
    with pytest.raises(ValueError, match="cannot apply to an IterableDataset's batches"):
        shard_dataloader(DataLoader(Stream()), 0, 2, None, config)
    config.dispatch_batches = True
    with pytest.raises(ValueError, match="cannot apply to dispatched batches"):
        shard_dataloader(DataLoader(range(4)), 0, 2, None, config)


def test_a_slice_fn_needs_dispatch():
    with pytest.raises(ValueError, match=r"slice_fn_for_dispatch .* would never be called"):
        shard_dataloader(DataLoader(range(4)), 0, 2, None, slice_fn=lambda *a, **k: None)


def test_dispatch_refuses_a_distributed_sampler():
    sampler = DistributedSampler(range(8), num_replicas=2, rank=0)
    config = DataLoaderConfiguration(dispatch_batches=True)
    with pytest.raises(ValueError, match="DistributedSampler: the sampler already gives"):
        shard_dataloader(DataLoader(range(8), sampler=sampler), 0, 2, None, config)


def test_a_loader_without_batches_is_refused():
    loader = DataLoader(range(4), batch_size=None)  # Accelerate fails here with a bare TypeError
    with pytest.raises(TypeError, match=r"batch_size=None and no batch_sampler across 2"):
        shard_dataloader(loader, 0, 2, None)
    assert shard_dataloader(loader, 0, 1, None) is loader


def test_the_fields_and_defaults_are_accelerates():
    from accelerate.utils import DataLoaderConfiguration as Theirs

    def defaults(cls):
        return [(f.name, f.default) for f in dataclasses.fields(cls)]

    assert defaults(DataLoaderConfiguration) == defaults(Theirs)


def test_fields_can_be_assigned_and_are_checked_when_set():
    config = DataLoaderConfiguration(use_seedable_sampler=True, data_seed=42)
    config.data_seed = 43  # Accelerate's test_script does this
    config.dispatch_batches = True
    assert (config.data_seed, config.dispatch_batches) == (43, True)
    with pytest.raises(TypeError, match=r"data_seed='7' must be an int or None"):
        config.data_seed = "7"  # type: ignore[assignment]
    config.use_stateful_dataloader = True  # torchdata's StatefulDataLoader (resumable.py)
    assert config.data_seed == 43 and config.use_stateful_dataloader is True


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(split_batches=1), r"split_batches=1 must be True or False"),
        (dict(even_batches="no"), r"even_batches='no' must be True or False"),
        (dict(non_blocking=None), r"non_blocking=None must be True or False"),
        (dict(use_stateful_dataloader=0), r"use_stateful_dataloader=0 must be True or False"),
        (dict(dispatch_batches="auto"), r"dispatch_batches='auto' must be None, True or False"),
        (dict(data_seed=1.5), r"data_seed=1.5 must be an int or None"),
        (dict(data_seed=True), r"data_seed=True must be an int or None"),
    ],
)
def test_wrong_types_are_refused(options, message):
    with pytest.raises(TypeError, match=message):
        DataLoaderConfiguration(**options)


def test_dispatch_batches_is_kept():
    assert DataLoaderConfiguration(dispatch_batches=True).dispatch_batches is True


def test_set_epoch_reaches_the_sampler_or_the_dataset():
    class Data(list):
        epochs: list[int]

        def set_epoch(self, epoch: int) -> None:
            self.epochs.append(epoch)

    data = Data(range(8))
    data.epochs = []
    prepared = PreparedDataLoader(DataLoader(data, batch_size=4), CPU, LoopState())
    read(prepared, epochs=2)  # each complete pass moves the epoch on
    prepared.set_epoch(5)
    read(prepared)
    assert data.epochs == [0, 1, 5, 5]

    sampler = DistributedSampler(range(8), num_replicas=2, rank=0)  # no process group needed
    data.epochs = []
    loader = DataLoader(data, batch_size=2, sampler=sampler)
    prepared = PreparedDataLoader(shard_dataloader(loader, 0, 2, None), CPU, LoopState())
    prepared.set_epoch(3)
    assert sampler.epoch == 3 and data.epochs == []  # Accelerate tells one of them too


def test_non_blocking_copies_reach_the_gpu(monkeypatch):
    calls = []
    monkeypatch.setattr(
        "nbaccel.accelerator.data.loader.send_to_device", lambda b, d, nb: calls.append(nb) or b
    )
    loader = DataLoader(range(4), batch_size=2)
    for device, non_blocking, expected in [("cuda", True, True), ("cuda", False, False)]:
        calls.clear()
        prepared = PreparedDataLoader(
            loader, torch.device(device), LoopState(), non_blocking=non_blocking
        )
        list(prepared)
        assert calls == [expected, expected]
    calls.clear()
    list(PreparedDataLoader(loader, CPU, LoopState(), non_blocking=True))
    assert calls == [False, False]  # a CPU "copy" never overlaps anything
