"""The free ``prepare_data_loader``: Accelerate's parameters and structure, in one process (each
rank's loader built here with an explicit ``num_processes`` and ``process_index``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from nbaccel.accelerator.data.loader import LoopState, PreparedDataLoader
from nbaccel.accelerator.data.prepare import prepare_data_loader
from nbaccel.accelerator.data.samplers import SeedableRandomSampler
from nbaccel.errors import NbaccelError


@pytest.fixture(autouse=True)
def keeps_torch_rng():
    with torch.random.fork_rng(devices=[]):
        yield


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(7)


def test_the_sharded_batch_sampler_has_accelerates_shape():
    """What Accelerate's test_script reads: ``.batch_sampler.batch_sampler.sampler``."""
    loader = DataLoader(list(range(10)), batch_size=1, shuffle=True)
    prepared = prepare_data_loader(
        loader, num_processes=2, process_index=0, use_seedable_sampler=True
    )
    assert isinstance(prepared.batch_sampler.batch_sampler.sampler, SeedableRandomSampler)
    custom = BatchSampler(SequentialSampler(range(8)), 2, drop_last=False)
    prepared = prepare_data_loader(DataLoader(range(8), batch_sampler=custom), None, 2, 1)
    assert prepared.batch_sampler.batch_sampler is custom  # the user's, untouched
    assert [b.tolist() for b in prepared] == [[2, 3], [6, 7]]


def test_batches_stay_where_they_are_unless_put_on_device(monkeypatch):
    moved = []
    monkeypatch.setattr(
        "nbaccel.accelerator.data.loader.send_to_device", lambda b, d, nb: moved.append(d) or b
    )
    list(prepare_data_loader(DataLoader(range(4), batch_size=2), "cpu", 1, 0))
    assert moved == []
    list(prepare_data_loader(DataLoader(range(4), batch_size=2), "cpu", 1, 0, put_on_device=True))
    assert moved == [torch.device("cpu")] * 2
    moved.clear()
    list(prepare_data_loader(DataLoader(range(4), batch_size=2), None, 1, 0, put_on_device=True))
    assert moved == []  # as Accelerate: no device given, no move


def test_the_seedable_sampler_takes_accelerates_arguments_and_orders():
    from accelerate.data_loader import SeedableRandomSampler as Theirs

    for seed in (None, 5):
        torch.manual_seed(11)
        kwargs = dict(data_source=range(12), num_samples=12, data_seed=seed)
        ours, theirs = SeedableRandomSampler(**kwargs), Theirs(**kwargs)
        for epoch in (0, 3):
            ours.set_epoch(epoch), theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
        assert ours.epoch == theirs.epoch == 4  # a complete pass moves on
    generator = torch.Generator()
    ours = SeedableRandomSampler(range(6), generator=generator, data_seed=3)
    theirs = Theirs(range(6), generator=torch.Generator(), data_seed=3)
    assert list(ours) == list(theirs) and ours.generator is generator


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (dict(rng_types=["generator"]), ValueError, r"rng_types=\['generator'\] is not supp"),
        (dict(torch_device_mesh=object()), ValueError, "torch_device_mesh is not supported"),
        (dict(dispatch_batches=True), ValueError, "needs put_on_device=True"),
        (
            dict(dispatch_batches=True, put_on_device=True),
            ValueError,
            "dispatch_batches=True on 2 processes needs their process group",
        ),
        (dict(non_blocking=1), TypeError, "non_blocking=1 must be True or False"),
        (dict(slice_fn_for_dispatch=print), ValueError, "would never be called"),
        (dict(process_index=2), ValueError, "process_index=2 must be below num_processes=2"),
        (dict(num_processes=-1), ValueError, "num_processes=-1 must be an int >= 0"),
    ],
)
def test_what_cannot_be_honoured_is_refused(options, error, message):
    arguments = dict(num_processes=2, process_index=0) | options
    with pytest.raises(error, match=message):
        prepare_data_loader(DataLoader(range(8), batch_size=2), **arguments)


def test_a_stream_skips_by_reading_but_cannot_resume_a_checkpointed_pass():
    def prepared():
        loader = prepare_data_loader(DataLoader(Stream(), batch_size=2), None, 2, 1)
        assert isinstance(loader, PreparedDataLoader)
        return loader

    loader = prepared()
    assert [b.tolist() for b in loader.skip(1)] == [[6, 0]]  # as Accelerate's skip_first_batches
    loader = prepared()
    loader.load_state_dict({"epoch": 0, "batches": 1, "rng": torch.get_rng_state()})
    with pytest.raises(NbaccelError, match=r"a checkpoint's pass over a stream cannot be resumed"):
        list(loader.skip(1))
    loader.load_state_dict({"epoch": loader.epoch})  # the fix the message gives
    assert [b.tolist() for b in loader] == [[2, 3], [6, 0]]


def test_the_loop_state_sees_the_end_and_the_remainder_of_a_stream():
    state = LoopState()
    loader = prepare_data_loader(DataLoader(Stream(), batch_size=2), None, 2, 0)
    loader = PreparedDataLoader(loader.loader, None, state)
    ends = [(state.end_of_dataloader, state.remainder) for _ in loader]
    assert ends == [(False, None), (True, 3)]  # 7 samples: the last step holds 3 real ones
