"""Worker-side commands (plugins; see nebula_flow/cli): `worker` runs one worker process;
`train-draft` and `eval-draft` distil and measure draft models with the same model runner."""

from __future__ import annotations

import json
import sys

import click

from nebula_flow.cli.common import IntList, checked_addresses
from nebula_flow.options import WorkerOptions, read_options


@click.command()
@click.option("--options", "options_file", type=click.Path(exists=True, dir_okay=False),
              help="Take every setting from this JSON file (what `serve` writes for each worker).")
@click.option("--role", type=click.Choice(["draft", "target", "colocated", "any"]),
              help="Which topic to serve; colocated workers hold both models and run whole rounds; any (elastic "
              "mode) holds both models and takes a draft or a verify batch at each pull, as the broker decides.")
@click.option("--model",
              help="The checkpoint (the draft's for role draft), as a config names it: a folder, a hub id "
              "(Qwen/Qwen3-0.6B) or cache:NAME (the nebula-flow cache folder, e.g. cache:tiny-pair/target). A draft may also be ngram, ngram:MAX or "
              "ngram:MIN-MAX: prompt lookup, no model (proposes what followed the context's last n tokens before; "
              "default n 2..4).")
@click.option("--draft-model", help="Draft checkpoint (colocated and any workers only; named as --model, or ngram).")
@click.option("--drafter", default=None, metavar="NAME",
              help="Draft workers: the drafter name the broker routes rounds by (several drafters: each round goes "
              "to the one that pays best for its request). Workers of one drafter must run the same model. "
              "[default: the model folder's name; ngram for the n-gram drafter]")
@click.option("--broker", "broker_addr", default="tcp://127.0.0.1:5556", show_default=True, callback=checked_addresses,
              help="The broker's worker address; a sharded deployment's every shard's, comma-separated (the worker "
              "serves them all).")
@click.option("--name", default="", help="Name shown in status and logs.")
@click.option("--max-batch", type=click.IntRange(1), default=8, show_default=True, help="Tasks per batch (the credits of each PULL).")
@click.option("--draft-max-batch", type=click.IntRange(1), help="Role any: tasks per draft batch, where more than --max-batch (a small "
              "draft model runs large batches for little more than small ones). [default: --max-batch]")
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True, help="torch threads for this worker.")
@click.option("--device", default="cpu", show_default=True,
              help="cpu, cuda, cuda:N, or emulated (forward passes take the time --profile predicts).")
@click.option("--dtype", default=None, help="float32, bfloat16, float16, or auto: bf16 on CUDA and on CPUs that compute "
              "bf16 natively (AMX-BF16, AVX512-BF16, Arm BF16), fp32 on other CPUs (default: fp32 on CPU, bf16 on CUDA).")
@click.option("--batch-invariant/--no-batch-invariant", default=None,
              help="Give a token's logits the same bits whatever it is batched with, so speculative output "
              "equals plain decoding exactly in reduced precision (costs a little speed). Default: on for "
              "bfloat16/float16 on CPU, off otherwise.")
@click.option("--cuda-graphs/--enforce-eager", default=True, show_default=True,
              help="On CUDA, replay decode steps and verify blocks from CUDA graphs recorded at start and on first "
              "use (--enforce-eager: every forward eager, as vLLM's flag; slower, for debugging).")
@click.option("--kv-transport", type=click.Choice(["auto", "ucx", "zmq", "shm", "shm+zmq", "none"]), default="auto",
              show_default=True,
              help="How KV moves between workers: auto = UCX on CUDA (if ucxx is installed, else ZeroMQ), shm+zmq "
              "on CPU; shm = peers on this host read the holder's KV files (CPU, one host); shm+zmq = shm with "
              "same-host peers, ZeroMQ with the others. With --keys: ZeroMQ (CURVE) only.")
@click.option("--kv-host", help="Address of the interface the KV server binds and advertises to peers (default: "
              "the one this host reaches the broker through; 127.0.0.1 with a broker on loopback).")
@click.option("--kv-overlap/--no-kv-overlap", default=True, show_default=True,
              help="Pull a batch's KV while the previous batch computes (off: at the start of its compute).")
@click.option("--kv-skip-slow-pulls/--kv-always-pull", default=True, show_default=True,
              help="Recompute a request's positions here instead of pulling them where the holder's link, as "
              "measured by earlier pulls, would take more than twice as long as this worker's forward of those "
              "rows (status: pulls_skipped). Either way a pull is waited for as long as its link needs.")
@click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
              help="Keep finished requests' KV (within --max-kv-gb, least recently used dropped first) and start "
              "each request from the longest prefix of its tokens this worker's KV holds, copied instead of "
              "computed: a shared system prompt or a chat's earlier turns are computed once (status: prefix_hits, "
              "prefix_reused).")
