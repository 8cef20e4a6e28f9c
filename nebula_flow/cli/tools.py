"""Model and key tools: `profile` (latency for emulated devices), `tiny-pair`, `keys`."""

from __future__ import annotations

import json
from pathlib import Path

import click

from nebula_flow.cli.common import IntList
from nebula_flow.config import cache_dir


@click.command()
@click.option("--model", type=click.Path(exists=True, file_okay=False), help="Checkpoint directory (required "
              "unless --ops; with --ops, default: a Qwen3-0.6B-shaped model with random weights).")
@click.option("--ops", "count_ops", is_flag=True, help="Instead: count the aten ops one forward dispatches (torch's "
              "profiler) for a decode of 1, 8 and 16 sequences and 8 and 16 five-row verifies, with their times, "
              "the batch's attention in one call per layer and (\"apart\") per sequence; print JSON. "
              "What a forward costs the host, each op a kernel launch on a GPU.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="--ops: the weights' dtype.")
@click.option("--device", default="cpu", show_default=True, help="--ops: where the model runs (cpu, cuda, cuda:N); "
              "on CUDA the times are the device's, with CUDA graphs and (\"eager\") without.")
@click.option("--out", type=click.Path(), help="Profile JSON to write (default: print it).")
@click.option("--batches", type=IntList(), default="1,2,4,8", show_default=True, help="Sequences per forward.")
@click.option("--tokens", type=IntList(), default="1,5", show_default=True, help="New tokens per sequence (1 = decode, k+1 = verify).")
@click.option("--contexts", type=IntList(), default="64,256", show_default=True,
              help="Context lengths (tokens before the new ones).")
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True)
@click.option("--acceptance", type=click.FloatRange(0, 1), help="Record a per-position acceptance rate (for draft profiles).")
def profile(model, count_ops, dtype, device, out, batches, tokens, contexts, threads, acceptance) -> None:  # noqa: ANN001
    """Measure MODEL's forward latency over a grid and write a profile for --device emulated
    (or, with --ops, count the host work of a forward)."""
    from nebula_flow.emulated import measure_profile

    if count_ops:
        click.echo(json.dumps(forward_ops_report(model, dtype, threads, device)))
        return
    if device != "cpu":
        raise click.UsageError("--device is for --ops (latency profiles for emulated devices are measured on the CPU)")
    if model is None:
        raise click.UsageError("--model is required (unless --ops)")

    try:
        prof = measure_profile(model, list(batches), list(tokens), list(contexts), threads,
                               log=lambda m: click.echo(m, err=True))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if acceptance is not None:
        prof["acceptance"] = acceptance
    text = json.dumps(prof, indent=2)
    if out:
        Path(out).write_text(text)
        click.echo(f"wrote {out}: {prof['latency']}", err=True)
    else:
        click.echo(text)



