"""The wire schema: round trips, tensor frames, and typed errors for anything malformed."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nebula_flow import protocol
from nebula_flow.protocol import (
    Holder,
    KvData,
    KvRows,
    ProtocolError,
    Register,
    Rejected,
    Result,
    Submit,
    TaskResult,
    Tasks,
    TaskSpec,
)

V = b'{"v": %d' % protocol.VERSION  # a header's start, for raw headers below


def roundtrip(msg: protocol.Msg) -> protocol.Msg:
    return protocol.decode([bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f
                            for f in protocol.encode(msg)])


def test_roundtrip_with_tensor_frames() -> None:
    out = roundtrip(Submit("a", {"max_new_tokens": 3}, prompt_tokens=np.arange(5, dtype=np.int32)))
    assert isinstance(out, Submit) and out.req_id == "a" and out.prompt is None
    assert out.prompt_tokens.tolist() == [0, 1, 2, 3, 4]


def test_fields_at_their_defaults_stay_off_the_wire_and_come_back() -> None:
    task = TaskSpec(1, "verify", 2, 3, np.arange(4, dtype=np.int32), 2, {}, 9, Holder(5, 4, "tcp://h:1"), draft=[3, 4])
    frames = protocol.encode(Tasks([task]))
    header = orjson.loads(frames[1])
    assert set(header["tasks"][0]) == {"rid", "kind", "round", "attempt", "tokens", "k", "params", "seed", "holder",
                                       "draft"}
    [back] = roundtrip(Tasks([task])).tasks
    assert (back.rid, back.draft, back.runner_ups, back.chains, back.fuse, back.q_len) == (1, [3, 4], [], [], 0, None)
    assert back.holder == Holder(5, 4, "tcp://h:1") and back.tokens.tolist() == [0, 1, 2, 3]


def test_proposal_q_roundtrip_and_validation() -> None:
    out = TaskResult(1, "draft", 1, 1, draft=[3, 4])
    out.propose([np.array([3, 1], np.int32), np.array([4], np.int32)],
                [np.array([0.7, 0.3], np.float32), np.array([1.0], np.float32)])
    [got] = roundtrip(Result([out])).results
    idx, prob = got.proposal()
    assert [a.tolist() for a in idx] == [[3, 1], [4]] and prob[0].tolist() == pytest.approx([0.7, 0.3])
    out.q_len = [1, 1]  # lengths that do not add up to the frames: that item is refused
    [bad] = roundtrip(Result([out])).results
    assert isinstance(bad, Rejected) and "does not match" in bad.error.message and bad.head["rid"] == 1


def test_a_bad_task_in_a_batch_is_refused_alone() -> None:
    good = TaskSpec(1, "verify", 1, 1, np.arange(3, dtype=np.int32), 0, {}, 1, Holder())
    bad = TaskSpec(2, "verify", 1, 1, np.arange(3, dtype=np.int32), 0, {}, 1, Holder(), runner_ups=[4])  # (no draft)
    got = roundtrip(Tasks([good, bad, good])).tasks
    assert [type(t).__name__ for t in got] == ["TaskSpec", "Rejected", "TaskSpec"]
    assert got[1].head == {"rid": 2, "kind": "verify", "round": 1, "attempt": 1} and "runner_ups" in got[1].error.message


@pytest.mark.parametrize("draft", ["[true]", "[-1]", "[2147483648]", "[1.0]", '["5"]', "5", '{"0": 1}', "[[1]]"])
def test_a_result_with_bad_token_ids_is_refused_alone(draft: str) -> None:
    """Token ids are whole numbers in int32's range: no bool, float, string, negative or nested id."""
    head = b'"rid": 1, "kind": "draft", "round": 1, "attempt": 1'
    frames = [b"RESULT", V + b', "results": [{' + head + b', "draft": [7, 8]}, {' + head.replace(b'"rid": 1', b'"rid": 2')
              + b', "draft": ' + draft.encode() + b'}]}']
    got = protocol.decode(frames).results
    assert isinstance(got[0], TaskResult) and got[0].draft == [7, 8]
    assert isinstance(got[1], Rejected) and got[1].error.code == "malformed" and got[1].head["rid"] == 2


