"""Model shapes: the one description of an architecture that the solver reasons about and the trainer builds.

A `ModelShape` holds only what decides memory, FLOPs and communication (and what the training core needs to build
the same network). Presets come from each model's Hugging Face config.json (text part); `from_hf_config` reads a
user's own config. Parameter counts are per group, because each group is sharded over a different mesh axis:
routed experts over EP × expert-DP, everything else over DP × CP (see docs/cost_model.md).

Pure Python: never imports torch.
"""

from __future__ import annotations

import functools

import json
import math
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal, NamedTuple

from dataclasses import dataclass
from ._data import Record, plain, validate

Pos = int  # > 0, checked in __post_init__ (which pydantic also runs when it validates untrusted data)
NonNeg = int  # >= 0, likewise

LayerType = Literal["full_attention", "linear_attention", "sliding_attention", "chunked_attention",
                    "compressed_sparse_attention", "heavily_compressed_attention"]
LAYER_TYPES = ("full_attention", "linear_attention", "sliding_attention", "chunked_attention",
               "compressed_sparse_attention", "heavily_compressed_attention")
# DeepSeek-V4's: a sliding window over the raw keys and, beside it, keys compressed m to one
COMPRESSED_LAYER_TYPES = ("compressed_sparse_attention", "heavily_compressed_attention")


@dataclass(frozen=True, kw_only=True)
class LinearAttnShape(Record):
    """Linear attention by the gated delta rule: Gated DeltaNet (`kind` "gated_delta": Qwen3-Next's and Qwen3.5's,
    one decay per head and token) or Kimi Delta Attention ("kda": Kimi-Linear's, one decay per key channel, head and
    token, from a low-rank projection of rank head_k_dim; separate q/k/v projections and convolutions, a low-rank
    output gate and a sigmoid-gated RMSNorm; as many value heads as key heads, of the key heads' size)."""

    kind: Literal["gated_delta", "kda"] = "gated_delta"
    num_k_heads: Pos  # q and k heads
    num_v_heads: Pos  # v heads (a multiple of num_k_heads)
    head_k_dim: Pos
    head_v_dim: Pos
    conv_kernel: Pos = 4  # short causal depthwise conv width
    chunk_size: Pos = 64  # chunked delta rule: one fp32 state per chunk in the backward

    def __post_init__(self) -> None:
        _positive(self, ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel", "chunk_size"))
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"num_v_heads={self.num_v_heads} is not a multiple of num_k_heads={self.num_k_heads}")
        if self.kind == "kda" and (self.num_v_heads != self.num_k_heads or self.head_v_dim != self.head_k_dim):
            raise ValueError(f"Kimi Delta Attention takes as many value heads as key heads, of their size; got "
                             f"{self.num_k_heads} key heads of {self.head_k_dim} and {self.num_v_heads} value heads "
                             f"of {self.head_v_dim}")


@dataclass(frozen=True, kw_only=True)
class MLAShape(Record):
    """DeepSeek multi-head latent attention."""

    q_lora_rank: NonNeg  # 0 = no q LoRA (DeepSeek-V2-Lite, Moonlight): q projected straight from the hidden state
    kv_lora_rank: Pos
    qk_nope_head_dim: Pos
    qk_rope_head_dim: Pos
    v_head_dim: Pos
    # A.X K2's: q_b_proj takes the q LoRA's normed and raw latents side by side (2·q_lora_rank inputs) and gives each
    # head its query and a sigmoid gate per value channel of its output (`q_gate_proj`)
    query_gate: bool = False

    def __post_init__(self) -> None:
        _positive(self, ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        _positive(self, ("q_lora_rank",), strict=False)
        if self.query_gate and not self.q_lora_rank:
            raise ValueError("query_gate (A.X K2's gated query projection) needs a q_lora_rank")


@dataclass(frozen=True, kw_only=True)
class BlockSparseShape(Record):
    """MiniMax-M3's block-sparse attention on some of its full-attention layers (`layers`): a lightning indexer
    (`index_heads` heads of `index_head_dim`, one per KV head group, against one index key a token; q and k
    RMSNormed and rotated) scores every earlier key, max-pools the scores over blocks of `block` keys, and each KV
    group's queries attend the `topk_blocks` best blocks, the `local_blocks` ending at the query's own among them
    (transformers' MiniMaxM3VLIndexer). The indexer has no gradient: its selection steers the attention."""

    block: Pos
    topk_blocks: Pos
    local_blocks: NonNeg
    index_heads: Pos
    index_head_dim: Pos
    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        _positive(self, ("block", "topk_blocks", "index_heads", "index_head_dim"))
        _positive(self, ("local_blocks",), strict=False)
        if self.local_blocks > self.topk_blocks:
            raise ValueError(f"block_sparse.local_blocks={self.local_blocks} > topk_blocks={self.topk_blocks}")


@dataclass(frozen=True, kw_only=True)
class SparseAttentionShape(Record):
    """DeepSeek sparse attention (DSA, DeepSeek-V3.2 and GLM-5) on multi-head latent attention: a lightning indexer
    (`index_heads` ReLU heads of `index_head_dim`, queries from MLA's q latent, one key a token) scores every earlier
    key of a query's document, and the query attends to the `topk` highest (launch/sparse_attention.py)."""

    topk: Pos
    index_heads: Pos
    index_head_dim: Pos
    rope_pairs: bool = False  # the indexer's RoPE channels rotated in pairs (GLM-5), not in halves (DeepSeek-V3.2)
    # layers that reuse the previous indexing layer's selection rather than run an indexer (GLM's "shared" layers)
    shared_layers: tuple[int, ...] = ()

    def selection_source(self, layer: int) -> int:
        """The layer whose selection a shared layer reuses: the last one before it that runs its indexer."""
        return max(j for j in range(layer) if j not in self.shared_layers)

    def selection_groups(self, num_layers: int) -> list[list[int]]:
        """The model's layers in groups that must share a pipeline stage: each indexing layer with the shared layers
        after it (which reuse its selection)."""
        groups: list[list[int]] = []
        for i in range(num_layers):
            if i in self.shared_layers:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

    def __post_init__(self) -> None:
        _positive(self, ("topk", "index_heads", "index_head_dim"))
        object.__setattr__(self, "shared_layers", tuple(self.shared_layers))
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 1 for i in self.shared_layers):
            raise ValueError(f"shared_layers must be layer indices from 1 (layer 0 always indexes), got "
                             f"{list(self.shared_layers)}")


@dataclass(frozen=True, kw_only=True)
class CompressedAttentionShape(Record):
    """DeepSeek-V4's attention (docs/deepseek_v4.md). Every layer: queries from a q LoRA, one key/value head of
    `head_dim` (K = V) over a sliding window of raw keys, a sink logit per head, and a grouped low-rank output
    projection (`o_groups` groups of heads, each to `o_lora_rank`, then to the hidden size). Beside the window, a
    compressed_sparse_attention layer attends to the `index_topk` of its keys compressed `csa_rate` to one (windows
    of 2·rate tokens at a stride of rate) that a lightning indexer (`index_heads` × `index_head_dim`, on keys
    compressed the same way) picks; a heavily_compressed_attention layer to all its keys compressed `hca_rate` to
    one. The residual is `hc_mult` streams mixed by hyper-connections; the first `hash_layers` MoE layers route by a
    fixed table of token ids; experts are scored by `scoring` and their gate and up values clamped at
    `swiglu_limit`."""

    q_lora_rank: Pos
    o_groups: Pos
    o_lora_rank: Pos
    csa_rate: Pos = 4
    hca_rate: Pos = 128
    index_heads: Pos
    index_head_dim: Pos
    index_topk: Pos
    hc_mult: Pos = 4
    hash_layers: NonNeg = 0
    scoring: str = "sqrtsoftplus"
    swiglu_limit: float = 10.0

    def __post_init__(self) -> None:
        _positive(self, ("q_lora_rank", "o_groups", "o_lora_rank", "csa_rate", "hca_rate", "index_heads",
                         "index_head_dim", "index_topk", "hc_mult"))
        _positive(self, ("hash_layers",), strict=False)


@dataclass(frozen=True, kw_only=True)
class _GroupedRouting(Record):
    """The experts in `groups` equal groups, the top-k chosen among the `topk_groups` best groups, their weights
    times `scaling`."""

    groups: Pos = 1
    topk_groups: Pos = 1
    scaling: float = 1.0

    def __post_init__(self) -> None:
        _positive(self, ("groups", "topk_groups"))
        if self.topk_groups > self.groups:
            raise ValueError(f"topk_groups={self.topk_groups} > groups={self.groups}")
        if not (isinstance(self.scaling, (int, float)) and math.isfinite(self.scaling) and self.scaling > 0):
            raise ValueError(f"routed scaling must be a positive number, got {self.scaling!r}")


@dataclass(frozen=True, kw_only=True)
class SigmoidRouter(_GroupedRouting):
    """DeepSeek-V3 / GLM-4.5 routing (what a softmax top-k router is replaced by): each expert scored by a sigmoid;
    experts chosen on score + a per-expert correction bias (set by load balancing in pre-training, not by the
    loss), among the `topk_groups` best of `groups` equal expert groups (a group scored by its two best experts);
    the chosen experts weighted by their scores without the bias, renormalized if norm_topk_prob, times
    `scaling`."""


@dataclass(frozen=True, kw_only=True)
class SoftmaxRouter(_GroupedRouting):
    """DeepSeek-V2 routing: the experts' softmax probabilities; the top-k chosen among the `topk_groups` best of
    `groups` equal expert groups (a group scored by its most probable expert; one group: plain top-k, V2-Lite's
    "greedy"); weighted by their probabilities, renormalized if norm_topk_prob, times `scaling`. No correction
    bias."""


@dataclass(frozen=True, kw_only=True)
class Llama4Attention(Record):
    """Llama 4's attention beyond the chunks: its chunked layers rotate q and k (RoPE on channel pairs) and, with
    `qk_norm`, scale each head of them to unit RMS (no weight) after the rotation; its full-attention layers take no
    RoPE and, with `temperature_tuning`, scale each query by 1 + attn_scale · log(1 + ⌊(p + 1) / floor_scale⌋) at
    its position p."""

    qk_norm: bool = True
    temperature_tuning: bool = True
    floor_scale: Pos = 8192
    attn_scale: float = 0.1

    def __post_init__(self) -> None:
        _positive(self, ("floor_scale",))
        v = self.attn_scale
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"attn_scale must be a non-negative number, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class GraniteScales(Record):
    """Granite's multipliers: the input embedding times `embedding`, attention's softmax scale `attention` (in place
    of 1/√d), each layer's mixer and FFN output times `residual` before its residual add, the logits divided by
    `logits`."""

    embedding: float = 1.0
    attention: float = 1.0
    residual: float = 1.0
    logits: float = 1.0

    def __post_init__(self) -> None:
        for n in ("embedding", "attention", "residual", "logits"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"Granite's {n} multiplier must be a positive number, got {v!r}")


# the RoPE scalings the training core applies ("dynamic" only in its NTK-alpha form: Hunyuan's, with `alpha`)
ROPE_SCALINGS = ("yarn", "llama3", "linear", "dynamic")


@dataclass(frozen=True, kw_only=True)
class RopeScaling(Record):
    """A Hugging Face `rope_scaling` (rope_parameters) other than the default: the frequencies the training core
    must use to be the same network. `kind` is the rope_type: yarn (DeepSeek-V3, Kimi-K2, long-context Qwen3),
    llama3 (Llama 3.1 and later), linear; any other is read and named, and the core refuses to train it.
    None-valued fields are absent from the config (each kind's defaults apply)."""

    kind: str
    factor: float = 1.0
    original_max_position: NonNeg = 0  # 0: absent
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    alpha: float | None = None  # dynamic (Hunyuan's NTK-alpha): the base stretched to base · alpha^(d / (d − 2))
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None

    def __post_init__(self) -> None:
        _positive(self, ("original_max_position",), strict=False)
        for n in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                  "low_freq_factor", "high_freq_factor", "alpha"):
            v = getattr(self, n)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v < 0):
                raise ValueError(f"rope scaling {n} must be a non-negative number, got {v!r}")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor!r}")
        if self.kind in ("yarn", "llama3") and not self.original_max_position:
            raise ValueError(f"{self.kind} rope scaling needs original_max_position_embeddings")


# what the training core (launch/) builds: the Qwen3.5 / Qwen3-Next hybrids (MoE and dense), Qwen3-MoE, Mixtral
# (Qwen3-MoE's block without q/k norms, top-k weights renormalized), Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B: q/k/v
# biases, a gated shared expert, softmax routing without renormalization), DeepSeek-V3 (multi-head latent
# attention, sigmoid routing; Kimi-K2 and Moonlight share it; DeepSeek-V3.2 and GLM-5 with DeepSeek sparse attention;
# Kimi-Linear with Kimi Delta Attention layers among MLA ones without RoPE)
# and DeepSeek-V2 (its softmax routing), GLM-4.5
# (sigmoid routing, q/k/v biases, partial RoPE), gpt-oss (attention sinks, sliding-window layers, biased router and
# experts, clamped GLU) and dense Llama-family stacks (Llama, Qwen2, Qwen3, Mistral; their sliding windows too), OLMoE
# (q/k norms over all heads together, softmax routing without renormalization), ERNIE-4.5 MoE (softmax scores
# steered by a correction bias, shared experts, a dense first layer, interleaved RoPE, tied embeddings), MiniMax-M2
# (q/k norms over all heads together, partial RoPE, sigmoid routing steered by a correction bias, no shared
# expert), Llama 4 (chunked attention with RoPE, global attention without, sigmoid top-k weights scaling the routed
# experts' input, a shared expert, dense layers among the MoE ones), Granite 3.x MoE (Mixtral's block with
# embedding, attention, residual and logits multipliers; an optional shared expert), Hunyuan-A13B (per-head q/k
# norms after RoPE, a shared expert of the experts' width, NTK-alpha RoPE); `recipe solve` plans every arch
TRAINED_ARCHS = ("qwen3_5_moe", "qwen3_next", "qwen3_moe", "qwen2_moe", "olmoe", "ernie4_5_moe", "minimax_m2",
                 "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss", "llama4", "granitemoe", "hunyuan_moe", "qwen3_5",
                 "dense")
# archs whose q/k RMSNorms span all heads of a token together (one weight per channel of the projection), not each
# head apart
WHOLE_QK_NORM_ARCHS = ("olmoe", "minimax_m2")
WHOLE_QK_NORM_TYPES = ("olmo2", "olmo3")  # the dense OLMo stacks' likewise
# archs whose attention biases are on q/k/v only (Qwen2, Qwen2-MoE, GLM-4.5); the others' (gpt-oss, OLMoE, the Qwen3
# families) are on o_proj too
QKV_ONLY_BIAS_ARCHS = ("dense", "glm4_moe", "qwen2_moe")


# the dense stacks the core trains by their model type: the Llama family's (no type recorded: Llama, Mistral,
# Ministral, Qwen2, Qwen3), Gemma's, OLMo's, Granite's, EXAONE 4's, SmolLM3's, Phi-3's, GLM-4's, ERNIE-4.5's and
# Cohere2's
TRAINED_DENSE_TYPES = (None, "gemma", "gemma3_text", "gemma4_text", "olmo2", "olmo3", "granite", "exaone4",
                       "smollm3", "phi3", "glm4", "ernie4_5", "cohere2")


def trainable(shape: "ModelShape") -> str | None:
    """None when the training core can build `shape`; otherwise the one line saying why (the solver still plans
    it): `recipe launch` checks it before any worker starts, `recipe models` shows it."""
    if shape.arch == "dense" and shape.hf_model_type not in TRAINED_DENSE_TYPES:
        return (f"{shape.name}: model_type {shape.hf_model_type!r} was read by its standard fields as a Llama block, "
                f"which its own norms, activations or attention may not be: planned by `recipe solve`, not trained by "
                f"this core")
    if shape.arch not in TRAINED_ARCHS and not (shape.arch == "moe" and shape.hf_model_type == "gemma4_text"):
        return (f"{shape.name}: arch {shape.arch!r} is planned by `recipe solve` but not trained by this core (it "
                f"trains {', '.join(TRAINED_ARCHS)}: Qwen3.5, Qwen3-Next, Qwen3-MoE (and Qwen3-VL-MoE's text model, "
                f"Mellum 2), Gemma 4, "
                f"Qwen2-MoE, OLMoE (and FlexOlmo), ERNIE-4.5, MiniMax-M2, Mixtral, DeepSeek-V2, V3 (Kimi-K2, "
                f"Moonlight, Kimi-Linear, Mistral 4, A.X K1) and V3.2 (A.X K2), GLM-5, GLM-4.5 (and dots.llm1, Solar Open, "
                f"MiMo-V2-Flash, Hunyuan-V3, K-EXAONE, AFMoE, Step-3.7, Laguna), Cohere2-MoE, gpt-oss, Llama 4, "
                f"Granite MoE, Hunyuan-A13B and dense Llama/Qwen/Mistral stacks; "
                f"not ERNIE-4.5 with biases or "
                f"dense layers after its MoE ones, Qwen2-MoE with dense layers among its MoE ones, or MiniMax-M2 "
                f"with per-head q/k norms, a shared expert or softmax scoring)")
    sc = shape.rope_scaling
    unsupported = [what for what, present in (
        ("sliding-window attention with MLA", bool(shape.sliding_window) and shape.mla is not None),
        ("a sliding_window on no sliding_attention layer", bool(shape.sliding_window) and shape.num_sliding_layers == 0),
        ("sliding_attention layers without a sliding_window",
         shape.num_sliding_layers > 0 and not shape.sliding_window),
        ("chunked attention outside Llama 4", shape.num_chunked_layers > 0 and shape.arch != "llama4"),
        ("MiMo-V2-Flash's attention (v_head_dim, value_scale) outside MiMo-V2-Flash",
         shape.hf_model_type != "mimo_v2_flash" and (shape.v_head_dim is not None or shape.value_scale != 1.0)),
        ("sliding layers' own KV heads outside MiMo-V2-Flash and Gemma 4", shape.sliding_kv_heads is not None
         and shape.hf_model_type not in ("mimo_v2_flash", "gemma4_text")),
        ("sink logits or a sliding layers' RoPE base outside gpt-oss, MiMo-V2-Flash and Granite-SWA",
         (shape.sinks != "none" or shape.sliding_rope_theta is not None)
         and shape.hf_model_type not in ("mimo_v2_flash", "granitemoe_swa", "step3p5", "mellum", "laguna",
                                         "gemma4_text", "gemma3_text")),
        ("sliding layers' own query heads, or a gate per query head, outside Step-3.7 and Laguna",
         shape.hf_model_type not in ("step3p5", "laguna") and (shape.sliding_heads is not None or shape.head_gate)),
        ("sliding layers' own rotated share outside Step-3.7, Laguna and Gemma",
         shape.hf_model_type not in ("step3p5", "laguna", "gemma4_text", "gemma3_text")
         and shape.sliding_rotary_factor is not None),
        ("Gemma 4's blocks (a sliding layers' head width of its own, keys as values, a dense MLP beside the experts, "
         "proportional RoPE) outside Gemma 4", shape.hf_model_type != "gemma4_text" and (
             shape.sliding_head_dim is not None or shape.keys_as_values or shape.dense_beside_experts
             or shape.rope_proportional)),
        ("Gemma 4 without its dense MLP beside the experts or its sandwich norms", shape.hf_model_type == "gemma4_text"
         and (shape.norm_placement != "sandwich" or (shape.arch != "dense" and (
             not shape.dense_beside_experts or shape.first_dense_layers > 0)))),
        ("proportional RoPE under RoPE scaling", shape.rope_proportional and shape.rope_scaling is not None),
        ("a softplus gate per query head outside Laguna",
         shape.head_gate_activation != "sigmoid" and shape.hf_model_type != "laguna"),
        ("Step-3.7's clamped SwiGLU outside Step-3.7", shape.hf_model_type != "step3p5" and (
            bool(shape.swiglu_limits) or bool(shape.swiglu_limits_shared))),
        ("(1 + w) norms outside Step-3.7 and Gemma", shape.offset_norms
         and shape.hf_model_type not in ("step3p5", "gemma3_text", "gemma")),
        ("a query_pre_attn_scalar outside Step-3.7 and Gemma", shape.query_pre_attn_scalar is not None
         and shape.hf_model_type not in ("step3p5", "gemma4_text", "gemma3_text")),
        ("a norm on the MoE block's output (moe_output_norm) outside A.X K1",
         shape.moe_output_norm and shape.hf_model_type != "axk1"),
        ("a query scale by position (query_scale_period) outside Mistral 4",
         shape.query_scale_period is not None and shape.hf_model_type != "mistral4"),
        ("Mistral 4's expert groups (n_group > 1: a group scored by its two most probable experts, where the core's "
         "grouped softmax router scores it by its best)",
         shape.hf_model_type == "mistral4" and shape.softmax_router is not None and shape.softmax_router.groups > 1),
        ("full layers without RoPE (nope_full_layers) outside K-EXAONE, AFMoE, Granite-SWA, Cohere2-MoE and "
         "Kimi-Linear",
         shape.nope_full_layers and shape.hf_model_type not in ("exaone_moe", "exaone4", "afmoe", "granitemoe_swa",
                                                                 "cohere2_moe", "cohere2", "kimi_linear")),
        ("Kimi Delta Attention, or linear attention beside MLA, outside Kimi-Linear",
         shape.linear_attn is not None and (shape.linear_attn.kind == "kda" or shape.mla is not None)
         and shape.hf_model_type != "kimi_linear"),
        ("Kimi-Linear without its KDA and MLA layers", shape.hf_model_type == "kimi_linear" and (
            shape.linear_attn is None or shape.linear_attn.kind != "kda" or shape.mla is None)),
        ("sandwich or post norms, or a scaled embedding, outside AFMoE, FlexOlmo, OLMo and Gemma",
         (shape.norm_placement in ("sandwich", "post") or shape.embedding_scale != 1.0)
         and shape.hf_model_type not in ("afmoe", "flex_olmo", "gemma4_text", "gemma3_text", "gemma", "olmo2",
                                         "olmo3", "exaone4", "glm4")),
        ("Cohere's blocks (a parallel block, LayerNorms, RoPE on pairs, a logit scale, the experts' mean, sigmoid "
         "selection, a rotated prefix) outside Cohere2-MoE",
         (shape.norm_placement == "parallel" or shape.norm_kind != "rms" or shape.logit_scale != 1.0
          or shape.shared_expert_mean or shape.sigmoid_top or shape.rotated_prefix)
         and shape.hf_model_type not in ("cohere2_moe", "cohere2")),
        ("RoPE on channel pairs outside Cohere2, GLM-4 and ERNIE-4.5", shape.rope_pairs
         and shape.hf_model_type not in ("cohere2_moe", "cohere2", "glm4", "ernie4_5")),
        ("a sliding layers' RoPE base under RoPE scaling", shape.sliding_rope_theta is not None
         and shape.rope_scaling is not None and not shape.sliding_rope_plain),
        ("sliding layers without the RoPE scaling outside Step-3.7, Mellum, Laguna, Gemma 3 and OLMo 3",
         shape.sliding_rope_plain and shape.hf_model_type not in ("step3p5", "mellum", "laguna", "gemma3_text", "olmo3")),
        ("a DeepSeek model without its router", shape.arch == "deepseek_v3" and shape.sigmoid_router is None
         and shape.softmax_router is None),
        (f"RoPE scaling {sc.kind if sc else ''!r}", sc is not None and (
            sc.kind not in ROPE_SCALINGS or (sc.kind == "dynamic" and sc.alpha is None))))
                   if present]
    if unsupported:
        return f"{shape.name}: {' and '.join(unsupported)} is planned by `recipe solve` but not trained by this core"
    return None


def _positive(rec, names, strict: bool = True) -> None:
    for n in names:
        v = getattr(rec, n)
        if isinstance(v, bool) or not isinstance(v, int) or (v <= 0 if strict else v < 0):
            raise ValueError(f"{n} must be a {'positive' if strict else 'non-negative'} integer, got {v!r}")


GPT_OSS_SWIGLU_LIMIT = 7.0  # gpt-oss's clamp of the GLU's gate and up values (its config's `swiglu_limit`)
# gpt-oss's published rope_scaling, and transformers' default for a gpt_oss config without one
GPT_OSS_ROPE_SCALING = RopeScaling(kind="yarn", factor=32.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0,
                                   truncate=False)


