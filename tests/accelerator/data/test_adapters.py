"""Accelerate's DataLoader classes by name (``adapters``, ``BatchSamplerShard``,
``SkipBatchSampler``), checked batch for batch against Accelerate's own classes; and the
loaders built on torchdata's StatefulDataLoader (``resumable``), which resume a pass exactly."""

from __future__ import annotations

import itertools
import pickle
import sys

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, TensorDataset

import nbaccel
from nbaccel import Accelerator, DataLoaderConfiguration
from nbaccel.accelerator.data.dispatch import DispatchedDataLoader
from nbaccel.accelerator.data.resumable import stateful_loader_class
from nbaccel.accelerator.data.sharding import stateful_if_asked

accelerate_data = pytest.importorskip("accelerate.data_loader")
StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader


def _lists(loader):
    return [batch.tolist() for batch in loader]


@pytest.mark.parametrize(
    ("n", "batch_size", "drop_last", "split", "even", "processes"),
    [
        (n, b, d, s, e, p)
        for n, b, d, s, e, p in itertools.product(
            (2, 20, 21, 22, 24), (2, 3, 4), (False, True), (False, True), (False, True), (2, 3)
        )
        if not s or b % p == 0
    ],
)
def test_batch_sampler_shard_is_accelerates(n, batch_size, drop_last, split, even, processes):
    batches = BatchSampler(range(n), batch_size=batch_size, drop_last=drop_last)
    for rank in range(processes):
        args = (batches, processes, rank)
        kwargs = dict(split_batches=split, even_batches=even)
        ours, theirs = (
            nbaccel.BatchSamplerShard(*args, **kwargs),
            accelerate_data.BatchSamplerShard(*args, **kwargs),
        )
        assert list(ours) == list(theirs)
        if not split:
            assert len(ours) == len(theirs)


def test_a_batch_size_that_does_not_split_is_refused_as_accelerate_does():
    with pytest.raises(ValueError, match="round multiple"):
        nbaccel.BatchSamplerShard(BatchSampler(range(9), 3, False), 2, 0, split_batches=True)


@pytest.mark.parametrize("skip", [0, 1, 3, 5])
def test_skipping_is_accelerates(skip):
    batches = BatchSampler(range(13), batch_size=3, drop_last=False)
    ours = nbaccel.SkipBatchSampler(batches, skip)
    assert list(ours) == list(accelerate_data.SkipBatchSampler(batches, skip))
    assert len(ours) == max(5 - skip, 0)
    loader = DataLoader(list(range(13)), batch_size=3)
    expected = _lists(accelerate_data.skip_first_batches(loader, skip))
    assert _lists(nbaccel.skip_first_batches(loader, skip)) == expected
    assert _lists(nbaccel.SkipDataLoader(list(range(13)), batch_size=3, skip_batches=skip)) == (
        expected
    )


@pytest.mark.parametrize("kind", ["DataLoaderShard", "DataLoaderDispatcher", "SkipDataLoader"])
def test_the_classes_are_dataloaders_and_know_their_last_batch(kind):
    ours = getattr(nbaccel, kind)(range(10), batch_size=3)
    theirs = getattr(accelerate_data, kind)(range(10), batch_size=3)
    assert type(ours) is getattr(nbaccel, kind) and isinstance(ours, DataLoader)
    assert isinstance(ours.base_dataloader, DataLoader)
    for _ in range(2):  # and again, on the second pass
        flags = []
        for mine, yours in zip(ours, theirs, strict=True):
            assert mine.tolist() == yours.tolist()
            flags.append((ours.end_of_dataloader, theirs.end_of_dataloader))
        if kind != "SkipDataLoader":  # Accelerate's never says it reached its last batch
            assert all(a == b for a, b in flags) and flags[-1] == (True, True)
        assert [a for a, _ in flags] == [False] * (len(flags) - 1) + [True]
    with pytest.raises(AttributeError):
        _ = getattr(nbaccel, kind).base_dataloader


def test_prepared_loaders_are_accelerates_classes_and_pickle():
    data = TensorDataset(torch.arange(10.0))
    shard = Accelerator().prepare(DataLoader(data, batch_size=3))
    dispatched = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    dispatcher = dispatched.prepare(DataLoader(data, batch_size=3))
    assert isinstance(shard, nbaccel.DataLoaderShard) and isinstance(shard, DataLoader)
    assert isinstance(dispatcher, nbaccel.DataLoaderDispatcher)
    for loader in (shard, dispatcher):
        copy = pickle.loads(pickle.dumps(loader))
        assert type(copy) is type(loader)
        assert [b[0].tolist() for b in copy] == [b[0].tolist() for b in loader]


def test_prepare_data_loader_registers_the_loader():
    accelerator = Accelerator()
    loader = accelerator.prepare_data_loader(DataLoader(range(6), batch_size=2))
    assert isinstance(loader, nbaccel.DataLoaderShard) and loader in accelerator._dataloaders
    assert _lists(loader) == [[0, 1], [2, 3], [4, 5]]
    assert accelerator.prepare_data_loader(loader) is loader


