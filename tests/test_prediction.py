"""Predicted Outputs: a client's prediction of the output feeds the lookup chains of its rounds.

The output must be exactly the one without a prediction (greedy: the target's own, whatever the
prediction says; seeded sampling: a function of the request, the prediction included, whatever
the placement), and a prediction that matches must cut the rounds.
"""

from __future__ import annotations

import zlib

import numpy as np
import openai
import pytest

from nebula_flow.api.errors import ApiError
from nebula_flow.api.request import Served, parse_chat, parse_completion
from nebula_flow.api.response import usage
from nebula_flow.client import Client, Completion, RequestError, build_submit
from nebula_flow.deploy import Deployment
from nebula_flow.lookup import MAX_SKIP, PREDICTION_MAX_N, RESYNC_N, lookup, lookup_with, matched, predicted
from nebula_flow.params import SamplingParams
from nebula_flow.protocol import Holder, ProtocolError, Submit, TaskSpec
from nebula_flow.speclen import LONG_PREDICTED_CHAIN, PREDICTED_CHAIN, Acceptance, longest_chain
from nebula_flow_workers.token_book import TokenBook
from tests.conftest import deploy_config, hf_greedy

ids = np.array  # (token sequences, as the workers hold them)


def test_a_prediction_gives_what_follows_the_longest_matching_context() -> None:
    prediction = ids([1, 2, 3, 4, 9, 9, 2, 3, 5, 6, 7])
    # the context ends "2 3": it follows "1 2 3" (-> 4) and "9 2 3" (-> 5): the longer match decides
    assert predicted(ids([7, 9, 2, 3]), prediction, 3, 2) == [5, 6, 7]
    assert predicted(ids([0, 1, 2, 3]), prediction, 3, 2) == [4, 9, 9]
    assert predicted(ids([8, 2, 3]), prediction, 2, 2) == [4, 9]  # (only "2 3" matches: its first occurrence)
    assert predicted(ids([5, 8]), prediction, 3, 2) == []  # no occurrence
    assert predicted(ids([6, 7]), prediction, 3, 2) == []  # at the prediction's end: nothing follows
    long = np.arange(100)
    assert predicted(long[:50], long, 4, 2) == [50, 51, 52, 53]
    # the output replaced 50 (and then 51 too) by its own tokens: the prediction is taken up after them
    assert predicted(np.append(long[:50], 500), long, 3, 2) == [51, 52, 53]
    assert predicted(np.append(long[:50], [500, 501]), long, 3, 2) == [52, 53, 54]
    assert predicted(np.append(long[:50], [500, 501, 502]), long, 3, 2) == []  # (more than MAX_SKIP: none)
    assert predicted(ids([1, 2, 500]), long, 3, 2) == []  # (too short a context to take it up on: RESYNC_N)
    assert PREDICTION_MAX_N >= 8 and (MAX_SKIP, RESYNC_N) == (2, 4)  # (a file's repeated lines need long contexts)


def test_lookup_falls_back_to_the_context_without_a_match_in_the_prediction() -> None:
    tokens = ids([4, 5, 6, 1, 4, 5])
    assert lookup_with(tokens, None, 2, 2, 4) == lookup(tokens, 2, 2, 4) == ([6, 1], [])
    assert lookup_with(tokens, ids([]), 2, 2, 4) == ([6, 1], [])
    assert lookup_with(tokens, ids([8, 4, 5, 9, 9]), 2, 2, 4) == ([9, 9], [])  # the prediction first
    assert lookup_with(tokens, ids([8, 8, 8]), 2, 2, 4) == ([6, 1], [])


def spec(rid: int, tokens: list[int], base: int = 0, crc: int = 0, prediction: list[int] | None = None) -> TaskSpec:
    return TaskSpec(rid, "draft", 1, 1, ids(tokens, dtype=np.int32), 2, SamplingParams().to_wire(), rid, Holder(),
                    base=base, base_crc=crc, prediction=None if prediction is None else ids(prediction, dtype=np.int32))


def test_the_token_book_keeps_a_prediction_for_the_requests_later_tasks() -> None:
    book = TokenBook(max_tokens=8)
    book.tokens(spec(1, [5, 6, 7], prediction=[7, 8, 9]))
    assert book.prediction(1).tolist() == [7, 8, 9]
    book.tokens(spec(1, [8], base=3, crc=zlib.crc32(ids([5, 6, 7], dtype=np.int32))))  # (a later task: no prediction)
    assert book.prediction(1).tolist() == [7, 8, 9]
    book.tokens(spec(1, [5, 6, 7, 8]))  # sent whole again, without one: none now
    assert book.prediction(1) is None
    book.tokens(spec(2, [1, 2], prediction=[3]))
    book.forget([2])
    assert book.prediction(2) is None
    book.tokens(spec(3, [1, 2], prediction=[3]))
    book.tokens(spec(4, list(range(8))))  # (over the book's bound: the oldest request goes, its prediction too)
    assert book.prediction(3) is None and 3 not in book.entries and book.held == 8  # (predictions count)


