"""``get_logger`` and the environment helpers (``patch_environment``, ``clear_environment``,
``check_os_kernel``) from ``nbaccel.utils``, beside Accelerate's where they can be compared."""

from __future__ import annotations

import inspect
import logging
import os
from unittest.mock import Mock, patch

import accelerate.utils as theirs
import pytest

from nbaccel.utils import check_os_kernel, clear_environment, get_logger, patch_environment

RANK_1_OF_2 = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


@pytest.fixture
def root_level():
    """get_logger(log_level=...) sets the root logger's level too: put it back."""
    level = logging.getLogger().level
    yield
    logging.getLogger().setLevel(level)


def test_a_message_names_the_rank_and_the_caller_without_any_state(caplog):
    logger = get_logger("nbaccel.test.caller")
    with caplog.at_level(logging.INFO):
        line = inspect.currentframe().f_lineno + 1  # the next line logs
        logger.info("hello %s", "there")
    (record,) = caplog.records
    assert record.getMessage() == "[RANK 0] hello there"
    assert record.lineno == line and record.filename == os.path.basename(__file__)
    assert record.funcName == "test_a_message_names_the_rank_and_the_caller_without_any_state"


def test_only_rank_0_logs_unless_asked(caplog, monkeypatch):
    for name, value in RANK_1_OF_2.items():
        monkeypatch.setenv(name, value)
    logger = get_logger("nbaccel.test.ranks")
    with caplog.at_level(logging.INFO):
        logger.info("main only")
        logger.warning("everyone", main_process_only=False)
    assert [r.getMessage() for r in caplog.records] == ["[RANK 1] everyone"]
    with pytest.raises(RuntimeError, match="needs the process group"):
        logger.warning("in turn", in_order=True)


def test_in_order_on_one_process_logs_once(caplog):
    logger = get_logger("nbaccel.test.order")
    with caplog.at_level(logging.INFO):
        logger.info("in turn", in_order=True)
    assert [r.getMessage() for r in caplog.records] == ["[RANK 0] in turn"]


def test_log_level_sets_this_logger_and_the_root(caplog, root_level, monkeypatch):
    logger = get_logger("nbaccel.test.level", log_level="debug")
    assert logger.logger.level == logging.getLogger().level == logging.DEBUG
    monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "error")
    assert get_logger("nbaccel.test.level2").logger.level == logging.ERROR
    with caplog.at_level(logging.DEBUG):
        logger.debug("low")
    assert [r.getMessage() for r in caplog.records] == ["[RANK 0] low"]


def test_warning_once(caplog):
    logger = get_logger("nbaccel.test.once")
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            logger.warning_once("careful")
        logger.warning_once("another")
        logger.warning_once(["unhashable"])
    assert [r.getMessage() for r in caplog.records] == [
        "[RANK 0] careful",
        "[RANK 0] another",
        "[RANK 0] ['unhashable']",
    ]
    assert {r.filename for r in caplog.records} == {os.path.basename(__file__)}


@pytest.mark.parametrize("helper", [patch_environment, theirs.patch_environment])
def test_patch_environment_restores_each_variable(helper, monkeypatch):
    monkeypatch.setenv("NBACCEL_TEST_KEPT", "before")
    monkeypatch.delenv("NBACCEL_TEST_NEW", raising=False)
    with pytest.raises(KeyError), helper(nbaccel_test_kept=1, NBACCEL_TEST_NEW=2.5):
        assert os.environ["NBACCEL_TEST_KEPT"] == "1"
        assert os.environ["NBACCEL_TEST_NEW"] == "2.5"
        raise KeyError
    assert os.environ["NBACCEL_TEST_KEPT"] == "before"
    assert "NBACCEL_TEST_NEW" not in os.environ


def test_clear_environment_empties_then_restores(monkeypatch):
    monkeypatch.setenv("NBACCEL_TEST_KEPT", "before")
    before = dict(os.environ)
    with clear_environment():
        assert dict(os.environ) == {}
        os.environ["NBACCEL_TEST_INSIDE"] = "x"
    assert dict(os.environ) == before


@pytest.mark.parametrize(
    "system, release, warns",
    [
        ("Linux", "5.4.0-35-generic", True),
        ("Linux", "5.15.0-35-generic", False),
        ("Linux", "4.19.112+", True),
        ("Darwin", "5.4.0", False),
        ("Linux", "unknown", False),
    ],
)
def test_check_os_kernel_warns_below_5_5_on_linux(system, release, warns, caplog):
    uname = Mock(release=release, system=system)
    with patch("platform.uname", return_value=uname), caplog.at_level(logging.WARNING):
        check_os_kernel()
    assert len(caplog.records) == warns
    if warns:
        assert release.split("-")[0].rstrip("+") in caplog.records[0].getMessage()
        assert "5.5.0" in caplog.records[0].getMessage()