@pytest.mark.parametrize("frames, code", [
    ([b"SUBMIT"], "malformed"),
    ([b"NOPE", b"{}"], "unknown_kind"),
    ([b"STATUS", b"not json"], "malformed"),
    ([b"STATUS", b"[1]"], "malformed"),
    ([b"STATUS", b'{"v": 99}'], "bad_version"),
    ([b"CANCEL", V + b'}'], "malformed"),
    ([b"CANCEL", V + b', "req_id": 5}'], "malformed"),
    ([b"PULL", V + b', "credits": true, "idle": true}'], "malformed"),  # (a bool is not an int)
    ([b"PULL", V + b', "credits": 2, "idle": 1}'], "malformed"),  # (nor an int a bool)
    ([b"PULL", V + b', "credits": null, "idle": true}'], "malformed"),  # (null: absent, and it is required)
    ([b"FREE", V + b', "rids": [1, "2"]}'], "malformed"),
    ([b"TASKS", V + b', "tasks": {"rid": 1}}'], "malformed"),
    ([b"SUBMIT", V + b', "req_id": "a", "params": {}}'], "malformed"),  # neither prompt nor tokens
    ([b"SUBMIT", V + b', "req_id": "", "params": {}, "prompt": "x"}'], "malformed"),
    ([b"REGISTER", V + b', "role": "draft", "name": "x", "capacity": 0, "model": {}}'], "invalid_params"),
    ([b"REGISTER", V + b', "role": "draft", "name": "x", "capacity": 1, "model": {}, "drafter": "a b"}'],
     "malformed"),
    ([b"KV_PULL", V + b', "seq": 1, "items": [[1, "target", 3, 2]]}'], "malformed"),
    ([b"RESULT", V + b', "results": [], "busy_s": "slow"}'], "malformed"),
])
def test_malformed_messages_raise_typed_errors(frames: list[bytes], code: str) -> None:
    with pytest.raises(ProtocolError) as err:
        protocol.decode(frames)
    assert err.value.code == code


def test_tensor_descriptor_mismatches_are_rejected() -> None:
    frames = [b"\x00" * 12]
    assert protocol.array({"f": 0, "dtype": "int32", "shape": [3]}, frames).tolist() == [0, 0, 0]
    for desc, code in [({"f": 0, "dtype": "int32", "shape": [4]}, "bad_frame"),  # truncated frame
                       ({"f": 1, "dtype": "int32", "shape": [1]}, "bad_frame"),  # missing frame
                       ({"f": 0, "dtype": "object", "shape": [1]}, "malformed"),
                       ({"f": 0, "dtype": "int32", "shape": [-3]}, "malformed"),
                       ({"f": 0}, "malformed")]:
        with pytest.raises(ProtocolError) as err:
            protocol.array(desc, frames)
        assert err.value.code == code


