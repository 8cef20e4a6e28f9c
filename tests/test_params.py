from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nebula_flow.params import InvalidParams, SamplingParams
from nebula_flow.penalties import NoTokenAllowed, Penalties


def test_defaults_are_greedy_and_valid() -> None:
    p = SamplingParams.from_wire({})
    assert p.greedy and p.max_new_tokens == 64


@pytest.mark.parametrize("raw, match", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -5}, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 5e-324}, "at least"),  # subnormal: logits / t overflow, the probabilities turn NaN
    ({"temperature": 1e-6}, "at least"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"seed": True}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"bogus": 1}, "unknown parameters"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 65}, "min_tokens"),  # (more than max_new_tokens, 64)
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 1.2559881381636063e-56}, "repetition_penalty"),  # (0 in fp32: logits / 0)
    ({"repetition_penalty": 1e-6}, "repetition_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"-5": 1}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"logit_bias": {"5": math.inf}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": 5}, "allowed_token_ids"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"skip_special_tokens": "no"}, "booleans"),
    ({"include_stop_str_in_output": 1}, "booleans"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"bad_words": "x"}, "bad_words"),
    ({"bad_word_ids": [[]]}, "bad_word_ids"),
    ({"bad_word_ids": [5]}, "bad_word_ids"),
])
def test_bad_parameters_are_rejected_with_a_clear_message(raw: dict, match: str) -> None:
    with pytest.raises(InvalidParams, match=match):
        SamplingParams.from_wire(raw)


def test_logit_bias_travels_with_string_keys_and_counts_as_a_penalty() -> None:
    p = SamplingParams(logit_bias={5: 100, 7: -2.5})
    assert p.to_wire()["logit_bias"] == {"5": 100, "7": -2.5}  # (JSON's keys)
    assert SamplingParams.from_wire(p.to_wire()) == p and p.penalized
    assert not SamplingParams(logit_bias={}).penalized


def test_allowed_token_ids_travel_as_a_list_and_bar_every_other_id() -> None:
    p = SamplingParams(allowed_token_ids=(3, 9, 3))
    assert p.to_wire()["allowed_token_ids"] == [3, 9, 3] and SamplingParams.from_wire(p.to_wire()) == p and p.penalized
    row = Penalties(p, np.array([1, 2]), 2).row(torch.arange(12, dtype=torch.float32), [])
    assert torch.isfinite(row).nonzero().flatten().tolist() == [3, 9] and row[9] == 9.0


def test_rules_that_leave_no_token_raise_rather_than_pick_a_barred_one() -> None:
    """allowed_token_ids that bad_words or min_tokens rule out leave a row of -inf, whose argmax is
    id 0 (barred) and whose softmax is NaN: the row says so instead; one id left is enough."""
    barred_word = SamplingParams(allowed_token_ids=(4,), bad_word_ids=((4,),))
    only_eos = SamplingParams(allowed_token_ids=(2,), min_tokens=3)
    with pytest.raises(NoTokenAllowed, match="no token is allowed at output token 1"):
        Penalties(barred_word, np.array([1, 2]), 2).row(torch.zeros(12), [])
    with pytest.raises(NoTokenAllowed, match="output token 3"):  # (the path counts: the row after a drafted token)
        Penalties(only_eos, np.array([1, 5, 7]), 2, suppress=[2]).row(torch.zeros(12), [7])
    row = Penalties(only_eos, np.array([1, 5, 7, 7, 7]), 2, suppress=[2]).row(torch.zeros(12), [])  # (3 made: EOS ends it)
    assert torch.isfinite(row).nonzero().flatten().tolist() == [2]


def test_a_bad_words_last_token_is_barred_after_the_rest_of_it_in_the_output() -> None:
    """A one-token word is never picked; a longer one's last token not where the output (not the
    prompt) plus the row's path ends with the rest of it."""
    p = SamplingParams(bad_word_ids=((5,), (7, 8, 9)))
    assert SamplingParams.from_wire(p.to_wire()) == p and p.penalized

    def barred(tokens: list[int], prompt_len: int, path: list[int]) -> list[int]:
        row = Penalties(p, np.array(tokens), prompt_len).row(torch.zeros(12), path)
        return torch.isinf(row).nonzero().flatten().tolist()

    assert barred([1, 2, 3, 7, 8], 3, []) == [5, 9]
    assert barred([1, 2, 3, 7, 8], 3, [9, 7, 8]) == [5, 9] and barred([1, 2, 3, 7, 8], 3, [4]) == [5]
    assert barred([1, 2, 3, 7], 3, [8]) == [5, 9] and barred([7, 8], 2, []) == [5]  # (the prompt does not count)


def test_stop_token_ids_end_the_output_even_with_ignore_eos() -> None:
    from nebula_flow.request import Request

    params = SamplingParams.from_wire({"max_new_tokens": 10, "ignore_eos": True, "stop_token_ids": [7, 9]})
    assert params.stop_token_ids == (7, 9) and SamplingParams.from_wire(params.to_wire()) == params
    req = Request(1, "r", [1, 2], params, seed=0)
    assert req.commit([3, 2, 4], eos_ids=(2,)) == [3, 2, 4] and req.finish_reason is None  # (EOS ignored)
    assert req.commit([5, 9, 7, 8], eos_ids=(2,)) == [5, 9] and req.finish_reason == "stop"
    plain = Request(2, "s", [1], SamplingParams(max_new_tokens=10), seed=0)
    assert plain.commit([3, 9, 2, 4], eos_ids=(2,)) == [3, 9, 2] and plain.finish_reason == "stop"


def test_limit_on_max_new_tokens() -> None:
    with pytest.raises(InvalidParams, match="exceeds the limit"):
        SamplingParams(max_new_tokens=10_000).validate(max_new_tokens_limit=4096)


def test_a_worker_checks_each_distinct_parameter_set_once_and_a_bad_one_every_time() -> None:
    """Every round of a request carries the same parameters: the worker makes them once, yet
    parameters that differ only in type (1 and 1.0 and True) stay apart, and invalid ones are
    refused on every task that carries them."""
    from nebula_flow_workers.tasks import sampling_params

    a = sampling_params({"max_new_tokens": 9, "temperature": 0.5, "stop": ["x"]})
    assert sampling_params({"max_new_tokens": 9, "temperature": 0.5, "stop": ["x"]}) is a
    assert a.temperature == 0.5 and list(a.stop) == ["x"]
    assert sampling_params({"max_new_tokens": 9, "temperature": 1}) is not sampling_params(
        {"max_new_tokens": 9, "temperature": 1.0})
    for _ in range(2):
        with pytest.raises(InvalidParams):
            sampling_params({"max_new_tokens": 9, "temperature": math.inf})
        with pytest.raises(InvalidParams):
            sampling_params({"max_new_tokens": True})
