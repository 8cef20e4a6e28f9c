"""The peers in the bench: HF transformers' generate() and assisted generation, run as a user would."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from nebula_flow.cli import main
from nebula_flow.hf_peer import _load_draft
from nebula_flow.models.loader import load_model
from tests.conftest import tiny_config_file

pytestmark = pytest.mark.slow


def reduced_head_draft(pair, out, keep: int = 96):  # noqa: ANN001, ANN201
    """The tiny draft with its head cut to ``keep`` rows (as ``train-draft --head-vocab`` makes)."""
    src = pair / "draft"
    out.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            (out / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    ids = torch.randperm(cfg["vocab_size"], generator=torch.Generator().manual_seed(3))[:keep].sort().values
    state["lm_head.weight"], state["head_token_ids"] = head[ids].clone(), ids
    cfg.update(draft_head_size=keep, tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out


def test_a_reduced_head_draft_proposes_in_hf_what_it_proposes_here(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """The expanded head keeps the draft's choices: the same argmax token as our runtime's, over
    the reduced head's rows only."""
    path = reduced_head_draft(tiny_pair, tmp_path / "draft")
    ours = load_model(path, dtype="float32")
    hf = _load_draft(str(path), torch.float32)
    assert hf.lm_head.out_features == ours.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    for trial in range(8):
        prompt = torch.randint(3, ours.cfg.vocab_size, (5 + trial,), generator=gen).tolist()
        mine = ours([ours.new_cache()], [prompt], [1])[0][0]
        with torch.inference_mode():
            theirs = hf(torch.tensor([prompt])).logits[0, -1]
        assert int(ours.token_ids(mine.argmax())) == int(theirs.argmax())
        assert int(theirs.argmax()) in ours.head_token_ids.tolist()


def test_bench_runs_the_hf_peers_beside_the_modes(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    cfg = tiny_config_file(tiny_pair, tmp_path)
    res = CliRunner().invoke(main, ["bench", "--config", str(cfg), "--modes", "autoregressive,hf,hf-assisted",
                                    "--requests", "2", "--max-new-tokens", "12", "--repeats", "1", "--json"])
    assert res.exit_code == 0, res.output
    modes = json.loads(res.output.strip().splitlines()[-1])["modes"]
    for name in ("hf", "hf-assisted"):
        assert modes[name]["tokens_per_s"] > 0 and modes[name]["repeats"][0]["tokens"] == 24, name
        assert modes[name]["utilization"] is None and modes[name]["threads"] >= 1
    assert modes["hf"]["tokens_per_round"] == 1.0  # one target forward a token
    assert modes["hf-assisted"]["tokens_per_round"] > 1.0  # the tiny draft agrees with its target often
    bad = CliRunner().invoke(main, ["bench", "--config", str(cfg), "--modes", "hf-nosuch"])
    assert bad.exit_code != 0 and "hf-assisted" in bad.output
    # nucleus sampling reaches our workers and HF's generate() alike; it needs a temperature
    res = CliRunner().invoke(main, ["bench", "--config", str(cfg), "--modes", "autoregressive,hf", "--temperature",
                                    "0.8", "--top-p", "0.5", "--requests", "2", "--max-new-tokens", "6", "--repeats", "1",
                                    "--json"])
    assert res.exit_code == 0, res.output
    assert all(m["repeats"][0]["tokens"] == 12 for m in json.loads(res.output.strip().splitlines()[-1])["modes"].values())
    for args, says in ((["--top-p", "0.5"], "--temperature above 0"), (["--top-p", "0"], "--top-p")):
        bad = CliRunner().invoke(main, ["bench", "--config", str(cfg), "--modes", "hf", *args])
        assert bad.exit_code == 2 and says in bad.output, bad.output


def test_bench_measures_predictions_beside_hfs_prompt_lookup(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    """``--edit --predict``: each deployment runs the edit requests without and with their code as
    the prediction, in turns (rows MODE and MODE predicted); hf-lookup is HF's prompt lookup decoding."""
    cfg = tiny_config_file(tiny_pair, tmp_path)
    res = CliRunner().invoke(main, ["bench", "--config", str(cfg), "--modes", "pooled,hf-lookup", "--edit", "--predict",
                                    "--via", "zmq,api", "--requests", "2", "--max-new-tokens", "12", "--repeats", "2",
                                    "--json"])
    assert res.exit_code == 0, res.output
    modes = json.loads(res.output.strip().splitlines()[-1])["modes"]
    assert list(modes) == ["pooled via zmq", "pooled via api", "pooled via zmq predicted", "pooled via api predicted",
                           "hf-lookup"]
    assert all(len(m["repeats"]) == 2 and m["repeats"][0]["tokens"] == 24 for m in modes.values())
    assert modes["hf-lookup"]["tokens_per_round"] >= 1.0
    assert "pooled via api predicted repeat 1/2" in res.output  # (progress names the side it ran)
    bad = CliRunner().invoke(main, ["bench", "--config", str(cfg), "--modes", "pooled", "--predict"])
    assert bad.exit_code == 2 and "--edit" in bad.output, bad.output
