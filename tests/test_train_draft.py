"""The draft-training tool end to end on a tiny target, and the pair compatibility check."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from nebula_flow.distill import DistillConfig, train_draft
from nebula_flow.models import load_model
from nebula_flow.models.compat import IncompatiblePair, check_pair
from nebula_flow.tiny import build_tiny_pair


def test_train_draft_runs_end_to_end_and_evaluates(tiny_pair, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("NEBULA_FLOW_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "draft"
    cfg = DistillConfig(target=str(tiny_pair / "target"), out=str(out), max_tokens=12_000, seq_len=64, steps=40,
                        batch_size=8, head_vocab=200, hidden_size=32, heads=2, kv_heads=1, intermediate_size=64,
                        layers=1, eval_tokens=12, teacher_dtype="float32", checkpoint_every=20)
    report = train_draft(cfg)
    assert report["held_out_loss"] > 0 and report["corpus"]["tokens"] > 0
    assert set(report["acceptance"]) == {"k=2", "k=4", "k=6"}
    for res in report["acceptance"].values():
        assert res["lossless"] is True  # the reduced-head draft never changes the output
        assert 1.0 <= res["tokens_per_round"] <= 7.0
    saved = json.loads((out / "training.json").read_text())
    assert saved["acceptance"] == report["acceptance"]
    assert not (out / "checkpoint.pt").exists()
    draft = load_model(out)
    assert draft.head_token_ids is not None and len(draft.head_token_ids) == 200
    check_pair(out, tiny_pair / "target")
    # The teacher pass is cached: a second run reuses it (its folder already says done).
    teacher = list((tmp_path / "cache" / "teacher").iterdir())
    assert len(teacher) == 1 and (teacher[0] / "done").read_text() == str(12_000 // 64)
    # Training goes on from a saved draft (its weights read by HF names, unfused).
    more = dataclasses.replace(cfg, out=str(tmp_path / "draft2"), steps=4, init_from=str(out))
    again = train_draft(more)
    assert again["parameters"] == report["parameters"] and (tmp_path / "draft2" / "model.safetensors").exists()


def test_pair_check_rejects_a_foreign_tokenizer(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    check_pair(tiny_pair / "draft", tiny_pair / "target")
    # A smaller BPE trained the same way is a prefix of the larger: compatible up to padding.
    smaller = build_tiny_pair(tmp_path / "smaller", vocab_size=300)
    check_pair(smaller / "draft", tiny_pair / "target")
    big = tmp_path / "big"
    shutil.copytree(tiny_pair / "draft", big)
    cfg = json.loads((big / "config.json").read_text())
    (big / "config.json").write_text(json.dumps(dict(cfg, vocab_size=cfg["vocab_size"] + 5000)))
    with pytest.raises(IncompatiblePair, match="vocabulary sizes differ"):
        check_pair(big, tiny_pair / "target")
    shifted = tmp_path / "shifted"
    shutil.copytree(tiny_pair / "draft", shifted)
    raw = json.loads((shifted / "tokenizer.json").read_text())
    vocab = raw["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (shifted / "tokenizer.json").write_text(json.dumps(raw))
    with pytest.raises(IncompatiblePair, match="tokenizers differ"):
        check_pair(shifted, tiny_pair / "target")


def test_eval_draft_command_reports_each_k_in_bf16(tiny_pair) -> None:  # noqa: ANN001
    from click.testing import CliRunner

    from nebula_flow.cli import main

    res = CliRunner().invoke(main, ["eval-draft", "--target", str(tiny_pair / "target"), "--draft",
                                    str(tiny_pair / "draft"), "--target-dtype", "bfloat16", "--ks", "1,3",
                                    "--max-new-tokens", "10"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)  # progress goes to stderr: stdout is the JSON report alone
    assert set(report) == {"k=1", "k=3"}
    assert all(r["lossless"] is True and 1.0 <= r["tokens_per_round"] <= 4.0 for r in report.values())
    bad = CliRunner().invoke(main, ["eval-draft", "--target", str(tiny_pair / "target"), "--draft",
                                    str(tiny_pair / "target" / "..")])
    assert bad.exit_code != 0 and "Error" in bad.output