@dataclass(frozen=True, kw_only=True)
class ModelShape(Record):
    name: str
    # dense: every layer a dense FFN (num_experts = top_k = 1, first_dense_layers = num_layers), EP = 1;
    # moe: a standard softmax-routed MoE (the forms of Qwen2-MoE, OLMoE and ERNIE-4.5 the core does not train,
    # unknown types); qwen2_moe: Qwen2-MoE (q/k/v biases, gated shared expert);
    # olmoe: OLMoE (q/k norms over all heads together); ernie4_5_moe: ERNIE-4.5 MoE (softmax scores steered by a
    # correction bias, interleaved RoPE: launch/model.py);
    # glm4_moe: GLM-4.5 (sigmoid router, shared experts, dense first layers, partial RoPE);
    # minimax_m2: MiniMax-M2 (q/k norms over all heads together, partial RoPE, sigmoid router, no shared expert);
    # qwen3_5: Qwen3.5 dense (Gated DeltaNet + gated attention, dense FFN);
    # llama4: Llama 4 (chunked and global attention, `llama4`; sigmoid top-k weights on the experts' input);
    # granitemoe: Granite 3.x MoE (Mixtral's block, `granite` multipliers, an optional shared expert);
    # hunyuan_moe: Hunyuan-A13B (per-head q/k norms after RoPE, a plain shared expert, NTK-alpha RoPE)
    arch: Literal["qwen3_5_moe", "qwen3_next", "qwen3_moe", "qwen2_moe", "olmoe", "ernie4_5_moe", "minimax_m2",
                  "deepseek_v3", "gpt_oss", "mixtral", "glm4_moe", "llama4", "granitemoe", "hunyuan_moe", "dense",
                  "moe", "qwen3_5", "deepseek_v4"]
    hidden_size: Pos
    num_layers: Pos
    vocab_size: Pos
    layer_types: tuple[LayerType, ...]
    # attention
    num_heads: Pos
    num_kv_heads: Pos
    head_dim: Pos
    attn_output_gate: bool = False  # Qwen3.5: q_proj also emits a sigmoid gate per head channel
    qk_norm: bool = True
    attn_bias: bool = False
    partial_rotary_factor: float = 1.0  # in (0, 1]
    rope_theta: float = 1e6
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    sliding_window: int | None = None
    # chunked_attention layers: a query sees the keys of its own chunk of this many positions of its document
    attention_chunk: int | None = None
    llama4: Llama4Attention | None = None  # Llama 4's RoPE-free global layers and q/k scaling (arch llama4)
    granite: GraniteScales | None = None  # Granite's multipliers (arch granitemoe)
    clip_qkv: float | None = None  # OLMoE's clip_qkv: q and k (after their norms) and v clamped to ±this
    # DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): MLA whose queries attend to the keys an indexer picks
    dsa: SparseAttentionShape | None = None
    block_sparse: BlockSparseShape | None = None  # MiniMax-M3's block-sparse layers (planned, not trained)
    # DeepSeek-V4's compressed attention, hyper-connections and hash routing (arch deepseek_v4: planned, not trained)
    compressed: CompressedAttentionShape | None = None
    mla: MLAShape | None = None
    linear_attn: LinearAttnShape | None = None
    # MoE
    num_experts: Pos
    top_k: Pos
    expert_ffn: Pos  # routed expert intermediate size (SwiGLU)
    shared_expert_ffn: NonNeg = 0  # 0 = no shared expert
    shared_expert_gate: bool = False  # sigmoid gate on the shared expert's output
    norm_topk_prob: bool = True  # renormalize the top-k router weights
    router_bias: bool = False
    sigmoid_router: SigmoidRouter | None = None  # None: softmax top-k
    softmax_router: SoftmaxRouter | None = None  # DeepSeek-V2's grouped softmax top-k (None: plain softmax top-k)
    first_dense_layers: NonNeg = 0  # leading layers with a dense FFN instead of MoE
    # after those, layer i is MoE only where (i + 1) is a multiple of this (Llama 4's interleave_moe_layer_step,
    # Qwen2-MoE's decoder_sparse_step); the others have the dense FFN
    moe_layer_step: Pos = 1
    dense_ffn: NonNeg = 0
    # embeddings, norms
    tie_embeddings: bool = False
    pad_token_id: int | None = None  # the embedding row transformers never updates (its padding_idx)
    rms_norm_eps: float = 1e-6
    max_position: int = 262144
    mtp_layers: NonNeg = 0  # multi-token-prediction layers (counted apart from the text stack)
    # attention that differs by layer (MiMo-V2-Flash): the sliding layers' own key/value heads and RoPE base (None: the
    # full layers'), a sink logit per head on the sliding layers only or on all (`sinks`; Granite-SWA: all), value
    # heads narrower than the query/key heads (None: head_dim), and the values scaled by `value_scale` before
    # attention
    sliding_kv_heads: int | None = None
    sliding_rope_theta: float | None = None
    sinks: Literal["none", "sliding", "all"] = "none"  # (gpt-oss has them on every layer by its arch)
    v_head_dim: int | None = None
    value_scale: float = 1.0
    # Step-3.7's attention: the sliding layers' own query heads and rotated share (None: num_heads,
    # partial_rotary_factor), a sigmoid gate per query head from its own projection of the layer's input
    # (`head_gate`), and the softmax scale query_pre_attn_scalar^-1/2 (None: the q·k head size's)
    sliding_heads: int | None = None
    sliding_rotary_factor: float | None = None
    head_gate: bool = False
    head_gate_activation: Literal["sigmoid", "softplus"] = "sigmoid"  # the gate's (Laguna's: softplus)
    query_pre_attn_scalar: float | None = None
    # Gemma 4's attention and FFN: the sliding layers' own head width (None: head_dim, the full layers'); the full
    # layers' values are their keys' projection (no value projection, `attention_k_eq_v`); each MoE layer runs its
    # dense MLP beside the experts (planned as the shared expert, `shared_expert_ffn` wide), the two sides' inputs
    # and outputs normed apart (three RMSNorms a layer more than the sandwich's four), the router's input scaled per
    # channel and its weights per expert
    sliding_head_dim: int | None = None
    keys_as_values: bool = False
    dense_beside_experts: bool = False
    # Gemma 4's full layers' "proportional" RoPE: their rotated share's pair frequencies base^(-2i / head_dim) (the
    # whole head width's spacing, not the share's), pair i rotating channels (i, i + head_dim / 2), the other pairs
    # still
    rope_proportional: bool = False
    # the logits soft-capped before the softmax, c · tanh(z / c) (Gemma 4's final_logit_softcapping; None: not)
    final_logit_softcap: float | None = None
    # Step-3.7's clamped SwiGLU, by layer (0: none): min(silu(gate), L) · clamp(up, -L, L), L the routed experts'
    # bound (`swiglu_limits`) or the shared expert's and dense MLP's (`swiglu_limits_shared`); () : no layer clamps
    swiglu_limits: tuple[float, ...] = ()
    swiglu_limits_shared: tuple[float, ...] = ()
    offset_norms: bool = False  # RMSNorms scale by (1 + w) outside the Qwen3.5 archs (Step-3.7's, Gemma's form)
    # the RoPE scaling is the full layers' alone, the sliding ones rotate plain (Step-3.7's `rope_parameters`)
    sliding_rope_plain: bool = False
    # the full-attention layers take no RoPE where the sliding layers do (K-EXAONE's, AFMoE's global layers;
    # Kimi-Linear's MLA layers, beside its KDA ones)
    nope_full_layers: bool = False
    # Mistral 4's query scale by position p in the document: q · (1 + beta · log(1 + ⌊p / period⌋)) on every layer
    # (its `rope_parameters.llama_4_scaling_beta` and `original_max_position_embeddings`); None: no scale
    query_scale_period: int | None = None
    query_scale_beta: float = 0.0
    # an RMSNorm on each MoE block's output (its routed and shared experts' sum) before the residual add, on the MoE
    # layers only (A.X K1's `post_mlp_layernorm`)
    moe_output_norm: bool = False
    # A.X K2's block norms with a low-rank sigmoid gate, y · σ(W_up silu(W_down y)) with y the RMSNorm's output and
    # W_down rank × hidden: the input norm of every layer and the FFN's norm of the MoE layers (0: plain norms)
    gated_norm_rank: NonNeg = 0
    # the dense prefix layers take RoPE whatever their kind (Cohere2-MoE's prefix of sliding-window pattern 1, whose
    # layers are all full)
    rotated_prefix: bool = False
    # layers whose attention takes no RoPE, by index (SmolLM3's `no_rope_layers` zeros); () : none by this rule
    nope_layers: tuple[int, ...] = ()
    # where a block's RMSNorms sit: before each sublayer ("pre"), before and after it ("sandwich": AFMoE), or after
    # it only ("post": FlexOlmo, OLMo-2's blocks)
    # ("parallel": one norm, whose output both sublayers take, their outputs added to the residual together: Cohere's)
    norm_placement: Literal["pre", "sandwich", "post", "parallel"] = "pre"
    norm_kind: Literal["rms", "layer"] = "rms"  # the blocks' norms: RMSNorm, or Cohere's LayerNorm (centred, no bias)
    embedding_scale: float = 1.0  # the input embedding's rows times this (AFMoE's muP: √hidden_size)
    logit_scale: float = 1.0  # the logits times this (Cohere's logit_scale)
    rope_pairs: bool = False  # RoPE on channel pairs (0, 1), (2, 3), … rather than halves (Cohere's)
    shared_expert_mean: bool = False  # the MoE's output the mean of the routed and shared experts' (Cohere's "average")
    # the k experts chosen on the router's logits and weighted by the sigmoid of each, renormalized under
    # norm_topk_prob (Cohere2-MoE's "sigmoid" expert selection; Llama 4's router, by its arch)
    sigmoid_top: bool = False
    # the Hugging Face model_type an export writes where the arch's blocks serve several (glm4_moe_lite: GLM-4.7-Flash
    # on DeepSeek-V3's); None: the arch's own
    hf_model_type: str | None = None
    source: str = ""  # where the figures come from

    def __post_init__(self) -> None:
        _positive(self, ("hidden_size", "num_layers", "vocab_size", "num_heads", "num_kv_heads", "head_dim",
                         "num_experts", "top_k", "expert_ffn"))
        _positive(self, ("shared_expert_ffn", "first_dense_layers", "dense_ffn", "mtp_layers"), strict=False)
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        _positive(self, ("moe_layer_step",))
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"unknown layer type {bad[0]!r} ({', '.join(LAYER_TYPES)})")
        if self.attention_chunk is not None:
            _positive(self, ("attention_chunk",))
        if "chunked_attention" in self.layer_types and not self.attention_chunk:
            raise ValueError("layer_types has chunked_attention layers but no attention_chunk")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries but num_layers={self.num_layers}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.sliding_kv_heads is not None:
            _positive(self, ("sliding_kv_heads",))
        if self.sliding_heads is not None:
            _positive(self, ("sliding_heads",))
        if self.sliding_kv_heads is not None or self.sliding_heads is not None:
            heads, kv = self.heads_at("sliding_attention"), self.kv_heads_at("sliding_attention")
            if heads % kv:
                raise ValueError(f"the sliding layers' {heads} attention heads are not a multiple of their {kv} KV "
                                 f"heads")
        if self.sliding_head_dim is not None:
            _positive(self, ("sliding_head_dim",))
        if self.dense_beside_experts and not self.shared_expert_ffn:
            raise ValueError("dense_beside_experts needs the dense MLP's width as shared_expert_ffn")
        if self.sliding_rotary_factor is not None and not 0 < self.sliding_rotary_factor <= 1:
            raise ValueError(f"sliding_rotary_factor must be in (0, 1], got {self.sliding_rotary_factor}")
        for name in ("swiglu_limits", "swiglu_limits_shared"):
            v = tuple(getattr(self, name))
            object.__setattr__(self, name, v)
            if v and (len(v) != self.num_layers or not all(
                    not isinstance(x, bool) and isinstance(x, (int, float)) and 0 <= x < math.inf for x in v)):
                raise ValueError(f"{name} must be empty or hold a bound ≥ 0 (0: none) for each of the "
                                 f"{self.num_layers} layers, got {list(v)[:8]}")
        if self.v_head_dim is not None:
            _positive(self, ("v_head_dim",))
            if self.v_head_dim > self.head_dim:
                raise ValueError(f"v_head_dim={self.v_head_dim} is wider than head_dim={self.head_dim}")
        if self.norm_placement not in ("pre", "sandwich", "post", "parallel"):
            raise ValueError(f"norm_placement must be pre, sandwich, post or parallel, got {self.norm_placement!r}")
        if self.norm_kind not in ("rms", "layer"):
            raise ValueError(f"norm_kind must be rms or layer, got {self.norm_kind!r}")
        if self.sinks not in ("none", "sliding", "all"):
            raise ValueError(f"sinks must be none, sliding or all, got {self.sinks!r}")
        for name in ("sliding_rope_theta", "value_scale", "embedding_scale", "logit_scale", "query_pre_attn_scalar",
                     "final_logit_softcap"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf):
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} > num_experts={self.num_experts}")
        if self.num_compressed_layers and self.compressed is None:
            raise ValueError("layer_types has compressed attention layers but no compressed shape (DeepSeek-V4's)")
        if self.compressed is not None:
            if self.num_full_attn_layers or self.num_linear_attn_layers or self.num_chunked_layers:
                raise ValueError("a DeepSeek-V4 shape's layers are sliding_attention, compressed_sparse_attention and "
                                 "heavily_compressed_attention")
            if not self.sliding_window or self.num_kv_heads != 1 or self.num_heads % self.compressed.o_groups:
                raise ValueError("DeepSeek-V4's attention has a sliding_window, one key/value head and o_groups "
                                 "dividing its heads")
            if self.compressed.hash_layers > self.num_moe_layers:
                raise ValueError(f"hash_layers={self.compressed.hash_layers} > the {self.num_moe_layers} MoE layers")
        if "linear_attention" in self.layer_types and self.linear_attn is None:
            raise ValueError("layer_types has linear_attention layers but no linear_attn shape")
        if self.num_dense_layers and not self.dense_ffn:
            raise ValueError(f"{self.num_dense_layers} dense layers (first_dense_layers={self.first_dense_layers}, "
                             f"moe_layer_step={self.moe_layer_step}) need dense_ffn > 0")
        if self.dsa is not None:
            if self.mla is None or not self.mla.q_lora_rank:
                raise ValueError("dsa (DeepSeek sparse attention) needs multi-head latent attention with a q_lora_rank "
                                 "(its indexer's queries come from the q latent)")
            if any(i >= self.num_layers for i in self.dsa.shared_layers):
                raise ValueError(f"dsa.shared_layers {list(self.dsa.shared_layers)} names layers past the model's "
                                 f"{self.num_layers}")
        if self.block_sparse is not None:
            b = self.block_sparse
            if any(not 0 <= i < self.num_layers or self.layer_types[i] != "full_attention" for i in b.layers):
                raise ValueError(f"block_sparse.layers {list(b.layers)} must name full-attention layers of the "
                                 f"model's {self.num_layers}")
            if self.num_kv_heads % b.index_heads:
                raise ValueError(f"block_sparse.index_heads={b.index_heads} must divide the {self.num_kv_heads} KV "
                                 f"heads (one selection a KV head group)")
        if self.clip_qkv is not None and not (isinstance(self.clip_qkv, (int, float)) and self.clip_qkv > 0):
            raise ValueError(f"clip_qkv must be a positive number, got {self.clip_qkv!r}")
        if self.first_dense_layers > self.num_layers:
            raise ValueError(f"first_dense_layers={self.first_dense_layers} > num_layers={self.num_layers}")
        if sum((self.sigmoid_router is not None, self.softmax_router is not None, self.sigmoid_top)) > 1:
            raise ValueError("a model has one router: two of sigmoid_router, softmax_router and sigmoid_top are set")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id={self.pad_token_id} is not a token of the {self.vocab_size}-row vocabulary")

    # ---- derived shape facts -------------------------------------------------------------------------------
    @property
    def has_sinks(self) -> bool:
        """Whether attention has a sink logit per query head on some layers (gpt-oss: all; MiMo-V2-Flash: the
        sliding ones)."""
        return self.arch == "gpt_oss" or self.sinks != "none"

    def sinks_at(self, kind: str) -> bool:
        """Whether a `kind` attention layer has the sink logits."""
        return self.arch == "gpt_oss" or self.sinks == "all" or (
            self.sinks == "sliding" and kind == "sliding_attention")

    def heads_at(self, kind: str) -> int:
        """The query heads of a `kind` attention layer."""
        return self.sliding_heads if kind == "sliding_attention" and self.sliding_heads else self.num_heads

    def head_dim_at(self, kind: str) -> int:
        """The q·k head width of a `kind` attention layer (outside MLA)."""
        return self.sliding_head_dim if kind == "sliding_attention" and self.sliding_head_dim else self.head_dim

    def value_width_at(self, kind: str) -> int:
        """A value head's channels in a `kind` attention layer (outside MLA): v_head_dim where set, else the
        layer's head width."""
        return self.v_head_dim or self.head_dim_at(kind)

    def rotary_factor_at(self, kind: str) -> float:
        """The share of a `kind` attention layer's head channels RoPE rotates."""
        return (self.sliding_rotary_factor if kind == "sliding_attention" and self.sliding_rotary_factor
                else self.partial_rotary_factor)

    @functools.cached_property
    def max_heads(self) -> int:
        """The most query heads any attention layer has."""
        return max(self.num_heads, self.sliding_heads or 0)

    def kv_heads_at(self, kind: str) -> int:
        """The key/value heads of a `kind` attention layer."""
        return self.sliding_kv_heads if kind == "sliding_attention" and self.sliding_kv_heads else self.num_kv_heads

    def rope_theta_at(self, kind: str) -> float:
        """The RoPE base of a `kind` attention layer."""
        return self.sliding_rope_theta if kind == "sliding_attention" and self.sliding_rope_theta else self.rope_theta

    @functools.cached_property
    def mean_kv_width(self) -> float:
        """Key channels an attention layer holds a token, on average over the attention layers: each layer's KV
        heads at its head width (what CP all-gathers of k, and of v at the same width)."""
        n = self.num_attention_layers
        return sum(self.kv_heads_at(t) * self.head_dim_at(t) for t in self.layer_types
                   if t != "linear_attention") / n if n else 0.0

    def tp_splits(self) -> list[tuple[int, str]]:
        """(count, what) of each thing tensor parallelism splits by whole units, so tp must divide it: the query
        heads, the KV heads (DeepSeek-V4's one K = V head stays whole on every rank; its output groups split),
        the sliding layers' KV heads, Gated DeltaNet's key heads (Kimi Delta Attention's heads), the vocabulary."""
        out = [(self.num_heads, "attention heads")]
        out.append((self.compressed.o_groups, "output projection groups") if self.compressed is not None
                   else (self.num_kv_heads, "KV heads"))
        if self.sliding_kv_heads is not None:
            out.append((self.sliding_kv_heads, "sliding layers' KV heads"))
        if self.sliding_heads is not None:
            out.append((self.sliding_heads, "sliding layers' attention heads"))
        if self.linear_attn is not None:
            out.append((self.linear_attn.num_k_heads, "KDA heads" if self.linear_attn.kind == "kda"
                        else "linear-attention key heads"))
        return out + [(self.vocab_size, "vocab entries")]

    @property
    def tp_refusal(self) -> str | None:
        """Why tensor parallelism cannot run this model at any tp > 1 (None where it can): a tied embedding and LM
        head, which it does not split."""
        return "ties its embedding to the LM head, which tensor parallelism does not split" if self.tie_embeddings \
            else None

    def rotated(self, i: int) -> bool:
        """Whether layer i's attention takes RoPE by the shape's rules (`nope_full_layers`, `rotated_prefix`,
        `nope_layers`; Llama 4's global layers go without it by its arch)."""
        if self.rotated_prefix and i < self.first_dense_layers:
            return True
        return not (self.nope_full_layers and self.layer_types[i] == "full_attention") and i not in self.nope_layers

    @property
    def moe_output_saved(self) -> bool:
        """Whether a norm after the MoE block keeps its output for the backward (norm_placement "sandwich" or
        "post", or `moe_output_norm`): a recomputed forward must then return the experts' output, where otherwise it
        skips that."""
        return self.norm_placement in ("sandwich", "post") or self.moe_output_norm

    @property
    def whole_qk_norm(self) -> bool:
        """Whether the q/k RMSNorms span all heads of a token together (OLMoE's, MiniMax-M2's, dense OLMo's), not
        each head apart."""
        return self.arch in WHOLE_QK_NORM_ARCHS or self.hf_model_type in WHOLE_QK_NORM_TYPES

    @property
    def value_width(self) -> int:
        """A value head's channels (outside MLA): v_head_dim where set, else head_dim."""
        return self.v_head_dim or self.head_dim

    @functools.cached_property
    def num_full_attn_layers(self) -> int:
        return sum(t == "full_attention" for t in self.layer_types)

    @functools.cached_property
    def num_linear_attn_layers(self) -> int:
        return sum(t == "linear_attention" for t in self.layer_types)

    @functools.cached_property
    def num_sliding_layers(self) -> int:
        return sum(t == "sliding_attention" for t in self.layer_types)

    @functools.cached_property
    def num_chunked_layers(self) -> int:
        return sum(t == "chunked_attention" for t in self.layer_types)

    @functools.cached_property
    def num_compressed_layers(self) -> int:
        """DeepSeek-V4's compressed attention layers (sparse and heavy)."""
        return sum(t in COMPRESSED_LAYER_TYPES for t in self.layer_types)

    @property
    def num_attention_layers(self) -> int:
        """Layers whose mixer is softmax attention: full, sliding, chunked and compressed."""
        return (self.num_full_attn_layers + self.num_sliding_layers + self.num_chunked_layers
                + self.num_compressed_layers)

    def is_dense_layer(self, i: int) -> bool:
        """Whether layer i has the dense FFN (one of the first_dense_layers, or off the moe_layer_step)."""
        return i < self.first_dense_layers or (i + 1) % self.moe_layer_step != 0

    @functools.cached_property
    def num_dense_layers(self) -> int:
        return sum(self.is_dense_layer(i) for i in range(self.num_layers))

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    def with_layers(self, num_layers: int) -> "ModelShape":
        """The same model cut to its first `num_layers` layers (for validation runs on few GPUs)."""
        if num_layers <= 0:
            raise ValueError(f"--layers must be positive, got {num_layers}")
        if num_layers > self.num_layers:
            raise ValueError(f"--layers {num_layers} exceeds the model's {self.num_layers} layers")
        dsa = self.dsa
        if dsa is not None and dsa.shared_layers:
            dsa = dsa.model_copy(update={"shared_layers": tuple(i for i in dsa.shared_layers if i < num_layers)})
        block_sparse = self.block_sparse
        if block_sparse is not None:
            block_sparse = block_sparse.model_copy(update={"layers": tuple(i for i in block_sparse.layers
                                                                           if i < num_layers)})
        compressed = self.compressed
        if compressed is not None:  # the hash-routed layers lead: as many of them as the cut keeps
            compressed = compressed.model_copy(update={"hash_layers": min(compressed.hash_layers, num_layers)})
        return self.model_copy(
            update={
                "dsa": dsa,
                "block_sparse": block_sparse,
                "compressed": compressed,
                "num_layers": num_layers,
                "layer_types": self.layer_types[:num_layers],
                "first_dense_layers": min(self.first_dense_layers, num_layers),
                **{k: (lim[:num_layers] if any(lim[:num_layers]) else ()) for k in ("swiglu_limits",
                                                                                  "swiglu_limits_shared")
                   if (lim := getattr(self, k))},
                "name": self.name if num_layers == self.num_layers else f"{self.name}@{num_layers}L",
            }
        )

    def fingerprint_dict(self) -> dict:
        # a shape without the routing, RoPE-scaling or pad records keeps the fingerprint it had before they existed
        unset = {k for k in ("sigmoid_router", "softmax_router", "rope_scaling", "pad_token_id", "attention_chunk",
                             "llama4", "hf_model_type", "granite", "clip_qkv", "dsa", "sliding_kv_heads",
                             "sliding_rope_theta", "v_head_dim", "compressed", "sliding_heads",
                             "sliding_rotary_factor", "query_pre_attn_scalar", "query_scale_period",
                             "sliding_head_dim", "final_logit_softcap", "block_sparse")
                 if getattr(self, k) is None}
        unset |= {k for k, default in (("moe_layer_step", 1), ("sinks", "none"), ("value_scale", 1.0),
                                       ("nope_full_layers", False), ("norm_placement", "pre"),
                                       ("embedding_scale", 1.0), ("norm_kind", "rms"), ("logit_scale", 1.0),
                                       ("rope_pairs", False), ("shared_expert_mean", False), ("sigmoid_top", False),
                                       ("rotated_prefix", False), ("head_gate", False), ("swiglu_limits", ()),
                                       ("swiglu_limits_shared", ()), ("offset_norms", False),
                                       ("sliding_rope_plain", False), ("query_scale_beta", 0.0),
                                       ("moe_output_norm", False), ("head_gate_activation", "sigmoid"),
                                       ("keys_as_values", False), ("dense_beside_experts", False),
                                       ("rope_proportional", False), ("gated_norm_rank", 0), ("nope_layers", ()))
                  if getattr(self, k) == default}
        out = plain(self, exclude=frozenset({"source"} | unset))
        if self.rope_scaling is not None and self.rope_scaling.alpha is None:  # nor does a scaling without alpha
            del out["rope_scaling"]["alpha"]
        if self.linear_attn is not None and self.linear_attn.kind == "gated_delta":  # nor a Gated DeltaNet's kind
            del out["linear_attn"]["kind"]
        if self.mla is not None and not self.mla.query_gate:  # nor an MLA without A.X K2's query gate
            del out["mla"]["query_gate"]
        return out


