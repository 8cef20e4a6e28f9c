"""End to end, real processes on loopback: a broker, workers, 16 concurrent requests.

* Greedy output is token-for-token HF transformers' own greedy output, in every mode.
* Seeded sampled output (temperature 0.8) is identical across modes and pool sizes.
* Log-probabilities, where asked for, are the target's own (HF transformers' log-softmax), in every mode.
* Penalized and structured (grammar-bound) greedy output is HF transformers' under the same
  penalties and llguidance's masks, in every mode.
"""

from __future__ import annotations

import asyncio
import json

import llguidance
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from nebula_flow.client import AsyncClient, Client
from nebula_flow.deploy import Deployment
from tests.conftest import _hf_model, deploy_config, hf_greedy

pytestmark = pytest.mark.slow

TEXT_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, item):",
                "for i in range(10):", "The quick brown fox", "# parse the arguments\n", "return {",
                "while True:\n    line = f.readline()"]
TOKEN_PROMPTS = [[5 + i, 40 + 3 * i, 7, 300 + i] for i in range(4)] + [[i + 1] for i in range(4)]
MAX_NEW = [24, 31, 40, 17, 28, 35, 22, 38]


LOGPROBS = {0: 2, 3: 0, 9: 5}  # greedy requests that ask for log-probabilities: how many top tokens
SAMPLED_LOGPROBS = {1: 3}
PROMPT_LOGPROBS = {2: 2, 9: 0}  # greedy requests that ask for their prompt's (a text and a token-id prompt)
SAMPLED_PROMPT_LOGPROBS = {1: 4}


def greedy_requests() -> list[dict]:
    reqs = [{"prompt": p, "max_new_tokens": MAX_NEW[i]} for i, p in enumerate(TEXT_PROMPTS)]
    reqs += [{"token_ids": p, "max_new_tokens": MAX_NEW[i]} for i, p in enumerate(TOKEN_PROMPTS)]
    for i, top in LOGPROBS.items():
        reqs[i]["logprobs"] = top
    for i, top in PROMPT_LOGPROBS.items():
        reqs[i]["prompt_logprobs"] = top
    return reqs


def penalized_requests() -> list[dict]:
    """Greedy with HF's repetition penalty, greedy with OpenAI's presence and frequency penalties,
    sampled with all three (seeded), greedy with min_tokens past where it would end, and greedy
    and sampled with a logit bias."""
    prompt = [5, 6, 7, 8, 5, 6]
    return [{"token_ids": prompt, "max_new_tokens": 40, "ignore_eos": True, "repetition_penalty": 1.3},
            {"token_ids": prompt, "max_new_tokens": 40, "ignore_eos": True, "presence_penalty": 0.5,
             "frequency_penalty": 0.4},
            {"token_ids": prompt, "max_new_tokens": 40, "ignore_eos": True, "presence_penalty": 0.5,
             "frequency_penalty": 0.2, "repetition_penalty": 1.2, "temperature": 0.9, "seed": 4},
            {"token_ids": [16, 17, 7], "max_new_tokens": 30, "min_tokens": 12},  # (its greedy output ends at 6)
            {"token_ids": prompt, "max_new_tokens": 40, "ignore_eos": True, "logit_bias": BIAS},
            {"token_ids": prompt, "max_new_tokens": 40, "ignore_eos": True, "logit_bias": BIAS, "temperature": 0.9,
             "seed": 5, "repetition_penalty": 1.1},
            {"token_ids": prompt, "max_new_tokens": 30, "allowed_token_ids": ALLOWED},
            {"token_ids": prompt, "max_new_tokens": 30, "allowed_token_ids": ALLOWED, "temperature": 0.9, "seed": 6},
            {"token_ids": prompt, "max_new_tokens": 30, "bad_words": BAD_WORDS},
            {"token_ids": prompt, "max_new_tokens": 30, "bad_words": BAD_WORDS, "temperature": 0.9, "seed": 7},
            {"token_ids": prompt, "max_new_tokens": 40, "ignore_eos": True, "stop": ["Mde"]},
            {"token_ids": prompt, "max_new_tokens": 40, "ignore_eos": True, "stop": ["e"], "temperature": 0.9, "seed": 8}]


ALLOWED = list(range(40, 90))  # (allowed_token_ids: the plain greedy output of the prompt below leaves them)
BAD_WORDS = ["Mdef", "ith"]  # (bad_words: the plain greedy output of the prompt below writes both, as [45, 446] and [445])


