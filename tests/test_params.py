from __future__ import annotations

import math

import pytest

from nebula_flow.params import InvalidParams, SamplingParams


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
])
def test_bad_parameters_are_rejected_with_a_clear_message(raw: dict, match: str) -> None:
    with pytest.raises(InvalidParams, match=match):
        SamplingParams.from_wire(raw)


def test_limit_on_max_new_tokens() -> None:
    with pytest.raises(InvalidParams, match="exceeds the limit"):
        SamplingParams(max_new_tokens=10_000).validate(max_new_tokens_limit=4096)
