"""Emulated devices: a model whose forward pass takes the time a latency profile predicts.

Everything around it is real (processes, ZeroMQ, the scheduler, KV buffers of the model's
real size moved over the real transport); only the arithmetic is replaced by a sleep, so one
small machine can run many workers with GPU-like speed ratios. The tokens come from a
deterministic stand-in: the "target" continues a sequence with a hash of its last tokens; the
"draft" agrees with it at each position with the profile's ``acceptance`` probability. Text
produced this way is not meaningful, and reports say so.

A profile is JSON::

    {"name": "...", "source": "measured on ..." | "hand-written" | "roofline",
     "model": {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "vocab_size": 49152,
               "max_position_embeddings": 8192},
     "latency": {"base_s": 0.02, "per_seq_s": 0.0002, "per_token_s": 0.0006, "per_ctx_token_s": 1e-7},
     "acceptance": 0.7,                     # drafts only
     "runner_up": 0.5,                      # drafts only, default 0.5: where the draft disagrees, the chance
                                            # its second choice is the target's token, and its third where the
                                            # second is not, and so on (draft-ahead's guesses); or a list, rank
                                            # by rank: [0.28, 0.19, 0.09] (its last repeated)
     "salt": 1,                             # drafts only, default 0: drafters of different salts disagree with
                                            # the target at independent positions (fused drafters); same salt: at
                                            # the same positions, as far as their rates allow
     "grid": [{"batch": 1, "tokens": 1, "context": 128, "seconds": 0.021}, ...]}   # optional, measured

A forward over B sequences with T new tokens in all and C context positions in all takes
``base + per_seq * B + per_token * T + per_ctx_token * C`` seconds.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from nebula_flow.kv.cache import KVCache
from nebula_flow.models.batch import TreeRows
from nebula_flow.protocol import AHEAD_GUESSES
from nebula_flow.sim.acceptance import guess_rank, ranked_rates
from nebula_flow.specdec import splitmix64

RUNNER_UP = 0.5  # a profile's default "runner_up": a guess; the bundled CPU pair measures ~0.28 (eval-draft --guesses)
STAND_IN_VOCAB = 256  # the stand-in emits ids below min(this, vocab): cheap, and ids any tokenizer has (the broker
# checks every id against the served tokenizer's vocabulary: the tiny pair's has 512)


class ProfileError(ValueError):
    """A latency profile that cannot be used."""


def load_profile(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"profile not found: {path}")
    prof = json.loads(path.read_text())
    for key in ("num_layers", "num_kv_heads", "head_dim", "vocab_size"):
        if key not in prof.get("model", {}):
            raise ProfileError(f"{path}: model.{key} is missing")
    lat = prof.get("latency", {})
    if not all(isinstance(lat.get(k, 0.0), (int, float)) and lat.get(k, 0.0) >= 0
               for k in ("base_s", "per_seq_s", "per_token_s", "per_ctx_token_s")):
        raise ProfileError(f"{path}: latency coefficients must be numbers >= 0")
    try:
        ranked_rates(prof.get("runner_up", RUNNER_UP), "runner_up")
    except ValueError as exc:
        raise ProfileError(f"{path}: {exc}") from None
    return prof


def predict_seconds(latency: dict[str, float], batch: int, tokens: int, context: int) -> float:
    return (latency.get("base_s", 0.0) + latency.get("per_seq_s", 0.0) * batch
            + latency.get("per_token_s", 0.0) * tokens + latency.get("per_ctx_token_s", 0.0) * context)


class _Cfg:
    def __init__(self, m: dict[str, Any]) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = m["num_layers"], m["num_kv_heads"], m["head_dim"]
        self.vocab_size = m["vocab_size"]
        self.max_position_embeddings = m.get("max_position_embeddings", 4096)


def stand_in_next(prev: int, prev2: int, position: int, vocab: int) -> int:
    """The emulated target's next token: a pure function of the last two tokens and position."""
    return splitmix64((prev * 1_000_003 + prev2) ^ (position << 20)) % min(STAND_IN_VOCAB, vocab)


