"""The KV benchmark (`nebula-flow bench-kv`): a pooled run whose every round moves KV, with and
without overlapping the pulls with compute, against the bare transport's bandwidth measured
on the same machine (``kv/probe.py``).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from nebula_flow.bench import BenchWorkload, run_once
from nebula_flow.client import Client
from nebula_flow.config import DeployConfig
from nebula_flow.deploy import Deployment
from nebula_flow.kv.store import PULL_SIZE_CLASSES, add_by_size


def raw_transport_gbps(transport: str, nbytes: int, repeats: int = 20, spread: bool = False) -> float:
    """Median bandwidth of back-to-back bare pulls of ``nbytes`` on this machine (kv/probe.py);
    ``spread``: each pull other rows of a buffer larger than the CPU's caches."""
    from nebula_flow.kv.probe import SPREAD_BYTES, RawPair

    pair = RawPair(transport, max(nbytes, SPREAD_BYTES) if spread else nbytes)
    try:
        return pair.gbps(nbytes, repeats, spread)
    finally:
        pair.close()


PROBE_PACE_MS = 20.0  # about one exchange per batch of a worker, as the system pulls
PROBE_START_S = 120.0
IDLE_PROBE_S = 8.0  # paced pulls on the idle machine after the runs: ~400 pulls at the pace
# Up to a long prompt's whole KV (the larger size classes of bench-kv's exchanges)
PROBE_SIZES = "16384,65536,262144,1048576,4194304,16777216"


