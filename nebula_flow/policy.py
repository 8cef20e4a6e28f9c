"""The scheduling policy's settings: one frozen, self-validating type, and the one place each
knob's default, range and help text are written down.

Everything that exposes a knob takes a ``PolicyConfig``: the ``Scheduler``, the broker's
options, a deployment's ``[policy]`` table, a simulation scenario's ``[policy]`` table, the
policy log, and the command line (``cli.common.policy_options`` derives ``--KNOB`` options from
the fields below; ``--set KNOB=VALUE`` and a bench mode's ``@KNOB=VALUE`` go through
``with_setting``).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from nebula_flow.params import did_you_mean
from nebula_flow.protocol import MAX_AHEAD, MAX_ALTERNATIVES, MAX_DECODE_STEPS
from nebula_flow.speclen import DEFAULT_COSTS

MAX_FUSED = 16  # the longest fused prompt-lookup chain


class PolicyError(ValueError):
    """A policy setting out of range or of the wrong type; the message names the knob."""


def _knob(default: Any, help: str, **limits: Any) -> Any:  # noqa: ANN401, A002
    """A field with its help text and limits (``lo``, ``hi``) kept beside its default."""
    return field(default=default, metadata={"help": help, **limits})


@dataclass(frozen=True)
class PolicyConfig:
    """How the scheduler plans rounds and builds batches (see ``scheduler.Scheduler``)."""

    k: int = _knob(4, "Draft tokens proposed per round (the most, with adaptive_k).", lo=0, hi=64)
    locality: bool = _knob(True, "Prefer giving a worker the tasks whose KV it already holds (never waiting for it); "
                           "off: NebulaSD's affinity-free batch reconstruction.")
    migrate: bool = _knob(False, "Never give a request the worker that ran its previous task of that role while "
                          "another exists: forces KV movement (tests, benchmarks).")
    prefix_affinity: bool = _knob(True, "The broker places a new request where its prompt's start was last held, the "
                                  "prefill a worker's prefix cache would save weighed against the load "
                                  "(nebula_flow/prefixes.py; in the simulator where the workload's prompts share their start).")
    prefix_pulls: bool = _knob(True, "A new request's first task that goes to another worker than the one whose KV "
                               "likely holds its prompt's start names that worker and the request whose KV it was: "
                               "the task's worker pulls that prefix (as KV that follows a request) instead of "
                               "computing it (nebula_flow/prefixes.py; simulated where prompts share their start).")
    prefix_pull_cost: float = _knob(1.0, "With prefix_pulls: what paired, colocated and elastic binding counts a prompt's "
                                    "start held on another worker to cost any other, as a share of computing it. 1: only "
                                    "the worker that holds it saves it, so requests on one document queue there while "
                                    "others may idle; lower (a pull takes ~1/13 of computing over loopback, ~1/25 over "
                                    "PCIe) spreads them, each pulling it: simulated on 4 GPUs 1.19x with one document, "
                                    "live on the emulated 4-GPU host 0.81x (docs/benchmarks.md; nebula_flow/roles.py).",
                                    lo=0.0, hi=1.0)
    wait_for_prefix: float = _knob(0.5, "With prefix_affinity: a new request whose prompt starts like that of a request "
                                   "still computing its prompt (64 tokens or more, and at least this share of what that "
                                   "request computes) waits for that request's first tokens, then starts from its KV, "
                                   "copied or pulled, instead of computing the same tokens at the same time: a burst of "
                                   "questions on a new document, n choices of a long prompt (SGLang's in-batch prefix "
                                   "caching). 0: never waits (nebula_flow/prefixes.py; simulated where prompts share their start).",
                                   lo=0.0, hi=1.0)
    priority_scheduling: bool = _knob(False, "Queued tasks go by their requests' priority (vLLM's request parameter and "
                                      "--scheduling-policy priority: lower first, equal ones by arrival), each round "
                                      "again, and a full pool (max_pending) turns away its least urgent request not "
                                      "started for a more urgent one; off: by arrival, and a priority other than 0 is "
                                      "refused.")
    merge_batches: bool = _knob(True, "Give a busy worker no small batch beside a bigger running one (two half batches "
                                "would alternate for ever); the tasks join the returning ones instead.")
    adaptive_k: bool = _knob(False, "Choose each round's k in 0..k from the request's decayed acceptance, for the most "
                             "expected tokens per cost (nebula_flow/speclen.py).")
    spec_costs: tuple[float, float, float] = _knob(
        DEFAULT_COSTS, "What adaptive_k weighs, in target decode steps: a draft step, a verify row, a round's fixed "
        "cost (with measure_costs, only where it starts; a seeded sampled request always plans with these).")
    measure_costs: bool = _knob(True, "With adaptive_k: weigh draft steps and verify blocks by the forward times the "
                                "workers measure and report.")
    first_alternatives: int = _knob(0, "The draft also proposes this many runner-ups to its first token, verified in "
                                    "the same forward as siblings in a token tree (exact for sampled requests too).",
                                    lo=0, hi=MAX_ALTERNATIVES)
    fuse_ngram: int = _knob(0, "Beside each model draft, also verify the prompt-lookup chain of up to this many "
                            "tokens, fused into one token tree (not in autoregressive mode). 0: off.",
                            lo=0, hi=MAX_FUSED)
    disable_by_batch_size: int = _knob(0, "While more requests than this are in the pool, rounds start without "
                                       "drafts (not a seeded sampled request's). 0: always speculate.", lo=0)
    elastic_split: int = _knob(0, "Elastic mode: split rounds into a draft batch and verify batches once this many drafts "
                               "are queued; 0: once they fill a draft batch larger than a round's and the measured "
                               "draft costs say merging them pays (nebula_flow/elastic.py).", lo=0)
    draft_ahead: int = _knob(0, "Pooled and paired modes: while a round verifies, a draft worker that would otherwise "
                             "idle pre-drafts the next round for this many likely outcomes (the whole draft accepted "
                             "plus its guess of the bonus token first; then a correction after 0, 1, ... k - 1 "
                             "accepted tokens and the whole draft plus a second guess: k + 2 in all; then the same "
                             "with third and fourth guesses: 2k + 3, 3k + 4; fewer while the pool holds more than "
                             "2 requests per draft worker); a verify that commits one sends the next verify at once "
                             "(nebula_flow/ahead.py). 0: off.", lo=0, hi=MAX_AHEAD)
    fuse_drafters: int = _knob(0, "Pooled mode with several model drafters: a round also goes to the next best model "
                               "drafter at once, its draft verified beside the first as a chain of the round's token "
                               "tree (CoSine's fusion; nebula_flow/fusion.py). 1: where the expected tokens per cost "
                               "pay for its verify rows; 2: every round (tests, benchmarks). 0: off.", lo=0, hi=2)
    decode_steps: int = _knob(4, "Autoregressive mode: a round's verify of a request alone in the pool decodes up "
                              "to this many tokens, one forward each (multi-step decoding: the hops and the "
                              "broker's work paid once for them; a request arriving meanwhile waits up to this "
                              "many forwards). A first round, penalized requests and those asking for logprobs "
                              "decode one (nebula_flow/steps.py). 1: one token a round.", lo=1, hi=MAX_DECODE_STEPS)
    max_forward_tokens: int = _knob(0, "The most uncached prompt (committed) tokens one forward pass computes: a "
                                    "longer prompt is prefilled in chunks beside the other requests' decode and "
                                    "verify rows, which are not counted (chunked prefill, nebula_flow/budget.py); a "
                                    "request alone in the pool prefills whole (up to max_burst_tokens). 0: no bound.",
                                    lo=0)
    max_burst_tokens: int = _knob(0, "The most uncached prompt tokens a forward computes where its tasks went out "
                                  "alone: a request alone in the pool, a burst sent while no stream flowed, and "
                                  "every task sent beside a burst's request whose output has not begun. Smallest "
                                  "prompts first, the rest in chunks, so a burst's streams begin one forward after "
                                  "another. At least max_forward_tokens; 0: no bound (such a forward prefills "
                                  "whole; nebula_flow/budget.py).", lo=0)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("bool", bool):
                if not isinstance(value, bool):
                    raise PolicyError(f"{f.name} must be true or false, got {value!r}")
            elif f.type in ("int", int, "float", float):
                if f.type in ("float", float):  # (a share: any finite number, kept as a float)
                    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                        raise PolicyError(f"{f.name} must be a number, got {value!r}")
                    object.__setattr__(self, f.name, value := float(value))
                elif not isinstance(value, int) or isinstance(value, bool):
                    raise PolicyError(f"{f.name} must be a whole number, got {value!r}")
                lo, hi = f.metadata.get("lo"), f.metadata.get("hi")
                if (lo is not None and value < lo) or (hi is not None and value > hi):
                    raise PolicyError(f"{f.name} must be in {lo}..{'' if hi is None else hi}, got {value}")
        costs = self.spec_costs
        if not isinstance(costs, tuple | list) or len(costs) != 3 or not all(
                isinstance(c, int | float) and not isinstance(c, bool) and math.isfinite(c) for c in costs):
            raise PolicyError(f"spec_costs must be three numbers [draft_step, verify_row, round], got {costs!r}")
        if min(costs) < 0 or costs[2] <= 0:
            raise PolicyError(f"spec_costs must be >= 0 with round > 0, got {list(costs)}")
        object.__setattr__(self, "spec_costs", tuple(float(c) for c in costs))

    # -- building one ----------------------------------------------------------------------
    @classmethod
    def from_table(cls, raw: Mapping[str, Any], where: str = "[policy]") -> PolicyConfig:
        """From a TOML table (a deployment's or a scenario's ``[policy]``); unknown keys refused."""
        if not isinstance(raw, Mapping):
            raise PolicyError(f"{where} must be a table of knobs")
        unknown = set(raw) - set(knob_names())
        if unknown:
            raise PolicyError(f"{where}: unknown knobs {sorted(unknown)}{did_you_mean(sorted(unknown), knob_names(), 0.75)} "
                              f"(known: {', '.join(knob_names())})")
        try:
            return cls(**raw)
        except PolicyError as exc:
            raise PolicyError(f"{where}: {exc}") from None

    def replace(self, **changes: Any) -> PolicyConfig:
        """A copy with ``changes`` (validated like any other)."""
        return dataclasses.replace(self, **changes)

    def with_setting(self, setting: str) -> PolicyConfig:
        """A copy with ``KNOB=VALUE`` applied; VALUE is TOML (``true``, ``3``, ``[0.1, 0.03, 1.1]``)."""
        knob, eq, value = setting.partition("=")
        knob = knob.strip().replace("-", "_")
        if knob not in knob_names() or not eq:
            raise PolicyError(f"{setting!r} must be KNOB=VALUE with KNOB one of {', '.join(knob_names())}")
        try:
            parsed = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            raise PolicyError(f"{setting!r}: {value!r} is not a TOML value (true, 3, [0.1, 0.03, 1.1])") from None
        return self.replace(**{knob: parsed})

    def to_table(self) -> dict[str, Any]:
        """Plain data (JSON and TOML safe), the inverse of ``from_table``."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}


def knob_names() -> tuple[str, ...]:
    return tuple(f.name for f in fields(PolicyConfig))


def knob_help(name: str) -> str:
    return next(f.metadata["help"] for f in fields(PolicyConfig) if f.name == name)
