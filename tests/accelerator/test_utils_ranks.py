"""``nbaccel.utils``'s helpers on 2 CPU ranks (gloo), in one launch: ``pad_across_processes``
leaves a nested tensor as it is (with Accelerate's warning) and pads the rest as torch would,
and ``get_logger`` logs on rank 0 only, on every rank, or on every rank in rank order."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from nbaccel.utils import (
    CannotPadNestedTensorWarning,
    PartialState,
    get_logger,
    pad_across_processes,
)

from ..distributed import run_ranks

pytestmark = pytest.mark.multiprocess


def every_case(log_file: str) -> dict:
    state = PartialState(cpu=True)
    rank = state.process_index
    nested = torch.nested.nested_tensor([torch.ones(1 + rank), torch.ones(3)])
    ragged = torch.full((1 + 2 * rank, 2), float(rank + 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        padded = pad_across_processes({"nested": nested, "ragged": ragged}, pad_index=-1)
    logger = get_logger(f"nbaccel.test.ranks.{rank}")
    logger.logger.setLevel(logging.INFO)
    logger.logger.propagate = False
    handler = logging.FileHandler(log_file)
    logger.logger.addHandler(handler)
    try:
        logger.info("main only")
        logger.info("everyone", main_process_only=False)
        for turn in range(2):
            logger.info(f"turn {turn}", in_order=True)
            handler.flush()
    finally:
        handler.close()
        logger.logger.removeHandler(handler)
    state.wait_for_everyone()
    return {
        "warned": [w.category.__name__ for w in caught],
        "nested kept": padded["nested"] is nested,
        "ragged": padded["ragged"],
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    log_file = tmp_path_factory.mktemp("logs") / "ranks.log"
    log_file.touch()
    results = run_ranks(every_case, str(log_file), timeout=180)
    return results, log_file.read_text().splitlines()


def test_pad_leaves_a_nested_tensor_and_pads_the_rest(two_ranks):
    results, _ = two_ranks
    for rank, result in enumerate(results):
        assert result["warned"] == [CannotPadNestedTensorWarning.__name__]
        assert result["nested kept"]
        by_hand = torch.full((3, 2), -1.0)
        by_hand[: 1 + 2 * rank] = rank + 1
        assert torch.equal(result["ragged"], by_hand)


def test_the_logger_logs_on_rank_0_on_every_rank_or_in_rank_order(two_ranks):
    _, lines = two_ranks
    assert lines.count("[RANK 0] main only") == 1 and "[RANK 1] main only" not in lines
    assert sorted(line for line in lines if "everyone" in line) == [
        "[RANK 0] everyone",
        "[RANK 1] everyone",
    ]
    turns = [line for line in lines if "turn" in line]
    assert turns == [f"[RANK {r}] turn {t}" for t in (0, 1) for r in (0, 1)]
