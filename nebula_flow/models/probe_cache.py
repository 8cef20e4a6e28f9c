"""Kernel probes remembered across starts.

Batch-invariant numerics probe, once per weight shape, which call sizes give a row the same bits
(``invariant.row_plan``). Where the CPU has no bf16 instructions a probe runs emulated bf16
products by the thousand: loading the bundled target in bf16 took 15.5 s of probing on a 2-core
AVX2 VM (3 s to load it in fp32), and every worker of every deployment paid it again. What a
probe finds depends only on the kernels and their inputs' shapes, so it is kept in a JSON file in
the nebula-flow cache folder ($NEBULA_FLOW_CACHE, default ~/.cache/nebula-flow), keyed by
everything that picks a kernel: torch's version, the CPU (its model and instruction-set flags) or
GPU, the environment variables that cap oneDNN's and MKL's instruction sets, torch's thread
count, and the probe's own inputs. ``NEBULA_FLOW_PROBE_CACHE=0`` probes every time. fp32 layers'
packed-kernel timings are kept the same way (``packed.first_faster_rows``: 1.5 s of the bundled
target's load on that VM), the measured ratios rather than the choice, which each load makes.

Workers of one host start together: the file is read whole and replaced atomically, so two that
probe at once may each keep only their own finding (the other probes again next time), never a
torn file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("nebula_flow.models")

VERSION = 1  # of the probes' logic: bump it when a probe would decide differently on the same kernels
ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ATEN_CPU_CAPABILITY")


def path() -> Path | None:
    """The file probes are kept in (None: ``NEBULA_FLOW_PROBE_CACHE=0``, every probe runs)."""
    if os.environ.get("NEBULA_FLOW_PROBE_CACHE", "1").lower() in ("0", "off", "false", "no"):
        return None
    from nebula_flow.config import cache_dir

    return cache_dir() / "kernel_probes.json"


@functools.cache
def _cpu() -> str:
    """This CPU's model and a digest of its flags (what picks a CPU kernel's blocking)."""
    model = flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name" and not model:
                model = value.strip()
            elif name.strip() in ("flags", "Features") and not flags:
                flags = value.strip()
    except OSError:  # (no /proc: the platform's own words)
        import platform

        model = platform.processor() or platform.machine()
    return f"{model} [{hashlib.sha256(flags.encode()).hexdigest()[:16]}]"


def machine(device: torch.device) -> dict[str, Any]:
    """What, beside a probe's own inputs, decides which kernel runs on ``device``."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu()
    return {"version": VERSION, "torch": torch.__version__, "device": where, "threads": torch.get_num_threads(),
            "env": {v: os.environ[v] for v in ISA_VARIABLES if v in os.environ}}


def model_kernels(model: Any) -> dict[str, Any]:  # noqa: ANN401 - a CausalLM (not imported: it imports this module)
    """What decides which kernels a batch-invariant ``model`` runs, not its weights' values: its
    shapes, dtype, packed layers and what its load-time probes chose (a probe over the whole model,
    such as ``invariant.same_bits_across_threads``, is keyed by this)."""
    cfg = model.cfg
    shape = {k: getattr(cfg, k) for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                          "num_heads", "num_kv_heads", "head_dim", "qkv_bias", "o_bias", "mlp_bias",
                                          "qk_norm", "tie_word_embeddings", "draft_head_size")}
    return {**shape, "dtype": str(model.lm_head.weight.dtype), "packed": model.packed_from_rows,
            "invariance": model.invariance}


def remember(kind: str, inputs: dict[str, Any], device: torch.device, probe: Callable[[], Any]) -> Any:  # noqa: ANN401
    """The result of ``probe()`` (JSON-able), a probe of ``kind`` on ``inputs`` on ``device``: kept
    from an earlier run with the same kernels, or probed now and kept."""
    where = path()
    if where is None:
        return probe()
    key = json.dumps({"kind": kind, "inputs": inputs, **machine(device)}, sort_keys=True)
    kept = _read(where)
    if key in kept:
        return kept[key]
    found = probe()
    kept = _read(where)  # (again: another worker may have added its own meanwhile)
    kept[key] = found
    out = None
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=where.parent, prefix=".probes-", delete=False) as out:
            json.dump(kept, out)
        os.replace(out.name, where)
    except OSError as err:  # (a read-only cache: probing each time is only slower)
        log.warning("kernel probes not kept in %s: %s", where, err)
        if out is not None:
            Path(out.name).unlink(missing_ok=True)
    return found


def _read(where: Path) -> dict[str, Any]:
    try:
        kept = json.loads(where.read_text())
    except (OSError, ValueError):  # (none yet, or not ours: probed again and replaced)
        return {}
    return kept if isinstance(kept, dict) else {}