def test_small_integer_vectors_share_one_packed_frame_and_are_checked() -> None:
    """A batch's tokens share one frame per dtype, each task's a read-only slice of it; a long
    prompt still gets a frame of its own; a packed descriptor or frame that does not fit is
    refused with a clear code."""
    from nebula_flow.protocol import Holder, Submit, Tasks, TaskSpec
    from nebula_flow.wire import PACK_MAX, Frames

    tokens = [np.arange(n, dtype=np.int32) + n for n in (3, 300, 1)]
    tasks = [TaskSpec(i, "draft", 1, 0, t, 4, {}, 7, Holder(), draft=[]) for i, t in enumerate(tokens)]
    frames = protocol.encode(Tasks(tasks))
    assert len(frames) == 3  # (kind, header, one int32 frame for all three)
    got = protocol.decode([bytes(f) for f in frames])
    assert [t.tokens.tolist() for t in got.tasks] == [t.tolist() for t in tokens]
    assert not got.tasks[1].tokens.flags.writeable
    both = protocol.encode(Submit("a", {}, prompt_tokens=np.arange(5, dtype=np.int64)))
    assert protocol.decode(both).prompt_tokens.dtype == np.int64
    long = protocol.encode(Submit("b", {}, prompt_tokens=np.arange(PACK_MAX + 1, dtype=np.int32)))
    assert len(long) == 3 and "packs" not in orjson.loads(long[1]) and protocol.decode(long).prompt_tokens[-1] == PACK_MAX

    packs = Frames.received({"packs": {"int32": 0}}, [np.arange(4, dtype=np.int32).tobytes()])
    assert protocol.array({"p": "int32", "o": 1, "n": 2}, packs).tolist() == [1, 2]
    for desc, code in [({"p": "int32", "o": 3, "n": 2}, "malformed"),  # past the frame's end
                       ({"p": "int32", "o": -1, "n": 1}, "malformed"),
                       ({"p": "int32", "o": True, "n": 1}, "malformed"),
                       ({"p": "int64", "o": 0, "n": 1}, "bad_frame"),  # no such pack
                       ({"p": "int32", "o": 0, "n": 1, "x": 1}, "bad_frame")]:
        with pytest.raises(ProtocolError) as err:
            protocol.array(desc, packs)
        assert err.value.code == code, desc
    for header, raw in [({"packs": {"float32": 0}}, [b"\x00" * 4]),  # (floats travel as frames of their own)
                        ({"packs": {"int32": 1}}, [b"\x00" * 4]),  # missing frame
                        ({"packs": {"int32": 0}}, [b"\x00" * 5]),  # not whole int32s
                        ({"packs": [0]}, [b""])]:
        with pytest.raises(ProtocolError):
            Frames.received(header, raw)
    bad = TaskSpec(0, "draft", 1, 0, np.array([-1], np.int32), 4, {}, 7, Holder())
    rejected = protocol.decode(protocol.encode(Tasks([bad]))).tasks[0]  # (a packed slice is checked as any tensor)
    assert isinstance(rejected, protocol.Rejected) and rejected.error.code == "malformed"


def test_kv_data_carries_missing_items_as_null() -> None:
    got = roundtrip(KvData(3, [None, KvRows(np.arange(2, dtype=np.int32), np.ones((2, 4), np.float32))]))
    assert got.seq == 3 and got.items[0] is None and got.items[1].rows.shape == (2, 4)


def test_a_tokenize_gives_one_source_and_its_answer_round_trips() -> None:
    ask = roundtrip(protocol.Tokenize("t", messages=[{"role": "user", "content": "hi"}], special=False, pieces=True))
    assert ask.messages == [{"role": "user", "content": "hi"}] and not ask.special and ask.pieces
    for bad in (protocol.Tokenize("t"), protocol.Tokenize("t", prompt="a", token_ids=np.arange(2)),
                protocol.Tokenize("t", token_ids=np.ones((2, 2), np.int64)), protocol.Tokenize("", prompt="a")):
        with pytest.raises(ProtocolError, match="malformed"):
            roundtrip(bad)
    back = roundtrip(protocol.Tokenized("t", np.arange(3, dtype=np.int32), 2048, "abc", ["a", "b", "c"]))
    assert back.token_ids.tolist() == [0, 1, 2] and (back.max_model_len, back.text, back.pieces) == (2048, "abc",
                                                                                                   ["a", "b", "c"])


def test_every_kind_has_a_documented_class_and_round_trips_at_its_defaults() -> None:
    for kind, cls in protocol.KINDS.items():
        assert cls.__doc__ and cls.KIND == kind
    assert roundtrip(Register("draft", "w", 4, {"vocab_size": 9}, drafter="ngram")) == \
        Register("draft", "w", 4, {"vocab_size": 9}, None, "ngram")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=5),
       st.sampled_from(list(protocol.KINDS)),
       st.dictionaries(st.text(max_size=8), st.one_of(st.none(), st.integers(-2**63, 2**63 - 1), st.text(max_size=8),
                                                      st.booleans(), st.lists(st.integers(-2**63, 2**63 - 1), max_size=3)), max_size=5))