def test_the_wire_refuses_malformed_predictions() -> None:
    with pytest.raises(ProtocolError, match="at most one"):
        Submit("r", {}, "hi", prediction="x", prediction_tokens=ids([1], dtype=np.int32)).check()
    with pytest.raises(ProtocolError, match="base 0"):
        spec(1, [4], base=3, crc=1, prediction=[1, 2]).check()
    with pytest.raises(ProtocolError, match="token ids"):
        spec(1, [4], prediction=[-1]).check()
    with pytest.raises(ValueError, match="text or a list"):
        build_submit("r", "hi", None, False, prediction=[[1, 2]])
    assert build_submit("r", "hi", None, False, prediction=[3, 4]).prediction_tokens.tolist() == [3, 4]
    assert build_submit("r", "hi", None, False, prediction="def f").prediction == "def f"


def test_usage_counts_the_prediction_tokens_the_output_holds() -> None:
    assert matched(ids([1, 2, 3, 4]), [1, 2, 3, 4]) == 4
    assert matched(ids([1, 2, 3, 4, 5, 6]), [1, 2, 9, 9, 5, 6, 7]) == 4
    assert matched(ids([1, 2]), []) == 0
    long = list(range(100, 400))
    assert matched(ids(long), long[:150] + [1, 2, 3] + long[150:]) == 300  # (an insertion: taken up after it)
    assert matched(ids(long), long[:100] + long[105:]) == 295  # (a deletion)
    assert matched(ids(long), [t if i % 50 != 7 else 0 for i, t in enumerate(long)]) == 294  # (six replaced)
    assert matched(ids(long), list(range(1000, 1300))) == 0

    def out(given: int, took: int) -> Completion:
        return Completion("", [0] * 10, "length", 3, [], 0.0, 0.0,
                          stats={"prompt_tokens": 4, "prediction_tokens": given, "prediction_accepted": took})

    assert usage([out(12, 8), out(6, 6)], 2)["completion_tokens_details"] == {
        "accepted_prediction_tokens": 14, "rejected_prediction_tokens": 4}
    assert "completion_tokens_details" not in usage([Completion("", [1], "length", 1, [], 0.0, 0.0)])


def test_the_api_takes_openais_prediction_on_chat_only() -> None:
    served, messages = Served("m"), [{"role": "user", "content": "hi"}]
    job = parse_chat({"model": "m", "messages": messages, "prediction": {"type": "content", "content": "def f"}}, served)
    assert job.choices()[0]["prediction"] == "def f"
    parts = {"type": "content", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert parse_chat({"model": "m", "messages": messages, "prediction": parts}, served).params["prediction"] == "ab"
    assert "prediction" not in parse_chat({"model": "m", "messages": messages}, served).params
    for bad in ({"type": "text", "content": "a"}, "a", {"type": "content", "content": 3},
                {"type": "content", "content": "a", "extra": 1}):
        with pytest.raises(ApiError) as err:
            parse_chat({"model": "m", "messages": messages, "prediction": bad}, served)
        assert err.value.status == 400 and err.value.param == "prediction"
    with pytest.raises(ApiError, match="unrecognized"):  # (as OpenAI: completions do not define it)
        parse_completion({"model": "m", "prompt": "x", "prediction": {"type": "content", "content": "a"}}, served)


# -- end to end: real broker and worker processes on loopback, the tiny pair ------------------------

PROMPTS = [[5, 40, 7, 300], [9, 10, 11], [16, 17, 7, 5, 6]]
MAX_NEW = 40


def perturbed(tokens: list[int]) -> list[int]:
    """A prediction that is right at first, wrong in the middle, and right again after it."""
    return tokens[:10] + [(t + 7) % 500 + 1 for t in tokens[10:14]] + tokens[14:]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pooled", "colocated", "elastic", "paired", "autoregressive"])
def test_greedy_output_is_the_targets_own_whatever_the_prediction(tiny_pair, mode: str) -> None:  # noqa: ANN001
    refs = [hf_greedy(tiny_pair / "target", p, MAX_NEW) for p in PROMPTS]
    cfg = deploy_config(tiny_pair, mode, 0 if mode == "colocated" else 1, 1)
    with Deployment(cfg) as dep, Client(dep.address) as client:
        for prompt, ref in zip(PROMPTS, refs):
            plain = client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, ignore_eos=True)
            runs = {name: client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, ignore_eos=True, prediction=p)
                    for name, p in (("right", plain.token_ids), ("perturbed", perturbed(plain.token_ids)),
                                    ("wrong", [(t * 3 + 11) % 500 for t in plain.token_ids]))}
            assert plain.token_ids[:len(ref)] == ref  # (HF stops at EOS; ignore_eos goes on)
            for name, out in runs.items():
                assert out.token_ids == plain.token_ids, f"{mode}: a {name} prediction changed the output"
                assert out.stats["prediction_tokens"] == MAX_NEW
            assert runs["right"].stats["prediction_accepted"] == MAX_NEW
            if mode != "autoregressive":  # (no speculation there: the prediction has nothing to feed)
                assert runs["right"].rounds * 2 <= plain.rounds, f"{mode}: {runs['right'].rounds} rounds against {plain.rounds}"


