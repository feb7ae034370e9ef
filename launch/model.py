"""Qwen3.5 (MoE and dense) / Qwen3-Next / Qwen3-MoE / Qwen2-MoE / OLMoE / ERNIE-4.5 / MiniMax-M2 / Mixtral /
DeepSeek-V2 and V3 / GLM-4.5 / gpt-oss / Llama 4 / Granite MoE / Hunyuan-A13B / Gemma 4 MoE and dense Llama-family
text stacks, built from a `recipe.models.ModelShape`.

Shape legend: T tokens (one packed sequence: several documents back to back), D model dim, Hq query heads, Hkv
key/value heads, Dh attention head dim, R rotary dims, V vocabulary.

A batch is one packed sequence. Document boundaries are carried by `Packing`: positions restart at 0 at each
document's first token; attention runs causally inside each document only; the linear-attention conv and recurrent
state reset at each document start. The model is architecture only: no collectives, no recompute (applied from
outside, launch/recompute.py), no loss (launch/rl.py); context parallelism is a `context_parallel` attribute on the
mixers, installed from outside (launch/context_parallel.py), and `Packing.cp` marks a micro-batch shard. Module and
parameter names follow Hugging Face's, so a state dict maps one to one (launch/hf_io.py).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.expert_grads import GEGLU_TANH, GPT_OSS_GLU, SWIGLU, clamped_swiglu
from kernels.gdn_fused import causal_conv1d_silu, gated_rms_norm
from kernels.rope import rope as apply_rope
from kernels.rms_norm import rms_norm
from launch.gated_delta import gated_delta_rule
from launch.moe import GatedMLP, MoE
from launch.sink_attention import sink_attention
from launch.sparse_attention import index_topk, sparse_latent_attention
from recipe.models import QKV_ONLY_BIAS_ARCHS, ROPE_SCALINGS, ModelShape, trainable

# RMSNorm scales by (1 + w) in these (w stored zero-centred), by w elsewhere
OFFSET_NORM_ARCHS = ("qwen3_5_moe", "qwen3_next", "qwen3_5")
# attention with a learned sink logit per head, sliding windows on the "sliding_attention" layers, a biased router
# and biased experts with the clamped GLU (kernels.expert_grads.GPT_OSS_GLU)
GPT_OSS_ARCHS = ("gpt_oss",)
# per-head q/k RMSNorms after RoPE, not before (Hunyuan-A13B)
QK_NORM_AFTER_ROPE_ARCHS = ("hunyuan_moe",)
# the router's top-k logits through a sigmoid weight the routed experts' input, not their output (Llama 4)
INPUT_WEIGHTED_ARCHS = ("llama4",)
# the router with a correction bias (sigmoid_router) scoring the experts by a softmax, not a sigmoid (ERNIE-4.5)
SOFTMAX_SCORE_ARCHS = ("ernie4_5_moe",)
# attention rotating channel pairs (0, 1), (2, 3), … (GLM-style RoPE), not the two halves of a head (ERNIE-4.5,
# Llama 4)
INTERLEAVED_ROPE_ARCHS = ("ernie4_5_moe", "llama4")
# Gemma 4's blocks: values at unit RMS (no weight); the FFN a dense GeGLU MLP beside GeGLU experts, each side normed
# before and after apart, the router on the block's input through a scaled norm; each layer's output times a scalar
# (a buffer of its checkpoint's); the embedding's scale rounded to its dtype
GEMMA4_TYPES = ("gemma4_text",)
# the Gemma families' GeGLU MLPs (the tanh GELU) and embedding scale rounded to the embedding's dtype (Gemma 3 too)
GEMMA_TYPES = ("gemma4_text", "gemma3_text", "gemma")


class Handoff:
    """What one layer leaves for a later one within a micro-batch (DeepSeek sparse attention's selections, by layer):
    a plain object, so that FSDP2's casting of the layers' inputs, which rebuilds dataclasses and dicts, hands this
    very instance to every layer."""

    def __init__(self):
        self.values: dict = {}


@dataclass(frozen=True)
class Packing:
    """Document layout of one packed sequence."""

    positions: torch.Tensor  # [T] int64, restarting at 0 per document
    cu_seqlens: torch.Tensor  # [num_docs + 1] int32 on the device
    doc_lengths: tuple[int, ...]  # host copy (attention loops over documents)
    # a context-parallel shard (launch.context_parallel.ContextShard): these T tokens are this rank's two zigzag
    # segments of a longer micro-batch, `doc_lengths` their runs of one document; None: the whole micro-batch
    cp: object | None = None
    _derived: dict = field(default_factory=dict, compare=False, repr=False)  # `chunked`'s, made once a batch
    handoff: Handoff = field(default_factory=Handoff, compare=False, repr=False)

    @staticmethod
    def from_lengths(doc_lengths: list[int] | tuple[int, ...], device: torch.device | str = "cpu") -> "Packing":
        if not doc_lengths or min(doc_lengths) <= 0:
            raise ValueError(f"document lengths must be positive, got {list(doc_lengths)}")
        lengths = torch.tensor(doc_lengths, dtype=torch.int64)
        cu = torch.zeros(len(doc_lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lengths, 0)
        starts = torch.repeat_interleave(cu[:-1].long(), lengths)
        positions = torch.arange(int(cu[-1])) - starts
        return Packing(positions.to(device), cu.to(device), tuple(int(n) for n in doc_lengths))

    @property
    def num_tokens(self) -> int:
        return sum(self.doc_lengths)

    def chunked(self, chunk: int) -> "Packing":
        """The layout chunked attention sees (Llama 4's): every document cut into runs of `chunk` positions from
        its start, each run a document of its own. Made once per batch and kept (every chunked layer asks). A
        context-parallel shard's runs are cut on the whole micro-batch's positions (`ContextShard.chunked`)."""
        hit = self._derived.get(chunk)
        if hit is None:
            if self.cp is not None:
                hit = replace(self, cp=self.cp.chunked(chunk), _derived={})
            else:
                runs = [min(chunk, n - s) for n in self.doc_lengths for s in range(0, n, chunk)]
                hit = Packing.from_lengths(runs, self.positions.device)
            self._derived[chunk] = hit
        return hit


class RMSNorm(nn.Module):
    """RMSNorm in fp32. Qwen3.5/Qwen3-Next scale by (1 + w) with w initialized at 0 (`offset=1`); Qwen3-MoE by w
    (kernels.rms_norm: one fused Triton kernel each way on GPU, the torch path on CPU; x alone kept for the
    backward)."""

    def __init__(self, dim: int, eps: float, offset: float):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.backend = "auto"  # auto | torch | triton (kernels/rms_norm.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset, backend=self.backend)


class LayerNorm(nn.Module):
    """Cohere's LayerNorm: each row centred and scaled to unit variance in fp32, times a weight (no bias)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), None, self.eps).to(x.dtype)


class GateMLP(nn.Module):
    """A gated norm's low-rank gate logits: fc2(silu(fc1(y)))."""

    def __init__(self, dim: int, rank: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, rank, bias=False)
        self.fc2 = nn.Linear(rank, dim, bias=False)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(y)))


