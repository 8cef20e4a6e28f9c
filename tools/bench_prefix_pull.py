"""What a prefix pull saves: a new request's prompt start, held by another request's KV on a peer,
pulled from there (``KVStore.fetch_many`` with a source, over a real transport) against computed
(the prefill a worker without it runs), then the prompt's last positions computed on top either way.

    PYTHONPATH=. .venv/bin/python tools/bench_prefix_pull.py [--model DIR] [--lengths 512,2048] [--repeats 5]

The holder's request finishes and is kept for prefixes, as on a worker; the puller is another store
of the same model in this process (its pulls go through the transport's server as a peer's would).
Wall time per request, medians of the repeats, pull and compute in turns.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from nebula_flow.kv.store import KVStore
from nebula_flow.kv.transport import make_transport
from nebula_flow.models.loader import load_model

TAIL = 8  # the new request's own positions after the shared start (its question)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path.home() / ".cache/nebula-flow/smollm2-135m-instruct"))
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--transports", default="shm+zmq,zmq")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a worker's default: 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype="auto")  # (as a deployment loads it: bf16 where the CPU has it)
    vocab = model.cfg.vocab_size
    print(f"{args.model}: {model.cfg.num_layers} layers, {next(model.parameters()).dtype}, {args.threads} thread(s)")
    rng = np.random.default_rng(0)
    for transport in args.transports.split(","):
        server, client = make_transport(transport), make_transport(transport)
        holder = KVStore(model, prefix_cache=True)
        endpoint = server.serve("127.0.0.1", lambda rid, role, s, e, held=holder: held.snapshot(rid, s, e))
        if server.share_folder is not None:
            holder.share_into(server.share_folder, "target")
        try:
            for n in map(int, args.lengths.split(",")):
                shared = rng.integers(100, vocab - 1, n).tolist()
                done = np.array(shared + [5, 6], dtype=np.int64)
                with torch.inference_mode():
                    model([holder.prepare(n, done)], [done[:-1].tolist()], [1])
                holder.publish([n])
                holder.free([n])  # (finished, kept for prefixes: served by its request's id)
                times: dict[str, list[float]] = {"pulled": [], "computed": []}
                for r in range(args.repeats + 1):  # (the first pass warms up: not counted)
                    prompt = np.array(shared + rng.integers(100, vocab - 1, TAIL).tolist(), dtype=np.int64)
                    for way in ("pulled", "computed"):
                        puller = KVStore(model, prefix_cache=True)
                        t = time.perf_counter()
                        if way == "pulled":
                            puller.fetch_many("target", [(1, prompt, n, n, None)], endpoint, client)
                        cache = puller.prepare(1, prompt)
                        with torch.inference_mode():
                            model([cache], [prompt[cache.length:-1].tolist()], [0])
                        took = time.perf_counter() - t
                        if way == "pulled":
                            assert puller.stats.prefix_pulled == n, "the pull did not bring the prefix"
                        if r:
                            times[way].append(took)
                pulled, computed = (statistics.median(times[w]) * 1e3 for w in ("pulled", "computed"))
                print(f"{transport:>8}, a {n}-token prompt start: pulled {pulled:.1f} ms, computed {computed:.1f} ms "
                      f"({computed / pulled:.1f}x; medians of {args.repeats}; then {TAIL} positions computed either way)")
        finally:
            server.close()
            client.close()


if __name__ == "__main__":
    main()