def _stateful(dataset, **kwargs):
    return nbaccel.DataLoaderShard(dataset, use_stateful_dataloader=True, **kwargs)


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.process)])
def test_a_stateful_shard_has_torchdatas_state_and_resumes(num_workers):
    def make(kind):
        g = torch.Generator().manual_seed(3)
        return kind(list(range(40)), batch_size=4, num_workers=num_workers, generator=g)

    reference, ours = make(StatefulDataLoader), make(_stateful)
    assert isinstance(ours, StatefulDataLoader) and ours.use_stateful_dataloader
    for i, (a, b) in enumerate(zip(reference, ours, strict=False)):
        assert a.tolist() == b.tolist()
        if i == 3:
            break
    state = reference.state_dict()
    assert ours.state_dict() == state
    resumed, again = make(_stateful), make(StatefulDataLoader)
    resumed.load_state_dict(state)
    again.load_state_dict(state)
    assert (
        _lists(resumed) == _lists(again) == [[16 + 4 * i + j for j in range(4)] for i in range(6)]
    )


def test_a_prepared_stateful_loader_resumes_a_shuffled_pass_through_save_state(tmp_path):
    config = DataLoaderConfiguration(use_stateful_dataloader=True)
    data = TensorDataset(torch.arange(30.0))

    def prepared():
        accelerator = Accelerator(dataloader_config=config)
        return accelerator, accelerator.prepare(DataLoader(data, batch_size=4, shuffle=True))

    torch.manual_seed(0)
    accelerator, loader = prepared()
    assert isinstance(loader, StatefulDataLoader) and isinstance(loader, nbaccel.DataLoaderShard)
    seen = []
    for i, (batch,) in enumerate(loader):
        seen.append(batch.tolist())
        if i == 2:
            accelerator.save_state(tmp_path / "state")
    assert sorted(itertools.chain.from_iterable(seen)) == list(range(30))
    torch.manual_seed(1)  # another run: its own shuffle, until the checkpoint is loaded
    accelerator, loader = prepared()
    accelerator.load_state(tmp_path / "state")
    assert [batch.tolist() for (batch,) in loader] == seen[3:]


def test_stateful_dispatch_across_processes_is_refused():
    dispatched = DispatchedDataLoader(DataLoader(range(8), batch_size=2), 0, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="dispatch_batches=True on several processes"):
        stateful_if_asked(dispatched, DataLoaderConfiguration(use_stateful_dataloader=True))


def test_a_missing_torchdata_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchdata.stateful_dataloader", None)
    with pytest.raises(ImportError, match=r"pip install 'nbaccel\[stateful\]'"):
        stateful_loader_class()
    with pytest.raises(ImportError, match="torchdata"):
        _stateful(range(4), batch_size=2)


@pytest.mark.parametrize("split", [False, True])
def test_total_batch_size_is_accelerates(split):
    from accelerate.data_loader import prepare_data_loader as theirs

    from nbaccel.utils import prepare_data_loader as ours

    def made(prepare):
        loader = DataLoader(list(range(20)), batch_size=4)
        return prepare(loader, num_processes=2, process_index=1, split_batches=split)

    mine, yours = made(ours), made(theirs)
    assert mine.total_batch_size == yours.total_batch_size == (4 if split else 8)
    assert mine.total_dataset_length == yours.total_dataset_length == 20


@pytest.mark.parametrize("rank", [0, 1])
def test_a_sharded_shuffle_resumes_with_its_own_seed_on_a_stateful_loader(rank):
    from torch.utils.data import RandomSampler

    from nbaccel.accelerator.data.samplers import ShardedBatchSampler

    def loader(first_seed):
        seeds = itertools.count(first_seed)  # each pass: "rank 0's draw", another each time
        batches = BatchSampler(RandomSampler(range(30)), batch_size=3, drop_last=False)
        sharded = ShardedBatchSampler(batches, rank, 2, shared_seed=lambda: next(seeds))
        return StatefulDataLoader(list(range(30)), batch_sampler=sharded)

    interrupted = loader(100)
    whole, state = [], None
    for i, batch in enumerate(interrupted):
        whole.append(batch.tolist())
        if i == 1:
            state = interrupted.state_dict()
    resumed = loader(555)  # a new run: its RNG would draw another order
    resumed.load_state_dict(state)
    assert _lists(resumed) == whole[2:]
    assert len(whole) == 5 and whole[2:] != _lists(loader(555))[2:]  # the seed mattered


def test_a_state_of_the_other_kind_is_refused_with_the_reason():
    plain = nbaccel.DataLoaderShard(range(8), batch_size=2)
    stateful = _stateful(range(8), batch_size=2)
    with pytest.raises(ValueError, match="use_stateful_dataloader=True"):
        plain.load_state_dict(stateful.state_dict())
    with pytest.raises(ValueError, match="saved without use_stateful_dataloader"):
        stateful.load_state_dict(plain.state_dict())


def test_the_accelerators_skip_first_batches_takes_a_torch_dataloader_too():
    accelerator = Accelerator()
    loader = DataLoader(list(range(8)), batch_size=2)
    assert _lists(accelerator.skip_first_batches(loader, 1)) == [[2, 3], [4, 5], [6, 7]]
    prepared = accelerator.prepare(DataLoader(list(range(8)), batch_size=2))
    assert _lists(accelerator.skip_first_batches(prepared, 3)) == [[6, 7]]
    with pytest.raises(TypeError, match="takes a torch DataLoader"):
        accelerator.skip_first_batches([[0, 1], [2, 3]], 1)
