"""The token budget of one forward (chunked prefill): the pure plan."""

from __future__ import annotations

from nebula_flow.budget import MIN_CHUNK, plan_forward


def test_no_budget_or_a_batch_within_it_runs_whole() -> None:
    assert plan_forward([1, 5, 900], [0, 0, 899], 0) == [None, None, None]
    assert plan_forward([1, 5, 90], [0, 0, 89], 96) == [None, None, None]


def test_decode_and_verify_rows_go_first_and_a_long_prompt_gets_what_is_left() -> None:
    # three decode steps and a 2,000-token prompt: 64 tokens a forward
    plan = plan_forward([2000, 1, 1, 1], [1999, 0, 0, 0], 64)
    assert plan == [64 - 3, None, None, None]


def test_a_second_long_prompt_waits_and_the_first_always_moves() -> None:
    assert plan_forward([500, 800], [499, 799], 64) == [64, 0]
    # the budget taken by rows that cannot wait: the prompt still moves MIN_CHUNK
    assert plan_forward([300] + [1] * 70, [299] + [0] * 70, 64) == [MIN_CHUNK] + [None] * 70


def test_rows_that_cannot_wait_run_whole_even_past_the_budget() -> None:
    assert plan_forward([100, 3], [0, 0], 64) == [None, None]


def test_a_prompt_one_token_over_is_cut_just_before_its_last() -> None:
    # 60 uncached tokens beside a decode step, 60 allowed: 59 now, the last with its logits next time
    assert plan_forward([60, 1], [59, 0], 60) == [59, None]
