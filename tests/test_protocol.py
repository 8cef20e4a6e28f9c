"""The wire schema: round trips, tensor frames, and typed errors for anything malformed."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nebula_flow import protocol
from nebula_flow.protocol import Message, ProtocolError


def roundtrip(msg: Message) -> Message:
    return protocol.decode([bytes(memoryview(f)) if not isinstance(f, bytes) else f for f in protocol.encode(msg)])


def test_roundtrip_with_tensor_frames() -> None:
    msg = Message("SUBMIT", {"req_id": "a", "params": {"max_new_tokens": 3}})
    msg.header["prompt_tokens"] = msg.add_array(np.arange(5, dtype=np.int32))
    out = roundtrip(msg)
    assert out.kind == "SUBMIT" and out.header["req_id"] == "a"
    assert out.int_list(out.header["prompt_tokens"], "prompt_tokens") == [0, 1, 2, 3, 4]


def test_proposal_q_roundtrip_and_validation() -> None:
    msg = Message("RESULT", {"results": [], "busy_s": 0.0})
    head = {"draft": [3, 4]}
    idx = [np.array([3, 1], np.int32), np.array([4], np.int32)]
    prob = [np.array([0.7, 0.3], np.float32), np.array([1.0], np.float32)]
    protocol.attach_q(msg, head, idx, prob)
    out = roundtrip(Message("RESULT", {"results": [head], "busy_s": 0.0}, msg.frames))
    got_idx, got_prob = protocol.split_q(out, out.header["results"][0])
    assert [a.tolist() for a in got_idx] == [[3, 1], [4]]
    head["q_len"] = [1, 1]  # lengths that do not add up to the frames
    with pytest.raises(ProtocolError, match="does not match"):
        protocol.split_q(msg, head)


@pytest.mark.parametrize("frames, code", [
    ([b"SUBMIT"], "malformed"),
    ([b"NOPE", b"{}"], "unknown_kind"),
    ([b"STATUS", b"not json"], "malformed"),
    ([b"STATUS", b"[1]"], "malformed"),
    ([b"STATUS", b'{"v": 99}'], "bad_version"),
    ([b"CANCEL", b'{"v": 1}'], "malformed"),
    ([b"CANCEL", b'{"v": 1, "req_id": 5}'], "malformed"),
    ([b"PULL", b'{"v": 1, "credits": true, "idle": true}'], "malformed"),
])
def test_malformed_messages_raise_typed_errors(frames: list[bytes], code: str) -> None:
    with pytest.raises(ProtocolError) as err:
        protocol.decode(frames)
    assert err.value.code == code


def test_tensor_descriptor_mismatches_are_rejected() -> None:
    msg = protocol.decode([b"TASKS", orjson.dumps({"v": 1, "tasks": []}), b"\x00" * 12])
    assert msg.array({"f": 0, "dtype": "int32", "shape": [3]}).tolist() == [0, 0, 0]
    for desc, code in [({"f": 0, "dtype": "int32", "shape": [4]}, "bad_frame"),  # truncated frame
                       ({"f": 1, "dtype": "int32", "shape": [1]}, "bad_frame"),  # missing frame
                       ({"f": 0, "dtype": "object", "shape": [1]}, "malformed"),
                       ({"f": 0, "dtype": "int32", "shape": [-3]}, "malformed"),
                       ({"f": 0}, "malformed")]:
        with pytest.raises(ProtocolError) as err:
            msg.array(desc)
        assert err.value.code == code


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=5),
       st.sampled_from(list(protocol.SCHEMA)),
       st.dictionaries(st.text(max_size=8), st.one_of(st.none(), st.integers(-2**63, 2**63 - 1), st.text(max_size=8),
                                                      st.booleans(), st.lists(st.integers(-2**63, 2**63 - 1), max_size=3)), max_size=5))
def test_decode_never_fails_with_anything_but_protocol_error(extra: list[bytes], kind: str, header: dict) -> None:
    for frames in ([kind.encode(), orjson.dumps(dict(header, v=1)), *extra], extra):
        try:
            msg = protocol.decode(frames)
        except ProtocolError:
            continue
        assert msg.kind in protocol.SCHEMA
