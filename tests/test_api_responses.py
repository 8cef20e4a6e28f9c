"""OpenAI's Responses API (``/v1/responses``) as users reach it: the official ``openai`` client's
``responses.create``, ``responses.stream``, ``retrieve`` and ``delete``, raw server-sent events,
against served tiny pairs; checked against HF transformers' greedy output, the chat endpoint and
the same request on another placement."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from nebula_flow.deploy import Deployment
from nebula_flow.tokenizer import TextCodec
from tests.conftest import deploy_config, hf_greedy

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
                         "additionalProperties": False}}]


@pytest.fixture(scope="module")
def served(tiny_pair):  # noqa: ANN001, ANN201
    """Pooled 1+1 behind the gateway (an API key; the hermes tool-call format, qwen3's thinking)."""
    with Deployment(deploy_config(tiny_pair, "pooled", 1, 1)) as dep:
        dep.start_api("127.0.0.1", 0, api_key="sesame", model_name="tiny", tool_parser="hermes", reasoning_parser="qwen3")
        yield dep


@pytest.fixture(scope="module")
def elsewhere(tiny_pair):  # noqa: ANN001, ANN201
    """The same model on another placement: colocated, one worker that drafts and verifies."""
    with Deployment(deploy_config(tiny_pair, "colocated", 0, 1)) as dep:
        dep.start_api("127.0.0.1", 0, api_key="sesame", model_name="tiny", reasoning_parser="qwen3")
        yield dep


def oai(dep: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=dep.http_url + "/v1", api_key="sesame", max_retries=0, timeout=60)


def hf_text(tiny_pair, messages: list[dict], n: int) -> str:  # noqa: ANN001
    """HF transformers alone, greedy: ``n`` tokens after the conversation as the chat template renders it."""
    tok = AutoTokenizer.from_pretrained(tiny_pair / "target")
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    return tok.decode(hf_greedy(tiny_pair / "target", ids, n), skip_special_tokens=True)


def test_a_response_is_the_targets_greedy_output_and_the_chat_answer(served, tiny_pair) -> None:  # noqa: ANN001
    """``instructions`` and ``input`` are the conversation; the text is HF's greedy text of it (through
    speculation in pooled mode), the chat endpoint's answer, and the usage is the chat's, reshaped."""
    client = oai(served)
    got = client.responses.create(model="tiny", instructions="You write Python.", input="Add two numbers.",
                                  max_output_tokens=24, temperature=0)
    conversation = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Add two numbers."}]
    assert got.output_text == hf_text(tiny_pair, conversation, 24)
    chat = client.chat.completions.create(model="tiny", messages=conversation, max_completion_tokens=24, temperature=0)
    assert got.output_text == chat.choices[0].message.content
    assert (got.usage.input_tokens, got.usage.output_tokens, got.usage.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    [message] = got.output
    assert message.type == "message" and message.role == "assistant" and got.id.startswith("resp_")
    assert got.instructions == "You write Python." and got.max_output_tokens == 24 and got.store is True
    cut = client.responses.create(model="tiny", input="Add two numbers.", max_output_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3
    effort = client.responses.create(model="tiny", input="Add two numbers.", max_output_tokens=2,
                                     reasoning={"effort": "high", "summary": "auto"})
    codec = TextCodec(served.cfg.target.model)  # (the effort is the template's variable, as chat's reasoning_effort)
    assert effort.usage.input_tokens == len(codec.encode_chat([{"role": "user", "content": "Add two numbers."}],
                                                              {"reasoning_effort": "high"})) and effort.reasoning.effort == "high"
    done = client.responses.create(model="tiny", input="Add two numbers.", max_output_tokens=400, temperature=0)
    assert done.status == "completed" and done.incomplete_details is None  # (the tiny model ends before 400)


def test_a_stream_puts_together_the_same_response(served) -> None:  # noqa: ANN001
    """``responses.stream`` (the client library's accumulation) ends with the response unstreamed,
    from events numbered in order; raw events name their type on the ``event:`` line too."""
    client, ask = oai(served), {"model": "tiny", "input": "Write a haiku.", "max_output_tokens": 400, "temperature": 0}
    want = client.responses.create(**ask)
    assert want.status == "completed"
    with client.responses.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == want.output_text and final.usage.output_tokens == want.usage.output_tokens
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.output_text
    body = {**ask, "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", served.http_url + "/v1/responses", json=body, timeout=60,
                      headers={"Authorization": "Bearer sesame"}) as res:
        blocks = res.read().decode().strip().split("\n\n")
    assert res.headers["content-type"].startswith("text/event-stream")
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and json.loads(data[len("data: "):])["type"] == event[len("event: "):]
    assert json.loads(blocks[-1].split("\n")[1][6:])["type"] == "response.incomplete"  # (cut at max_output_tokens)


def test_a_conversation_goes_on_from_a_stored_response(served) -> None:  # noqa: ANN001
    """``previous_response_id`` continues the stored conversation (the chat endpoint with the whole
    conversation answers the same); ``retrieve`` gives it back, ``delete`` forgets it; with ``store``
    false nothing is kept."""
    client = oai(served)
    first = client.responses.create(model="tiny", input="Name a fruit.", max_output_tokens=12, temperature=0)
    second = client.responses.create(model="tiny", input="And a colour.", previous_response_id=first.id,
                                     max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model="tiny", max_completion_tokens=12, temperature=0, messages=[
        {"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And a colour."}])
    assert second.output_text == chat.choices[0].message.content and second.previous_response_id == first.id
    as_items = client.responses.create(model="tiny", max_output_tokens=12, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "And a colour."}])
    assert as_items.output_text == second.output_text
    [asked] = client.responses.input_items.list(second.id).data  # (its own input, not the earlier turns')
    assert (asked.type, asked.role, asked.content[0].type, asked.content[0].text) == (
        "message", "user", "input_text", "And a colour.")
    page = client.responses.input_items.list(as_items.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["Name a fruit.", first.output_text] and page.has_more
    rest = client.responses.input_items.list(as_items.id, order="asc", after=page.last_id)
    assert [i.content[0].text for i in rest.data] == ["And a colour."] and not rest.has_more
    newest = client.responses.input_items.list(as_items.id, limit=1).data  # (newest first, as OpenAI lists them)
    assert [i.id for i in newest] == [rest.data[0].id]
    for query, param in (("limit=0", "limit"), ("order=up", "order"), ("after=msg_x", "after"), ("page=2", "page")):
        res = httpx.get(f"{served.http_url}/v1/responses/{as_items.id}/input_items?{query}", timeout=10,
                        headers={"Authorization": "Bearer sesame"})
        assert res.status_code == 400 and res.json()["error"]["param"] == param
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="tiny", input="x", previous_response_id=first.id, max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id"
    unkept = client.responses.create(model="tiny", input="x", store=False, max_output_tokens=2)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_function_calls_and_their_outputs(served) -> None:  # noqa: ANN001
    """A named function: a ``function_call`` item whose arguments follow its schema (the chat
    endpoint's call), streamed as argument deltas; the call and its output go back as input items,
    as the chat endpoint takes an assistant's calls and tool messages."""
    client = oai(served)
    ask = {"model": "tiny", "input": "Weather in Oslo?", "tools": TOOLS, "max_output_tokens": 30, "temperature": 0,
           "tool_choice": {"type": "function", "name": "get_weather"}}
    got = client.responses.create(**ask)
    [call] = got.output
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Oslo?"}], max_completion_tokens=30, temperature=0,
        tools=[{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.arguments == chat.choices[0].message.tool_calls[0].function.arguments
    assert set(json.loads(call.arguments)) == {"city"} and call.call_id.startswith("call_")
    with client.responses.stream(**ask) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        [streamed] = stream.get_final_response().output
    assert len(deltas) > 1 and "".join(deltas) == call.arguments == streamed.arguments
    follow = [{"role": "user", "content": "Weather in Oslo?"},
              {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    answer = client.responses.create(model="tiny", input=follow, tools=TOOLS, tool_choice="none", max_output_tokens=8,
                                     temperature=0)
    chat = client.chat.completions.create(model="tiny", max_completion_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}],
        tools=[{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}], tool_choice="none")
    assert answer.output_text == chat.choices[0].message.content


def test_thinking_a_structured_text_and_logprobs(served) -> None:  # noqa: ANN001
    """The thinking is a ``reasoning`` item before the message (streamed as reasoning deltas);
    ``text.format`` a JSON schema makes JSON that follows it; ``include`` logprobs gives each token's,
    the chat endpoint's."""
    client = oai(served)
    think = {"regex": "<think>[a-z]{1,12}</think>\n(yes|no)"}
    ask = {"model": "tiny", "input": "Is it raining?", "max_output_tokens": 40, "temperature": 0,
           "extra_body": {"structured_outputs": think}}
    got = client.responses.create(**ask)
    thinking, message = got.output
    assert thinking.type == "reasoning" and thinking.content[0].text.isalpha() and got.output_text in ("yes", "no")
    with client.responses.stream(**ask) as stream:
        reasoned = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
        final = stream.get_final_response()
    assert reasoned == thinking.content[0].text and final.output_text == got.output_text
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
              "additionalProperties": False}
    shaped = client.responses.create(model="tiny", input="A name.", max_output_tokens=40, temperature=0,
                                     text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    assert set(json.loads(shaped.output_text)) == {"name"}
    scored = client.responses.create(model="tiny", input="hi", max_output_tokens=4, temperature=0, top_logprobs=2,
                                     include=["message.output_text.logprobs"])
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    logprobs = scored.output[-1].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert [(p.token, len(p.top_logprobs)) for p in logprobs] == [(p.token, 2) for p in want]
    # (equal to float rounding: the two requests' rows were computed in batches of other shapes)
    assert [p.logprob for p in logprobs] == pytest.approx([p.logprob for p in want], abs=1e-4)


def test_seeded_sampling_is_the_same_on_any_placement(served, elsewhere) -> None:  # noqa: ANN001
    """A seeded sampled response is the same in pooled mode and colocated, and the chat endpoint's."""
    ask = {"model": "tiny", "input": "Tell me a story.", "max_output_tokens": 24, "temperature": 1.0,
           "extra_body": {"seed": 7, "ignore_eos": True}}
    here, there = oai(served).responses.create(**ask), oai(elsewhere).responses.create(**ask)
    chat = oai(served).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Tell me a story."}],
                                               max_completion_tokens=24, temperature=1.0, seed=7,
                                               extra_body={"ignore_eos": True})
    assert here.output_text == there.output_text == chat.choices[0].message.content
    other = oai(served).responses.create(**{**ask, "extra_body": {"seed": 8, "ignore_eos": True}})
    assert other.output_text != here.output_text


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({"input": "x", "background": True}, 400, "background"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, 400, "reasoning"),
    ({"input": "x", "reasoning": {"summary": "long"}}, 400, "reasoning"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input[0]"),
    ({"input": [{"role": "narrator", "content": "x"}]}, 400, "input[0]"),
    ({"input": ""}, 400, "input"),
    ({}, 400, "input"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10 ** 6}, 400, "max_output_tokens"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, 400, "include"),
    ({"input": "x", "top_logprobs": 3}, 400, "top_logprobs"),
    ({"input": "x", "previous_response_id": "resp_none"}, 404, "previous_response_id"),
])
def test_bad_requests_are_refused_by_name(served, body, status, param) -> None:  # noqa: ANN001
    res = httpx.post(served.http_url + "/v1/responses", json={"model": "tiny", **body}, timeout=30,
                     headers={"Authorization": "Bearer sesame"})
    assert res.status_code == status and res.json()["error"]["param"] == param, res.text
    assert httpx.get(served.http_url + "/v1/responses/resp_x", timeout=10).status_code == 401  # (the API key)


def test_a_chat_stream_becomes_responses_events() -> None:
    """The reshaping alone (pure): thinking, text and two calls become three kinds of items in order,
    each added, grown and done; a failure at the broker ends the stream with OpenAI's error event."""
    import asyncio

    import orjson

    from nebula_flow.api.response_items import ResponseShaper, ResponseStream
    from nebula_flow.api.responses import ResponseStore, parse

    def chunk(delta: dict, reason: str | None = None) -> dict:
        return {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

    calls = [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{\"x\""}},
             {"index": 0, "function": {"arguments": ": 1}"}}, {"index": 1, "id": "call_b", "function": {"name": "g"}}]
    chat = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "hm"}),
            chunk({"reasoning_content": "m"}), chunk({"content": "Hi"}), *[chunk({"tool_calls": [c]}) for c in calls],
            chunk({}, "tool_calls"), {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5,
                                                                "total_tokens": 8}}, "[DONE]"]

    async def run(events: list) -> tuple[list[dict], list[dict]]:
        async def source():  # noqa: ANN202
            for e in events:
                yield e
        kept: list[dict] = []
        ask = parse({"model": "m", "input": "x"}, ResponseStore())
        out = [b async for b in ResponseStream(ResponseShaper(ask, "m", "r"), kept.append).events(source())]
        return [orjson.loads(b.split(b"\ndata: ")[1]) for b in out], kept

    events, kept = asyncio.run(run(chat))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final == kept[0]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert {i["status"] for i in final["output"]} == {"completed"}
    assert final["output"][0]["content"][0]["text"] == "hmm" and final["output"][1]["content"][0]["text"] == "Hi"
    assert [(i["call_id"], i["name"], i["arguments"]) for i in final["output"][2:]] == [
        ("call_a", "f", "{\"x\": 1}"), ("call_b", "g", "")]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2, 3]
    assert final["usage"]["input_tokens"] == 3 and final["usage"]["output_tokens"] == 5
    failed, kept = asyncio.run(run([chunk({"content": "Hi"}), {"error": {
        "message": "the request failed", "type": "server_error", "param": None, "code": "worker_lost"}}]))
    assert failed[-1] == {"type": "error", "sequence_number": len(failed) - 1, "code": "worker_lost",
                          "message": "the request failed", "param": None} and not kept
