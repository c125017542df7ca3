"""Property-based fuzzing of the control protocol (issue 13, bounded input): the frame reader, the message
parser and the version check take arbitrary bytes / JSON and only ever answer with their typed errors; a live
control server fed arbitrary frames keeps its slot untouched and still serves a well-formed hello."""

from __future__ import annotations

import json
import socket
import struct
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tilepd.control.compat import check_raw_hello
from tilepd.control.framing import MAX_FRAME_BYTES, FrameError, encode_frame, recv_frame, send_frame
from tilepd.control.messages import ProtocolError, parse_message
from tilepd.runtime.slot import State
from tests.control.test_protocol import _hello, node  # noqa: F401  (node is the real control server fixture)

TYPES = ["hello", "hello_ok", "error", "admit", "accept", "reject", "done", "ack", "bogus", None, 1]
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.text(max_size=40))
json_value = st.recursive(json_leaf, lambda kids: st.one_of(st.lists(kids, max_size=5), st.dictionaries(st.text(max_size=12), kids, max_size=5)),
                          max_leaves=25)
KEYS = ["type", "protocol", "layout", "transport", "max_seq_len", "sender_rank", "tp_size", "transfer_id", "token", "seq_len",
        "num_blocks", "generation", "bytes", "ok", "checksums", "dst", "code", "message", "tilepd_version"]
messages = st.dictionaries(st.sampled_from(KEYS), json_value, max_size=10).flatmap(
    lambda d: st.sampled_from(TYPES).map(lambda t: {**d, "type": t} if t is not None else d))
FUZZ = settings(max_examples=100, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _read(raw: bytes) -> object:
    a, b = socket.socketpair()
    try:
        a.sendall(raw)
        a.shutdown(socket.SHUT_WR)
        b.settimeout(2)
        return recv_frame(b)
    finally:
        a.close()
        b.close()


@FUZZ
@given(st.binary(max_size=512))
def test_frame_reader_takes_any_bytes(raw: bytes) -> None:
    try:
        obj = _read(raw)
    except FrameError:
        return
    assert isinstance(obj, dict)


@FUZZ
@given(st.integers(0, 2**32 - 1), st.binary(max_size=64))
def test_frame_length_is_capped_before_reading(length: int, tail: bytes) -> None:
    started = time.monotonic()
    try:
        _read(struct.pack(">I", length) + tail)
    except FrameError as e:
        if length > MAX_FRAME_BYTES:
            assert "exceeds" in str(e)
    assert time.monotonic() - started < 2.5  # never waits on a length it refused


@FUZZ
@given(messages)
def test_parser_and_version_check_answer_only_with_protocol_errors(msg: dict) -> None:
    try:
        json.dumps(msg, allow_nan=False)
    except ValueError:
        return  # not representable as a frame (NaN/inf): the sender's json.dumps refuses it first
    for step in (check_raw_hello, parse_message):
        try:
            step(msg)
        except ProtocolError as e:
            assert e.code and str(e)
            return


@settings(max_examples=25, deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(messages, min_size=1, max_size=3))
def test_a_live_node_fed_arbitrary_frames_keeps_its_slot(node, frames: list[dict]) -> None:  # noqa: F811
    before = node.slot.state
    with socket.create_connection(("127.0.0.1", node.port), timeout=5) as s:
        s.settimeout(5)
        for msg in frames:
            try:
                s.sendall(encode_frame(json.loads(json.dumps(msg, default=str))))
            except (ValueError, OSError, FrameError):
                break  # NaN/inf not encodable, or the node already closed the connection: both fine
            try:
                reply = recv_frame(s)
            except (FrameError, OSError):
                break  # the node closed the connection on a bad frame
            assert reply.get("type") in ("hello_ok", "error", "reject", "ack", "accept"), reply
    assert node.slot.state == before == State.FREE
    with socket.create_connection(("127.0.0.1", node.port), timeout=5) as s:  # and still serves a good hello
        send_frame(s, _hello())
        assert recv_frame(s)["type"] == "hello_ok"