def bad_word_ids(tiny_pair, words: list[str]) -> list[list[int]]:  # noqa: ANN001
    """vLLM's spellings of bad words, made here with HF's tokenizer: each word as written (leading
    spaces dropped), and after a space where that spells it in as many tokens with another first."""
    tok = AutoTokenizer.from_pretrained(str(tiny_pair / "target"))
    out = []
    for word in words:
        bare = tok(word.lstrip(), add_special_tokens=False)["input_ids"]
        spaced = tok(" " + word.lstrip(), add_special_tokens=False)["input_ids"]
        out += [bare] + ([spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [])
    return out


BIAS = {42: 2.5, 45: -100, 300: 1.5}  # (logit_bias: 45 is in the plain greedy output of the prompt below)


BOUNDED = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                          "ok": {"type": "boolean"}}, "required": ["n", "ok"], "additionalProperties": False}


def structured_requests() -> list[dict]:
    """Greedy with a JSON schema, a regular expression and choices (with min_tokens past the
    choices' end: the complete grammar wins), and seeded sampling of any JSON object."""
    return [{"token_ids": [5, 6, 7, 8], "max_new_tokens": 40, "structured": {"json": BOUNDED}},
            {"token_ids": [9, 10], "max_new_tokens": 30, "structured": {"regex": "[0-9]{3}-[a-z]{2,6}"}},
            {"token_ids": [16, 17, 7], "max_new_tokens": 30, "min_tokens": 12,
             "structured": {"choice": ["red", "green", "blue sky"]}},
            {"token_ids": [9, 10, 11], "max_new_tokens": 30, "temperature": 0.9, "seed": 3,
             "structured": {"json_object": True}}]


def sampled_requests() -> list[dict]:
    return [{"prompt": p, "max_new_tokens": 30, "temperature": 0.8, "seed": 1000 + i,
             **({"min_p": 0.05} if i % 3 == 1 else {}),  # (vLLM's min-p on some: drafts and verifies cut alike)
             **({"logprobs": SAMPLED_LOGPROBS[i]} if i in SAMPLED_LOGPROBS else {}),
             **({"prompt_logprobs": SAMPLED_PROMPT_LOGPROBS[i]} if i in SAMPLED_PROMPT_LOGPROBS else {})}
            for i, p in enumerate(TEXT_PROMPTS)]


async def _run_all(address: str, reqs: list[dict], at_once: int | None = None) -> list:
    """``reqs`` all at once, or ``at_once`` at a time."""
    gate = asyncio.Semaphore(at_once or len(reqs))
    async with AsyncClient(address, timeout_s=120) as client:
        async def one(r: dict):  # noqa: ANN202
            async with gate:
                return await client.generate(**r)

        return await asyncio.gather(*(one(r) for r in reqs))


@pytest.fixture(scope="module")
def runs(tiny_pair):  # noqa: ANN001, ANN201
    """Run the greedy and sampled sets once per (mode, M, N); cached for the tests below."""
    cache: dict[tuple, tuple[list, list]] = {}
    batches: dict[tuple, list[dict]] = {}  # each worker's batches by stage
    penalized: dict[tuple, list] = {}  # penalized_requests()' outputs
    bound: dict[tuple, list] = {}  # structured_requests()' outputs
    ahead: dict[tuple, dict] = {}  # draft-ahead's counters

    def get(mode: str, m: int, n: int, fixed_drafts: bool = False, split: bool = False, draft_ahead: int = 0
            ) -> tuple[list, list]:
        """Elastic mode: ``fixed_drafts``: the draft pool kept to drafting (mixed workers); ``split``:
        every round's stages split (draft batches, then verify batches; ``elastic_split``).
        ``draft_ahead``: the policy knob (pre-drafts of the next round while one verifies), with
        requests sent two at a time (pre-drafts are made only while the pool is light)."""
        key = (mode, m, n, fixed_drafts, split, draft_ahead)
        if key not in cache:
            cfg = deploy_config(tiny_pair, mode, m, n, max_batch=4)
            cfg.draft.elastic = not fixed_drafts
            cfg.broker.policy = cfg.broker.policy.replace(elastic_split=1 if split else 0, draft_ahead=draft_ahead)
            with Deployment(cfg) as dep:
                outs = asyncio.run(_run_all(dep.address, greedy_requests() + sampled_requests() + penalized_requests()
                                            + structured_requests(), 2 if draft_ahead else None))
                start = len(greedy_requests()) + len(sampled_requests())
                end = start + len(penalized_requests())
                penalized[key], bound[key] = outs[start:end], outs[end:]
                with Client(dep.address) as client:
                    state = client.status()
                    batches[key] = [{"role": w["role"], **w["batches"]} for w in state["workers"]]
                    ahead[key] = state["draft_ahead"]
            cache[key] = (outs[:16], outs[16:24])
        return cache[key]

    get.batches, get.ahead, get.penalized, get.structured = batches, ahead, penalized, bound
    return get


