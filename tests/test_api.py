"""The OpenAI-compatible HTTP API as users reach it: the official ``openai`` client, raw SSE with
httpx, disconnects, overload, bad and fuzzed bodies, the API key; against a served tiny pair."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import time

import httpx
import openai
import orjson
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState

from nebula_flow.cli import main
from nebula_flow.client import Client
from nebula_flow.deploy import Deployment
from nebula_flow.params import MIN_REPETITION_PENALTY
from nebula_flow.tokenizer import TextCodec
from tests.conftest import SAMPLE_TRACE, deploy_config, tiny_config_file

pytestmark = pytest.mark.slow

CONVERSATION = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "A function that adds two numbers."},
                {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
                {"role": "user", "content": "Now one that multiplies them."}]


@pytest.fixture(scope="module")
def served(tiny_pair):  # noqa: ANN001, ANN201
    """Pooled 1+1 with the gateway (an API key: callers must send it; the hermes tool-call format and
    qwen3's thinking)."""
    cfg = deploy_config(tiny_pair, "pooled", 1, 1)
    with Deployment(cfg) as dep:
        dep.start_api("127.0.0.1", 0, api_key="sesame", model_name="tiny", tool_parser="hermes", reasoning_parser="qwen3",
                      allowed_origins=("https://ui.example",))
        yield dep


@pytest.fixture(scope="module")
def strict(tiny_pair):  # noqa: ANN001, ANN201
    """A small deployment with tight limits: 2 requests admitted, at most 4 tokens each."""
    cfg = deploy_config(tiny_pair, "colocated", 0, 1)
    cfg.broker.max_pending, cfg.broker.max_new_tokens_limit = 2, 4
    with Deployment(cfg) as dep:
        dep.start_api("127.0.0.1", 0, model_name="tiny")
        yield dep


def oai(dep: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=dep.http_url + "/v1", api_key="sesame", max_retries=0, timeout=60)


def test_completions_equal_the_zmq_client_token_for_token(served) -> None:  # noqa: ANN001
    prompt = "def fibonacci(n):"
    with Client(served.address) as c:
        want = c.generate(prompt, max_new_tokens=24)
    got = oai(served).completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                         extra_body={"return_token_ids": True})
    choice = got.choices[0]
    assert choice.model_extra["token_ids"] == want.token_ids and choice.text == want.text
    assert choice.finish_reason == want.finish_reason == "length"
    prompt_len = len(TextCodec(served.cfg.target.model).encode(prompt))
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (prompt_len, 24)
    assert got.usage.total_tokens == prompt_len + 24 and got.model == "tiny"
    assert got.model_extra["speculative"]["rounds"] == want.rounds
    # streamed: the same tokens, chunk by chunk, and the usage at the end
    events = list(oai(served).completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"return_token_ids": True}))
    assert [t for e in events if e.choices for t in e.choices[0].model_extra.get("token_ids", [])] == want.token_ids
    assert "".join(e.choices[0].text for e in events if e.choices) == want.text
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 24


def test_chat_equals_the_zmq_client_and_passes_template_options(served) -> None:  # noqa: ANN001
    with Client(served.address) as c:
        want = c.generate(messages=CONVERSATION, max_new_tokens=20)
        quiet = c.generate(messages=CONVERSATION, chat_options={"enable_thinking": False}, max_new_tokens=20)
    client = oai(served)
    got = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_completion_tokens=20, temperature=0,
                                         extra_body={"return_token_ids": True})
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.text
    assert got.choices[0].model_extra["token_ids"] == want.token_ids
    codec = TextCodec(served.cfg.target.model)
    assert got.usage.prompt_tokens == len(codec.encode_chat(CONVERSATION))
    # the template option reaches the template: the prompt grows by the empty thinking block
    off = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=20, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens == len(codec.encode_chat(CONVERSATION, {"enable_thinking": False}))
    assert off.usage.prompt_tokens > got.usage.prompt_tokens and off.choices[0].message.content == quiet.text
    # OpenAI's reasoning_effort is the template's variable (as vLLM hands it to gpt-oss's template)
    low = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=2, reasoning_effort="low")
    assert low.usage.prompt_tokens == len(codec.encode_chat(CONVERSATION, {"reasoning_effort": "low"})) > \
        got.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=2, reasoning_effort="extreme")
    assert err.value.body["param"] == "reasoning_effort"
    stream = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=20, temperature=0,
                                            stream=True)
    events = list(stream)
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events) == want.text


def test_seeded_sampling_and_stop_strings(served) -> None:  # noqa: ANN001
    prompt = "import os\n\ndef list_files(path):"
    with Client(served.address) as c:
        want = c.generate(prompt, max_new_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
        greedy = c.generate(prompt, max_new_tokens=24)
    client = oai(served)
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    assert got.choices[0].text == want.text
    # stop: the text ends before the first stop string, finish_reason "stop"
    stop = next(greedy.text[i:i + 3] for i in range(4, len(greedy.text)) if greedy.text[i:i + 3].strip())
    cut = greedy.text[:greedy.text.find(stop)]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "\x00"])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=24,
                                          temperature=0, stop=stop, stream=True)
    assert stop not in "".join(e.choices[0].delta.content or "" for e in chat)


def test_n_choices_and_prompt_batches_equal_single_requests(served) -> None:  # noqa: ANN001
    """Each choice is a request of its own: choice j of a seeded request is the single request with
    seed + j, token for token, and a batch's choices come prompt by prompt, n each."""
    prompts = ["def fibonacci(n):", "import os\n\n"]
    with Client(served.address) as c:
        want = [c.generate(p, max_new_tokens=12, temperature=0.9, top_p=0.95, seed=77 + j) for p in prompts for j in range(2)]
        greedy = c.generate(prompts[0], max_new_tokens=12)
    assert want[0].token_ids != want[1].token_ids  # (the seeds differ, so do the choices)
    client = oai(served)
    body = {"model": "tiny", "prompt": prompts, "n": 2, "max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 77,
            "extra_body": {"return_token_ids": True}}
    got = client.completions.create(**body)
    assert [ch.index for ch in got.choices] == [0, 1, 2, 3]
    assert [ch.model_extra["token_ids"] for ch in got.choices] == [w.token_ids for w in want]
    assert [ch.text for ch in got.choices] == [w.text for w in want]
    codec = TextCodec(served.cfg.target.model)
    assert got.usage.prompt_tokens == sum(len(codec.encode(p)) for p in prompts)  # (each prompt once)
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    assert got.model_extra["speculative"]["rounds"] == sum(w.rounds for w in want)
    # streamed: every chunk names its choice; each choice ends once; the usage comes last
    ids: dict[int, list[int]] = {}
    ends = []
    events = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    for e in events:
        for ch in e.choices:
            ids.setdefault(ch.index, []).extend(ch.model_extra.get("token_ids", []))
            if ch.finish_reason:
                ends.append(ch.index)
    assert [ids[i] for i in range(4)] == [w.token_ids for w in want] and sorted(ends) == [0, 1, 2, 3]
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == got.usage.completion_tokens
    # greedy choices are all the target's own greedy output; chat streams a role for each choice
    two = client.completions.create(model="tiny", prompt=prompts[0], n=2, max_tokens=12, temperature=0)
    assert [ch.text for ch in two.choices] == [greedy.text] * 2
    chat = list(client.chat.completions.create(model="tiny", messages=CONVERSATION, n=3, max_tokens=6, stream=True,
                                               temperature=0))
    roles = [ch.index for e in chat for ch in e.choices if ch.delta.role == "assistant"]
    assert sorted(roles) == [0, 1, 2]
    texts = ["".join(ch.delta.content or "" for e in chat for ch in e.choices if ch.index == i) for i in range(3)]
    assert texts[0] and texts == [texts[0]] * 3


