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
    MissingDescriptors,
    Refused,
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
    [Signal(3, 15), Started(3, (101, 102)), Refused(3, "why"), Exited(101, -9)],
    ids=lambda m: type(m).__name__,
)
def test_each_control_message_crosses_a_socketpair_intact(pair, message):
    ours, theirs = pair
    send(ours, message)
    received, fds = recv(theirs)
    assert received == message and type(received) is type(message) and fds == []


def test_descriptors_travel_with_a_start_and_still_work(pair):
    ours, theirs = pair
    read, write = os.pipe()
    extra = [os.dup(write) for _ in range(3)]  # four per worker
    try:
        send(ours, Start(0, (SPEC,)), [write, *extra])
        message, fds = recv(theirs)
        assert message == Start(0, (SPEC,)) and len(fds) == 4
        os.write(fds[0], b"through the passed fd")
        for fd in fds:
            os.close(fd)
        assert os.read(read, 100) == b"through the passed fd"
    finally:
        for fd in [read, write, *extra]:
            os.close(fd)


def test_more_descriptors_than_one_message_carries_arrive_in_order(pair):
    # Linux passes at most 253 descriptors in one message (SCM_MAX_FD): 70 workers' 280 travel
    # one worker to a message, and each worker gets its own four.
    ours, theirs = pair
    theirs.settimeout(10)  # a hang catcher: a sender that failed sends nothing
    pipes = [os.pipe() for _ in range(70 * 4)]
    start = Start(1, (SPEC,) * 70)
    sender = threading.Thread(target=send, args=(ours, start, [w for _, w in pipes]))
    sender.start()
    try:
        message, fds = recv(theirs)
        sender.join()
        assert message == start and len(fds) == 280
        for i, fd in enumerate(fds):
            os.write(fd, str(i).encode())
            os.close(fd)
        assert [os.read(r, 10) for r, _ in pipes] == [str(i).encode() for i in range(280)]
    finally:
        sender.join()
        for r, w in pipes:
            os.close(r)
            os.close(w)


def test_a_short_descriptor_set_is_closed_and_the_stream_stays_in_step(pair):
    ours, theirs = pair
    read, write = os.pipe()
    sent = [os.dup(write) for _ in range(7)]
    try:
        # The second worker's set came short, as when the receiver's open-file limit cut it
        # (MSG_CTRUNC): the framing written out, since send() refuses a short set.
        data = encode(Start(2, (SPEC, SPEC)))
        ours.sendall(len(data).to_bytes(4, "big") + data)
        socket.send_fds(ours, [b"\0"], sent[:4])
        socket.send_fds(ours, [b"\0"], sent[4:])
        send(ours, Signal(2, 15))
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(MissingDescriptors, match="received 7 of the 8 file descriptors"):
            recv(theirs)
        assert len(os.listdir("/proc/self/fd")) == before  # what arrived was closed
        assert recv(theirs) == (Signal(2, 15), [])  # the next message, whole
    finally:
        for fd in [read, write, *sent]:
            os.close(fd)


def test_a_message_with_the_wrong_number_of_descriptors_is_not_sent(pair):
    ours, _ = pair
    with pytest.raises(ValueError, match=r"this Start sends 8 descriptors .* not 3"):
        send(ours, Start(0, (SPEC, SPEC)), [0, 1, 2])
    with pytest.raises(ValueError, match=r"this Signal sends 0 descriptors .* not 1"):
        send(ours, Signal(0, 15), [0])


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
