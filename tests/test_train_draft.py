"""The draft-training tool end to end on a tiny target, and the pair compatibility check."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from nebula_flow.models.compat import IncompatiblePair, check_pair
from nebula_flow.models.loader import load_model
from nebula_flow.tiny import build_tiny_pair
from nebula_flow_workers.distill import DistillConfig, train_draft
from tests.conftest import hf_greedy


def test_train_draft_runs_end_to_end_and_evaluates(tiny_pair, tmp_path, monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setenv("NEBULA_FLOW_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "draft"
    cfg = DistillConfig(target=str(tiny_pair / "target"), out=str(out), max_tokens=12_000, seq_len=64, steps=40,
                        batch_size=8, head_vocab=200, hidden_size=32, heads=2, kv_heads=1, intermediate_size=64,
                        layers=1, eval_tokens=12, teacher_dtype="float32", checkpoint_every=20, generate_chat=8,
                        generate_len=32)
    report = train_draft(cfg)
    assert report["held_out_loss"] > 0 and report["corpus"]["tokens"] > 0
    assert set(report["acceptance"]) == {"k=2", "k=4", "k=6"}
    for res in report["acceptance"].values():
        assert res["lossless"] is True  # the reduced-head draft never changes the output
        assert 1.0 <= res["tokens_per_round"] <= 7.0
    assert set(report["acceptance_chat"]) == {"k=2", "k=4", "k=6"}  # the tiny tokenizer has a chat template
    assert all(res["lossless"] is True for res in report["acceptance_chat"].values())
    progress = capsys.readouterr().err  # (each evaluation's lines say which prompts: they looked alike)
    assert all(f"eval k={k} on {which} prompts" in progress for k in (2, 4, 6) for which in ("code", "chat"))
    saved = json.loads((out / "training.json").read_text())
    assert saved["acceptance"] == report["acceptance"]
    assert not (out / "checkpoint.pt").exists()
    draft = load_model(out)
    assert draft.head_token_ids is not None and len(draft.head_token_ids) == 200
    check_pair(out, tiny_pair / "target")
    # The teacher pass and the chat answers are cached: a second run reuses them (their folders say done).
    teacher = sorted((f / "done").read_text() for f in (tmp_path / "cache" / "teacher").iterdir())
    assert teacher == sorted([str(12_000 // 64), "ok"])
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
    chat = CliRunner().invoke(main, ["eval-draft", "--target", str(tiny_pair / "target"), "--draft",
                                     str(tiny_pair / "draft"), "--ks", "2", "--max-new-tokens", "10", "--chat"])
    assert chat.exit_code == 0, chat.output
    assert "chat prompts" in chat.stderr and json.loads(chat.stdout)["k=2"]["lossless"] is True
    fused = CliRunner().invoke(main, ["eval-draft", "--target", str(tiny_pair / "target"), "--draft",
                                      str(tiny_pair / "draft"), "--ks", "2", "--max-new-tokens", "10",
                                      "--alternatives", "1", "--fuse-ngram", "6"])
    assert fused.exit_code == 0, fused.output
    assert json.loads(fused.stdout)["k=2"]["lossless"] is True
    sampled = CliRunner().invoke(main, ["eval-draft", "--target", str(tiny_pair / "target"), "--draft",
                                        str(tiny_pair / "draft"), "--ks", "2", "--max-new-tokens", "10",
                                        "--alternatives", "1", "--temperature", "0.8", "--seeds", "2"])
    assert sampled.exit_code == 0, sampled.output
    assert "sampled at temperature 0.8, 2 seeds" in sampled.stderr
    report = json.loads(sampled.stdout)["k=2"]
    assert report["lossless"] is None and 1.0 <= report["tokens_per_round"] <= 3.0  # (nothing to compare)
    bad = CliRunner().invoke(main, ["eval-draft", "--target", str(tiny_pair / "target"), "--draft",
                                    str(tiny_pair / "target" / "..")])
    assert bad.exit_code != 0 and "Error" in bad.output


def test_eval_draft_reports_how_often_the_drafts_choices_catch_the_targets_token(tiny_pair) -> None:  # noqa: ANN001
    from click.testing import CliRunner

    from nebula_flow.cli import main
    from nebula_flow_workers.evaluate import EVAL_PROMPTS

    args = ["eval-draft", "--target", str(tiny_pair / "target"), "--ks", "2", "--max-new-tokens", "10", "--guesses"]
    res = CliRunner().invoke(main, [*args, "--draft", str(tiny_pair / "draft")])
    assert res.exit_code == 0, res.output
    g = json.loads(res.stdout)["guesses"]
    assert g["positions"] == 10 * len(EVAL_PROMPTS)
    keys = ("first", "second_where_first_missed", "third_where_two_missed", "fourth_where_three_missed")
    assert all(0.0 <= g[key] <= 1.0 for key in keys) and set(g) == {"positions", *keys}
    same = json.loads(CliRunner().invoke(main, [*args, "--draft", str(tiny_pair / "target")]).stdout)["guesses"]
    assert same["first"] == 1.0  # the target drafting for itself: its first choice is always its own token
    assert CliRunner().invoke(main, [*args, "--draft", str(tiny_pair / "draft"), "--temperature", "0.5"]).exit_code != 0


def test_target_generation_records_its_own_greedy_text_and_ends_rows_at_a_stop_token(tiny_pair, tmp_path,
                                                                                     monkeypatch) -> None:  # noqa: ANN001
    from nebula_flow.corpus import corpus_files
    from nebula_flow.tokenizer import TextCodec
    from nebula_flow_workers.distill import _generate, chat_corpus, code_requests

    monkeypatch.setenv("NEBULA_FLOW_CACHE", str(tmp_path / "cache"))
    target = tiny_pair / "target"
    cfg = DistillConfig(target=str(target), out=str(tmp_path / "d"), generate_len=24, teacher_dtype="float32",
                        teacher_top_k=4)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]  # ragged: each row continues its own prompt
    ids, idx, logp = _generate(cfg, prompts, stop=set())
    assert ids[0, :5].tolist() == prompts[0] and ids[1, :3].tolist() == prompts[1]
    reference = hf_greedy(target, prompts[0], 24 - 5)  # row 0 is greedy (odd rows sample)
    assert ids[0, 5:5 + len(reference)].tolist() == reference
    assert (idx[0, 4:4 + len(reference), 0] == reference).all()  # the teacher's top-1 is what it wrote
    assert (logp[0, :, 0] >= logp[0, :, 1]).all()
    # A stop token ends a row: it repeats to the end, and the teacher there is certain of it.
    ids, idx, logp = _generate(cfg, prompts, stop=set(range(100_000)))
    first = int(ids[0, 5])
    assert (ids[0, 5:] == first).all() and (idx[0, 5:, 0] == first).all()
    assert (logp[0, 5:, 0] == 0).all() and np.isneginf(logp[0, 5:, 1:]).all()
    # Chat requests come from the corpus's documented functions, the same for a seed.
    files = corpus_files(None)[:40]
    requests = code_requests(files, 6, seed=0)
    assert len(requests) == 6 and requests == code_requests(files, 6, seed=0)
    assert all("`" in r for r in requests)
    chat = dataclasses.replace(cfg, generate_chat=3)
    ids, idx, logp = chat_corpus(chat, TextCodec(target))
    codec = TextCodec(target)
    first_prompt = codec.encode(code_requests(corpus_files(None), 3, seed=0)[0], chat=True)
    assert ids.shape == (3, 24) and ids[0, :len(first_prompt)].tolist() == first_prompt[:24]
    assert (chat_corpus(chat, codec)[0] == ids).all()  # cached: read back, not generated again
