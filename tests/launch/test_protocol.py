"""The launch protocol: typed messages through real sockets, and exceptions as data."""

from __future__ import annotations

import os
import pickle
import re
import socket
import threading
import traceback

import pytest

from nbaccel.launch.protocol import (
    ExceptionData,
    Exited,
    Failure,
    Result,
    Signal,
    Start,
    Started,
    WorkerSpec,
    decode,
    encode,
    pack_call,
    recv,
    send,
    unpack_call,
)

SPEC = WorkerSpec({"RANK": "0"}, "/tmp", ["/x"], threads=2, local_rank=0)


@pytest.fixture
def pair():
    ours, theirs = socket.socketpair()
    yield ours, theirs
    ours.close()
    theirs.close()


@pytest.mark.parametrize(
    "message",
    [Start(3, (SPEC, SPEC)), Signal(3, 15), Started(3, (101, 102)), Exited(101, -9)],
    ids=lambda m: type(m).__name__,
)
def test_each_control_message_crosses_a_socketpair_intact(pair, message):
    ours, theirs = pair
    send(ours, message)
    received, fds = recv(theirs)
    assert received == message and type(received) is type(message) and fds == []


def test_descriptors_travel_with_a_message_and_still_work(pair):
    ours, theirs = pair
    read, write = os.pipe()
    try:
        send(ours, Start(0, (SPEC,)), [write])
        message, fds = recv(theirs, max_fds=4)
        assert message == Start(0, (SPEC,)) and len(fds) == 1
        os.write(fds[0], b"through the passed fd")
        os.close(fds[0])
        assert os.read(read, 100) == b"through the passed fd"
    finally:
        os.close(read)
        os.close(write)


def test_a_large_message_arrives_whole(pair):
    ours, theirs = pair
    big = Result(os.urandom(3 << 20))  # more than one recv() and more than the socket buffer
    sender = threading.Thread(target=send, args=(ours, big))
    sender.start()
    assert recv(theirs)[0] == big
    sender.join()


def test_a_closed_peer_is_eof_and_foreign_data_is_refused(pair):
    ours, theirs = pair
    with pytest.raises(TypeError, match="is not a message of nbaccel's launch protocol"):
        encode({"kind": "launch"})  # the old string-keyed dicts are not messages
    with pytest.raises(TypeError, match="received dict, not a launch protocol message"):
        decode(pickle.dumps({"kind": "started"}))
    ours.close()
    with pytest.raises(EOFError, match="closed the control socket"):
        recv(theirs)


def _raise_chained():
    try:
        {}["missing"]
    except KeyError as err:
        raise ValueError("the config had no entry") from err


def _without_carets(text: str) -> str:
    """Python 3.11+ marks the failing expression with ^ lines; frames sent as data have no
    column numbers, so those lines are the one thing that may differ."""
    return "\n".join(line for line in text.splitlines() if not re.fullmatch(r"\s*[\^~]+\s*", line))


def test_an_exception_becomes_data_and_back_with_its_traceback_text():
    try:
        _raise_chained()
    except ValueError as err:
        expected = "".join(traceback.format_exception(err))
        data = ExceptionData.of(err)
    failure = decode(encode(Failure(data, collective=False)))  # as it crosses the socket
    text = failure.exception.format()
    assert _without_carets(text) == _without_carets(expected)
    assert "The above exception was the direct cause" in text and "in _raise_chained" in text
    assert failure.exception.cause.type == "KeyError" and failure.exception.type == "ValueError"


def test_exceptions_outside_builtins_keep_their_module_and_the_runners_frames_are_hidden():
    class Custom(Exception):
        pass

    def run():  # stands for forkserver.run_worker: its frame is noise to the user
        user_code()

    def user_code():
        raise Custom("from the user")

    try:
        run()
    except Custom as err:
        shown = ExceptionData.of(err, hide=__file__)
        full = ExceptionData.of(err)
    assert [f[2] for f in full.frames][-2:] == ["run", "user_code"]
    assert shown.frames == ()  # every leading frame was in this file
    assert f"{__name__}.{Custom.__qualname__}: from the user" in full.format()


def test_the_call_travels_by_value():
    offset = 5

    def add(x, y=0):  # a closure, as a notebook cell's function is: not importable by name
        return x + y + offset

    function, args, kwargs = unpack_call(pack_call(add, [1], {"y": 2}))
    assert function(*args, **kwargs) == 8 and args == (1,)
    with pytest.raises(TypeError, match="cannot send 'add' and its arguments"):
        pack_call(add, (threading.Lock(),), {})
