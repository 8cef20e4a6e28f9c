"""The broker's text work per round as outputs grow: ``Admission.stop_text`` (incremental: only
the new tokens decoded, stop strings searched in a bounded window) against the rule it replaced
(the whole output decoded and searched every round), CPU time per round, medians of 3; and
``stop_text`` then ``Admission.release`` (the streamed text held back where it may begin a stop
string), what the broker runs each round since 2026-12-05.

    .venv/bin/python tools/bench_detok.py [TOKENIZER_DIR]   (default: the bundled target)
"""
import os
import statistics
import sys
import time

from nebula_flow.params import SamplingParams
from nebula_flow.request import Request
from nebula_flow_broker.admission import Admission, apply_stop

folder = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/nebula-flow/smollm2-135m-instruct")
adm = Admission(folder, 1 << 20)
codec = adm.codec
text = open(os.path.join(os.path.dirname(__file__), "..", "nebula_flow", "scheduler.py")).read() * 4
ids = codec.encode(text)[:4096]


def whole(req: Request) -> bool:
    """The rule before: decode the whole output, search all of it."""
    full, hit = apply_stop(codec.decode(req.output), req.params.stop)
    if hit or not full.endswith("\ufffd"):
        req.text = full
    return hit


for n in (256, 1024, 4096):
    res = {}
    for name, fn in (("whole", whole), ("incremental", adm.stop_text),
                     ("released", lambda req: (adm.stop_text(req), adm.release(req)))):
        times = []
        for _ in range(3):
            req = Request(0, "r", [1], SamplingParams(max_new_tokens=1 << 20, stop=("<|never|>", "\n\n\n\n")), 0)
            t0, rounds = time.process_time(), 0
            for end in range(3, n + 1, 3):  # 3 tokens a round
                req.output = ids[:end]
                fn(req)
                rounds += 1
            times.append((time.process_time() - t0) / rounds * 1e6)
        res[name] = statistics.median(times)
    print(f"output {n:5d} tokens, 3 per round: whole-output decode {res['whole']:.1f} us/round, incremental "
          f"{res['incremental']:.1f} us/round ({res['whole']/res['incremental']:.1f}x), with release "
          f"{res['released']:.1f} us/round")