class EmulatedCache(KVCache):
    """A cache of an emulated device: rows of the model's real size (transfers move real bytes)
    whose contents no emulated forward reads. So growing it takes fresh rows without copying the
    held ones, and a fork copies none: a GPU copies rows on the device, not with the host's CPU,
    and on a 2-core host these copies (with the page faults of fresh rows) were most of an emulated
    worker's CPU (at 192 requests, ~28 MB copied per request of an 8B model's ~150 positions;
    docs/benchmarks.md, "An emulated worker's host CPU")."""

    def reserve(self, total: int) -> None:
        if self.shared_path is not None or total <= self.buf.shape[0]:
            super().reserve(total)  # (a cache in a shared file: its file's pool decides)
            return
        cap = self.buf.shape[0]
        while cap < total:
            cap *= 2
        self.buf = torch.empty((cap, *self.row_shape), dtype=self.buf.dtype, device=self.buf.device)

    def copy_rows(self, source: KVCache, start: int, end: int) -> None:
        """(A fork's rows, e.g. a pre-drafted branch's: a copy on the device, rows no forward reads.)"""


class EmulatedModel:
    """Duck-types ``CausalLM`` for the runner: same ``forward`` contract, sleeps instead."""

    head_token_ids = None

    @staticmethod
    def token_ids(head_rows: torch.Tensor) -> torch.Tensor:
        """``CausalLM.token_ids``: an emulated head covers every token id."""
        return head_rows

    def __init__(self, profile: dict[str, Any], role: str) -> None:
        self.profile, self.role = profile, role
        self.cfg = _Cfg(profile["model"])
        self.latency = profile["latency"]
        self.acceptance = float(profile.get("acceptance", 1.0))
        self.runner_up = ranked_rates(profile.get("runner_up", RUNNER_UP), "runner_up")
        self.salt = int(profile.get("salt", 0)) << 40  # (above any position * 7919 + token id)
        # How faithfully this host emulates the device: forwards that took longer than the profile
        # says (host work or a late wake-up on a busy CPU) add up in ``overrun_s``.
        self.forwards, self.predicted_s, self.overrun_s = 0, 0.0, 0.0

    def make_kv_arena(self, max_bytes: int) -> None:
        """(No arena: an emulated forward never reads its caches, only transfers move them.)"""

    def new_cache(self, capacity: int = 64) -> KVCache:
        c = self.cfg
        # fp16 by default, as the emulated GPU would hold it: transfers move the real byte count.
        dtype = getattr(torch, self.profile.get("kv_dtype", "float16"))
        return EmulatedCache(c.num_layers, c.num_kv_heads, c.head_dim, dtype=dtype, capacity=capacity)

    def _logit_row(self, context: list[int]) -> torch.Tensor:
        pos = len(context)
        vocab = min(STAND_IN_VOCAB, self.cfg.vocab_size)
        nxt = stand_in_next(context[-1], context[-2] if pos > 1 else 0, pos, vocab)
        draft_choice, others = nxt, [(nxt + 1 + i) % vocab for i in range(AHEAD_GUESSES)]
        if self.role == "draft" and (splitmix64(pos * 7919 + context[-1] + self.salt) % 10_000) / 10_000 >= self.acceptance:
            # this position disagrees with the target; its next choices are the target's token or not
            rank = guess_rank((splitmix64(pos * 104_729 + context[-1]) % 10_000) / 10_000, self.runner_up)
            draft_choice, others = others[0], others[1:]
            if rank:
                others.insert(rank - 1, nxt)
        # Rows cover only the stand-in's ids: a full-vocabulary row (150k floats) per position
        # would cost more host time than the emulated GPU's forward takes.
        row = torch.full((vocab,), -10.0)
        if self.role == "draft":
            for i, other in enumerate(others[:AHEAD_GUESSES - 1]):  # (its guesses after its choice, ranked)
                row[other] = -float(i)
            row[draft_choice] = 10.0
            return row
        row[nxt] = 10.0
        return row

    def __call__(
        self, caches: list[KVCache], new_tokens: list[list[int]] | torch.Tensor, logit_rows: list[int],
        parents: list[list[int] | None] | None = None,
    ) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        if isinstance(new_tokens, torch.Tensor):  # (a draft step's picks: this stand-in computes on the host)
            new_tokens = [[t] for t in new_tokens.tolist()]
        tokens = sum(len(t) for t in new_tokens)
        context = sum(c.length for c in caches) + tokens
        out = []
        for cache, seq, want, tree_parents in zip(caches, new_tokens, logit_rows, parents or [None] * len(caches)):
            cache.reserve(cache.length + len(seq))  # real-size KV rows, so transfers move real bytes
            tree = TreeRows.of(tree_parents)
            if tree is None:
                full = cache.tokens + list(seq)
                contexts = [full[: len(full) - want + i + 1] for i in range(want)]
            else:  # a token tree's row: the cached tokens, then its own path
                contexts = [cache.tokens + [seq[r] for r in tree.sees[i]] for i in range(len(seq) - want, len(seq))]
            rows = [self._logit_row(c) for c in contexts]
            out.append(torch.stack(rows) if rows else torch.empty(0, min(STAND_IN_VOCAB, self.cfg.vocab_size)))
            cache.tokens.extend(seq)
        predicted = predict_seconds(self.latency, len(caches), tokens, context)
        remaining = predicted - (time.perf_counter() - t0)
        if remaining > 0:
            time.sleep(remaining)
        self.forwards += 1
        self.predicted_s += predicted
        self.overrun_s += max(0.0, time.perf_counter() - t0 - predicted)
        return out


