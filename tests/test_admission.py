"""The broker's text as a request grows: decoded a step at a time, stop strings found as a whole
decode would find them."""

from __future__ import annotations

import random

from nebula_flow.params import SamplingParams
from nebula_flow.request import Request
from nebula_flow_broker.admission import Admission, apply_stop


def test_incremental_text_and_stop_strings_match_decoding_the_whole_output(tiny_pair) -> None:  # noqa: ANN001
    adm = Admission(str(tiny_pair / "target"), 4096)
    codec = adm.codec
    sample = codec.encode("def add(a, b):\n    return a + b  # héllo wörld ✓ 日本語\nprint(add(1, 2))\n" * 3)
    vocab = codec.vocab_size
    for trial in range(200):
        rnd = random.Random(trial)
        ids = sample if trial % 2 else [rnd.randrange(vocab) for _ in range(120)]
        full = codec.decode(ids)
        stops: tuple[str, ...] = ()
        if trial % 4 and len(full) > 20:  # stop strings cut from the text, some across chunk boundaries
            at = rnd.randrange(5, len(full) - 5)
            stops = (full[at:at + rnd.randrange(1, 5)], "\x00never")
        req = Request(trial, f"r{trial}", [1], SamplingParams(max_new_tokens=4096, stop=stops), 0)
        fed, want = 0, ""
        while fed < len(ids):
            fed = min(len(ids), fed + rnd.randrange(1, 6))
            req.output = ids[:fed]
            hit = adm.stop_text(req)
            # the reference: decode everything; text ending in a partial character waits
            whole, want_hit = apply_stop(codec.decode(req.output), stops)
            want = whole if want_hit or not whole.endswith("\ufffd") else want
            assert (hit, req.text) == (want_hit, want), (trial, fed)
            if hit:
                break
