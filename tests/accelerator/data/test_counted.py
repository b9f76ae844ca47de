"""A prepared loader over a TensorDataset counts its batches instead of reading one ahead
(``samplers.counted_batches``): the same batches, last batch and remainder as reading ahead,
under every sharding rule, and each batch read only when the loop asks for it."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from nbaccel.accelerator.data.loader import LoopState, PreparedDataLoader
from nbaccel.accelerator.data.prepare import prepare_data_loader
from nbaccel.accelerator.data.samplers import counted_batches
from nbaccel.errors import NbaccelError


class ReadAhead(TensorDataset):
    """A TensorDataset that the loader does not trust to count (a subclass may draw random
    numbers in ``__getitem__``): it reads ahead, as Accelerate's loader does."""


def passes(dataset, epochs: int = 2, **config) -> list:
    """Each batch of ``epochs`` passes, with whether the loader called it the last, and at
    the last its remainder."""
    loader_args = {k: config.pop(k) for k in ("batch_size", "shuffle", "drop_last")}
    torch.manual_seed(0)  # the same shuffle for both loaders
    loader = prepare_data_loader(DataLoader(dataset, **loader_args), **config)
    seen = []
    for _ in range(epochs):
        for (batch,) in loader:
            end = loader.state.end_of_dataloader
            seen.append((batch.tolist(), end, loader.state.remainder if end else None))
    return seen, loader


CASES = [
    dict(n=n, batch_size=b, shuffle=s, drop_last=d, num_processes=w, even_batches=e, split=p)
    for n, b, s, d, w, e, p in itertools.product(
        (0, 1, 5, 16, 17, 23),
        (1, 3, 4),
        (False, True),
        (False, True),
        (1, 2, 3),
        (True, False),
        (False, True),
    )
    # split_batches needs a batch size the ranks divide; torch shuffles no empty dataset
    if not (p and b % w) and not (s and n == 0)
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v:d}" for k, v in c.items()))
def test_counted_passes_are_the_passes_read_ahead(case):
    n, world = case["n"], case["num_processes"]
    config = dict(
        batch_size=case["batch_size"], shuffle=case["shuffle"], drop_last=case["drop_last"],
        num_processes=world, even_batches=case["even_batches"], split_batches=case["split"],
    )  # fmt: skip
    for rank in range(world):
        counted, loader = passes(TensorDataset(torch.arange(n)), process_index=rank, **config)
        ahead, reference = passes(ReadAhead(torch.arange(n)), process_index=rank, **config)
        assert counted_batches(loader.loader) == len(loader)  # the counting path ran
        assert counted_batches(reference.loader) is None  # the reference read ahead
        assert counted == ahead
        assert [end for _, end, _ in counted].count(True) == (2 if counted else 0)


def test_a_counted_batch_is_read_when_asked_for(monkeypatch):
    fetched = []
    getitem = TensorDataset.__getitem__

    def counted(self, index):
        fetched.append(index)
        return getitem(self, index)

    monkeypatch.setattr(TensorDataset, "__getitem__", counted)  # ReadAhead's too
    for dataset, ahead in ((TensorDataset(torch.arange(7)), 0), (ReadAhead(torch.arange(7)), 1)):
        fetched.clear()
        loader = PreparedDataLoader(DataLoader(dataset, batch_size=2), None, LoopState())
        handed = 0
        for _ in loader:
            handed += 1
            # samples read so far: a batch more than handed out when reading ahead
            assert len(fetched) == min(2 * (handed + ahead), 7)
        assert handed == 4


def test_only_loaders_of_exact_length_and_no_side_effects_are_counted():
    data = TensorDataset(torch.arange(10))
    assert counted_batches(DataLoader(data, batch_size=3)) == 4
    assert counted_batches(DataLoader(data, batch_size=3, shuffle=True, drop_last=True)) == 3
    assert counted_batches(DataLoader(ReadAhead(torch.arange(10)), batch_size=3)) is None
    assert counted_batches(DataLoader(data, batch_size=3, num_workers=2)) is None
    assert counted_batches(DataLoader(data, batch_size=3, collate_fn=lambda b: b)) is None
    assert counted_batches(DataLoader(data, batch_size=None)) is None  # no batch sampler
    mine = torch.Generator().manual_seed(0)  # the loop may draw from it too
    assert counted_batches(DataLoader(data, batch_size=3, shuffle=True, generator=mine)) is None

    class Lengthy(SequentialSampler):
        pass

    batches = BatchSampler(Lengthy(data), 3, False)
    assert counted_batches(DataLoader(data, batch_sampler=batches)) is None


@pytest.mark.parametrize("length,said", [(2, "more"), (4, "fewer")])
def test_a_length_that_lies_is_said_not_hidden(monkeypatch, length, said):
    """The guard behind counting: were a trusted length wrong, the pass stops with the reason
    instead of training on with an accumulation window that never synced."""
    monkeypatch.setattr(BatchSampler, "__len__", lambda self: length)
    loader = PreparedDataLoader(
        DataLoader(TensorDataset(torch.arange(5)), batch_size=2), None, LoopState()
    )
    with pytest.raises(NbaccelError, match=f"yielded {said} batches than its length, {length}"):
        list(loader)