def test_continuous_usage_stats_count_every_event(served) -> None:  # noqa: ANN001
    """vLLM's ``continuous_usage_stats``: every streamed event carries its choice's usage so far (its
    prompt's tokens as the answer's usage counts them, the tokens streamed to it until then), from a
    chat's first event (the role, nothing made yet) to its end; the closing usage event is unchanged."""
    client, prompts = oai(served), ["def fibonacci(n):", "import os\n\n"]
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": "tiny", "prompt": prompts, "n": 2, "max_tokens": 7, "temperature": 0, "stream": True,
            "extra_body": {"return_token_ids": True, "ignore_eos": True}}
    events = list(client.completions.create(**body, stream_options=options))
    counts = [client.completions.create(model="tiny", prompt=p, max_tokens=1).usage.prompt_tokens for p in prompts]
    made = [0] * 4
    for e in events[:-1]:
        [ch] = e.choices
        made[ch.index] += len(ch.model_extra.get("token_ids", []))
        assert (e.usage.prompt_tokens, e.usage.completion_tokens, e.usage.total_tokens) == (
            counts[ch.index // 2], made[ch.index], counts[ch.index // 2] + made[ch.index])
    assert made == [7] * 4 and events[-1].choices == []
    assert (events[-1].usage.prompt_tokens, events[-1].usage.completion_tokens) == (sum(counts), 28)
    chat = list(client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=5, temperature=0,
                                               stream=True, stream_options=options, extra_body={"ignore_eos": True}))
    prompt = chat[-1].usage.prompt_tokens
    assert chat[0].choices[0].delta.role == "assistant" and (chat[0].usage.prompt_tokens, chat[0].usage.completion_tokens) \
        == (prompt, 0)
    assert [e.usage.prompt_tokens for e in chat] == [prompt] * len(chat) and chat[-2].usage.completion_tokens == 5
    plain = list(client.completions.create(**body, stream_options={"include_usage": True, "include_obfuscation": False}))
    assert all(e.usage is None for e in plain[:-1])  # (asked for only; no obfuscation, as asked)
    quiet = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=2, verbosity="medium",
                                           prompt_cache_key="c-1", safety_identifier="u-1")
    assert quiet.usage.completion_tokens <= 2  # (OpenAI's newer fields, accepted where they ask nothing else)


def test_choices_past_the_admission_limit_are_refused_whole(strict) -> None:  # noqa: ANN001
    """3 choices where 2 requests are admitted: a 429, and the admitted choices do not linger."""
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    res = httpx.post(strict.http_url + "/v1/completions", json={**body, "n": 3}, timeout=30)
    assert res.status_code == 429 and res.json()["error"]["type"] == "rate_limit_error"
    with Client(strict.address) as c:
        deadline = time.monotonic() + 5.0
        while c.status()["pool"]:
            assert time.monotonic() < deadline, "a refused answer's admitted choices still run"
            time.sleep(0.05)
    ok = httpx.post(strict.http_url + "/v1/completions", json={**body, "n": 2}, timeout=30)
    assert ok.status_code == 200 and [ch["index"] for ch in ok.json()["choices"]] == [0, 1]
    assert ok.json()["usage"]["completion_tokens"] == 8


def test_stop_token_ids_end_the_output_and_leave_its_text(served) -> None:  # noqa: ANN001
    """vLLM's ``stop_token_ids``: the output ends at the first of them (kept among the ids, not in
    the text, ``finish_reason`` "stop"), with ``ignore_eos`` or not; the client library and the
    HTTP API agree."""
    prompt = "def fibonacci(n):"
    codec = TextCodec(served.cfg.target.model)
    with Client(served.address) as c:
        greedy = c.generate(prompt, max_new_tokens=24, ignore_eos=True)
        at = next(i for i in range(3, 24) if greedy.token_ids[i] not in greedy.token_ids[:i])
        stop = greedy.token_ids[at]
        cut = c.generate(prompt, max_new_tokens=24, ignore_eos=True, stop_token_ids=[stop, 1 << 30])
    assert cut.token_ids == greedy.token_ids[:at + 1] and cut.finish_reason == "stop"
    assert cut.text == codec.decode(greedy.token_ids[:at])
    got = oai(served).completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                         extra_body={"stop_token_ids": [stop], "ignore_eos": True, "return_token_ids": True})
    assert got.choices[0].model_extra["token_ids"] == cut.token_ids and got.choices[0].text == cut.text
    assert got.choices[0].finish_reason == "stop"
    events = list(oai(served).completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                                 extra_body={"stop_token_ids": [stop]}))
    assert "".join(e.choices[0].text for e in events) == cut.text


def test_logprobs_in_openai_shape_equal_the_client_librarys(served) -> None:  # noqa: ANN001
    """``logprobs`` (completions: a count) and ``logprobs``/``top_logprobs`` (chat): each token's
    log-probability and the top tokens beside it, as the client library gets them (the target's own:
    ``test_e2e_lossless``), streamed or not."""
    prompt = "def fibonacci(n):"
    with Client(served.address) as c:
        want = c.generate(prompt, max_new_tokens=10, logprobs=2)
        chat_want = c.generate(messages=CONVERSATION, max_new_tokens=8, logprobs=3, temperature=0.7, seed=5)
    client = oai(served)
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert lp.tokens == [e[1] for e in want.logprobs] and lp.token_logprobs == [e[2] for e in want.logprobs]
    assert lp.top_logprobs == [{t[1]: t[2] for t in e[3]} for e in want.logprobs]
    assert lp.text_offset == [sum(len(e[1]) for e in want.logprobs[:i]) for i in range(len(want.logprobs))]
    events = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=2,
                                            stream=True))
    streamed = [e.choices[0].logprobs for e in events if e.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    chat = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=8, temperature=0.7, seed=5,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert [(t.token, t.logprob) for t in content] == [(e[1], e[2]) for e in chat_want.logprobs]
    assert all(t.bytes == list(t.token.encode()) and len(t.top_logprobs) == 3 for t in content)
    assert [[x.token for x in t.top_logprobs] for t in content] == [[x[1] for x in e[3]] for e in chat_want.logprobs]
    plain = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=4, logprobs=True)
    assert all(t.top_logprobs == [] for t in plain.choices[0].logprobs.content)  # (top_logprobs 0 by default)
    assert client.completions.create(model="tiny", prompt=prompt, max_tokens=4).choices[0].logprobs is None
    res = httpx.post(served.http_url + "/v1/chat/completions", headers={"Authorization": "Bearer sesame"},
                     json={"model": "tiny", "messages": CONVERSATION, "top_logprobs": 2})
    assert res.status_code == 400 and res.json()["error"]["param"] == "top_logprobs"


def test_echo_scores_the_prompt_as_an_evaluation_harness_asks(served) -> None:  # noqa: ANN001
    """``echo`` (OpenAI's): the text begins with the prompt (a token-id prompt decoded by the broker),
    and with ``logprobs`` the prompt's tokens come first, the first one's null: the request an
    evaluation harness sends to score a continuation (token ids, ``max_tokens`` 1, ``logprobs`` 1).
    Streamed, the prompt is the first event. The figures are the client library's (the target's
    own: ``test_e2e_lossless``)."""
    prompt = [5, 40, 7, 300, 12, 9, 81, 3]
    with Client(served.address) as c:
        want = c.generate(token_ids=prompt, max_new_tokens=1, prompt_logprobs=1, logprobs=1, echo=True)
        text_want = c.generate("def fibonacci(n):", max_new_tokens=6)
    client = oai(served)
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    choice = got.choices[0]
    assert want.prompt_text and choice.text == want.prompt_text + want.text
    lp, entries = choice.logprobs, want.prompt_logprobs + want.logprobs
    assert [e[0] for e in want.prompt_logprobs] == prompt and len(lp.tokens) == len(prompt) + 1
    assert lp.tokens == [e[1] for e in entries] and lp.token_logprobs == [e[2] for e in entries]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.top_logprobs[1:] == [{t[1]: t[2] for t in e[3]} for e in entries[1:]]
    assert got.usage.prompt_tokens == len(prompt) and got.usage.completion_tokens == 1
    events = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=1,
                                            echo=True, stream=True))
    texts = [e.choices[0].text for e in events if e.choices]
    assert texts[0] == want.prompt_text and "".join(texts) == choice.text
    streamed = [e.choices[0].logprobs for e in events if e.choices and e.choices[0].logprobs]
    assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    # a text prompt is echoed as given; without logprobs none are computed
    two = client.completions.create(model="tiny", prompt="def fibonacci(n):", max_tokens=6, temperature=0, echo=True,
                                    n=2)
    assert [c.text for c in two.choices] == ["def fibonacci(n):" + text_want.text] * 2
    assert all(c.logprobs is None for c in two.choices)
    for body, param in (({"echo": "yes"}, "echo"), ({"messages": CONVERSATION, "echo": "yes"}, "echo")):
        chat = "messages" in body
        res = httpx.post(served.http_url + ("/v1/chat/completions" if chat else "/v1/completions"),
                         headers={"Authorization": "Bearer sesame"},
                         json={"model": "tiny", **({} if chat else {"prompt": "x"}), **body})
        assert res.status_code == 400 and res.json()["error"]["param"] == param, res.text


