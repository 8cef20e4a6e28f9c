"""A compact Llama-family decoder (Llama 2/3, Qwen2/2.5, Qwen3, Mistral, SmolLM).

One forward call takes a ragged batch: every sequence brings its own KV cache and its own
number of new tokens (the whole prompt for a prefill, 1 for a decode step, k+1 for a verify).
Projections and MLPs run once over all new tokens concatenated; attention runs once per layer for
the batch, reading every cache through one slot index of the model's KV arena (``models.batch``;
on CUDA through FlashAttention-2, ``models.flash``), or per sequence where that does not apply
(long prefills on a CPU, shared-file caches, batch-invariant numerics). Module names mirror
HuggingFace's so checkpoints load unchanged.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nebula_flow.kv.arena import CHUNK_BYTES, KVArena
from nebula_flow.kv.cache import PENDING, KVCache
from nebula_flow.models import flash, invariant, packed, probe_cache, staging
from nebula_flow.models.batch import Batch, GroupPlan, TreeRows, attention_mask
from nebula_flow.models.config import ModelConfig
from nebula_flow.models.flash import FlashPlan
from nebula_flow.models.rows import attend as attend_rows
from nebula_flow.models.rows import attention_rules


class Linear(nn.Linear):
    """``nn.Linear`` that may run on a packed weight (``packed``) and, in batch-invariant mode,
    in probed call sizes (see ``invariant``)."""

    row_plan: invariant.RowPlan | None = None
    packed: torch.Tensor | None = None  # the weight in the CPU kernel's layout (CausalLM.pack_weights)
    packed_from_rows = 1  # calls of fewer rows use the plain weight (fp32: faster there; see models.packed)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for the rows of ``x``, in one kernel call."""
        if self.packed is not None and x.shape[0] >= self.packed_from_rows:
            return packed.linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_plan is None:
            return self.product(x)
        return invariant.chunked_linear(x, self.product, self.row_plan)


