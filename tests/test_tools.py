"""Tool calling's request side and answer shapes (``nebula_flow/api/tools.py``; through the real
``openai`` client: test_api.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nebula_flow import structured
from nebula_flow.api.errors import ApiError
from nebula_flow.api.request import Served, parse_chat
from nebula_flow.api.tools import CallStream, ToolCalling, hermes

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
HI = [{"role": "user", "content": "hi"}]


def chat(**body) -> object:  # noqa: ANN003
    return parse_chat({"model": "tiny", "messages": HI, **body}, Served("tiny"))


def test_a_named_function_forces_its_arguments() -> None:
    job = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert job.params["structured"] == {"json": WEATHER} and job.calls == ToolCalling("get_weather")
    assert job.inputs[0]["chat_options"] == {"tools": TOOLS}  # (the template renders them)
    content, [call] = job.calls.split('{"city": "Oslo"}')
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'} and call["id"].startswith("call_")
    assert content is None and job.calls.finish_reason == "stop"
    assert job.calls.split('{"city": "Os') == ('{"city": "Os', None)  # (cut short: no call, its text)


def test_required_forces_an_array_of_calls_and_parallel_false_one() -> None:
    job = chat(tools=TOOLS, tool_choice="required")
    spec = job.params["structured"]["json"]
    assert spec["type"] == "array" and spec["minItems"] == 1 and "maxItems" not in spec
    assert [c["properties"]["name"]["enum"] for c in spec["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    structured.check(job.params["structured"])
    assert chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).params["structured"]["json"]["maxItems"] == 1
    _, calls = job.calls.split('[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{"city":"Rome"}}]')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {}), ("get_weather", {"city": "Rome"})]
    assert job.calls.finish_reason == "tool_calls"


def test_none_renders_the_tools_and_answers_in_text() -> None:
    job = chat(tools=TOOLS, tool_choice="none")
    assert job.calls is None and "structured" not in job.params and job.inputs[0]["chat_options"] == {"tools": TOOLS}


def test_a_conversation_with_tool_calls_and_results_goes_to_the_template() -> None:
    turn = HI + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    messages = chat(messages=turn, tools=TOOLS, tool_choice="none").inputs[0]["messages"]
    assert messages[1]["content"] is None and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


def test_auto_reads_the_models_own_calls_with_a_parser() -> None:
    job = parse_chat({"model": "tiny", "messages": HI, "tools": TOOLS}, Served("tiny", tool_parser="hermes"))
    assert job.calls == ToolCalling(None, auto=True) and "structured" not in job.params  # (the model decides)
    content, calls = job.calls.split('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                     '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}')  # (the last unended)
    assert content == "Let me look." and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert job.calls.split("It is sunny.") == ("It is sunny.", None)


@pytest.mark.parametrize("text", ["<tool_call>{not json}</tool_call>", '<tool_call>["get_time"]</tool_call>',
                                  'x <tool_call>{"arguments": {}}</tool_call>'])
def test_a_malformed_call_leaves_the_whole_output_content(text: str) -> None:
    assert hermes(text) == (text, None)


def test_a_stream_sends_text_until_a_call_begins() -> None:
    gate, sent = CallStream(auto=True), []
    for piece in ["Hello", " there <", "tool", "_call>{", '"name": "x"}</tool_call>']:
        sent.append(gate.feed(piece))
    assert sent == ["Hello", " there ", "", "", ""] and gate.sent == len("Hello there ")
    words = CallStream(auto=True)
    assert [words.feed(p) for p in ["a <", "b", "<tool", "s>"]] == ["a ", "<b", "", "<tools>"]  # (held, then let go)
    forced = CallStream(auto=False)
    assert forced.feed('{"city": "Oslo"}') == "" and forced.sent == 0


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"tools": TOOLS}, "tool_choice", "unsupported_parameter"),  # (auto, the default: no parser of the model's format)
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "unsupported_parameter"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "invalid_value"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"}, "tools", "invalid_value"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools", "invalid_value"),
    ({"tools": TOOLS * 2, "tool_choice": "none"}, "tools", "invalid_value"),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid_value"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "invalid_value"),
    ({"tools": TOOLS, "tool_choice": "required", "logprobs": True}, "logprobs", "unsupported_parameter"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "invalid_value"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}]}, "messages[0]", "invalid_value"),
])
def test_bad_tool_requests_are_refused_by_name(body: dict, param: str, code: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_chat({"model": "tiny", "messages": HI, **body}, Served("tiny"))
    assert (err.value.status, err.value.param, err.value.code) == (400, param, code), err.value.message


CALLS_TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo }", "at": {"day": 1}}}\n'
              '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}')  # (the last unended)


def _stream(text: str, cuts: list[int]) -> tuple[str, list[list[dict]], dict[int, tuple[str, str]]]:
    """``text`` streamed through a ``CallStream`` in pieces cut at ``cuts``, then completed as the
    gateway completes it: the content sent, the call deltas of each piece, and each call put
    together from its deltas (name, arguments), as a client does."""
    gate, content, per_piece = CallStream(auto=True), "", []
    bounds = [0, *sorted(set(cuts)), len(text)]
    for a, b in zip(bounds, bounds[1:]):
        content += gate.feed(text[a:b])
        per_piece.append(gate.calls())
    per_piece.append(gate.rest(hermes(text)[1]))
    calls: dict[int, tuple[str, str]] = {}
    for delta in (d for piece in per_piece for d in piece):
        name, args = calls.get(delta["index"], ("", ""))
        calls[delta["index"]] = (name + delta["function"].get("name", ""), args + delta["function"]["arguments"])
    return content, per_piece, calls


@given(st.lists(st.integers(1, len(CALLS_TEXT) - 1), max_size=12))
@settings(max_examples=200, deadline=None)
def test_auto_calls_stream_as_they_are_written_and_add_up_to_the_finished_calls(cuts: list[int]) -> None:
    """However the text is cut into pieces, the streamed content is the text before the first call
    and the calls put together from their deltas are the finished output's, arguments as the model
    wrote them (a brace inside a string, nested objects, an unended last call)."""
    content, _, calls = _stream(CALLS_TEXT, cuts)
    want_content, want_calls = hermes(CALLS_TEXT)
    assert content.rstrip() == want_content
    assert list(calls.values()) == [(c["function"]["name"], c["function"]["arguments"]) for c in want_calls]
    assert [json.loads(a) for _, a in calls.values()] == [{"city": "Oslo }", "at": {"day": 1}}, {"tz": "CET"}]


def test_a_call_is_named_before_it_ends_and_its_arguments_grow_piece_by_piece() -> None:
    """Fed a character at a time: each call's name goes out once its head is written, long before
    its end, and its arguments in many pieces; a call not written name first goes out whole at the
    end, its arguments normalized."""
    text = CALLS_TEXT
    _, per_piece, _ = _stream(text, list(range(1, len(text))))
    named = [i for i, piece in enumerate(per_piece) for d in piece if "name" in d["function"]]
    assert named[0] < text.index("Oslo") and named[1] < text.index("CET")
    assert sum(1 for piece in per_piece[:-1] for d in piece if d["function"]["arguments"]) > 20
    late = '<tool_call>{"arguments": {"tz": "UTC"}, "name": "get_time"}</tool_call>'
    _, per_piece, calls = _stream(late, list(range(1, len(late))))
    assert not any(per_piece[:-1]) and calls == {0: ("get_time", '{"tz": "UTC"}')}


def test_a_named_functions_arguments_stream_as_they_grow() -> None:
    gate = CallStream(auto=False, forced="get_weather")
    first, second = gate.arguments('{"city": '), gate.arguments('"Oslo"}')
    assert first["function"] == {"name": "get_weather", "arguments": '{"city": '} and first["id"].startswith("call_")
    assert second == {"index": 0, "function": {"arguments": '"Oslo"}'}} and gate.arguments("") is None


REQUIRED_TEXT = '[{"name": "get_weather", "parameters": {"city": "Oslo ]}"}}, {"name":"get_time","parameters":{}}]'


@given(st.lists(st.integers(1, len(REQUIRED_TEXT) - 1), max_size=12))
@settings(max_examples=200, deadline=None)
def test_required_calls_stream_as_they_are_written_and_add_up_to_the_finished_calls(cuts: list[int]) -> None:
    """``"required"``'s JSON array, cut anywhere: no content, and the calls put together from their
    deltas are the finished output's (parameters as written, a bracket inside a string)."""
    gate, deltas = CallStream(auto=False), []
    bounds = [0, *sorted(set(cuts)), len(REQUIRED_TEXT)]
    for a, b in zip(bounds, bounds[1:]):
        assert gate.feed(REQUIRED_TEXT[a:b]) == ""
        deltas += gate.calls()
    content, want = ToolCalling(None).split(REQUIRED_TEXT)
    deltas += gate.rest(want)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        calls.setdefault(d["index"], ["", ""])
        calls[d["index"]][0] += d["function"].get("name", "")
        calls[d["index"]][1] += d["function"]["arguments"]
    assert content is None and [tuple(c) for c in calls.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in want]
    assert [json.loads(a) for _, a in calls.values()] == [{"city": "Oslo ]}"}, {}]
    fed = CallStream(auto=False)  # (a character at a time: named long before the array ends)
    named = [i for i in range(len(REQUIRED_TEXT)) for d in (fed.feed(REQUIRED_TEXT[i]), fed.calls())[1] if "name" in d["function"]]
    assert named[0] < REQUIRED_TEXT.index("Oslo") and named[1] < REQUIRED_TEXT.index("{}")
