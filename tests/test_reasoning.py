"""A reasoning model's thinking apart from its answer (``nebula_flow/api/reasoning.py``; through the
real ``openai`` client: test_api.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nebula_flow.api.reasoning import ThinkingStream, split

CASES = [
    ("qwen3", "<think>\nhmm, 2+2\n</think>\n\nIt is 4.", ("\nhmm, 2+2\n", "It is 4.")),
    ("qwen3", "It is 4.", (None, "It is 4.")),  # (thinking turned off)
    ("qwen3", "<think>cut sh", ("cut sh", None)),  # (cut short by max_tokens: all thinking)
    ("qwen3", "<thin k", (None, "<thin k")),
    ("deepseek_r1", "hmm</think>\n\nAnswer", ("hmm", "Answer")),  # (its <think> was in the prompt)
    ("deepseek_r1", "<think>x</think>y", ("x", "y")),
    ("deepseek_r1", "thinking...", ("thinking...", None)),
]


@pytest.mark.parametrize(("parser", "text", "want"), CASES)
def test_a_finished_output_splits_into_thinking_and_answer(parser: str, text: str, want: tuple) -> None:
    assert split(text, parser) == want


def _streamed(parser: str, text: str, cuts: list[int]) -> tuple[str | None, str | None]:
    stream, pieces, at = ThinkingStream(parser), [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        pieces += stream.feed(text[at:cut])
        at = max(at, cut)
    pieces += stream.rest()
    assert all(text for _, text in pieces)
    return ("".join(t for k, t in pieces if k == "reasoning") or None,
            "".join(t for k, t in pieces if k == "content") or None)


@given(st.sampled_from(CASES), st.lists(st.integers(0, 40), max_size=8))
def test_a_stream_gives_what_the_finished_output_gives_however_it_is_cut(case: tuple, cuts: list[int]) -> None:
    parser, text, want = case
    assert _streamed(parser, text, [c for c in cuts if c <= len(text)]) == want
