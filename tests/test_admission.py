"""The broker's text as a request grows: decoded a step at a time, stop strings found as a whole
decode would find them."""

from __future__ import annotations

import random

import numpy as np
import pytest

from nebula_flow.params import SamplingParams
from nebula_flow.protocol import ProtocolError, Submit
from nebula_flow.request import Request
from nebula_flow_broker.admission import Admission, apply_stop, stop_prefix


def test_incremental_text_and_stop_strings_match_decoding_the_whole_output(tiny_pair) -> None:  # noqa: ANN001
    adm = Admission(str(tiny_pair / "target"), 4096)
    codec = adm.codec
    sample = codec.encode("def add(a, b):\n    return a + b  # héllo wörld ✓ 日本語\nprint(add(1, 2))\n" * 3)
    vocab = codec.vocab_size
    for trial in range(200):
        rnd = random.Random(trial)
        ids = sample if trial % 2 else [rnd.randrange(vocab) for _ in range(120)]
        full = codec.decode(ids)
        stops: tuple[str, ...] = ()
        if trial % 4 and len(full) > 20:  # stop strings cut from the text, some across chunk boundaries
            at = rnd.randrange(5, len(full) - 5)
            stops = (full[at:at + rnd.randrange(1, 5)], "\x00never")
        req = Request(trial, f"r{trial}", [1], SamplingParams(max_new_tokens=4096, stop=stops), 0)
        fed, want, streamed = 0, "", ""
        while fed < len(ids):
            step = min(len(ids) - fed, rnd.randrange(1, 6))
            fed += step
            req.output = ids[:fed]
            req.tokens_per_round.append(step)
            hit = adm.stop_text(req)
            # the reference: decode everything; text ending in a partial character waits
            whole, want_hit = apply_stop(codec.decode(req.output), stops)
            want = whole if want_hit or not whole.endswith("\ufffd") else want
            assert (hit, req.text) == (want_hit, want), (trial, fed)
            req.finish_reason = "stop" if hit else ("length" if fed == len(ids) else None)
            delta, at = adm.release(req)
            assert at == len(streamed) and want.startswith(streamed + delta), (trial, fed)  # (nothing taken back)
            streamed += delta
            if hit:  # (the output ends with the token that completed the stop string)
                assert not apply_stop(codec.decode(req.output[:-1]), stops)[1] and sum(req.tokens_per_round) == \
                    len(req.output), trial
                break
        assert streamed == req.text, trial  # (all of it, once it ends)


def test_the_tail_held_back_is_the_longest_that_begins_a_stop_string() -> None:
    """``stop_prefix`` (what ``release`` holds back) against trying every tail length of every stop string."""
    rnd = random.Random(0)
    for _ in range(20_000):
        text = "".join(rnd.choice("ab\n") for _ in range(rnd.randrange(0, 8)))
        stops = tuple("".join(rnd.choice("ab\n") for _ in range(rnd.randrange(1, 6))) for _ in range(rnd.randrange(1, 3)))
        want = max((n for s in stops for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])),
                   default=0)
        assert stop_prefix(text, stops) == want, (text, stops)


def test_a_stop_string_kept_in_the_text_and_a_prompt_truncated_to_its_end(tiny_pair) -> None:  # noqa: ANN001
    """``include_stop_str_in_output``: the earliest stop string ends the text, kept (a stop string
    listed first wins a tie at the same place); ``truncate_prompt_tokens``: the request runs the
    prompt's last N tokens, and its context check counts only those."""
    assert apply_stop("abc STOP def END", ("END", "STOP")) == ("abc ", True)
    assert apply_stop("abc STOP def END", ("END", "STOP"), include=True) == ("abc STOP", True)
    assert apply_stop("abc STOPPED", ("STOPPED", "STOP"), include=True) == ("abc STOPPED", True)
    assert apply_stop("abc", ("x",), include=True) == ("abc", False)
    adm = Admission(str(tiny_pair / "target"), 4096)
    prompt = np.arange(5, adm.max_model_len + 5, dtype=np.int32) % 300  # (as long as the context)
    msg = Submit("t", {"max_new_tokens": 8, "truncate_prompt_tokens": 10}, prompt_tokens=prompt)
    req = adm.request(0, msg, b"c", 0.0)
    assert req.prompt == prompt[-10:].tolist()
    with pytest.raises(ProtocolError, match="too_long"):
        adm.request(1, Submit("u", {"max_new_tokens": 8}, prompt_tokens=prompt), b"c", 0.0)
    with pytest.raises(ProtocolError, match="truncate_prompt_tokens"):
        adm.request(2, Submit("v", {"max_new_tokens": 8, "truncate_prompt_tokens": 0}, prompt_tokens=prompt), b"c", 0.0)