@pytest.fixture(scope="module")
def reference(tiny_pair) -> list[list[int]]:  # noqa: ANN001
    tok = AutoTokenizer.from_pretrained(str(tiny_pair / "target"))
    refs = []
    for r in greedy_requests():
        ids = r.get("token_ids") or tok(r["prompt"])["input_ids"]
        refs.append(hf_greedy(tiny_pair / "target", ids, r["max_new_tokens"]))
    return refs


@pytest.mark.parametrize("mode", ["pooled", "paired", "colocated", "autoregressive", "elastic"])
def test_greedy_output_equals_hf_transformers(runs, reference, mode: str) -> None:  # noqa: ANN001
    greedy, _ = runs(mode, 2, 2)
    for i, (out, ref) in enumerate(zip(greedy, reference)):
        assert out.token_ids == ref, f"request {i} differs in {mode} mode"
    assert sum(o.rounds for o in greedy) > 0
    if mode == "elastic":  # workers of role any, running whole rounds (a CPU's draft gains nothing from merging)
        assert [w["role"] for w in runs.batches[("elastic", 2, 2, False, False, 0)]] == ["any"] * 4
        assert sum(w.get("round", 0) for w in runs.batches[("elastic", 2, 2, False, False, 0)]) > 0
    if mode == "autoregressive":  # one token a round, or a few where nothing waited (test_decode_steps.py)
        assert all(o.rounds <= len(o.token_ids) for o in greedy)
    else:  # speculation commits more than one token per round on average
        assert sum(len(o.token_ids) for o in greedy) / sum(o.rounds for o in greedy) > 1.3


def test_seeded_sampling_is_identical_across_modes_and_pool_sizes(runs, reference) -> None:  # noqa: ANN001
    base = [o.token_ids for o in runs("pooled", 2, 2)[1]]
    assert len({tuple(t) for t in base}) > 1  # really sampled, distinct prompts
    for key in [("pooled", 1, 1), ("pooled", 3, 1), ("paired", 2, 2), ("colocated", 2, 2), ("elastic", 2, 2),
                ("elastic", 2, 2, False, True), ("elastic", 1, 1, True)]:
        assert [o.token_ids for o in runs(*key)[1]] == base, f"seeded output changed in {key}"
    # elastic with every round split: draft batches and verify batches, on every worker, greedy still HF's
    split = runs.batches[("elastic", 2, 2, False, True, 0)]
    assert all(w.get("draft", 0) and w.get("target", 0) for w in split)  # (rounds: only draft-less last ones)
    assert [o.token_ids for o in runs("elastic", 2, 2, False, True)[0]] == reference
    # elastic beside a draft-only worker: the mixed deployment ran both kinds of worker
    assert sorted(w["role"] for w in runs.batches[("elastic", 1, 1, True, False, 0)]) == ["any", "draft"]
    assert [o.token_ids for o in runs("elastic", 1, 1, True)[0]] == reference
    greedy = [o.token_ids for o in runs("pooled", 2, 2)[0][:8]]
    assert base != [g[:30] for g in greedy]  # temperature 0.8 is not greedy


def target_logprobs(tiny_pair, request: dict, output: list[int], of_prompt: bool = False) -> torch.Tensor:  # noqa: ANN001
    """The target's own log-softmax at each output position (HF transformers, the whole sequence at
    once); ``of_prompt``: at each prompt position after the first."""
    tok = AutoTokenizer.from_pretrained(str(tiny_pair / "target"))
    prompt = request.get("token_ids") or tok(request["prompt"])["input_ids"]
    with torch.no_grad():
        logits = _hf_model(str(tiny_pair / "target"))(torch.tensor([prompt + output])).logits[0].float()
    if of_prompt:
        return torch.log_softmax(logits, -1)[:len(prompt) - 1]
    return torch.log_softmax(logits, -1)[len(prompt) - 1:len(prompt) - 1 + len(output)]