def test_decode_never_fails_with_anything_but_protocol_error(extra: list[bytes], kind: str, header: dict) -> None:
    for frames in ([kind.encode(), orjson.dumps(dict(header, v=protocol.VERSION)), *extra], extra):
        try:
            msg = protocol.decode(frames)
        except ProtocolError:
            continue
        assert msg.KIND in protocol.KINDS


def test_a_draft_token_outside_its_proposal_or_a_repeated_id_is_refused() -> None:
    """q(x) = 0 for a token outside the proposal would make the verifier accept it always: a forged
    draft must never reach it. Refused for a draft result and for a verify task alike."""
    def proposing(draft: list[int], idx: list[list[int]], prob: list[list[float]]) -> TaskResult:
        out = TaskResult(1, "draft", 1, 1, draft=draft)
        out.propose([np.array(i, np.int32) for i in idx], [np.array(p, np.float32) for p in prob])
        return out

    good = proposing([3, 4], [[3, 1], [4]], [[0.7, 0.3], [1.0]])
    assert isinstance(roundtrip(Result([good])).results[0], TaskResult)
    again = proposing([3, 1, 3], [[3, 1], [1, 3], [3]], [[0.7, 0.3], [0.6, 0.4], [1.0]])  # (an id in several positions)
    assert isinstance(roundtrip(Result([again])).results[0], TaskResult)
    for bad, why in ((proposing([5, 4], [[3, 1], [4]], [[0.7, 0.3], [1.0]]), "outside"),  # 5 is not proposed
                     (proposing([3, 4], [[3, 1], [4]], [[0.0, 1.0], [1.0]]), "outside"),  # proposed with q = 0
                     (proposing([3, 4], [[4], [3, 1]], [[1.0], [0.7, 0.3]]), "outside"),  # each in the other's
                     (proposing([3, 4], [[3, 3], [4]], [[0.5, 0.5], [1.0]]), "repeats"),
                     (proposing([3, 4], [[3, 1], [4, 4]], [[0.5, 0.5], [0.5, 0.5]]), "repeats"),
                     (proposing([3, 4], [[3, 1], [4]], [[0.0, 0.0], [1.0]]), "no probability mass"),
                     (proposing([3, 4], [[3, 1], [4]], [[0.7, float("nan")], [1.0]]), "invalid entries"),
                     (proposing([3, 4], [[3, 1], [4]], [[0.7, -0.3], [1.0]]), "invalid entries")):
        [item] = roundtrip(Result([bad])).results
        assert isinstance(item, Rejected) and why in item.error.message
        task = TaskSpec(1, "verify", 1, 1, np.arange(3, dtype=np.int32), 2, {"temperature": 1.0}, 1, Holder(),
                        draft=bad.draft, q_idx=bad.q_idx, q_prob=bad.q_prob, q_len=bad.q_len)
        [item] = roundtrip(Tasks([task])).tasks
        assert isinstance(item, Rejected) and why in item.error.message


