"""The peers a user would otherwise pick, for ``nebula-flow bench --modes ...,hf,hf-assisted``:
HF transformers' ``generate()`` of the target alone (``hf``), its assisted generation with the
deployment's draft as ``assistant_model`` (``hf-assisted``), and its prompt lookup decoding
(``hf-lookup``: drafts copied from the prompt, what HF offers for edits that repeat their input).

Each runs as a user would run it: one Python process (``python -m nebula_flow.hf_peer SPEC``)
with torch's default threads, the same prompt token ids the broker would make, the same dtype,
and concurrent requests one after another (``generate`` serves one at a time). A draft with a
reduced head (``draft_head_size``: its rows cover ``head_token_ids`` only) is loaded as an
ordinary Llama whose head is expanded to the full vocabulary, the rows it lacks at the lowest
logit, so they never win: the same proposals our draft worker makes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

PEERS = ("hf", "hf-assisted", "hf-lookup")
LOOKUP_TOKENS = 10  # hf-lookup's prompt_lookup_num_tokens: HF's documented example value


def _load_target(path: str, dtype: Any):  # noqa: ANN401, ANN202 - torch types load lazily
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _load_draft(path: str, dtype: Any):  # noqa: ANN401, ANN202
    """The draft as ``LlamaForCausalLM``; a reduced head expanded to the whole vocabulary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from nebula_flow.models.loader import load_state_dict

    raw = json.loads((Path(path) / "config.json").read_text())
    if not raw.pop("draft_head_size", None):
        return _load_target(path, dtype)
    raw.pop("draft_for", None)
    cfg = LlamaConfig(**raw)
    state = load_state_dict(path)
    head_ids = state.pop("head_token_ids")
    model = LlamaForCausalLM(cfg).to(dtype)
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=True, dtype=dtype)
    with torch.no_grad():
        head.weight.zero_()
        head.weight[head_ids] = state.pop("lm_head.weight").to(dtype)
        head.bias.fill_(torch.finfo(dtype).min)  # rows the draft does not have never win
        head.bias[head_ids] = 0
    model.load_state_dict(state, strict=False)
    model.lm_head = head
    return model.eval()


class _FirstToken:
    """A ``generate`` streamer that notes when the first new tokens came (its first ``put`` is
    the prompt)."""

    def __init__(self) -> None:
        self.puts, self.first = 0, None

    def put(self, _value: Any) -> None:  # noqa: ANN401
        self.puts += 1
        if self.puts == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def run(spec: dict[str, Any], log=print) -> dict[str, Any]:  # noqa: ANN001
    """``spec``: target, draft (hf-assisted) or null, lookup (hf-lookup: tokens a draft copies) or null, dtype, prompts (token id lists),
    max_new_tokens, temperature, top_p, ignore_eos, repeats, label. Per repeat: tokens/s, target
    forwards (rounds), TTFT and latency of each request."""
    import torch

    from nebula_flow.models.loader import resolve_dtype

    dtype = resolve_dtype(spec["dtype"], "cpu")
    target = _load_target(spec["target"], dtype)
    draft = _load_draft(spec["draft"], dtype) if spec.get("draft") else None
    forwards = [0]
    target.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    greedy = spec["temperature"] == 0
    kwargs: dict[str, Any] = {"max_new_tokens": spec["max_new_tokens"], "do_sample": not greedy}
    if not greedy:  # the target's own distribution (no top-k cut; top-p as the bench asks)
        kwargs.update(temperature=spec["temperature"], top_k=0, top_p=spec.get("top_p", 1.0))
    if spec["ignore_eos"]:  # fixed-length outputs, as the bench asks of every mode
        kwargs["min_new_tokens"] = spec["max_new_tokens"]
    if draft is not None:
        kwargs["assistant_model"] = draft
    if spec.get("lookup"):
        kwargs["prompt_lookup_num_tokens"] = spec["lookup"]

    def one(ids: list[int], seed: int) -> tuple[int, float, float]:
        torch.manual_seed(seed)
        first = _FirstToken()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  streamer=first, pad_token_id=target.config.eos_token_id, **kwargs)
        took = time.perf_counter() - t0
        return out.shape[1] - len(ids), (first.first or t0 + took) - t0, took

    one(spec["prompts"][0], 0)  # warm-up, as the bench warms each deployment
    runs = []
    for r in range(spec["repeats"]):
        forwards[0] = 0
        t0 = time.perf_counter()
        done = [one(ids, i) for i, ids in enumerate(spec["prompts"])]
        wall = time.perf_counter() - t0
        tokens = sum(n for n, _, _ in done)
        runs.append({"wall_s": wall, "tokens": tokens, "rounds": forwards[0], "tokens_per_s": tokens / wall,
                     "round_rate": forwards[0] / wall, "tokens_per_round": tokens / max(forwards[0], 1),
                     "ttft": [t for _, t, _ in done], "latency": [t for _, _, t in done]})
        log(f"  {spec['label']} repeat {r + 1}/{spec['repeats']}: {tokens / wall:.1f} tokens/s, "
            f"{forwards[0] / wall:.1f} target forwards/s, {tokens / max(forwards[0], 1):.2f} tokens/forward")
    return {"runs": runs, "threads": torch.get_num_threads(), "dtype": str(dtype).removeprefix("torch."),
            "transformers": __import__("transformers").__version__}


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = run(spec, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