def prompt_of(tiny_pair, request: dict) -> list[int]:  # noqa: ANN001
    tok = AutoTokenizer.from_pretrained(str(tiny_pair / "target"))
    return request.get("token_ids") or tok(request["prompt"])["input_ids"]


@pytest.mark.parametrize("mode", ["pooled", "paired", "colocated", "autoregressive", "elastic"])
def test_logprobs_are_the_targets_own_in_every_mode(tiny_pair, runs, mode: str) -> None:  # noqa: ANN001
    """Each output token's log-probability (and the top tokens beside it) is the target's own raw
    distribution at that position, whether a draft proposed the token or the target did; greedy
    and seeded sampled requests; requests that did not ask get none."""
    greedy, sampled = runs(mode, 2, 2)
    asked = [(greedy_requests()[i], greedy[i], top) for i, top in LOGPROBS.items()]
    asked += [(sampled_requests()[i], sampled[i], top) for i, top in SAMPLED_LOGPROBS.items()]
    for request, out, top in asked:
        ref = target_logprobs(tiny_pair, request, out.token_ids)
        assert [e[0] for e in out.logprobs] == out.token_ids
        mine = torch.tensor([e[2] for e in out.logprobs])
        assert torch.allclose(mine, ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0], atol=1e-4), mode
        for e, row in zip(out.logprobs, ref):
            assert len(e[3]) == top and [t[2] for t in e[3]] == sorted((t[2] for t in e[3]), reverse=True)
            if top:
                best = torch.topk(row, top)
                assert torch.allclose(torch.tensor([t[2] for t in e[3]]), best.values, atol=1e-4)
                assert e[3][0][2] >= e[2] - 1e-6  # (the most likely token is at least as likely)
        if not request.get("temperature"):  # greedy: the token is the most likely one
            assert all(e[3][0][0] == e[0] for e in out.logprobs if e[3])
    others = [o for i, o in enumerate(greedy) if i not in LOGPROBS]
    assert all(o.logprobs is None for o in others)


@pytest.mark.parametrize("mode", ["pooled", "paired", "colocated", "autoregressive", "elastic"])
def test_prompt_logprobs_are_the_targets_own_in_every_mode(tiny_pair, runs, mode: str) -> None:  # noqa: ANN001
    """Each prompt token's log-probability after the first (and the top tokens beside it) is the
    target's own at that position (``prompt_logprobs``, vLLM's), the first one's null; greedy and
    seeded sampled requests, their output unchanged by asking; requests that did not ask get none."""
    greedy, sampled = runs(mode, 2, 2)
    asked = [(greedy_requests()[i], greedy[i], top) for i, top in PROMPT_LOGPROBS.items()]
    asked += [(sampled_requests()[i], sampled[i], top) for i, top in SAMPLED_PROMPT_LOGPROBS.items()]
    for request, out, top in asked:
        prompt, ref = prompt_of(tiny_pair, request), target_logprobs(tiny_pair, request, [], of_prompt=True)
        entries = out.prompt_logprobs
        assert [e[0] for e in entries] == prompt and entries[0][2] is None and entries[0][3] == [] and entries[0][4] is None
        mine = torch.tensor([e[2] for e in entries[1:]])
        assert torch.allclose(mine, ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], atol=1e-4), mode
        for e, row in zip(entries[1:], ref):
            assert len(e[3]) == top
            v = row[e[0]]  # (its rank: the logits above its own, plus one; within the numerics' 1e-4)
            assert int((row > v + 1e-4).sum()) + 1 <= e[4] <= int((row > v - 1e-4).sum()) + 1, mode
            if top:
                assert torch.allclose(torch.tensor([t[2] for t in e[3]]), torch.topk(row, top).values, atol=1e-4)
                assert [t[0] for t in e[3]] == torch.topk(row, top).indices.tolist()
    others = [o for i, o in enumerate(greedy) if i not in PROMPT_LOGPROBS]
    assert all(o.prompt_logprobs is None for o in others)