def fused_linear(parts: list[Linear]) -> Linear:
    """One ``Linear`` computing ``parts`` side by side (their outputs concatenated)."""
    weight = torch.cat([p.weight for p in parts])
    with torch.device("meta"):
        fused = Linear(weight.shape[1], weight.shape[0], bias=parts[0].bias is not None)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one fused kernel (fp32 inside) for the eight below: a small model's GPU step is launch-bound
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 like the reference implementation, so bf16 runs agree with HF (and
        # every op runs row by row: batch-invariant on a CPU).
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse rotary frequencies, with linear, Llama-3 or YaRN scaling applied."""
    dim = cfg.head_dim
    theta = float(cfg.rope["rope_theta"])
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = cfg.rope["rope_type"]
    if kind == "linear":
        inv_freq = inv_freq / float(cfg.rope["factor"])
    elif kind == "llama3":
        factor = float(cfg.rope["factor"])
        low, high = float(cfg.rope["low_freq_factor"]), float(cfg.rope["high_freq_factor"])
        old_len = float(cfg.rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        inv_freq = _yarn_inv_freq(cfg, inv_freq)
    return inv_freq


def _yarn_inv_freq(cfg: ModelConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): frequencies interpolated by ``factor`` below the correction range,
    kept above it, ramped linearly within it, as transformers computes them."""
    p, dim = cfg.rope, cfg.head_dim
    base, old_len = float(p["rope_theta"]), float(p["original_max_position_embeddings"])
    factor = float(p.get("factor") or cfg.max_position_embeddings / old_len)
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001), 0, 1)
    keep = 1 - ramp  # (the share of the original frequency)
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_attention_scaling(cfg: ModelConfig) -> float:
    """The factor YaRN applies to cos and sin (1 for the other kinds)."""
    p = cfg.rope
    if p["rope_type"] != "yarn":
        return 1.0
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    factor = float(p.get("factor") or cfg.max_position_embeddings / float(p["original_max_position_embeddings"]))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if p.get("mscale") and p.get("mscale_all_dim"):
        return mscale(factor, float(p["mscale"])) / mscale(factor, float(p["mscale_all_dim"]))
    return mscale(factor)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` turned by the rotary embedding, ``sin`` in ``signed_sin``'s form. The reference's
    ``x * cos + rotate_half(x) * sin``, where ``rotate_half`` negates the second half and swaps the
    halves (two kernels on CUDA, where a small model's step is bound by its kernel count), becomes
    a roll with the sign carried by ``sin``: each product and the sum round as the reference's do
    (a negation is exact), so the bits are the reference's. (An ``addcmul`` would save one more
    kernel, but its fused rounding differed between a CUDA graph's replay and the eager step.)"""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """What ``rotate`` takes as ``sin``: its first half negated (made once per forward)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


class Attention(nn.Module):
    fused = False  # q, k and v come from one ``qkv_proj`` (``CausalLM.fuse_projections``)

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.window = cfg.window(layer)  # (Qwen2/Qwen3 slide in some layers only)
        hd = cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.num_heads * hd, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch) -> torch.Tensor:
        cfg, hd, heads = self.cfg, self.cfg.head_dim, self.cfg.num_heads
        T = x.shape[0]
        cos, sin = cos[:, None, :], sin[:, None, :]
        if self.fused:  # q and k side by side, normed and rotated in one go (each op runs once, not twice)
            qkv = self.qkv_proj(x).view(T, heads + 2 * cfg.num_kv_heads, hd)
            qk, v = qkv[:, :heads + cfg.num_kv_heads], qkv[:, heads + cfg.num_kv_heads:]
            if cfg.qk_norm:
                qk = self.qk_norm(qk)
            qk = rotate(qk, cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k, v = q.view(T, heads, hd), k.view(T, cfg.num_kv_heads, hd), v.view(T, cfg.num_kv_heads, hd)
            if cfg.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if batch.rows is not None:  # batch-invariant: each row its own problem (``models.rows``)
            return self.o_proj(attend_rows(batch.rows, self.layer, self.window, q, k, v))
        plans = batch.plans
        if len(plans) == 1 and plans[0].rows is None:  # (every sequence in one plan)
            return self.o_proj(self._attend(plans[0], q, k, v))
        out = q.new_empty(T, cfg.num_heads * hd)
        for plan in plans:
            out.index_copy_(0, plan.rows, self._attend(plan, q.index_select(0, plan.rows),
                                                       k.index_select(0, plan.rows), v.index_select(0, plan.rows)))
        for i in batch.apart:
            start, n = batch.starts[i], batch.lengths[i]
            rows = slice(start, start + n)
            out[rows] = self._alone(q[rows], k[rows], v[rows], batch.caches[i], batch.trees[i])
        return self.o_proj(out)

    def _attend(self, plan: GroupPlan | FlashPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention of a plan's rows: through FlashAttention or one masked SDPA."""
        if plan.flash:
            return flash.attend(plan, self.layer, self.window, q, k, v)
        return self._grouped(plan, q, k, v)

    def _grouped(self, plan: GroupPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of the grouped sequences' rows (``GroupPlan``), in one call: their new KV
        written into the arena, their keys gathered padded to the longest, one masked SDPA."""
        cfg, hd = self.cfg, self.cfg.head_dim
        rows = plan.chunk[:, self.layer]  # [slots, 2, kv_heads, head_dim]
        rows.index_copy_(0, plan.write, torch.stack((k, v), 1))
        kv = rows.index_select(0, plan.gather).view(plan.size, plan.keys, 2, cfg.num_kv_heads, hd)
        if plan.padded is not None:
            q = q.index_select(0, plan.padded)
        out = F.scaled_dot_product_attention(
            q.view(plan.size, plan.width, cfg.num_heads, hd).transpose(1, 2),
            kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2),
            attn_mask=plan.mask(self.window), enable_gqa=cfg.num_heads != cfg.num_kv_heads,
        )
        out = out.transpose(1, 2).reshape(plan.size * plan.width, cfg.num_heads * hd)
        return out if plan.real is None else out.index_select(0, plan.real)

    def _alone(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
               tree: TreeRows | None) -> torch.Tensor:
        """Attention of one sequence's ``n`` new rows against its own cache."""
        cfg = self.cfg
        n = q.shape[0]
        past = cache.length
        end = past + n
        cache.buf[past:end, self.layer, 0] = k
        cache.buf[past:end, self.layer, 1] = v
        keys, values = cache.layer_kv(self.layer, end)
        window = self.window if self.window and end > self.window else None
        mask, causal = None, False
        if past == 0 and window is None and tree is None:
            causal = n > 1
        elif n > 1 or window is not None:
            mask = attention_mask(past, n, window, q.device, tree)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys[None], values[None],
            attn_mask=mask, is_causal=causal, enable_gqa=cfg.num_heads != cfg.num_kv_heads,
        )
        return out[0].transpose(0, 1).reshape(n, cfg.num_heads * cfg.head_dim)


class MLP(nn.Module):
    fused = False  # gate and up come from one ``gate_up_proj`` (``CausalLM.fuse_projections``)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, batch):  # noqa: ANN001, ANN201 - internal
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


def embedding(num: int, dim: int) -> nn.Embedding:
    """``nn.Embedding``, N(0, 1) as torch initialises it, but left empty on the meta device (a loaded
    checkpoint replaces it), where torch's initialisation imports ``torch._dynamo``: 1.2-1.5 s a worker."""
    weight = torch.empty(num, dim)
    return nn.Embedding(num, dim, _weight=weight if weight.is_meta else nn.init.normal_(weight))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Decoder plus output head. ``forward`` advances every cache by its new tokens."""

    batch_invariant = False
    run_block: int | None = None  # a batch-invariant model's runs' query blocks (``models.rows``)
    attention_dtype = torch.float32  # and the dtype its rows attend in
    kv_arena: KVArena | None = None  # every cache of this model is a range of it (made with the first)
    group_attention = True  # one attention call per layer for the batch (``models.batch``); False: per sequence
    flash_attention: bool | None = None  # through FlashAttention-2 (``models.flash``); None: where it runs
    packed_layers = 0  # linear layers running on packed weights (``pack_weights``)
    weights_released = False  # the plain copies of packed weights were dropped (bf16)
    packed_from_rows: dict[str, int] = {}  # weight shape -> the fewest rows run on its packed copy
    step_graphs = None  # models.graphs.StepGraphs: decode steps and verify blocks replayed from CUDA graphs (GPUs)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.draft_head_size or cfg.vocab_size, bias=False)
        with torch.device("cpu"):  # (on the meta device this arithmetic, too, would import torch._dynamo)
            inv_freq = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)
        self.rope_scaling = rope_attention_scaling(cfg)
        self.windows = {cfg.window(i) for i in range(cfg.num_layers)}  # (the layers' attention windows)
        head_ids = torch.zeros(cfg.draft_head_size, dtype=torch.long) if cfg.draft_head_size else None
        self.register_buffer("head_token_ids", head_ids)  # None (not saved) for an ordinary model

    def fuse_projections(self) -> None:
        """For inference: each layer's q, k and v projections become one matmul, gate and up
        another (measured on the bundled target on a CPU: a decode step 50.2 -> 47.3 ms, fewer
        and larger calls). The module names then differ from HF's: training and checkpoint I/O
        use an unfused model. Qwen3's q and k norms become one (``qk_norm``), over both's heads."""
        for layer in self.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            a.qkv_proj = fused_linear([a.q_proj, a.k_proj, a.v_proj])
            del a.q_proj, a.k_proj, a.v_proj
            if self.cfg.qk_norm:  # one norm over q's and k's heads: each head's row keeps its own weight
                a.qk_norm = RMSNorm(self.cfg.head_dim, self.cfg.rms_norm_eps)
                a.qk_norm.weight = nn.Parameter(torch.cat([a.q_norm.weight.expand(self.cfg.num_heads, -1),
                                                           a.k_norm.weight.expand(self.cfg.num_kv_heads, -1)]),
                                                requires_grad=False)
                del a.q_norm, a.k_norm
            mlp.gate_up_proj = fused_linear([mlp.gate_proj, mlp.up_proj])
            del mlp.gate_proj, mlp.up_proj
            a.fused = mlp.fused = True

    def pack_weights(self) -> int:
        """For inference on a CPU: linear layers run on a weight packed once into the kernel's
        layout (``models.packed``): in bf16 always, and the plain copy is released (a head tied to
        the embedding keeps the embedding's); in fp32 from the fewest rows where the packed kernel
        is faster (timed once per weight shape), beside the plain copy. Returns how many layers
        were packed."""
        count, from_rows = 0, {}
        for m in self.modules():
            if isinstance(m, Linear) and m.packed is None and (weight := packed.pack(m.weight)) is not None:
                key = (*m.weight.shape, m.weight.dtype)
                if key not in from_rows:
                    from_rows[key] = packed.first_faster_rows(m.weight, weight)
                if from_rows[key] is None:
                    continue
                m.packed, m.packed_from_rows = weight, from_rows[key]
                count += 1
                if m.packed_from_rows == 1:  # keep shape, dtype and device for the probes and callers; drop the bytes
                    m.weight = nn.Parameter(m.weight.detach().new_zeros(1).expand(m.weight.shape), requires_grad=False)
                    self.weights_released = True
        self.packed_layers += count
        self.packed_from_rows = {"x".join(map(str, k[:2])): v for k, v in from_rows.items() if v is not None}
        return count

    def state_dict(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - nn.Module's signature
        if self.weights_released:  # its linear weights were released: refuse rather than return zeros
            raise RuntimeError("this model's weights are packed for inference; load it with "
                               "load_model(..., inference=False) to read or save its state dict")
        return super().state_dict(*args, **kwargs)

    def make_batch_invariant(self) -> dict:
        """Switch to batch-invariant numerics (``invariant``): a position's logits get the same
        bits whatever it is batched with. Returns what the kernel probe decided."""
        plans: dict[tuple, invariant.RowPlan] = {}  # (weight shape, packed) -> its probed call sizes
        for m in self.modules():
            if isinstance(m, Linear):
                key = (*m.weight.shape, m.packed is not None)
                if key not in plans:  # (probed once per kernel and shape on this machine: ``probe_cache``)
                    inputs = {"shape": list(m.weight.shape), "dtype": str(m.weight.dtype), "packed": key[2],
                              "packed_from_rows": m.packed_from_rows, "bias": m.bias is not None}
                    plans[key] = invariant.RowPlan(**probe_cache.remember(
                        "row_plan", inputs, m.weight.device, lambda m=m: asdict(invariant.row_plan(m.weight, m.product))))
                m.row_plan = plans[key]
        self.batch_invariant = True
        cfg = self.cfg
        weight = self.lm_head.weight
        self.attention_dtype, self.run_block = attention_rules(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                                               str(weight.device), weight.dtype)
        self.invariance = {"attention": ("row by row" if self.run_block is None else
                                         f"prefills and verify blocks as matrix products, query blocks of >= {self.run_block} rows")
                           + f", in {str(self.attention_dtype).removeprefix('torch.')}",
                           "linears": {"x".join(map(str, s[:2])) + (" packed" if s[2] else ""): f"<= {p.chunk} rows" + (
            f", above {p.exact} padded to a multiple of {p.multiple}" if p.multiple > 1 else "")
            for s, p in sorted(plans.items())}}
        return self.invariance

    def token_ids(self, head_rows: torch.Tensor) -> torch.Tensor:
        """Map output-head rows to token ids (identity unless the head covers a subset)."""
        return head_rows if self.head_token_ids is None else self.head_token_ids[head_rows.long()]

    def runtime_status(self) -> dict[str, Any]:
        """How this model runs, for a worker's status: its numerics, the layers on packed weights
        (``models.packed``; weight shape -> fewest rows on the packed kernel) and its CUDA graphs."""
        out: dict[str, Any] = {"numerics": str(self.lm_head.weight.dtype).removeprefix("torch.")
                               + (" batch-invariant" if self.batch_invariant else ""),
                               "packed_layers": self.packed_layers}
        if self.packed_from_rows:
            out["packed_from_rows"] = self.packed_from_rows
        out["attention"] = "flash-attention-2" if self.uses_flash() else "sdpa"
        if self.step_graphs is not None:
            out["cuda_graphs"] = self.step_graphs.status()
        return out

    @property
    def prompt_blocks(self) -> bool:
        """Whether it computes prompt positions in aligned blocks, the rest alone (``rows.BlockCall``)."""
        return self.batch_invariant and self.run_block is None

    def uses_flash(self) -> bool:
        """Whether this model's grouped chains attend through FlashAttention-2 (``models.flash``;
        a batch-invariant model's rows attend as problems of their own, ``models.rows``)."""
        if self.flash_attention is None:
            p = self.lm_head.weight
            self.flash_attention = flash.usable(p.device, p.dtype, self.cfg.head_dim)
        return self.flash_attention and not self.batch_invariant

    def make_kv_arena(self, max_bytes: int = CHUNK_BYTES) -> None:
        """This model's caches from now on come from one arena of ``max_bytes`` (the worker's KV
        budget; ``kv/arena.py``)."""
        p, cfg = self.lm_head.weight, self.cfg
        self.kv_arena = KVArena((cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim), p.dtype, p.device, max_bytes)

    def new_cache(self, capacity: int = 64) -> KVCache:
        """An empty cache for one request: a range of this model's arena (``kv/arena.py``)."""
        if self.kv_arena is None:
            self.make_kv_arena()
        cfg = self.cfg
        return KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity=capacity, arena=self.kv_arena)

    def compute(self, ids: torch.Tensor, positions: torch.Tensor, batch: Batch, rows: torch.Tensor | None) -> torch.Tensor:
        """The tensor work of a forward (no host reads, no shapes from data: a CUDA graph can hold
        it, ``models.graphs``): fp32 logits of the new tokens' ``rows`` (None: all of them)."""
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.model.embed_tokens(ids)
        if self.rope_scaling != 1.0:
            emb_cos, emb_sin = emb.cos() * self.rope_scaling, emb.sin() * self.rope_scaling
        else:
            emb_cos, emb_sin = emb.cos(), emb.sin()
        cos, sin = emb_cos.to(x.dtype), signed_sin(emb_sin.to(x.dtype))  # (``rotate``'s form of sin)
        for layer in self.model.layers:
            x = layer(x, cos, sin, batch)
        return self.lm_head(self.model.norm(x if rows is None else x[rows])).float()

    @staticmethod
    def _record(caches: list[KVCache], new_tokens: list[list[int]] | torch.Tensor) -> None:
        """The caches now hold the new tokens' KV (``PENDING`` for tokens fed from the device)."""
        for cache, seq in zip(caches, [[PENDING]] * len(caches) if isinstance(new_tokens, torch.Tensor) else new_tokens):
            cache.tokens.extend(seq)

    @torch.inference_mode()
    def forward(
        self, caches: list[KVCache], new_tokens: list[list[int]] | torch.Tensor, logit_rows: list[int],
        parents: list[list[int] | None] | None = None,
    ) -> list[torch.Tensor]:
        """Run one ragged step.

        ``new_tokens[i]`` are appended to ``caches[i]``: a list of token ids each, or one tensor on
        the model's device with one token per sequence (a draft step fed the step before's picks
        without reading them on the host; the caches record ``PENDING`` until ``KVCache.settle``).
        The result holds, for sequence i,
        fp32 logits of its last ``logit_rows[i]`` new positions (0 = none). Only those rows go
        through the output head, which dominates the cost for large vocabularies. Logit column j
        scores token ``token_ids(j)``.

        ``parents[i]`` (None: a chain) makes sequence i's new tokens a token tree: new token j
        follows new token ``parents[i][j]`` (-1: the last cached one), sits at that one's position
        plus one and sees only its own path (``TreeRows``). Every token's KV is stored in the
        order given; the caller keeps one path of it (``KVCache.adopt``).
        """
        device = self.lm_head.weight.device
        on_device = isinstance(new_tokens, torch.Tensor)
        lengths = [1] * len(caches) if on_device else [len(t) for t in new_tokens]
        for cache, n in zip(caches, lengths):
            cache.await_rows()
            cache.reserve(cache.length + n)
        if self.step_graphs is not None and (
                logits := self.step_graphs.step(caches, lengths, logit_rows, new_tokens, parents)) is not None:
            self._record(caches, new_tokens)
            return list(torch.split(logits, logit_rows))
        batch = Batch(caches, lengths, parents, device, group=self.group_attention,
                      invariant_windows=self.windows if self.batch_invariant else None, flash=self.uses_flash(),
                      invariant_block=self.run_block, invariant_dtype=self.attention_dtype)
        ids = new_tokens.long() if on_device else staging.tensor([t for seq in new_tokens for t in seq], device, torch.long)
        # (positions and the picked rows made in Python, one tensor each: a few ops per sequence saved)
        positions = [c.length + d for c, n, tree in zip(caches, lengths, batch.trees)
                     for d in (range(n) if tree is None else tree.depth)]
        rows = [start + n - want + r for start, n, want in zip(batch.starts, lengths, logit_rows) for r in range(want)]
        logits = self.compute(ids, staging.tensor(positions, device, torch.float32), batch, staging.tensor(rows, device, torch.long))
        self._record(caches, new_tokens)
        return list(torch.split(logits, logit_rows))
