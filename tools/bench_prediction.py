"""Predicted Outputs where the expected answer is not in the prompt: a regenerated answer, a
template, a retried request whose earlier answer the client kept.

A deployment of the config (the bundled one by default) answers the chat prompts once, greedy;
then, single stream and in turns, it answers them again without a prediction and with the first
answers as predictions, exact or with one token in every N replaced (``--change-every``: an
answer that changed a little). Every output must equal the first answer (greedy: the prediction
never changes it); printed: tokens/s (medians over ``--repeats``), rounds, tokens a round, the
share of the prediction the output holds, and the ratio against no prediction in the same run.
Edits whose code is in the prompt are ``nebula-flow bench --edit --predict``'s (prompt lookup
already copies it there).

    PYTHONPATH=. .venv/bin/python tools/bench_prediction.py [--config configs/default.toml]
        [--requests 8] [--max-new-tokens 128] [--repeats 3] [--change-every 0,20,8]
"""

from __future__ import annotations

import argparse
import statistics
import time

from nebula_flow.bench import DEFAULT_CHAT_PROMPTS
from nebula_flow.cli.common import load_deploy, prepare_models
from nebula_flow.client import Client
from nebula_flow.deploy import Deployment


def changed(tokens: list[int], every: int) -> list[int]:
    """``tokens`` with one in every ``every`` replaced by another id (0: unchanged)."""
    return [t + 1 if every and i % every == every // 2 else t for i, t in enumerate(tokens)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--change-every", default="0,20,8")
    args = ap.parse_args()
    levels = [int(x) for x in args.change_every.split(",")]
    prompts = [DEFAULT_CHAT_PROMPTS[i % len(DEFAULT_CHAT_PROMPTS)] for i in range(args.requests)]
    cfg = load_deploy(args.config)
    prepare_models(cfg)
    cfg.broker.client_port = cfg.broker.worker_port = 0
    with Deployment(cfg) as dep, Client(dep.address, timeout_s=600) as client:
        def ask(prompt: str, prediction: list[int] | None = None):  # noqa: ANN202
            return client.generate(prompt, chat=True, max_new_tokens=args.max_new_tokens, temperature=0,
                                   **({"prediction": prediction} if prediction is not None else {}))

        answers = [ask(p).token_ids for p in prompts]
        sides = ["none", *(f"every {n}" if n else "exact" for n in levels)]
        runs: dict[str, list[tuple[float, int, int, float]]] = {s: [] for s in sides}
        for r in range(args.repeats):
            for side, every in (list(zip(sides, [None, *levels])))[:: -1 if r % 2 else 1]:  # (turns)
                t0, rounds, tokens, held, given = time.perf_counter(), 0, 0, 0, 0
                for prompt, answer in zip(prompts, answers):
                    out = ask(prompt, None if every is None else changed(answer, every))
                    if out.token_ids != answer:
                        raise SystemExit(f"a prediction changed the output of {prompt!r}")
                    rounds, tokens = rounds + out.rounds, tokens + len(out.token_ids)
                    held += out.stats.get("prediction_accepted", 0)
                    given += out.stats.get("prediction_tokens", 0)
                wall = time.perf_counter() - t0
                runs[side].append((tokens / wall, rounds, tokens, held / given if given else 0.0))
                print(f"  repeat {r + 1}/{args.repeats}, prediction {side}: {tokens / wall:.1f} tokens/s, "
                      f"{tokens / rounds:.2f} tokens/round", flush=True)
    base = statistics.median(x[0] for x in runs["none"])
    print(f"{'prediction':<12}{'tokens/s':>10}{'rounds':>8}{'tok/round':>11}{'held':>7}{'vs none':>9}")
    for side, done in runs.items():
        rate = statistics.median(x[0] for x in done)
        rounds, tokens = done[0][1], done[0][2]
        print(f"{side:<12}{rate:>10.1f}{rounds:>8}{tokens / rounds:>11.2f}{done[0][3]:>7.0%}{rate / base:>8.2f}x")


if __name__ == "__main__":
    main()