class GatedNorm(nn.Module):
    """A.X K2's block norm: y = RMSNorm(x), then y · σ(gate(y)) with a low-rank gate (`GateMLP`), the sigmoid in fp32
    and the product rounded to y's dtype (transformers' AXK2GatedRMSNorm)."""

    def __init__(self, dim: int, rank: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(dim, eps, 0.0)
        self.mlp = GateMLP(dim, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return (y * torch.sigmoid(self.mlp(y).float())).to(y.dtype)


def block_norm(s: ModelShape, norm_offset: float, gated: bool = False) -> nn.Module:
    """A norm of the decoder blocks (and the final one): the shape's norm_kind; `gated` (A.X K2's input norms, and
    its MoE layers' FFN norms, where `gated_norm_rank` is set) a GatedNorm."""
    if gated and s.gated_norm_rank:
        return GatedNorm(s.hidden_size, s.gated_norm_rank, s.rms_norm_eps)
    if s.norm_kind == "layer":
        return LayerNorm(s.hidden_size, s.rms_norm_eps)
    return RMSNorm(s.hidden_size, s.rms_norm_eps, norm_offset)


class HeadsRMSNorm(nn.Module):
    """RMSNorm over all heads' channels of a token together (OLMoE's q/k norms: one weight per channel of the
    projection, the mean square taken over its whole width `dim`), in OLMoE's order: fp32 inside, then the weight
    times the normalized x in x's dtype. Under tensor parallelism a rank holds some of the heads: `sum_over_ranks`
    (launch/tensor_parallel.py installs it; None: every head is here) adds the other ranks' sums of squares, and
    the backward's Σ dn ⊙ n is added over them the same way (kernels.rms_norm's torch path, which takes the callable;
    the fused kernels where the whole width is here)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.sum_over_ranks = None
        self.backend = "auto"  # auto | torch | triton (kernels/rms_norm.py)

    def forward(self, x_THD: torch.Tensor) -> torch.Tensor:
        x = x_THD.reshape(x_THD.shape[0], -1)
        return rms_norm(x, self.weight, self.eps, 0.0, sum_over_ranks=self.sum_over_ranks, width=self.dim,
                        backend=self.backend).view_as(x_THD)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head's channels, then a SiLU gate (Gated DeltaNet's output norm). fp32 inside; the
    normalized x is cast to x's dtype before the weight multiplies it (kernels.gdn_fused: one fused Triton kernel
    on GPU, the torch reference on CPU)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.backend = "auto"  # auto | torch | triton (kernels/gdn_fused.py)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps, backend=self.backend)


def proportional_rope(s: ModelShape, kind: str) -> bool:
    """Whether a `kind` layer's RoPE is Gemma 4's proportional form (`ModelShape.rope_proportional`: its full
    layers)."""
    return s.rope_proportional and kind != "sliding_attention"


def rotary_dim(s: ModelShape, kind: str = "full_attention") -> int:
    """Channels of a head that RoPE's cos and sin span on a `kind` layer: the MLA rope part, or the layer's head
    width × its rotated share (`ModelShape.rotary_factor_at`); under proportional RoPE the whole head width (the
    unrotated pairs at frequency 0: cos 1, sin 0)."""
    if s.mla is not None:
        return s.mla.qk_rope_head_dim
    width = s.head_dim_at(kind)
    return width if proportional_rope(s, kind) else int(width * s.rotary_factor_at(kind))


def _mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def rope_frequencies(s: ModelShape, device=None, kind: str = "full_attention") -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies [R/2] and the factor cos/sin are scaled by, for the shape's RoPE scaling (none,
    linear, llama3 or YaRN; docs/training.md "RoPE scaling" derives the YaRN and llama3 bands), for a `kind` layer:
    its RoPE base (`ModelShape.rope_theta_at`) over its rotated channels (`rotary_dim`), Step-3.7's sliding layers
    unscaled (`ModelShape.sliding_rope_plain`); Gemma 4's proportional RoPE: pair i < share · D/2 at base^(-2i/D),
    the others 0 (D the head width: the share's frequencies spaced over the whole head, not the share)."""
    dim = rotary_dim(s, kind)
    theta = s.rope_theta_at(kind)
    if proportional_rope(s, kind):  # the share's pairs spaced as the whole head's would be, the rest still
        rotated = int(s.rotary_factor_at(kind) * dim // 2)
        inv = 1.0 / (theta ** (torch.arange(0, 2 * rotated, 2, device=device, dtype=torch.float32) / dim))
        return torch.cat([inv, inv.new_zeros(dim // 2 - rotated)]), 1.0
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    sc = None if kind == "sliding_attention" and s.sliding_rope_plain else s.rope_scaling
    if sc is None:
        return inv, 1.0
    if sc.kind == "linear":
        return inv / sc.factor, 1.0
    if sc.kind == "dynamic" and sc.alpha is not None:  # Hunyuan's NTK-alpha: the base stretched, at every length
        base = theta * sc.alpha ** (dim / (dim - 2))
        return 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)), 1.0
    if sc.kind == "llama3":
        low, high = sc.low_freq_factor or 1.0, sc.high_freq_factor or 4.0
        wavelen = 2 * math.pi / inv
        ctx = sc.original_max_position
        # long wavelengths (beyond ctx / low) slowed by the factor, short ones (below ctx / high) kept, a linear blend
        # in ctx / wavelength between
        slowed = torch.where(wavelen > ctx / low, inv / sc.factor, inv)
        blend = (ctx / wavelen - low) / (high - low)
        middle = (wavelen <= ctx / low) & (wavelen >= ctx / high)
        return torch.where(middle, (1 - blend) * slowed / sc.factor + blend * slowed, slowed), 1.0
    if sc.kind == "yarn":
        f, ctx = sc.factor, sc.original_max_position
        if sc.attention_factor is not None:
            attn = sc.attention_factor
        elif sc.mscale and sc.mscale_all_dim:
            attn = _mscale(f, sc.mscale) / _mscale(f, sc.mscale_all_dim)
        else:
            attn = _mscale(f)

        def channel(rotations: float) -> float:  # the pair index whose wavelength fits `rotations` times in ctx
            return dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = channel(sc.beta_fast or 32.0), channel(sc.beta_slow or 1.0)
        if sc.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        # 1 for pairs that rotate fast (kept), 0 for slow ones (interpolated), a linear ramp between
        keep = 1 - ((torch.arange(dim // 2, device=device, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        return inv / f * (1 - keep) + inv * keep, attn
    raise ValueError(f"RoPE scaling {sc.kind!r} is not applied by this core ({', '.join(ROPE_SCALINGS)})")


def softmax_scale(s: ModelShape) -> float:
    """Attention's softmax scale: 1/√(q·k head dim); MLA under YaRN with mscale_all_dim also multiplies it by
    mscale(factor, mscale_all_dim)², as DeepSeek-V3 does; Granite's `attention` multiplier in its place; Step-3.7's
    1/√query_pre_attn_scalar where it sets one."""
    if s.granite is not None:
        return s.granite.attention
    if s.query_pre_attn_scalar is not None:
        return s.query_pre_attn_scalar ** -0.5
    scale = (s.mla.qk_nope_head_dim + s.mla.qk_rope_head_dim if s.mla is not None else s.head_dim) ** -0.5
    sc = s.rope_scaling
    if s.mla is not None and sc is not None and sc.kind == "yarn" and sc.mscale_all_dim:
        scale *= _mscale(sc.factor, sc.mscale_all_dim) ** 2
    return scale


def logits_divisor(s: ModelShape) -> float:
    """What the model divides its logits by before the softmax (Granite's `logits` scaling, Cohere's 1/logit_scale;
    1 elsewhere): the trainer folds it into the head's temperature (launch/train.py), so the fused head applies it
    inside its kernels."""
    return (s.granite.logits if s.granite is not None else 1.0) / s.logit_scale


class ScaledEmbedding(nn.Embedding):
    """nn.Embedding whose rows come out times `scale` (Granite's embedding multiplier, AFMoE's and Gemma's
    √hidden_size; 1 elsewhere). Parameter names and the padding row are nn.Embedding's; tensor parallelism's hooks
    see the scaled rows (a linear map)."""

    def __init__(self, *args, scale: float = 1.0, round_scale: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = scale
        self.round_scale = round_scale  # Gemma's: the scale itself rounded to the rows' dtype first

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(ids)
        if self.scale == 1.0:
            return out
        return out * (torch.tensor(self.scale, dtype=out.dtype) if self.round_scale else self.scale)


def rope_cos_sin(positions_T: torch.Tensor, s: ModelShape, dtype: torch.dtype, kind: str = "full_attention"):
    """cos and sin [T, R] of each token's position (R = rotary_dim(s), the pair angles repeated twice) for a `kind`
    layer (its RoPE base: `ModelShape.rope_theta_at`)."""
    inv_freq, attn = rope_frequencies(s, positions_T.device, kind)
    freqs_TR2 = positions_T.float()[:, None] * inv_freq[None]
    emb_TR = torch.cat([freqs_TR2, freqs_TR2], dim=-1)
    return (emb_TR.cos() * attn).to(dtype), (emb_TR.sin() * attn).to(dtype)


def layer_ropes(positions_T: torch.Tensor, s: ModelShape, dtype: torch.dtype) -> dict[str, tuple]:
    """The decoder layers' cos and sin: "main" for every layer, and "sliding_attention" for the sliding layers where
    they rotate at a base or over a share of their own, or without the RoPE scaling (MiMo-V2-Flash, Step-3.7);
    `DecoderLayer.forward` takes its layer's."""
    ropes = {"main": rope_cos_sin(positions_T, s, dtype)}
    if (s.sliding_rope_theta or s.sliding_rotary_factor or s.sliding_rope_plain) and s.num_sliding_layers:
        ropes["sliding_attention"] = rope_cos_sin(positions_T, s, dtype, "sliding_attention")
    return ropes


def sdpa_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """K/V as SDPA should take them for queries q ([1, Hq, Tq, Dh]; K/V [1, Hkv, Tk, Dh]), and whether to pass
    `enable_gqa`. GQA inside SDPA (each K/V head serves its group of query heads) keeps no K/V copied to the query
    heads' count for the backward: on CPU (the math path) and where SDPA's flash kernel takes the shapes as they are
    (checked with `torch.backends.cuda.can_use_flash_attention`), or, for values narrower than q·k (which the flash
    kernel never takes), cuDNN's. Elsewhere on a GPU (no such kernel for the dtype, head size or platform) K/V are
    repeated to the query heads, so the memory-efficient kernel can run instead of the math path, which would
    materialize the [Tq, Tk] scores."""
    if q.shape[1] == k.shape[1]:
        return k, v, False
    # asked without the causal flag: the kernel takes lower-right causal masks (`causal_lower_right`, the CP path's
    # pieces) where the flag would refuse queries shorter than the keys
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, True) if q.is_cuda else None
    if not q.is_cuda or torch.backends.cuda.can_use_flash_attention(params) or (
            v.shape[-1] < q.shape[-1] and torch.backends.cuda.can_use_cudnn_attention(params)):
        return k, v, True
    rep = q.shape[1] // k.shape[1]
    return k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), False


def causal_attention(q_THD, k_THD, v_THD, packing: Packing, scale: float) -> torch.Tensor:
    """Causal SDPA inside each document, GQA inside SDPA where it can run there (`sdpa_kv`). Returns [T, Hq, Dh]."""
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q_THD, k_THD, v_THD))  # [1, H, T, Dh]
    k, v, gqa = sdpa_kv(q, k, v)
    if len(packing.doc_lengths) == 1:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    elif not q.is_cuda and packing.num_tokens <= 4096:
        doc = torch.repeat_interleave(torch.arange(len(packing.doc_lengths), device=q.device),
                                      torch.tensor(packing.doc_lengths, device=q.device))
        pos = packing.positions
        mask_TT = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_TT, scale=scale, enable_gqa=gqa)
    else:  # one flash call per document
        outs, start = [], 0
        for n in packing.doc_lengths:
            sl = slice(start, start + n)
            outs.append(F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True,
                                                       scale=scale, enable_gqa=gqa))
            start += n
        o = torch.cat(outs, dim=2)
    return o.squeeze(0).transpose(0, 1)


def unit_rms(x: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    """Each row of the last dimension scaled to unit RMS in fp32, then rounded to x's dtype (Llama 4's q/k norm, no
    weight): kernels.rms_norm with a weight of ones, whose w ⊙ round(n) is round(n) exactly (one fused kernel each
    way on GPU; the weight takes no gradient)."""
    return rms_norm(x, x.new_ones(x.shape[-1]), eps, 0.0, backend=backend)


def query_temperature(positions_T: torch.Tensor, floor_scale: float, attn_scale: float,
                      shift: float = 1.0) -> torch.Tensor:
    """A query scale that grows with the log of the position p in its document: 1 + attn_scale · log(1 + ⌊(p +
    shift) / floor_scale⌋), fp32 [T, 1, 1]. Llama 4's on its RoPE-free layers (shift 1: 1 for the first
    floor_scale − 1 positions of a document); Mistral 4's on every layer (shift 0, `ModelShape.query_scale_period`
    and `query_scale_beta`: 1 for the first period positions)."""
    return (torch.log1p(torch.floor((positions_T.float() + shift) / floor_scale)) * attn_scale + 1.0).view(-1, 1, 1)


class Attention(nn.Module):
    """GQA with per-head q/k RMSNorm (OLMoE: over all heads together, HeadsRMSNorm, and optionally q, k and v
    clamped; Hunyuan: after RoPE), partial RoPE and (Qwen3.5/Qwen3-Next) a sigmoid output gate per channel;
    gpt-oss: a learned sink logit per head (`sinks`) and, on its sliding layers, a `window` (both through
    launch/sink_attention.py); Llama 4: on its `chunk` layers RoPE, then q and k heads at unit RMS (`unit_rms`,
    where its qk_norm is on), each query attending within its chunk of the document; on its others no RoPE, the
    queries scaled by `query_temperature` (where temperature tuning is on), global attention; Step-3.7: a layer's
    own query heads (`ModelShape.heads_at`) and a sigmoid (Laguna: softplus) gate per head from `g_proj`; Gemma 4: a
    layer's own head width (`ModelShape.head_dim_at`), values at unit RMS, and on its full layers the values the
    keys' projection before their norm (`ModelShape.keys_as_values`: no v_proj)."""

    def __init__(self, s: ModelShape, norm_offset: float, window: int | None = None, chunk: int | None = None,
                 index: int = 0):
        super().__init__()
        kind = "sliding_attention" if window is not None else "chunked_attention" if chunk is not None \
            else "full_attention"
        self.num_heads, self.num_kv_heads, self.head_dim = s.heads_at(kind), s.kv_heads_at(kind), s.head_dim_at(kind)
        heads, head_dim = self.num_heads, self.head_dim
        # MiMo-V2-Flash: value heads narrower than the query/key heads, at their own width where cuDNN's kernel takes
        # the layer (full attention without sinks), else zero-padded to the q·k head size for the kernels (which take
        # one head size) and cut back after; the values scaled before attention
        self.value_dim, self.value_scale = s.value_width_at(kind), s.value_scale
        self.output_gate = s.attn_output_gate
        q_out = heads * head_dim * (2 if s.attn_output_gate else 1)
        self.q_proj = nn.Linear(s.hidden_size, q_out, bias=s.attn_bias)
        self.k_proj = nn.Linear(s.hidden_size, self.num_kv_heads * head_dim, bias=s.attn_bias)
        # Gemma 4's full layers: the values are the keys' projection (before the keys' norm and RoPE)
        keys_as_values = s.keys_as_values and kind == "full_attention"
        self.v_proj = None if keys_as_values else nn.Linear(s.hidden_size, self.num_kv_heads * self.value_dim,
                                                             bias=s.attn_bias)
        # Gemma 4: the values at unit RMS per head, no weight (None: not normed)
        self.value_norm_eps = s.rms_norm_eps if s.hf_model_type in GEMMA4_TYPES else None
        self.o_proj = nn.Linear(heads * self.value_dim, s.hidden_size,
                                bias=s.attn_bias and s.arch not in QKV_ONLY_BIAS_ARCHS)
        # Step-3.7: a sigmoid gate per query head, from its own projection of the layer's input
        self.g_proj = nn.Linear(s.hidden_size, heads, bias=False) if s.head_gate else None
        self.gate_softplus = s.head_gate_activation == "softplus"  # Laguna's gate (fp32 inside), else a sigmoid
        self.scale = softmax_scale(s)
        if s.qk_norm and s.whole_qk_norm:  # OLMoE, OLMo: over all heads of the projection together
            self.q_norm = HeadsRMSNorm(heads * head_dim, s.rms_norm_eps)
            self.k_norm = HeadsRMSNorm(self.num_kv_heads * head_dim, s.rms_norm_eps)
        else:
            self.q_norm = RMSNorm(head_dim, s.rms_norm_eps, norm_offset) if s.qk_norm else None
            self.k_norm = RMSNorm(head_dim, s.rms_norm_eps, norm_offset) if s.qk_norm else None
        self.sinks = nn.Parameter(torch.empty(heads)) if s.sinks_at(kind) else None
        self.clip_qkv = s.clip_qkv  # OLMoE's: q and k after their norms, and v, clamped to ±clip_qkv (None: not)
        self.qk_norm_after_rope = s.arch in QK_NORM_AFTER_ROPE_ARCHS
        # ERNIE-4.5, Llama 4, Cohere: channel pairs, not halves
        self.rope_interleaved = s.arch in INTERLEAVED_ROPE_ARCHS or s.rope_pairs
        self.rope_backend = "auto"  # auto | torch | triton (kernels/rope.py: one fused kernel on GPU)
        self.window = window  # keys fewer than `window` positions back (None: every earlier key of the document)
        self.chunk = chunk  # keys of the query's own run of `chunk` positions of the document (None: no chunks)
        l4 = s.llama4
        # Llama 4's global layers take no RoPE, nor K-EXAONE's, AFMoE's and Cohere's full layers (`ModelShape.rotated`:
        # layer `index`)
        self.rotary = (l4 is None or chunk is not None) and s.rotated(index)
        self.unit_rms_eps = s.rms_norm_eps if l4 is not None and l4.qk_norm and chunk is not None else None
        self.norm_backend = "auto"  # the unit-RMS q/k norm's: auto | torch | triton (kernels/rms_norm.py)
        self.temperature = ((l4.floor_scale, l4.attn_scale) if l4 is not None and l4.temperature_tuning
                            and chunk is None else None)
        # the share of o_proj's bias this rank adds: 1/tp under tensor parallelism (launch/tensor_parallel.py sets
        # it), whose ranks' partial outputs are summed
        self.o_proj_bias_share = 1.0
        # None: the whole sequence is here; launch/context_parallel.py installs its ContextParallel (K/V exchange)
        self.context_parallel = None

    def _rotate(self, t: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE on q or k: halves of the rotated channels, or pairs (of the whole head, or of its rotated share)."""
        if self.rope_interleaved and rope[0].shape[-1] < t.shape[-1]:
            return _partial_pairs(t, rope, self.rope_backend)
        return apply_rope(t, *rope, pairs=self.rope_interleaved, backend=self.rope_backend)

    def forward(self, x_TD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], packing: Packing):
        T = x_TD.shape[0]
        q = self.q_proj(x_TD)
        if self.output_gate:  # per head: [query channels | gate channels]
            q, gate = q.view(T, -1, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(T, -1)
        # head counts from the projections' widths: under tensor parallelism each rank holds whole heads of them
        q = q.reshape(T, -1, self.head_dim)
        k = self.k_proj(x_TD).view(T, -1, self.head_dim)
        v = k if self.v_proj is None else self.v_proj(x_TD).view(T, -1, self.value_dim)
        if self.value_scale != 1.0:
            v = v * self.value_scale
        if self.value_norm_eps is not None:
            v = unit_rms(v, self.value_norm_eps, self.norm_backend)
        if self.q_norm is not None and not self.qk_norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        if self.rotary:
            q, k = (self._rotate(t, rope) for t in (q, k))
        if self.q_norm is not None and self.qk_norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.unit_rms_eps is not None:
            q, k = (unit_rms(t, self.unit_rms_eps, self.norm_backend) for t in (q, k))
        if self.temperature is not None:
            q = (q * query_temperature(packing.positions, *self.temperature)).to(q.dtype)
        if self.chunk is not None:
            packing = packing.chunked(self.chunk)
        if self.value_dim != self.head_dim and not (self.sinks is None and self.window is None
                                                    and cudnn_takes(q, k, v)):
            v = F.pad(v, (0, self.head_dim - self.value_dim))
        if self.sinks is not None or self.window is not None:
            if _context_parallel(self, packing) is not None:
                o = self.context_parallel.sink_attention(q, k, v, self.sinks, packing, self.scale, self.window)
            else:
                o = sink_attention(q, k, v, self.sinks, packing, self.scale, self.window)
        else:
            with contextlib.nullcontext() if v.shape[-1] == self.head_dim else sdpa_without_flash():
                if _context_parallel(self, packing) is not None:
                    o = self.context_parallel.attention(q, k, v, packing, self.scale)
                else:
                    o = causal_attention(q, k, v, packing, self.scale)
        o = o[..., :self.value_dim]
        if self.g_proj is not None:  # the gated output is o_proj's contiguous input
            g = self.g_proj(x_TD)
            g = F.softplus(g.float()).to(o.dtype) if self.gate_softplus else torch.sigmoid(g)
            o = o * g.unsqueeze(-1)
        o = o.reshape(T, -1)
        if self.output_gate:
            o = o * torch.sigmoid(gate)
        if self.o_proj.bias is not None and self.o_proj_bias_share != 1.0:
            return F.linear(o, self.o_proj.weight, self.o_proj.bias * self.o_proj_bias_share)
        return self.o_proj(o)


def _partial_pairs(t: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], backend: str) -> torch.Tensor:
    """RoPE on channel pairs of a head's first R channels (R the angle rows' width: GLM-4's half of each head), the
    rest passed through; kernels.rope's pairs form on the R-wide slice (its output's channel order is the same
    permutation for q and k, which q·k does not see)."""
    r = rope[0].shape[-1]
    return torch.cat([apply_rope(t[..., :r].contiguous(), *rope, pairs=True, backend=backend), t[..., r:]], dim=-1)


class MLAttention(nn.Module):
    """DeepSeek multi-head latent attention (DeepSeek-V3, Kimi-K2, Moonlight). Queries from the hidden state, or
    through a low-rank q_a_proj → RMSNorm → q_b_proj (q_lora_rank > 0); keys and values from one shared latent:
    kv_a_proj_with_mqa gives the kv_lora_rank latent (normed, then kv_b_proj expands it to each head's
    [k_nope (Dn) | v (Dv)]) and one RoPE key part (Dr) that every head shares. Per head q = [q_nope | rope(q_rope)],
    k = [k_nope | rope(k_rope)], RoPE on channel pairs (kernels.rope, `pairs`). Attention runs as multi-head attention
    over the expanded keys (training processes every token, so the latent is never cached): on a GPU whose cuDNN
    takes the shapes, cuDNN's kernel with v at its own width Dv; elsewhere v zero-padded to q's head size Dn + Dr
    (flash attention takes one head size; the padded output channels are zero and dropped). `expand` decides, for
    the plain and the context-parallel path alike. Under context
    parallelism the cp ranks exchange the latent (normed latent and RoPE'd shared key), and each expands the whole
    micro-batch's keys and values from it (`expand`). A.X K2 (`MLAShape.query_gate`): q_gate_proj takes the q LoRA's
    normed and raw latents side by side and gives each head its query and a gate per value channel, its output
    times the gate's sigmoid (fp32) before o_proj."""

    def __init__(self, s: ModelShape, layer: int = 0):
        super().__init__()
        a = s.mla
        self.num_heads, self.num_kv_heads = s.num_heads, s.num_heads
        self.nope_dim, self.rope_dim, self.v_dim = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        self.qk_dim, self.kv_lora_rank = a.qk_nope_head_dim + a.qk_rope_head_dim, a.kv_lora_rank
        if a.q_lora_rank:
            self.q_a_proj = nn.Linear(s.hidden_size, a.q_lora_rank, bias=s.attn_bias)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, 1e-6, 0.0)
        if a.query_gate:  # A.X K2: each head's query and its output's gate from both latents
            self.q_gate_proj = nn.Linear(2 * a.q_lora_rank, s.num_heads * (self.qk_dim + a.v_head_dim), bias=False)
        elif a.q_lora_rank:
            self.q_b_proj = nn.Linear(a.q_lora_rank, s.num_heads * self.qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(s.hidden_size, s.num_heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(s.hidden_size, a.kv_lora_rank + a.qk_rope_head_dim, bias=s.attn_bias)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, 1e-6, 0.0)
        self.kv_b_proj = nn.Linear(a.kv_lora_rank, s.num_heads * (a.qk_nope_head_dim + a.v_head_dim), bias=False)
        self.o_proj = nn.Linear(s.num_heads * a.v_head_dim, s.hidden_size, bias=s.attn_bias)
        self.scale = softmax_scale(s)
        # DeepSeek sparse attention: this layer's indexer, or (GLM's "shared" layers) the earlier layer whose
        # selection it reuses; `keeps_selection`: a later layer reuses this one's; `keeps_for_recompute` (set by
        # launch/recompute.py: the plan's train.keep_selections on a recomputed layer): its recomputed forward reuses
        # the forward's selection instead of running the indexer again
        self.sparse, self.layer = s.dsa is not None, layer
        self.indexer, self.selection_of, self.keeps_selection = None, None, False
        self.keeps_for_recompute = False
        # tensor parallelism's split of the selection work (launch/tensor_parallel.py: each rank selects for its
        # share of the queries, the selections all-gathered); None: this rank selects for every query
        self.selection_split = None
        if s.dsa is not None:
            if layer in s.dsa.shared_layers:
                self.selection_of = s.dsa.selection_source(layer)
            else:
                self.indexer = Indexer(s)
                self.keeps_selection = any(s.dsa.selection_source(i) == layer for i in s.dsa.shared_layers)
        self.rope_backend = "auto"  # as Attention's
        self.context_parallel = None  # as Attention's
        # Kimi-Linear's MLA layers take no RoPE (`ModelShape.rotated`): the Dr key part is shared, unrotated
        self.rotary = s.rotated(layer)
        # Mistral 4's query scale by position (`query_temperature`, shift 0); None: none
        self.temperature = ((s.query_scale_period, s.query_scale_beta, 0.0) if s.query_scale_period else None)

    def forward(self, x_TD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], packing: Packing):
        T = x_TD.shape[0]
        if not self.rotary:
            rope = None
        gate = None
        if hasattr(self, "q_gate_proj"):  # per head [query | gate of its v channels]
            q_compressed = self.q_a_proj(x_TD)
            q_latent = self.q_a_layernorm(q_compressed)
            q, gate = self.q_gate_proj(torch.cat([q_latent, q_compressed], dim=-1)).view(
                T, -1, self.qk_dim + self.v_dim).split([self.qk_dim, self.v_dim], dim=-1)
            gate = gate.reshape(T, -1)
        elif hasattr(self, "q_b_proj"):
            q_latent = self.q_a_layernorm(self.q_a_proj(x_TD))
            q = self.q_b_proj(q_latent)
        else:
            q = self.q_proj(x_TD)
        q = q.reshape(T, -1, self.qk_dim)  # [T, H, Dn + Dr]: heads from the width (tensor parallelism splits them)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x_TD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        if rope is not None:
            q_rope = apply_rope(q_rope, *rope, pairs=True, backend=self.rope_backend)
            k_rope = apply_rope(k_rope.view(T, 1, self.rope_dim), *rope, pairs=True,
                                backend=self.rope_backend).view(T, self.rope_dim)
        latent = torch.cat([self.kv_a_layernorm(latent), k_rope], dim=-1)  # [T, C + Dr]: all a key needs
        if self.sparse:
            o = self.sparse_attention(x_TD, q_latent, q_nope, q_rope, latent, rope, packing).reshape(T, -1)
            return self.o_proj(o if gate is None else (o * torch.sigmoid(gate.float())).to(o.dtype))
        q = torch.cat([q_nope, q_rope], dim=-1)
        if self.temperature is not None:
            q = (q * query_temperature(packing.positions, *self.temperature)).to(q.dtype)
        if _context_parallel(self, packing) is not None:  # the latent crosses the cp ranks, not K and V
            o = self.context_parallel.latent_attention(q, latent, self.expand, packing, self.scale)
        else:
            k, v = self.expand(latent, q)
            # v at its own width: cuDNN's kernel (2.1 times padded flash on an H200, 1.5 times padded cuDNN)
            with sdpa_without_flash() if v.shape[-1] < k.shape[-1] else contextlib.nullcontext():
                o = causal_attention(q, k, v, packing, self.scale)
        o = o[..., : self.v_dim].reshape(T, -1)
        return self.o_proj(o if gate is None else (o * torch.sigmoid(gate.float())).to(o.dtype))

    def sparse_attention(self, x_TD, q_latent, q_nope_THN, q_rope_THR, latent_TC, rope, packing: Packing
                         ) -> torch.Tensor:
        """DeepSeek sparse attention (launch/sparse_attention.py): the indexer picks each query's keys, and the heads
        attend to them in the absorbed form, q_nope through each head's k rows of kv_b_proj into the latent's space
        and the output back through its v rows. Returns [T, H, Dv]. Under context parallelism the latents and index
        keys of the whole micro-batch are all-gathered (in global token order) and the local queries select among
        them. A layer without an indexer reuses the selection its source layer left on the micro-batch's packing
        (`Packing.handoff`, kept for the step: the recomputed forward finds it too); with `keeps_for_recompute` a
        layer leaves its own there in the forward (with grad enabled: a training forward) and its recomputed forward
        takes it back instead of running the indexer again."""
        T, H = q_nope_THN.shape[:2]
        w = self.kv_b_proj.weight.view(H, self.nope_dim + self.v_dim, self.kv_lora_rank)  # this rank's heads
        q_hat = torch.cat([torch.bmm(q_nope_THN.transpose(0, 1), w[:, :self.nope_dim]).transpose(0, 1), q_rope_THR],
                          dim=-1)  # [T, H, C + Dr]
        cp = _context_parallel(self, packing)
        idx = self._given_selection(packing)
        if idx is not None:  # an earlier layer's, or the forward's for the recomputed forward: no indexer to run
            if cp is not None:
                (latent_TC,) = cp.gather_in_order(packing, latent_TC)
        else:
            split = self.selection_split
            a, b = split.row_share(T) if split is not None else (0, T)
            index_q, index_w, index_k = self.indexer(x_TD, q_latent, rope, (a, b))
            if cp is not None:
                latent_TC, index_k = cp.gather_in_order(packing, latent_TC, index_k)
                query_index, doc_start = cp.key_positions(packing)
            else:
                lengths = torch.tensor(packing.doc_lengths)
                query_index = torch.arange(T)
                doc_start = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
            idx = index_topk(index_q, index_w, index_k, query_index[a:b], doc_start[a:b],
                             self.indexer.topk, self.indexer.scale)
            if split is not None:
                idx = split.gather_rows(idx, T)
            if self.keeps_selection:
                packing.handoff.values[("sparse_selection", self.layer)] = idx
            if self.keeps_for_recompute and torch.is_grad_enabled():
                packing.handoff.values[("recompute_selection", self.layer)] = idx
        o = sparse_latent_attention(q_hat, latent_TC, idx, self.scale, self.kv_lora_rank)  # [T, H, C]
        return torch.bmm(o.transpose(0, 1), w[:, self.nope_dim:].transpose(1, 2)).transpose(0, 1)

    def _given_selection(self, packing: Packing) -> torch.Tensor | None:
        """The selection this layer attends with without running an indexer: a shared layer's source's, or (with
        `keeps_for_recompute`) the one its forward left for its recomputed forward, taken off the packing there (its
        one use: a packing reused for another step finds none); None where the layer selects for itself."""
        values = packing.handoff.values
        if self.indexer is None:
            idx = values.get(("sparse_selection", self.selection_of))
            if idx is None:
                raise ValueError(f"layer {self.layer} reuses layer {self.selection_of}'s sparse-attention selection, "
                                 f"which this process did not compute (a pipeline stage must hold both)")
            return idx
        return values.pop(("recompute_selection", self.layer), None) if self.keeps_for_recompute else None

    def expand(self, latent_TC: torch.Tensor, q_THD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [T, H, Dn + Dr] and values [T, H, Dv] of tokens' latents [T, C + Dr], for the queries q_THD:
        kv_b_proj's per-head k_nope and v, the shared RoPE key appended to every head's k; v at its own width where
        SDPA's cuDNN kernel takes the shapes with q (`cudnn_takes`), else zero-padded to the q·k head size."""
        T = latent_TC.shape[0]
        c, k_rope = latent_TC.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_nope, v = self.kv_b_proj(c).view(T, -1, self.nope_dim + self.v_dim).split([self.nope_dim, self.v_dim], -1)
        k = torch.cat([k_nope, k_rope[:, None, :].expand(T, k_nope.shape[1], self.rope_dim)], dim=-1)
        if self.v_dim < self.qk_dim and not cudnn_takes(q_THD, k, v):
            v = F.pad(v, (0, self.qk_dim - self.v_dim))
        return k, v


class Indexer(nn.Module):
    """DeepSeek sparse attention's lightning indexer (DeepSeek-V3.2, GLM-5; launch/sparse_attention.py): index
    queries from MLA's q latent (wq_b, N heads of I), one index key a token (wk, then a LayerNorm), a weight per
    index head (weights_proj, times N^−½); RoPE on the first qk_rope_head_dim channels of both, in halves
    (DeepSeek-V3.2) or pairs (GLM-5). Its weights take no gradient (the selection it feeds is discrete): they are
    loaded, used and exported unchanged."""

    def __init__(self, s: ModelShape):
        super().__init__()
        d = s.dsa
        self.heads, self.dim, self.rope_dim, self.pairs = d.index_heads, d.index_head_dim, s.mla.qk_rope_head_dim, \
            d.rope_pairs
        self.topk, self.scale = d.topk, d.index_head_dim ** -0.5
        self.wq_b = nn.Linear(s.mla.q_lora_rank, d.index_heads * d.index_head_dim, bias=False)
        self.wk = nn.Linear(s.hidden_size, d.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(d.index_head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(s.hidden_size, d.index_heads, bias=False)
        self.requires_grad_(False)

    @torch.no_grad()
    def forward(self, x_TD: torch.Tensor, q_latent: torch.Tensor, rope, rows: tuple[int, int] | None = None
                ) -> tuple[torch.Tensor, ...]:
        """Index queries [n, N, I] and head weights [n, N] (fp32) of the tokens rows[0]..rows[1] − 1 (all T where
        None: under TP each rank selects for its share), and every token's key [T, I]."""
        T = x_TD.shape[0]
        a, b = rows if rows is not None else (0, T)
        r = self.rope_dim
        q = self.wq_b(q_latent[a:b]).view(b - a, self.heads, self.dim)
        rope_q = tuple(c[a:b] for c in rope)
        q = torch.cat([apply_rope(q[..., :r].contiguous(), *rope_q, pairs=self.pairs, backend="torch"), q[..., r:]],
                      -1)
        k = F.layer_norm(self.wk(x_TD).float(), (self.dim,), self.k_norm.weight.float(), self.k_norm.bias.float(),
                         self.k_norm.eps).to(x_TD.dtype).view(T, 1, self.dim)
        k = torch.cat([apply_rope(k[..., :r].contiguous(), *rope, pairs=self.pairs, backend="torch"), k[..., r:]], -1)
        w = self.weights_proj(x_TD[a:b]).float() * self.heads ** -0.5
        return q, w, k.view(T, self.dim)


# False: values narrower than q·k are zero-padded to it everywhere, as off NVIDIA GPUs (the A/B of
# bench/bench_train_step.py --value-widths)
VALUES_AT_OWN_WIDTH = True


def cudnn_takes(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor) -> bool:
    """Whether SDPA's cuDNN kernel takes causal attention of these shapes (v's head size may differ from q·k's; GQA
    inside the kernel): `launch.attention_parts.kernel_for`'s answer for one causal part. What decides whether
    narrower values (MLA's, MiMo-V2-Flash's) go to the kernel at their own width (`VALUES_AT_OWN_WIDTH`)."""
    from launch.attention_parts import kernel_for

    if not VALUES_AT_OWN_WIDTH:
        return False
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q_THD, k_THD, v_THD))
    return kernel_for(q, [(k, v, True)]) == "cudnn"


def sdpa_without_flash():
    """SDPA with its flash kernel disabled (it needs v as wide as q·k, which MLA's is not): cuDNN's kernel, the
    memory-efficient one and the math path stay enabled, in torch's own priority order (on Hopper and Blackwell
    datacenter GPUs torch puts cuDNN first; elsewhere the memory-efficient kernel leads). Only the enabled set changes,
    and it is restored exactly on exit; the priority order is never set here. Setting it would pin torch's pristine
    flash-first order for the rest of the process whenever the context is the process's first SDPA call (torch fills
    in its GPU-dependent default at that first call, after the context has saved the order it restores), and every
    later model's attention would run the flash kernel where torch picks cuDNN (on the H200, 1.7x slower at 96 query
    heads over 8, 32K tokens)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


ATTENTION_MIXERS = (Attention, MLAttention)  # full attention's two forms: what CP and TP install on and split


class GatedDeltaNet(nn.Module):
    """Linear attention: q/k/v/z/β/α projections, causal depthwise conv (per document), gated delta rule, gated
    RMSNorm, output projection. Qwen3.5's split projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), with
    in_proj_qkv's rows (and the conv's channels) grouped per key head: [q (Dk) | k (Dk) | its r value heads (r·Dv)]
    for each of the G key heads, so that a contiguous block of rows is whole heads (tensor parallelism shards it on
    rows); launch/hf_io.py converts from and to Hugging Face's [all q | all k | all v]. Head counts in the forward
    come from the projections' widths (a tensor-parallel rank holds G/tp key heads and their value heads)."""

    def __init__(self, s: ModelShape):
        super().__init__()
        la = s.linear_attn
        self.num_k_heads, self.num_v_heads = la.num_k_heads, la.num_v_heads
        self.head_k_dim, self.head_v_dim = la.head_k_dim, la.head_v_dim
        self.key_dim, self.value_dim = la.num_k_heads * la.head_k_dim, la.num_v_heads * la.head_v_dim
        self.chunk_size, self.conv_kernel = la.chunk_size, la.conv_kernel
        self.backend = "auto"  # delta-rule backend: auto | torch | fla (launch/gated_delta.py)
        self.conv_backend = "auto"  # conv + SiLU: auto | torch | triton (kernels/gdn_fused.py)
        conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(s.hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(s.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(s.hidden_size, la.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(s.hidden_size, la.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, la.conv_kernel, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(la.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(la.num_v_heads))
        self.norm = GatedRMSNorm(la.head_v_dim, s.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, s.hidden_size, bias=False)
        # None: the whole sequence is here; launch/context_parallel.py installs its ContextParallel (conv halo,
        # delta-rule state combine)
        self.context_parallel = None

    def causal_conv(self, x_TC: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        """Depthwise causal conv + SiLU; a tap reaching before its document's first token reads zero
        (kernels.gdn_fused.causal_conv1d_silu: one fused Triton kernel on GPU, the torch reference on CPU)."""
        return causal_conv1d_silu(x_TC, self.conv1d.weight[:, 0, :], positions_T, backend=self.conv_backend)

    def forward(self, x_TD: torch.Tensor, rope, packing: Packing):
        T = x_TD.shape[0]
        cp = _context_parallel(self, packing)
        if cp is not None:
            qkv = cp.causal_conv(self.in_proj_qkv(x_TD), self.conv1d.weight[:, 0, :], packing, self.conv_backend)
        else:
            qkv = self.causal_conv(self.in_proj_qkv(x_TD), packing.positions)
        r = self.num_v_heads // self.num_k_heads  # value heads per key head
        qkv = qkv.view(T, -1, 2 * self.head_k_dim + r * self.head_v_dim)  # [T, G, Dk + Dk + r·Dv]
        q, k, v = torch.split(qkv, [self.head_k_dim, self.head_k_dim, r * self.head_v_dim], dim=-1)
        v = v.reshape(T, -1, self.head_v_dim)  # value head g·r + j reads key head g
        beta = torch.sigmoid(self.in_proj_b(x_TD))
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x_TD).float() + self.dt_bias)  # log decay ≤ 0
        if cp is not None:
            o = cp.delta_rule(q, k, v, g, beta, packing, self.chunk_size, self.backend)
        else:
            o = gated_delta_rule(q, k, v, g, beta, packing.positions, packing.cu_seqlens, self.chunk_size,
                                 self.backend)
        z = self.in_proj_z(x_TD).view(T, -1, self.head_v_dim)
        o = self.norm(o, z).reshape(T, -1)
        return self.out_proj(o)


class SigmoidGatedRMSNorm(GatedRMSNorm):
    """RMSNorm over each head's channels times the weight, then a sigmoid gate (KDA's output norm), all in fp32, the
    result in x's dtype (kernels.gdn_fused.gated_rms_norm's sigmoid form: one fused Triton kernel on GPU)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps, backend=self.backend, activation="sigmoid")


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention (Kimi-Linear's linear attention): the gated delta rule with one decay per key channel.
    q, k, v from their own projections, each through its own causal depthwise conv + SiLU (per document; the three
    run as one conv over [q | k | v]); the log decay g = −exp(A_log) · softplus(f_b(f_a(x)) + dt_bias) per head and
    key channel (f_a a rank-head_dim bottleneck, dt_bias per channel, A_log per head); β = sigmoid(b_proj(x)); the
    rule's output through an RMSNorm per head gated by sigmoid(g_b(g_a(x))), then o_proj. The parameters carry the
    releases' names (`self_attn.q_conv1d`, `f_a_proj`, …; A_log one value a head). Head counts in the forward come
    from the projections' widths (a tensor-parallel rank holds heads/tp of every per-head tensor)."""

    def __init__(self, s: ModelShape):
        super().__init__()
        la = s.linear_attn
        self.num_k_heads = self.num_v_heads = la.num_k_heads
        self.head_k_dim = self.head_v_dim = la.head_k_dim
        width = la.num_k_heads * la.head_k_dim
        self.chunk_size, self.conv_kernel = la.chunk_size, la.conv_kernel
        self.backend = "auto"  # as GatedDeltaNet's
        self.conv_backend = "auto"
        h, d = s.hidden_size, la.head_k_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(h, width, bias=False) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(width, width, la.conv_kernel, groups=width, bias=False) for _ in range(3))
        self.f_a_proj, self.f_b_proj = nn.Linear(h, d, bias=False), nn.Linear(d, width, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.A_log = nn.Parameter(torch.zeros(la.num_k_heads))
        self.b_proj = nn.Linear(h, la.num_k_heads, bias=False)
        self.g_a_proj, self.g_b_proj = nn.Linear(h, d, bias=False), nn.Linear(d, width, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(d, s.rms_norm_eps)
        self.o_proj = nn.Linear(width, h, bias=False)
        self.context_parallel = None  # as GatedDeltaNet's

    def forward(self, x_TD: torch.Tensor, rope, packing: Packing):
        T, d = x_TD.shape[0], self.head_k_dim
        qkv = torch.cat([self.q_proj(x_TD), self.k_proj(x_TD), self.v_proj(x_TD)], -1)
        weight = torch.cat([c.weight[:, 0, :] for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)])
        cp = _context_parallel(self, packing)
        if cp is not None:
            qkv = cp.causal_conv(qkv, weight, packing, self.conv_backend)
        else:
            qkv = causal_conv1d_silu(qkv, weight, packing.positions, backend=self.conv_backend)
        q, k, v = (t.reshape(T, -1, d) for t in qkv.chunk(3, dim=-1))
        heads = q.shape[1]
        f = self.f_b_proj(self.f_a_proj(x_TD)).float() + self.dt_bias.float()
        g = -self.A_log.float().exp()[:, None] * F.softplus(f.view(T, heads, d))  # [T, H, K] log decay ≤ 0
        beta = torch.sigmoid(self.b_proj(x_TD))
        if cp is not None:
            o = cp.delta_rule(q, k, v, g, beta, packing, self.chunk_size, self.backend)
        else:
            o = gated_delta_rule(q, k, v, g, beta, packing.positions, packing.cu_seqlens, self.chunk_size,
                                 self.backend)
        gate = self.g_b_proj(self.g_a_proj(x_TD)).view(T, heads, d)
        return self.o_proj(self.o_norm(o, gate).reshape(T, -1))


LINEAR_MIXERS = (GatedDeltaNet, KimiDeltaAttention)  # the delta-rule mixers: what CP and TP install on and split


def _context_parallel(mixer: nn.Module, packing: Packing):
    """The mixer's installed ContextParallel for a sharded micro-batch, None for a whole one; a shard reaching a
    mixer without one (or the reverse) is refused rather than attended within the shard."""
    if (packing.cp is None) != (mixer.context_parallel is None):
        raise ValueError("a context-parallel micro-batch needs a model parallelized with cp > 1, and such a model "
                         "needs sharded micro-batches (ContextParallel.shard)")
    return mixer.context_parallel


class DecoderLayer(nn.Module):
    """`x + mixer(norm(x))`, then `x + ffn(norm(x))` (the shape's norm_placement "sandwich": `x + norm(mixer(norm(x)))`
    and likewise the FFN; "post": `x + norm(mixer(x))`; "parallel": `x + mixer(n) + ffn(n)` with n = norm(x)): the
    FFN is the MoE, or a dense SwiGLU MLP (`dense`: the model's dense layers, `ModelShape.is_dense_layer`, which are
    all of a dense model's). Gemma 4's FFN runs its dense MLP and its experts side by side (`_gemma4_forward`)."""

    def __init__(self, s: ModelShape, layer_type: str, norm_offset: float, dense: bool = False, index: int = 0):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "full_attention":
            self.self_attn = MLAttention(s, index) if s.mla is not None else Attention(s, norm_offset, index=index)
        elif layer_type == "sliding_attention" and s.mla is None and s.sliding_window:
            self.self_attn = Attention(s, norm_offset, window=s.sliding_window, index=index)
        elif layer_type == "chunked_attention" and s.mla is None and s.attention_chunk:
            self.self_attn = Attention(s, norm_offset, chunk=s.attention_chunk, index=index)
        elif layer_type == "linear_attention" and s.linear_attn.kind == "kda":  # the releases' name for it
            self.self_attn = KimiDeltaAttention(s)
        elif layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(s)
        else:
            raise ValueError(f"layer type {layer_type!r} is not supported by this model (full_attention, "
                             f"sliding_attention with a sliding_window, chunked_attention with an attention_chunk, "
                             f"linear_attention)")
        # the norms where the shape puts them, under transformers' names: "pre" input_layernorm before the mixer and
        # post_attention_layernorm before the FFN; "sandwich" (AFMoE) input_layernorm and post_attention_layernorm
        # around the mixer, pre_mlp_layernorm and post_mlp_layernorm around the FFN; "post" (FlexOlmo)
        # post_attention_layernorm after the mixer and post_feedforward_layernorm after the FFN; "parallel" (Cohere)
        # input_layernorm alone, before both
        self.norm_placement = s.norm_placement
        names = {"pre": ("input_layernorm", "post_attention_layernorm"),
                 "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_mlp_layernorm", "post_mlp_layernorm"),
                 "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
                 "parallel": ("input_layernorm",)}[s.norm_placement]
        for name in names:  # A.X K2's input norm gated on every layer, its FFN norm on the MoE ones
            setattr(self, name, block_norm(s, norm_offset, name == "input_layernorm" or not dense))
        # Granite: each branch's output times its residual multiplier before the add (1 elsewhere)
        self.residual_scale = s.granite.residual if s.granite is not None else 1.0
        # Step-3.7's clamped SwiGLU on some layers: the routed experts' bound, and the shared expert's and dense MLP's
        limit = s.swiglu_limits[index] if s.swiglu_limits else 0.0
        shared_limit = (s.swiglu_limits_shared[index] if s.swiglu_limits_shared else 0.0) or None
        self.gemma4 = s.hf_model_type in GEMMA4_TYPES
        glu = GEGLU_TANH if s.hf_model_type in GEMMA_TYPES else SWIGLU
        shared_glu = clamped_swiglu(shared_limit) if shared_limit else glu
        if dense:
            self.mlp = GatedMLP(s.hidden_size, s.dense_ffn, shared_glu)
        else:
            gpt_oss = s.arch in GPT_OSS_ARCHS
            activation = GPT_OSS_GLU if gpt_oss else clamped_swiglu(limit) if limit else glu
            self.mlp = MoE(s.hidden_size, s.num_experts, s.top_k, s.expert_ffn, s.shared_expert_ffn,
                           s.shared_expert_gate, s.norm_topk_prob, s.sigmoid_router, router_bias=gpt_oss,
                           activation=activation, expert_bias=gpt_oss, shared_glu=shared_glu,
                           softmax_scores=s.arch in SOFTMAX_SCORE_ARCHS, softmax_router=s.softmax_router,
                           weights_on_input=s.arch in INPUT_WEIGHTED_ARCHS, shared_mean=s.shared_expert_mean,
                           sigmoid_top=s.sigmoid_top, scaled_router=s.rms_norm_eps if self.gemma4 else None)
            # a norm after the MoE block keeps its output for the backward: a recomputed forward must produce it
            self.mlp.experts.output_read = s.moe_output_saved
        # A.X K1: an RMSNorm on the MoE block's output, its MoE layers only (under its releases' name)
        self.moe_output_norm = s.moe_output_norm and not dense
        if self.moe_output_norm:
            self.post_mlp_layernorm = block_norm(s, norm_offset)
        if self.gemma4:  # the dense MLP's output norm, the experts' input and output norms, the layer's scalar
            if not dense:
                for name in ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
                             "post_feedforward_layernorm_2"):
                    setattr(self, name, block_norm(s, norm_offset))
            self.register_buffer("layer_scalar", torch.ones(1))

    @property
    def mixer(self) -> nn.Module:
        """The token mixer: `linear_attn` (Gated DeltaNet) or `self_attn` (attention, or KDA under its releases'
        name)."""
        return self.linear_attn if hasattr(self, "linear_attn") else self.self_attn

    def forward(self, x_TD: torch.Tensor, ropes: dict[str, tuple], packing: Packing) -> torch.Tensor:
        """`ropes`: `layer_ropes`'s cos and sin, this layer's by its type (else the "main" pair)."""
        mixer = self.mixer
        rope = ropes.get(self.layer_type, ropes["main"])
        if self.gemma4:
            return self._gemma4_forward(x_TD, mixer(self.input_layernorm(x_TD), rope, packing))
        if self.norm_placement == "sandwich":
            x_TD = x_TD + self.post_attention_layernorm(mixer(self.input_layernorm(x_TD), rope, packing))
            return x_TD + self.post_mlp_layernorm(self.mlp(self.pre_mlp_layernorm(x_TD)))
        if self.norm_placement == "post":
            x_TD = x_TD + self.post_attention_layernorm(mixer(x_TD, rope, packing))
            return x_TD + self.post_feedforward_layernorm(self.mlp(x_TD))
        if self.norm_placement == "parallel":
            n_TD = self.input_layernorm(x_TD)
            return x_TD + mixer(n_TD, rope, packing) + self.mlp(n_TD)
        if self.residual_scale != 1.0:
            x_TD = x_TD + mixer(self.input_layernorm(x_TD), rope, packing) * self.residual_scale
            return x_TD + self.mlp(self.post_attention_layernorm(x_TD)) * self.residual_scale
        x_TD = x_TD + mixer(self.input_layernorm(x_TD), rope, packing)
        if self.moe_output_norm:
            return x_TD + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x_TD)))
        return x_TD + self.mlp(self.post_attention_layernorm(x_TD))


    def _gemma4_forward(self, x_TD: torch.Tensor, mixed_TD: torch.Tensor) -> torch.Tensor:
        """Gemma 4's layer after its mixer: the dense MLP on the normed input and the experts on their own norm of
        it, routed on the input itself, each side's output normed, their sum normed, added (a dense model's: its MLP
        alone between its two norms); the whole times the layer's scalar."""
        x_TD = x_TD + self.post_attention_layernorm(mixed_TD)
        moe = self.mlp
        if isinstance(moe, GatedMLP):  # a dense Gemma 4
            out_TD = x_TD + self.post_mlp_layernorm(moe(self.pre_mlp_layernorm(x_TD)))
            return out_TD * self.layer_scalar.to(out_TD.dtype)
        dense_TD = self.post_feedforward_layernorm_1(moe.shared_expert(self.pre_mlp_layernorm(x_TD)))
        _, top_w_TK, top_e_TK = moe.gate(x_TD)
        routed_TD = moe.experts(self.pre_feedforward_layernorm_2(x_TD), top_w_TK, top_e_TK)
        out_TD = x_TD + self.post_mlp_layernorm(dense_TD + self.post_feedforward_layernorm_2(routed_TD))
        return out_TD * self.layer_scalar.to(out_TD.dtype)


class Transformer(nn.Module):
    """Embedding → decoder layers → final norm; `lm_head` holds the output projection, applied by the loss
    (launch/rl.py: fused log-probs, or plain logits for `lm_head: naive`)."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        refusal = trainable(shape)
        if refusal:
            raise ValueError(refusal)
        self.shape = shape
        norm_offset = 1.0 if shape.arch in OFFSET_NORM_ARCHS or shape.offset_norms else 0.0
        # transformers' embedding never updates its pad row (padding_idx): nor does ours; `pad_row` keeps the
        # vocabulary's id where tensor parallelism makes padding_idx this rank's
        self.embed_tokens = ScaledEmbedding(shape.vocab_size, shape.hidden_size, padding_idx=shape.pad_token_id,
                                            scale=(shape.granite.embedding if shape.granite is not None else 1.0)
                                            * shape.embedding_scale, round_scale=shape.hf_model_type in GEMMA_TYPES)
        self.embed_tokens.pad_row = shape.pad_token_id
        self.layers = nn.ModuleList(DecoderLayer(shape, t, norm_offset, dense=shape.is_dense_layer(i), index=i)
                                    for i, t in enumerate(shape.layer_types))
        self.norm = block_norm(shape, norm_offset)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        # None: one micro-batch is one sequence on this rank; launch/context_parallel.py installs its
        # ContextParallel here (the trainer shards each micro-batch with it) and on every mixer
        self.context_parallel = None
        if shape.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids_T: torch.Tensor, packing: Packing) -> torch.Tensor:
        """Final-norm hidden states [T, D]."""
        if input_ids_T.shape[0] != packing.num_tokens:
            raise ValueError(f"{input_ids_T.shape[0]} tokens but the packing holds {packing.num_tokens}")
        h_TD = self.embed_tokens(input_ids_T)
        ropes = layer_ropes(packing.positions, self.shape, h_TD.dtype)
        for layer in self.layers:
            h_TD = layer(h_TD, ropes, packing)
        return self.norm(h_TD)

    def init_weights(self, std: float = 0.02, seed: int | None = None) -> None:
        """Random init for training from scratch and tests (checkpoints come through launch/hf_io.py)."""
        init_parameters(self, std=std, seed=seed)


@torch.no_grad()
def init_parameters(module: nn.Module, std: float = 0.02, seed: int | None = None) -> None:
    """Random init of a Transformer, or of what `parallelize` made of one (sharded, split into pipeline stages;
    parameter names stay the whole model's). Each parameter is drawn from a generator of its own, seeded by `seed`
    and its name, at its full (global) shape on its device, and each rank keeps its shard: so a model built whole
    and one built on the meta device and sharded hold the same weights, whatever the layout. A_log ~ log U(1, 16),
    dt_bias 1, norm weights and Gemma 4's router scales 1 (0 for offset norms; a LayerNorm's bias 0), the rest
    N(0, std) but the embedding's pad row (0, as transformers initializes it); the sigmoid router's correction bias
    (a buffer) 0, Gemma 4's layer scalars (buffers) 1."""
    for name, p in module.named_parameters():
        gen = torch.Generator(device=p.device)
        gen.manual_seed(_parameter_seed(0 if seed is None else seed, whole_model_name(name)))
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            full = torch.empty(p.shape, device=p.device).uniform_(1, 16, generator=gen).log()
        elif leaf == "dt_bias":
            full = torch.ones(p.shape, device=p.device)
        elif "norm" in name and not isinstance(module.get_submodule(name.rsplit(".", 1)[0]), nn.Linear):
            owner = module.get_submodule(name.rsplit(".", 1)[0])
            # 0 for offset RMSNorms and a LayerNorm's bias (DSA's index keys), 1 for the other norm weights
            zero = leaf == "bias" or (isinstance(owner, RMSNorm) and owner.offset)
            full = torch.full(p.shape, 0.0 if zero else 1.0, device=p.device)
        elif leaf in ("scale", "per_expert_scale"):  # Gemma 4's router scales (launch/moe.py ScaledRouter): 1
            full = torch.ones(p.shape, device=p.device)
        else:
            full = torch.randn(p.shape, generator=gen, device=p.device) * std
            if name.endswith("embed_tokens.weight"):
                pad = getattr(module.get_submodule(name.rsplit(".", 1)[0]), "pad_row", None)
                if pad is not None:
                    full[pad] = 0.0
        assign_full(p, full)
    for name, b in module.named_buffers():
        if name.endswith("e_score_correction_bias"):  # the sigmoid router's (launch/moe.py)
            b.zero_()
        elif name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale
            b.fill_(1.0)


def whole_model_name(name: str) -> str:
    """A parameter's name in the whole model: without the recompute wrapper's module level, which named_parameters
    shows (state dicts already drop it)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def _parameter_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def assign_full(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a parameter's whole value into it: a plain tensor takes it as is, a DTensor (tensor, expert or FSDP2
    sharding) keeps this rank's shard of it, cut locally (every rank holds the same whole value: no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor):
        p.copy_(distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None))
    else:
        p.copy_(full)


def build_model(shape: ModelShape, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                seed: int | None = 0) -> Transformer:
    """The model for `shape`, randomly initialized (deterministic for a seed) on `device` in `dtype`; on the meta
    device, shapes only (`parallelize` it, then `materialize`)."""
    with torch.device(device):
        model = Transformer(shape)
    if torch.device(device).type == "meta":
        return model.to(dtype=dtype)
    model.init_weights(seed=seed)  # in fp32, then cast: the same weights for every dtype
    return model.to(dtype=dtype)


def materialize(module: nn.Module, device: torch.device | str, seed: int | None = 0) -> nn.Module:
    """Storage on `device` for a model built on the meta device and parallelized (each rank allocates only its
    shards), then the same random init a whole model gets (init_parameters)."""
    module.to_empty(device=device)
    init_parameters(module, seed=seed)
    return module