def _rounded_layer_types(num_layers: int, interval: int, other: str = "linear_attention") -> tuple[LayerType, ...]:
    """Every `interval`-th layer full attention, the rest `other`: Qwen3-Next/Qwen3.5's linear layers; K-EXAONE's,
    AFMoE's and Cohere2-MoE's sliding ones."""
    return tuple("full_attention" if (i + 1) % interval == 0 else other for i in range(num_layers))


def _qwen35(name: str, hidden: int, layers: int, heads: int, experts: int, top_k: int, ffn: int, v_heads: int,
            vocab: int = 248320, arch: str = "qwen3_5_moe", source: str = "") -> ModelShape:
    return ModelShape(
        name=name, arch=arch, hidden_size=hidden, num_layers=layers, vocab_size=vocab,
        layer_types=_rounded_layer_types(layers, 4), num_heads=heads, num_kv_heads=2, head_dim=256,
        attn_output_gate=True, partial_rotary_factor=0.25, rope_theta=1e7,
        linear_attn=LinearAttnShape(num_k_heads=16, num_v_heads=v_heads, head_k_dim=128, head_v_dim=128),
        num_experts=experts, top_k=top_k, expert_ffn=ffn, shared_expert_ffn=ffn, shared_expert_gate=True,
        norm_topk_prob=True, max_position=262144, mtp_layers=1, source=source,
    )