def test_echo_with_max_tokens_0_is_the_prompt_alone_scored(served) -> None:  # noqa: ANN001
    """``echo`` with ``max_tokens`` 0 (vLLM's, and older evaluation harnesses'): the answer is the
    prompt alone, with its tokens' logprobs, ``finish_reason`` ``length`` and no completion tokens;
    streamed, the prompt and then the end. Without echo, or on chat, 0 stays a 400."""
    prompt = [5, 40, 7, 300, 12, 9, 81, 3]
    with Client(served.address) as c:
        want = c.generate(token_ids=prompt, max_new_tokens=1, prompt_logprobs=2, echo=True)
    client = oai(served)
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, temperature=0, logprobs=2, echo=True)
    choice = got.choices[0]
    assert choice.text == want.prompt_text and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs == [e[2] for e in want.prompt_logprobs]
    assert choice.logprobs.tokens == [e[1] for e in want.prompt_logprobs]
    assert got.usage.prompt_tokens == len(prompt) and got.usage.completion_tokens == 0
    events = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=0, temperature=0, logprobs=2,
                                            echo=True, stream=True))
    choices = [e.choices[0] for e in events if e.choices]
    assert "".join(ch.text for ch in choices) == want.prompt_text and choices[-1].finish_reason == "length"
    assert [v for ch in choices if ch.logprobs for v in ch.logprobs.token_logprobs] == choice.logprobs.token_logprobs
    texts = client.completions.create(model="tiny", prompt=["def f(x):", "import os"], max_tokens=0, echo=True, n=2)
    assert sorted(ch.text for ch in texts.choices) == ["def f(x):"] * 2 + ["import os"] * 2
    assert all(ch.logprobs is None and ch.finish_reason == "length" for ch in texts.choices)
    for body in ({"prompt": "x", "max_tokens": 0}, {"prompt": "x", "max_tokens": 0, "echo": True, "min_tokens": 1},
                 {"messages": CONVERSATION, "max_tokens": 0, "echo": True}):
        chat = "messages" in body
        res = httpx.post(served.http_url + ("/v1/chat/completions" if chat else "/v1/completions"),
                         headers={"Authorization": "Bearer sesame"}, json={"model": "tiny", **body})
        assert res.status_code == 400, res.text


def test_an_evaluation_harness_scores_continuations_through_echo(served) -> None:  # noqa: ANN001
    """lm-evaluation-harness's loglikelihood requests, as its ``local-completions`` sends them (a
    batch of token-id prompts, context + continuation each, ``echo``, ``logprobs`` 1, ``max_tokens``
    1, a seed) and read as it reads them: the continuation's log-likelihood is the sum of its
    tokens' ``token_logprobs``, and it is greedy when each equals the best of its ``top_logprobs``.
    The model's own greedy continuation is greedy; another is not, and is less likely."""
    context = [5, 40, 7, 300, 12, 9]
    with Client(served.address) as c:
        greedy = c.generate(token_ids=context, max_new_tokens=4, ignore_eos=True).token_ids
    other = [(t + 1) % 400 for t in greedy]
    body = {"model": "tiny", "prompt": [context + greedy, context + other], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}
    res = httpx.post(served.http_url + "/v1/completions", headers={"Authorization": "Bearer sesame"}, json=body,
                     timeout=60)
    assert res.status_code == 200, res.text
    scored = []
    for choice in sorted(res.json()["choices"], key=lambda ch: ch["index"]):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(context) + 4 + 1 and lp["token_logprobs"][0] is None
        tokens, tops = lp["token_logprobs"][len(context):-1], lp["top_logprobs"][len(context):-1]
        scored.append((sum(tokens), all(t == max(top.values()) for t, top in zip(tokens, tops))))
    (greedy_ll, greedy_is_greedy), (other_ll, other_is_greedy) = scored
    assert greedy_is_greedy and not other_is_greedy and greedy_ll > other_ll


def test_prompt_logprobs_as_vllm_answers_them(served) -> None:  # noqa: ANN001
    """vLLM's ``prompt_logprobs`` extension: per prompt token after the first, by token id, its own
    and the top tokens' log-probability, rank and text (a completion's on each choice, a chat's
    beside the choices), as the client library gets them; beside echo's logprobs, each shows the
    top tokens it asked for. Not streamed: a clear 400."""
    prompt = [5, 40, 7, 300, 12, 9]
    with Client(served.address) as c:
        want = c.generate(token_ids=prompt, max_new_tokens=2, prompt_logprobs=3).prompt_logprobs
        chat_want = c.generate(messages=CONVERSATION, max_new_tokens=2, prompt_logprobs=1).prompt_logprobs
    url, auth = served.http_url, {"Authorization": "Bearer sesame"}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3,
            "echo": True, "logprobs": 1}
    choice = httpx.post(url + "/v1/completions", headers=auth, json=body, timeout=60).json()["choices"][0]
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(prompt)
    for entry, (token, text, logprob, top, rank) in zip(got[1:], want[1:]):
        assert entry[str(token)]["logprob"] == logprob and entry[str(token)]["decoded_token"] == text
        assert [entry[str(t[0])]["rank"] for t in top] == [1, 2, 3]
        # (the prompt token's rank, as vLLM's: where it is among the top ones, its place there)
        assert entry[str(token)]["rank"] == rank == next((r for r, t in enumerate(top, 1) if t[0] == token), rank)
        assert set(entry) == {str(token), *(str(t[0]) for t in top)}
    assert any(e[4] > 3 for e in want[1:])  # (ranks past the tokens reported are given too)
    assert all(len(t) <= 1 for t in choice["logprobs"]["top_logprobs"][1:])  # (echo's logprobs: 1 each)
    chat = httpx.post(url + "/v1/chat/completions", headers=auth, timeout=60, json={
        "model": "tiny", "messages": CONVERSATION, "max_tokens": 2, "prompt_logprobs": 1}).json()
    assert "prompt_logprobs" not in chat["choices"][0] and len(chat["prompt_logprobs"]) == len(chat_want)
    assert [next(iter(e.values()))["logprob"] for e in chat["prompt_logprobs"][1:]] == [e[2] for e in chat_want[1:]]
    for extra, param in (({"stream": True}, "prompt_logprobs"), ({"prompt_logprobs": 21}, "prompt_logprobs")):
        res = httpx.post(url + "/v1/completions", headers=auth, json={**body, **extra}, timeout=60)
        assert res.status_code == 400 and res.json()["error"]["param"] == param, res.text


def test_penalties_reach_the_broker(served) -> None:  # noqa: ANN001
    """OpenAI's presence and frequency penalties and vLLM's repetition_penalty: the HTTP API gives
    what the client library gives (the penalized output itself: ``test_e2e_lossless``)."""
    prompt, knobs = "def fibonacci(n):", {"presence_penalty": 0.6, "frequency_penalty": 0.3, "repetition_penalty": 1.4}
    with Client(served.address) as c:
        want = c.generate(prompt, max_new_tokens=16, **knobs)
        plain = c.generate(prompt, max_new_tokens=16)
    assert want.token_ids != plain.token_ids
    got = oai(served).completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                         presence_penalty=0.6, frequency_penalty=0.3,
                                         extra_body={"repetition_penalty": 1.4, "return_token_ids": True})
    assert got.choices[0].model_extra["token_ids"] == want.token_ids


