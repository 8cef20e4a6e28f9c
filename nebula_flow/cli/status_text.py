"""`nebula-flow status`'s text: what an operator reads first, from the broker's state (pure)."""

from __future__ import annotations

from typing import Any

from nebula_flow.roles import unserved_in


def status_lines(state: dict[str, Any]) -> list[str]:
    """The lines `nebula-flow status` prints for a broker's (or a sharded deployment's merged) state."""
    out: list[str] = []
    waiting = state.get("waiting_for_prefix", 0)  # (new requests waiting for one computing their prompt's start)
    out.append(f"mode {state['mode']}, up {state['uptime_s']:.0f} s, {state['pool']} requests in the pool"
               + (f" ({waiting} waiting for a shared prompt start)" if waiting else "") + f", topics {state['topics']}"
               + (", draining: stopping, refuses new requests while those in flight finish" if state.get("draining")
                  else ""))
    if why := unserved_in(state):  # (its /health says 503)
        out.append(f"  NOT SERVING: {why}")
    if address := state.get("worker_address"):  # (how an operator adds a worker to this deployment)
        out.append(f"  workers join at {address} (nebula-flow worker --broker {address} --role ROLE --model MODEL)")
    if "queued_by_priority" in state:  # (priority scheduling: queued tasks by priority, most urgent first)
        queued = sorted(state["queued_by_priority"].items(), key=lambda kv: int(kv[0]))
        out.append("  queued by priority: " + (", ".join(f"{p}: {n}" for p, n in queued) or "none"))
    for sh in state.get("by_shard", []):  # (a sharded deployment: its brokers one by one)
        out.append(f"  shard {sh['shard']}: pid {sh['pid']}, {sh['pool']} in the pool, {sh['workers']} workers, "
                   f"{sh['rounds']} rounds" + (f", restarts {sh['restarts']}" if sh["restarts"] else ""))
    wheres = [_where(w) for w in state["workers"]]
    width = max(map(len, wheres), default=0)  # (one column, whether or not a worker shows its numerics)
    for w, where in zip(state["workers"], wheres):
        drafter = f" drafter {w['drafter']}" if w.get("drafter") and len(state.get("drafters", {})) > 1 else ""
        restarted = f" restarts {w['restarts']}" if w.get("restarts") else ""
        if w["role"] == "any":  # an elastic worker: how its batches split between the stages
            kinds = (("round", "round"), ("draft", "draft"), ("target", "verify"), ("ahead", "pre-draft"))
            restarted += " (batches: " + ", ".join(f"{w['batches'].get(stage, 0)} {name}" for stage, name in kinds
                                                   if stage != "ahead" or w["batches"].get(stage)) + ")"
        failed = (w.get("kv") or {}).get("pull_failures", 0)  # (KV it could not pull: recomputed, never silent)
        kv = f" KV pull failures {failed} (recomputed; see its log)" if failed else ""
        if skipped := (w.get("kv") or {}).get("pulls_skipped", 0):  # (a link measured slower than recomputing)
            kv += f" KV pulls skipped {skipped} (recomputed: quicker than the link)"
        if hits := (w.get("kv") or {}).get("prefix_hits", 0):  # (prefixes of other requests' KV it reused)
            kv += f" prefix cache {hits} hits, {w['kv']['prefix_reused']} positions reused"
        if pulls := (w.get("kv") or {}).get("prefix_pulls", 0):  # (prompt starts pulled from other requests' KV on peers)
            kv += f" prefixes pulled {pulls} ({w['kv']['prefix_pulled']} positions)"
        if saved := (w.get("kv") or {}).get("pull_saved", 0):  # (pulled KV its own prefix cache held: copied here)
            kv += f" {saved} positions not pulled (its prefix cache held them)"
        out.append(f"  worker {w['id']:>3} {w['role']:<9} slot {w['slot']:<3} {w['name']:<16} on {where:<{width}} "
                   f"tasks {w['tasks']:<8} busy {w['busy_s']:.1f} s{drafter}{restarted}{kv}")
        links = (w.get("kv") or {}).get("links") or {}  # (its network pulls' holders, as it measured them lately)
        if links:
            out.append("      KV links: " + ", ".join(
                f"{addr} " + (f"{fit['mbit_s']:g} Mbit/s" if fit["mbit_s"] else "rate not shown yet") + f" {fit['latency_ms']:g} ms"
                for addr, fit in sorted(links.items())))
    if len(state.get("drafters", {})) > 1:  # several drafters: how routing shares the rounds out
        for name, d in state["drafters"].items():
            rates = ", ".join(f"{kind} {rate:.2f}" for kind, rate in d.get("acceptance", {}).items())
            out.append(f"  drafter {name:<16} workers {d['workers']:<3} rounds {d['rounds']:<7} "
                       f"drafts accepted {d['accepted']}/{d['proposed']}" + (f"; recent acceptance {rates}" if rates else ""))
    if "draft" in state["roles"] or "colocated" in state["roles"]:
        draft, row, fixed = state["spec_costs"]
        blocks = " ".join("-" if v is None else f"{v:.2f}" for v in state["verify_costs"]) or "not measured yet"
        out.append(f"speculation costs in target decode steps: draft step {draft:.3f}, verify row {row:.3f}, "
                   f"round {fixed:.2f}; verify blocks by rows: {blocks}")
    rounds = state.get("round_times", {}).get("rounds", {})
    if rounds.get("rounds"):  # where a decode round's time goes (docs/operations.md)
        per = {p: v / rounds["rounds"] * 1000 for p, v in rounds["seconds"].items()}
        parts = ", ".join(f"{p} {v:.2f}" for p, v in sorted(per.items(), key=lambda kv: -kv[1])
                          if p != "total" and v >= 0.005)
        out.append(f"decode rounds: {rounds['rounds']}, {per['total']:.2f} ms each: {parts}")
    out += _draft_ahead_lines(state) + _fusion_lines(state)
    if any(state.get("restarts", {}).values()):
        out.append(f"restarts after a death: broker {state['restarts']['broker']}, "
                   f"workers registered now {state['restarts']['workers']}")
    out.append(f"counters {state['counters']}")
    if state["errors"]:
        out.append(f"errors {state['errors']}")
    return out