def penalized_greedy(tiny_pair, request: dict) -> list[int]:  # noqa: ANN001
    """The reference for a penalized greedy request: HF transformers decoding one token at a time,
    the penalties applied to each step's logits as ``nebula_flow/penalties.py`` defines them (for
    the repetition penalty alone, HF's own ``generate(repetition_penalty=...)`` agrees)."""
    model, prompt = _hf_model(str(tiny_pair / "target")), request["token_ids"]
    eos = model.config.eos_token_id
    out: list[int] = []
    with torch.no_grad():
        while len(out) < request["max_new_tokens"] and (request.get("ignore_eos") or eos not in out):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
            for t, b in request.get("logit_bias", {}).items():
                logits[t] += b
            for word in bad_word_ids(tiny_pair, request.get("bad_words", [])):
                if len(word) == 1 or len(out) >= len(word) - 1 and out[len(out) - len(word) + 1:] == word[:-1]:
                    logits[word[-1]] = float("-inf")
            if "allowed_token_ids" in request:
                barred = torch.ones_like(logits, dtype=torch.bool)
                barred[request["allowed_token_ids"]] = False
                logits[barred] = float("-inf")
            if len(out) < request.get("min_tokens", 0):
                logits[eos] = float("-inf")
            seen = torch.tensor(sorted(set(prompt + out)))
            r = request.get("repetition_penalty", 1.0)
            logits[seen] = torch.where(logits[seen] > 0, logits[seen] / r, logits[seen] * r)
            for t in set(out):
                logits[t] -= out.count(t) * request.get("frequency_penalty", 0.0) + request.get("presence_penalty", 0.0)
            out.append(int(torch.argmax(logits)))
    return out


@pytest.mark.parametrize("mode", ["pooled", "paired", "colocated", "autoregressive", "elastic"])
def test_penalized_output_is_the_targets_own_penalized_output(tiny_pair, runs, mode: str) -> None:  # noqa: ANN001
    """Presence, frequency and repetition penalties, min_tokens, logit_bias, allowed_token_ids and bad_words: greedy
    output is the target's own penalized
    greedy output (each row of a verify penalized for the tokens on its own path), in every mode;
    seeded penalized sampling is the same in every speculative mode."""
    runs(mode, 2, 2)
    rep, freq, sampled, least, biased, biased_sampled, only, only_sampled, clean, clean_sampled, stopped, \
        stopped_sampled = runs.penalized[(mode, 2, 2, False, False, 0)]
    requests = penalized_requests()
    model, prompt = _hf_model(str(tiny_pair / "target")), requests[0]["token_ids"]
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, repetition_penalty=1.3,
                        attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    assert rep.token_ids == hf == penalized_greedy(tiny_pair, requests[0])
    assert freq.token_ids == penalized_greedy(tiny_pair, requests[1])
    plain = hf_greedy(tiny_pair / "target", prompt, 40)
    assert rep.token_ids != plain and freq.token_ids != plain  # (the penalties changed the output)
    assert least.token_ids == penalized_greedy(tiny_pair, requests[3]) and len(least.token_ids) >= 12
    assert len(hf_greedy(tiny_pair / "target", requests[3]["token_ids"], 30)) < 12  # (without it: EOS sooner)
    assert biased.token_ids == penalized_greedy(tiny_pair, requests[4]) != plain and 45 in plain
    assert 45 not in biased.token_ids and 45 not in biased_sampled.token_ids  # (-100: all but banned)
    assert only.token_ids == penalized_greedy(tiny_pair, requests[6]) and not set(plain) <= set(ALLOWED)
    assert set(only.token_ids) | set(only_sampled.token_ids) <= set(ALLOWED) and len(only_sampled.token_ids) == 30
    assert clean.token_ids == penalized_greedy(tiny_pair, requests[8]) != plain[:30] and 445 in plain and 446 in plain
    for out in (clean.token_ids, clean_sampled.token_ids):  # (neither word written: [445] alone, 446 after 45)
        assert 445 not in out and all(out[i:i + 2] != [45, 446] for i in range(len(out)))
    if mode != "autoregressive":  # (its sampled draws are its own: placement independence is across speculative modes)
        assert sampled.token_ids == runs.penalized[("pooled", 2, 2, False, False, 0)][2].token_ids
        assert biased_sampled.token_ids == runs.penalized[("pooled", 2, 2, False, False, 0)][5].token_ids
        assert only_sampled.token_ids == runs.penalized[("pooled", 2, 2, False, False, 0)][7].token_ids
        assert clean_sampled.token_ids == runs.penalized[("pooled", 2, 2, False, False, 0)][9].token_ids
        assert stopped_sampled.token_ids == runs.penalized[("pooled", 2, 2, False, False, 0)][11].token_ids
    # a stop string: the output ends with the token that completes it, as decoding one token at a time
    # ends it, however many more the round that completed it committed ("Mde": inside the token "def")
    tok = AutoTokenizer.from_pretrained(str(tiny_pair / "target"))
    plain40 = hf_greedy(tiny_pair / "target", prompt, 40)
    n = next(i for i in range(1, 41) if "Mde" in tok.decode(plain40[:i]))
    assert stopped.token_ids == plain40[:n] and stopped.finish_reason == "stop" and n < 40
    assert stopped.text == tok.decode(plain40[:n]).split("Mde")[0] and len(stopped.tokens_per_round) == stopped.rounds
    assert sum(stopped.tokens_per_round) == n
    assert stopped_sampled.finish_reason == "stop" and "e" in tok.decode(stopped_sampled.token_ids)
    assert "e" not in tok.decode(stopped_sampled.token_ids[:-1])