def forward_ops_report(model: str | None, dtype: str, threads: int, device: str = "cpu") -> dict:
    """``profile --ops``: aten ops and seconds per forward shape, on MODEL or a Qwen3-0.6B shape."""
    import torch

    from nebula_flow.models.loader import load_model
    from nebula_flow.models.ops import QWEN3_0_6B, count_ops, random_model
    from nebula_flow.options import DEVICE_NAME, check_device

    torch.set_num_threads(threads)
    torch_dtype = getattr(torch, dtype)
    try:
        if device == "emulated" or not DEVICE_NAME.fullmatch(device):
            raise ValueError(f"--ops counts a real model's work: cpu, cuda or cuda:N, got {device!r}")
        check_device(device, present=True)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--device") from None
    click.echo(f"building {'the model in ' + model if model else 'a Qwen3-0.6B-shaped model (random weights)'} "
               f"({dtype}, {device}) ...", err=True)
    net = load_model(model, device=device, dtype=torch_dtype) if model else random_model(QWEN3_0_6B, torch_dtype, device=device)
    res, apart = count_ops(net), count_ops(net, group=False)
    extra = {}
    if net.step_graphs is not None:  # (CUDA: the same forwards launched op by op)
        eager = count_ops(net, graphs=False)
        extra = {"eager": {"ops": {k: v["ops"] for k, v in eager.items()},
                           "seconds": {k: round(v["seconds"], 5) for k, v in eager.items()},
                           "host_seconds": {k: round(v["host_seconds"], 5) for k, v in eager.items()}},
                 "graphs_replayed": net.step_graphs.replays, "graphs_enabled": net.step_graphs.enabled}
    return {"model": model or "qwen3-0.6b-shape", "dtype": dtype, "threads": threads, "device": device, **extra,
            "layers": net.cfg.num_layers, "batch_invariant": net.batch_invariant,
            "ops": {k: v["ops"] for k, v in res.items()},
            "seconds": {k: round(v["seconds"], 5) for k, v in res.items()},
            "host_seconds": {k: round(v["host_seconds"], 5) for k, v in res.items()},
            # each sequence attending apart: how every forward ran before the grouped path (issue 27)
            "apart": {"ops": {k: v["ops"] for k, v in apart.items()},
                      "seconds": {k: round(v["seconds"], 5) for k, v in apart.items()}},
            "ops_ratio": {k: round(apart[k]["ops"] / res[k]["ops"], 2) for k in res}}


@click.command()
@click.argument("folder", type=click.Path())
@click.argument("action", required=False, type=click.Choice(["add-worker", "add-client", "revoke"]))
@click.argument("name", required=False)
def keys(folder: str, action: str | None, name: str | None) -> None:
    """CURVE keys: `keys DIR` creates a key folder (the broker's keypair, a worker key and a client
    key "client"); `keys DIR add-worker NAME` / `add-client NAME` adds one keypair; `keys DIR
    revoke NAME` takes one back (refused at its next connection; a registered worker is dropped
    within a second). Each socket accepts only its role's keys. A deployment started with keys
    makes one key per worker (workers/draft-0, ...). Clients pick theirs with
    NEBULA_FLOW_CLIENT_KEY (default "client"). See docs/security.md."""
    from nebula_flow.security import SecurityError, add_key, generate_keys, revoke

    try:
        if action is None:
            existed = (Path(folder) / "broker.key_secret").exists()  # (never replaced: every peer trusts it)
            path = generate_keys(folder)
            click.echo((f"{path} holds keys already: kept them (made only what was missing of the broker's keypair, "
                        "worker key 'worker' and client key 'client')" if existed else
                        f"wrote the broker's keypair, worker key 'worker' and client key 'client' to {path}")
                       + f"; pass --keys {path} (or set NEBULA_FLOW_KEYS) on the broker, workers and clients")
            return
        if not name:
            raise click.UsageError(f"{action} needs a NAME")
        if action == "revoke":
            done = revoke(folder, name)
            if not done:
                raise click.ClickException(f"no authorized key named {name!r} in {folder}")
            click.echo(f"revoked {', '.join(done)}")
            return
        secret = add_key(folder, action.removeprefix("add-"), name)
        click.echo(f"wrote {secret} (give it, with {Path(folder) / 'broker.key'}, to that {action[4:]} only)")
    except SecurityError as exc:
        raise click.ClickException(str(exc)) from None


@click.command("tiny-pair")
@click.argument("out", type=click.Path(), default=None, required=False)
def tiny_pair(out: str | None) -> None:
    """Build the project's tiny draft/target pair (random weights) into OUT (default: the cache)."""
    from nebula_flow.tiny import build_tiny_pair

    try:
        path = build_tiny_pair(out or cache_dir() / "tiny-pair")
    except OSError as exc:
        raise click.ClickException(f"cannot write the pair there: {exc}") from None
    click.echo(f"wrote {path}/target and {path}/draft")



COMMANDS = [profile, keys, tiny_pair]
