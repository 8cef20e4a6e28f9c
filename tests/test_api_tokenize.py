"""vLLM's ``/tokenize`` and ``/detokenize`` and the client library's ``tokenize``: the broker's own
tokenizer at work, checked against HF transformers' tokenizer of the same model and against what
the broker counts for a request of the same prompt."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from nebula_flow.client import AsyncClient, Client, RequestError
from nebula_flow.deploy import Deployment
from tests.conftest import deploy_config

pytestmark = pytest.mark.slow

CONVERSATION = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "A function that adds two numbers."}]
AUTH = {"Authorization": "Bearer sesame"}


@pytest.fixture(scope="module")
def served(tiny_pair):  # noqa: ANN001, ANN201
    cfg = deploy_config(tiny_pair, "colocated", 0, 1)
    with Deployment(cfg) as dep:
        dep.start_api("127.0.0.1", 0, api_key="sesame", model_name="tiny")
        yield dep


@pytest.fixture(scope="module")
def hf(tiny_pair):  # noqa: ANN001, ANN201
    return AutoTokenizer.from_pretrained(str(tiny_pair / "target"))


def chat_ids(hf, generation_prompt: bool = True) -> list[int]:  # noqa: ANN001
    return chat_ids_of(hf, CONVERSATION, generation_prompt)


def chat_ids_of(hf, messages: list[dict], generation_prompt: bool = True) -> list[int]:  # noqa: ANN001
    return list(hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                       return_dict=True)["input_ids"])


def post(dep: Deployment, path: str, body: dict) -> httpx.Response:
    return httpx.post(dep.http_url + path, headers=AUTH, json=body, timeout=60)


def test_tokenize_a_prompt_as_a_request_is_tokenized(served, hf) -> None:  # noqa: ANN001
    """A text's ids are HF's (special tokens added by default, as vLLM's), the count is what a
    completion of that prompt is billed, the pieces are the vocabulary's; a text longer than the
    broker tokenizes inline goes to its tokenizer thread and comes back the same."""
    prompt = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"
    res = post(served, "/tokenize", {"model": "tiny", "prompt": prompt, "return_token_strs": True})
    assert res.status_code == 200, res.text
    got = res.json()
    assert got["tokens"] == hf(prompt)["input_ids"] and got["count"] == len(got["tokens"])
    assert got["token_strs"] == hf.convert_ids_to_tokens(got["tokens"])
    model = httpx.get(served.http_url + "/v1/models", headers=AUTH).json()["data"][0]
    assert got["max_model_len"] == model["max_model_len"]
    api = openai.OpenAI(base_url=served.http_url + "/v1", api_key="sesame", max_retries=0, timeout=60)
    assert api.completions.create(model="tiny", prompt=prompt, max_tokens=1).usage.prompt_tokens == got["count"]
    plain = post(served, "/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()  # (model optional)
    assert plain["tokens"] == hf(prompt, add_special_tokens=False)["input_ids"] and plain["token_strs"] is None
    long = "x = [" + ", ".join(str(i) for i in range(3000)) + "]"  # (past the broker's INLINE_CHARS)
    assert post(served, "/tokenize", {"prompt": long}).json()["tokens"] == hf(long)["input_ids"]


def test_tokenize_a_conversation_through_the_chat_template(served, hf) -> None:  # noqa: ANN001
    """Messages go through the chat template as a chat request's (the generation prompt by default,
    as HF's ``apply_chat_template``); the count is what a chat completion is billed."""
    got = post(served, "/tokenize", {"model": "tiny", "messages": CONVERSATION}).json()
    assert got["tokens"] == chat_ids(hf)
    api = openai.OpenAI(base_url=served.http_url + "/v1", api_key="sesame", max_retries=0, timeout=60)
    chat = api.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=1)
    assert chat.usage.prompt_tokens == got["count"]
    bare = post(served, "/tokenize", {"messages": CONVERSATION, "add_generation_prompt": False}).json()
    assert bare["tokens"] == chat_ids(hf, generation_prompt=False)
    assert bare["count"] < got["count"]