@pytest.mark.slow
def test_seeded_samples_with_a_prediction_do_not_depend_on_placement(tiny_pair) -> None:  # noqa: ANN001
    outs = {}
    prediction = list(range(20, 60))
    for mode, m, n in (("pooled", 1, 1), ("pooled", 2, 1), ("elastic", 2, 2), ("colocated", 0, 2)):
        with Deployment(deploy_config(tiny_pair, mode, m, n)) as dep, Client(dep.address) as client:
            outs[(mode, m, n)] = [client.generate(token_ids=p, max_new_tokens=MAX_NEW, ignore_eos=True, temperature=0.8,
                                                  seed=7 + i, prediction=prediction).token_ids
                                  for i, p in enumerate(PROMPTS)]
    first = next(iter(outs.values()))
    assert len({tuple(t) for t in first}) == len(PROMPTS)
    assert all(o == first for o in outs.values()), outs


@pytest.mark.slow
def test_the_openai_client_sends_a_prediction_and_reads_its_usage(tiny_pair) -> None:  # noqa: ANN001
    with Deployment(deploy_config(tiny_pair, "pooled", 1, 1)) as dep:
        dep.start_api("127.0.0.1", 0, model_name="tiny")
        api = openai.OpenAI(base_url=dep.http_url + "/v1", api_key="none", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "def fibonacci(n):"}]
        plain = api.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_NEW, temperature=0)
        text = plain.choices[0].message.content
        got = api.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_NEW, temperature=0,
                                          prediction={"type": "content", "content": text})
        assert got.choices[0].message.content == text
        details = got.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == len(
            dep_tokens(dep, text))
        assert got.model_extra["speculative"]["rounds"] < plain.model_extra["speculative"]["rounds"]
        assert plain.usage.completion_tokens_details is None  # (no prediction: no such details)
        with pytest.raises(openai.BadRequestError) as err:  # (longer than the tiny pair's 1,024-token context)
            api.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                        prediction={"type": "content", "content": "def f(x): return x\n" * 400})
        assert err.value.body["param"] == "prediction" and "longer than the context" in err.value.body["message"]
        with Client(dep.address) as client, pytest.raises(RequestError) as refused:
            client.generate(token_ids=[5, 6], max_new_tokens=4, prediction=[1 << 20])
        assert refused.value.code == "invalid_prediction"
        assert client_ok(dep)  # (and the deployment serves on)
        with Client(dep.address) as client:
            counters = client.status()["counters"]
        assert counters["prediction_requests"] == 1  # (the refused ones never entered the pool)
        assert counters["prediction_tokens_accepted"] == details.accepted_prediction_tokens
        assert counters["prediction_tokens_rejected"] == details.rejected_prediction_tokens


def dep_tokens(dep: Deployment, text: str) -> list[int]:
    """``text`` as the broker tokenizes a prediction: the target's tokenizer, no special tokens."""
    from nebula_flow.tokenizer import TextCodec

    return TextCodec(dep.cfg.target.model).encode(text, special=False)


def client_ok(dep: Deployment) -> bool:
    with Client(dep.address) as client:
        return len(client.generate(token_ids=[5, 6], max_new_tokens=4, ignore_eos=True).token_ids) == 4


def test_chains_grow_while_the_output_follows_the_prediction() -> None:
    acc = Acceptance()
    assert longest_chain(12, False, acc) == 12  # (no prediction: the policy's fuse_ngram)
    assert longest_chain(0, True, acc) == PREDICTED_CHAIN and longest_chain(24, True, acc) == 24
    for _ in range(10):  # chains that win 16 tokens a round beyond the draft
        acc.update_fused(16)
    assert longest_chain(0, True, acc) == LONG_PREDICTED_CHAIN
    for _ in range(10):  # the output has left the prediction
        acc.update_fused(1)
    assert longest_chain(0, True, acc) == PREDICTED_CHAIN