def structured_greedy(tiny_pair, request: dict) -> list[int]:  # noqa: ANN001
    """The reference for a structured greedy request: HF transformers one token at a time, each
    step's logits masked to what llguidance's own matcher allows after the output so far (EOS
    suppressed while short of min_tokens, unless the grammar allows nothing else)."""
    model, prompt = _hf_model(str(tiny_pair / "target")), request["token_ids"]
    eos = model.config.eos_token_id
    tokenizer = llguidance.LLTokenizer((tiny_pair / "target" / "tokenizer.json").read_text(), n_vocab=512, eos_token=eos)
    spec = request["structured"]
    kind, value = next(iter(spec.items()))
    grammar = {"json": lambda: llguidance.LLMatcher.grammar_from_json_schema(value, defaults={"whitespace_flexible": False}),
               "regex": lambda: llguidance.LLMatcher.grammar_from_regex(value),
               "choice": lambda: llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, value)))}[kind]()
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    out: list[int] = []
    with torch.no_grad():
        while len(out) < request["max_new_tokens"] and eos not in out:
            logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")[:512]
            allowed = torch.from_numpy(bits.astype(bool))
            if len(out) < request.get("min_tokens", 0) and allowed.sum() > allowed[eos]:
                allowed[eos] = False
            logits[~allowed] = float("-inf")
            out.append(int(torch.argmax(logits)))
            assert matcher.consume_token(out[-1])
    return out


@pytest.mark.parametrize("mode", ["pooled", "paired", "colocated", "autoregressive", "elastic"])
def test_structured_output_is_the_targets_own_output_under_the_grammar(tiny_pair, runs, mode: str) -> None:  # noqa: ANN001
    """JSON schema, regex and choice: greedy output is the target's own greedy output under
    llguidance's masks, in every mode; the drafts follow the grammar too (speculation still
    commits several tokens a round); seeded sampled JSON is the same in every speculative mode
    and parses."""
    runs(mode, 2, 2)
    outs = runs.structured[(mode, 2, 2, False, False, 0)]
    requests = structured_requests()
    for request, out in zip(requests[:3], outs[:3]):
        assert out.token_ids == structured_greedy(tiny_pair, request), (mode, request["structured"])
        assert out.finish_reason == "stop"  # (each grammar completes: EOS)
    shape = json.loads(outs[0].text)
    assert set(shape) == {"n", "ok"} and 0 <= shape["n"] <= 999
    assert outs[2].text in ("red", "green", "blue sky")
    if mode != "autoregressive":
        assert sum(len(o.token_ids) for o in outs[:3]) > sum(o.rounds for o in outs[:3])
        assert outs[3].token_ids == runs.structured[("pooled", 2, 2, False, False, 0)][3].token_ids
    if outs[3].finish_reason == "stop":
        assert isinstance(json.loads(outs[3].text), dict)


@pytest.mark.parametrize("mode", ["pooled", "paired"])
def test_draft_ahead_keeps_greedy_and_seeded_output(runs, reference, mode: str) -> None:  # noqa: ANN001
    """Pre-drafting the next round while one verifies (draft-ahead) changes no token: greedy is HF's,
    seeded sampling (structured outputs too) the same as without it. (Hits on this CPU pair are few: its verify is as quick
    as the pre-draft; ``test_emulated`` runs draft-ahead where most rounds hit.)"""
    greedy, sampled = runs(mode, 2, 2, draft_ahead=16)
    assert [o.token_ids for o in greedy] == reference
    assert [o.token_ids for o in sampled] == [o.token_ids for o in runs("pooled", 2, 2)[1]]
    bound = runs.structured[(mode, 2, 2, False, False, 16)]  # (grammar-bound drafts, pre-drafted too)
    assert [o.token_ids for o in bound] == [o.token_ids for o in runs.structured[("pooled", 2, 2, False, False, 0)]]
    counters = runs.ahead[(mode, 2, 2, False, False, 16)]
    assert counters["tasks"] > 0 and counters["branches"] > 0
    assert counters["hits"] + counters["wasted"] + counters["cancelled"] > 0