def test_an_answer_begun_in_the_final_message_is_continued(served, hf) -> None:  # noqa: ANN001
    """vLLM's ``continue_final_message`` (transformers' ``apply_chat_template`` keyword): the final
    assistant message is left open, no new turn begun, so a chat completion continues the answer
    the caller began (an assistant prefill); ``/tokenize`` gives the same ids as HF's."""
    begun = [*CONVERSATION, {"role": "assistant", "content": "def add(a, b):\n    return"}]
    want = list(hf.apply_chat_template(begun, continue_final_message=True, tokenize=True, return_dict=True)["input_ids"])
    got = post(served, "/tokenize", {"messages": begun, "continue_final_message": True}).json()
    assert got["tokens"] == want and hf.decode(want).endswith("    return")
    api = openai.OpenAI(base_url=served.http_url + "/v1", api_key="sesame", max_retries=0, timeout=60)
    chat = api.chat.completions.create(model="tiny", messages=begun, max_tokens=12, temperature=0,
                                       extra_body={"continue_final_message": True, "return_token_ids": True})
    with Client(served.address) as c:
        assert chat.choices[0].model_extra["token_ids"] == c.generate(token_ids=want, max_new_tokens=12).token_ids
    assert chat.usage.prompt_tokens == len(want)
    # vLLM's chat echo: the answer begins with the final assistant message it continues (streamed first)
    echoed = api.chat.completions.create(model="tiny", messages=begun, max_tokens=12, temperature=0,
                                         extra_body={"continue_final_message": True, "echo": True})
    assert echoed.choices[0].message.content == begun[-1]["content"] + chat.choices[0].message.content
    events = api.chat.completions.create(model="tiny", messages=begun, max_tokens=12, temperature=0, stream=True,
                                         extra_body={"continue_final_message": True, "echo": True})
    deltas = [e.choices[0].delta.content for e in events if e.choices and e.choices[0].delta.content]
    assert deltas[0] == begun[-1]["content"] and "".join(deltas) == echoed.choices[0].message.content
    plain = api.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=6, temperature=0)
    same = api.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=6, temperature=0,
                                       extra_body={"echo": True})  # (the final message is the user's: nothing added)
    assert same.choices[0].message.content == plain.choices[0].message.content
    closed = post(served, "/tokenize", {"messages": begun}).json()["tokens"]  # (by default: a new turn after it)
    assert closed == chat_ids_of(hf, begun) and len(closed) > len(want)
    res = post(served, "/v1/chat/completions", {"model": "tiny", "messages": [*CONVERSATION, {"role": "assistant",
                                                "content": "   "}], "continue_final_message": True})
    assert res.status_code == 400 and "final message" in res.json()["error"]["message"], res.text


def test_detokenize_and_the_client_library(served, hf) -> None:  # noqa: ANN001
    """Ids back to text (special tokens kept, as HF's ``decode``); the blocking and asyncio clients
    ask the broker the same."""
    ids = hf("def add(a, b):\n    return a + b")["input_ids"]
    res = post(served, "/detokenize", {"model": "tiny", "tokens": ids})
    assert res.status_code == 200 and res.json() == {"prompt": hf.decode(ids)}
    with Client(served.address) as c:
        assert c.tokenize("def add(a, b):").token_ids == hf("def add(a, b):")["input_ids"]
        back = c.tokenize(token_ids=ids, pieces=True)
        assert back.text == hf.decode(ids) and back.pieces == hf.convert_ids_to_tokens(ids)
        with pytest.raises(RequestError, match="invalid_prompt"):
            c.tokenize(token_ids=[len(hf) + 10_000])

    async def both() -> tuple:
        async with AsyncClient(served.address) as ac:
            return await asyncio.gather(ac.tokenize("def add(a, b):"), ac.tokenize(messages=CONVERSATION))

    text, chat = asyncio.run(both())
    assert text.token_ids == hf("def add(a, b):")["input_ids"]
    assert chat.token_ids == chat_ids(hf)


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"prompt": "x", "messages": CONVERSATION}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": CONVERSATION, "continue_final_message": True, "add_generation_prompt": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"messages": CONVERSATION, "continue_final_message": 1}, 400, "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0]"),
    ("/tokenize", {"messages": CONVERSATION, "tools": [{"type": "nope"}]}, 400, "tools"),
    ("/tokenize", {"prompt": "x", "temperature": 0}, 400, "temperature"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CONVERSATION, "echo": True, "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "echo"),
    ("/v1/chat/completions", {"model": "tiny", "messages": CONVERSATION, "echo": 1}, 400, "echo"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
])
def test_bad_tokenize_bodies_are_clear_errors(served, path: str, body: dict, status: int, param: str) -> None:  # noqa: ANN001
    res = post(served, path, body)
    assert res.status_code == status and res.json()["error"]["param"] == param, res.text


def test_tokenize_needs_the_api_key_and_is_counted(served) -> None:  # noqa: ANN001
    assert httpx.post(served.http_url + "/tokenize", json={"prompt": "x"}).status_code == 401
    assert post(served, "/tokenize", {"prompt": "x"}).status_code == 200
    metrics = httpx.get(served.http_url + "/metrics", headers=AUTH).text
    assert 'nebula_api_requests_total{endpoint="tokenize",status="200"}' in metrics
    assert 'nebula_api_requests_total{endpoint="tokenize",status="401"}' in metrics