class PacedProbe:
    """Paced raw pulls in a separate process (kv/probe.py), started early (its imports take
    seconds, spent while a deployment starts beside it) and pulling from ``go`` to ``stop``."""

    def __init__(self, transport: str, out: Path) -> None:
        self.transport = transport
        self.proc = subprocess.Popen([sys.executable, "-m", "nebula_flow.kv.probe", "--transport", transport,
                                      "--pace-ms", str(PROBE_PACE_MS), "--sizes", PROBE_SIZES, "--out", str(out),
                                      "--wait-for-go"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def go(self) -> None:
        """Wait until the probe is ready, then start its pulls."""
        give_up = threading.Timer(PROBE_START_S, self.proc.kill)  # a probe that never says ready must not hang us
        give_up.start()
        try:
            # A library may print to stdout first (UCX prints its warnings there), so read up to
            # the line that says so.
            assert self.proc.stdout is not None and self.proc.stdin is not None
            if not any(line.strip() == "ready" for line in self.proc.stdout):
                raise RuntimeError(f"the raw {self.transport} probe failed to start (exit code {self.proc.wait(timeout=30)})")
        finally:
            give_up.cancel()
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        """Stop pulling; the probe writes what it measured and exits."""
        if self.proc.poll() is None:
            self.proc.stdin.close()  # (one still waiting for its go sees the end of stdin: it measured nothing)
            self.proc.terminate()
        self.proc.wait(timeout=30)


@contextlib.contextmanager
def paced_probe(transport: str, out: Path):  # noqa: ANN201
    """A ``PacedProbe`` started before the block and stopped after it, whatever happens in it."""
    probe = PacedProbe(transport, out)
    try:
        yield probe
    finally:
        probe.stop()


def _kv_totals(address: str) -> dict[str, float]:
    with Client(address) as c:
        workers = c.status()["workers"]
    tot: dict[str, Any] = {"busy_s": sum(w["busy_s"] for w in workers)}
    for key in ("stall_s", "pull_s", "pull_cpu_s", "bytes_pulled", "pulls", "transfers", "pull_failures", "computed",
                "pulled", "files_recycled"):
        tot[key] = sum((w["kv"] or {}).get(key, 0) for w in workers)
    tot["by_size"] = {}
    for w in workers:
        add_by_size(tot["by_size"], (w["kv"] or {}).get("by_size") or {})
    return tot


def bench_kv(cfg: DeployConfig, wl: BenchWorkload, transport: str, log=print, repeats: int = 2,  # noqa: ANN001
             idle_probe_s: float = IDLE_PROBE_S) -> dict[str, Any]:
    """Pooled run with forced migration (every round moves KV), with and without overlap:
    ``repeats`` runs of each, in alternating order, reported as medians."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    with tempfile.TemporaryDirectory(prefix="nebula-flow-bench-kv-") as tmp:
        return _bench_kv(cfg, wl, transport, Path(tmp), log, repeats, idle_probe_s)


def _kv_run(cfg: DeployConfig, wl: BenchWorkload, overlap: bool, probe_out: Path, transport: str) -> dict[str, Any]:
    """One deployment, one workload: the KV counters it moved and its tokens/s."""
    # The raw transport under the same load, as the system uses it: paced pulls in a separate
    # process while this run goes on (in both modes, so that the probe's own load does not favour
    # either in the tokens/s they report); started with the deployment, pulling only during the run.
    # (Every pull made: what is measured is the transport, not whether recomputing would win.)
    changes = {"kv_overlap": overlap, "kv_skip_slow_pulls": False}
    with paced_probe(transport, probe_out) as probe, Deployment(cfg, worker_changes=changes) as dep:
        with Client(dep.address) as c:
            c.generate(wl.prompts[0], max_new_tokens=8)
        before = _kv_totals(dep.address)
        probe.go()
        try:
            res = run_once(dep.address, wl)
        finally:
            probe.stop()
        after = _kv_totals(dep.address)
    d = {k: after[k] - before[k] for k in after if k != "by_size"}
    by_size = add_by_size(dict(after["by_size"]), before["by_size"], sign=-1)
    return {"by_size": {size: c for size, c in by_size.items() if c[0] > 0}, "files_recycled": d["files_recycled"],
            "stall_fraction": d["stall_s"] / max(d["busy_s"], 1e-9), "stall_s": d["stall_s"],
            "compute_s": d["busy_s"], "pull_s": d["pull_s"], "pulls": d["pulls"], "transfers": d["transfers"],
            # the share of pull time the pulling thread was running; the rest it waited (for a
            # core on a busy machine, for the holder, for the wire)
            "pull_on_cpu": d["pull_cpu_s"] / max(d["pull_s"], 1e-9),
            "pull_failures": d["pull_failures"], "bytes_pulled": d["bytes_pulled"],
            "positions_pulled": d["pulled"], "positions_recomputed": d["computed"],
            "system_gbps": d["bytes_pulled"] / max(d["pull_s"], 1e-9) / 1e9,
            # one exchange carries every request a batch needs from one holder
            "mean_pull_bytes": d["bytes_pulled"] / max(d["transfers"], 1), "tokens_per_s": res["tokens_per_s"]}


def _bench_kv(cfg: DeployConfig, wl: BenchWorkload, transport: str, tmp: Path, log, repeats: int,  # noqa: ANN001
              idle_probe_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {"transport": transport, "repeats": repeats}
    cfg.mode, cfg.kv_transport = "pooled", transport
    # speculate at every load: both roles' KV moves
    cfg.broker.policy = cfg.broker.policy.replace(migrate=True, disable_by_batch_size=0)
    cfg.broker.client_port = cfg.broker.worker_port = 0
    runs: dict[str, list[dict[str, Any]]] = {"overlap": [], "no_overlap": []}
    loaded_probes, probe_idle = [], tmp / "idle.json"
    for rep in range(repeats):
        # Alternate which mode runs first (A B B A ...): on this machine a deployment's tokens/s
        # depended on its place in the sequence by up to ~10 %, which a fixed order reads as a
        # difference between the modes.
        for overlap in (True, False) if rep % 2 == 0 else (False, True):
            key = "overlap" if overlap else "no_overlap"
            probe = tmp / f"loaded-{key}-{rep}.json"
            run = _kv_run(cfg, wl, overlap, probe, transport)
            runs[key].append(run)
            if overlap:
                loaded_probes.append(probe)
            log(f"  {key} ({rep + 1}/{repeats}): stall {run['stall_fraction'] * 100:.2f}% of compute, "
                f"{run['pulls']:.0f} pulls in {run['transfers']:.0f} exchanges, "
                f"{run['bytes_pulled'] / 1e6:.1f} MB, {run['tokens_per_s']:.1f} tokens/s")
    for key, rs in runs.items():
        out[key] = {name: statistics.median(r[name] for r in rs) for name in rs[0] if name != "by_size"}
        out[key]["runs"] = rs
    size = int(out["overlap"]["mean_pull_bytes"]) or 1 << 20
    out["raw_gbps_same_size"] = raw_transport_gbps(transport, size)
    out["raw_gbps_4mib"] = raw_transport_gbps(transport, 4 << 20)
    out["bandwidth_ratio"] = out["overlap"]["system_gbps"] / out["raw_gbps_same_size"]
    # The same, each pull's data from memory rather than the cache (as every real pull's is)
    out["raw_spread_gbps_same_size"] = raw_transport_gbps(transport, size, spread=True)
    out["raw_spread_gbps_4mib"] = raw_transport_gbps(transport, 4 << 20, spread=True)
    out["bandwidth_ratio_spread"] = out["overlap"]["system_gbps"] / out["raw_spread_gbps_same_size"]
    # Paced raw pulls: on the idle machine now, and (recorded above) while the system ran.
    with paced_probe(transport, probe_idle) as probe:
        probe.go()
        time.sleep(idle_probe_s)
    from nebula_flow.kv.probe import paced_gbps

    for key, paths in (("idle", [probe_idle]), ("loaded", loaded_probes)):
        samples: dict[int, list[float]] = {}
        for path in paths:
            for k, v in json.loads(path.read_text()).items():
                samples.setdefault(int(k), []).extend(v)
        out[f"raw_paced_{key}_gbps"] = paced_gbps(samples, size)
        out[f"bandwidth_ratio_paced_{key}"] = out["overlap"]["system_gbps"] / out[f"raw_paced_{key}_gbps"]
    out["by_size"] = _by_size_against_raw(runs["overlap"], transport, samples)  # (paced: the loaded samples)
    out["raw_pace_ms"] = PROBE_PACE_MS
    return out


def _by_size_against_raw(runs: list[dict[str, Any]], transport: str, paced: dict[int, list[float]]) -> dict[str, Any]:
    """The in-system bandwidth of each size class of exchanges against raw pulls at that class's
    mean size: back to back with the data from memory, and paced like the system's during the
    run (``paced`` samples). Over all exchanges, the time raw pulls of the same sizes would take
    against the time the system took (the "size-matched" ratio). Medians over ``runs``."""
    from nebula_flow.kv.probe import paced_gbps

    classes: dict[str, dict[str, list[float]]] = {}
    raw: dict[str, float] = {}
    matched: dict[str, list[float]] = {"b2b": [], "paced": []}
    for run in runs:
        raw_s = paced_s = sys_s = 0.0
        for size, (n, nbytes, took) in run["by_size"].items():
            if size not in raw:  # (measured once, at the first run's mean size of the class)
                raw[size] = raw_transport_gbps(transport, int(nbytes / n), spread=True)
            c = classes.setdefault(size, {"exchanges": [], "mean_bytes": [], "system_gbps": [], "paced_gbps": []})
            c["exchanges"].append(n)
            c["mean_bytes"].append(nbytes / n)
            c["system_gbps"].append(nbytes / max(took, 1e-9) / 1e9)
            c["paced_gbps"].append(paced_gbps(paced, nbytes / n))
            raw_s += nbytes / (raw[size] * 1e9)
            paced_s += nbytes / (c["paced_gbps"][-1] * 1e9)
            sys_s += took
        matched["b2b"].append(raw_s / max(sys_s, 1e-9))
        matched["paced"].append(paced_s / max(sys_s, 1e-9))
    out: dict[str, Any] = {"classes": {}, **{f"size_matched_ratio_{k}": statistics.median(v) if v else 0.0
                                              for k, v in matched.items()}}
    for size in sorted(classes, key=list(PULL_SIZE_CLASSES).index):
        c = {k: statistics.median(v) for k, v in classes[size].items()}
        c["raw_gbps"] = raw[size]
        c["ratio"] = c["system_gbps"] / raw[size]
        c["ratio_paced"] = c["system_gbps"] / c["paced_gbps"]
        out["classes"][size] = c
    return out


def kv_report(res: dict[str, Any]) -> str:
    """``bench_kv``'s result as the text ``bench-kv`` prints."""
    lines = [f"medians of {res['repeats']} run(s) per mode, transport {res['transport']}"]
    for key in ("overlap", "no_overlap"):
        r = res[key]
        lines.append(f"{key:<11} stall {r['stall_fraction'] * 100:6.2f}% of compute ({r['stall_s']:.3f} s / "
                     f"{r['compute_s']:.2f} s), {r['pulls']:.0f} pulls, {r['bytes_pulled'] / 1e6:.1f} MB, "
                     f"{r['positions_recomputed']:.0f} positions recomputed, {r['tokens_per_s']:.1f} tokens/s")
    o, size = res["overlap"], res["overlap"]["mean_pull_bytes"]
    lines.append(f"bandwidth  in-system {o['system_gbps']:.2f} GB/s: {o['pull_s'] / max(o['transfers'], 1) * 1e6:.0f} us "
                 f"per exchange of {size / 1e3:.0f} kB on average (the pulling thread on a core "
                 f"{o['pull_on_cpu'] * 100:.0f}% of that time)")
    lines.append(f"raw {res['transport']}, back to back, at that size: data in cache {res['raw_gbps_same_size']:.2f} GB/s "
                 f"-> ratio {res['bandwidth_ratio']:.2f}; data from memory {res['raw_spread_gbps_same_size']:.2f} GB/s "
                 f"-> ratio {res['bandwidth_ratio_spread']:.2f} (at 4 MiB: {res['raw_gbps_4mib']:.2f} and "
                 f"{res['raw_spread_gbps_4mib']:.2f} GB/s)")
    by = res["by_size"]
    lines.append(f"by exchange size (overlap runs; raw at the class's mean size: back to back with the data from "
                 f"memory, and paced during the run; {o['files_recycled']:.0f} caches got a pooled file):")
    for size, c in by["classes"].items():
        lines.append(f"  {size:<9}{c['exchanges']:5.0f} exchanges of {c['mean_bytes'] / 1e3:7.0f} kB: in-system "
                     f"{c['system_gbps']:6.2f} GB/s; raw b2b {c['raw_gbps']:6.2f} GB/s -> ratio {c['ratio']:.2f}; "
                     f"raw paced {c['paced_gbps']:6.2f} GB/s -> ratio {c['ratio_paced']:.2f}")
    lines.append(f"  all sizes: raw pulls of the same sizes would take {by['size_matched_ratio_b2b']:.2f} (b2b) and "
                 f"{by['size_matched_ratio_paced']:.2f} (paced) of the time the system's took (size-matched ratios)")
    lines.append(f"raw {res['transport']}, one pull per {res['raw_pace_ms']:.0f} ms, at that size: idle machine "
                 f"{res['raw_paced_idle_gbps']:.2f} GB/s -> ratio {res['bandwidth_ratio_paced_idle']:.2f}; during the "
                 f"run (same load) {res['raw_paced_loaded_gbps']:.2f} GB/s -> ratio {res['bandwidth_ratio_paced_loaded']:.2f}")
    return "\n".join(lines)