def test_bf16_target_speculative_output_equals_its_own_greedy_output(tiny_pair) -> None:  # noqa: ANN001
    """In bf16 the target's rounding depends on call shapes unless it runs batch-invariant (the
    default for bf16 on CPU): pooled speculation must still reproduce the bf16 target alone."""
    outs = {}
    for mode, m, n in (("autoregressive", 0, 1), ("pooled", 2, 2)):
        cfg = deploy_config(tiny_pair, mode, m, n, max_batch=4)
        cfg.target.dtype = "bfloat16"
        with Deployment(cfg) as dep:
            outs[mode] = asyncio.run(_run_all(dep.address, greedy_requests()))
            with Client(dep.address) as client:
                workers = client.status()["workers"]
        # (the target workers that computed: one that got no task has reported no numerics)
        assert {w["device"].get("target_numerics") for w in workers if w["role"] == "target" and w["device"]} \
            == {"bfloat16 batch-invariant"}
    for i, (spec, alone) in enumerate(zip(outs["pooled"], outs["autoregressive"])):
        assert spec.token_ids == alone.token_ids, f"request {i} differs"
    assert sum(len(o.token_ids) for o in outs["pooled"]) / sum(o.rounds for o in outs["pooled"]) > 1.3


def test_adaptive_k_changes_k_per_round_and_stays_lossless(tiny_pair, reference) -> None:  # noqa: ANN001
    """Greedy output is HF's whatever k each round takes; with draft-ahead too (adaptive k then plans
    with the draft steps pre-drafts hide, which seeded sampled requests ignore: their output is the
    same with it and without)."""
    sampled = {}
    for draft_ahead in (0, 16):
        cfg = deploy_config(tiny_pair, "pooled", 2, 2, k=6, max_batch=4)
        cfg.broker.policy = cfg.broker.policy.replace(adaptive_k=True, draft_ahead=draft_ahead)
        with Deployment(cfg) as dep:
            outs = asyncio.run(_run_all(dep.address, greedy_requests() + sampled_requests(), 2 if draft_ahead else None))
            with Client(dep.address) as client:
                made = client.status()["draft_ahead"]["tasks"]
        outs, sampled[draft_ahead] = outs[:16], [o.token_ids for o in outs[16:]]
        for i, (out, ref) in enumerate(zip(outs, reference)):
            assert out.token_ids == ref, f"request {i} differs with adaptive k (draft_ahead {draft_ahead})"
        ks = [k for o in outs for k in o.stats["k_per_round"]]
        assert len(set(ks)) > 2 and max(ks) <= 6, ks  # k really moved, within the limit
        assert (made > 0) == (draft_ahead > 0)
    assert sampled[16] == sampled[0]


@pytest.mark.parametrize("mode", ["pooled", "colocated"])
def test_token_tree_alternatives_stay_lossless_and_win_rounds(tiny_pair, reference, mode: str) -> None:  # noqa: ANN001
    """With runner-ups to the first draft token verified beside the chain, greedy output is still
    HF's greedy output, and some rounds are won by a runner-up. Sampled requests verify theirs
    too (their seeded placement independence: ``test_token_trees``)."""
    cfg = deploy_config(tiny_pair, mode, 2, 2, max_batch=4)
    cfg.broker.policy = cfg.broker.policy.replace(first_alternatives=3)
    long = {"token_ids": [9, 8, 7], "max_new_tokens": 90}  # outgrows a cache's first buffer
    greedy = [{**r, "logprobs": 1} for r in greedy_requests()]  # (a runner-up's row: on the tree's accepted path)
    with Deployment(cfg) as dep:
        outs = asyncio.run(_run_all(dep.address, greedy + sampled_requests()[:2] + [long]))
        with Client(dep.address) as client:
            counters = client.status()["counters"]
    outs, longest = outs[:-1], outs[-1]
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert out.token_ids == ref, f"request {i} differs with alternatives in {mode} mode"
        own = target_logprobs(tiny_pair, greedy[i], ref).gather(1, torch.tensor(ref)[:, None])[:, 0]
        assert torch.allclose(torch.tensor([e[2] for e in out.logprobs]), own, atol=1e-4), f"request {i}'s logprobs"
    assert longest.token_ids == hf_greedy(tiny_pair / "target", long["token_ids"], long["max_new_tokens"])
    counters["alternatives_proposed"] -= 3 * sum(k > 0 for k in longest.stats["k_per_round"])
    counters["alternatives_accepted"] -= longest.stats["alternatives_accepted"]
    rounds = sum(o.rounds for o in outs)
    assert counters["alternatives_proposed"] == 3 * sum(k > 0 for o in outs for k in o.stats["k_per_round"])
    assert 0 < counters["alternatives_accepted"] < rounds
    assert sum(o.stats["alternatives_accepted"] for o in outs) == counters["alternatives_accepted"]
    assert all(any(k > 0 for k in o.stats["k_per_round"]) for o in outs[16:])  # (so they proposed runner-ups)