_PRESET_FACTORIES: dict[str, Callable[[], ModelShape]] = {
    "qwen35-35b": lambda: _qwen35("qwen35-35b", 2048, 40, 16, 256, 8, 512, 32,
                source="Qwen/Qwen3.5-35B-A3B config.json (text_config)"),
    "qwen35-122b": lambda: _qwen35("qwen35-122b", 3072, 48, 32, 256, 8, 1024, 64,
                source="Qwen/Qwen3.5-122B-A10B config.json (text_config)"),
    "qwen35-397b": lambda: _qwen35("qwen35-397b", 4096, 60, 32, 512, 10, 1024, 64,
                source="Qwen/Qwen3.5-397B-A17B config.json (text_config)"),
    "qwen3-next-80b": lambda: _qwen35("qwen3-next-80b", 2048, 48, 16, 512, 10, 512, 32, vocab=151936, arch="qwen3_next",
                source="Qwen/Qwen3-Next-80B-A3B-Instruct config.json"),
    "qwen3-30b-a3b": lambda: ModelShape(
            name="qwen3-30b-a3b", arch="qwen3_moe", hidden_size=2048, num_layers=48, vocab_size=151936,
            layer_types=("full_attention",) * 48, num_heads=32, num_kv_heads=4, head_dim=128, rope_theta=1e6,
            num_experts=128, top_k=8, expert_ffn=768, max_position=40960,
            source="Qwen/Qwen3-30B-A3B config.json",
        ),
    "qwen3-235b-a22b": lambda: ModelShape(
            name="qwen3-235b-a22b", arch="qwen3_moe", hidden_size=4096, num_layers=94, vocab_size=151936,
            layer_types=("full_attention",) * 94, num_heads=64, num_kv_heads=4, head_dim=128, rope_theta=1e6,
            num_experts=128, top_k=8, expert_ffn=1536, max_position=40960,
            source="Qwen/Qwen3-235B-A22B config.json",
        ),
    "deepseek-v3": lambda: ModelShape(
            name="deepseek-v3", arch="deepseek_v3", hidden_size=7168, num_layers=61, vocab_size=129280,
            layer_types=("full_attention",) * 61, num_heads=128, num_kv_heads=128, head_dim=192, qk_norm=False,
            mla=MLAShape(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                         v_head_dim=128),
            num_experts=256, top_k=8, expert_ffn=2048, shared_expert_ffn=2048, router_bias=True,
            sigmoid_router=SigmoidRouter(groups=8, topk_groups=4, scaling=2.5),
            first_dense_layers=3, dense_ffn=18432, rope_theta=10000.0, max_position=163840, mtp_layers=1,
            rope_scaling=RopeScaling(kind="yarn", factor=40.0, original_max_position=4096, beta_fast=32.0,
                                     beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
            source="deepseek-ai/DeepSeek-V3 config.json",
        ),
    # DeepSeek-V3.2: DeepSeek-V3's stack with DeepSeek sparse attention (its indexer's 64 heads of 128 keep 2,048
    # keys a query)
    "deepseek-v32": lambda: _PRESET_FACTORIES["deepseek-v3"]().model_copy(update=dict(
            name="deepseek-v32", hf_model_type="deepseek_v32",
            dsa=SparseAttentionShape(topk=2048, index_heads=64, index_head_dim=128),
            source="deepseek-ai/DeepSeek-V3.2 config.json (DeepSeek-V3's and the index_* fields)")),
    # GLM-5 (744B, 40B active): DSA on MLA, every layer indexing, its indexer's RoPE in pairs
    "glm5": lambda: ModelShape(
            name="glm5", arch="deepseek_v3", hidden_size=6144, num_layers=78, vocab_size=154880,
            layer_types=("full_attention",) * 78, num_heads=64, num_kv_heads=64, head_dim=256, qk_norm=False,
            mla=MLAShape(q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
                         v_head_dim=256),
            dsa=SparseAttentionShape(topk=2048, index_heads=32, index_head_dim=128, rope_pairs=True),
            num_experts=256, top_k=8, expert_ffn=2048, shared_expert_ffn=2048, router_bias=True,
            sigmoid_router=SigmoidRouter(groups=1, topk_groups=1, scaling=2.5), first_dense_layers=3,
            dense_ffn=12288, rope_theta=10000.0, rms_norm_eps=1e-5, max_position=202752,
            hf_model_type="glm_moe_dsa", source="zai-org/GLM-5 config.json (transformers' GlmMoeDsaConfig defaults)"),
    "moonlight-16b": lambda: ModelShape(
            name="moonlight-16b", arch="deepseek_v3", hidden_size=2048, num_layers=27, vocab_size=163840,
            layer_types=("full_attention",) * 27, num_heads=16, num_kv_heads=16, head_dim=192, qk_norm=False,
            mla=MLAShape(q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                         v_head_dim=128),
            num_experts=64, top_k=6, expert_ffn=1408, shared_expert_ffn=2 * 1408, router_bias=True,
            sigmoid_router=SigmoidRouter(groups=1, topk_groups=1, scaling=2.446),
            first_dense_layers=1, dense_ffn=11264, rope_theta=50000.0, rms_norm_eps=1e-5, max_position=8192,
            source="moonshotai/Moonlight-16B-A3B config.json",
        ),
    "glm45-air": lambda: ModelShape(
            name="glm45-air", arch="glm4_moe", hidden_size=4096, num_layers=46, vocab_size=151552,
            layer_types=("full_attention",) * 46, num_heads=96, num_kv_heads=8, head_dim=128, qk_norm=False,
            attn_bias=True, partial_rotary_factor=0.5, num_experts=128, top_k=8, expert_ffn=1408,
            shared_expert_ffn=1408, router_bias=True,
            sigmoid_router=SigmoidRouter(groups=1, topk_groups=1, scaling=1.0),
            first_dense_layers=1, dense_ffn=10944, rope_theta=1e6, rms_norm_eps=1e-5, max_position=131072,
            mtp_layers=1, source="zai-org/GLM-4.5-Air config.json",
        ),
    # DeepSeek-V4-Flash (284B, 13B active): compressed attention, hyper-connections, hash routing (planned, not
    # trained; docs/deepseek_v4.md)
    "deepseek-v4-flash": lambda: ModelShape(
            name="deepseek-v4-flash", arch="deepseek_v4", hidden_size=4096, num_layers=43, vocab_size=129280,
            layer_types=("heavily_compressed_attention",) * 2 + tuple(
                "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(41)),
            num_heads=64, num_kv_heads=1, head_dim=512, qk_norm=False, partial_rotary_factor=0.125,
            rope_theta=10000.0, sliding_window=128,
            compressed=CompressedAttentionShape(q_lora_rank=1024, o_groups=8, o_lora_rank=1024, index_heads=64,
                                                index_head_dim=128, index_topk=512, hash_layers=3),
            num_experts=256, top_k=6, expert_ffn=2048, shared_expert_ffn=2048, router_bias=True,
            sigmoid_router=SigmoidRouter(groups=1, topk_groups=1, scaling=1.5), max_position=1048576,
            mtp_layers=1, source="deepseek-ai/DeepSeek-V4-Flash config.json (transformers' DeepseekV4Config defaults)"),
    # MiMo-V2-Flash (309B, 15B active): 39 sliding layers (window 128, twice the KV heads, sinks, RoPE base 1e4)
    # among 9 full ones, values 128 wide beside q·k's 192
    "mimo-v2-flash": lambda: ModelShape(
            name="mimo-v2-flash", arch="glm4_moe", hidden_size=4096, num_layers=48, vocab_size=152576,
            layer_types=tuple("full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention"
                              for i in range(48)),
            num_heads=64, num_kv_heads=4, sliding_kv_heads=8, head_dim=192, v_head_dim=128, value_scale=0.707,
            sinks="sliding", sliding_window=128, qk_norm=False, partial_rotary_factor=0.334, rope_theta=5e6,
            sliding_rope_theta=1e4, num_experts=256, top_k=8, expert_ffn=2048, router_bias=True,
            sigmoid_router=SigmoidRouter(groups=1, topk_groups=1, scaling=1.0), first_dense_layers=1,
            dense_ffn=16384, rms_norm_eps=1e-5, max_position=131072, hf_model_type="mimo_v2_flash",
            source="XiaomiMiMo/MiMo-V2-Flash config.json (transformers' MiMoV2FlashConfig defaults)"),
    # Step-3.7-Flash (196B, 11B active): every 4th layer full (64 heads, half of each rotated at base 5e6), the others
    # sliding over 512 keys (96 heads, all rotated at base 1e4), a sigmoid gate per head; three dense layers, then
    # 288 experts (top 8) and a shared one; SwiGLU clamped on the last two layers (experts 7, shared 16)
    "step37-flash": lambda: ModelShape(
            name="step37-flash", arch="glm4_moe", hidden_size=4096, num_layers=45, vocab_size=128896,
            layer_types=tuple("full_attention" if i % 4 == 0 else "sliding_attention" for i in range(45)),
            num_heads=64, sliding_heads=96, num_kv_heads=8, head_dim=128, head_gate=True, offset_norms=True,
            partial_rotary_factor=0.5, sliding_rotary_factor=1.0, rope_theta=5e6, sliding_rope_theta=1e4,
            sliding_window=512, num_experts=288, top_k=8, expert_ffn=1280, shared_expert_ffn=1280,
            router_bias=True, sigmoid_router=SigmoidRouter(groups=1, topk_groups=1, scaling=3.0),
            first_dense_layers=3, dense_ffn=11264, rms_norm_eps=1e-5, max_position=262144, mtp_layers=3,
            swiglu_limits=(0.0,) * 43 + (7.0, 7.0), swiglu_limits_shared=(0.0,) * 43 + (16.0, 16.0),
            hf_model_type="step3p5", pad_token_id=1,
            source="stepfun-ai/Step-3.7-Flash config.json (text_config; the clamped layers as transformers' "
                   "Step3p7 port documents them)"),
    # Kimi-Linear (49.1B, 3.1B active): Kimi Delta Attention in 20 layers (32 heads of 128 for q, k and v, a decay per
    # channel), MLA without RoPE in the other 7 (every fourth and the last); a dense first layer, then 256 experts
    # (top 8, sigmoid routing) and a shared one
    "kimi-linear-48b": lambda: ModelShape(
            name="kimi-linear-48b", arch="deepseek_v3", hidden_size=2304, num_layers=27, vocab_size=163840,
            layer_types=tuple("full_attention" if (i + 1) % 4 == 0 or i == 26 else "linear_attention"
                              for i in range(27)),
            num_heads=32, num_kv_heads=32, head_dim=192, qk_norm=False,
            mla=MLAShape(q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                         v_head_dim=128),
            nope_full_layers=True,
            linear_attn=LinearAttnShape(kind="kda", num_k_heads=32, num_v_heads=32, head_k_dim=128, head_v_dim=128),
            num_experts=256, top_k=8, expert_ffn=1024, shared_expert_ffn=1024, router_bias=True,
            sigmoid_router=SigmoidRouter(groups=1, topk_groups=1, scaling=2.446), first_dense_layers=1,
            dense_ffn=9216, rope_theta=10000.0, rms_norm_eps=1e-5, max_position=1048576, pad_token_id=163839,
            hf_model_type="kimi_linear", source="moonshotai/Kimi-Linear-48B-A3B-Instruct config.json"),
    # Mistral Small 4 (118.97B; 6.1B active, 6.6B with the input embedding): DeepSeek-V3's MLA and experts under a
    # softmax router, the query scaled by position
    "mistral-small-4": lambda: ModelShape(
            name="mistral-small-4", arch="deepseek_v3", hidden_size=4096, num_layers=36, vocab_size=131072,
            layer_types=("full_attention",) * 36, num_heads=32, num_kv_heads=32, head_dim=128, qk_norm=False,
            mla=MLAShape(q_lora_rank=1024, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=64,
                         v_head_dim=128),
            num_experts=128, top_k=4, expert_ffn=2048, shared_expert_ffn=2048, norm_topk_prob=True,
            softmax_router=SoftmaxRouter(groups=1, topk_groups=1, scaling=1.0), partial_rotary_factor=0.5,
            rope_theta=10000.0, rope_scaling=RopeScaling(kind="yarn", factor=128.0, original_max_position=8192,
                                                         beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                                                         mscale_all_dim=1.0),
            query_scale_period=8192, query_scale_beta=0.1, dense_ffn=12288, rms_norm_eps=1e-6, max_position=1048576,
            pad_token_id=11, hf_model_type="mistral4",
            source="mistralai/Mistral-Small-4-119B-2603 (text_config; transformers' Mistral4Config defaults)"),
    # Laguna XS.2 (33.44B): Poolside's agentic coding model; full layers of 48 heads (half of each rotated at base
    # 5e5) every fourth from the first, sliding ones of 64 heads (512 keys, whole heads rotated at 1e4), a softplus
    # gate per head, 256 experts (top 8) and a shared one, the routed output times 2.5, a dense first layer
    "laguna-xs2": lambda: ModelShape(
            name="laguna-xs2", arch="glm4_moe", hidden_size=2048, num_layers=40, vocab_size=100352,
            layer_types=tuple("full_attention" if i % 4 == 0 else "sliding_attention" for i in range(40)),
            num_heads=48, sliding_heads=64, num_kv_heads=8, head_dim=128, qk_norm=True, head_gate=True,
            head_gate_activation="softplus", partial_rotary_factor=0.5, sliding_rotary_factor=1.0,
            rope_theta=500000.0, sliding_rope_theta=10000.0, sliding_window=512, num_experts=256, top_k=8,
            expert_ffn=512, shared_expert_ffn=512, router_bias=True,
            sigmoid_router=SigmoidRouter(groups=1, topk_groups=1, scaling=2.5), first_dense_layers=1,
            dense_ffn=8192, max_position=262144, hf_model_type="laguna",
            source="poolside/laguna-XS.2 config.json (its RoPE at transformers' LagunaConfig defaults)"),
    # Mellum 2 (12.15B, 2.5B active): Qwen3-MoE's blocks, three 1024-token sliding layers to a full one, the full
    # layers' YaRN ×16 (the sliding ones rotate plain)
    "mellum2-12b": lambda: ModelShape(
            name="mellum2-12b", arch="qwen3_moe", hidden_size=2304, num_layers=28, vocab_size=98304,
            layer_types=tuple("full_attention" if i % 4 == 3 else "sliding_attention" for i in range(28)),
            num_heads=32, num_kv_heads=4, head_dim=128, sliding_window=1024, num_experts=64, top_k=8,
            expert_ffn=896, norm_topk_prob=True, rope_theta=500000.0,
            rope_scaling=RopeScaling(kind="yarn", factor=16.0, original_max_position=8192, beta_fast=32.0,
                                     beta_slow=1.0, attention_factor=1.2772588722239782),
            sliding_rope_plain=True, max_position=131072, hf_model_type="mellum",
            source="JetBrains/Mellum2-12B-A2.5B-Base config.json"),
    # Gemma 4 26B-A4B (25.23B, 3.8B active): five sliding layers (16 heads of 256 over 1,024 keys, 8 KV heads) to one
    # full layer (16 heads of 512, 2 KV heads whose values are their keys), a dense MLP beside 128 experts (top 8) on
    # every layer, norms before and after each sublayer, tied embeddings; planned, not trained
    "gemma4-26b-a4b": lambda: ModelShape(
            name="gemma4-26b-a4b", arch="moe", hidden_size=2816, num_layers=30, vocab_size=262144,
            layer_types=tuple("full_attention" if i % 6 == 5 else "sliding_attention" for i in range(30)),
            num_heads=16, num_kv_heads=2, sliding_kv_heads=8, head_dim=512, sliding_head_dim=256,
            keys_as_values=True, sliding_window=1024, query_pre_attn_scalar=1.0, num_experts=128, top_k=8,
            expert_ffn=704, shared_expert_ffn=2112, dense_beside_experts=True, norm_topk_prob=True,
            partial_rotary_factor=0.25, rope_theta=1000000.0, sliding_rope_theta=10000.0, sliding_rotary_factor=1.0,
            norm_placement="sandwich", embedding_scale=2816 ** 0.5, tie_embeddings=True, max_position=262144,
            pad_token_id=0, rope_proportional=True, final_logit_softcap=30.0,
            hf_model_type="gemma4_text", source="google/gemma-4-26B-A4B-it config.json (text_config)"),
    # A.X K1 (518.98B, 31.6B active): DeepSeek-V3's blocks with an RMSNorm on each MoE block's output
    "ax-k1": lambda: ModelShape(
            name="ax-k1", arch="deepseek_v3", hidden_size=7168, num_layers=61, vocab_size=163840,
            layer_types=("full_attention",) * 61, num_heads=64, num_kv_heads=64, head_dim=192, qk_norm=False,
            mla=MLAShape(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                         v_head_dim=128),
            num_experts=192, top_k=8, expert_ffn=2048, shared_expert_ffn=2048, router_bias=True,
            sigmoid_router=SigmoidRouter(groups=8, topk_groups=4, scaling=2.5), first_dense_layers=1,
            dense_ffn=18432, rope_theta=10000.0, max_position=32768, moe_output_norm=True, hf_model_type="axk1",
            source="skt/A.X-K1 (transformers' AXK1Config defaults)"),
    # Solar Open (102.6B, 12B active): GLM-4.5's MoE in every layer under Llama's attention
    "solar-open-100b": lambda: ModelShape(
            name="solar-open-100b", arch="glm4_moe", hidden_size=4096, num_layers=48, vocab_size=196608,
            layer_types=("full_attention",) * 48, num_heads=64, num_kv_heads=8, head_dim=128, qk_norm=False,
            num_experts=128, top_k=8, expert_ffn=1280, shared_expert_ffn=1280, router_bias=True,
            sigmoid_router=SigmoidRouter(groups=1, topk_groups=1, scaling=1.0), rope_theta=1e6, rms_norm_eps=1e-5,
            max_position=131072, hf_model_type="solar_open",
            source="upstage/Solar-Open-100B config.json (transformers' SolarOpenConfig defaults)"),
    "gpt-oss-120b": lambda: _gpt_oss("gpt-oss-120b", layers=36, experts=128),
    "gpt-oss-20b": lambda: _gpt_oss("gpt-oss-20b", layers=24, experts=32),
    "qwen15-moe-a27b": lambda: _qwen2_moe_preset("qwen15-moe-a27b", 2048, 24, 16, 16, 60, 4, 1408, 5632, 8192,
                                                  "Qwen/Qwen1.5-MoE-A2.7B config.json"),
    "qwen2-57b-a14b": lambda: _qwen2_moe_preset("qwen2-57b-a14b", 3584, 28, 28, 4, 64, 8, 2560, 20480, 131072,
                                                 "Qwen/Qwen2-57B-A14B config.json"),
    "olmoe-1b-7b": lambda: ModelShape(
            name="olmoe-1b-7b", arch="olmoe", hidden_size=2048, num_layers=16, vocab_size=50304,
            layer_types=("full_attention",) * 16, num_heads=16, num_kv_heads=16, head_dim=128, qk_norm=True,
            rope_theta=10000.0, num_experts=64, top_k=8, expert_ffn=1024, norm_topk_prob=False, rms_norm_eps=1e-5,
            max_position=4096, source="allenai/OLMoE-1B-7B-0924 config.json",
        ),
    "ernie45-21b-a3b": lambda: ModelShape(
            name="ernie45-21b-a3b", arch="ernie4_5_moe", hidden_size=2560, num_layers=28, vocab_size=103424,
            layer_types=("full_attention",) * 28, num_heads=20, num_kv_heads=4, head_dim=128, qk_norm=False,
            rope_theta=500000.0, num_experts=64, top_k=6, expert_ffn=1536, shared_expert_ffn=2 * 1536,
            router_bias=True, sigmoid_router=SigmoidRouter(), first_dense_layers=1, dense_ffn=12288,
            tie_embeddings=True, rms_norm_eps=1e-5, max_position=131072,
            source="baidu/ERNIE-4.5-21B-A3B-PT config.json",
        ),
    "minimax-m2": lambda: ModelShape(
            name="minimax-m2", arch="minimax_m2", hidden_size=3072, num_layers=62, vocab_size=200064,
            layer_types=("full_attention",) * 62, num_heads=48, num_kv_heads=8, head_dim=128, qk_norm=True,
            partial_rotary_factor=0.5, rope_theta=5e6, num_experts=256, top_k=8, expert_ffn=1536, router_bias=True,
            sigmoid_router=SigmoidRouter(), rms_norm_eps=1e-6, max_position=196608, mtp_layers=3,
            source="MiniMaxAI/MiniMax-M2 config.json",
        ),
    "llama4-scout": lambda: _llama4_preset(
            "llama4-scout", experts=16, moe_step=1, qk_norm=True, max_position=10485760,
            rope_scaling=RopeScaling(kind="llama3", factor=16.0, original_max_position=8192, low_freq_factor=1.0,
                                     high_freq_factor=1.0),
            source="meta-llama/Llama-4-Scout-17B-16E config.json (text_config)"),
    "llama4-maverick": lambda: _llama4_preset(
            "llama4-maverick", experts=128, moe_step=2, qk_norm=False, max_position=1048576, rope_scaling=None,
            source="meta-llama/Llama-4-Maverick-17B-128E config.json (text_config)"),
    "mixtral-8x7b": lambda: ModelShape(
            name="mixtral-8x7b", arch="mixtral", hidden_size=4096, num_layers=32, vocab_size=32000,
            layer_types=("full_attention",) * 32, num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=False,
            rope_theta=1e6, num_experts=8, top_k=2, expert_ffn=14336, max_position=32768,
            source="mistralai/Mixtral-8x7B-v0.1 config.json",
        ),
    # A few-MB Qwen3.5-style model for CPU runs and CI: every block type of the real one, tiny widths.
    "tiny-moe": lambda: ModelShape(
            name="tiny-moe", arch="qwen3_5_moe", hidden_size=64, num_layers=4, vocab_size=512,
            layer_types=_rounded_layer_types(4, 4), num_heads=4, num_kv_heads=2, head_dim=16,
            attn_output_gate=True, partial_rotary_factor=0.25, rope_theta=1e7,
            linear_attn=LinearAttnShape(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, chunk_size=16),
            num_experts=8, top_k=2, expert_ffn=32, shared_expert_ffn=32, shared_expert_gate=True,
            max_position=65536, source="recipe's own tiny test model",
        ),
}


class _Presets(Mapping):
    """Preset shapes by name, each validated on first use (so `recipe solve` builds only the one it needs)."""

    def __init__(self, factories: dict[str, Callable[[], ModelShape]]):
        self._factories = factories
        self._built: dict[str, ModelShape] = {}

    def __getitem__(self, name: str) -> ModelShape:
        if name not in self._built:
            self._built[name] = self._factories[name]()
        return self._built[name]

    def __iter__(self):
        return iter(self._factories)

    def __len__(self) -> int:
        return len(self._factories)



def _llama4_preset(name: str, experts: int, moe_step: int, qk_norm: bool, max_position: int, rope_scaling,
                   source: str) -> "ModelShape":
    """Llama 4's two releases share the stack: 48 layers of hidden 5120, 40 query heads over 8 of width 128, every
    fourth layer global without RoPE, the others chunked in runs of 8,192 positions; one expert of 8,192 a token by a
    sigmoid on its input, a shared expert of the same width; Maverick MoE every second layer (dense 16,384 between)."""
    return ModelShape(
        name=name, arch="llama4", hidden_size=5120, num_layers=48, vocab_size=202048,
        layer_types=(("chunked_attention",) * 3 + ("full_attention",)) * 12, num_heads=40, num_kv_heads=8, head_dim=128,
        qk_norm=False, attention_chunk=8192, llama4=Llama4Attention(qk_norm=qk_norm), rope_theta=500000.0,
        rope_scaling=rope_scaling, num_experts=experts, top_k=1, expert_ffn=8192, shared_expert_ffn=8192,
        moe_layer_step=moe_step, dense_ffn=16384 if moe_step > 1 else 0, norm_topk_prob=False, rms_norm_eps=1e-5,
        max_position=max_position, source=source)


def _gpt_oss(name: str, layers: int, experts: int) -> "ModelShape":
    """gpt-oss's two sizes differ only in depth and expert count (openai/<name> config.json)."""
    return ModelShape(
        name=name, arch="gpt_oss", hidden_size=2880, num_layers=layers, vocab_size=201088,
        layer_types=("sliding_attention", "full_attention") * (layers // 2), num_heads=64, num_kv_heads=8,
        head_dim=64, qk_norm=False, attn_bias=True, sliding_window=128, rope_theta=150000.0,
        rope_scaling=GPT_OSS_ROPE_SCALING, num_experts=experts, top_k=4, expert_ffn=2880, router_bias=True,
        rms_norm_eps=1e-5, max_position=131072, source=f"openai/{name} config.json")

PRESETS: Mapping[str, ModelShape] = _Presets(_PRESET_FACTORIES)


# ---- parameter counts ----------------------------------------------------------------------------------------
PARAM_GROUPS = ("embedding", "head", "attention", "linear_attention", "router", "shared_expert", "dense_ffn",
                "routed_experts", "norms")


def _full_attention_params(m: ModelShape, kind: str = "full_attention") -> int:
    """One `kind` attention layer's parameters."""
    h = m.hidden_size
    if m.compressed is not None:
        return _compressed_attention_params(m, kind)
    if m.mla is not None:
        a = m.mla
        qk_head = a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.query_gate:  # down, norm, and the query and gate from both latents (A.X K2)
            q = h * a.q_lora_rank + a.q_lora_rank + 2 * a.q_lora_rank * m.num_heads * (qk_head + a.v_head_dim)
        elif a.q_lora_rank:
            q = h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * m.num_heads * qk_head  # down, norm, up
        else:
            q = h * m.num_heads * qk_head
        kv = (h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
              + a.kv_lora_rank * m.num_heads * (a.qk_nope_head_dim + a.v_head_dim))
        o = m.num_heads * a.v_head_dim * h
        return q + kv + o + indexer_params(m)
    heads, hd, vw = m.heads_at(kind), m.head_dim_at(kind), m.value_width_at(kind)
    # the query projection's outputs (with Qwen3.5's output gate a gate channel per query channel), and Step-3.7's
    # gate per head (its own projection, without a bias)
    q_out = heads * hd * (2 if m.attn_output_gate else 1)
    gate = heads if m.head_gate else 0
    kv_heads = m.kv_heads_at(kind)
    kv_out = kv_heads * (hd + (0 if m.keys_as_values and kind == "full_attention" else vw))
    o = heads * vw * h
    # q/k/v biases, and o_proj's where the arch has one (launch/model.py: Attention)
    bias = (q_out + kv_out + (0 if m.arch in QKV_ONLY_BIAS_ARCHS else h)) if m.attn_bias else 0
    norms = (kv_heads * hd + heads * hd if m.whole_qk_norm else 2 * hd) if m.qk_norm else 0
    sinks = heads if m.sinks_at(kind) else 0  # per-head attention sinks
    return h * (q_out + gate + kv_out) + o + bias + norms + sinks


def compressed_projections(m: ModelShape, kind: str) -> list[tuple[int, int, int, bool]]:
    """One DeepSeek-V4 attention layer's projections (transformers' DeepseekV4Attention), each (in, out, groups,
    split by head under tensor parallelism): q_a and q_b; the one K = V head's projection; the grouped o_a (each of
    o_groups groups of heads to o_lora_rank: in·out/groups weights) and o_b. A compressed_sparse_attention layer adds
    its compressor's kv and gate (two overlapping series of head_dim) and its indexer's (at index_head_dim), the
    indexer's queries from the q latent and its weight per index head; a heavily_compressed_attention layer a
    compressor of one series."""
    c, h, hd, nh = m.compressed, m.hidden_size, m.head_dim, m.num_heads
    out = [(h, c.q_lora_rank, 1, False), (c.q_lora_rank, nh * hd, 1, True), (h, hd, 1, False),
           (nh * hd, c.o_groups * c.o_lora_rank, c.o_groups, True), (c.o_groups * c.o_lora_rank, h, 1, True)]
    if kind == "compressed_sparse_attention":
        ihd = c.index_head_dim
        out += [(h, 2 * hd, 1, False)] * 2 + [(h, 2 * ihd, 1, False)] * 2 + [
            (c.q_lora_rank, c.index_heads * ihd, 1, False), (h, c.index_heads, 1, False)]
    elif kind == "heavily_compressed_attention":
        out += [(h, hd, 1, False)] * 2
    return out


def _compressed_attention_params(m: ModelShape, kind: str) -> int:
    """One DeepSeek-V4 attention layer: its projections (`compressed_projections`), the q latent's and the K = V
    head's norms, a sink per head; a compressor's position bias per slot of its window and its entries' norm (the
    compressed-sparse layer's two: its own at head_dim over two series, its indexer's at index_head_dim)."""
    c, hd = m.compressed, m.head_dim
    out = sum(i * o // g for i, o, g, _ in compressed_projections(m, kind)) + c.q_lora_rank + hd + m.num_heads
    if kind == "compressed_sparse_attention":
        out += c.csa_rate * 2 * hd + hd + c.csa_rate * 2 * c.index_head_dim + c.index_head_dim
    elif kind == "heavily_compressed_attention":
        out += c.hca_rate * hd + hd
    return out


def hyper_connection_params(m: ModelShape) -> int:
    """DeepSeek-V4's hyper-connections: two mixers a layer (each a [(2 + n)·n, n·h] map of the n streams, a bias
    per output and three scales) and the head's (an [n, n·h] map, n biases, one scale); 0 elsewhere."""
    if m.compressed is None:
        return 0
    n, h = m.compressed.hc_mult, m.hidden_size
    mix = (2 + n) * n
    return m.num_layers * 2 * (mix * n * h + mix + 3) + n * n * h + n + 1


def block_index_params(m: ModelShape) -> int:
    """MiniMax-M3's block indexer in one block-sparse layer: its q and k projections and their RMSNorms; 0 without."""
    if m.block_sparse is None:
        return 0
    b, h = m.block_sparse, m.hidden_size
    return h * b.index_heads * b.index_head_dim + h * b.index_head_dim + 2 * b.index_head_dim


def indexer_params(m: ModelShape) -> int:
    """DeepSeek sparse attention's indexer in one layer (launch/model.py Indexer): wq_b from the q latent, wk and its
    LayerNorm (weight and bias), weights_proj; 0 without DSA. Stored with the attention, never trained."""
    if m.dsa is None:
        return 0
    d, h = m.dsa, m.hidden_size
    return m.mla.q_lora_rank * d.index_heads * d.index_head_dim + h * d.index_head_dim + 2 * d.index_head_dim \
        + h * d.index_heads


def _linear_attention_params(m: ModelShape) -> int:
    """One linear-attention layer's parameters, by its kind (`LinearAttnShape.kind`)."""
    la, h = m.linear_attn, m.hidden_size
    if la.kind == "kda":
        return kda_params(la, h)
    key_dim, value_dim = la.num_k_heads * la.head_k_dim, la.num_v_heads * la.head_v_dim
    qkvz = h * (2 * key_dim + 2 * value_dim)
    ba = h * 2 * la.num_v_heads
    conv = (2 * key_dim + value_dim) * la.conv_kernel
    per_head = 2 * la.num_v_heads  # dt_bias, A_log
    norm = la.head_v_dim  # gated RMSNorm weight
    out = value_dim * h
    return qkvz + ba + conv + per_head + norm + out


def kda_projections(la: LinearAttnShape, h: int) -> list[tuple[int, int]]:
    """(in, out) of a Kimi Delta Attention layer's matmuls (transformers' KimiLinearDeltaAttention), H heads of
    width D, HD = H·D: q, k and v (h → HD each), the decay gate's low-rank pair f_a (h → D) and f_b (D → HD),
    β's b_proj (h → H), the output gate's low-rank pair g_a (h → D) and g_b (D → HD), and o_proj (HD → h)."""
    hd, d = la.num_k_heads * la.head_k_dim, la.head_k_dim
    return [(h, hd)] * 3 + [(h, d), (d, hd), (h, la.num_k_heads), (h, d), (d, hd), (hd, h)]


def kda_params(la: LinearAttnShape, h: int) -> int:
    """One Kimi Delta Attention layer: its matmuls (`kda_projections`), the depthwise convs of q, k and v (width
    `conv_kernel`, no bias), the decay's dt_bias (one a channel) and A_log (one a head), and the gated output norm's
    weight (one a head channel, shared by the heads)."""
    hd = la.num_k_heads * la.head_k_dim
    return (sum(i * o for i, o in kda_projections(la, h)) + 3 * hd * la.conv_kernel + hd + la.num_k_heads
            + la.head_k_dim)


def param_counts(m: ModelShape) -> dict[str, int]:
    """Parameters of the text stack by group (MTP layers excluded; see `mtp_params`)."""
    return dict(_param_counts(m))  # a copy: callers may keep or change theirs


@functools.lru_cache(maxsize=1024)
def _param_counts(m: ModelShape) -> tuple[tuple[str, int], ...]:
    # the cost model asks for these for every layout the solver weighs
    h = m.hidden_size
    moe_layers = m.num_moe_layers
    swiglu = 3 * h  # gate, up, down per intermediate unit
    counts = dict.fromkeys(PARAM_GROUPS, 0)
    counts["embedding"] = m.vocab_size * h
    counts["head"] = 0 if m.tie_embeddings else m.vocab_size * h
    counts["attention"] = sum(n * _full_attention_params(m, kind) for kind, n in (
        ("full_attention", m.num_full_attn_layers), ("sliding_attention", m.num_sliding_layers),
        ("chunked_attention", m.num_chunked_layers)) if n) + sum(
        _full_attention_params(m, kind) for kind in m.layer_types if kind in COMPRESSED_LAYER_TYPES)
    counts["attention"] += len(m.block_sparse.layers) * block_index_params(m) if m.block_sparse is not None else 0
    if m.linear_attn is not None:
        counts["linear_attention"] = m.num_linear_attn_layers * _linear_attention_params(m)
    counts["router"] = moe_layers * (h * m.num_experts + (m.num_experts if m.router_bias else 0))
    if m.compressed is not None:  # DeepSeek-V4's hash-routed layers: the weight, no correction bias
        counts["router"] -= m.compressed.hash_layers * m.num_experts
    shared = swiglu * m.shared_expert_ffn + (h if m.shared_expert_gate else 0) if m.shared_expert_ffn else 0
    counts["shared_expert"] = moe_layers * shared
    counts["dense_ffn"] = m.num_dense_layers * swiglu * m.dense_ffn
    per_expert = swiglu * m.expert_ffn
    if m.arch == "gpt_oss":
        per_expert += 2 * m.expert_ffn + h  # gate_up and down biases
    counts["routed_experts"] = moe_layers * m.num_experts * per_expert
    # with DeepSeek-V4's hyper-connection mixers: small maps of the residual streams beside the norms
    norms = {"sandwich": 4, "parallel": 1}.get(m.norm_placement, 2)  # a layer's: two a sublayer in the sandwich
    counts["norms"] = m.num_layers * norms * h + h + hyper_connection_params(m)
    if m.moe_output_norm:  # A.X K1's, on each MoE layer
        counts["norms"] += h * sum(1 for i in range(m.num_layers) if not m.is_dense_layer(i))
    if m.gated_norm_rank:  # A.X K2's gates: W_down and W_up on every layer's input norm and the MoE layers' FFN norm
        counts["norms"] += 2 * h * m.gated_norm_rank * (m.num_layers + moe_layers)
    if m.dense_beside_experts:  # Gemma 4's: the experts' input norm, both sides' output norms, the router's scales
        counts["norms"] += (3 * h + h + m.num_experts) * moe_layers
    return tuple(counts.items())


def total_params(m: ModelShape) -> int:
    return sum(param_counts(m).values())


def active_params(m: ModelShape) -> int:
    """Parameters touched per token: all but the routed experts a token is not sent to and the input embedding
    (a lookup, not a matmul; the FLOPs leave it out too). With tied embeddings the matrix is the LM head and
    counts."""
    c = param_counts(m)
    embed = 0 if m.tie_embeddings else c["embedding"]
    return total_params(m) - embed - c["routed_experts"] + c["routed_experts"] * m.top_k // m.num_experts


def active_matmul_params(m: ModelShape) -> int:
    """Matmul weights a token multiplies through (LM head included, embedding lookup and norms excluded): the N
    in 2N forward FLOPs per token."""
    c = param_counts(m)
    routed = c["routed_experts"] * m.top_k / m.num_experts
    return int(c["head"] + c["attention"] + c["linear_attention"] + c["router"] + c["shared_expert"]
               + c["dense_ffn"] + routed)


def mtp_params(m: ModelShape) -> int:
    """One MTP layer: a decoder layer (full attention + MoE) plus the projection of [embed; hidden] → hidden."""
    if not m.mtp_layers:
        return 0
    h = m.hidden_size
    one = {"num_layers": 1, "layer_types": ("full_attention",), "first_dense_layers": 0, "moe_layer_step": 1}
    if m.compressed is not None:  # DeepSeek-V4's: a layer of its first layer's kind, routed by score
        one.update(layer_types=m.layer_types[:1], compressed=m.compressed.model_copy(update={"hash_layers": 0}))
    c = param_counts(m.model_copy(update=one))
    layer = c["attention"] + c["router"] + c["shared_expert"] + c["routed_experts"] + 2 * h
    return m.mtp_layers * (layer + 2 * h * h + 3 * h)  # + eh_proj [2h → h] and its enorm/hnorm/final norm


def _qwen2_moe_preset(name: str, hidden: int, layers: int, heads: int, kv_heads: int, experts: int, top_k: int,
                      ffn: int, shared: int, max_position: int, source: str) -> ModelShape:
    """Qwen2-MoE's releases: q/k/v biases, head width 128, a gated shared expert, top-k weights not renormalized."""
    return ModelShape(name=name, arch="qwen2_moe", hidden_size=hidden, num_layers=layers, vocab_size=151936,
                      layer_types=("full_attention",) * layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=128,
                      qk_norm=False, attn_bias=True, rope_theta=1e6, num_experts=experts, top_k=top_k,
                      expert_ffn=ffn, shared_expert_ffn=shared, shared_expert_gate=True, norm_topk_prob=False,
                      max_position=max_position, source=source)


# ---- Hugging Face config.json --------------------------------------------------------------------------------
_ARCH_BY_MODEL_TYPE = {
    "qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe", "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5",
    "qwen3_moe": "qwen3_moe", "qwen3_vl_moe": "qwen3_moe", "qwen3_vl_moe_text": "qwen3_moe",
    "qwen3_omni_moe": "qwen3_moe", "qwen3_omni_moe_thinker": "qwen3_moe", "qwen3_omni_moe_text": "qwen3_moe",
    "cohere2_moe": "qwen3_moe", "mellum": "qwen3_moe",
    "deepseek_v3": "deepseek_v3", "deepseek_v2": "deepseek_v3", "kimi_k2": "deepseek_v3", "kimi_linear": "deepseek_v3",
    "mistral4": "deepseek_v3", "axk1": "deepseek_v3", "axk2": "deepseek_v3",
    "glm4_moe_lite": "deepseek_v3", "deepseek_v32": "deepseek_v3", "glm_moe_dsa": "deepseek_v3",
    "gpt_oss": "gpt_oss", "mixtral": "mixtral", "glm4_moe": "glm4_moe", "dots1": "glm4_moe",
    "solar_open": "glm4_moe", "mimo_v2_flash": "glm4_moe", "hy_v3": "glm4_moe", "exaone_moe": "glm4_moe",
    "glm4v_moe": "glm4_moe", "glm4v_moe_text": "glm4_moe", "deepseek_v4": "deepseek_v4", "afmoe": "glm4_moe",
    "flex_olmo": "olmoe", "step3p5": "glm4_moe", "step3p7": "glm4_moe", "laguna": "glm4_moe",
    "qwen2_moe": "qwen2_moe", "olmoe": "olmoe", "ernie4_5_moe": "ernie4_5_moe",
    "minimax_m2": "minimax_m2",
    "llama4": "llama4",
    "llama4_text": "llama4", "granitemoe": "granitemoe", "granitemoeshared": "granitemoe",
    "granitemoe_swa": "granitemoe",
    "hunyuan_v1_moe": "hunyuan_moe", "gemma4": "moe", "gemma4_text": "moe", "minimax_m3_vl_text": "moe",
    "gemma3_text": "dense", "olmo2": "dense", "olmo3": "dense", "gemma": "dense", "granite": "dense",
    "exaone4": "dense", "smollm3": "dense", "phi3": "dense", "glm4": "dense", "ernie4_5": "dense",
    "cohere2": "dense",
    "llama": "dense", "qwen2": "dense", "qwen3": "dense", "mistral": "dense", "ministral": "dense",
}
# state-space hybrids: their configs carry the standard attention fields, so they would read as all-attention stacks
_MAMBA_HYBRIDS = ("jamba", "bamba", "falcon_h1", "falcon_mamba", "granitemoehybrid", "mamba", "mamba2", "nemotron_h",
                  "zamba", "zamba2")
# families whose standard fields would read as blocks they do not have: what they have instead
_UNPLANNED_TYPES = {
    "jetmoe": "mixture-of-attention experts",
    "lfm2_moe": "short-convolution layers (LFM2's)", "lfm2": "short-convolution layers (LFM2's)",
    "longcat_flash": "zero-computation experts and two attention blocks a layer",
    "ernie4_5_vl_moe": "experts split between text and vision",
    "ernie4_5_vl_moe_text": "experts split between text and vision",
    "apertus": "an MLP without a gate (up and down projections)",
    "arcee": "an MLP without a gate (up and down projections)",
    "youtu": "multi-head latent attention in a dense model",
    "hy_v4": "hyper-connections (iHC) beside sparse MLA",
    # standard fields that would read as a causal MoE it is not: Doge's experts are a product-key lookup of tiny
    # experts (read as routed FFNs they count 3,299B parameters for a 0.4B model); the others are not causal LMs
    "doge": "cross-domain experts (a product-key lookup of one-neuron experts, not routed FFNs)",
    "openai_privacy_filter": "bidirectional attention (a token classifier, not a causal language model)",
    **dict.fromkeys(("diffusion_gemma", "diffusion_gemma_text"),
                    "bidirectional denoising layers (a diffusion language model, not a causal one)"),
    "deepseek_ocr2_encoder": "a vision encoder (not a language model)",
    # dense families whose standard fields read as a Llama block they do not have (their parameters off by 3-180%)
    **dict.fromkeys(("bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie",
                     "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer",
                     "xlm-roberta", "xlm-roberta-xl", "xmod"),
                    "bidirectional encoder layers (an encoder, not a causal language model)"),
    **dict.fromkeys(("gpt_neox", "phi", "starcoder2", "persimmon", "jais2", "nanochat", "biogpt", "nemotron"),
                    "an MLP without a gate (up and down projections)"),
    **dict.fromkeys(("fuyu", "git", "got_ocr2", "phi4_multimodal"),
                    "its image inputs inside the text model's blocks (a vision-language model)"),
    "recurrent_gemma": "recurrent (RG-LRU) layers",
    "hrm_text": "hierarchical recurrent modules",
    "minicpm3": "multi-head latent attention in a dense model",
    **dict.fromkeys(("gemma4_unified", "gemma4_unified_text"),
                    "Gemma's blocks with an encoder (Gemma 4 unified: its text model reads no standard fields)"),
    # a wrapper's model_type and its text model's
    **dict.fromkeys(("qwen4_exp", "qwen4_exp_text"),
                    "hyper-connections, hashed n-gram layer embeddings and QSA sparse attention"),
    **dict.fromkeys(("glm5_next", "glm5_next_text"),
                    "hyper-connections (mHC) and KDA layers beside sparse MLA over pooled keys"),
}
_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")


def from_hf_config(path: str | Path) -> ModelShape:
    """Read a Hugging Face config.json (its text_config when present). Raises ValueError with the missing field."""
    path = Path(path)
    try:
        return _from_hf_config(path)
    except (TypeError, ValueError, AttributeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None


MAX_CONFIG_BYTES = 4 * 1024 * 1024  # a config.json is a few KB; a shape YAML less
MAX_SHAPE_BYTES = 256 * 1024


def _from_hf_config(path: Path) -> ModelShape:
    from .safeio import FileRefused, read_text_limited

    try:
        raw = json.loads(read_text_limited(path, "model config", MAX_CONFIG_BYTES))
    except FileRefused as e:
        raise ValueError(str(e)) from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"cannot read model config {path}: {str(e) or type(e).__name__}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    text_config = raw.get("text_config")
    thinker = raw.get("thinker_config")
    if text_config is None and isinstance(thinker, dict):  # Qwen3-Omni: its thinker's text model
        text_config = thinker.get("text_config")
    if text_config is not None and not isinstance(text_config, dict):
        raise ValueError(f"{path}: field 'text_config': expected an object, got {_shown(text_config)}")
    cfg = text_config or raw
    model_type = cfg.get("model_type") or raw.get("model_type") or ""
    if model_type in _MAMBA_HYBRIDS:
        raise ValueError(f"{path}: model_type {_shown(model_type)} has Mamba layers, which this tool does not plan")
    if isinstance(model_type, str) and model_type in _UNPLANNED_TYPES:
        raise ValueError(f"{path}: model_type {_shown(model_type)} has {_UNPLANNED_TYPES[model_type]}, which this "
                         f"tool does not plan")
    arch = _ARCH_BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    unknown = arch is None
    if unknown:
        if not isinstance(model_type, str) or not all(
                k in cfg for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")):
            raise ValueError(f"{path}: model_type {_shown(model_type)} is not supported and lacks the standard fields "
                             f"(supported: {', '.join(sorted(_ARCH_BY_MODEL_TYPE))})")
        arch = "moe" if any(cfg.get(k) is not None for k in _EXPERT_KEYS) else "dense"

    def bad(key: str, want: str, v) -> ValueError:
        return ValueError(f"{path}: field {key!r}: expected {want}, got {_shown(v)}")

    if model_type in ("step3p5", "step3p7"):  # Step-3.7's text model (its config's text_config), hub or transformers
        model_type, cfg = "step3p5", _step_config(cfg, bad)
    if model_type == "kimi_linear":  # Kimi-Linear, its hub form (linear_attn_config) or transformers'
        cfg = _kimi_config(cfg, bad)
    if model_type in ("gemma4", "gemma4_text"):  # Gemma 4's text model, with transformers' defaults
        model_type, cfg = "gemma4_text", _gemma4_config(cfg, bad)
        arch = "dense" if cfg["_dense"] else arch
    if model_type == "minimax_m3_vl_text":  # MiniMax-M3's text model, with transformers' defaults
        cfg = _minimax_m3_config(cfg, bad)
    if model_type == "gemma3_text":  # Gemma 3's text model (its `gemma3` wrapper's text_config), transformers' defaults
        cfg = _gemma3_config(cfg, bad)
    if model_type in ("olmo2", "olmo3"):  # AI2's OLMo 2 and 3, with transformers' defaults
        cfg = _olmo_config(cfg, model_type, bad)
    if model_type == "cohere2":  # transformers' Cohere2Config defaults (Command R7B, Command A)
        cfg = {"layer_norm_eps": 1e-5, "max_position_embeddings": 8192, "pad_token_id": 0, **cfg}
    if model_type == "ernie4_5":  # transformers' Ernie4_5Config defaults
        cfg = {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "pad_token_id": 0, "head_dim": 128,
               "tie_word_embeddings": True, **cfg}
        if cfg.get("use_bias"):
            raise bad("use_bias", "false (ERNIE-4.5 with biases is not planned)", cfg["use_bias"])
    if model_type == "glm4":  # transformers' Glm4Config defaults: half of each head rotated, eps 1.5625e-7
        cfg = {"rms_norm_eps": 1.5625e-07, "max_position_embeddings": 131072, "pad_token_id": 151329,
               "attention_bias": True, "head_dim": 128, **cfg}
        if "partial_rotary_factor" not in cfg and "partial_rotary_factor" not in (cfg.get("rope_parameters") or {}):
            cfg["partial_rotary_factor"] = 0.5
    if model_type == "phi3":  # transformers' Phi3Config defaults; its window (where set) over every layer
        cfg = {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "pad_token_id": 32000, **cfg}
        if cfg.get("sliding_window") is not None and not cfg.get("layer_types") and isinstance(
                cfg.get("num_hidden_layers"), int) and 0 < cfg["num_hidden_layers"] <= 100_000:
            cfg["layer_types"] = ["sliding_attention"] * cfg["num_hidden_layers"]
    if model_type == "exaone4":  # transformers' Exaone4Config defaults
        cfg = {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "sliding_window": 4096, **cfg}

    def need(key: str, *alts: str):
        for k in (key, *alts):
            if k in cfg and cfg[k] is not None:
                return cfg[k]
        also = f" (or {', '.join(map(repr, alts))})" if alts else ""
        raise ValueError(f"{path}: missing field {key!r}{also} for model_type {model_type!r}")

    def which(key: str, *alts: str) -> str:
        return next((k for k in (key, *alts) if k in cfg and cfg[k] is not None), key)

    def count(v, key: str) -> int:
        """A whole number: not a boolean, not a string, not a fraction (48.0 is 48; 48.7 is refused)."""
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (
                isinstance(v, float) and not (math.isfinite(v) and v.is_integer())):
            raise bad(key, "a whole number", v)
        if not -(1 << 62) < v < (1 << 62):
            raise bad(key, "a whole number in range", v)
        return int(v)

    def number(v, key: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or abs(v) >= 2**62 or not math.isfinite(v):
            raise bad(key, "a finite number", v)
        return float(v)

    def flag(v, key: str) -> bool:
        if not isinstance(v, bool):
            raise bad(key, "true or false", v)
        return v

    def req(key: str, *alts: str) -> int:
        return count(need(key, *alts), which(key, *alts))

    def opt(key: str, default: int, *, null_ok: bool = True) -> int:
        """An optional count: absent → default; null → default where null means "none" (e.g. mtp layers)."""
        if key not in cfg or (cfg[key] is None and null_ok):
            return default
        return count(cfg[key], key)

    def opt_num(key: str, default: float) -> float:
        return default if key not in cfg else number(cfg[key], key)

    def opt_flag(key: str, default: bool, src: dict | None = None) -> bool:
        src = cfg if src is None else src
        return default if key not in src or src[key] is None else flag(src[key], key)

    rope = cfg.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise bad("rope_parameters", "an object", rope)
    rope = rope or {}
    # RoPE by layer type (MiMo-V2-Flash: {"full_attention": {…}, "sliding_attention": {…}}): the full layers' is the
    # model's; `rope_by_type` keeps them all
    rope_by_type = None
    if rope and all(k in LAYER_TYPES and isinstance(v, dict) for k, v in rope.items()):
        rope_by_type = rope
        rope = rope.get("full_attention") or next(iter(rope.values()))

    n_layers = req("num_hidden_layers")
    if model_type == "mimo_v2_flash":  # transformers' defaults where its config leaves them out
        if not cfg.get("layer_types") and 0 < n_layers <= 100_000:
            cfg = {**cfg, "layer_types": ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention"
                                          for i in range(n_layers)]}
        cfg = {"head_dim": 192, "sliding_window": 128, **cfg}
    if cfg.get("layer_types"):
        lt = cfg["layer_types"]
        if not isinstance(lt, list) or not all(isinstance(t, str) for t in lt):
            raise bad("layer_types", "a list of layer type names", lt)
        if model_type in _DSA_MODEL_TYPES or model_type == "axk2":  # its sparse layers are full attention with an
            # indexer (`dsa`)
            lt = ["full_attention" if t == "deepseek_sparse_attention" else t for t in lt]
        layer_types = tuple(lt)[:n_layers]
        other = next((t for t in layer_types if t not in LAYER_TYPES
                      or (t in COMPRESSED_LAYER_TYPES and model_type != "deepseek_v4")), None)
        if other is not None:
            raise ValueError(f"{path}: layer type {other!r} (model_type {_shown(model_type)}) is not planned by this "
                             f"tool; it plans {', '.join(LAYER_TYPES)} layers")
    elif cfg.get("full_attention_interval") is not None:
        interval = count(cfg["full_attention_interval"], "full_attention_interval")
        if not 0 < interval <= max(n_layers, 1):
            raise bad("full_attention_interval", f"a whole number from 1 to {n_layers}", interval)
        layer_types = _rounded_layer_types(n_layers, interval) if 0 < n_layers <= 100_000 else ()
    else:
        layer_types = ("full_attention",) * n_layers if 0 < n_layers <= 100_000 else ()
    if not 0 < n_layers <= 100_000:
        raise bad("num_hidden_layers", "a whole number from 1 to 100,000", n_layers)
    num_heads = req("num_attention_heads")
    hidden = req("hidden_size")
    if num_heads <= 0:
        raise bad("num_attention_heads", "a positive whole number", num_heads)
    rope_theta = cfg.get("rope_theta")
    rope_key = "rope_theta"
    if rope_theta is None:
        rope_theta, rope_key = rope.get("rope_theta"), "rope_parameters.rope_theta"
    if "max_position_embeddings" in cfg and cfg["max_position_embeddings"] is None:
        raise bad("max_position_embeddings", "a whole number", None)
    vocab = req("vocab_size")
    pad = cfg.get("pad_token_id", raw.get("pad_token_id"))
    if pad is not None and vocab > 0:  # transformers' embedding takes it as padding_idx, negatives from the end
        pad = count(pad, "pad_token_id")
        if not -vocab <= pad < vocab:
            raise bad("pad_token_id", f"a token id of the {vocab:,}-row vocabulary", pad)
        pad %= vocab
    else:
        pad = None  # (a vocabulary that is no size is refused by its own field)
    fields: dict = dict(
        name=path.parent.name if path.name == "config.json" else path.stem,
        arch=arch, hidden_size=hidden, num_layers=n_layers, vocab_size=vocab, pad_token_id=pad,
        layer_types=layer_types, num_heads=num_heads,
        num_kv_heads=opt("num_key_value_heads", num_heads),
        head_dim=opt("head_dim", hidden // num_heads),
        rope_theta=1e6 if rope_theta is None else number(rope_theta, rope_key),
        tie_embeddings=opt_flag("tie_word_embeddings", opt_flag("tie_word_embeddings", False), raw),
        # (a LayerNorm's epsilon where a config has one instead, as Cohere's and LFM2's: the cost is the same)
        rms_norm_eps=opt_num("rms_norm_eps", 1e-6) if cfg.get("rms_norm_eps") is not None
        else opt_num("layer_norm_eps", opt_num("norm_eps", 1e-6)),
        max_position=opt("max_position_embeddings", 32768),
        mtp_layers=opt("mtp_num_hidden_layers", opt("num_nextn_predict_layers", opt("num_mtp_layers", 0))),
        norm_topk_prob=opt_flag("norm_topk_prob", arch not in ("moe", "qwen2_moe", "olmoe")),
        source=str(path),
    )
    if arch in ("dense", "qwen3_5"):
        ffn = req("intermediate_size")
        fields.update(num_experts=1, top_k=1, expert_ffn=ffn, first_dense_layers=n_layers, dense_ffn=ffn,
                      qk_norm=model_type in ("qwen3", "qwen3_5", "qwen3_5_text"),
                      attn_bias=opt_flag("attention_bias", model_type == "qwen2"))
    elif arch == "hunyuan_moe":  # per-layer lists where they are uniform; transformers' port: one width
        width = req("intermediate_size")
        fields.update(num_experts=_uniform(cfg, "num_experts", count, bad), top_k=_uniform(cfg, "moe_topk", count, bad),
                      expert_ffn=width, shared_expert_ffn=width, qk_norm=True, norm_topk_prob=True,
                      attn_bias=opt_flag("attention_bias", False), rms_norm_eps=opt_num("rms_norm_eps", 1e-5))
    else:
        fields.update(num_experts=req(*_EXPERT_KEYS),
                      top_k=req("num_experts_per_tok", "experts_per_token", "num_experts_per_token", "moe_k"),
                      expert_ffn=req("moe_intermediate_size", "intermediate_size"))
    prf = cfg.get("partial_rotary_factor")
    prf_key = "partial_rotary_factor"
    if prf is None:
        prf, prf_key = rope.get("partial_rotary_factor"), "rope_parameters.partial_rotary_factor"
    if prf is not None:
        fields["partial_rotary_factor"] = number(prf, prf_key)
    scaling = _rope_scaling(cfg, rope, bad, number, count)
    if scaling is not None:
        fields["rope_scaling"] = scaling
    if arch in ("qwen3_5_moe", "qwen3_next", "qwen3_5"):
        shared = opt("shared_expert_intermediate_size", 0)
        fields.update(
            attn_output_gate=opt_flag("attn_output_gate", True),
            linear_attn=dict(
                num_k_heads=req("linear_num_key_heads"), num_v_heads=req("linear_num_value_heads"),
                head_k_dim=req("linear_key_head_dim"), head_v_dim=req("linear_value_head_dim"),
                conv_kernel=opt("linear_conv_kernel_dim", 4)),
        )
        if arch != "qwen3_5":
            fields.update(shared_expert_ffn=shared, shared_expert_gate=bool(shared))
    elif arch == "deepseek_v3":
        nope, rope_dim = req("qk_nope_head_dim"), req("qk_rope_head_dim")
        fields.update(
            qk_norm=False, router_bias=model_type not in _SOFTMAX_MLA_TYPES, head_dim=nope + rope_dim,
            # q_lora_rank null (DeepSeek-V2-Lite, Moonlight): q projected straight from the hidden state
            mla=dict(q_lora_rank=opt("q_lora_rank", 0), kv_lora_rank=req("kv_lora_rank"), qk_nope_head_dim=nope,
                     qk_rope_head_dim=rope_dim, v_head_dim=req("v_head_dim")),
            shared_expert_ffn=opt("n_shared_experts", 0) * req("moe_intermediate_size"),
            first_dense_layers=_leading_dense(cfg, model_type, opt, bad),
            dense_ffn=opt("intermediate_size", 0),
        )
        if model_type == "glm4_moe_lite":  # GLM-4.7-Flash: DeepSeek-V3's blocks, exported under its own type
            fields["hf_model_type"] = model_type
        if model_type == "axk1":  # A.X K1: DeepSeek-V3's blocks with an RMSNorm on each MoE block's output
            fields.update(hf_model_type=model_type, moe_output_norm=True)
        if model_type == "axk2":  # A.X K2: DeepSeek-V3.2's blocks with a gated query and gated norms
            _axk2(cfg, fields, n_layers, opt, bad)
        if model_type == "kimi_linear":  # Kimi-Linear: KDA layers among MLA ones without RoPE
            _kimi_linear(cfg, fields, opt)
        if model_type in _DSA_MODEL_TYPES:  # DeepSeek-V3.2, GLM-5: V3's blocks and an indexer that picks each
            # query's keys
            fields.update(hf_model_type=model_type, dsa=_sparse_attention(cfg, model_type, n_layers, opt, bad))
        if cfg.get("rope_interleave") is False:  # RoPE on halves of the rope channels: planned only (arch `moe`)
            fields["arch"] = "moe"
        if model_type == "mistral4":  # Mistral 4: a softmax router, the query scale by position
            _mistral4(cfg, rope, fields, opt, number, bad)
        elif model_type == "deepseek_v2":
            fields["softmax_router"] = _softmax_router(cfg, opt, number, bad)
        else:
            fields["sigmoid_router"] = _sigmoid_router(cfg, model_type, opt, number)
    elif arch == "gpt_oss":
        # transformers' defaults for what a gpt_oss config leaves out: layers alternating sliding (first) and full,
        # a 128-token window, RoPE base 150,000 with the published YaRN scaling, eps 1e-5
        window = cfg.get("sliding_window", 128)
        fields.update(qk_norm=False, attn_bias=opt_flag("attention_bias", True), router_bias=True,
                      sliding_window=None if window is None else count(window, "sliding_window"),
                      expert_ffn=req("intermediate_size"), rms_norm_eps=opt_num("rms_norm_eps", 1e-5))
        if not cfg.get("layer_types") and 0 < n_layers <= 100_000:
            fields["layer_types"] = tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                                          for i in range(n_layers))
        if rope_theta is None:
            fields["rope_theta"] = 150000.0
        if scaling is None and cfg.get("rope_scaling") is None and cfg.get("rope_parameters") is None:
            fields["rope_scaling"] = plain(GPT_OSS_ROPE_SCALING)
        # the core's clamped GLU clamps at gpt-oss's 7 (kernels.expert_grads.GPT_OSS_GLU): another limit is planned only
        limit = cfg.get("swiglu_limit")
        if limit is not None and number(limit, "swiglu_limit") != GPT_OSS_SWIGLU_LIMIT:
            fields["arch"] = "moe"
    elif arch == "mixtral":
        fields.update(qk_norm=False, expert_ffn=req("intermediate_size"))
    elif arch == "glm4_moe":  # GLM-4.5's blocks, read per family (_GLM4_FAMILIES)
        fam = _GLM4_FAMILIES[model_type]
        dense_key, dense_default = fam.dense
        first = (0 if dense_key is None else _leading_dense(cfg, model_type, opt, bad) if dense_key == "types"
                 else opt(dense_key, dense_default))
        if fam.export is not None:
            fields["hf_model_type"] = fam.export
        if model_type == "afmoe":
            _afmoe(cfg, fields, n_layers, opt, opt_flag, count, bad)
        elif model_type == "exaone_moe":
            _exaone_layers(cfg, fields, n_layers, opt, count, bad)
        elif model_type == "mimo_v2_flash":
            _mimo_attention(cfg, fields, rope, rope_by_type, opt, number, bad)
        if fam.qk_norm == "flag" and prf is None:  # GLM-4.5 itself: transformers rotates half of each head
            fields["partial_rotary_factor"] = 0.5
        shared_key, shared_default = fam.shared
        fields.update(qk_norm=opt_flag("use_qk_norm", False) if fam.qk_norm == "flag" else fam.qk_norm,
                      attn_bias=opt_flag("attention_bias", False),
                      shared_expert_ffn=opt(shared_key, shared_default) * fields["expert_ffn"], router_bias=True,
                      first_dense_layers=first, dense_ffn=req("intermediate_size") if first else 0,
                      sigmoid_router=_sigmoid_router(cfg, model_type, opt, number))
        if model_type == "step3p5":
            _step3p5(cfg, fields, n_layers, rope_by_type, opt, opt_flag, number, count, bad)
        if model_type == "laguna":
            _laguna(cfg, fields, rope_by_type, opt, number, count, bad)
        if fam.o_bias and fields["attn_bias"]:  # their biases include o_proj's, which GLM-4.5's blocks lack
            fields["arch"] = "moe"
    elif arch == "deepseek_v4":
        _deepseek_v4(cfg, fields, n_layers, req, opt, number, count, bad)
    elif arch == "qwen2_moe":
        _qwen2_moe(cfg, fields, n_layers, req, opt, opt_flag, count)
    elif arch == "ernie4_5_moe":
        _ernie(cfg, fields, n_layers, req, opt, opt_flag)
    elif arch == "minimax_m2":
        _minimax_m2(cfg, fields, opt, opt_flag, number, count)
    elif arch == "olmoe":
        # q/k norms over all heads together; clip_qkv clamps q and k (after their norms) and v. FlexOlmo
        # (flex_olmo): OLMoE's blocks with OLMo-2's norms, after each sublayer and none before
        fields.update(qk_norm=True, attn_bias=opt_flag("attention_bias", False),
                      shared_expert_ffn=opt("shared_expert_intermediate_size", 0))
        if model_type == "flex_olmo":
            fields.update(hf_model_type=model_type, norm_placement="post")
        if cfg.get("clip_qkv") is not None:
            fields["clip_qkv"] = number(cfg["clip_qkv"], "clip_qkv")
    elif arch == "llama4":
        _llama4(cfg, fields, n_layers, req, opt, opt_flag, number, count, bad)
    elif arch == "granitemoe":
        # Granite 3.x MoE: Mixtral's block with four multipliers (transformers' defaults 1 where absent), the top-k
        # weights a softmax over the chosen logits; granitemoeshared adds a plain shared expert
        fields.update(expert_ffn=req("intermediate_size"), shared_expert_ffn=opt("shared_intermediate_size", 0),
                      qk_norm=False, attn_bias=opt_flag("attention_bias", False), norm_topk_prob=True,
                      granite={k: 1.0 if cfg.get(f) is None else number(cfg[f], f) for k, f in (
                          ("embedding", "embedding_multiplier"), ("attention", "attention_multiplier"),
                          ("residual", "residual_multiplier"), ("logits", "logits_scaling"))})
        if model_type == "granitemoe_swa":
            _granite_swa(cfg, fields, n_layers, number, count, bad)
    elif arch in ("moe", "dense") and model_type == "gemma4_text":
        _gemma4(cfg, fields, rope_by_type, opt_flag, number, count)
    elif model_type == "gemma3_text":
        _gemma3(cfg, fields, rope_by_type, opt_flag, number)
    elif model_type == "cohere2":  # Cohere2 dense: Cohere2-MoE's blocks with a dense MLP in every layer
        scale = cfg.get("logit_scale", 0.0625)
        fields.update(hf_model_type="cohere2", qk_norm=False, attn_bias=opt_flag("attention_bias", False),
                      norm_placement="parallel", norm_kind="layer", rope_pairs=True, nope_full_layers=True,
                      rms_norm_eps=number(cfg["layer_norm_eps"], "layer_norm_eps"),  # its LayerNorm's, always
                      logit_scale=1.0 if scale is None else number(scale, "logit_scale"),
                      tie_embeddings=cfg.get("tie_word_embeddings", True) is not False)
        if not cfg.get("layer_types"):  # transformers' rule: every `sliding_window_pattern`-th layer full
            fields["layer_types"] = _rounded_layer_types(n_layers, max(opt("sliding_window_pattern", 4), 1),
                                                         "sliding_attention")
        if cfg.get("sliding_window", 4096) is not None and "sliding_attention" in fields["layer_types"]:
            fields["sliding_window"] = opt("sliding_window", 4096)
    elif model_type == "ernie4_5":  # ERNIE-4.5 dense: Llama's blocks, RoPE on channel pairs (its MoE's)
        fields.update(hf_model_type="ernie4_5", rope_pairs=True, attn_bias=False)
    elif model_type == "glm4":  # GLM-4 (0414): norms around each sublayer, q/k/v biases, RoPE on pairs of half a head
        fields.update(hf_model_type="glm4", norm_placement="sandwich", rope_pairs=True,
                      attn_bias=opt_flag("attention_bias", True))
    elif model_type == "phi3":  # Phi-3 / Phi-4: Llama's blocks, q/k/v and gate/up fused in its checkpoints
        fields.update(hf_model_type="phi3", attn_bias=False)
    elif model_type == "smollm3":  # SmolLM3: Llama's blocks, every `no_rope_layer_interval`-th layer without RoPE
        flags = cfg.get("no_rope_layers")
        if flags is None:
            interval = opt("no_rope_layer_interval", 4)
            if interval <= 0:
                raise bad("no_rope_layer_interval", "a positive whole number", cfg["no_rope_layer_interval"])
            flags = [int((i + 1) % interval != 0) for i in range(n_layers)]
        if not isinstance(flags, list) or len(flags) < n_layers or any(f not in (0, 1) for f in flags):
            raise bad("no_rope_layers", f"{n_layers} flags of 0 or 1", flags)
        if cfg.get("use_sliding_window"):
            raise bad("use_sliding_window", "false (SmolLM3's sliding layers are not planned)", True)
        fields.update(hf_model_type="smollm3", attn_bias=opt_flag("attention_bias", False),
                      nope_layers=tuple(i for i, f in enumerate(flags[:n_layers]) if not f),
                      tie_embeddings=opt_flag("tie_word_embeddings", True))
    elif model_type == "exaone4":  # EXAONE 4.0: norms after each sublayer, per-head q/k norms, K-EXAONE's layers
        fields.update(hf_model_type="exaone4", qk_norm=True, norm_placement="post", attn_bias=False)
        _exaone_layers(cfg, fields, n_layers, opt, count, bad)
    elif model_type == "granite":  # Granite 3.x dense: Llama's blocks with granitemoe's four multipliers
        fields.update(hf_model_type="granite", qk_norm=False, attn_bias=opt_flag("attention_bias", False),
                      granite={k: 1.0 if cfg.get(f) is None else number(cfg[f], f) for k, f in (
                          ("embedding", "embedding_multiplier"), ("attention", "attention_multiplier"),
                          ("residual", "residual_multiplier"), ("logits", "logits_scaling"))})
    elif model_type == "gemma":  # Gemma 1: Llama's blocks with (1 + w) norms, GeGLU and the scaled embedding
        if cfg.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh" or cfg.get("use_bidirectional_attention"):
            bad_key = "hidden_act" if cfg.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh" \
                else "use_bidirectional_attention"
            raise bad(bad_key, '"gelu_pytorch_tanh" and a causal model (Gemma\'s GeGLU)', cfg[bad_key])
        fields.update(offset_norms=True, hf_model_type="gemma", embedding_scale=math.sqrt(fields["hidden_size"]),
                      qk_norm=False, attn_bias=opt_flag("attention_bias", False))
        if cfg.get("head_dim") is None:
            fields["head_dim"] = 256  # transformers' default
        if cfg.get("tie_word_embeddings") is None:
            fields["tie_embeddings"] = True
    elif model_type in ("olmo2", "olmo3"):  # norms after each sublayer, q/k normed over all heads together
        fields.update(qk_norm=True, norm_placement="post", hf_model_type=model_type,
                      attn_bias=opt_flag("attention_bias", False))
        sliding = (rope_by_type or {}).get("sliding_attention") or {}
        if sliding:
            _sliding_rope(fields, sliding, number)
    elif arch == "moe" and model_type == "minimax_m3_vl_text":
        _minimax_m3(cfg, fields, n_layers, opt, number, bad)
    elif arch == "moe":
        _generic_moe(cfg, fields, n_layers, req, opt, opt_flag, bad)
    if model_type == "mellum":
        _mellum(cfg, fields, rope_by_type, opt, number, bad)
    if model_type in ("qwen3_vl_moe", "qwen3_vl_moe_text"):  # Qwen3-VL-MoE's text model: Qwen3-MoE's blocks; its
        # multimodal RoPE rotates a text-only sequence as plain RoPE (the three position ids are equal)
        fields["hf_model_type"] = "qwen3_vl_moe"
    if model_type == "cohere2_moe":
        _cohere2_moe(cfg, fields, n_layers, opt, opt_flag, number, bad)
    if model_type in ("qwen3_omni_moe", "qwen3_omni_moe_thinker", "qwen3_omni_moe_text"):  # Qwen3-Omni's thinker:
        # Qwen3-VL-MoE's text model
        fields["hf_model_type"] = "qwen3_omni_moe"
    if model_type in ("mistral", "mixtral") and not cfg.get("layer_types"):
        # transformers' Mistral and Mixtral slide every layer over `sliding_window` keys (Mistral: 4096 where the
        # field is absent; null turns it off, as in Mistral v0.2 and later and every Mixtral release)
        window = cfg.get("sliding_window", 4096 if model_type == "mistral" else None)
        if window is not None:
            fields.update(sliding_window=count(window, "sliding_window"), layer_types=("sliding_attention",) * n_layers)
    if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window") and cfg.get("sliding_window") \
            and not cfg.get("layer_types"):  # transformers' rule: the layers from max_window_layers on slide
        first = opt("max_window_layers", n_layers)
        fields["layer_types"] = tuple("sliding_attention" if i >= first else "full_attention" for i in range(n_layers))
    if "sliding_attention" in fields["layer_types"] and fields.get("sliding_window") is None \
            and cfg.get("sliding_window") is not None:
        fields["sliding_window"] = count(cfg["sliding_window"], "sliding_window")
    if "linear_attention" in fields["layer_types"] and fields.get("linear_attn") is None:
        raise ValueError(f"{path}: the linear_attention layers of model_type {_shown(model_type)} are not planned by "
                         f"this tool (it plans Qwen3-Next's and Qwen3.5's Gated DeltaNet and Kimi-Linear's Kimi Delta "
                         f"Attention)")
    if unknown:  # its type recorded: the core trains no block it has not checked (`trainable`)
        fields["hf_model_type"] = model_type
    shape = validate(ModelShape, fields, f"{path}: invalid model shape")
    if unknown:  # said once the config has read: a refusal is the only line
        sys.stderr.write(f"warning: {path}: model_type {_shown(model_type)} is not known; read by its standard "
                         f"fields as a {'MoE' if arch == 'moe' else 'dense'} model\n")
    return shape


# transformers' defaults where a config leaves the router's fields out: (n_group, topk_group, routed_scaling_factor)
_SIGMOID_ROUTER_DEFAULTS = {"deepseek_v3": (8, 4, 2.5), "axk1": (8, 4, 2.5), "deepseek_v32": (8, 4, 2.5),
                            "axk2": (1, 1, 2.5),
                            "kimi_k2": (8, 4, 2.5),
                            "kimi_linear": (1, 1, 2.446),
                            "glm_moe_dsa": (1, 1, 2.5), "glm4_moe": (1, 1, 1.0), "glm4_moe_lite": (1, 1, 1.8),
                            "dots1": (1, 1, 1.0), "solar_open": (1, 1, 1.0), "mimo_v2_flash": (1, 1, 1.0),
                            "hy_v3": (1, 1, 2.826), "exaone_moe": (1, 1, 2.5), "afmoe": (1, 1, 1.0),
                            "glm4v_moe": (1, 1, 1.0), "glm4v_moe_text": (1, 1, 1.0)}
# the MLA families whose attention layers an indexer makes sparse (DeepSeek sparse attention): DeepSeek-V3.2, GLM-5
_DSA_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")


def _axk2(cfg: dict, fields: dict, n_layers: int, opt, bad) -> None:
    """SK Telecom's A.X K2 (transformers' AXK2Config): DeepSeek-V3.2's blocks (MLA with the q LoRA, which it needs,
    DeepSeek sparse attention on every layer: 16 index heads where absent, the sigmoid router with a correction bias,
    ungrouped where `n_group` is null, shared experts, dense layers first) with the query projection fused with an
    output gate (`MLAShape.query_gate`) and the block norms gated (`gated_norm_rank`, 16 where absent)."""
    if not opt("q_lora_rank", 0):
        raise bad("q_lora_rank", "a positive whole number (A.X K2's indexer and output gate read the q LoRA)",
                  cfg.get("q_lora_rank"))
    if cfg.get("mlp_layer_types") is None and opt("moe_layer_freq", 1) != 1:
        raise bad("moe_layer_freq", "1 (dense layers between the MoE ones are not planned)", cfg["moe_layer_freq"])
    rank = opt("gated_norm_rank", 16)
    if rank <= 0:
        raise bad("gated_norm_rank", "a positive whole number", cfg.get("gated_norm_rank"))
    fields.update(hf_model_type="axk2", mla={**fields["mla"], "query_gate": True}, gated_norm_rank=rank,
                  dsa=_sparse_attention(cfg, "axk2", n_layers, opt, bad))


def _mlp_layer_types(cfg: dict, bad, n_layers: int = 0) -> list[str] | None:
    """`mlp_layer_types` ("dense" or "sparse" a layer, at least `n_layers` of them), None where absent."""
    types = cfg.get("mlp_layer_types")
    if types is not None and (not isinstance(types, list) or any(t not in ("dense", "sparse") for t in types)
                              or len(types) < n_layers):
        want = f'{n_layers} entries of "dense" and "sparse"' if n_layers else 'a list of "dense" and "sparse"'
        raise bad("mlp_layer_types", want, types)
    return types


def _sparse_attention(cfg: dict, model_type: str, n_layers: int, opt, bad) -> dict:
    """DSA's fields (transformers' defaults where absent: top 2048 keys, 128-wide index heads, 64 of them for
    DeepSeek-V3.2, 32 for GLM-5, 16 for A.X K2). GLM-5's `indexer_types` ("full" or "shared" a layer), else its
    `index_topk_pattern` ("F"/"S" a layer) or `index_topk_freq` / `index_skip_topk_offset` schedule, name the
    layers that reuse the previous indexing layer's selection."""
    glm = model_type == "glm_moe_dsa"
    fields: dict = {"rope_pairs": glm}
    heads = {"glm_moe_dsa": 32, "axk2": 16}.get(model_type, 64)
    for name, key, default in (("topk", "index_topk", 2048), ("index_heads", "index_n_heads", heads),
                               ("index_head_dim", "index_head_dim", 128)):
        fields[name] = opt(key, default)
        if fields[name] <= 0:
            raise bad(key, "a positive whole number", cfg[key])
    if not glm:
        return fields
    types = cfg.get("indexer_types")
    if types is None and cfg.get("index_topk_pattern") is not None:
        pattern = cfg["index_topk_pattern"]
        if not isinstance(pattern, str) or not set(pattern) <= {"F", "S"}:
            raise bad("index_topk_pattern", 'a string of "F" (full) and "S" (shared), one a layer', pattern)
        types = [{"F": "full", "S": "shared"}[c] for c in pattern]
    if types is None:
        freq, offset = max(opt("index_topk_freq", 1), 1), opt("index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]
    if (not isinstance(types, list) or len(types) < n_layers or any(t not in ("full", "shared") for t in types)
            or (types and types[0] != "full")):
        raise bad("indexer_types", f"a list of {n_layers} \"full\" or \"shared\" entries, the first \"full\"", types)
    fields["shared_layers"] = tuple(i for i, t in enumerate(types[:n_layers]) if t == "shared")
    return fields


class _Glm4Family(NamedTuple):
    """How a family on GLM-4.5's blocks reads its config: q/k norms (True, False, or "flag": `use_qk_norm`, and
    transformers' half-rotated heads where `partial_rotary_factor` is absent); the dense layers first (a key and its
    default, ("types", None) for `mlp_layer_types`, (None, None) for none); the shared experts' count (a key and its
    default, times the experts' width); the model type an export writes (None: GLM-4.5's own); whether an
    `attention_bias` includes o_proj's, which GLM-4.5's blocks lack (then planned only)."""
    qk_norm: bool | str
    dense: tuple[str | None, int | None]
    shared: tuple[str, int]
    export: str | None = None
    o_bias: bool = False


_GLM_DENSE, _N_SHARED, _COUNTED = ("first_k_dense_replace", 1), ("n_shared_experts", 0), ("num_shared_experts", 1)
_GLM4_FAMILIES = {
    # GLM-4.5, and GLM-4.5V/4.6V's text model (its multimodal RoPE plain RoPE on text)
    "glm4_moe": _Glm4Family("flag", _GLM_DENSE, _N_SHARED),
    "glm4v_moe": _Glm4Family("flag", _GLM_DENSE, _N_SHARED, "glm4v_moe"),
    "glm4v_moe_text": _Glm4Family("flag", _GLM_DENSE, _N_SHARED, "glm4v_moe"),
    # dots.llm1: Qwen3's per-head q/k norms always on
    "dots1": _Glm4Family(True, ("first_k_dense_replace", 0), _N_SHARED, "dots1"),
    # Solar Open: GLM-4.5's MoE under Llama's attention (no q/k norms, every channel rotated), every layer MoE
    "solar_open": _Glm4Family(False, (None, None), _N_SHARED, "solar_open"),
    # MiMo-V2-Flash: no shared experts, its dense layers by `mlp_layer_types`; attention whose sliding layers have
    # twice the key/value heads, sink logits and a RoPE base of their own, value heads narrower than the q/k heads,
    # the values scaled by `attention_value_scale` (_mimo_attention)
    "mimo_v2_flash": _Glm4Family(False, ("types", None), _N_SHARED, "mimo_v2_flash"),
    # Hunyuan-V3: per-head q/k norms before RoPE, plain shared experts of the experts' width by count, the top-k
    # sigmoid weights renormalized and scaled by `router_scaling_factor`, the correction bias on the MoE block
    "hy_v3": _Glm4Family(True, ("types", None), _COUNTED, "hy_v3", o_bias=True),
    # K-EXAONE: per-head q/k norms, sliding layers (`sliding_window_pattern`: every n-th layer full) rotated, the
    # full ones without RoPE (_exaone_layers)
    "exaone_moe": _Glm4Family(True, ("types", None), _COUNTED, "exaone_moe"),
    # AFMoE (Arcee's Trinity): per-head q/k norms, a sigmoid gate on the attention output, RoPE on the sliding layers
    # only, norms before and after each sublayer, the embedding times √h under `mup_enabled` (_afmoe)
    "afmoe": _Glm4Family(True, ("num_dense_layers", 1), ("num_shared_experts", 2), "afmoe", o_bias=True),
    # Step-3.5/3.7 (StepFun's Step-3.7-Flash text model): per-head q/k norms, a sigmoid gate per query head, sliding
    # layers with query heads, a RoPE base and a rotated share of their own, (1 + w) norms, one shared expert of
    # `share_expert_dim`, clamped SwiGLU on some layers (_step3p5; its hub form read by _step_config first)
    "step3p5": _Glm4Family(True, ("types", None), _N_SHARED, "step3p5", o_bias=True),
    # Laguna (Poolside's Laguna XS): per-head q/k norms, a softplus gate per query head, sliding layers with query
    # heads, a RoPE base and a rotated share of their own, a shared expert of its own width, the routed experts'
    # output scaled (_laguna)
    "laguna": _Glm4Family(True, ("types", None), _N_SHARED, "laguna", o_bias=True),
}


def _leading_dense(cfg: dict, model_type: str, opt, bad) -> int:
    """The dense layers before the MoE ones: `first_k_dense_replace`, or `mlp_layer_types` ("dense" and "sparse" a
    layer: GLM-4.7-Flash, MiMo-V2-Flash, Cohere2-MoE, …; transformers' default where absent: the family's), whose
    dense layers must lead."""
    types = _mlp_layer_types(cfg, bad)
    if types is None:  # transformers' defaults where the field is absent
        default = {"glm4_moe_lite": 1, "mimo_v2_flash": 1, "hy_v3": 1, "exaone_moe": 1, "step3p5": 3, "kimi_linear": 1,
                   "laguna": 1, "axk2": 1,
                   **dict.fromkeys(_DSA_MODEL_TYPES, 3)}.get(model_type, 0)
        return opt("first_k_dense_replace", default)
    k = types.index("sparse") if "sparse" in types else len(types)
    if "dense" in types[k:]:
        raise bad("mlp_layer_types", "the dense layers first, then the sparse ones", types)
    return k


def _sigmoid_router(cfg: dict, model_type: str, opt, number) -> dict:
    """DeepSeek-V3 / GLM-4.5 router fields (n_group, topk_group, routed_scaling_factor; absent ones at transformers'
    defaults for the model type)."""
    groups, topk_groups, scaling = _SIGMOID_ROUTER_DEFAULTS.get(model_type, (1, 1, 1.0))
    key = {"hy_v3": "router_scaling_factor", "afmoe": "route_scale",
           "step3p5": "moe_router_scaling_factor"}.get(model_type, "routed_scaling_factor")
    given = cfg.get(key)
    return dict(groups=opt("n_group", groups), topk_groups=opt("topk_group", topk_groups),
                scaling=scaling if given is None else number(given, key))


_SOFTMAX_MLA_TYPES = ("deepseek_v2", "mistral4")  # DeepSeek-V3's blocks under a softmax router, no correction bias


def _mistral4(cfg: dict, rope: dict, fields: dict, opt, number, bad) -> None:
    """Mistral 4 (Mistral Small 4's text model, `text_config` of its `mistral3` wrapper): DeepSeek-V3's MLA, dense
    layers and shared experts under a softmax router (the experts' softmax probabilities, the top-k in the best
    `topk_group` of `n_group` groups, renormalized under norm_topk_prob, times routed_scaling_factor) and a query
    scale by position: q · (1 + β · log(1 + ⌊p / P⌋)), β `rope_parameters.llama_4_scaling_beta`, P its
    `original_max_position_embeddings`."""
    given = cfg.get("routed_scaling_factor")
    fields.update(hf_model_type="mistral4", softmax_router=dict(
        groups=opt("n_group", 1), topk_groups=opt("topk_group", 1),
        scaling=1.0 if given is None else number(given, "routed_scaling_factor")))
    beta = rope.get("llama_4_scaling_beta")
    if beta is not None and number(beta, "rope_parameters.llama_4_scaling_beta") != 0.0:
        period = rope.get("original_max_position_embeddings")
        if isinstance(period, bool) or not isinstance(period, int) or period <= 0:
            raise bad("rope_parameters.original_max_position_embeddings", "a positive whole number beside "
                      "llama_4_scaling_beta", period)
        fields.update(query_scale_beta=float(beta), query_scale_period=period)


def _softmax_router(cfg: dict, opt, number, bad) -> dict:
    """DeepSeek-V2's router fields: `topk_method` "greedy" (transformers' default; one group) or
    "group_limited_greedy" (n_group, topk_group), routed_scaling_factor (default 1)."""
    method = cfg.get("topk_method", "greedy")
    given = cfg.get("routed_scaling_factor")
    scaling = 1.0 if given is None else number(given, "routed_scaling_factor")
    if method == "greedy":
        return dict(scaling=scaling)
    if method == "group_limited_greedy":
        return dict(groups=opt("n_group", 1), topk_groups=opt("topk_group", 1), scaling=scaling)
    raise bad("topk_method", "DeepSeek-V2's greedy or group_limited_greedy", method)


def _rope_scaling(cfg: dict, rope: dict, bad, number, count) -> dict | None:
    """The config's RoPE scaling (`rope_scaling`, or transformers' newer `rope_parameters`), None for plain RoPE."""
    key, src = "rope_parameters", rope
    legacy = cfg.get("rope_scaling")
    if legacy is not None:
        if not isinstance(legacy, dict):
            raise bad("rope_scaling", "an object", legacy)
        key, src = "rope_scaling", legacy
    kind = src.get("rope_type", src.get("type")) or "default"
    if not isinstance(kind, str):
        raise bad(f"{key}.rope_type", "a name", kind)
    if kind == "default":
        return None
    out: dict = {"kind": kind}
    for name in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "low_freq_factor",
                 "high_freq_factor", "alpha"):  # the same names as RopeScaling's
        if src.get(name) is not None:
            out[name] = number(src[name], f"{key}.{name}")
    if src.get("original_max_position_embeddings") is not None:
        out["original_max_position"] = count(src["original_max_position_embeddings"],
                                             f"{key}.original_max_position_embeddings")
        if kind == "yarn" and "factor" not in out and cfg.get("max_position_embeddings"):  # implied by the stretch
            out["factor"] = count(cfg["max_position_embeddings"], "max_position_embeddings") / out[
                "original_max_position"]
    if isinstance(src.get("truncate"), bool):
        out["truncate"] = src["truncate"]
    return out


def _deepseek_v4(cfg: dict, fields: dict, n_layers: int, req, opt, number, count, bad) -> None:
    """DeepSeek-V4 (transformers' DeepseekV4Config; absent fields at its defaults): the layer types (or the older
    `compress_ratios`, 0 / 4 / 128 a layer; else two heavily compressed layers, then sparse and heavy alternating),
    the compression rates (`compress_rates`, or `compress_rate_csa` / `compress_rate_hca`), the hash-routed layers
    (`mlp_layer_types`' "hash_moe", or `num_hash_layers`; 3), one shared expert of the experts' width, sqrtsoftplus
    scores with a correction bias, their weights renormalized and scaled."""
    if not cfg.get("layer_types"):
        ratios = cfg.get("compress_ratios")
        by_ratio = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
        if ratios is not None:
            if not isinstance(ratios, list) or any(r not in by_ratio for r in ratios) or len(ratios) < n_layers:
                raise bad("compress_ratios", f"{n_layers} entries of 0, 4 and 128", ratios)
            types = [by_ratio[r] for r in ratios]
        else:
            types = ["heavily_compressed_attention"] * min(n_layers, 2) + [
                "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                for i in range(max(n_layers - 2, 0))]
        fields["layer_types"] = tuple(types[:n_layers])
    rates = cfg.get("compress_rates") or {}
    if not isinstance(rates, dict):
        raise bad("compress_rates", "an object", rates)
    csa = rates.get("compressed_sparse_attention", cfg.get("compress_rate_csa", 4))
    hca = rates.get("heavily_compressed_attention", cfg.get("compress_rate_hca", 128))
    types = cfg.get("mlp_layer_types")
    if types is not None:
        if not isinstance(types, list) or any(t not in ("hash_moe", "moe") for t in types) or len(types) < n_layers:
            raise bad("mlp_layer_types", f'{n_layers} entries of "hash_moe" and "moe"', types)
        k = types.index("moe") if "moe" in types else len(types)
        if "hash_moe" in types[k:n_layers]:
            raise bad("mlp_layer_types", 'the "hash_moe" layers first, then the "moe" ones', types)
        hash_layers = min(k, n_layers)
    else:
        hash_layers = min(opt("num_hash_layers", 3), n_layers)
    width = fields["expert_ffn"]
    prf = cfg.get("partial_rotary_factor")
    head_dim = opt("head_dim", 512)
    if prf is None:
        prf = opt("qk_rope_head_dim", 64) / head_dim
    scoring = cfg.get("scoring_func", "sqrtsoftplus")
    if not isinstance(scoring, str):
        raise bad("scoring_func", "a name", scoring)
    scale = cfg.get("routed_scaling_factor", 1.5)
    window = cfg.get("sliding_window", 128)
    fields.update(
        head_dim=head_dim, num_kv_heads=opt("num_key_value_heads", 1), qk_norm=False,
        partial_rotary_factor=number(prf, "partial_rotary_factor"), sliding_window=count(window, "sliding_window"),
        shared_expert_ffn=opt("n_shared_experts", 1) * width, router_bias=True,
        sigmoid_router=dict(groups=1, topk_groups=1, scaling=1.0 if scale is None else number(
            scale, "routed_scaling_factor")),
        compressed=dict(
            q_lora_rank=opt("q_lora_rank", 1024), o_groups=opt("o_groups", 8), o_lora_rank=opt("o_lora_rank", 1024),
            csa_rate=count(csa, "compress_rates.compressed_sparse_attention"),
            hca_rate=count(hca, "compress_rates.heavily_compressed_attention"),
            index_heads=opt("index_n_heads", 64), index_head_dim=opt("index_head_dim", 128),
            index_topk=opt("index_topk", 512), hc_mult=opt("hc_mult", 4), hash_layers=hash_layers, scoring=scoring,
            swiglu_limit=number(cfg.get("swiglu_limit", 10.0), "swiglu_limit")))


def _cohere2_moe(cfg: dict, fields: dict, n_layers: int, opt, opt_flag, number, bad) -> None:
    """Cohere2-MoE (transformers' Cohere2MoeConfig): one norm a layer whose output the attention and the MLP both
    take, added to the residual together; LayerNorm (centred, a weight, no bias) unless the config gives
    `rms_norm_eps`; RoPE on channel pairs, on the sliding layers only; the logits times `logit_scale`; experts of
    `intermediate_size` under a softmax over the top-k logits, or (`expert_selection_fn` "sigmoid") the sigmoid of
    each, renormalized under `norm_topk_prob`; `num_shared_experts` shared ones of the same width added, or averaged
    (`shared_expert_combination_strategy`); dense layers of `prefix_dense_intermediate_size` first
    (`mlp_layer_types`, or `first_k_dense_replace`, whose layers' attention follows
    `prefix_dense_sliding_window_pattern`)."""
    shared = opt("num_shared_experts", 0) * fields["expert_ffn"]  # the experts' width: `intermediate_size`
    strategy = cfg.get("shared_expert_combination_strategy", "average")
    if strategy not in ("sum", "average"):
        raise bad("shared_expert_combination_strategy", '"sum" or "average"', strategy)
    selection = cfg.get("expert_selection_fn", "softmax")
    if selection not in ("softmax", "sigmoid"):
        raise bad("expert_selection_fn", '"softmax" or "sigmoid"', selection)
    scale = cfg.get("logit_scale", 0.0625)
    fields.update(hf_model_type="cohere2_moe", qk_norm=False, attn_bias=bool(cfg.get("attention_bias", False)),
                  norm_placement="parallel",
                  norm_kind="rms" if cfg.get("rms_norm_eps") is not None else "layer", rope_pairs=True,
                  nope_full_layers=True, logit_scale=1.0 if scale is None else number(scale, "logit_scale"),
                  shared_expert_ffn=shared, shared_expert_mean=bool(shared) and strategy == "average",
                  sigmoid_top=selection == "sigmoid",
                  norm_topk_prob=selection == "softmax" or opt_flag("norm_topk_prob", True),
                  tie_embeddings=cfg.get("tie_word_embeddings", True) is not False)
    first = _leading_dense(cfg, "cohere2_moe", opt, bad)
    if first:
        dense_ffn = cfg.get("prefix_dense_intermediate_size")
        if dense_ffn is None:
            raise bad("prefix_dense_intermediate_size", "the dense layers' width", None)
        # transformers rotates the prefix's layers where its pattern (1) makes them all full
        fields.update(first_dense_layers=first, dense_ffn=int(number(dense_ffn, "prefix_dense_intermediate_size")),
                      rotated_prefix=opt("prefix_dense_sliding_window_pattern", 1) == 1)
    if not cfg.get("layer_types"):  # transformers' rule: every `sliding_window_pattern`-th layer full, counted
        # apart over the dense prefix (its own pattern) and the rest
        fields["layer_types"] = (
            _rounded_layer_types(first, max(opt("prefix_dense_sliding_window_pattern", 1), 1), "sliding_attention")
            + _rounded_layer_types(n_layers - first, max(opt("sliding_window_pattern", 4), 1), "sliding_attention"))
    if cfg.get("sliding_window", 4096) is not None and "sliding_attention" in fields["layer_types"]:
        fields["sliding_window"] = opt("sliding_window", 4096)


def _granite_swa(cfg: dict, fields: dict, n_layers: int, number, count, bad) -> None:
    """Granite-SWA MoE (granitemoe_swa): a sink logit per head on every layer, the sliding layers (every layer but
    each 4th from the first where `layer_types` is absent) over `sliding_window` (128) keys, and a RoPE base per layer
    (`layer_rope_theta`, 0 for no RoPE): trained where the bases follow the layer kinds — one for the full layers (or
    none), one for the sliding ones — and planned only otherwise."""
    if not cfg.get("layer_types"):
        fields["layer_types"] = tuple("full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n_layers))
    window = cfg.get("sliding_window", 128)
    fields.update(hf_model_type="granitemoe_swa", sinks="all",
                  sliding_window=None if window is None else count(window, "sliding_window"))
    thetas = cfg.get("layer_rope_theta")
    if thetas is None:
        return
    if not isinstance(thetas, list) or len(thetas) < n_layers:
        raise bad("layer_rope_theta", f"{n_layers} RoPE bases (0: none)", thetas)
    by_kind: dict[str, set] = {}
    for kind, t in zip(fields["layer_types"], thetas):
        by_kind.setdefault(kind, set()).add(0.0 if t is None else number(t, "layer_rope_theta"))
    full, sliding = by_kind.get("full_attention", set()), by_kind.get("sliding_attention", set())
    if len(full) > 1 or len(sliding) > 1 or 0.0 in sliding:  # bases that do not follow the kinds: planned only
        fields["arch"] = "moe"
        return
    rotated_full = bool(full) and full != {0.0}
    if full == {0.0}:
        fields["nope_full_layers"] = True
    elif full:
        fields["rope_theta"] = full.pop()
    if sliding:  # the sliding layers' base: the model's where no full layer rotates, else their own where it differs
        base = sliding.pop()
        if not rotated_full:
            fields["rope_theta"] = base
        elif base != fields["rope_theta"]:
            fields["sliding_rope_theta"] = base


def _afmoe(cfg: dict, fields: dict, n_layers: int, opt, opt_flag, count, bad) -> None:
    """AFMoE's attention and blocks (transformers' AfmoeConfig defaults where absent): layer types by
    `global_attn_every_n_layers` (every n-th full) where `layer_types` is absent, the sliding ones over
    `sliding_window` (1024) keys and rotated, the full ones not; the output gate; sandwich norms; the embedding
    scaled by √h under `mup_enabled`."""
    if not cfg.get("layer_types"):
        n = opt("global_attn_every_n_layers", 4)
        if n <= 0:
            raise bad("global_attn_every_n_layers", "a positive whole number", n)
        fields["layer_types"] = _rounded_layer_types(n_layers, n, "sliding_attention")
    window = cfg.get("sliding_window", 1024)
    fields.update(attn_output_gate=True, nope_full_layers=True, norm_placement="sandwich",
                  sliding_window=None if window is None else count(window, "sliding_window"),
                  embedding_scale=fields["hidden_size"] ** 0.5 if opt_flag("mup_enabled", False) else 1.0)


def _exaone_layers(cfg: dict, fields: dict, n_layers: int, opt, count, bad) -> None:
    """K-EXAONE's attention layers as transformers derives them where `layer_types` is absent: every
    `sliding_window_pattern`-th layer full, the rest sliding over `sliding_window` keys (4096 where absent; null: all
    full); its full layers take no RoPE where any layer slides."""
    window = cfg.get("sliding_window", 4096)
    if window is None:
        fields["layer_types"] = ("full_attention",) * n_layers
        return
    if not cfg.get("layer_types"):
        pattern = opt("sliding_window_pattern", 4)
        if pattern <= 0:
            raise bad("sliding_window_pattern", "a positive whole number", pattern)
        fields["layer_types"] = _rounded_layer_types(n_layers, pattern, "sliding_attention")
    fields.update(sliding_window=count(window, "sliding_window"),
                  nope_full_layers="sliding_attention" in fields["layer_types"])


def _step_config(cfg: dict, bad) -> dict:
    """Step-3.5/3.7's text config in transformers' field names (Step3p7TextConfig), from either form: the hub's
    (`num_attention_groups`, `moe_num_experts`, `moe_top_k`, `moe_layers_enum`, per-layer `rope_theta` and
    `partial_rotary_factors` lists, `attention_other_setting` for the sliding layers, `rope_scaling` on the full
    layers) or transformers' own (`rope_parameters` by layer type, `num_sliding_attention_heads`, `mlp_layer_types`).
    Lists that also cover the multi-token-prediction layers are cut to the decoder's by the reader."""
    cfg = dict(cfg)
    for hub, name in (("num_attention_groups", "num_key_value_heads"), ("moe_num_experts", "n_routed_experts"),
                      ("moe_top_k", "num_experts_per_tok")):
        if cfg.get(name) is None and cfg.get(hub) is not None:
            cfg[name] = cfg[hub]
    other = cfg.get("attention_other_setting")
    if other is not None and not isinstance(other, dict):
        raise bad("attention_other_setting", "an object", other)
    if cfg.get("num_sliding_attention_heads") is None and other and other.get("num_attention_heads") is not None:
        cfg["num_sliding_attention_heads"] = other["num_attention_heads"]
    n = cfg.get("num_hidden_layers")
    if cfg.get("mlp_layer_types") is None and cfg.get("moe_layers_enum") is not None and isinstance(n, int) \
            and 0 < n <= 100_000:
        items = cfg["moe_layers_enum"]
        items = items.split(",") if isinstance(items, str) else items
        try:
            moe = {int(str(i).strip()) for i in items if str(i).strip()}
        except (TypeError, ValueError):
            raise bad("moe_layers_enum", 'the MoE layers\' indices ("3,4,5" or a list)', cfg["moe_layers_enum"]) from None
        cfg["mlp_layer_types"] = ["sparse" if i in moe else "dense" for i in range(n)]
    rope = cfg.get("rope_parameters")
    by_type = isinstance(rope, dict) and rope and all(k in LAYER_TYPES and isinstance(v, dict) for k, v in rope.items())
    if not by_type and (isinstance(cfg.get("rope_theta"), list) or cfg.get("partial_rotary_factors") is not None):
        types = cfg.get("layer_types") or ["full_attention"] * (n if isinstance(n, int) and 0 < n <= 100_000 else 1)
        theta, share = cfg.get("rope_theta", 10000.0), cfg.get("partial_rotary_factors")
        for key, v in (("rope_theta", theta), ("partial_rotary_factors", share)):
            if isinstance(v, list) and len(v) < len(types):
                raise bad(key, f"one entry for each of the {len(types)} layers", v)
        if share is not None and not isinstance(share, list):
            raise bad("partial_rotary_factors", "a list, one a layer", share)
        rope = {}
        for i, t in enumerate(types):
            if isinstance(t, str) and t not in rope:
                rope[t] = {"rope_type": "default", "rope_theta": theta[i] if isinstance(theta, list) else theta,
                           **({"partial_rotary_factor": share[i]} if share is not None else {})}
        scaling = cfg.pop("rope_scaling", None)
        if isinstance(scaling, dict) and "full_attention" in rope:  # the hub's scaling is the full layers' alone
            rope["full_attention"] = {**rope["full_attention"], **scaling}
        cfg["rope_parameters"] = rope
        cfg.pop("rope_theta", None)
        cfg.pop("partial_rotary_factors", None)
    return cfg


# Kimi-Linear's hub names for what transformers' KimiLinearConfig (its attribute_map) and this reader call otherwise
_KIMI_NAMES = (("num_experts_per_token", "num_experts_per_tok"), ("num_shared_experts", "n_shared_experts"),
               ("num_expert_group", "n_group"), ("moe_renormalize", "norm_topk_prob"),
               ("model_max_length", "max_position_embeddings"))


def _kimi_config(cfg: dict, bad) -> dict:
    """Kimi-Linear's config in the field names the DeepSeek-V3 reader takes, from either form: the hub's
    (`linear_attn_config` with 1-indexed `kda_layers` and `full_attn_layers`, `num_heads`, `head_dim`,
    `short_conv_kernel_size`; the MoE and length fields by the names of transformers' attribute_map:
    `num_experts_per_token`, `num_shared_experts`, `num_expert_group`, `moe_renormalize`, `model_max_length`) or
    transformers' own (`layer_types`, `mlp_layer_types`, `linear_num_heads`, `linear_head_dim`,
    `linear_conv_kernel_dim`; the standard MoE names too). Where a field is absent, transformers' KimiLinearConfig
    default: layer_types, where neither form gives them, full attention at every layer i > 0 with i % 4 == 0; one
    shared expert. The KDA variants the release does not have are refused by field: a decay gate with a lower
    bound (`gate_lower_bound`) or of full rank (`use_full_rank_gate`), layer lists indexed from other than 1
    (`kda_layer_index_base`), a layer in both lists or in neither, a `linear_attn_config` without its heads' count
    and width."""
    cfg = dict(cfg)
    for hub, name in _KIMI_NAMES:
        if cfg.get(hub) is not None:
            cfg[name] = cfg[hub]
    if cfg.get("n_shared_experts") is None:
        cfg["n_shared_experts"] = 1
    la = cfg.get("linear_attn_config")
    if la is not None and not isinstance(la, dict):
        raise bad("linear_attn_config", "an object", la)
    la = la or {}
    for src, prefix in ((la, "linear_attn_config."), (cfg, "")):
        if src.get("gate_lower_bound") is not None:
            raise bad(f"{prefix}gate_lower_bound", "null (KDA with a lower-bounded decay gate is not planned)",
                      src["gate_lower_bound"])
        if src.get("use_full_rank_gate") not in (None, False):
            raise bad(f"{prefix}use_full_rank_gate", "false (KDA with a full-rank decay gate is not planned)",
                      src["use_full_rank_gate"])
        if src.get("kda_layer_index_base") not in (None, 1):
            raise bad(f"{prefix}kda_layer_index_base", "1 (the release's layer numbers, from 1)",
                      src["kda_layer_index_base"])
    if "linear_attn_config" in cfg:
        for key in ("num_heads", "head_dim"):
            if la.get(key) is None:
                raise ValueError(f"missing field 'linear_attn_config.{key}' for model_type 'kimi_linear' (the KDA "
                                 f"heads' {'count' if key == 'num_heads' else 'width'})")
        cfg.update(linear_num_heads=la["num_heads"], linear_head_dim=la["head_dim"],
                   linear_conv_kernel_dim=la.get("short_conv_kernel_size", 4))
    n = cfg.get("num_hidden_layers")
    if not (isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 100_000) or cfg.get("layer_types"):
        return cfg
    if "kda_layers" in la or "full_attn_layers" in la:
        kda, full = la.get("kda_layers"), la.get("full_attn_layers")
        for key, v in (("kda_layers", kda), ("full_attn_layers", full)):
            if not isinstance(v, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= n
                                              for i in v):
                raise bad(f"linear_attn_config.{key}", f"a list of layer numbers from 1 to {n}", v)
        both = sorted(set(kda) & set(full))
        neither = sorted(set(range(1, n + 1)) - set(kda) - set(full))
        if both or neither:
            what = f"layer {both[0]} is in both" if both else f"layer {neither[0]} is in neither"
            raise ValueError(f"fields 'linear_attn_config.kda_layers' and 'linear_attn_config.full_attn_layers': "
                             f"{what} (each of the {n} layers is KDA or full attention)")
        cfg["layer_types"] = ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)]
    elif la:
        raise ValueError("missing field 'linear_attn_config.kda_layers' and 'linear_attn_config.full_attn_layers' "
                         "(or 'layer_types') for model_type 'kimi_linear'")
    else:
        cfg["layer_types"] = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    return cfg


def _kimi_linear(cfg: dict, fields: dict, opt) -> None:
    """Kimi-Linear (transformers' KimiLinearForCausalLM) on DeepSeek-V3's blocks: its linear_attention layers Kimi
    Delta Attention (`linear_num_heads` heads of `linear_head_dim` for q, k and v alike, convs of
    `linear_conv_kernel_dim`; transformers' defaults 32, 128 and 4), its full_attention layers MLA without RoPE
    (`mla_use_nope`; the rotated share of the key stays, shared by the heads, unrotated), sigmoid routing with the
    correction bias. MLA with RoPE (`mla_use_nope` false), MTP layers, MoE layers off every layer
    (`moe_layer_freq`) and routing other than the sigmoid's are not a released form: refused by field."""
    def refuse(key: str, want: str):
        raise ValueError(f"field {key!r}: expected {want}, got {_shown(cfg[key])}")

    if cfg.get("mla_use_nope") not in (None, True):
        refuse("mla_use_nope", "true (Kimi-Linear's MLA without RoPE; with RoPE it is not a released form)")
    if opt("num_nextn_predict_layers", 0):
        refuse("num_nextn_predict_layers", "0 (Kimi-Linear has no multi-token-prediction layers)")
    if opt("moe_layer_freq", 1) != 1:
        refuse("moe_layer_freq", "1 (every layer after the dense ones MoE)")
    if cfg.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        refuse("moe_router_activation_func", '"sigmoid"')
    heads, width = opt("linear_num_heads", 32), opt("linear_head_dim", 128)
    fields.update(hf_model_type="kimi_linear", nope_full_layers=True,
                  linear_attn=dict(kind="kda", num_k_heads=heads, num_v_heads=heads, head_k_dim=width,
                                   head_v_dim=width, conv_kernel=opt("linear_conv_kernel_dim", 4)))
    fields.pop("rope_scaling", None)  # no layer rotates


def _laguna(cfg: dict, fields: dict, rope_by_type: dict | None, opt, number, count, bad) -> None:
    """Laguna (transformers' LagunaForCausalLM): per-head q/k norms; a softplus gate per query head from `g_proj`
    (`gating` true or "per-head"; "per-element" is planned only); query heads by layer
    (`num_attention_heads_per_layer`: the full layers' and the sliding layers' counts, `sliding_heads`; counts that
    do not follow the layer kinds are planned only); RoPE by layer type (`rope_parameters`: the sliding layers' base
    and rotated share their own); sigmoid routing with a correction bias, the top-k renormalized, the routed
    experts' output times `moe_routed_scaling_factor` (the same as weights so scaled), a shared expert of
    `shared_expert_intermediate_size`. Router logits soft-capped (`moe_router_logit_softcapping` > 0) are planned
    only; router weights on the experts' input are refused, as transformers refuses them."""
    if cfg.get("moe_apply_router_weight_on_input"):
        raise bad("moe_apply_router_weight_on_input", "false (transformers' Laguna does not implement it)", True)
    given = cfg.get("moe_routed_scaling_factor")
    sliding_layers = "sliding_attention" in fields["layer_types"]
    fields.update(shared_expert_ffn=opt("shared_expert_intermediate_size", 0), norm_topk_prob=True,
                  sliding_window=(opt("sliding_window", 0) or None) if sliding_layers else None,
                  sigmoid_router=dict(groups=1, topk_groups=1, scaling=1.0 if given is None else number(
                      given, "moe_routed_scaling_factor")))
    cap = cfg.get("moe_router_logit_softcapping")
    if cap is not None and number(cap, "moe_router_logit_softcapping") > 0:
        fields["arch"] = "moe"
    gating = cfg.get("gating", True)
    if gating is True or gating == "per-head":
        fields.update(head_gate=True, head_gate_activation="softplus")
    elif gating is not False:
        fields["arch"] = "moe"  # a gate per channel
    per_layer = cfg.get("num_attention_heads_per_layer")
    if per_layer is not None:
        if not isinstance(per_layer, list) or len(per_layer) != len(fields["layer_types"]):
            raise bad("num_attention_heads_per_layer", f"{len(fields['layer_types'])} head counts", per_layer)
        by_kind: dict[str, set] = {}
        for i, (kind, n) in enumerate(zip(fields["layer_types"], per_layer)):
            by_kind.setdefault(kind, set()).add(count(n, f"num_attention_heads_per_layer[{i}]"))
        full, sliding = by_kind.get("full_attention", set()), by_kind.get("sliding_attention", set())
        if len(full) > 1 or len(sliding) > 1:
            fields["arch"] = "moe"  # head counts that do not follow the layer kinds
        else:
            if full:
                fields["num_heads"] = full.pop()
            if sliding and sliding != {fields["num_heads"]}:
                fields["sliding_heads"] = sliding.pop()
    if cfg.get("rope_parameters") is None:  # transformers' defaults: the full layers half rotated at base 5e5, the
        # sliding ones whole at 1e4
        fields.update(rope_theta=500000.0, partial_rotary_factor=0.5)
        rope_by_type = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    sliding = (rope_by_type or {}).get("sliding_attention") or {}
    if sliding_layers and sliding:  # transformers rotates a kind's whole heads where its entry gives no share
        _sliding_rope(fields, sliding, number, share_default=1.0)


def _gemma4_config(cfg: dict, bad) -> dict:
    """Gemma 4's text config (its `gemma4` wrapper's `text_config`) in the reader's terms, transformers' defaults
    where it leaves a field out: the MoE block on (`enable_moe_block`) or off (a dense model: `_dense`; per-layer
    input embeddings, which transformers builds where `hidden_size_per_layer_input` is absent, and shared-KV layers
    are not planned, nor bidirectional attention), `top_k_experts` as the experts a token takes, layer types five
    sliding to one full
    with the last forced full, RoPE by layer type (the full layers' "proportional" RoPE at factor 1 reads as their
    rotated share with `rope_proportional`: that share's frequencies spaced over the whole head). The full layers' head width and KV heads go to `_gemma4` as
    `_full_head_dim` and `_full_kv_heads`."""
    if cfg.get("enable_moe_block") not in (True, False, None):
        raise bad("enable_moe_block", "true or false", cfg["enable_moe_block"])
    for key, default in (("hidden_size_per_layer_input", 256), ("num_kv_shared_layers", 0)):  # transformers'
        if cfg.get(key, default):
            raise bad(key, "0 or null (per-layer input embeddings and layers sharing another's keys and values are "
                      "not planned)", cfg.get(key, default))
    if cfg.get("use_bidirectional_attention") == "all":
        raise bad("use_bidirectional_attention", '"vision" or null (a causal text model)',
                  cfg["use_bidirectional_attention"])
    out = {"head_dim": 256, "sliding_window": 512, "attention_k_eq_v": False, "tie_word_embeddings": True,
           "pad_token_id": 0, "intermediate_size": 9216, **cfg, "_dense": cfg.get("enable_moe_block") is not True}
    if cfg.get("top_k_experts") is not None:
        out["num_experts_per_tok"] = cfg["top_k_experts"]
    n = cfg.get("num_hidden_layers")
    if not cfg.get("layer_types") and isinstance(n, int) and 0 < n <= 100_000:
        out["layer_types"] = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    if isinstance(out.get("layer_types"), list) and out["layer_types"]:  # transformers forces the last layer full
        out["layer_types"] = [*out["layer_types"][:-1], "full_attention"]
    # the full layers' head width and KV heads: `global_head_dim` (512) and, with keys as values,
    # `num_global_key_value_heads`; or, as transformers saves them, `per_layer_config` (layer → its overrides)
    per_layer = cfg.get("per_layer_config")
    if per_layer is not None:
        types = out.get("layer_types") or []
        if not isinstance(per_layer, dict) or not all(isinstance(v, dict) for v in per_layer.values()):
            raise bad("per_layer_config", "an object of layer overrides", per_layer)
        try:
            kinds = {types[int(i)]: None for i in per_layer}
        except (ValueError, IndexError, TypeError):
            raise bad("per_layer_config", f"layer indices below {len(types)}", sorted(per_layer)) from None
        overrides = {(v.get("head_dim"), v.get("num_key_value_heads")) for v in per_layer.values()}
        full = [i for i, t in enumerate(types) if t == "full_attention"]
        if set(kinds) != {"full_attention"} or len(overrides) != 1 or sorted(int(i) for i in per_layer) != full:
            raise bad("per_layer_config", "one override for every full-attention layer and none other (per-layer "
                      "head widths otherwise are not planned)", per_layer)
        width, out["_full_kv_heads"] = next(iter(overrides))
        out["_full_head_dim"] = out["head_dim"] if width is None else width  # an override of the KV heads alone
    else:
        out["_full_head_dim"] = 512 if cfg.get("global_head_dim") is None else cfg["global_head_dim"]
        out["_full_kv_heads"] = cfg.get("num_global_key_value_heads") if out["attention_k_eq_v"] else None
    rope = cfg.get("rope_parameters")
    if rope is None:
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}
    if isinstance(rope, dict):
        full = rope.get("full_attention")
        out["_proportional"] = isinstance(full, dict) and full.get("rope_type") == "proportional"
        if isinstance(full, dict) and full.get("rope_type", "default") == "default":  # transformers' Gemma 4 rotates
            rope = {**rope, "full_attention": {**full, "partial_rotary_factor": 1.0}}  # whole heads at "default"
        rope = {k: ({**v, "rope_type": "default"} if isinstance(v, dict) and v.get("rope_type") == "proportional"
                    and v.get("factor", 1.0) == 1.0 else v) for k, v in rope.items()}
    if out.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise bad("hidden_activation", '"gelu_pytorch_tanh" (the GeGLU Gemma 4 is trained with)',
                  out["hidden_activation"])
    return {**out, "rope_parameters": rope}


# transformers' MiniMaxM3VLTextConfig defaults (MiniMaxAI/MiniMax-M3)
_MINIMAX_M3_DEFAULTS = {"vocab_size": 200064, "hidden_size": 6144, "intermediate_size": 3072, "num_hidden_layers": 60,
                        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
                        "max_position_embeddings": 524288, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                        "num_experts_per_tok": 4, "num_local_experts": 128, "dense_intermediate_size": 12288,
                        "shared_intermediate_size": 3072, "routed_scaling_factor": 2.0, "rotary_dim": 64,
                        "index_n_heads": 4, "index_head_dim": 128, "index_block_size": 128, "index_topk_blocks": 16,
                        "index_local_blocks": 1}
# its releases' `sparse_attention_config` names for the indexer's fields
_MINIMAX_M3_LEGACY = {"sparse_num_index_heads": "index_n_heads", "sparse_index_dim": "index_head_dim",
                      "sparse_block_size": "index_block_size", "sparse_topk_blocks": "index_topk_blocks",
                      "sparse_local_block": "index_local_blocks"}


def _minimax_m3_config(cfg: dict, bad) -> dict:
    """MiniMax-M3's text config (its `minimax_m3_vl` wrapper's `text_config`) in the reader's terms, as transformers'
    MiniMaxM3VLTextConfig reads it: its defaults where a field is absent; the releases' `sparse_attention_config`
    (the indexer's fields under their own names, `sparse_attention_freq` a flag a layer) and `moe_layer_freq` (a
    flag a layer: MoE or dense) where `layer_types` and `mlp_layer_types` are absent; the block-sparse layers
    ("minimax_m3_sparse") read as full attention, their indices passed on as `_sparse_layers`."""
    sparse = cfg.get("sparse_attention_config") or {}
    if not isinstance(sparse, dict):
        raise bad("sparse_attention_config", "an object", sparse)
    out = {**_MINIMAX_M3_DEFAULTS, **{new: sparse[old] for old, new in _MINIMAX_M3_LEGACY.items() if old in sparse},
           **{k: v for k, v in cfg.items() if v is not None or k not in _MINIMAX_M3_DEFAULTS}}
    n = out["num_hidden_layers"]
    for key, flags, yes, no in (("layer_types", sparse.get("sparse_attention_freq"), "minimax_m3_sparse",
                                 "full_attention"), ("mlp_layer_types", cfg.get("moe_layer_freq"), "sparse", "dense")):
        if out.get(key) is None and flags is not None:
            if not isinstance(flags, list):
                raise bad("sparse_attention_config.sparse_attention_freq" if key == "layer_types" else "moe_layer_freq",
                          "a list of flags, one a layer", flags)
            out[key] = [yes if f else no for f in flags]
    types = out.get("layer_types")
    if isinstance(types, list) and isinstance(n, int):
        if any(t not in ("full_attention", "minimax_m3_sparse") for t in types) or len(types) < n:
            raise bad("layer_types", f'{n} entries of "full_attention" and "minimax_m3_sparse"', types)
        out["_sparse_layers"] = tuple(i for i, t in enumerate(types[:n]) if t == "minimax_m3_sparse")
        out["layer_types"] = ["full_attention"] * n
    return out


def _minimax_m3(cfg: dict, fields: dict, n_layers: int, opt, number, bad) -> None:
    """MiniMax's MiniMax-M3 text model (transformers' MiniMaxM3VLTextConfig; `_minimax_m3_config` gives its
    defaults): GQA with per-head q/k norms and (1 + w) norms throughout, RoPE on the first `rotary_dim` channels of
    each head; block-sparse attention on its "minimax_m3_sparse" layers (`BlockSparseShape`); every MoE layer 128
    experts (`intermediate_size` wide, top 4) under a sigmoid router with a correction bias, renormalized, times
    `routed_scaling_factor`, beside a shared expert of `shared_intermediate_size`; dense layers
    (`dense_intermediate_size`) where `mlp_layer_types` leads with them; clamped GLUs (gpt-oss's, its gate and up
    not interleaved: they change no count the plan makes). Planned, not trained."""
    head = fields["head_dim"]
    rotary = opt("rotary_dim", 64)
    if not 0 < rotary <= head:
        raise bad("rotary_dim", f"a whole number from 1 to head_dim {head}", cfg.get("rotary_dim"))
    types = _mlp_layer_types(cfg, bad, n_layers) or ["sparse"] * n_layers
    dense = types.index("sparse") if "sparse" in types[:n_layers] else n_layers
    if "dense" in types[dense:n_layers]:
        raise bad("mlp_layer_types", "the dense layers first, then the sparse ones", types)
    fields.update(hf_model_type="minimax_m3", qk_norm=True, offset_norms=True, partial_rotary_factor=rotary / head,
                  expert_ffn=opt("intermediate_size", 3072), shared_expert_ffn=opt("shared_intermediate_size", 3072),
                  norm_topk_prob=True, router_bias=True, first_dense_layers=dense,
                  dense_ffn=opt("dense_intermediate_size", 12288) if dense else 0,
                  sigmoid_router={"groups": 1, "topk_groups": 1,
                                  "scaling": number(cfg.get("routed_scaling_factor", 2.0), "routed_scaling_factor")})
    layers = cfg.get("_sparse_layers", ())
    if layers:
        fields["block_sparse"] = {"block": opt("index_block_size", 128), "topk_blocks": opt("index_topk_blocks", 16),
                                  "local_blocks": opt("index_local_blocks", 1), "index_heads": opt("index_n_heads", 4),
                                  "index_head_dim": opt("index_head_dim", 128), "layers": layers}


def _olmo_config(cfg: dict, model_type: str, bad) -> dict:
    """OLMo 2's and OLMo 3's configs in the reader's terms, as transformers' Olmo2Config / Olmo3Config read them:
    their defaults where a field is absent (RoPE base 1e4 for OLMo 2 and 5e5 for OLMo 3, eps 1e-5, 2,048 positions,
    pad id 1, KV heads as many as the query heads); OLMo 3's layer types three sliding (`sliding_window`, 4,096
    where absent) to one full where absent, its RoPE by layer type with the legacy `rope_scaling` on the full layers
    only."""
    out = {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "pad_token_id": 1, "tie_word_embeddings": False,
           **{k: v for k, v in cfg.items() if v is not None or k == "pad_token_id"}}
    theta = 10_000.0 if model_type == "olmo2" else 500_000.0
    if model_type == "olmo2":
        if out.get("rope_parameters") is None and out.get("rope_theta") is None:
            out["rope_theta"] = theta
        return out
    out.setdefault("sliding_window", 4096)
    n = out.get("num_hidden_layers")
    if not out.get("layer_types") and isinstance(n, int) and 0 < n <= 100_000:
        out["layer_types"] = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]
    return _rope_by_type_from_legacy(out, theta, out.get("rope_theta", theta))


def _rope_by_type_from_legacy(out: dict, full_theta: float, sliding_theta: float) -> dict:
    """`out` with RoPE by layer type where its config gives the legacy fields instead (transformers' Gemma 3 and
    OLMo 3 configs' conversion): the full layers at `rope_theta` (else `full_theta`) with the `rope_scaling`, the
    sliding layers at `sliding_theta`, unscaled."""
    rope = out.get("rope_parameters")
    if not isinstance(rope, dict) or "full_attention" not in rope:
        rope = {"full_attention": {"rope_type": "default", **(out.get("rope_scaling") or {}),
                                   "rope_theta": out.get("rope_theta", full_theta)},
                "sliding_attention": {"rope_type": "default", "rope_theta": sliding_theta}}
    return {k: v for k, v in out.items() if k not in ("rope_scaling", "rope_theta")} | {"rope_parameters": rope}


def _gemma3_config(cfg: dict, bad) -> dict:
    """Gemma 3's text config in the reader's terms, as transformers' Gemma3TextConfig reads it: its defaults where a
    field is absent (head_dim 256, query_pre_attn_scalar 256, a window of 4,096, tied embeddings, pad id 0), layer
    types five sliding to one full (`sliding_window_pattern`) where absent, and RoPE by layer type: the full layers'
    base `rope_theta` (1e6) with the legacy `rope_scaling` (linear ×8 in the 4B–27B releases), the sliding layers'
    `rope_local_base_freq` (1e4), unscaled. Bidirectional attention and attention-logit soft-capping are refused."""
    if cfg.get("use_bidirectional_attention"):
        raise bad("use_bidirectional_attention", "false or null (a causal text model)", cfg["use_bidirectional_attention"])
    if cfg.get("attn_logit_softcapping") is not None:
        raise bad("attn_logit_softcapping", "null (soft-capped attention scores are not planned)",
                  cfg["attn_logit_softcapping"])
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise bad("hidden_activation", '"gelu_pytorch_tanh" (the GeGLU Gemma 3 is trained with)',
                  cfg["hidden_activation"])
    out = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "tie_word_embeddings": True,
           "pad_token_id": 0, "max_position_embeddings": 131_072, **{k: v for k, v in cfg.items() if v is not None or k in ("final_logit_softcapping",)}}
    n = out.get("num_hidden_layers")
    if not out.get("layer_types") and isinstance(n, int) and 0 < n <= 100_000:
        pattern = out.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise bad("sliding_window_pattern", "a positive whole number", pattern)
        out["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    return _rope_by_type_from_legacy(out, 1_000_000.0, out.get("rope_local_base_freq", 10_000.0))


def _gemma3(cfg: dict, fields: dict, rope_by_type: dict | None, opt_flag, number) -> None:
    """Google's Gemma 3 text model (transformers' Gemma3TextConfig; `_gemma3_config` gives its defaults): Llama's
    dense blocks with norms before and after each sublayer, (1 + w) RMSNorms (q/k per head too), GeGLU, the softmax
    scale 1/√query_pre_attn_scalar, sliding layers (RoPE at their own base, unscaled) five to one full, the embedding
    times √hidden_size, tied to the head; the logits soft-capped where `final_logit_softcapping` is set."""
    fields.update(qk_norm=True, offset_norms=True, norm_placement="sandwich", hf_model_type="gemma3_text",
                  embedding_scale=math.sqrt(fields["hidden_size"]),
                  query_pre_attn_scalar=number(cfg["query_pre_attn_scalar"], "query_pre_attn_scalar"),
                  attn_bias=opt_flag("attention_bias", False))
    cap = cfg.get("final_logit_softcapping")
    if cap is not None:
        fields["final_logit_softcap"] = number(cap, "final_logit_softcapping")
    sliding = (rope_by_type or {}).get("sliding_attention") or {}
    if sliding:
        _sliding_rope(fields, sliding, number, share_default=1.0)


def _gemma4(cfg: dict, fields: dict, rope_by_type: dict | None, opt_flag, number, count) -> None:
    """Google's Gemma 4 text model (transformers' Gemma4TextConfig; `_gemma4_config` gives its defaults), MoE
    (`enable_moe_block`) or dense: the full layers at `global_head_dim` (512) with their own KV heads
    (`num_global_key_value_heads` where `attention_k_eq_v`) whose values are their keys' projection; the sliding
    layers at `head_dim` with `num_key_value_heads`; each layer's dense MLP (`intermediate_size`) beside its experts
    (planned as a shared expert of that width), or alone in a dense model; norms before and after each sublayer, q
    and k normed, an unscaled
    softmax (scale 1), the embedding scaled by √hidden_size, tied to the head, the logits soft-capped
    (`final_logit_softcapping`, none where absent: transformers' default); the full layers' proportional RoPE.
    Its GeGLU activations and per-layer scalars change no count the plan makes."""
    sliding_dim = fields["head_dim"]
    full_dim = count(cfg["_full_head_dim"], "global_head_dim")
    k_eq_v = opt_flag("attention_k_eq_v", False)
    kv = fields["num_kv_heads"]
    full_kv = kv if cfg["_full_kv_heads"] is None else count(cfg["_full_kv_heads"], "num_global_key_value_heads")
    moe = not cfg["_dense"]  # (a dense one's MLP is the dense layers' `dense_ffn`, read as every dense model's)
    fields.update(head_dim=full_dim, num_kv_heads=full_kv, keys_as_values=k_eq_v,
                  shared_expert_ffn=count(cfg["intermediate_size"], "intermediate_size") if moe else 0,
                  dense_beside_experts=moe, norm_placement="sandwich", qk_norm=True,
                  attn_bias=opt_flag("attention_bias", False), norm_topk_prob=True,
                  embedding_scale=math.sqrt(fields["hidden_size"]), query_pre_attn_scalar=1.0,
                  rope_proportional=bool(cfg.get("_proportional")), hf_model_type="gemma4_text")
    cap = cfg.get("final_logit_softcapping")
    if cap is not None:
        fields["final_logit_softcap"] = number(cap, "final_logit_softcapping")
    if sliding_dim != full_dim:
        fields["sliding_head_dim"] = sliding_dim
    if full_kv != kv:
        fields["sliding_kv_heads"] = kv
    sliding = (rope_by_type or {}).get("sliding_attention") or {}
    if sliding:  # transformers rotates a kind's whole heads where its entry gives no share
        _sliding_rope(fields, sliding, number, share_default=1.0)


def _sliding_rope(fields: dict, sliding: dict, number, share_default: float | None = None) -> None:
    """The sliding layers' RoPE from their `rope_parameters` entry (Step-3.7's, Laguna's, Mellum's): a base of their
    own where it differs from the full layers' (`sliding_rope_theta`), a rotated share of their own
    (`sliding_rotary_factor`; where the entry gives none, `share_default`, None: the full layers'), and plain RoPE
    where the full layers' is scaled and theirs is "default" (`sliding_rope_plain`)."""
    key = "rope_parameters.sliding_attention"
    if sliding.get("rope_theta") is not None and number(sliding["rope_theta"], f"{key}.rope_theta") != \
            fields["rope_theta"]:
        fields["sliding_rope_theta"] = float(sliding["rope_theta"])
    share = sliding.get("partial_rotary_factor", share_default)
    if share is not None and number(share, f"{key}.partial_rotary_factor") != fields.get("partial_rotary_factor",
                                                                                         1.0):
        fields["sliding_rotary_factor"] = float(share)
    if fields.get("rope_scaling") is not None and sliding and sliding.get("rope_type", "default") == "default":
        fields["sliding_rope_plain"] = True  # the full layers' scaling alone


def _mellum(cfg: dict, fields: dict, rope_by_type: dict | None, opt, number, bad) -> None:
    """JetBrains' Mellum 2 (transformers' MellumForCausalLM): Qwen3-MoE's blocks with sliding-window layers
    (`layer_types`, `sliding_window`), RoPE by layer type (`rope_parameters`: the full layers' the model's, with
    their scaling; the sliding layers' base of their own, and without the scaling where their type is "default"),
    dense layers by `mlp_layer_types` (leading; transformers' default: none). A sliding layers' rotated share of its
    own is planned only."""
    fields.update(hf_model_type="mellum", first_dense_layers=_leading_dense(cfg, "mellum", opt, bad))
    if fields["first_dense_layers"]:
        fields["dense_ffn"] = opt("intermediate_size", 0)
    # a sliding rotated share of its own (`sliding_rotary_factor`) is planned only (`trainable`)
    _sliding_rope(fields, (rope_by_type or {}).get("sliding_attention") or {}, number)


def _step3p5(cfg: dict, fields: dict, n_layers: int, rope_by_type: dict | None, opt, opt_flag, number, count,
             bad) -> None:
    """Step-3.5/3.7's attention and MLPs as transformers' Step3p7TextModel builds them: per-head q/k norms and
    (1 + w) norms throughout; the sliding layers' query heads (`num_sliding_attention_heads`), RoPE base and rotated
    share (`rope_parameters` by layer type); a sigmoid gate per query head from `g_proj` (`gating`: transformers'
    default, per head); the softmax scale `query_pre_attn_scalar`^-1/2; one shared expert of `share_expert_dim`
    on each MoE layer; SwiGLU clamped by layer (`swiglu_limits` on the routed experts, `swiglu_limits_shared` on the
    shared expert and the dense MLP; 0 or null: none). A sliding layer with key/value heads or a head size of its
    own (the hub's `attention_other_setting`, which transformers does not read), a per-channel gate or MLP biases are
    planned only."""
    other = cfg.get("attention_other_setting") or {}
    kv, head = fields["num_kv_heads"], fields["head_dim"]
    if other.get("head_dim") is not None and count(other["head_dim"], "attention_other_setting.head_dim") != head:
        raise bad("attention_other_setting.head_dim", f"the full layers' head_dim {head}", other["head_dim"])
    heads = opt("num_sliding_attention_heads", fields["num_heads"])
    sliding = (rope_by_type or {}).get("sliding_attention") or {}
    fields.update(qk_norm=True, offset_norms=True, shared_expert_ffn=opt("share_expert_dim", fields["expert_ffn"]),
                  sliding_window=opt("sliding_window", 0) or None)
    if heads != fields["num_heads"]:
        fields["sliding_heads"] = heads
    groups = other.get("num_attention_groups")
    if groups is not None and count(groups, "attention_other_setting.num_attention_groups") != kv:
        fields.update(sliding_kv_heads=groups, arch="moe")
    _sliding_rope(fields, sliding, number)  # the full layers' scaling: the releases' `rope_scaling`
    gating = cfg.get("gating", True)
    if gating is True or gating == "per-head":
        fields["head_gate"] = True
    else:  # a gate per channel from its own projection: Qwen3.5's count, not its layout
        fields.update(attn_output_gate=True, arch="moe")
    scalar = cfg.get("query_pre_attn_scalar")
    if scalar is not None and number(scalar, "query_pre_attn_scalar") != head:
        fields["query_pre_attn_scalar"] = float(scalar)
    for key in ("swiglu_limits", "swiglu_limits_shared"):
        limits = cfg.get(key)
        if limits is None:
            continue
        if not isinstance(limits, list) or len(limits) < n_layers:
            raise bad(key, f"a list of at least {n_layers} bounds (0 or null: none)", limits)
        bounds = tuple(0.0 if v is None else number(v, key) for v in limits[:n_layers])
        if any(b < 0 for b in bounds):
            raise bad(key, "bounds ≥ 0 (0 or null: none)", limits)
        if any(bounds):
            fields[key] = bounds
    if opt_flag("mlp_bias", False):
        fields["arch"] = "moe"


def _mimo_attention(cfg: dict, fields: dict, rope: dict, rope_by_type: dict | None, opt, number, bad) -> None:
    """MiMo-V2-Flash's attention (transformers' MiMoV2FlashAttention): twice the key/value heads on the sliding layers,
    a sink logit per head there only, values of `v_head_dim` channels (128 beside q·k's 192) scaled by
    `attention_value_scale` (null: 1), RoPE by layer type (the same rotated share; bases 5e6 and 1e4)."""
    kv = opt("num_key_value_heads", fields["num_heads"])
    scale = cfg.get("attention_value_scale", 0.707)
    fields.update(sliding_kv_heads=2 * kv, sinks="sliding", v_head_dim=opt("v_head_dim", 128),
                  value_scale=1.0 if scale is None else number(scale, "attention_value_scale"))
    sliding = (rope_by_type or {}).get("sliding_attention")
    if sliding is None:
        return
    for name in ("rope_type", "type"):
        if sliding.get(name, "default") != "default":
            raise bad(f"rope_parameters.sliding_attention.{name}", '"default" (plain RoPE)', sliding[name])
    prf = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if sliding.get("partial_rotary_factor", prf) != prf:
        raise bad("rope_parameters.sliding_attention.partial_rotary_factor", f"the full layers' {prf}",
                  sliding["partial_rotary_factor"])
    if sliding.get("rope_theta") is not None:
        fields["sliding_rope_theta"] = number(sliding["rope_theta"], "rope_parameters.sliding_attention.rope_theta")


def _ernie(cfg: dict, fields: dict, n_layers: int, req, opt, opt_flag) -> None:
    """ERNIE-4.5 MoE (ERNIE-4.5-21B-A3B, 300B-A47B): dense layers before `moe_layer_start_index`, MoE from there to
    `moe_layer_end_index` every `moe_layer_interval`-th layer; `moe_num_shared_experts` plain shared experts; the
    router's softmax scores steered by a correction bias (no groups, no scaling), the chosen weights renormalized.
    With biases (`use_bias`) or dense layers among or after the MoE ones it is planned only (arch `moe`, its dense
    layers counted as leading ones)."""
    moe_ffn = fields["expert_ffn"]
    first, interval = opt("moe_layer_start_index", 0), opt("moe_layer_interval", 1)
    last = opt("moe_layer_end_index", n_layers - 1)
    if last < 0:  # transformers reads -1 as the last layer
        last = n_layers - 1
    if interval <= 0:
        raise ValueError(f"field 'moe_layer_interval': expected a positive whole number, got {interval}")
    moe = [i for i in range(n_layers) if first <= i <= last and (i + 1) % interval == 0]
    n_dense = n_layers - len(moe)
    fields.update(qk_norm=False, attn_bias=opt_flag("use_bias", False), norm_topk_prob=True, router_bias=True,
                  shared_expert_ffn=opt("moe_num_shared_experts", 0) * moe_ffn, sigmoid_router={},
                  first_dense_layers=n_dense, dense_ffn=req("intermediate_size") if n_dense else 0)
    if fields["attn_bias"] or moe != list(range(n_dense, n_layers)):  # the correction bias still counts: E a layer
        fields.update(arch="moe", sigmoid_router=None)


def _minimax_m2(cfg: dict, fields: dict, opt, opt_flag, number, count) -> None:
    """MiniMax-M2 (M2, M2.1, M2.5): q/k RMSNorms over the whole projection (`qk_norm_type` "per_layer"), RoPE on the
    first `rotary_dim` channels of each head (transformers' port reads `partial_rotary_factor`; both are accepted and
    must agree), experts scored by a sigmoid and chosen on score + a correction bias (`use_routing_bias`), the chosen
    weights renormalized: DeepSeek-V3's router with one group and no scaling; no shared expert. Its multi-token-
    prediction modules (`num_mtp_modules` of `mtp_transformer_layers` each) are counted apart. With per-head q/k
    norms, a shared expert or another scoring function it is planned only (arch `moe`)."""
    head = fields["head_dim"]
    if cfg.get("rotary_dim") is not None:
        rotary = count(cfg["rotary_dim"], "rotary_dim")
        if not 0 < rotary <= head:
            raise ValueError(f"field 'rotary_dim': expected a whole number from 1 to head_dim {head}, got {rotary}")
        given = fields.get("partial_rotary_factor")
        if given is not None and abs(given * head - rotary) > 1e-6:
            raise ValueError(f"field 'rotary_dim': {rotary} channels of {head} disagree with partial_rotary_factor "
                             f"{given:g}")
        fields["partial_rotary_factor"] = rotary / head
    scaling = cfg.get("routed_scaling_factor")
    shared = opt("shared_intermediate_size", 0)
    fields.update(qk_norm=opt_flag("use_qk_norm", True), attn_bias=False, router_bias=True, norm_topk_prob=True,
                  shared_expert_ffn=shared,
                  sigmoid_router={} if scaling is None else {"scaling": number(scaling, "routed_scaling_factor")})
    if opt_flag("use_mtp", True):
        fields["mtp_layers"] = opt("num_mtp_modules", 0) * opt("mtp_transformer_layers", 1)
    if cfg.get("qk_norm_type", "per_layer") != "per_layer" or shared or cfg.get("scoring_func", "sigmoid") != "sigmoid":
        fields.update(arch="moe", sigmoid_router=None)


def _qwen2_moe(cfg: dict, fields: dict, n_layers: int, req, opt, opt_flag, count) -> None:
    """Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v biases (`qkv_bias`, on in every release), a shared expert
    behind a sigmoid gate, softmax routing without renormalization (transformers' default). A layer is MoE where
    (i + 1) is a multiple of `decoder_sparse_step` and i is not in `mlp_only_layers`, dense (`intermediate_size`)
    elsewhere: the step is the shape's `moe_layer_step`; with `mlp_only_layers` the shape counts the dense layers as
    leading ones (the cost does not depend on where they sit) and is planned only (arch `moe`).
    `use_sliding_window` slides the layers from `max_window_layers` on (transformers' rule)."""
    shared = opt("shared_expert_intermediate_size", 0)
    fields.update(qk_norm=False, attn_bias=opt_flag("qkv_bias", opt_flag("attention_bias", True)),
                  shared_expert_ffn=shared, shared_expert_gate=bool(shared))
    step = opt("decoder_sparse_step", 1)
    if step <= 0:
        raise ValueError(f"field 'decoder_sparse_step': expected a positive whole number, got {step}")
    dense_only = cfg.get("mlp_only_layers") or []
    if not isinstance(dense_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense_only):
        raise ValueError(f"field 'mlp_only_layers': expected a list of layer indices, got {_shown(dense_only)}")
    n_dense = sum(1 for i in range(n_layers) if i in dense_only or (i + 1) % step)
    if dense_only and n_dense:
        fields.update(arch="moe", first_dense_layers=n_dense, dense_ffn=req("intermediate_size"))
    elif n_dense:
        fields.update(moe_layer_step=step, dense_ffn=req("intermediate_size"))
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        fields["sliding_window"] = count(cfg["sliding_window"], "sliding_window")
        if not cfg.get("layer_types"):
            first = opt("max_window_layers", n_layers)
            fields["layer_types"] = tuple("sliding_attention" if i >= first else "full_attention"
                                          for i in range(n_layers))


def _index_list(cfg: dict, key: str, bad) -> list[int] | None:
    """An optional list of whole numbers (layer indices or 0/1 flags); None where absent or null."""
    v = cfg.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise bad(key, "a list of whole numbers", v)
    return v


def _uniform(cfg: dict, key: str, count, bad) -> int:
    """A count given once or once a layer (Hunyuan's lists), the same for every layer."""
    v = cfg.get(key)
    if v is None:
        raise ValueError(f"missing field {key!r}")
    if isinstance(v, list):
        if not v or any(x != v[0] for x in v):
            raise bad(key, "one value, or the same value for every layer", v)
        v = v[0]
    return count(v, key)


def _truthy(cfg: dict, key: str, default: bool, bad) -> bool:
    """A switch given as true/false or, as some releases write it, a number (on where not zero)."""
    v = cfg.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or (isinstance(v, (int, float)) and math.isfinite(v)):
        return bool(v)
    raise bad(key, "true, false or a number", v)


def _llama4(cfg: dict, fields: dict, n_layers: int, req, opt, opt_flag, number, count, bad) -> None:
    """Llama 4 (Scout, Maverick; transformers' `llama4_text`, or the `text_config` of `llama4`). The layers flagged 1
    in `no_rope_layers` (by default all but every `no_rope_layer_interval`-th) rotate q and k and attend within
    chunks of `attention_chunk_size` positions; the others attend globally without RoPE (with query temperature
    tuning: `attn_temperature_tuning`, `floor_scale`, `attn_scale`). `use_qk_norm` scales the RoPE layers' q and k
    heads to unit RMS. Every `interleave_moe_layer_step`-th layer is MoE (top-k of `num_local_experts` experts of
    `intermediate_size`, plus a shared expert of the same width), the others dense of `intermediate_size_mlp`;
    a `moe_layers` list must be that pattern (another is refused by name)."""
    step = opt("interleave_moe_layer_step", 1)
    if step <= 0:
        raise ValueError(f"field 'interleave_moe_layer_step': expected a positive whole number, got {step}")
    moe_layers = _index_list(cfg, "moe_layers", bad)
    want = list(range(step - 1, n_layers, step))
    if moe_layers is not None and sorted(moe_layers) != want:
        raise bad("moe_layers", f"every interleave_moe_layer_step-th layer ({want[:4]}…)", moe_layers)
    interval = opt("no_rope_layer_interval", 4)
    if interval <= 0:
        raise ValueError(f"field 'no_rope_layer_interval': expected a positive whole number, got {interval}")
    flags = _index_list(cfg, "no_rope_layers", bad)
    if not flags:  # absent, null or empty: transformers' default pattern
        flags = [int((i + 1) % interval != 0) for i in range(n_layers)]
    elif len(flags) < n_layers or any(f not in (0, 1) for f in flags):
        raise bad("no_rope_layers", f"{n_layers} flags of 0 or 1", flags)
    rope_layers = [bool(f) for f in flags[:n_layers]]
    types = tuple("chunked_attention" if r else "full_attention" for r in rope_layers)
    given = cfg.get("layer_types")
    if given and tuple(given)[:n_layers] != types:
        raise bad("layer_types", "chunked_attention on the RoPE layers of no_rope_layers, full_attention elsewhere",
                  given)
    chunk = cfg.get("attention_chunk_size", 8192)
    if chunk is None and any(rope_layers):
        raise ValueError("field 'attention_chunk_size': null, but RoPE layers attend in chunks (no_rope_layers)")
    ffn = req("intermediate_size")
    n_dense = n_layers - len(want)
    fields.update(expert_ffn=ffn, shared_expert_ffn=ffn, moe_layer_step=step, layer_types=types, norm_topk_prob=False,
                  dense_ffn=req("intermediate_size_mlp") if n_dense else 0, qk_norm=False,
                  attn_bias=opt_flag("attention_bias", False),
                  rms_norm_eps=1e-5 if cfg.get("rms_norm_eps") is None else number(cfg["rms_norm_eps"], "rms_norm_eps"),
                  attention_chunk=None if chunk is None else count(chunk, "attention_chunk_size"),
                  llama4=dict(qk_norm=opt_flag("use_qk_norm", True),
                              temperature_tuning=_truthy(cfg, "attn_temperature_tuning", True, bad),
                              floor_scale=count(cfg.get("floor_scale", 8192), "floor_scale"),
                              attn_scale=number(cfg.get("attn_scale", 0.1), "attn_scale")))


# the names configs give a shared expert's width, and (times the routed experts' width) the number of shared experts
_SHARED_WIDTH_KEYS = ("shared_expert_intermediate_size", "shared_intermediate_size", "share_expert_dim")
_SHARED_COUNT_KEYS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")


def _generic_moe(cfg: dict, fields: dict, n_layers: int, req, opt, opt_flag, bad) -> None:
    """The standard MoE families the core does not train, and unknown types, by the field names most configs share:
    q/k norms (`use_qk_norm`), attention biases; shared experts by width (`shared_expert_intermediate_size`,
    `shared_intermediate_size`, `share_expert_dim`) or by count of the routed experts' width (`n_shared_experts`,
    `num_shared_experts`, `moe_num_shared_experts`); dense layers (`intermediate_size` wide) from
    `first_k_dense_replace` or `mlp_layer_types` ("dense"/"sparse" a layer; counted as leading ones wherever they
    sit: the cost does not depend on where); routing is costed the same whatever its scoring."""
    fields.update(qk_norm=opt_flag("use_qk_norm", False), attn_bias=opt_flag("attention_bias", False))
    width_key = next((k for k in _SHARED_WIDTH_KEYS if cfg.get(k) is not None), None)
    count_key = next((k for k in _SHARED_COUNT_KEYS if cfg.get(k) is not None), None)
    fields["shared_expert_ffn"] = (opt(width_key, 0) if width_key is not None
                                   else opt(count_key, 0) * fields["expert_ffn"] if count_key is not None else 0)
    types = _mlp_layer_types(cfg, bad, n_layers)
    if types is not None:
        n_dense = types[:n_layers].count("dense")
    else:
        n_dense = min(opt("first_k_dense_replace", 0), n_layers)
    if n_dense:
        fields.update(first_dense_layers=n_dense, dense_ffn=req("intermediate_size"))


def _shown(v) -> str:
    s = json.dumps(v) if v is None or isinstance(v, bool) else repr(v)
    return s if len(s) <= 40 else s[:39] + "…"


def resolve_model(spec: str) -> ModelShape:
    """A preset name or a path to a config.json / model-shape YAML."""
    if spec in PRESETS:
        return PRESETS[spec]
    p = Path(spec)
    if p.suffix == ".json" or p.is_dir() or p.exists():
        if p.is_dir():
            p = p / "config.json"
        if p.suffix in (".yaml", ".yml"):
            return _from_shape_yaml(p)
        return from_hf_config(p)
    from difflib import get_close_matches

    close = get_close_matches(spec, list(PRESETS), n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ValueError(f"unknown model {spec!r}{hint} (presets: {', '.join(PRESETS)}; or a path to config.json)")


def _from_shape_yaml(p: Path) -> ModelShape:
    import yaml

    from .safeio import FileRefused, read_text_limited

    try:
        data = yaml.safe_load(read_text_limited(p, "model shape", MAX_SHAPE_BYTES))
    except FileRefused as e:
        raise ValueError(str(e)) from None
    except (yaml.YAMLError, RecursionError, ValueError, TypeError, OverflowError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"cannot read model shape {p}: {first}") from None
    return validate(ModelShape, data, f"{p}: invalid model shape")