def test_the_least_repetition_penalty_samples_through_both_pools(served) -> None:  # noqa: ANN001
    """At ``MIN_REPETITION_PENALTY`` (a positive logit divided by it, then by the temperature) a
    sampled request's draft proposals and verify stay finite: it completes through the OpenAI client
    (a tinier penalty, 0 in fp32, failed inside the draft worker with a server error; now refused)."""
    got = oai(served).completions.create(model="tiny", prompt="def fibonacci(n):", max_tokens=16, temperature=1.0,
                                         seed=3, extra_body={"repetition_penalty": MIN_REPETITION_PENALTY,
                                                             "ignore_eos": True, "return_token_ids": True})
    assert got.choices[0].finish_reason == "length" and len(got.choices[0].model_extra["token_ids"]) == 16


def test_logit_bias_through_the_openai_client(served) -> None:  # noqa: ANN001
    """OpenAI's ``logit_bias`` (string keys): what the client library gives; +100 forces a token,
    -100 bans one (its exactness in every mode: ``test_e2e_lossless``)."""
    prompt, client = "def fibonacci(n):", oai(served)
    with Client(served.address) as c:
        plain = c.generate(prompt, max_new_tokens=12)
        banned = plain.token_ids[0]
        want = c.generate(prompt, max_new_tokens=12, logit_bias={banned: -100, 42: 3.0})
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                    logit_bias={str(banned): -100, "42": 3.0}, extra_body={"return_token_ids": True})
    assert got.choices[0].model_extra["token_ids"] == want.token_ids != plain.token_ids
    assert banned not in want.token_ids
    forced = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_completion_tokens=5, temperature=0,
                                            logit_bias={"42": 100}, extra_body={"return_token_ids": True})
    assert forced.choices[0].model_extra["token_ids"] == [42] * 5