def test_a_clients_stream_chunks_of_one_step_travel_in_one_message() -> None:
    """The broker sends a client's chunks of one step as one ``Chunks`` (each request's messages in
    their order); the blocking client reads one out of it at a time."""
    import zmq

    from nebula_flow.client import Client, Completion
    from nebula_flow.deploy import free_port
    from nebula_flow.protocol import Chunks, Done, Tokens
    from nebula_flow_broker.server import Broker, BrokerOptions

    got = roundtrip(Chunks([Tokens("a", [1, 2], "x"), Tokens("b", [3], "y", 2, 1)]))
    assert [(c.req_id, list(c.token_ids), c.text, c.offset) for c in got.chunks] == [("a", [1, 2], "x", 0),
                                                                                      ("b", [3], "y", 2)]
    broker = Broker(BrokerOptions(client_port=free_port(), worker_port=free_port()))
    sent: list = []
    broker.clients = None  # (not bound: the sends are recorded)
    broker._send_now = lambda sock, identity, msg: sent.append((identity, msg)) or True
    done_r1 = Done("r1", [1], "x", "length", {})
    broker.client_outbox = [(b"a", Tokens("r1", [1], "x")), (b"b", Tokens("r2", [2], "y")), (b"a", done_r1),
                            (b"a", Tokens("r3", [3], "z"))]
    broker._flush_clients()
    assert sent == [(b"a", Chunks([Tokens("r1", [1], "x"), Tokens("r3", [3], "z")])), (b"b", Tokens("r2", [2], "y")),
                    (b"a", done_r1)]
    # a blocking client takes them apart (a fake broker on a real socket)
    ctx, port = zmq.Context.instance(), free_port()
    server = ctx.socket(zmq.ROUTER)
    server.bind(f"tcp://127.0.0.1:{port}")
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout_s=10) as client:
            stream = client.stream(token_ids=[1, 2], max_new_tokens=3, request_id="q")
            import threading

            def answer() -> None:
                identity, *frames = server.recv_multipart()
                assert isinstance(protocol.decode(frames), Submit)
                for msg in (Chunks([Tokens("q", [7], "a"), Tokens("q", [8], "b", 1, 1)]), Done("q", [7, 8], "ab", "length", {})):
                    server.send_multipart([identity, *protocol.encode(msg)])

            t = threading.Thread(target=answer)
            t.start()
            items = list(stream)
            t.join()
        assert [list(i.token_ids) for i in items[:-1]] == [[7], [8]] and isinstance(items[-1], Completion)
        assert items[-1].token_ids == [7, 8]
    finally:
        server.close(linger=0)


def test_logprobs_travel_as_tensor_frames_and_the_broker_checks_them() -> None:
    """A verify's log-probabilities come back as [committed, 1 + top] and [committed, top] frames;
    the broker takes exactly what the request asked for and refuses anything else."""
    from nebula_flow.params import SamplingParams
    from nebula_flow.request import Request
    from nebula_flow_broker import results

    lp = np.array([[-0.5, -0.5, -1.0], [-2.0, -0.1, -2.0]], np.float32)
    ids = np.array([[7, 3], [4, 9]], np.int32)
    out = TaskResult(1, "verify", 1, 1, committed=[7, 9], logprobs=lp, logprob_ids=ids)
    [got] = roundtrip(Result([out])).results
    assert got.logprobs.tolist() == lp.tolist() and got.logprob_ids.tolist() == ids.tolist()
    asked = Request(1, "r", [1], SamplingParams(logprobs=2), seed=0)
    checked = results.logprobs(asked, got, vocab=10)
    assert checked[0].tolist() == lp.tolist() and checked[0].flags.writeable  # (a copy: it outlives the frames)
    assert results.logprobs(Request(2, "s", [1], SamplingParams(), seed=0), TaskResult(2, "verify", 1, 1)) is None
    bad = [
        (SamplingParams(), lp, ids),  # not asked for
        (SamplingParams(logprobs=3), lp, ids),  # another top count
        (SamplingParams(logprobs=2), lp[:1], ids[:1]),  # not one row per committed token
        (SamplingParams(logprobs=2), lp + 1.0, ids),  # not log-probabilities
        (SamplingParams(logprobs=2), np.where(lp < -1, np.nan, lp).astype(np.float32), ids),
        (SamplingParams(logprobs=2), lp, ids + 10),  # outside the vocabulary
        (SamplingParams(logprobs=2), lp.astype(np.float64), ids),
        (SamplingParams(logprobs=2), None, None),  # asked for, not sent
    ]
    for params, values, top_ids in bad:
        item = TaskResult(1, "verify", 1, 1, committed=[7, 9], logprobs=values, logprob_ids=top_ids)
        with pytest.raises(ProtocolError):
            results.logprobs(Request(1, "r", [1], params, seed=0), item, vocab=10)
