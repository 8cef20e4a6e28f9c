"""Distil a small draft model for any target checkpoint (``nebula-flow train-draft``).

1. Corpus: text files (default: the Python standard library's sources, recorded in the run's
   ``training.json`` because it differs between machines), tokenized with the target's
   tokenizer and cut into fixed-length sequences; the last few percent are held out.
2. Teacher: the target runs once over the corpus; the top-K log-probabilities of every
   position are cached on disk (the target's cost is paid once; the cache is reused by later
   runs and resumed if interrupted).
3. Student: a narrow Llama (same tokenizer). Its input embedding covers the full vocabulary
   (a gather, nearly free) and starts from a PCA projection of the target's embeddings; its
   output head covers the ``head_vocab`` most frequent tokens, which keeps the per-token cost
   low on CPUs (a 49k-row head would cost as much as the rest of the draft several times).
4. Loss: cross-entropy of the student against the teacher's top-K distribution.
5. Evaluation: held-out loss and the mean committed tokens per round at k = 2, 4, 6 (greedy)
   with the real speculative pipeline code on prompts outside the corpus.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from nebula_flow.config import cache_dir
from nebula_flow.corpus import corpus_files, stdlib_root
from nebula_flow.models.config import ModelConfig
from nebula_flow.models.llama import CausalLM
from nebula_flow.models.loader import load_model
from nebula_flow.tokenizer import TextCodec, eos_token_ids
from nebula_flow_workers.evaluate import evaluate_pair, log


@dataclass
class DistillConfig:
    target: str
    out: str
    corpus: list[str] | None = None  # files or folders; default: the stdlib sources
    max_tokens: int = 400_000
    seq_len: int = 256
    teacher_top_k: int = 32
    teacher_dtype: str = "bfloat16"
    hidden_size: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 704
    head_vocab: int = 8192
    steps: int = 1500
    batch_size: int = 16
    lr: float = 2e-3
    seed: int = 0
    checkpoint_every: int = 250
    eval_tokens: int = 48
    generate_seqs: int = 0  # sequences the target writes itself (from corpus snippets), distilled too
    generate_len: int = 192  # tokens per generated sequence, the 32-token prompt included
    generate_chat: int = 0  # answers the target writes to code requests in its chat format, distilled too
    init_from: str | None = None  # fine-tune an existing draft instead of starting from PCA

    def check(self, target: ModelConfig) -> None:
        """Refuse, before any work, a draft shape the runtime cannot build or the target cannot teach."""
        from nebula_flow.models.loader import DTYPES

        if self.teacher_dtype not in DTYPES:
            raise ValueError(f"teacher_dtype must be one of {', '.join(DTYPES)}, got {self.teacher_dtype!r}")
        if self.seq_len > target.max_position_embeddings:
            raise ValueError(f"seq_len {self.seq_len} is past the target's {target.max_position_embeddings} positions")
        if self.init_from:  # (the draft's shape is the one being fine-tuned)
            return
        if self.hidden_size % self.heads or (self.hidden_size // self.heads) % 2:
            raise ValueError(f"hidden_size {self.hidden_size} must split into {self.heads} heads of an even size "
                             "(rotary embeddings rotate pairs)")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.hidden_size > min(target.hidden_size, target.vocab_size):
            raise ValueError(f"hidden_size {self.hidden_size} is wider than the target's ({target.hidden_size}): "
                             "the draft's embedding starts from a projection of the target's")





def tokenize_corpus(cfg: DistillConfig, codec: TextCodec) -> tuple[np.ndarray, dict]:
    """Token sequences [n, seq_len] from the corpus, files shuffled with the seed."""
    files = corpus_files(cfg.corpus)
    rng = np.random.default_rng(cfg.seed)
    rng.shuffle(files)
    ids: list[int] = []
    used = 0
    for f in files:
        if len(ids) >= cfg.max_tokens:
            break
        ids.extend(codec.encode(f.read_text(errors="replace")) + [codec.eos_token_id])
        used += 1
    n = min(len(ids), cfg.max_tokens) // cfg.seq_len
    if n < 8:
        raise ValueError(f"the corpus gives {n} sequences of {cfg.seq_len} tokens (of {len(ids)} tokens, at most "
                         f"max_tokens {cfg.max_tokens}); training needs 8 or more: add files, raise max_tokens "
                         "or shorten seq_len")
    info = {"files_available": len(files), "files_used": used, "tokens": n * cfg.seq_len,
            "python": platform.python_version(), "roots": cfg.corpus or [str(stdlib_root())]}
    return np.asarray(ids[: n * cfg.seq_len], dtype=np.int32).reshape(n, cfg.seq_len), info


def teacher_cache(cfg: DistillConfig, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-K teacher log-probs per position, computed once and kept in the cache folder."""
    key = hashlib.sha256(seqs.tobytes() + f"{Path(cfg.target).resolve()}|{cfg.teacher_top_k}|{cfg.teacher_dtype}".encode()).hexdigest()[:16]
    folder = cache_dir() / "teacher" / key
    folder.mkdir(parents=True, exist_ok=True)
    n, L, K = seqs.shape[0], seqs.shape[1], cfg.teacher_top_k
    mode = "r+" if (folder / "idx.npy").exists() else "w+"
    idx = np.lib.format.open_memmap(folder / "idx.npy", mode, np.int32, (n, L, K))
    lp = np.lib.format.open_memmap(folder / "logp.npy", mode, np.float16, (n, L, K))
    done_file = folder / "done"
    done = int(done_file.read_text()) if done_file.exists() else 0
    if done >= n:
        return idx, lp
    teacher = load_model(cfg.target, dtype=cfg.teacher_dtype, batch_invariant=False)  # whole sequences: no need
    log(f"teacher pass over {n} x {L} tokens ({cfg.teacher_dtype}), cached in {folder}; resuming at {done}")
    t0, batch = time.monotonic(), 4
    for start in range(done, n, batch):
        rows = seqs[start:start + batch]
        logits = teacher([teacher.new_cache(L) for _ in rows], [r.tolist() for r in rows], [L] * len(rows))
        for j, lg in enumerate(logits):
            top = torch.topk(torch.log_softmax(lg.float(), -1), K, dim=-1)
            idx[start + j], lp[start + j] = top.indices.numpy(), top.values.numpy()
        done_file.write_text(str(start + len(rows)))
        if (start // batch) % 10 == 0:
            rate = (start + len(rows) - done) * L / (time.monotonic() - t0)
            log(f"teacher {start + len(rows)}/{n} sequences, {rate:.0f} tokens/s, "
                 f"ETA {(n - start - len(rows)) * L / max(rate, 1e-9) / 60:.1f} min")
    idx.flush()
    lp.flush()
    return idx, lp


def _generate(cfg: DistillConfig, prompts: list[list[int]], stop: set[int]) -> tuple[np.ndarray, ...]:
    """The target continues each prompt to ``generate_len`` tokens (even rows greedy, odd rows
    sampled at temperature 0.8), recording its top-K at every position as it goes. A row that
    emits a ``stop`` token ends there: the rest repeats that token, teacher included (a draft is
    never asked past the end)."""
    n, L, K = len(prompts), cfg.generate_len, cfg.teacher_top_k
    teacher = load_model(cfg.target, dtype=cfg.teacher_dtype, batch_invariant=False)  # whole sequences: no need
    ids = np.zeros((n, L), np.int32)
    idx = np.zeros((n, L, K), np.int32)
    logp = np.zeros((n, L, K), np.float16)
    batch, t0, made = 32, time.monotonic(), 0
    for start in range(0, n, batch):
        rows = list(range(start, min(n, start + batch)))
        caches = {r: teacher.new_cache(L + 8) for r in rows}
        feed = {r: list(prompts[r][:L]) for r in rows}
        length = dict.fromkeys(rows, 0)
        while feed:
            active = list(feed)
            logits = teacher([caches[r] for r in active], [feed[r] for r in active], [len(feed[r]) for r in active])
            fed, feed = feed, {}
            for r, lg in zip(active, logits):
                lps = torch.log_softmax(lg.float(), -1)
                top = torch.topk(lps, K, dim=-1)
                s, e = length[r], length[r] + len(fed[r])
                ids[r, s:e], idx[r, s:e], logp[r, s:e] = fed[r], top.indices.numpy(), top.values.numpy()
                length[r] = e
                if e == L:
                    continue
                last = lps[-1]
                tok = int(last.argmax()) if r % 2 == 0 else int(torch.multinomial((last / 0.8).softmax(-1), 1))
                made += 1
                if tok in stop:
                    ids[r, e:], idx[r, e:, 0], logp[r, e:, 0], logp[r, e:, 1:] = tok, tok, 0.0, -np.inf
                else:
                    feed[r] = [tok]
        log(f"generated {rows[-1] + 1}/{n} sequences ({made / (time.monotonic() - t0):.0f} tokens/s)")
    return ids, idx, logp


def _cached_generation(key: bytes, make) -> tuple[np.ndarray, ...]:  # noqa: ANN001
    """``make()``'s (ids, idx, logp), generated once per ``key`` and kept in the cache folder."""
    folder = cache_dir() / "teacher" / hashlib.sha256(key).hexdigest()[:16]
    if (folder / "done").exists():
        return tuple(np.load(folder / f"{name}.npy") for name in ("ids", "idx", "logp"))
    folder.mkdir(parents=True, exist_ok=True)
    arrays = make()
    for name, arr in zip(("ids", "idx", "logp"), arrays):
        np.save(folder / f"{name}.npy", arr)
    (folder / "done").write_text("ok")
    return arrays


def generated_corpus(cfg: DistillConfig, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sequences the target writes from 32-token corpus snippets, with the teacher's top-K
    recorded as it generates: the draft learns the target's own style, which a corpus lacks."""
    n, prompt_len = cfg.generate_seqs, 32
    key = seqs.tobytes() + f"{Path(cfg.target).resolve()}|gen|{n}|{cfg.generate_len}|{cfg.teacher_top_k}|{cfg.seed}".encode()

    def make() -> tuple[np.ndarray, ...]:
        rng = np.random.default_rng(cfg.seed + 1)
        prompts = []
        for _ in range(n):
            src = seqs[rng.integers(len(seqs))]
            o = rng.integers(0, len(src) - prompt_len)
            prompts.append(src[o:o + prompt_len].tolist())
        return _generate(cfg, prompts, stop=set())

    return _cached_generation(key, make)


def code_requests(files: list[Path], n: int, seed: int) -> list[str]:
    """User requests for code, made from the corpus's documented public functions and classes
    (name, arguments, first docstring line), in a few phrasings."""
    phrasings = ["Write a Python {kind} `{sig}`: {doc}", "Implement `{sig}` in Python. {doc}",
                 "{doc} Write it as a Python {kind} named `{name}`.", "Show me a Python {kind} `{sig}`. {doc}"]
    rng = np.random.default_rng(seed + 2)
    found: list[str] = []
    for f in files:
        try:
            tree = ast.parse(f.read_text(errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            doc = (ast.get_docstring(node) or "").strip().split("\n")[0].strip()
            if len(doc) < 16:
                continue
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            args = "" if kind == "class" else ", ".join(a.arg for a in node.args.args if a.arg not in ("self", "cls"))
            sig = node.name if kind == "class" else f"{node.name}({args})"
            found.append(phrasings[len(found) % len(phrasings)].format(kind=kind, sig=sig, name=node.name, doc=doc))
        if len(found) >= 4 * n:
            break
    if not found:
        raise ValueError("no documented functions in the corpus to make code requests from")
    rng.shuffle(found)
    return [found[i % len(found)] for i in range(n)]


def chat_corpus(cfg: DistillConfig, codec: TextCodec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The target's answers to ``generate_chat`` code requests sent in its chat format, ending at
    its end-of-turn token: an instruct model is used this way, and answers unlike its corpus."""
    requests = code_requests(corpus_files(cfg.corpus), cfg.generate_chat, cfg.seed)
    prompts = [codec.encode(r, chat=True) for r in requests]
    stop = set(eos_token_ids(cfg.target, codec))
    key = json.dumps(prompts).encode() + f"{Path(cfg.target).resolve()}|chat|{cfg.generate_len}|{cfg.teacher_top_k}|{cfg.seed}".encode()
    return _cached_generation(key, lambda: _generate(cfg, prompts, stop))


def draft_config(cfg: DistillConfig, target: ModelConfig, target_raw: dict) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": target.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.hidden_size // cfg.heads, "max_position_embeddings": target.max_position_embeddings,
            "rms_norm_eps": 1e-5, "rope_theta": float(target.rope["rope_theta"]), "tie_word_embeddings": False,
            "bos_token_id": target_raw.get("bos_token_id"), "eos_token_id": target_raw.get("eos_token_id"),
            "draft_head_size": cfg.head_vocab or None, "draft_for": Path(cfg.target).name}


class Student(nn.Module):
    """Training-time view of the draft: the runtime's modules, run with full causal attention."""

    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        self.m = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from nebula_flow.models.llama import rotate, signed_sin

        cfg, m = self.m.cfg, self.m
        B, L = ids.shape
        x = m.model.embed_tokens(ids)
        freqs = torch.arange(L, dtype=torch.float32)[:, None] * m.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos()[None, :, None, :], signed_sin(emb.sin()[None, :, None, :])
        for layer in m.model.layers:
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(B, L, cfg.num_heads, cfg.head_dim)
            k = a.k_proj(h).view(B, L, cfg.num_kv_heads, cfg.head_dim)
            v = a.v_proj(h).view(B, L, cfg.num_kv_heads, cfg.head_dim)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=True)
            x = x + a.o_proj(o.transpose(1, 2).reshape(B, L, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return m.lm_head(m.model.norm(x))


def _head_vocab(seqs: np.ndarray, t_idx: np.ndarray, size: int, vocab: int, keep: list[int]) -> np.ndarray:
    """The ``size`` tokens the teacher most often ranks first or that the corpus uses most."""
    counts = np.bincount(t_idx[..., 0].ravel(), minlength=vocab) * 4 + np.bincount(seqs.ravel(), minlength=vocab)
    order = [t for t in keep if t is not None] + [int(t) for t in np.argsort(-counts, kind="stable")]
    seen, ids = set(), []
    for t in order:
        if t not in seen:
            seen.add(t)
            ids.append(t)
        if len(ids) == size:
            break
    return np.asarray(sorted(ids), dtype=np.int64)


def _loss(student: Student, ids: torch.Tensor, t_idx: torch.Tensor, t_lp: torch.Tensor, remap: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(student(ids).float(), -1)
    rows = remap[t_idx.long()]  # teacher token -> head row, -1 when outside the head
    inside = rows >= 0
    p = t_lp.float().exp() * inside
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    picked = torch.gather(logp, -1, rows.clamp_min(0))
    return -(p * picked).sum(-1).mean()


def train_draft(cfg: DistillConfig) -> dict:
    torch.manual_seed(cfg.seed)
    target_raw = json.loads((Path(cfg.target) / "config.json").read_text())
    tcfg = ModelConfig.from_dict(target_raw)
    cfg.check(tcfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    codec = TextCodec(cfg.target)
    seqs, corpus_info = tokenize_corpus(cfg, codec)
    log(f"corpus: {corpus_info['files_used']} files, {corpus_info['tokens']} tokens")
    t_idx, t_lp = teacher_cache(cfg, seqs)
    head = _head_vocab(seqs, t_idx, cfg.head_vocab or tcfg.vocab_size, tcfg.vocab_size,
                       [codec.eos_token_id, *tcfg.eos_token_ids])
    raw = draft_config(cfg, tcfg, target_raw)
    raw["draft_head_size"] = len(head) if cfg.head_vocab else None
    # Batches cycle through the sources: the corpus, the target's continuations, its chat answers.
    n_hold = max(2, len(seqs) // 50)  # the last sequences: held out
    sources = [(seqs, t_idx, t_lp, np.arange(len(seqs) - n_hold))]
    for arrays in (generated_corpus(cfg, seqs) if cfg.generate_seqs else None,
                   chat_corpus(cfg, codec) if cfg.generate_chat else None):
        if arrays is not None:
            sources.append((*arrays, np.arange(len(arrays[0]))))
    if cfg.init_from:  # fine-tune: keep the existing draft's shape and head
        base = load_model(cfg.init_from, inference=False)  # its state dict, by HF names
        raw = json.loads((Path(cfg.init_from) / "config.json").read_text())
        model = CausalLM(ModelConfig.from_dict(raw))
        model.load_state_dict(base.state_dict())
        if model.head_token_ids is not None:
            head = model.head_token_ids.numpy()
        log(f"fine-tuning {cfg.init_from}")
    else:
        model = CausalLM(ModelConfig.from_dict(raw))
        if model.head_token_ids is not None:
            model.head_token_ids.copy_(torch.from_numpy(head))
        _init_from_target(model, cfg.target, head)
    student = Student(model)
    remap = torch.full((tcfg.vocab_size,), -1, dtype=torch.long)
    remap[torch.from_numpy(head)] = torch.arange(len(head))
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
    step = 0
    ckpt = out / "checkpoint.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        student.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        log(f"resumed at step {step}")
    rng = np.random.default_rng(cfg.seed + step)
    t0, seen = time.monotonic(), 0
    student.train()
    while step < cfg.steps:
        lr = cfg.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        ids, s_idx, s_lp, pick = sources[step % len(sources)]
        b = np.sort(rng.choice(pick, min(cfg.batch_size, len(pick)), replace=False))
        loss = _loss(student, torch.from_numpy(ids[b]).long(), torch.from_numpy(s_idx[b]), torch.from_numpy(s_lp[b]),
                     remap)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        seen += cfg.batch_size * cfg.seq_len
        if step % 25 == 0 or step == cfg.steps:
            log(f"step {step}/{cfg.steps} loss {loss.item():.3f} lr {lr:.2e} "
                 f"{seen / (time.monotonic() - t0):.0f} tokens/s")
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            torch.save({"model": student.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt)
    student.eval()
    with torch.no_grad():
        hold = np.arange(len(seqs) - n_hold, len(seqs))
        held = float(np.mean([_loss(student, torch.from_numpy(seqs[i:i + 1]).long(), torch.from_numpy(t_idx[i:i + 1]),
                                    torch.from_numpy(t_lp[i:i + 1]), remap).item() for i in hold]))
    save_draft(model, raw, out, cfg.target)
    report = {"held_out_loss": held, "corpus": corpus_info, "config": asdict(cfg),
              "parameters": sum(p.numel() for p in model.parameters())}
    report["acceptance"] = evaluate_pair(cfg.target, str(out), cfg.eval_tokens, target_dtype=cfg.teacher_dtype)
    if codec.chat_template:
        report["acceptance_chat"] = evaluate_pair(cfg.target, str(out), cfg.eval_tokens,
                                                  target_dtype=cfg.teacher_dtype, chat=True)
    (out / "training.json").write_text(json.dumps(report, indent=2))
    ckpt.unlink(missing_ok=True)
    return report


def _init_from_target(model: CausalLM, target: str, head: np.ndarray) -> None:
    """Start the draft's embedding and head from a PCA projection of the target's embeddings."""
    from nebula_flow.models.loader import load_state_dict

    emb = load_state_dict(target)["model.embed_tokens.weight"].float()
    centered = emb - emb.mean(0, keepdim=True)
    _, _, v = torch.linalg.svd(centered[torch.randperm(len(emb))[:8192]], full_matrices=False)
    proj = centered @ v[: model.cfg.hidden_size].T
    proj = proj / proj.std() * 0.5
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(proj)
        rows = proj[torch.from_numpy(head)]
        model.lm_head.weight.copy_(rows / rows.norm(dim=1).mean())  # unit-scale logits at the start
        for name, p in model.named_parameters():
            if name.endswith(("proj.weight",)):
                p.normal_(0, 0.02)
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.mul_(1 / math.sqrt(2 * model.cfg.num_layers))


def save_draft(model: CausalLM, raw: dict, out: Path, target: str) -> None:
    """Write an ordinary checkpoint folder (bf16 weights keep the file small) plus the tokenizer."""
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    tgt = Path(target)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):
        if (tgt / name).exists():
            (out / name).write_bytes((tgt / name).read_bytes())
