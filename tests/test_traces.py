"""Traces are checked whole before a request is sent: a line the broker would refuse, or a field it
does not know, stops `replay` at that line (no broker needed to learn it); the window of
--start/--end is from the trace's first request, and an empty one is an error, not a silent run of
nothing. The client library refuses bad parameters with the broker's own messages."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from nebula_flow.cli import main
from nebula_flow.client import build_submit
from nebula_flow.params import InvalidParams
from nebula_flow.traces import Shaping, TraceError, load_trace, shape

BAD_LINES = [
    ('{"prompt": "hi", "max_tokens": 5}', "unknown field 'max_tokens' (did you mean 'max_new_tokens'?)"),
    ('{"prompt": "hi", "temprature": 0.5}', "unknown field 'temprature' (did you mean 'temperature'?)"),
    ("[1, 2]", "a line must be a JSON object, got list"),
    ('{"prompt": 5}', "prompt must be a non-empty string"),
    ('{"prompt": ""}', "prompt must be a non-empty string"),
    ('{"prompt_tokens": "abc"}', "prompt_tokens must be a non-empty list of token ids"),
    ('{"prompt_tokens": [1, -2]}', "prompt_tokens must be a non-empty list of token ids"),
    ('{"prompt_len": 2.5}', "prompt_len must be an integer >= 1, got 2.5"),
    ('{"prompt_len": -3}', "prompt_len must be an integer >= 1, got -3"),
    ('{"prompt": "hi", "prompt_len": 3}', "give exactly one of prompt, prompt_tokens, prompt_len"),
    ('{"prompt": "hi", "arrival_s": "1"}', "arrival_s must be a number of seconds >= 0"),
    ('{"prompt": "hi", "arrival_s": -5}', "arrival_s must be a number of seconds >= 0"),
    ('{"prompt": "hi", "max_new_tokens": 0}', "max_new_tokens must be a positive integer, got 0"),
    ('{"prompt": "hi", "temperature": "hot"}', "temperature must be a finite number"),
    ('{"prompt": "hi", "stop": 3}', "stop must be a string or a list of non-empty strings"),
    ('{"timestamp": "x", "input_length": 10, "output_length": 4, "hash_ids": [1]}', "timestamp must be a number"),
    ('{"timestamp": 0, "input_length": 10, "output_length": -1, "hash_ids": [1]}', "output_length must be an integer"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_a_bad_trace_line_is_refused_with_its_line_number(tmp_path, line: str, message: str) -> None:  # noqa: ANN001
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt": "fine", "arrival_s": 0.5, "stop": ["\\n"], "temperature": 0.7, "seed": 1}\n\n'
                     + line + "\n")
    with pytest.raises(TraceError) as caught:
        load_trace(trace)
    assert str(caught.value).startswith(f"{trace}:3: ") and message in str(caught.value), caught.value


def test_replay_names_a_bad_line_before_it_asks_any_broker(tmp_path) -> None:  # noqa: ANN001
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt": "hi", "max_tokens": 5}\n')
    res = CliRunner().invoke(main, ["replay", str(trace), "--broker", "tcp://127.0.0.1:1", "--out", str(tmp_path)])
    assert res.exit_code == 1 and res.output.startswith(f"Error: {trace}:1: unknown field 'max_tokens'"), res.output
    res = CliRunner().invoke(main, ["replay", str(trace), "--limit", "0"])
    assert res.exit_code == 2 and "--limit" in res.output, res.output


def test_csv_rows_with_impossible_counts_are_refused(tmp_path) -> None:  # noqa: ANN001
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,0,3\n")
    with pytest.raises(TraceError, match=r"t\.csv:2: .*ContextTokens 0"):
        load_trace(trace)


def test_the_window_is_from_the_first_request_and_an_empty_one_is_an_error(tmp_path) -> None:  # noqa: ANN001
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(f'{{"prompt": "p{t}", "arrival_s": {t}}}' for t in (100, 101, 103, 104)))
    window, report = shape(load_trace(trace), Shaping(start_s=2.5, end_s=3.5), context=1024)
    assert [(r.prompt, r.arrival_s) for r in window] == [("p103", 0.0)] and report["requests"] == 1
    window, _ = shape(load_trace(trace), Shaping(time_scale=2), context=1024)
    assert [r.arrival_s for r in window] == [0.0, 0.5, 1.5, 2.0]
    with pytest.raises(TraceError, match="no request of the trace's 4 arrives from 5 s to the end after its first"):
        shape(load_trace(trace), Shaping(start_s=5), context=1024)


@pytest.mark.parametrize(("params", "message"), [
    ({"stop": 3}, "stop must be a string or a list of non-empty strings"),
    ({"stop": ["a", 3]}, "stop must be a string or a list of non-empty strings"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids"),
    ({"temprature": 0.5}, "unknown parameters: ['temprature'] (temprature: did you mean temperature?)"),
    ({"max_tokens": 5, "bogus": 1}, "unknown parameters: ['bogus', 'max_tokens'] (max_tokens: did you mean max_new_tokens?)"),
])
def test_the_client_library_refuses_bad_parameters_as_the_broker_does(params: dict, message: str) -> None:
    with pytest.raises(InvalidParams) as caught:
        build_submit("r", "hi", None, False, **params)
    assert str(caught.value) == message
    sp = build_submit("r", "hi", None, False, stop="\n", stop_token_ids=[7], logit_bias={3: 1.5}, seed=4).params
    assert sp["stop"] == ["\n"] and sp["stop_token_ids"] == [7] and sp["logit_bias"] == {"3": 1.5} and sp["seed"] == 4