def test_structured_outputs_through_the_openai_client(served) -> None:  # noqa: ANN001
    """OpenAI's ``response_format`` (a JSON schema, streamed and not) and vLLM's ``structured_outputs``:
    the HTTP API gives what the client library gives, and the JSON follows the schema (its
    exactness in every mode: ``test_e2e_lossless``)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    client = oai(served)
    with Client(served.address) as c:
        want = c.generate(messages=CONVERSATION, max_new_tokens=30, structured={"json": schema})
        choice = c.generate("The quick brown fox", max_new_tokens=8, structured={"choice": ["jumps", "sleeps"]})
    got = client.chat.completions.create(
        model="tiny", messages=CONVERSATION, max_completion_tokens=30, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "count", "schema": schema, "strict": True}})
    assert got.choices[0].message.content == want.text and got.choices[0].finish_reason == "stop"
    assert set(json.loads(want.text)) == {"n"}
    streamed = client.chat.completions.create(
        model="tiny", messages=CONVERSATION, max_completion_tokens=30, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "count", "schema": schema}})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want.text
    picked = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["jumps", "sleeps"]}})
    assert picked.choices[0].text == choice.text and choice.text in ("jumps", "sleeps")
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"guided_regex": "[a-"})
    assert err.value.body["param"] == "guided_regex" and "unclosed" in err.value.body["message"]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"], "additionalProperties": False}}}]


def test_tool_calls_through_the_openai_client(served, strict) -> None:  # noqa: ANN001
    """A named function and ``"required"``: the answer's message holds tool calls whose arguments
    follow the tool's schema (its output is the structured output the client library gives for
    that schema); streamed, a named function's arguments come as they are made (the client library
    puts the same call together), and so do ``"required"``'s calls; a conversation that carries calls
    and their results goes on; ``"auto"`` reads the model's own calls where the server knows their
    format (this model makes none: its text is the content, streamed alike), and is refused by name
    where it does not."""
    client = oai(served)
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    weather = TOOLS[0]["function"]["parameters"]
    with Client(served.address) as c:
        want = c.generate(messages=ask, max_new_tokens=30, structured={"json": weather})
    named = client.chat.completions.create(model="tiny", messages=ask, tools=TOOLS, max_completion_tokens=30, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == want.text
    assert set(json.loads(call.function.arguments)) == {"city"} and named.choices[0].finish_reason == "stop"
    assert named.choices[0].message.content is None
    required = client.chat.completions.create(model="tiny", messages=ask, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, max_completion_tokens=60, temperature=0)
    assert required.choices[0].finish_reason == "tool_calls"
    [call] = required.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments), dict)
    state = ChatCompletionStreamState()  # (the client library's own accumulation of a stream)
    for chunk in client.chat.completions.create(model="tiny", messages=ask, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, max_completion_tokens=60, temperature=0,
                                                stream=True):
        state.handle_chunk(chunk)
    [streamed] = state.get_final_completion().choices[0].message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    stream = client.chat.completions.create(model="tiny", messages=ask, tools=TOOLS, max_completion_tokens=30,
                                            temperature=0, stream=True,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [tc for d in deltas for tc in d.delta.tool_calls or ()]
    # (the arguments as they are made: the first delta names the call, the rest add to its arguments)
    assert len(calls) > 1 and calls[0].function.name == "get_weather" and calls[0].id and calls[0].type == "function"
    assert all(tc.index == 0 and tc.id is None and tc.function.name is None for tc in calls[1:])
    assert "".join(tc.function.arguments for tc in calls) == want.text
    assert not any(d.delta.content for d in deltas) and deltas[-1].finish_reason == "stop"
    state = ChatCompletionStreamState()  # (the client library's own accumulation of a stream)
    for chunk in client.chat.completions.create(model="tiny", messages=ask, tools=TOOLS, max_completion_tokens=30,
                                                temperature=0, stream=True, tool_choice={
                                                    "type": "function", "function": {"name": "get_weather"}}):
        state.handle_chunk(chunk)
    [call] = state.get_final_completion().choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", want.text)
    turn = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model="tiny", messages=turn, tools=TOOLS, tool_choice="none",
                                            max_completion_tokens=8, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    auto = client.chat.completions.create(model="tiny", messages=ask, tools=TOOLS, max_completion_tokens=12, temperature=0)
    assert auto.choices[0].message.content and auto.choices[0].message.tool_calls is None
    stream = client.chat.completions.create(model="tiny", messages=ask, tools=TOOLS, max_completion_tokens=12,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == auto.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:
        oai(strict).chat.completions.create(model="tiny", messages=ask, tools=TOOLS, max_completion_tokens=4)
    assert err.value.body["param"] == "tool_choice" and "--tool-call-parser" in err.value.body["message"]


def test_thinking_apart_from_the_answer(served) -> None:  # noqa: ANN001
    """With a reasoning parser (qwen3 here) a chat answer carries the thinking as ``reasoning_content``
    and the rest as ``content``, streamed alike, token ids riding along. (The tiny model is made to
    think by a grammar in the thinking format; an answer that does not begin with <think> is all
    content.)"""
    client, ask = oai(served), [{"role": "user", "content": "Is it raining?"}]
    think = {"regex": "<think>[a-z]{1,12}</think>\n(yes|no)"}
    got = client.chat.completions.create(model="tiny", messages=ask, max_completion_tokens=40, temperature=0,
                                         extra_body={"structured_outputs": think, "return_token_ids": True})
    message = got.choices[0].message
    with Client(served.address) as c:
        want = c.generate(messages=ask, max_new_tokens=40, structured=think)
    thinking, answer = want.text.split("</think>\n")
    assert message.model_extra["reasoning_content"] == thinking[len("<think>"):] and message.content == answer
    assert answer in ("yes", "no")
    stream = client.chat.completions.create(model="tiny", messages=ask, max_completion_tokens=40, temperature=0,
                                            stream=True, extra_body={"structured_outputs": think, "return_token_ids": True})
    deltas = [c.choices[0] for c in stream if c.choices]
    assert "".join(d.delta.model_extra.get("reasoning_content") or "" for d in deltas) == thinking[len("<think>"):]
    assert "".join(d.delta.content or "" for d in deltas) == answer
    assert [t for d in deltas for t in d.model_extra.get("token_ids") or ()] == want.token_ids
    plain = client.chat.completions.create(model="tiny", messages=ask, max_completion_tokens=8, temperature=0)
    assert plain.choices[0].message.model_extra["reasoning_content"] is None and plain.choices[0].message.content


def test_raw_server_sent_events(served) -> None:  # noqa: ANN001
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "stream": True}
    with httpx.stream("POST", served.http_url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": "Bearer sesame"}) as res:
        assert res.status_code == 200 and res.headers["content-type"].startswith("text/event-stream")
        raw = res.read().decode()
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [orjson.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    plain = httpx.post(served.http_url + "/v1/completions", json={**body, "stream": False}, timeout=60,
                       headers={"Authorization": "Bearer sesame"}).json()
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]


def test_a_client_that_leaves_mid_stream_frees_its_request(served) -> None:  # noqa: ANN001
    body = {"model": "tiny", "prompt": "def forever():", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with Client(served.address) as c:
        before = c.status()["counters"].get("requests_cancelled", 0)
        with httpx.stream("POST", served.http_url + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer sesame"}) as res:
            lines = res.iter_lines()
            assert next(lines).startswith("data: ")
        left = time.monotonic()  # the connection is closed here
        while (st := c.status())["counters"].get("requests_cancelled", 0) == before:
            assert time.monotonic() - left < 2.0, "the broker still runs the request of a client that left"
            time.sleep(0.05)
        assert st["pool"] == 0
        c.generate(token_ids=[6, 7], max_new_tokens=4, ignore_eos=True)  # a batch applies the FREE
        assert all(w["kv"]["held_requests"] == 1 for w in c.status()["workers"])  # only that request's KV is left
        # the same for a request that does not stream
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served.http_url + "/v1/completions", json={**body, "stream": False}, timeout=1.0,
                       headers={"Authorization": "Bearer sesame"})
        left = time.monotonic()
        while c.status()["counters"].get("requests_cancelled", 0) == before + 1:
            assert time.monotonic() - left < 2.0, "a non-streamed request outlived its client"
            time.sleep(0.05)


def test_min_p_reaches_every_draft_and_verify(served) -> None:  # noqa: ANN001
    """vLLM's ``min_p``: at 1 only the most likely token is left, so a sampled request's output is
    the greedy one (drafts and verifies both cut); at 0.05 it samples still, seeded as any."""
    prompt = "def fibonacci(n):"
    client = oai(served)
    greedy = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, seed=1)
    cut = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=1.5, seed=1,
                                    extra_body={"min_p": 1.0})
    assert cut.choices[0].text == greedy.choices[0].text
    loose = [client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=1.5, seed=s,
                                       extra_body={"min_p": 0.05}).choices[0].text for s in (1, 1, 2)]
    assert loose[0] == loose[1] and greedy.choices[0].text not in loose


def test_vllm_extras_stop_strings_kept_prompts_truncated_tokens_named_by_id(served) -> None:  # noqa: ANN001
    """vLLM's ``include_stop_str_in_output`` (the stop string, or stop token, stays in the text;
    streamed alike), ``truncate_prompt_tokens`` (only the prompt's last N tokens run: the output is
    that shorter prompt's, and echo shows it), ``return_tokens_as_token_ids`` (logprobs name tokens
    "token_id:N") and ``GET /version``."""
    client, prompt = oai(served), "import os\n"
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0,
                                     extra_body={"return_token_ids": True})
    text, ids = full.choices[0].text, full.choices[0].model_extra["token_ids"]
    stop = next(text[i:i + 3] for i in range(6, len(text) - 3) if text[i:i + 3].strip() and text[i:i + 3] not in text[:i])
    kept = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[:text.index(stop) + 3] and kept.choices[0].finish_reason == "stop"
    events = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=[stop],
                                       stream=True, extra_body={"include_stop_str_in_output": True})
    assert "".join(e.choices[0].text for e in events if e.choices) == kept.choices[0].text
    with Client(served.address) as c:
        by_id = c.generate(prompt, max_new_tokens=30, stop_token_ids=[ids[4]], include_stop_str_in_output=True)
        plain = c.generate(prompt, max_new_tokens=30, stop_token_ids=[ids[4]])
    cut = ids[:ids.index(ids[4]) + 1]
    assert by_id.token_ids == plain.token_ids == cut and by_id.text.startswith(plain.text) and len(by_id.text) > len(plain.text)
    long = [(7 * j) % 300 + 5 for j in range(20)]
    short = client.completions.create(model="tiny", prompt=long, max_tokens=8, temperature=0, echo=True,
                                      extra_body={"truncate_prompt_tokens": 6, "return_token_ids": True})
    alone = client.completions.create(model="tiny", prompt=long[-6:], max_tokens=8, temperature=0, echo=True,
                                      extra_body={"return_token_ids": True})
    assert short.usage.prompt_tokens == 6 and short.choices[0].model_extra["token_ids"] == \
        alone.choices[0].model_extra["token_ids"] and short.choices[0].text == alone.choices[0].text
    named = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, logprobs=2,
                                      extra_body={"return_tokens_as_token_ids": True})
    assert named.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids[:5]]
    assert all(k.startswith("token_id:") for top in named.choices[0].logprobs.top_logprobs for k in top)
    for body in ({"truncate_prompt_tokens": 0}, {"include_stop_str_in_output": "yes"}):
        res = httpx.post(served.http_url + "/v1/completions", headers={"Authorization": "Bearer sesame"},
                         json={"model": "tiny", "prompt": "x", **body})
        assert res.status_code == 400 and res.json()["error"]["param"] == next(iter(body)), res.text
    assert httpx.get(served.http_url + "/version").json() == {"version": importlib.metadata.version("nebula-flow")}


def test_special_tokens_text_where_asked(served) -> None:  # noqa: ANN001
    """vLLM's ``skip_special_tokens`` false: special tokens' text stays in the output (here EOS,
    forced by a logit bias and not ending it with ``ignore_eos``); an EOS that ends the output is in
    its token ids but not its text, unless ``include_stop_str_in_output``."""
    codec = TextCodec(served.cfg.target.model)
    eos = codec.eos_token_id
    eos_text = codec.tok.decode([eos], skip_special_tokens=False)
    assert eos_text and not codec.decode([eos])

    def complete(**extra: object) -> dict:
        body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 3, "temperature": 0, "return_token_ids": True,
                "logit_bias": {str(eos): 100}, **extra}
        res = httpx.post(served.http_url + "/v1/completions", headers={"Authorization": "Bearer sesame"}, json=body)
        assert res.status_code == 200, res.text
        return res.json()["choices"][0]

    assert complete(ignore_eos=True)["text"] == ""
    shown = complete(ignore_eos=True, skip_special_tokens=False)
    assert shown["token_ids"] == [eos] * 3 and shown["text"] == eos_text * 3
    ended = complete(skip_special_tokens=False)
    assert ended["token_ids"] == [eos] and ended["text"] == "" and ended["finish_reason"] == "stop"
    assert complete(skip_special_tokens=False, include_stop_str_in_output=True)["text"] == eos_text
    events = oai(served).completions.create(model="tiny", prompt="def f(x):", max_tokens=3, temperature=0,
                                            stream=True, extra_body={"logit_bias": {str(eos): 100}, "ignore_eos": True,
                                                                     "skip_special_tokens": False})
    assert "".join(e.choices[0].text for e in events if e.choices) == eos_text * 3


def test_overload_answers_429_and_every_admitted_request_completes(strict) -> None:  # noqa: ANN001
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=strict.http_url, timeout=60) as http:
            body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(20)))

    answers = asyncio.run(burst())
    codes = [r.status_code for r in answers]
    assert set(codes) <= {200, 429} and codes.count(429) >= 10 and codes.count(200) >= 2
    for r in answers:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert r.json()["usage"]["completion_tokens"] == 4 and r.json()["choices"][0]["finish_reason"] == "length"


LONG = " ".join(str(i) for i in range(3000))
BAD = [
    ({"prompt": "x"}, 400, "model"),
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    ({"model": "tiny", "prompt": "x", "n": 129}, 400, "n"),
    ({"model": "tiny", "prompt": ["x"] * 65, "n": 2}, 400, "n"),  # 130 choices
    ({"model": "tiny", "prompt": ["x"] * 129}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"model": "tiny", "prompt": "x", "logprobs": True}, 400, "logprobs"),
    ({"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"model": "tiny", "prompt": "x", "echo": 1}, 400, "echo"),
    ({"model": "tiny", "prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ({"model": "tiny", "prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ({"model": "tiny", "prompt": "x", "bad_words": [""]}, 400, "bad_words"),
    ({"model": "tiny", "prompt": "x", "bad_words": "x"}, 400, "bad_words"),
    ({"model": "tiny", "prompt": "x", "allowed_token_ids": [1, "2"]}, 400, "allowed_token_ids"),
    ({"model": "tiny", "prompt": "x", "allowed_token_ids": [10 ** 6]}, 400, None),  # (the broker knows the vocabulary)
    ({"model": "tiny", "prompt": "x", "max_tokens": 5}, 400, "max_tokens"),  # over the limit of 4
    ({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": "tiny", "prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": "yes"}}, 400,
     "stream_options"),
    ({"model": "tiny", "prompt": "x", "stream": True, "stream_options": {"include_obfuscation": True}}, 400,
     "stream_options"),
    ({"model": "tiny", "prompt": "x", "verbosity": "high"}, 400, "verbosity"),
    ({"model": "tiny", "prompt": "x", "prompt_cache_key": 7}, 400, "prompt_cache_key"),
    ({"model": "tiny", "prompt": "x", "prompt_cache_key": "k" * 1025}, 400, "prompt_cache_key"),
    ({"model": "tiny", "prompt": "x", "safety_identifier": ["u"]}, 400, "safety_identifier"),
    ({"model": "tiny", "prompt": ["a", ""]}, 400, "prompt[1]"),
    ({"model": "tiny", "prompt": [[5, 6], "b", 7]}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({"model": "tiny", "prompt": "x", "stop": [1]}, 400, "stop"),
    ({"model": "tiny", "prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"model": "tiny", "prompt": "x", "stop_token_ids": 5}, 400, "stop_token_ids"),
    ({"model": "tiny", "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"model": "tiny", "prompt": "x", "frequency_penalty": "high"}, 400, "frequency_penalty"),
    ({"model": "tiny", "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"model": "tiny", "prompt": "hi", "repetition_penalty": 1.2559881381636063e-56}, 400, "repetition_penalty"),  # (was a 500)
    ({"model": "tiny", "prompt": "x", "min_tokens": -2}, 400, "min_tokens"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"5": 200}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"five": 1}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"99999": 1}}, 400, None),  # (past the vocabulary: the broker)
    ({"model": "tiny", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, 400,
     "response_format"),
    ({"model": "tiny", "prompt": LONG}, 400, None),  # over the context: the limit is in the message
    ({"model": "tiny", "prompt": [[1, 2], [99999]]}, 400, "prompt"),  # (past the vocabulary: the broker; was "messages")
]


@pytest.mark.parametrize(("body", "status", "param"), BAD)
def test_bad_requests_get_openai_errors(strict, body, status, param) -> None:  # noqa: ANN001
    res = httpx.post(strict.http_url + "/v1/completions", json=body, timeout=30)
    err = res.json()["error"]
    assert res.status_code == status and err["param"] == param and err["message"], (res.status_code, err)
    if body.get("prompt") == LONG:
        assert "1024" in err["message"]  # the tiny target's context


def test_a_misspelled_field_is_named_with_the_one_meant(strict) -> None:  # noqa: ANN001
    res = httpx.post(strict.http_url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_token": 4,
                                                                "frobnicate": 1}, timeout=30)
    err = res.json()["error"]
    assert res.status_code == 400 and err["code"] == "unknown_parameter" and err["param"] == "frobnicate"
    assert err["message"] == ("unrecognized request argument(s): frobnicate, max_token (max_token: did you mean "
                              "max_tokens?)")
    chat = httpx.post(strict.http_url + "/v1/chat/completions", json={"model": "tiny", "top_logprob": 2,
                                                                      "messages": [{"role": "user", "content": "x"}]})
    assert "top_logprob: did you mean top_logprobs?" in chat.json()["error"]["message"]
    bad = httpx.post(strict.http_url + "/v1/chat/completions", json={"model": "tiny", "messages": [
        {"role": "user", "content": "x"}], "logit_bias": {"99999": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] is None  # (not the prompt's fault)


def test_bad_chat_requests(strict) -> None:  # noqa: ANN001
    for messages, param in (([], "messages"), ([{"role": "tool", "content": "x"}], "messages[0]"),
                            ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0]"),
                            ([{"role": "user"}], "messages[0]")):
        res = httpx.post(strict.http_url + "/v1/chat/completions", json={"model": "tiny", "messages": messages})
        assert res.status_code == 400 and res.json()["error"]["param"] == param
    res = httpx.post(strict.http_url + "/v1/chat/completions", json={"model": "tiny", "tools": [{"type": "function"}],
                                                                      "messages": [{"role": "user", "content": "x"}]})
    assert res.status_code == 400 and "tools" in res.json()["error"]["message"]
    bad_json = httpx.post(strict.http_url + "/v1/chat/completions", content=b"{nope", timeout=10)
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"


def test_a_field_sent_as_null_is_one_not_given(strict) -> None:  # noqa: ANN001
    """The openai client sends `"user": null` where a caller passes user=None (a wrapper's default);
    it was a 400 ("user must be a string"), as were parallel_tool_calls and others. vLLM's optional
    fields take null as not given."""
    client = oai(strict)
    messages = [{"role": "user", "content": "hi"}]
    nulls = dict(top_p=None, stop=None, seed=None, user=None, n=None, logprobs=None,
                 parallel_tool_calls=None, tool_choice=None, response_format=None, metadata=None, store=None)
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0, **nulls)
    want = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content and got.usage.completion_tokens == 3
    text = client.completions.create(model="tiny", prompt="hi", max_tokens=None, echo=None, suffix=None, best_of=None,
                                     user=None, temperature=None)
    assert text.usage.completion_tokens == 4  # (no max_tokens: OpenAI's 16, capped by this broker's limit of 4)
    answer = client.responses.create(model="tiny", input="hi", max_output_tokens=2, instructions=None,
                                     previous_response_id=None, text=None, reasoning=None, truncation=None)
    assert answer.usage.output_tokens == 2
    res = httpx.post(strict.http_url + "/tokenize", json={"model": None, "prompt": "hi", "add_special_tokens": None})
    assert res.status_code == 200 and res.json()["count"] >= 1
    res = httpx.post(strict.http_url + "/v1/completions", json={"model": "tiny", "prompt": None})
    assert res.status_code == 400 and res.json()["error"]["param"] == "prompt"  # (a required one is still required)


def test_paths_and_methods_not_served_get_openai_errors(strict) -> None:  # noqa: ANN001
    """Starlette answered them in plain text, which the openai client showed as a bare "Error code: 404"."""
    with pytest.raises(openai.NotFoundError) as err:
        oai(strict).embeddings.create(model="tiny", input="hi")
    assert err.value.body["code"] == "not_found" and err.value.body["message"].startswith(
        "Invalid URL (POST /v1/embeddings): this server serves /v1/completions, /v1/chat/completions, /v1/responses")
    assert "/v1/models/{model}," in err.value.body["message"]
    res = httpx.post(strict.http_url + "/v1/models")
    assert res.status_code == 405 and res.headers["allow"] == "GET, HEAD"
    assert res.json()["error"] == {"message": "POST /v1/models: this path takes GET, HEAD", "type": "invalid_request_error",
                                   "param": None, "code": "method_not_allowed"}
    assert httpx.get(strict.http_url + "/v1/chat/completions").json()["error"]["code"] == "method_not_allowed"


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
          "stop", "stream", "stream_options", "n", "logprobs", "user", "chat_template_kwargs", "ignore_eos", "stop_token_ids",
          "presence_penalty", "repetition_penalty", "top_logprobs", "priority", "cache_salt", "min_p", "echo",
          "allowed_token_ids", "bad_words", "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens",
          "return_tokens_as_token_ids", "continue_final_message", "add_generation_prompt", "prompt_logprobs",
          "tokens", "add_special_tokens", "return_token_strs", "input", "instructions", "max_output_tokens", "store",
          "previous_response_id", "text", "include", "tools", "tool_choice", "prompt_cache_key", "safety_identifier",
          "verbosity"]
VALUES = JSON | st.sampled_from(["tiny", "hi", 1, 4, 0.5, True, [{"role": "user", "content": "hi"}], [1, 2, 3]])
PATHS = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"])
OPTIONAL = {f: VALUES for f in FIELDS[3:]}
REQUESTS = (st.tuples(PATHS, st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=8) | JSON)
            | st.tuples(st.just("/v1/completions"), st.fixed_dictionaries(  # (near-valid ones: some get answers)
                {"model": st.just("tiny"), "prompt": st.sampled_from(["hi", [5, 6]])}, optional=OPTIONAL))
            | st.tuples(st.just("/v1/chat/completions"), st.fixed_dictionaries(
                {"model": st.just("tiny"), "messages": st.just([{"role": "user", "content": "hi"}])},
                optional=OPTIONAL))
            | st.tuples(st.just("/v1/responses"), st.fixed_dictionaries(
                {"model": st.just("tiny"), "input": st.sampled_from(["hi", [{"role": "user", "content": "hi"}]])},
                optional={f: v for f, v in OPTIONAL.items() if f != "input"})))


def test_fuzzed_bodies_never_break_the_gateway(strict) -> None:  # noqa: ANN001
    http = httpx.Client(base_url=strict.http_url, timeout=30)
    seen: dict[int, int] = {}

    @settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(request=REQUESTS)
    def check(request: tuple[str, object]) -> None:
        path, body = request
        res = http.post(path, content=json.dumps(body))  # (json: integers past 64 bits too)
        seen[res.status_code] = seen.get(res.status_code, 0) + 1
        assert res.status_code in (200, 400, 404, 429), (res.status_code, body, res.text[:300])
        if res.status_code != 200:
            assert res.json()["error"]["message"]
        elif res.headers["content-type"].startswith("text/event-stream") and path == "/v1/responses":
            assert res.text.startswith("event: response.created\n") and json.loads(
                res.text.strip().split("\n")[-1][len("data: "):])["type"] in ("response.completed", "response.incomplete")
        elif res.headers["content-type"].startswith("text/event-stream"):
            assert res.text.endswith("data: [DONE]\n\n")

    check()
    assert sum(seen.values()) >= 2000 and seen.get(200, 0) > 0, seen  # (some bodies were good ones)
    assert http.get("/health").json()["status"] == "ok"  # and it still answers


def test_a_stream_sends_no_event_without_news(served) -> None:  # noqa: ANN001
    """A round whose tokens end within a character's first bytes has no text to show yet: each such
    round sent an event with an empty delta (content ""), and chat streams were full of them. None
    now, unless token ids or logprobs were asked for: those ride on it."""
    held = 0
    for seed in range(3):
        chat = [e.choices[0] for e in oai(served).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=32, seed=seed, stream=True,
            stream_options={"include_usage": True}) if e.choices]
        assert chat[0].delta.role == "assistant"
        assert all(c.delta.content or (c.delta.model_extra or {}).get("reasoning_content") or c.delta.tool_calls
                   or c.finish_reason for c in chat[1:]), chat
        ask = {"model": "tiny", "prompt": "hi", "max_tokens": 32, "seed": seed, "stream": True}
        assert all(e.choices[0].text or e.choices[0].finish_reason for e in oai(served).completions.create(**ask))
        with_ids = [e.choices[0] for e in oai(served).completions.create(**ask, extra_body={"return_token_ids": True})]
        held += sum(1 for c in with_ids if not c.text and c.model_extra.get("token_ids"))  # (ids, no text yet)
        final = oai(served).completions.create(**dict(ask, stream=False), extra_body={"return_token_ids": True})
        assert [t for c in with_ids for t in c.model_extra.get("token_ids") or []] == final.choices[0].model_extra["token_ids"]
    assert held  # (some rounds did end within a character: the case was met)


def test_health_is_503_while_no_worker_can_verify_and_ok_once_one_is_back(tiny_pair) -> None:  # noqa: ANN001
    """A load balancer must stop sending callers to a deployment whose every target worker is gone
    (their requests would only wait): /health answers 503 with the reason, `status` says it and
    `status --ready` exits 1; all recover once the supervisor's restart of the worker registers.
    (/health answered 200 "ok".)"""
    import signal

    from nebula_flow.cli.status_text import status_lines

    with Deployment(deploy_config(tiny_pair, "pooled", 1, 1)) as dep:
        url = dep.start_api("127.0.0.1", 0)
        assert httpx.get(url + "/health").json() == {"status": "ok", "workers": 2}
        dep.kill(next(name for name, _ in dep.procs if name.startswith("target")), signal.SIGTERM)
        deadline = time.monotonic() + 60
        while (answer := httpx.get(url + "/health")).status_code == 200:  # (until the broker has seen it leave)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        why = "no worker takes the verify stage (role target): requests wait until one registers"
        assert (answer.status_code, answer.json()) == (503, {"status": "unavailable", "message": why, "workers": 1})
        with Client(dep.address) as c:
            assert f"  NOT SERVING: {why}" in status_lines(c.status())
        probe = CliRunner().invoke(main, ["status", "--broker", dep.address, "--ready"])  # (a readiness probe's)
        assert (probe.exit_code, probe.output) == (1, f"Error: not ready: {why}\n")
        while (answer := httpx.get(url + "/health")).status_code != 200:
            assert time.monotonic() < deadline + 60, dep.log_tail("broker")
            dep.supervise()  # (starts it again after its backoff)
            time.sleep(0.1)
        assert answer.json() == {"status": "ok", "workers": 2}
        probe = CliRunner().invoke(main, ["status", "--broker", dep.address, "--ready"])
        assert (probe.exit_code, probe.output) == (0, "")
        with Client(dep.address) as c:
            assert not any("NOT SERVING" in line for line in status_lines(c.status()))
            assert c.generate(token_ids=[3, 4], max_new_tokens=4, ignore_eos=True).finish_reason == "length"


def test_api_key_models_metrics_and_health(served) -> None:  # noqa: ANN001
    url = served.http_url
    assert httpx.get(url + "/health").status_code == 200  # open: for load balancers
    denied = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    models = oai(served).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert oai(served).models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        oai(served).models.retrieve("other")
    oai(served).completions.create(model="tiny", prompt="def metrics():", max_tokens=6, temperature=0)

    def scrape() -> dict[str, float]:
        text = httpx.get(url + "/metrics", headers={"Authorization": "Bearer sesame"}).text
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"}

    # (the broker's families come from a status the gateway reuses for up to STATUS_TTL_S: one
    # taken before this test's request, run alone, still shows no round)
    deadline = time.monotonic() + 5.0
    while (samples := scrape()).get("nebula_rounds_total", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "queue_time_seconds", "tokens_per_round"):
        assert samples[f"nebula_api_{name}_count"] > 0, name
    assert samples['nebula_api_requests_total{endpoint="completions",status="200"}'] >= 1
    assert samples["nebula_rounds_total"] > 0  # and the broker's own families


def test_browsers_of_the_allowed_origins_only_may_call_it(served, strict) -> None:  # noqa: ANN001
    """CORS (--allowed-origins): a web page of an allowed origin gets its preflight answered without
    the key (browsers send none) and may read the answers, errors included; another origin's
    preflight is refused, and a gateway allowing none answers no page (it had no CORS at all, so a
    browser UI could not call it)."""
    asked = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    url = served.http_url + "/v1/chat/completions"
    ok = httpx.options(url, headers={"Origin": "https://ui.example", **asked})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ui.example"
    assert "POST" in ok.headers["access-control-allow-methods"] and "authorization" in ok.headers["access-control-allow-headers"]
    other = httpx.options(url, headers={"Origin": "https://evil.example", **asked})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answered = httpx.post(url, json=body, headers={"Origin": "https://ui.example", "Authorization": "Bearer sesame"}, timeout=60)
    assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == "https://ui.example"
    keyless = httpx.post(url, json=body, headers={"Origin": "https://ui.example"}, timeout=60)
    assert keyless.status_code == 401 and keyless.headers["access-control-allow-origin"] == "https://ui.example"
    assert "access-control-allow-origin" not in httpx.post(url, json=body, timeout=60, headers={
        "Origin": "https://evil.example", "Authorization": "Bearer sesame"}).headers
    closed = httpx.options(strict.http_url + "/v1/chat/completions", headers={"Origin": "https://ui.example", **asked})
    assert closed.status_code == 405 and "access-control-allow-origin" not in closed.headers
    models = httpx.get(strict.http_url + "/v1/models", headers={"Origin": "https://ui.example"})
    assert models.status_code == 200 and "access-control-allow-origin" not in models.headers


def test_a_spread_histogram_counts_as_many_single_observations_do() -> None:
    """The inter-token histogram takes a chunk's gap for all its tokens in one call: the buckets and
    count it exposes are those of prometheus_client's histogram given each token alone."""
    import random

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from nebula_flow.api.telemetry import TOKEN_GAP_BUCKETS, SpreadHistogram

    one, spread = CollectorRegistry(), CollectorRegistry()
    single = Histogram("gap_seconds", "x", buckets=TOKEN_GAP_BUCKETS, registry=one)
    many = SpreadHistogram("gap_seconds", "x", TOKEN_GAP_BUCKETS, spread)
    rng = random.Random(3)
    for _ in range(300):  # (values on the bounds too: a bucket holds values up to its bound)
        value, n = rng.choice([*TOKEN_GAP_BUCKETS, 0.0, 7.5, rng.random()]), rng.randint(1, 6)
        for _ in range(n):
            single.observe(value)
        many.observe(value, n)

    def lines(registry: CollectorRegistry) -> dict[str, float]:
        return {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in generate_latest(registry).decode().splitlines()
                if ln.startswith("gap_seconds_") and "created" not in ln}

    want, got = lines(one), lines(spread)
    assert want.keys() == got.keys() and got["gap_seconds_count"] > 300
    assert all(got[k] == pytest.approx(v) for k, v in want.items())


def test_off_loopback_needs_an_api_key() -> None:
    res = CliRunner().invoke(main, ["api", "--http-host", "0.0.0.0", "--port", "0"], env={"NEBULA_FLOW_API_KEY": ""})
    assert res.exit_code == 2 and "--api-key" in res.output


def test_replay_and_bench_through_the_api(served, tiny_pair, tmp_path) -> None:  # noqa: ANN001
    trace = tmp_path / "t.jsonl"
    trace.write_text(SAMPLE_TRACE)
    assert oai(served).models.retrieve("tiny").root == str(tiny_pair / "target")  # (vLLM's: replay's tokenizer)
    res = CliRunner().invoke(main, ["replay", str(trace), "--api", served.http_url, "--api-key", "sesame",
                                    "--out", str(tmp_path / "out"), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output.strip().splitlines()[-1])
    assert summary["completed"] == 3 and summary["tokens"] == 15 and summary["tokens_per_round"] >= 1
    records = [json.loads(line) for line in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()]
    assert records[2]["prompt_tokens"] == 1024 - 4  # clipped to the context /v1/models gives
    config = tiny_config_file(tiny_pair, tmp_path, "colocated")
    res = CliRunner().invoke(main, ["bench", "--config", str(config), "--modes", "colocated", "--via", "zmq,api",
                                    "--requests", "2", "--max-new-tokens", "6", "--repeats", "1", "--json"])
    assert res.exit_code == 0, res.output
    modes = json.loads(res.output.strip().splitlines()[-1])["modes"]
    assert set(modes) == {"colocated via zmq", "colocated via api"}
    assert all(r["tokens"] == 12 and r["rounds"] > 0 for m in modes.values() for r in m["repeats"])


def test_the_http_client_answers_like_the_zmq_client(served, strict) -> None:  # noqa: ANN001
    """``HttpClient`` (bench's and replay's front door) gives the ZeroMQ client's output and its
    errors: a bad request or a refused key is a RequestError with the API's message, a gateway
    not there a NebulaError that says so."""
    from nebula_flow.api.http_client import HttpClient
    from nebula_flow.client import NebulaError, RequestError
    from nebula_flow.deploy import free_port

    with Client(served.address) as c:
        want = c.generate("def add(a, b):", max_new_tokens=10)

    async def run() -> None:
        async with HttpClient(served.http_url, api_key="sesame", timeout_s=60) as http:
            got = await http.generate("def add(a, b):", max_new_tokens=10)
            assert got.token_ids == want.token_ids and got.text == want.text and got.finish_reason == "length"
            assert got.chunk_tokens and sum(got.chunk_tokens) == 10 and got.ttft_s <= got.latency_s
        async with HttpClient(strict.http_url, timeout_s=60) as http:
            with pytest.raises(RequestError, match="max_tokens"):
                await http.generate("x", max_new_tokens=5)  # (over strict's limit of 4)
        async with HttpClient(served.http_url, api_key="wrong", timeout_s=60) as http:
            with pytest.raises(RequestError, match="a valid API key is required"):
                await http.generate("x", max_new_tokens=2)
        async with HttpClient(f"http://127.0.0.1:{free_port()}", timeout_s=5) as http:
            with pytest.raises(NebulaError, match="does not answer /v1/models"):
                await http.generate("x", max_new_tokens=2)
        # the broker's own (ZeroMQ) address given where the gateway's is: said as such, not as
        # aiohttp's "Bad status line" and the greeting's raw bytes
        async with HttpClient(served.address.replace("tcp://", "http://"), timeout_s=5) as http:
            with pytest.raises(NebulaError, match="it answers in ZeroMQ, not HTTP: that is a broker's address"):
                await http.generate("x", max_new_tokens=2)

    asyncio.run(run())


def test_a_target_with_several_eos_ids_stops_at_any_of_them(served, tiny_pair, tmp_path) -> None:  # noqa: ANN001
    import shutil

    with Client(served.address) as c:
        free = c.generate("def fibonacci(n):", max_new_tokens=12, ignore_eos=True)
    target = tmp_path / "target"
    shutil.copytree(tiny_pair / "target", target)
    gen = json.loads((target / "generation_config.json").read_text())
    stop_id = free.token_ids[4]
    gen["eos_token_id"] = [gen["eos_token_id"], stop_id]
    cut = free.token_ids[:next(i for i, t in enumerate(free.token_ids) if t in gen["eos_token_id"]) + 1]
    (target / "generation_config.json").write_text(json.dumps(gen))
    cfg = deploy_config(tiny_pair, "colocated", 0, 1)
    cfg.target.model = str(target)
    with Deployment(cfg) as dep:
        dep.start_api("127.0.0.1", 0, model_name="tiny")
        out = httpx.post(dep.http_url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "def fibonacci(n):", "max_tokens": 12, "temperature": 0,
            "return_token_ids": True}).json()
    assert out["choices"][0]["token_ids"] == cut and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == len(cut)
