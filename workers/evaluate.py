"""Tokens per round of a draft/target pair, measured with the real runner code
(``nebula-flow eval-draft``, and the evaluation at the end of ``train-draft``)."""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from nebula_flow.models.llama import CausalLM
from nebula_flow.models.loader import load_model
from nebula_flow.params import SamplingParams
from nebula_flow.protocol import AHEAD_GUESSES
from nebula_flow.tokenizer import TextCodec, eos_token_ids
from nebula_flow_workers.runner import ModelRunner, Task


def log(msg: str) -> None:
    """Progress, on stderr: the commands print their JSON report on stdout."""
    print(f"[train-draft {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


EVAL_PROMPTS = [
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n",
    "import json\n\ndef load_settings(path):\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "def is_palindrome(s: str) -> bool:\n",
    "# Count the words in a file\nfrom collections import Counter\n\n",
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n",
    "async def fetch_all(urls):\n",
    "def parse_args():\n    parser = argparse.ArgumentParser(",
    "class Matrix:\n    def __mul__(self, other):\n",
    "def flatten(nested):\n    result = []\n",
    "with open('data.csv') as f:\n    reader = csv.reader(f)\n",
    "def retry(times=3):\n    def decorator(func):\n",
]

# The same tasks asked the way an instruct model is used: as a user message in its chat format.
EVAL_CHAT_PROMPTS = [
    "Write a Python function that merges two sorted lists.",
    "Write a Python function that loads settings from a JSON file.",
    "Implement an LRU cache class in Python.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python script that counts the words in a file.",
    "Write a binary search function in Python.",
    "Write an async Python function that fetches a list of URLs.",
    "Write a Python function that parses command-line arguments with argparse.",
    "Write a Python Matrix class with matrix multiplication.",
    "Write a Python function that flattens a nested list.",
    "Write Python code that reads a CSV file and prints each row.",
    "Write a Python retry decorator.",
]


def eval_prompts(codec: TextCodec, chat: bool) -> list[list[int]]:
    """Token ids of the evaluation prompts: raw code, or code requests in the chat format."""
    return [codec.encode(p, chat=True) for p in EVAL_CHAT_PROMPTS] if chat else [codec.encode(p) for p in EVAL_PROMPTS]


def evaluate_pair(target: str, draft: str, max_new_tokens: int = 48, ks: tuple[int, ...] = (2, 4, 6),
                  target_dtype: str | None = None, alternatives: int = 0, chat: bool = False,
                  fuse_ngram: int = 0, temperature: float = 0.0, seeds: int = 1, guesses: bool = False) -> dict:
    """Mean committed tokens per round (greedy, or sampled) at each k on ``EVAL_PROMPTS`` (``chat``: on
    ``EVAL_CHAT_PROMPTS`` in the target's chat format), using the
    real runner code; also checks the output equals the target's own greedy output (the target
    runs in ``target_dtype``, batch-invariant in reduced precision, as a deployment runs it).
    ``alternatives``: runner-ups to the first draft token verified beside the chain (token tree);
    ``fuse_ngram``: a prompt-lookup chain of up to that many tokens verified beside it too.
    ``temperature`` > 0: sampled requests, ``seeds`` of each prompt (rejection sampling keeps the
    target's distribution, not its tokens, so there is no output to compare; ``lossless`` is None).
    ``guesses`` (greedy): also how often the draft's choices catch the target's tokens (``guess_rates``)."""
    codec = TextCodec(target)
    t_run, d_run = ModelRunner(load_model(target, dtype=target_dtype)), ModelRunner(load_model(draft))
    sampled = temperature > 0
    if seeds < 1 or temperature < 0:
        raise ValueError("seeds must be >= 1 and temperature >= 0")
    prompts = eval_prompts(codec, chat) * (seeds if sampled else 1)  # (request i draws from its own seed, i)
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, temperature=temperature)
    stop = set(eos_token_ids(target, codec)) if chat else set()  # a chat answer ends at its end of turn
    result = {}
    reference = None
    for k in (*(() if sampled else (0,)), *ks):  # k = 0 is the target alone: the reference every k must reproduce
        outs, rounds = [], 0
        for rid, prompt in enumerate(prompts):
            toks = list(prompt)
            while len(toks) - len(prompt) < max_new_tokens:
                left = max_new_tokens - (len(toks) - len(prompt))
                kk = min(k, left - 1)
                task = Task(rid, "draft", rounds, 1, np.asarray(toks), kk, params, rid, alts=alternatives,
                            fuse=min(fuse_ngram, left - 1) if kk > 0 else 0)
                if kk > 0:
                    proposal = d_run.draft([task])[0]
                    task.draft, task.runner_ups, task.chains = proposal.tokens, proposal.runner_ups, proposal.chains
                    task.q_idx, task.q_prob = proposal.q_idx, proposal.q_prob
                new = t_run.verify([task])[0]
                rounds += 1
                ends = [i for i, t in enumerate(new) if t in stop]
                toks += new[:ends[0] + 1] if ends else new
                if ends:
                    break
            outs.append(toks[len(prompt):][:max_new_tokens])
            for r in (t_run, d_run):
                r.store.free([rid])
        if k == 0:
            reference = outs
            if guesses:
                result["guesses"] = guess_rates(d_run.model, prompts, outs)
            continue
        same = None if sampled else outs == reference
        result[f"k={k}"] = {"tokens_per_round": sum(map(len, outs)) / rounds, "lossless": same}
        log(f"eval k={k} on {'chat prompts' if chat else 'code prompts'}: "
            f"{result[f'k={k}']['tokens_per_round']:.2f} committed tokens per round, " +
             (f"sampled at temperature {temperature} ({seeds} seeds of each prompt)" if sampled else
              f"output {'equals' if same else 'DIFFERS FROM'} the target's greedy output"))
    return result


@torch.inference_mode()
def guess_rates(draft: CausalLM, prompts: list[list[int]], answers: list[list[int]]) -> dict[str, float]:
    """Over the positions of the target's greedy ``answers``: how often the draft's first choice is
    the target's token (greedy acceptance), its second where the first missed (what draft-ahead's
    pre-drafts bet on: ``nebula_flow/ahead.py``; the emulated profiles' ``runner_up``), its third
    where both missed and its fourth where three did (the further guesses a pre-draft may cover)."""
    counts = [0] * (AHEAD_GUESSES + 1)  # the target's token ranked first, second, ... or lower by the draft
    for prompt, answer in zip(prompts, answers):
        if not answer:
            continue
        cache = draft.new_cache(capacity=len(prompt) + len(answer) + 1)
        rows = draft([cache], [[*prompt, *answer[:-1]]], [len(answer)])[0]
        top = draft.token_ids(torch.topk(rows.float(), AHEAD_GUESSES, dim=-1).indices).tolist()
        for want, choices in zip(answer, top):
            counts[choices.index(want) if want in choices else AHEAD_GUESSES] += 1
    out: dict[str, float] = {"positions": sum(counts), "first": counts[0] / max(sum(counts), 1)}
    left = sum(counts[1:])
    for rank, key in enumerate(("second_where_first_missed", "third_where_two_missed", "fourth_where_three_missed"), 1):
        out[key] = counts[rank] / max(left, 1)
        left -= counts[rank]
    return out