def measure_profile(model_dir: str, batches: list[int], tokens: list[int], contexts: list[int],
                    threads: int = 1, repeats: int = 3, log=print) -> dict[str, Any]:  # noqa: ANN001
    """Time the real model over a grid and fit the linear latency model (least squares, >= 0)."""
    import numpy as np

    from nebula_flow.models.loader import load_model

    torch.set_num_threads(threads)
    model = load_model(model_dir)
    longest, limit = max(contexts) + max(tokens), model.cfg.max_position_embeddings
    if longest > limit:
        raise ValueError(f"a context of {max(contexts)} and {max(tokens)} new tokens is past the model's "
                         f"{limit} positions")
    grid = []
    for ctx in contexts:
        for b in batches:
            for t in tokens:
                caches = [model.new_cache(ctx + t + 8) for _ in range(b)]
                model(caches, [list(range(1, ctx + 1)) for _ in range(b)], [1] * b)
                times = []
                for _ in range(repeats):
                    for c in caches:
                        c.truncate(ctx)
                    t0 = time.perf_counter()
                    model(caches, [[5] * t for _ in range(b)], [t] * b)
                    times.append(time.perf_counter() - t0)
                sec = sorted(times)[len(times) // 2]
                grid.append({"batch": b, "tokens": t, "context": ctx, "seconds": sec})
                log(f"batch {b:>3} new tokens {t:>2} context {ctx:>5}: {sec * 1000:.1f} ms")
    a = np.array([[1.0, g["batch"], g["batch"] * g["tokens"], g["batch"] * (g["context"] + g["tokens"])] for g in grid])
    y = np.array([g["seconds"] for g in grid])
    coef = np.linalg.lstsq(a, y, rcond=None)[0].clip(min=0)
    cfg = model.cfg
    return {"name": Path(model_dir).name, "source": f"measured with {threads} thread(s) by nebula-flow profile",
            "model": {"num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                      "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings},
            "latency": dict(zip(("base_s", "per_seq_s", "per_token_s", "per_ctx_token_s"), map(float, coef))),
            "grid": grid}
