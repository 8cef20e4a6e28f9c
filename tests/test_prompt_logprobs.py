"""The prompt's log-probabilities (``SamplingParams.prompt_logprobs``, vLLM's) and ``echo``: the
checks on what a client asks and on what a worker brings back. End to end against HF transformers:
``test_e2e_lossless`` (every mode), ``test_chunked_prefill`` (chunks, the prefix cache), ``test_api``
(OpenAI's ``echo`` through the real ``openai`` client), ``test_service`` (the CLI)."""

from __future__ import annotations

import numpy as np
import pytest

from nebula_flow.params import InvalidParams, SamplingParams
from nebula_flow.protocol import ProtocolError, TaskResult
from nebula_flow.request import Request
from nebula_flow_broker import results

PROMPT = [5, 9, 13, 17, 21, 25]


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5, "2"])
def test_prompt_logprobs_must_be_a_small_count(bad: object) -> None:
    with pytest.raises(InvalidParams, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad).validate()
    SamplingParams(prompt_logprobs=20).validate()


def test_echo_must_be_a_boolean() -> None:
    with pytest.raises(InvalidParams, match="echo"):
        SamplingParams(echo=1).validate()


def _asking(top: int | None, scored: int = 1) -> Request:
    req = Request(1, "r", list(PROMPT), SamplingParams(prompt_logprobs=top), seed=1)
    if top is not None:
        req.prompt_logprobs = [[PROMPT[0], "a", None, []]] + [[t, "b", -1.0, []] for t in PROMPT[1:scored]]
    return req


def _result(at: int, n: int, top: int = 1, **changes: object) -> TaskResult:
    lp = np.full((n, 1 + top), -0.5, dtype=np.float32)
    out = TaskResult(1, "verify", 1, 1, prefilled=at + n, prompt_logprobs=lp,
                     prompt_logprob_ids=np.zeros((n, top), dtype=np.int32),
                     prompt_logprob_ranks=np.arange(1, n + 1, dtype=np.int32), scored_from=at)
    for name, value in changes.items():
        setattr(out, name, value)
    return out


def test_the_broker_takes_the_prompt_scores_a_verify_brings_and_refuses_bad_ones() -> None:
    lp, ids, rank, at = results.prompt_scores(_asking(1), _result(1, 3), vocab=100)
    assert lp.shape == (3, 2) and ids.shape == (3, 1) and rank.tolist() == [1, 2, 3] and at == 1
    # positions already had come again (a task run again from an earlier position): taken, the broker keeps its own
    assert results.prompt_scores(_asking(1, scored=3), _result(2, 4), vocab=100)[3] == 2
    bad = [
        (_asking(None), _result(1, 2), "did not ask"),
        (_asking(1), _result(2, 2), "gap"),  # position 1 was never scored
        (_asking(1), _result(1, 6), "prompt's end"),  # past the prompt's last token
        (_asking(1), _result(0, 2), "gap"),  # position 0 has no log-probability
        (_asking(1), _result(1, 2, top=2), "float32"),  # another top count than asked
        (_asking(1), _result(1, 2, prompt_logprobs=np.zeros((2, 2), dtype=np.float64)), "float32"),
        (_asking(1), _result(1, 2, prompt_logprobs=np.full((2, 2), 0.5, dtype=np.float32)), "<= 0"),
        (_asking(1), _result(1, 2, prompt_logprob_ids=np.full((2, 1), 100, dtype=np.int32)), "vocabulary"),
        (_asking(1), _result(1, 2, prompt_logprob_ids=None), "float32"),
        (_asking(1), _result(1, 2, prompt_logprob_ranks=None), "ranks"),
        (_asking(1), _result(1, 2, prompt_logprob_ranks=np.array([0, 1], dtype=np.int32)), "ranks"),
        (_asking(1), _result(1, 2, prompt_logprob_ranks=np.array([1, 101], dtype=np.int32)), "ranks"),
        (_asking(1), _result(1, 2, prompt_logprob_ranks=np.array([1, 2], dtype=np.int64)), "ranks"),
    ]
    for req, out, why in bad:
        with pytest.raises(ProtocolError, match=why):
            results.prompt_scores(req, out, vocab=100)


def test_a_verify_that_commits_before_the_prompt_is_scored_is_refused() -> None:
    req = _asking(1, scored=3)
    with pytest.raises(ProtocolError, match="before it scored the prompt"):
        results.verified(req, TaskResult(1, "verify", 1, 1, committed=[7]), vocab=100)


def test_the_wire_checks_where_scoring_starts_and_what_comes_back() -> None:
    from nebula_flow import protocol
    from nebula_flow.protocol import Holder, Rejected, Result, Tasks, TaskSpec

    def task(score_from: int, prompt_len: int = 3) -> object:
        spec = TaskSpec(1, "verify", 1, 1, np.arange(4, dtype=np.int32), 0, {}, 1, Holder(), prompt_len=prompt_len,
                        score_from=score_from)
        return protocol.decode(protocol.encode(Tasks([spec]))).tasks[0]

    assert task(2).score_from == 2
    assert all(isinstance(task(s), Rejected) for s in (-1, 4))  # (before the prompt, or past its end)
    sent = Result([_result(1, 2)], 0.0, {}, None, None)
    [back] = protocol.decode(protocol.encode(sent)).results
    assert back.scored_from == 1 and back.prompt_logprobs.shape == (2, 2) and back.prompt_logprob_ids.dtype == np.int32
    [bad] = protocol.decode(protocol.encode(Result([_result(1, 2, scored_from=-1)], 0.0, {}, None, None))).results
    assert isinstance(bad, Rejected)
