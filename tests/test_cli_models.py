"""The models on the command line (`--target`, `--draft`), as vLLM's `serve MODEL` takes one:
before, serving another model meant writing a TOML."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from nebula_flow.cli import main
from nebula_flow.cli.common import apply_overrides, load_deploy

REPO = Path(__file__).resolve().parent.parent


def missing_models_config(folder: Path, mode: str = "pooled") -> Path:
    """A deployment TOML whose models are not there: only the command line's can serve."""
    path = folder / "elsewhere.toml"
    path.write_text(f'mode = "{mode}"\n[draft]\nmodel = "no-such-draft"\nthreads = 1\n'
                    '[target]\nmodel = "no-such-target"\nname = "other"\nthreads = 1\n')
    return path


def generated_text(output: str, prompt: str) -> str:
    """What `run` printed for ``prompt``: the text between its ">>> prompt" line and its stats line."""
    found = re.search(rf">>> {re.escape(prompt)}\n(.*?)\n\[\d+ tokens", output, re.S)
    assert found, output
    return found.group(1)


def test_target_and_draft_on_the_command_line_replace_the_config_s(tiny_pair, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Folders relative to where the command runs, cache:NAME or ngram; clients call the target by
    the name given (the config's name was the other model's); a speculative run on them is the
    target's own greedy output."""
    config = missing_models_config(tmp_path)
    monkeypatch.chdir(tiny_pair)
    cfg = apply_overrides(load_deploy(str(config)), None, None, None, None, target="target", draft="draft")
    assert (cfg.target.model, cfg.target.name) == (str(tiny_pair / "target"), "target")
    assert (cfg.draft.model, cfg.draft.name) == (str(tiny_pair / "draft"), "draft")
    cfg = apply_overrides(load_deploy(str(config)), None, None, None, None, draft="ngram")
    assert cfg.draft.model == "ngram" and cfg.target.name == "other"  # (only what was given changes)

    texts = {}
    for mode, models in (("pooled", ["--target", "target", "--draft", "draft"]),
                         ("autoregressive", ["--target", "target"])):
        res = CliRunner().invoke(main, ["run", "--config", str(config), "--mode", mode, *models, "--port", "0",
                                        "--log-dir", str(tmp_path / mode), "--max-new-tokens", "12", "The fox"])
        assert res.exit_code == 0, res.output
        texts[mode] = generated_text(res.output, "The fox")
    assert texts["pooled"] == texts["autoregressive"]


def test_bench_measures_the_models_named_on_the_command_line(tiny_pair, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    import json

    monkeypatch.chdir(tiny_pair)
    res = CliRunner().invoke(main, ["bench", "--config", str(missing_models_config(tmp_path)), "--target", "target",
                                    "--draft", "draft", "--modes", "pooled,autoregressive", "--requests", "2",
                                    "--max-new-tokens", "8", "--repeats", "1", "--json"])
    assert res.exit_code == 0, res.output
    modes = json.loads(res.output.strip().splitlines()[-1])["modes"]
    assert set(modes) == {"pooled", "autoregressive"} and all(m["tokens_per_s"] > 0 for m in modes.values())
    assert modes["pooled"]["tokens_per_round"] > 1.0  # (the draft's tokens accepted: the tiny pair's)


@pytest.mark.parametrize(("models", "said"), [
    (["--target", "nope"], "Error: target model nope: no such folder (give a checkpoint folder, a hub id"),
    (["--target", "target", "--draft", str(REPO / "models" / "smollm2-draft")],
     "vocabulary sizes differ: draft 49152, target 512 (name a draft of the target's tokenizer: [draft] model or "
     "--draft, ngram for prompt lookup, or run --mode autoregressive)"),
])
def test_a_model_that_cannot_serve_is_said_before_anything_starts(tiny_pair, tmp_path, monkeypatch, models,  # noqa: ANN001
                                                                  said: str) -> None:
    monkeypatch.chdir(tiny_pair)
    res = CliRunner().invoke(main, ["run", "--config", str(missing_models_config(tmp_path)), *models, "--port", "0",
                                    "--log-dir", str(tmp_path / "logs"), "hi"])
    assert res.exit_code == 1 and said in res.output, res.output
    assert "starting" not in res.output