def test_bad_words_are_spelled_as_written_and_after_a_space(tiny_pair) -> None:  # noqa: ANN001
    """The broker turns ``bad_words`` into ``bad_word_ids`` (what workers read): each word's tokens
    as written (leading spaces dropped) and, where that differs in its first token only, after a
    space (vLLM's rule)."""
    adm = Admission(str(tiny_pair / "target"), 4096)
    params = adm.params(Submit("b", {"bad_words": ["Mdef", " and"], "bad_word_ids": [[3]]}, prompt="x"))
    enc = adm.codec.encode
    want = [(3,), tuple(enc("Mdef", special=False))]
    if len(enc(" Mdef", special=False)) == len(want[1]) and enc(" Mdef", special=False)[0] != want[1][0]:
        want.append(tuple(enc(" Mdef", special=False)))
    assert params.bad_words == () and params.bad_word_ids[:len(want)] == tuple(want)
    assert tuple(enc("and", special=False)) in params.bad_word_ids and params.penalized


def test_a_round_that_completes_a_stop_string_ends_the_output_at_its_last_token(tiny_pair) -> None:  # noqa: ANN001
    """A verify commits five tokens and the stop string ends inside the second: the output keeps two
    (as decoding one token at a time would), the round counts two, and the tokens the scheduler
    hands back to stream are those two. Token ids do not depend on how the rounds fell."""
    from nebula_flow.policy import PolicyConfig
    from nebula_flow.scheduler import Scheduler
    from tests.test_ahead import drafted, verify_taken

    adm = Admission(str(tiny_pair / "target"), 4096)
    ids = adm.codec.encode("alpha beta gamma delta epsilon", special=False)[:5]
    second = adm.codec.decode(ids[:2])
    stop = second[-2:]  # (ends inside the second token's text, or at its end)
    assert stop and stop not in adm.codec.decode(ids[:1])
    s = Scheduler("pooled", PolicyConfig(k=4))
    s.register(1, "draft", 4)
    s.register(2, "target", 4)
    r = Request(0, "0", [1, 2, 3], SamplingParams(max_new_tokens=32, stop=(stop,)), seed=0)
    s.admit(r)
    drafted(s, r, ids[:4])
    verify_taken(s, r)
    kept = s.end_round(r, 2, ids, stop_text=adm.stop_text)
    assert kept == ids[:2] and r.output == ids[:2] and r.tokens_per_round == [2] and r.finish_reason == "stop"
    assert r.text == second[:second.index(stop)] and adm.final_text(r) == r.text


def test_the_unlocked_tokenizer_call_gives_the_same_ids(tiny_pair) -> None:  # noqa: ANN001
    codec = Admission(str(tiny_pair / "target"), 4096).codec
    text = "def add(a, b):\n    return a + b  # héllo ✓ 日本語\n" * 50
    assert codec.encode(text, unlocked=True) == codec.encode(text)
    assert codec.encode(text, special=False, unlocked=True) == codec.encode(text, special=False)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    assert codec.encode_chat(chat, unlocked=True) == codec.encode_chat(chat)