def think_first_greedy(pair, request: dict) -> list[int]:  # noqa: ANN001
    """The reference for a think-first structured greedy request: HF transformers one token at a
    time (logit_bias added), unbound until the thinking ends (``</think>`` in the output, or already
    in the prompt after its last ``<think>``), then masked to what llguidance's own matcher allows."""
    model, prompt = _hf_model(str(pair / "target")), request["token_ids"]
    eos, (start, end) = model.config.eos_token_id, THINK_IDS
    tokenizer = llguidance.LLTokenizer((pair / "target" / "tokenizer.json").read_text(), n_vocab=512, eos_token=eos)
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_regex(request["structured"]["regex"]))
    last_start = max((i for i, t in enumerate(prompt) if t == start), default=-1)
    bound = not request.get("think_first") or end in prompt[last_start + 1:]
    out: list[int] = []
    with torch.no_grad():
        while len(out) < request["max_new_tokens"] and eos not in out:
            logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
            for token, bias in request.get("logit_bias", {}).items():
                logits[token] += bias
            if bound:
                bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")[:512]
                logits[~torch.from_numpy(bits.astype(bool))] = float("-inf")
            out.append(int(torch.argmax(logits)))
            if bound:
                assert matcher.consume_token(out[-1])
            bound = bound or out[-1] == end
    return out


THINK_IDS = (1, 2)  # <think>, </think> in the tiny pair built with ``thinking`` (nebula_flow/tiny.py)


def test_a_think_first_grammar_binds_only_what_follows_the_thinking(tmp_path) -> None:  # noqa: ANN001
    """A reasoning model's structured output (``think_first``): greedy output is the target's own,
    free until ``</think>`` and under the grammar after it, whether the output or the prompt ends
    the thinking, pooled and colocated; without ``think_first`` the grammar binds from the first
    token; seeded sampling is the same in both."""
    from nebula_flow.tiny import build_tiny_pair

    pair = build_tiny_pair(tmp_path, thinking=True)
    start, end = THINK_IDS
    regex = {"regex": "[0-9]{3}"}
    requests = [  # (a small bias on </think> makes this random model end its thinking after a token)
        {"token_ids": [5, 6, 7, start], "max_new_tokens": 30, "structured": regex, "think_first": True,
         "logit_bias": {end: 2.0}},
        {"token_ids": [5, 6, start, end], "max_new_tokens": 30, "structured": regex, "think_first": True},
        {"token_ids": [5, 6, 7, start], "max_new_tokens": 30, "structured": regex, "logit_bias": {end: 2.0}}]
    sampled = {"token_ids": [9, 10, start], "max_new_tokens": 30, "structured": regex, "think_first": True,
               "logit_bias": {end: 2.0}, "temperature": 0.9, "seed": 5}
    want = [think_first_greedy(pair, request) for request in requests]
    seeded = []
    for mode in ("pooled", "colocated"):
        with Deployment(deploy_config(pair, mode, 1, 1, max_batch=4)) as dep:
            outs = asyncio.run(_run_all(dep.address, [*requests, sampled]))
        assert [o.token_ids for o in outs[:3]] == want, mode
        seeded.append(outs[3].token_ids)
    assert seeded[0] == seeded[1]  # (seeded: the same in either mode)
    thought, closed, plain = want
    # (the cases reach both phases: thinking, then </think>, then three digits and EOS; bound at once)
    assert end in thought and thought.index(end) >= 1 and len(thought) == thought.index(end) + 1 + 4
    assert len(closed) == len(plain) == 4 and end not in closed + plain
