"""How often a draft's guesses catch the target's token, on a real pair: per position of the
target's own greedy output, whether the draft's first choice is the target's token (its greedy
acceptance) and, where it is not, whether its second or third choice is. Draft-ahead's
pre-drafts (``nebula_flow/ahead.py``) bet on the second choice; the emulated profiles'
``runner_up`` (``nebula_flow/emulated.py``) is that conditional rate. Prints one JSON line.

    PYTHONPATH=. .venv/bin/python tools/measure_guesses.py [--chat] [--tokens 64]

Defaults: the bundled pair (``make run`` builds its target), the bench's code prompts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from nebula_flow.bench import DEFAULT_CHAT_PROMPTS, DEFAULT_PROMPTS
from nebula_flow.bundled import target_dir
from nebula_flow.models.loader import load_model
from nebula_flow.tokenizer import TextCodec

DRAFT = Path(__file__).resolve().parent.parent / "models" / "smollm2-draft"


@torch.inference_mode()
def greedy(model, prompt: list[int], tokens: int) -> list[int]:  # noqa: ANN001
    cache = model.new_cache(capacity=len(prompt) + tokens + 1)
    row = model([cache], [prompt], [1])[0][-1]
    out = []
    for _ in range(tokens):
        out.append(int(model.token_ids(torch.argmax(row).view(1))[0]))
        row = model([cache], [[out[-1]]], [1])[0][-1]
    return out


@torch.inference_mode()
def ranks(draft, prompt: list[int], answer: list[int]) -> list[int]:  # noqa: ANN001
    """Per answer position, the target's token's rank among the draft's choices (0 = first)."""
    cache = draft.new_cache(capacity=len(prompt) + len(answer) + 1)
    rows = draft([cache], [prompt + answer[:-1]], [len(answer)])[0]
    top = draft.token_ids(torch.topk(rows.float(), 3, dim=-1).indices)
    out = []
    for want, choices in zip(answer, top.tolist()):
        out.append(choices.index(want) if want in choices else 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None, help="target checkpoint (default: the bundled one)")
    parser.add_argument("--draft", default=str(DRAFT), help="draft checkpoint (default: the bundled one)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--chat", action="store_true", help="the bench's chat prompts, in the target's chat format")
    args = parser.parse_args()
    target_path = args.target or str(target_dir())
    target = load_model(target_path, dtype=args.dtype)
    draft = load_model(args.draft, dtype=args.dtype)
    codec = TextCodec(target_path)
    counts = [0, 0, 0, 0]
    for text in DEFAULT_CHAT_PROMPTS if args.chat else DEFAULT_PROMPTS:
        prompt = list(codec.encode(text, chat=args.chat))
        for r in ranks(draft, prompt, greedy(target, prompt, args.tokens)):
            counts[r] += 1
    n, missed = sum(counts), sum(counts[1:])
    print(json.dumps({
        "positions": n, "first": round(counts[0] / n, 3),
        "second_where_first_missed": round(counts[1] / max(missed, 1), 3),
        "third_where_two_missed": round(counts[2] / max(missed - counts[1], 1), 3),
        "none_of_three": round(counts[3] / n, 3)}))


if __name__ == "__main__":
    main()