def _where(worker: dict[str, Any]) -> str:
    """Where a worker computes: its device, and a verifier's numerics (the broker refuses others beside it)."""
    where = (worker.get("model") or {}).get("device", "?")  # (registered: shown before it first computes)
    if numerics := (worker.get("model") or {}).get("numerics"):
        where += f" ({numerics.rsplit(' on ', 1)[0]})"
    return where


def _draft_ahead_lines(state: dict[str, Any]) -> list[str]:
    """Draft-ahead at work, where it is on (``nebula_flow/ahead.py``): how many rounds a pre-draft
    spared their draft, and what it cost in outcomes drafted for nothing."""
    a = state.get("draft_ahead") or {}
    if not (a.get("tasks") or a.get("skipped")):
        return []
    share = a["hits"] / max(state["counters"].get("rounds", 0), 1)
    return [f"draft-ahead: {a['hits']} rounds took a pre-drafted draft ({share:.0%} of rounds; {a['late_hits']} "
            f"after their verify came back), {a['tasks']} pre-drafts of {a['branches']} outcomes, {a['wasted']} "
            f"outcomes unused, {a['cancelled']} pre-drafts cancelled, {a['skipped']} not made (the pool too loaded)"
            + (f"; hits by outcome, most likely first: {a['hits_by_outcome']}" if a.get("hits_by_outcome") else "")]


def _fusion_lines(state: dict[str, Any]) -> list[str]:
    """Fused model drafters at work, where they are on (``nebula_flow/fusion.py``)."""
    f = state.get("fusion") or {}
    if not f.get("tasks"):
        return []
    won = ", ".join(f"{name} {n}" for name, n in sorted((f.get("won_by") or {}).items())) or "none yet"
    return [f"fused drafters: {f['rounds']} rounds fused, {f['tokens_won']} tokens won beyond the first draft, "
            f"{f['tasks']} second drafts ({f['requeued']} re-queued, {f['dropped']} dropped); rounds won by: {won}"]