def test_long_prompts_are_tokenized_beside_the_dispatch_loop(tiny_pair) -> None:  # noqa: ANN001
    """A long text prompt goes to the tokenizer thread: while it is there (held at a gate here) the
    broker admits and answers other requests; a retry re-attaches to it, a cancel drops it, and once
    tokenized it joins the pool with the ids the tokenizer gives (even if the broker began draining
    meanwhile), or gets its refusal."""
    import select
    import threading

    import numpy as np

    from nebula_flow import protocol
    from nebula_flow.deploy import free_port
    from nebula_flow.protocol import Cancel, Error, State, Status, Submit
    from nebula_flow_broker.server import Broker, BrokerOptions
    from nebula_flow_broker.tokenizing import INLINE_CHARS

    broker = Broker(BrokerOptions(client_port=free_port(), worker_port=free_port(), model=str(tiny_pair / "target")))
    gate, real = threading.Event(), broker.prompts.tokenize
    broker.prompts.tokenize = lambda msg: (gate.wait(30), real(msg))[1]
    text = "return " * (INLINE_CHARS // 6)  # (over INLINE_CHARS characters, within the tiny context in tokens)
    session = "s" * 32

    def submit(ident: bytes, req_id: str, **kw) -> None:  # noqa: ANN003
        broker.on_client(ident, protocol.encode(Submit(req_id, {"max_new_tokens": 4, **kw.pop("params", {})},
                                                       session=session, **kw)), 0.0)

    def tokenized() -> None:  # the gate opens; the broker's loop wakes on the pipe and admits
        gate.set()
        deadline = 30
        while broker.prompts.waiting and select.select([broker.prompts.fd], [], [], deadline)[0]:
            broker._tokenized()

    broker.bind()
    try:
        submit(b"c", "long", prompt=text)
        submit(b"c", "dropped", prompt=text)
        submit(b"c", "too-long", prompt=text, params={"max_new_tokens": 4096})
        submit(b"c", "short", prompt_tokens=np.array([1, 2, 3], np.int32))
        broker.on_client(b"c", protocol.encode(Status()), 0.0)
        # the short one runs while the long ones tokenize; the broker answers status meanwhile
        assert [r.req_id for r in broker.scheduler.requests.values()] == ["short"]
        assert isinstance(broker.client_outbox[-1][1], State)
        submit(b"c2", "long", prompt=text)  # a retry (the client reconnected): re-attached, not submitted twice
        broker.on_client(b"c", protocol.encode(Cancel("dropped", session)), 0.0)
        assert broker.inflight_by_owner == {b"c": 3, b"c2": 1}
        broker.draining_since = 1.0  # (SIGTERM now: a prompt taken before it still runs)
        tokenized()
        by_id = {r.req_id: r for r in broker.scheduler.requests.values()}
        assert sorted(by_id) == ["long", "short"], broker.client_outbox
        assert by_id["long"].prompt == broker.admission.codec.encode(text) and by_id["long"].owner == b"c2"
        errors = [(m.req_id, m.code) for _, m in broker.client_outbox if isinstance(m, Error)]
        assert errors == [("too-long", "too_long")]
        assert broker.counters["requests_cancelled"] == 1 and broker.counters["requests_reattached"] == 1
        assert broker.inflight_by_owner == {b"c": 1, b"c2": 1} and "dropped" not in broker.owners
    finally:
        broker.clients.close()
        broker.peers.close()
        broker.prompts.close()


def test_a_new_grammar_compiles_off_the_dispatch_thread(tiny_pair) -> None:  # noqa: ANN001
    """A structured output whose grammar the broker has not compiled waits on the tokenizer thread
    while other requests run; then it is admitted (a bad one refused); the same grammar again is
    compiled already and admitted at once."""
    import select
    import threading

    import numpy as np

    from nebula_flow import protocol
    from nebula_flow.deploy import free_port
    from nebula_flow.protocol import Error, Submit
    from nebula_flow_broker.server import Broker, BrokerOptions

    broker = Broker(BrokerOptions(client_port=free_port(), worker_port=free_port(), model=str(tiny_pair / "target")))
    gate, real = threading.Event(), broker.prompts.tokenize
    broker.prompts.tokenize = lambda msg: (gate.wait(30), real(msg))[1]
    schema = {"json": {"type": "object", "properties": {"unique_to_this_test": {"type": "integer"}}}}

    def submit(req_id: str, **params) -> None:  # noqa: ANN003
        broker.on_client(b"c", protocol.encode(Submit(req_id, {"max_new_tokens": 4, **params}, session="s" * 32,
                                                      prompt_tokens=np.array([1, 2, 3], np.int32))), 0.0)

    broker.bind()
    try:
        submit("json", structured=schema)
        submit("bad", structured={"regex": "[a-"})
        submit("shape", structured={"regex": "a", "choice": ["a"]})  # (refused at once: nothing to compile)
        submit("plain")
        assert [r.req_id for r in broker.scheduler.requests.values()] == ["plain"]
        assert sorted(broker.prompts.waiting) == ["bad", "json"]
        gate.set()
        while broker.prompts.waiting and select.select([broker.prompts.fd], [], [], 30)[0]:
            broker._tokenized()
        submit("again", structured=schema)  # (compiled now: inline)
        assert [r.req_id for r in broker.scheduler.requests.values()] == ["plain", "json", "again"]
        errors = {m.req_id: m.code for _, m in broker.client_outbox if isinstance(m, Error)}
        assert errors == {"bad": "invalid_params", "shape": "invalid_params"}
    finally:
        gate.set()
        broker.clients.close()
        broker.peers.close()
        broker.prompts.close()


def test_prompts_being_tokenized_count_against_the_pending_limit(tiny_pair) -> None:  # noqa: ANN001
    import threading

    from nebula_flow import protocol
    from nebula_flow.deploy import free_port
    from nebula_flow.protocol import Error, Submit
    from nebula_flow_broker.server import Broker, BrokerOptions
    from nebula_flow_broker.tokenizing import INLINE_CHARS

    broker = Broker(BrokerOptions(client_port=free_port(), worker_port=free_port(), model=str(tiny_pair / "target"),
                                  max_pending=1))
    gate, real = threading.Event(), broker.prompts.tokenize
    broker.prompts.tokenize = lambda msg: (gate.wait(30), real(msg))[1]
    broker.bind()
    try:
        for req_id in ("first", "second"):
            broker.on_client(b"c", protocol.encode(Submit(req_id, {"max_new_tokens": 4}, session="s" * 32,
                                                          prompt="return " * (INLINE_CHARS // 6))), 0.0)
        assert list(broker.prompts.waiting) == ["first"]
        assert [(m.req_id, m.code) for _, m in broker.client_outbox if isinstance(m, Error)] == [("second", "busy")]
        assert broker.inflight_by_owner == {b"c": 1}
    finally:
        gate.set()
        broker.clients.close()
        broker.peers.close()
        broker.prompts.close()


def test_min_tokens_defers_stop_strings_and_names_the_ids_a_verify_must_not_pick(tiny_pair) -> None:  # noqa: ANN001
    """min_tokens: no stop string ends the output before it holds that many tokens, and the request
    carries the ids that would end it (EOS unless ignored, its stop token ids) for its verifies."""
    admission = Admission(str(tiny_pair / "target"), 4096)
    ids = admission.codec.encode("ab ab ab ab")
    early = Request(1, "r", [1], SamplingParams(stop=("ab",), min_tokens=len(ids) + 1), seed=0)
    early.commit(list(ids), ())
    assert not admission.stop_text(early) and "ab" in early.text  # (too early to stop)
    late = Request(2, "s", [1], SamplingParams(stop=("ab",)), seed=0)
    late.commit(list(ids), ())
    assert admission.stop_text(late) and late.text == "" and late.output == ids[:1]  # ("ab": its first token)
    msg = Submit("m", {"min_tokens": 3, "stop_token_ids": [9]}, prompt_tokens=np.array([1, 2], np.int32))
    req = admission.request(1, msg, owner=b"c", now=0.0)
    assert req.suppress == sorted({*admission.eos_ids, 9}) and admission.eos_ids
    msg = Submit("n", {"min_tokens": 3, "ignore_eos": True}, prompt_tokens=np.array([1, 2], np.int32))
    assert admission.request(2, msg, owner=b"c", now=0.0).suppress == []


def test_a_prediction_is_tokenized_as_output_and_checked(tiny_pair) -> None:  # noqa: ANN001
    """Predicted Outputs at admission: text is tokenized without special tokens (as the output's
    text would be), on the tokenizer thread too; ids must be in the vocabulary; an empty one is
    none; one longer than the context is refused."""
    admission = Admission(str(tiny_pair / "target"), 4096)
    prompt = np.array([1, 2], np.int32)
    text = Submit("a", {}, prompt_tokens=prompt, prediction="def f(x):\n    return x")
    want = admission.codec.encode("def f(x):\n    return x", special=False)
    assert admission.request(1, text, owner=b"c", now=0.0).prediction.tolist() == want
    slow = Submit("b", {}, prompt_tokens=prompt, prediction="def f(x):\n    return x")
    admission.prepare(slow)  # (the tokenizer thread's work: the text becomes ids)
    assert slow.prediction is None and slow.prediction_tokens.tolist() == want
    assert admission.request(2, slow, owner=b"c", now=0.0).prediction.tolist() == want
    assert admission.request(3, Submit("c", {}, prompt_tokens=prompt, prediction=""), owner=b"c", now=0.0).prediction is None
    for bad, says in ((np.array([-1], np.int32), "must be in"), (np.array([admission.vocab_size], np.int32), "must be in"),
                      (np.zeros(admission.max_model_len + 1, np.int32), "longer than the context")):
        with pytest.raises(ProtocolError, match=says) as err:
            admission.request(4, Submit("d", {}, prompt_tokens=prompt, prediction_tokens=bad), owner=b"c", now=0.0)
        assert err.value.code == "invalid_prediction"


def test_max_model_len_bounds_the_context_served_and_never_exceeds_the_models(tiny_pair) -> None:  # noqa: ANN001
    from nebula_flow.config import ConfigError

    model = str(tiny_pair / "target")
    assert Admission(model, 4096).max_model_len == 1024  # (the model's max_position_embeddings)
    adm = Admission(model, 4096, max_model_len=48)
    assert adm.max_model_len == 48
    fits = adm.request(1, Submit("a", {"max_new_tokens": 40}, prompt_tokens=np.full(8, 5, np.int32)), b"c", 0.0)
    assert len(fits.prompt) + fits.params.max_new_tokens == 48
    with pytest.raises(ProtocolError, match=r"exceeds the context \(48\)") as refused:
        adm.request(2, Submit("b", {"max_new_tokens": 41}, prompt_tokens=np.full(8, 5, np.int32)), b"c", 0.0)
    assert refused.value.code == "too_long"
    with pytest.raises(ConfigError, match="max_model_len 2048 exceeds the model's context"):
        Admission(model, 4096, max_model_len=2048)


def test_a_resend_resumes_after_the_tokens_its_client_had(tiny_pair) -> None:  # noqa: ANN001
    """``Submit.resume_tokens`` at admission: the request's output begins with them (its rounds go on
    after them, within the same ``max_new_tokens``); ids outside the vocabulary, or as many as the
    request may make, are refused."""
    admission = Admission(str(tiny_pair / "target"), 4096)
    prompt = np.array([1, 2], np.int32)
    sampled = {"temperature": 1.0, "max_new_tokens": 8}
    req = admission.request(1, Submit("a", sampled, prompt_tokens=prompt, resume_tokens=np.array([5, 6, 7])),
                            owner=b"c", now=0.0)
    assert req.output == [5, 6, 7] and req.remaining == 5 and req.prompt == [1, 2] and not req.reproducible
    assert admission.request(2, Submit("b", sampled, prompt_tokens=prompt, resume_tokens=np.array([], np.int64)),
                             owner=b"c", now=0.0).output == []
    for bad, says in ((np.array([admission.vocab_size]), "outside the vocabulary"), (np.arange(8), "fewer than max_new")):
        with pytest.raises(ProtocolError, match=says) as err:
            admission.request(3, Submit("c", sampled, prompt_tokens=prompt, resume_tokens=bad), owner=b"c", now=0.0)
        assert err.value.code == "invalid_params"