@click.option("--profile", type=click.Path(), help="Latency profile for --device emulated.")
@click.option("--draft-profile", type=click.Path(), help="The draft's latency profile (colocated or any, + emulated).")
@click.option("--max-kv-gb", default=4.0, show_default=True, help="KV memory budget per model (LRU eviction).")
@click.option("--kv-pool-gb", type=float, help="Memory per model for finished requests' shared KV files, kept "
              "(pages in) for later requests, beyond --max-kv-gb; 0: none kept. Same-host (shm) KV only. "
              "[default: --max-kv-gb / 8]")
@click.option("--keys", type=click.Path(), help="CURVE key folder (or NEBULA_FLOW_KEYS).")
def worker(options_file: str | None, role: str | None, model: str | None, draft_model: str | None, drafter: str | None, broker_addr: str, name: str,
           max_batch: int, draft_max_batch: int | None, threads: int, device: str, dtype: str | None, batch_invariant: bool | None,
           cuda_graphs: bool, kv_transport: str, kv_host: str, kv_overlap: bool, kv_skip_slow_pulls: bool, prefix_cache: bool, profile: str | None, draft_profile: str | None, max_kv_gb: float,
           kv_pool_gb: float | None, keys: str | None) -> None:
    """Run one worker: register, pull tasks, run them, return results."""
    from nebula_flow.hub import local_folder
    from nebula_flow.lookup import is_ngram
    from nebula_flow.models.config import ModelConfigError
    from nebula_flow.protocol import DRAFTER_NAME, DRAFTER_RULE
    from nebula_flow_workers.worker import serve_worker

    if options_file:  # (a deployment's child: the file holds every setting)
        try:
            opts = read_options(WorkerOptions, options_file)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
        try:
            sys.exit(serve_worker(opts))
        except (ModelConfigError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
    if role is None or model is None:
        raise click.UsageError("give --role and --model (or --options FILE)")
    if drafter is not None and (role != "draft" or not DRAFTER_NAME.fullmatch(drafter)):
        raise click.BadParameter(f"a draft worker's name for its drafter: {DRAFTER_RULE}",
                                 param_hint="--drafter")

    try:
        model, draft_model = (m if m is None or is_ngram(m) else local_folder(m, log=lambda t: click.echo(t, err=True))
                              for m in (model, draft_model))  # (as a config names them: hub ids, cache:NAME)
        sys.exit(serve_worker(WorkerOptions(role, broker_addr, model, draft_model, name, max_batch, threads=threads,
                                            device=device, dtype=dtype, batch_invariant=batch_invariant,
                                            cuda_graphs=cuda_graphs, kv_transport=kv_transport,
                                            kv_host=kv_host,
                                            kv_overlap=kv_overlap, kv_skip_slow_pulls=kv_skip_slow_pulls,
                                            prefix_cache=prefix_cache,
                                            profile=profile, draft_profile=draft_profile,
                                            max_kv_gb=max_kv_gb, kv_pool_gb=kv_pool_gb, keys=keys,
                                            drafter=drafter, draft_capacity=draft_max_batch)))
    except (ModelConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None



@click.command("train-draft")
@click.option("--target", required=True, type=click.Path(exists=True, file_okay=False), help="Target checkpoint directory.")
@click.option("--out", required=True, type=click.Path(), help="Where the draft checkpoint goes (resumes if a checkpoint is there).")
@click.option("--corpus", multiple=True, type=click.Path(exists=True), help="Text files/folders (*.py); default: the stdlib sources.")
@click.option("--max-tokens", type=click.IntRange(1), default=400_000, show_default=True, help="Corpus tokens to use.")
@click.option("--seq-len", type=click.IntRange(2), default=256, show_default=True)
@click.option("--steps", type=click.IntRange(0), default=1500, show_default=True)
@click.option("--batch-size", type=click.IntRange(1), default=16, show_default=True)
@click.option("--lr", type=click.FloatRange(0, min_open=True), default=2e-3, show_default=True)
@click.option("--hidden-size", type=click.IntRange(1), default=256, show_default=True)
@click.option("--layers", type=click.IntRange(1), default=4, show_default=True)
@click.option("--heads", type=click.IntRange(1), default=4, show_default=True)
@click.option("--kv-heads", type=click.IntRange(1), default=2, show_default=True)
@click.option("--intermediate-size", type=click.IntRange(1), default=704, show_default=True)
@click.option("--head-vocab", type=click.IntRange(0), default=8192, show_default=True, help="Tokens the draft's output head scores (0 = all).")
@click.option("--teacher-dtype", default="bfloat16", show_default=True, help="dtype of the cached teacher pass.")
@click.option("--eval-tokens", type=click.IntRange(1), default=48, show_default=True, help="Tokens per prompt in the acceptance evaluation.")
@click.option("--generate-seqs", type=click.IntRange(0), default=0, show_default=True,
              help="Also distil on this many sequences the target writes itself (its own style).")
@click.option("--generate-len", type=click.IntRange(1), default=192, show_default=True, help="Tokens per generated sequence.")
@click.option("--generate-chat", type=click.IntRange(0), default=0, show_default=True,
              help="Also distil on the target's answers to this many code requests sent in its chat format "
              "(made from the corpus's documented functions): how an instruct model is used.")
@click.option("--init-from", type=click.Path(exists=True, file_okay=False), help="Fine-tune this draft instead of "
              "starting from scratch.")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True,
              help="Seeds initialisation, batches and generation (a new seed writes new generated sequences).")
def train_draft(target, out, corpus, **kw) -> None:  # noqa: ANN001, ANN003
    """Distil a draft model for TARGET: cached teacher logits, resumable training, evaluation."""
    from nebula_flow.models.config import ModelConfigError
    from nebula_flow_workers.distill import DistillConfig
    from nebula_flow_workers.distill import train_draft as run_training

    try:
        report = run_training(DistillConfig(target=target, out=out, corpus=list(corpus) or None, **kw))
    except (ModelConfigError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps({"held_out_loss": report["held_out_loss"], "acceptance": report["acceptance"],
                           "parameters": report["parameters"]}, indent=2))


@click.command("eval-draft")
@click.option("--target", required=True, type=click.Path(exists=True, file_okay=False), help="Target checkpoint directory.")
@click.option("--draft", required=True, type=click.Path(exists=True, file_okay=False), help="Draft checkpoint directory.")
@click.option("--target-dtype", default=None, help="The target's dtype as deployed (float32, bfloat16, or auto as "
              "workers pick it; default fp32 on CPU). bf16 runs batch-invariant, as workers run it.")
@click.option("--ks", type=IntList(), default="2,4,6", show_default=True, help="Speculation lengths to measure.")
@click.option("--max-new-tokens", type=click.IntRange(1), default=48, show_default=True, help="Tokens per prompt.")
@click.option("--alternatives", default=0, show_default=True, type=click.IntRange(0, 8),
              help="Runner-ups to the first draft token verified beside the chain (a token tree; the broker's "
              "--first-alternatives).")
@click.option("--fuse-ngram", default=0, show_default=True, type=click.IntRange(0, 16),
              help="Also verify a prompt-lookup chain of up to this many tokens beside each draft (the broker's "
              "--fuse-ngram).")
@click.option("--chat", is_flag=True, help="Send the built-in code requests in the target's chat format (how an "
              "instruct model is used) instead of raw code prompts; an answer ends at the end-of-turn token.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0, 100),
              help="Sample at this temperature instead of decoding greedily (rejection sampling: tokens per round "
              "only, there is no output to compare).")
@click.option("--seeds", default=3, show_default=True, type=click.IntRange(1, 1000),
              help="With --temperature: samples of each prompt (each request draws from its own seed).")
@click.option("--guesses", is_flag=True, help="Also report how often the draft's first, second, third and fourth "
              "choices are the target's greedy token (each where those before missed: the guesses draft-ahead's "
              "pre-drafts bet on, the second first; what draft_ahead beyond k + 2 would catch).")
def eval_draft(target: str, draft: str, target_dtype: str | None, ks: tuple[int, ...], max_new_tokens: int,
               alternatives: int, fuse_ngram: int, chat: bool, temperature: float, seeds: int, guesses: bool) -> None:
    """Committed tokens per round of a draft/target pair at each k, on the built-in code prompts
    (not from the training corpus). Greedy by default, checking the output equals the target
    alone; --temperature samples."""
    from nebula_flow.models.compat import IncompatiblePair, check_pair
    from nebula_flow.models.config import ModelConfigError
    from nebula_flow.models.loader import DTYPE_CHOICES
    from nebula_flow_workers.evaluate import EVAL_CHAT_PROMPTS, EVAL_PROMPTS, evaluate_pair

    if target_dtype is not None and target_dtype not in DTYPE_CHOICES:
        raise click.BadParameter(f"{target_dtype!r} is not one of {', '.join(DTYPE_CHOICES)}", param_hint="--target-dtype")
    if guesses and temperature:
        raise click.UsageError("--guesses compares with the target's greedy output: not with --temperature")
    try:
        check_pair(draft, target)
    except (IncompatiblePair, ModelConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{len(EVAL_CHAT_PROMPTS if chat else EVAL_PROMPTS)} {'chat' if chat else 'code'} prompts x "
               f"{max_new_tokens} tokens, target {target_dtype or 'default dtype'}"
               + (f", sampled at temperature {temperature}, {seeds} seeds" if temperature else ""), err=True)
    res = evaluate_pair(target, draft, max_new_tokens, ks, target_dtype,
                        alternatives, chat, fuse_ngram, temperature, seeds, guesses)
    click.echo(json.dumps(res, indent=2))


@click.command("worker-zygote", hidden=True)
def worker_zygote() -> None:
    """Fork workers on request from one process that imported their code once (what a deployment
    starts: nebula_flow/spawn.py); reads requests on stdin until it closes."""
    from nebula_flow_workers.zygote import main

    main()
