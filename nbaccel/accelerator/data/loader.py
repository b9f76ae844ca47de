"""The prepared DataLoader: this rank's batches, on the device, the last one known before it
is yielded; and how a pass that a killed run left halfway resumes where it stopped.

``Accelerator.prepare`` builds it (``data.prepare_dataloader``) around the sharded loader.
Resuming: ``save_state`` keeps each loader's ``state_dict()`` (its epoch and, for a pass in
progress, the batches it yielded and the torch RNG state the pass began with); after
``load_state``, ``accelerator.skip_first_batches(loader, n)`` (``loader.skip(n)``) runs the rest
of that pass in the order it had: the sampler draws its shuffle from the saved state, and the
RNG goes back to the checkpoint's before any batch is read (``samplers.Replay``). A resumed run
then sees exactly the batches, and draws exactly the random numbers, of the run that died.
On torchdata's StatefulDataLoader (``use_stateful_dataloader``) the state is that loader's
instead, and the next pass resumes by itself (``resumable``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from ...errors import NbaccelError
from ...tensors import samples_in, send_to_device
from .dispatch import DispatchedDataLoader
from .resumable import stateful_state
from .samplers import Replay, ShardedBatchSampler, counted_batches, fixed_batch_size
from .streams import IterableDatasetShard

if TYPE_CHECKING:
    from ...observe.rank_recorder import Recorder

logger = logging.getLogger(__name__)


@dataclass(eq=False)  # compared by identity: two passes may hold equal values
class _Pass:
    remainder: int | None
    end: bool = False
    loader: Any = None  # the prepared loader being iterated (GradientState.active_dataloader)


@dataclass
class LoopState:
    """Which prepared loader is being iterated, and whether this is its last batch.

    ``accumulate`` reads it to sync gradients at the end of the data, and ``gather_for_metrics``
    to drop the repeats that topped up the last step. One per Accelerator: no global state.
    """

    active: list[_Pass] = field(default_factory=list)  # a stack: eval loop inside a train loop

    @property
    def end_of_dataloader(self) -> bool:
        return bool(self.active) and self.active[-1].end

    @property
    def remainder(self) -> int | None:
        """Real samples in the last global step, when that step was topped up; else None."""
        return self.active[-1].remainder if self.active else None


def with_batch_sampler(loader: DataLoader, batch_sampler: Any, as_sampler: bool) -> DataLoader:
    where = {"sampler": batch_sampler, "batch_size": None} if as_sampler else {}
    return DataLoader(
        loader.dataset, **(where or {"batch_sampler": batch_sampler}), **workers_of(loader)
    )


def with_dataset(loader: DataLoader, dataset: Any, batch_size: int) -> DataLoader:
    """``loader`` over another dataset (an IterableDataset's shard), ``batch_size`` a batch."""
    return DataLoader(
        dataset, batch_size=batch_size, drop_last=loader.drop_last, **workers_of(loader)
    )


def workers_of(loader: DataLoader) -> dict[str, Any]:
    """How ``loader`` loads and collates: what a loader rebuilt from it keeps."""
    return {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "prefetch_factor": loader.prefetch_factor if loader.num_workers else None,
        "persistent_workers": loader.persistent_workers,
    }


class SkippedDataLoader:
    """The next pass of a prepared loader without its first batches: iterating it is that
    loader's pass (its epoch counts on); ``len`` is what is left."""

    def __init__(self, loader: PreparedDataLoader, num_batches: int) -> None:
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
            raise ValueError(f"skip_first_batches: num_batches={num_batches!r} must be an int >= 0")
        self.loader, self.num_batches = loader, num_batches

    def __len__(self) -> int:
        return max(len(self.loader) - self.num_batches, 0)

    def __iter__(self) -> Iterator[Any]:
        return self.loader._pass(self.num_batches)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


class DataLoaderStateMixin:
    """Accelerate's mixin of a loader's place in its pass: ``end_of_dataloader`` (the batch
    just yielded is the last), ``remainder`` (real samples of a topped-up last global step,
    else -1); ``begin``/``end`` open and close a pass by hand (``end`` after a ``break``)."""

    end_of_dataloader = False
    remainder = -1

    def reset(self) -> None:
        self.end_of_dataloader, self.remainder = False, -1

    def begin(self) -> None:
        self.reset()

    def end(self) -> None:
        state = getattr(self, "state", None)
        for frame in [f for f in getattr(state, "active", ()) if f.loader is self]:
            state.active.remove(frame)  # type: ignore[union-attr]


class PreparedDataLoader(DataLoaderStateMixin):
    """Iterates a (sharded) DataLoader and yields batches already on ``device``.

    It knows, before yielding it, which batch is the last: ``accumulate`` then syncs gradients
    there even if the window is not full. To know it, it reads one batch ahead, as
    Accelerate's loader does, except where counting is exact and changes nothing else
    (``counted_batches``: a TensorDataset read in this process, as the lessons' data is):
    reading ahead cost a small CPU step about 0.5% (``benchmarks/results/overhead-cpu.md``).
    Like Accelerate's loader it counts epochs: each pass starts with ``set_epoch(epoch)``, and
    a complete pass adds one.
    """

    def __init__(
        self,
        loader: DataLoader,
        device: torch.device | None,
        state: LoopState,
        recorder: Recorder | None = None,
        *,
        non_blocking: bool = False,
    ) -> None:
        self.loader, self.device, self.state = loader, device, state
        # its step meter counts each batch's samples for the live view, times the wait for
        # each batch, and hears when a pass is complete
        self.recorder = recorder
        self.meter = None if recorder is None else recorder.meter
        # a copy to the GPU can run behind the compute (fully so from pinned memory); a CPU
        # "copy" has nothing to overlap with
        on_gpu = device is not None and device.type == "cuda"
        self._non_blocking = (non_blocking or bool(loader.pin_memory)) and on_gpu
        self.epoch = 0
        self.skip_batches = 0  # each pass starts this many batches in (SkipDataLoader)
        # the torch DataLoader underneath (Accelerate's name); isinstance sees its class
        self.base_dataloader = getattr(loader, "loader", loader)
        # a torchdata StatefulDataLoader: its state_dict as of the batch last yielded
        self._stateful = stateful_state(self.base_dataloader)
        self._progress: tuple[torch.Tensor, int] | None = None  # pass in progress: RNG, batches
        self._resume: dict[str, Any] | None = None  # a checkpoint's state, until the next pass

    def __len__(self) -> int:
        return len(self.loader)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        """The torch DataLoader's class (``DataLoader``, ``StatefulDataLoader``), as in
        Accelerate: ``isinstance(loader, DataLoader)`` holds; ``type(loader)`` is the truth."""
        return type(self.base_dataloader)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickle checks __class__, which names the torch class: rebuild this one by its type
        return (_rebuilt, (type(self),), self.__dict__)

    @property
    def batch_size(self) -> int | None:
        """Samples per batch on this rank (None: the batch sampler's batches vary in size)."""
        if self.loader.batch_size is not None:
            return self.loader.batch_size
        return fixed_batch_size(self._batches)  # ShardedBatchSampler: this rank's

    @property
    def _batches(self) -> Any:
        """What yields this rank's batches: the batch sampler, or a sampler that yields whole
        batches itself (``DataLoader(sampler=BatchSampler(...), batch_size=None)``)."""
        loader = self.loader
        return loader.batch_sampler if loader.batch_sampler is not None else loader.sampler

    def set_epoch(self, epoch: int) -> None:
        """Shuffle the next pass as epoch ``epoch``: tells the samplers that have ``set_epoch``
        (the seeded sampler, a ``DistributedSampler``), else the dataset if it has one."""
        self.epoch = epoch
        told = False
        for sampler in _samplers(self._batches):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
                told = True
        if not told and hasattr(self.loader.dataset, "set_epoch"):
            self.loader.dataset.set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:  # dataset, sampler, ...
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        return self._pass(skip=self.skip_batches)

    def skip(self, num_batches: int) -> SkippedDataLoader:
        """The next pass without its first ``num_batches`` batches (``skip_first_batches``)."""
        return SkippedDataLoader(self, num_batches)

    def state_dict(self) -> dict[str, Any]:
        """Where this rank's loader stands: its epoch, and for a pass in progress the batches
        it yielded and the torch RNG state it began with (``save_state`` keeps it). Right
        after ``load_state_dict``, the state it was given (the pass is still to resume).
        Built on a StatefulDataLoader (``use_stateful_dataloader``): its state_dict, as of the
        batch last yielded."""
        if self._stateful is not None:
            return self._stateful.current
        if self._progress is not None:
            begun, batches = self._progress
            return {"epoch": self.epoch, "batches": batches, "rng": begun}
        return dict(self._resume) if self._resume else {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``: the next pass is epoch ``state["epoch"]``; when a pass was in
        progress it is shuffled again exactly as it was (see ``samplers.Replay``), and
        ``state["batches"]`` says how many of its batches to skip. On a StatefulDataLoader:
        its state, and the next pass goes on where that one stopped."""
        if self._stateful is not None:
            self._stateful.load(self.base_dataloader, state)
            return
        if "epoch" not in state:
            raise ValueError(
                f"load_state_dict() got a state with the keys {sorted(state)}, not this loader's "
                "(a StatefulDataLoader's? saved with use_stateful_dataloader=True): load it "
                "with the DataLoaderConfiguration it was saved with."
            )
        self.epoch = state["epoch"]
        self._resume = dict(state)

    def _pass(self, skip: int) -> Iterator[Any]:
        self.set_epoch(self.epoch)
        frame = _Pass(None, loader=self)
        self.state.active.append(frame)
        self.begin()
        stateful = self._stateful
        resume, self._resume = self._resume, None
        replay = resume.get("rng") if resume else None
        begun = torch.get_rng_state() if replay is None else replay
        self._progress = (begun, skip)
        try:
            asked = self._asked()
            loader, replaying = self._loader_for(skip, replay)
            if replaying is not None:  # the pass's own draws, from the state they came from
                replaying.resumed = torch.get_rng_state()
                torch.set_rng_state(replay)  # type: ignore[arg-type]
            # a batch sampler of known length: the last batch counted, each read when asked
            left = counted_batches(loader) if loader is self.loader else None
            try:
                batches = iter(loader)
                current = next(batches, _DONE)
            finally:
                if replaying is not None:
                    replaying.restore()  # done already, unless the sampler never ran
            # the loop runs once a step: what it reads is read once, here; the common batch's
            # check is inline (below), and the meter hears of each batch in one call
            device, non_blocking, meter = self.device, self._non_blocking, self.meter
            yielded, moves = skip, device is not None
            clock = None if meter is None else meter.clock
            while current is not _DONE:
                if stateful is not None:  # before reading ahead: the batches yielded so far
                    stateful.snapshot(self.base_dataloader)
                if left is None:
                    following = next(batches, _DONE)  # read ahead: the wait for it is this batch's
                else:
                    left -= 1
                    following = _LATER if left > 0 else _DONE
                if following is _DONE:  # the sampler is spent: it knows how the epoch ended
                    frame.end = self.end_of_dataloader = True
                    frame.remainder = self._remainder()
                    self.remainder = -1 if frame.remainder is None else frame.remainder
                    if stateful is not None:
                        stateful.snapshot(self.base_dataloader, finished=True)
                batch, samples = current, -1
                kind = type(current)
                if (kind is tuple or kind is list) and current:  # the common batch, inline:
                    for t in current:  # tensors already on the device, kept as they are
                        if type(t) is not torch.Tensor or (moves and t.device != device):
                            break
                    else:
                        samples = current[0].shape[0] if current[0].dim() else 1
                if samples < 0:  # anything else: moved and counted by the general rules
                    if device is not None:
                        batch = send_to_device(current, device, non_blocking)
                    samples = samples_in(current)
                if meter is not None:
                    meter.batch_ready(samples, asked)
                yielded += 1
                self._progress = (begun, yielded)
                yield batch
                asked = None if clock is None else clock()
                current = following if following is not _LATER else next(batches, _DONE)
            if left is not None and (left or next(batches, _DONE) is not _DONE):
                raise NbaccelError(  # counted_batches trusts no sampler whose length is not exact
                    f"this pass of the DataLoader yielded {'fewer' if left else 'more'} batches "
                    f"than its length, {len(loader)}, so its last batch was not the one counted "
                    "as last. This is a bug in nbaccel's counted_batches: please report it."
                )
            self.epoch += 1
            if meter is not None:
                meter.epoch_done()
        finally:  # complete, or left early (a break): no pass in progress to resume
            self._progress = None
            if frame in self.state.active:  # end() may have closed it already
                self.state.active.remove(frame)

    def _loader_for(self, skip: int, replay: torch.Tensor | None) -> tuple[Any, Replay | None]:
        """The loader for a pass: this one, or a copy whose batch sampler skips ``skip``
        batches and, resuming, draws its shuffle as the pass first did (the ``Replay``)."""
        if not skip and replay is None:
            return self.loader, None
        if self._stateful is not None:  # read and drop: the StatefulDataLoader counts them
            return itertools.islice(self.loader, skip, None), None
        if isinstance(self.loader.dataset, IterableDataset):
            if replay is not None:
                raise NbaccelError(
                    "this DataLoader reads an IterableDataset, and a checkpoint's pass over a "
                    "stream cannot be resumed: the stream has no indices to replay, and what "
                    "it drew from the RNG was interleaved with training's draws. Start the "
                    "epoch from its beginning: loader.load_state_dict({'epoch': loader.epoch}) "
                    "before iterating; or resume the stream yourself (e.g. a dataset with its "
                    "own state_dict, registered with accelerator.register_for_checkpointing)."
                )
            # read and drop the skipped batches, as Accelerate does (dispatched: every rank
            # takes part in their broadcasts)
            return itertools.islice(self.loader, skip, None), None
        if isinstance(self.loader, DispatchedDataLoader):
            # rank 0 reads every batch, so it skips by reading; resuming, its sampler draws
            # the pass's order from the saved RNG state when the first step is read
            replaying = Replay(None, 0, replay)
            return itertools.islice(
                self.loader, skip, None
            ), replaying if replay is not None else None
        batches = self._batches
        if batches is None:
            if replay is not None:
                logger.warning("this DataLoader has no batch sampler: its order is not replayed")
            return itertools.islice(self.loader, skip, None), None  # reads the skipped batches
        as_sampler = self.loader.batch_sampler is None
        replaying = Replay(batches, skip, replay)
        loader = with_batch_sampler(self.loader, replaying, as_sampler)
        return loader, (replaying if replay is not None else None)

    def _remainder(self) -> int | None:
        """Real samples in the pass's last global step if it was topped up, else None; asked
        when the pass is spent."""
        source = self._batches
        if isinstance(self.loader, DispatchedDataLoader):
            source = self.loader
        elif isinstance(self.loader.dataset, IterableDatasetShard):
            return self.loader.dataset.real_samples_of_last_step()
        if isinstance(source, ShardedBatchSampler | DispatchedDataLoader):
            return source.remainder
        return None

    def _asked(self) -> float | None:
        """When the loop asked for a batch, on the meter's clock (None: not timed)."""
        return None if self.meter is None else self.meter.now()


def _samplers(batch_sampler: Any) -> Iterator[Any]:
    """A batch sampler, the batch sampler it shards, and their samplers."""
    while batch_sampler is not None:
        yield batch_sampler
        if getattr(batch_sampler, "sampler", None) is not None:
            yield batch_sampler.sampler
        batch_sampler = getattr(batch_sampler, "batch_sampler", None)


def _rebuilt(kind: type) -> Any:
    return object.__new__(kind)


_DONE = object()
_LATER = object()  # the next batch, not read yet
