"""The cost model: memory per GPU by component, FLOPs per token, communication per step, step time.

Every formula is derived in docs/cost_model.md; the names here match the names there. Units: bytes and seconds
inside, decimal GB (1e9 bytes) in what is reported. Symbols: s = tokens of one micro-batch on one rank after CP
(s_local), h = hidden size, L = layers of one pipeline stage, k = top-k, E = experts, V = vocab.

Pure Python: never imports torch.
"""

from __future__ import annotations

import functools
import math

from dataclasses import dataclass, field
from typing import Literal

from ._data import Record
from .hw import HwProfile
from .models import ModelShape, compressed_projections, kda_projections, param_counts

GB = 1e9
BF16, FP32 = 2, 4

# Persistent bytes per parameter (FSDP2 + AdamW with fp32 master weights, bf16 compute):
BYTES_WEIGHTS = BF16  # bf16 compute copy
BYTES_GRADS = BF16  # bf16 gradient (reduce-scattered in fp32, accumulated into the fp32 shard)
BYTES_MASTER = FP32  # fp32 master weights
BYTES_OPTIMIZER = 2 * FP32  # Adam exp_avg and exp_avg_sq
# FSDP2's unsharded working set per parameter of the layer in use: the gathered bf16 layer, the next layer
# prefetched, and the unsharded fp32 gradient before its reduce-scatter.
BYTES_UNSHARDED = 2 * BF16 + FP32
# The fused head (kernels/lm_head/fused.py, what the trainer runs) holds one group's fp16 tile weights [Tg, V] (its
# dlogits are written over them): Tg = 4096 tokens (its GROUP_TOKENS), fewer where that would pass this budget (its
# SCRATCH_BYTES), in multiples of 256 (tests/test_kernels_lm_head.py holds the two sides equal).
FUSED_HEAD_BUDGET_B = 2.0 * 2**30
FUSED_HEAD_GROUP_TOKENS = 4096
# The lean head (kernels/lm_head/lean.py, `lm_head: lean`, the loss handed to it: four GEMMs) holds its two bf16
# gradients and ~2 MiB beside them (its scratch is carved out of dW's storage).
LEAN_EXTRA_BYTES = 4 * 2**20
# Its time as head passes (one pass = one logits-sized GEMM): four GEMMs, measured 2.0x to 2.3x the fused head's
# three at T = 65,536 on an H200 (703 / 485 ms against 331 / 204 at V = 248,320 / 151,936; docs/BENCHMARKS.md).
LEAN_HEAD_PASSES = 6.6
# The naive head's time in the same passes: its three GEMMs and its fp32 elementwise passes over [s, V] (the cast,
# the temperature, the log-softmax and their backward, ~60 bytes a logit moved), measured 2x the fused head on the
# H200 grid (Qwen3-30B-A3B, 2 layers, 8K tokens: the step 21 ms above the fused head's).
NAIVE_HEAD_PASSES = 6.0
HEAD_MODES = ("fused", "lean", "naive")
# Chunked EP overlap: the counts default_ep_chunks chooses from, each chunk at least EP_CHUNK_TOKENS tokens.
EP_CHUNK_COUNTS = (1, 2, 4, 8, 16, 32)
EP_CHUNK_TOKENS = 2048
# The EP path's fixed time per MoE layer, pass and chunk beyond the first where a profile has no measured
# efficiency.ep_chunk_ms: the H200's figure (the chunk loop's launches and index work, which the host's launch rate
# sets more than the GPU).
EP_CHUNK_MS_ASSUMED = 0.63
# The optimizer step per local parameter: cast the bf16 gradient to fp32 (2 + 4 bytes), fused AdamW (read master,
# grad, both moments, write master and moments: 28), write the bf16 compute copy back (4 + 2): 40 bytes.
ADAM_BYTES_MOVED = 40
# The expert-parallel path's rows held beyond the local dispatch's in a MoE layer's backward (ep_dispatch_bytes), in
# rows of h + 8 bf16 values a received copy. At one chunk, measured on the H200 grid's EP points
# (hw_profiles/calibration/h200.json, EP peak less the local peak of the same point): 1.00, 1.38 and 1.00 rows for
# Qwen3.5-35B-A3B (f = 512; 4 layers at 32K and 64K, 2 layers at 32K) and 1.01 for Qwen3-30B-A3B (f = 768, 32K), whose
# agreement at 32K says the term has no expert-width part; the mean of the models' means (bench/calibrate.py --fit
# prints it). With more than one chunk the weight gradients take every chunk's rows in one copy, made while the
# chunks' own rows are freed one by one: EP_CHUNK_ROWS more, the mean over the counts above one of the peak above the
# one-chunk peak in hw_profiles/calibration/h200_ep_memory.json (0.24 and 0.12 rows at 2 and 4 chunks at 32K, 0.12 at
# 4 chunks at 64K).
EP_HELD_ROWS = 1.07
EP_CHUNK_ROWS = 0.16
# MasterAdamW (launch/optim.py) steps its parameters in groups of at most this many elements (a larger tensor is a
# group of its own), casting each group's bf16 gradients to fp32 first.
OPT_GROUP_NUMEL = 2**28
# The naive head (launch/rl.py: token_logprobs, mode "naive"), bytes per logit at its peak, in its backward: the
# log-softmax output (saved, fp32), the gradient coming back to it (the gather's, fp32) and the one it passes on to
# the logits (fp32): 4 + 4 + 4. The bf16 logits and the fp32 copies before the log-softmax are not saved by anything
# and are gone by then. Measured on the H200 grid of commit d0e963f: 11.7 bytes a logit above the fused head's point
# (Qwen3-30B-A3B, 2 layers, 8K tokens).
NAIVE_BYTES_PER_LOGIT = 12
# Fixed cost of one small collective (a CP all-gather of Gated DeltaNet's maps or conv halos): launch and one
# round of latency on NVLink/xGMI, an order-of-magnitude figure, not measured.
COLLECTIVE_LATENCY_S = 10e-6
# Gated DeltaNet's CP combine against its FLOP count (cp_delta_rule_flops), measured on one H200 with fla
# (bench/bench_cp_gdn.py: 32 value heads, d_k = d_v = 128, C = 64, 32,768 tokens a rank, forward + backward, 30
# reps): it costs 0.73 / 0.84 / 0.93 plain delta-rule passes at cp = 2 / 4 / 8 where its FLOPs are 1.00 / 1.01 /
# 1.01 of one (the augmented pass's extra value columns ride on the plain pass's chunk loop). Fitted by least
# squares, within 0.7% of the three: the FLOPs take 0.642 of the plain pass's time per FLOP, and every doubling of
# cp adds 0.094 of a plain pass (the fold's 2·cp − 1 sequential steps are latency, not FLOPs). Separate runs of
# the same bench move a row by up to 0.15 of a pass.
CP_COMBINE_EFFICIENCY = 1 / 0.642
CP_COMBINE_PASSES_PER_DOUBLING = 0.094
# Kimi Delta Attention's chunked rule (fla's chunk_kda) against Gated DeltaNet's (chunk_gated_delta_rule) per FLOP
# of delta_rule_flops_per_token_head, each timed alone inside a training step's layers (bench/bench_train_step.py's
# "delta rule (kernel only)", forward + recomputed forward + backward, 32,768 tokens, d_k = d_v = 128, C = 64, one
# H200, fla-core 0.6.0): KDA's 3 layers of 32 heads take 88.5 ms where Gated DeltaNet's 3 layers of 32 value heads
# take 45.2 ms for 1/1.21 of the FLOPs: 0.62 of the rate. Its added work is mostly elementwise over K-wide decays,
# and its backward passes K-wide fp32 gradients (dq, dk, dg) twice (docs/cost_model.md, section 5).
KDA_RULE_RATE = 0.62
# a windowed attention kernel's key tile: a block of queries scores every key tile its windows touch, so a query
# costs its window rounded up past one more tile (window_keys), not the window alone
WINDOW_KEY_TILE = 128
# a windowed kernel's query row in keys of the full-attention kernel at the same head width (window_kernel_keys):
# each key it scores costs WINDOW_KEY_COST of one (the windowed kernel is the flash kernel, slower per FLOP than the
# cuDNN kernel full layers run on), and every row WINDOW_ROW_KEYS more whatever its window (loading and writing the
# row, its softmax bookkeeping, the sink's merge). Fitted by `bench/calibrate.py --fit` to gpt-oss-120b's sliding
# layers timed alone at windows of 128 to 4096 (hw_profiles/calibration/h200_window.json): within 12.2% of each
WINDOW_KEY_COST = 1.73
WINDOW_ROW_KEYS = 670
# a full-attention layer with sinks (gpt-oss) merges them in by log-sum-exp around its kernel (launch/
# attention_parts.py): elementwise work over the output, SINK_MERGE_BYTES a value (query head × head width) and pass,
# charged with the dense rows' bytes. Fitted by `bench/calibrate.py --fit` to gpt-oss-120b's full layers timed
# alone with and without sinks at 8K to 128K tokens (hw_profiles/calibration/h200_attention.json): the median of the
# five, which span 4 to 15
SINK_MERGE_BYTES = 11
# DeepSeek sparse attention (launch/sparse_attention.py, docs/sparse_attention.md "Cost"): its Triton kernels
# (absorbed MLA over each query's selected latents) at these shares of the bf16 peak in model FLOPs, the forward's
# 2·H·(2C + R) a selected key and the backward's twice that (bench/bench_sparse_attention.py on an H200 at 64 heads:
# forward 0.226 / 0.248 / 0.246 at 8K / 32K / 64K tokens, backward 0.078 / 0.079 / 0.076; the forward in 16-head
# programs, where a rank's heads are not a multiple of 64, 0.138 / 0.145 / 0.144); the indexer's scores at
# INDEX_GEMM_EFFICIENCY (its kernel's 449 TF/s), its top-k selection (the selection kernels,
# kernels/dsa_index_triton.py) INDEX_SELECT_S a score on an H200, scaled by HBM bandwidth elsewhere, and INDEX_ROW_S a
# query a pass (the selection's per-row bracket and search): the fit a·T + b·T²/2 through the indexer's 21.0 ms at 32K
# tokens and 272.4 ms at 128K (8K: 2.3 on it, 1.8 measured; 64K: 73.2 on it, 73.7)
SPARSE_FORWARD_EFFICIENCY = 0.245
SPARSE_NARROW_FORWARD_EFFICIENCY = 0.144
SPARSE_BACKWARD_EFFICIENCY = 0.078
# the fewest heads a program of those kernels holds (kernels/sparse_mla_triton.py): a rank with fewer runs it
# part-empty
SPARSE_HEAD_BLOCK = 16
INDEX_GEMM_EFFICIENCY = 0.45
INDEX_SELECT_S = 1.08e-11
INDEX_SELECT_HBM = 4.8e12
INDEX_ROW_S = 1.6e-7
HBM_EFFICIENCY = 0.9  # of the datasheet bandwidth, for streaming kernels (measured ~4.3 of 4.8 TB/s on an H200)


@dataclass(frozen=True, kw_only=True)
class TrainOptions(Record):
    micro_batch_tokens: int  # tokens of one packed micro-batch (before CP)
    recompute: Literal["full", "none"] = "full"
    lm_head: Literal["fused", "lean", "naive"] = "fused"
    ep_overlap_chunks: int = 1  # 1 = off
    micro_batches: int = 1  # micro-batches per DP rank per optimizer step
    # under full recompute, the decoder layers at the end of each pipeline stage that keep their activations and run
    # no recomputed forward (0: every layer is recomputed); docs/cost_model.md, "Partial recompute"
    keep_layers: int = 0
    # DeepSeek sparse attention under full recompute: each recomputed layer keeps its indexer's selection from the
    # forward (int32, topk a token) for its recomputed forward instead of running the indexer again (false whenever
    # recompute is not "full": nothing is recomputed)
    keep_selections: bool = False

    def __post_init__(self) -> None:
        for n in ("micro_batch_tokens", "ep_overlap_chunks", "micro_batches"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{n} must be a positive integer, got {v!r}")
        if self.recompute not in ("full", "none"):
            raise ValueError(f"recompute must be 'full' or 'none', got {self.recompute!r}")
        k = self.keep_layers
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"keep_layers must be a non-negative integer, got {k!r}")
        if k and self.recompute != "full":
            raise ValueError(f"keep_layers = {k} needs recompute 'full' (it names the layers exempt from it)")
        if not isinstance(self.keep_selections, bool):
            raise ValueError(f"keep_selections must be true or false, got {self.keep_selections!r}")
        if self.recompute != "full":  # nothing recomputed, nothing to keep: one way to say so
            object.__setattr__(self, "keep_selections", False)
        if self.lm_head not in HEAD_MODES:
            raise ValueError(f"lm_head must be one of {', '.join(HEAD_MODES)}, got {self.lm_head!r}")


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1

    def degrees(self, world: int) -> dict[str, int]:
        return {"pp": self.pp, "tp": self.tp, "cp": self.cp, "ep": self.ep, "dp": self.dp(world),
                "etp": self.etp, "edp": self.edp(world)}

    def dp(self, world: int) -> int:
        return world // (self.pp * self.tp * self.cp)

    def edp(self, world: int) -> int:
        return world // (self.pp * self.ep * self.etp)


@dataclass
class Estimate:
    memory_gb: dict[str, float]
    lm_head_unfused_gb: float
    fits: bool
    step_time_s: float
    time_s: dict[str, float]  # seconds per step by part (compute, exposed comm, bubble, optimizer)
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float  # hardware FLOPs (recompute included)
    mfu_hardware: float
    mfu_model: float
    flops_per_token: dict[str, float] = field(default_factory=dict)
    comm_bytes: dict[str, float] = field(default_factory=dict)  # per GPU per step
    lm_head_own_gb: float = 0.0  # what the head holds while it runs (memory_gb["lm_head"]: what it adds to the peak)
    compute_s: dict[str, float] = field(default_factory=dict)  # time_s["compute"] by operation (compute_work)

    @property
    def total_gb(self) -> float:
        return self.memory_gb["total"]

    @property
    def headroom_gb(self) -> float:
        return self.memory_gb["usable"] - self.memory_gb["total"]


# ---- parameters by sharding group ----------------------------------------------------------------------------
def stage_params(m: ModelShape, pp: int, layers: float | None = None) -> tuple[float, float, float]:
    """(dense, routed-expert, head+embedding) parameters held by the largest pipeline stage.

    The first stage also holds the embedding, the last the head: the largest stage is taken as `layers` layers
    (default L/pp; the plan's cost-balanced split gives its largest stage, stage_layers) plus the larger of the two
    (with pp=1 both)."""
    c = param_counts(m)
    layer_dense = (c["attention"] + c["linear_attention"] + c["router"] + c["shared_expert"] + c["dense_ffn"]
                   + c["norms"]) / m.num_layers
    layer_expert = c["routed_experts"] / m.num_layers
    ends = c["embedding"] + c["head"] if pp == 1 else max(c["embedding"], c["head"])
    per_stage = m.num_layers / pp if layers is None else layers
    return layer_dense * per_stage, layer_expert * per_stage, ends


def stage_layers(m: ModelShape, pp: int, opts: "TrainOptions", hw: HwProfile | None = None) -> int:
    """Layers of the largest pipeline stage under the plan's split (pipeline_split): the cost-balanced split can load
    one stage with most layers (a costly head on the last stage leaves it few), and that stage's parameters and
    checkpoints set the peak."""
    return m.num_layers if pp <= 1 else max(pipeline_split(m, pp, opts, hw))


def layer_params(m: ModelShape) -> tuple[float, float]:
    """(dense, routed-expert) parameters of the largest single layer (FSDP2's unit)."""
    c = param_counts(m)
    n_moe = max(m.num_moe_layers, 1)
    attn = max(c["attention"] / max(m.num_attention_layers, 1),
               c["linear_attention"] / max(m.num_linear_attn_layers, 1))
    ffn = max(c["router"] / n_moe + c["shared_expert"] / n_moe, c["dense_ffn"] / max(m.num_dense_layers, 1))
    return attn + ffn, c["routed_experts"] / n_moe


# ---- activations ---------------------------------------------------------------------------------------------
def norm_saved(width: float) -> float:
    """Bytes a token's RMSNorm keeps for its backward (kernels/rms_norm.py): its bf16 input and, on the torch path,
    the fp32 reciprocal RMS of the row (the fused kernels recompute it: an upper bound by 4 bytes)."""
    return width * BF16 + FP32


def attention_working_set(m: ModelShape, s: float, tp: int, cp: int, vendor: str = "nvidia") -> float:
    """Bytes saved by one full-attention layer's forward for its backward (launch/model.py: Attention).

    Per token: the normed input (kept by the q/k/v projections); q and k before their per-head norms (kept by the
    norms); q after RoPE, k after RoPE and v (kept by SDPA; with CP the K/V of the whole sequence is all-gathered,
    exact CP, so k and v count at s·cp); SDPA's output and log-sum-exp; the output as o_proj's contiguous input;
    with the output gate, its sigmoid and the gated output. GQA runs inside SDPA, so K/V stay at the KV heads'
    count. Values narrower than the q·k heads (MLA's, MiMo-V2-Flash's) are at the kernel's width for `vendor`
    (`attention_widths`). Where the layer kinds differ in heads or head width, the largest kind's set."""
    nh = m.max_heads / tp
    if m.compressed is not None:
        return compressed_attention_working_set(m, s, tp, cp)
    if m.mla is not None:  # launch/model.py MLAttention
        a = m.mla
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        # the q LoRA's projection (kept by its norm) and its normed copy (by q_b_proj); q as SDPA takes it (RoPE's
        # products keep only the constant cos and sin); the latent [c | k_rope] as projected and as kept (for the
        # expansion or the sparse kernels), all-gathered under CP; the normed input
        lat = a.kv_lora_rank + a.qk_rope_head_dim
        common = (s * (2 * a.q_lora_rank + nh * qk) + s * lat * (2 + (cp if cp > 1 else 0))
                  + s * m.hidden_size) * BF16
        if a.query_gate:  # A.X K2: q_gate_proj's input (both latents side by side), where the normed latent is kept
            # only by the indexer (the sparse layers); the gate's fp32 sigmoid and the gated output (o_proj's input)
            common += (s * a.q_lora_rank * (2 if m.dsa is not None else 1) * BF16
                       + s * nh * a.v_head_dim * (FP32 + BF16))
        if m.dsa is not None:  # MLAttention.sparse_attention: absorbed, nothing expanded
            # the absorbed query [H, C + R] the kernels keep; ô [H, C] and its log-sum-exp, the output through W_v
            # (o_proj's input), the selection (int32)
            q_hat = s * nh * lat * BF16
            out = s * nh * (a.kv_lora_rank * BF16 + FP32 + a.v_head_dim * BF16) + s * m.dsa.topk * 4
            return common + q_hat + out
        # every rank expands all of the micro-batch's keys and values, at the kernel's widths
        kw, vw = attention_widths(m, vendor)
        kv = s * cp * nh * (kw + vw) * BF16
        out = s * nh * (vw + a.v_head_dim) * BF16  # SDPA's output; its first v_head_dim channels as o_proj's input
        return common + kv + out + s * nh * FP32
    # MiniMax-M3's block-sparse layers keep their selection: topk_blocks block indices a query and index head (int32)
    selection = s * m.block_sparse.index_heads / tp * m.block_sparse.topk_blocks * 4 if m.block_sparse else 0.0
    return selection + max(_attention_set(m, s, cp, m.heads_at(k) / tp, m.kv_heads_at(k) / tp, m.head_dim_at(k),
                                          m.value_width_at(k), attention_widths(m, vendor, k)[1], k)
                           for k in attention_kinds(m))


# the widest head the flash kernels take (FlashAttention's and cuDNN's SDPA: 256); a wider one runs SDPA's
# memory-efficient kernel, which takes no GQA, so launch/model.py `sdpa_kv` repeats K/V to the query heads for it
FLASH_MAX_HEAD = 256


def kernel_kv_heads(nh: float, nkv: float, hd: int, vw: int) -> float:
    """K/V heads the attention kernel holds: the layer's own, or the query heads' count where its heads are wider
    than FLASH_MAX_HEAD (K/V repeated for the memory-efficient kernel: Gemma 4's 512-wide full layers)."""
    return nh if max(hd, vw) > FLASH_MAX_HEAD else nkv


def attention_kinds(m: ModelShape) -> list[str]:
    """The attention layer kinds the model has (outside linear attention), the full ones where it has none."""
    kinds = [k for k in ("full_attention", "sliding_attention", "chunked_attention") if k in m.layer_types]
    return kinds or ["full_attention"]


def _attention_set(m: ModelShape, s: float, cp: int, nh: float, nkv: float, hd: int, value_width: int,
                   vw: int, kind: str = "full_attention") -> float:
    """`attention_working_set` of one `kind` layer outside MLA: nh query and nkv KV heads a rank, of width hd, values
    `value_width` wide as projected and `vw` as the kernel holds them (at `kernel_kv_heads`). Gemma 4's value norm
    keeps its input (a sliding layer's v; a full layer's is k's, kept by k's norm) and row scale."""
    qw, kw = s * nh * hd * BF16, s * nkv * hd * BF16  # one q-sized, one k-sized tensor
    normed_in = s * m.hidden_size * BF16
    qk_norms = qw + kw + s * (nh + nkv) * FP32 if m.qk_norm else 0.0
    if m.hf_model_type == "gemma4_text":
        own_v = not (m.keys_as_values and kind == "full_attention")
        qk_norms += (s * nkv * value_width * BF16 if own_v else 0.0) + s * nkv * FP32
    kv_heads = kernel_kv_heads(nh, nkv, hd, vw)
    rope_q_kv = qw + s * kv_heads * (hd + vw) * BF16 * cp
    out = s * nh * (vw + value_width) * BF16 + s * nh * FP32  # SDPA's output and lse, o_proj's contiguous input
    # Qwen3.5's gate per channel: its sigmoid and the gated output; Step-3.7's per head: the gate and its sigmoid
    # (the gated output is o_proj's input, counted above)
    gate = 2 * qw if m.attn_output_gate else 2 * s * nh * BF16 if m.head_gate else 0.0
    return normed_in + qk_norms + rope_q_kv + out + gate


def linear_attention_working_set(m: ModelShape, s: float, tp: int, cp: int = 1) -> float:
    """Bytes one linear-attention layer's forward saves for its backward, by its kind: Kimi Delta Attention's
    (`kda_working_set`), or Gated DeltaNet, as launch/model.py runs it on GPU (fused conv and gated norm,
    kernels/gdn_fused.py; flash-linear-attention's chunked rule, which takes bf16 q/k/v and recomputes its WY factors
    in the backward): the q/k/v projection before and after the conv, z, beta and the fp32 log decay, the rule's
    in-chunk [C x C] matrices and output, the gated-norm output, the block's input and output. The fused kernels save
    only their inputs. Under CP the rule runs at value width V + K (docs/context_parallel.md): its augmented input's and
    output's K extra columns, and Q_eff kept for the completion's backward, K·2 bytes each per token and value
    head."""
    la = m.linear_attn
    if la.kind == "kda":
        return kda_working_set(m, s, tp, cp)
    nk, nv = la.num_k_heads / tp, la.num_v_heads / tp
    kd, vd = nk * la.head_k_dim, nv * la.head_v_dim
    proj = s * (2 * kd + vd + vd) * BF16 + s * 2 * nv * FP32  # qkv (conv input), z; beta, g
    conv = s * (2 * kd + vd) * BF16  # conv output: the rule's q, k, v
    in_chunk = s * la.chunk_size * nv * FP32
    out = s * vd * BF16 * 2 + 2 * s * m.hidden_size * BF16  # rule output, norm output; block input and output
    combine = 3 * s * nv * la.head_k_dim * BF16 if cp > 1 else 0.0
    return proj + conv + in_chunk + out + combine


def kda_working_set(m: ModelShape, s: float, tp: int, cp: int = 1) -> float:
    """Kimi Delta Attention (H/tp heads of width D, HD = H/tp·D a rank): what its forward keeps for the backward,
    at least what a recomputed forward holds. q, k and v as projected (the convs' input) and after the convs and
    SiLU (the rule's input), s·3·HD·2 each; the low-rank gates' D-wide latents (f_b's and g_b's inputs, not split
    by tp), s·2·D·2; the output gate (the gated norm's gate input), s·HD·2; the per-channel decay g and its in-chunk
    cumulative sum in fp32, s·2·HD·4; β in fp32, s·H/tp·4; the rule's two in-chunk [C × C] matrices (A_kk and A_qk)
    in fp32, s·2·C·H/tp·4; the rule output and the gated-norm output, s·HD·2 each; the block's input and output,
    2·s·h·2. Under CP the rule's augmented width adds Gated DeltaNet's 3·s·(H/tp)·D·2."""
    la = m.linear_attn
    nh = la.num_k_heads / tp
    d = la.head_k_dim
    hd = nh * d
    qkv = 2 * s * 3 * hd * BF16  # before and after the convs
    gates = s * (2 * d * BF16 + hd * BF16 + 2 * hd * FP32 + nh * FP32)  # latents, output gate; decay, its sums; beta
    in_chunk = 2 * s * la.chunk_size * nh * FP32
    out = 2 * s * hd * BF16 + 2 * s * m.hidden_size * BF16  # rule output, norm output; block input and output
    combine = 3 * s * nh * d * BF16 if cp > 1 else 0.0
    return qkv + gates + in_chunk + out + combine


def kda_backward_bytes(m: ModelShape, s: float, tp: int, cp: int = 1) -> float:
    """What Kimi Delta Attention's chunked rule (fla's chunk_kda) holds beyond its saved set at its backward's peak,
    the in-chunk gradient pass (H/tp heads a rank, d_k = K, value width V, V + K under CP's augmented pass, chunk C),
    per token and head: the recomputed WY factors w and u and the gated q and k, 2·(3K + V); the recomputed chunk
    states h and their gradients dh, bf16 [K × V] a chunk each, 2·2·K·V/C; the recomputed new values, 2·V; the
    value pass's fp32 dA, 4·C; the WY pass's dv, 2·V, its fp32 dq, dk and dg, 3·4·K, and dA, 4·C; the in-chunk
    pass's second fp32 dq, dk and dg, 3·4·K (β's gradients, 4·(1 + K/32), next to nothing). At Kimi-Linear's
    K = V = 128, C = 64: 6,164 bytes a token and head, 6.46 GB at 32,768 tokens and 32 heads, more than the layer's
    saved set; measured at the peak of that step (bench/memory_at_peak.py, fla-core 0.6.0): 6.47 GB of fla's
    buffers."""
    la = m.linear_attn
    nh = la.num_k_heads / tp
    k, c = la.head_k_dim, la.chunk_size
    v = la.head_v_dim + (k if cp > 1 else 0)
    per_head = (BF16 * (3 * k + v) + 2 * BF16 * k * v / c + 2 * BF16 * v + 2 * FP32 * c + 6 * FP32 * k
                + FP32 * (1 + k / 32))
    return s * nh * per_head


def routed_row_bytes(m: ModelShape, etp: int = 1) -> tuple[float, float]:
    """(saved, backward) bytes the routed experts hold per routed row (launch/moe.py: _RoutedExperts): saved, the
    permuted input x (h), the gate and up projection (2f) and the expert output y (h), bf16, and the row's order;
    in the backward beyond them, the larger of its two moments: the slot gradient g (h) formed while y is still
    held, or, once y is dropped, the SwiGLU backward's three expert-width tensors (g·W2, the activation and the gate
    and up gradient: f + f + 2f). f is split by etp."""
    h, f = m.hidden_size, m.expert_ffn / etp
    return (2 * h + 2 * f) * BF16 + 8, max(h, 4 * f) * BF16


def moe_moments(m: ModelShape, s: float) -> tuple[float, float, float]:
    """One MoE block on s tokens, in bytes: (saved, peak in the backward before the layer's expert weight gradients
    exist, peak after). Saved: the post-attention norm's input, its output (kept by the router and the shared
    expert), the router's fp32 probabilities and top-k weights and indices, the routed rows (`routed_row_bytes`,
    s·k of them), the shared expert's gate, up, activation and product and the gated output. The backward runs the
    shared expert first (created last): autograd's SwiGLU backward holds, at its multiply, the product's gradient
    and the activation's and up's beside the gate, up and activation it saved (six expert-width tensors where four
    were saved); then the routed experts, whose peak is their saved rows plus the larger backward moment; once
    their weight gradients are formed the block holds the input gradient's rows twice
    (expert order, then token order: 2·h a row) and no saved row: the backward frees each at its last use, with or
    without recompute (launch/moe.py: `free_at_last_use`)."""
    h, k = m.hidden_size, m.top_k
    base = s * (norm_saved(h) + h * BF16 + m.num_experts * FP32 + k * (FP32 + 8 + BF16) + FP32)
    row_saved, row_bwd = routed_row_bytes(m)
    routed = s * k * row_saved
    shared = s * (4 * m.shared_expert_ffn + (h if m.shared_expert_gate else 0)) * BF16 if m.shared_expert_ffn else 0.0
    shared_backward = shared + s * 2 * m.shared_expert_ffn * BF16
    before = base + routed + max(s * k * row_bwd, shared_backward)
    return base + routed + shared, before, base + s * k * 2 * h * BF16


def dense_ffn_moments(m: ModelShape, s: float, tp: int) -> tuple[float, float]:
    """A dense SwiGLU FFN on s tokens (its width split by tp), in bytes: (saved, peak in its backward). Saved: the
    norm's input and output (h each) and autograd's gate, up, activation and product (f each). Its backward, at the
    multiply, holds the product's gradient and the activation's and up's beside the gate, up and activation (six
    f-wide tensors; the product is dropped once the down projection's gradients are formed)."""
    if not m.num_dense_layers:
        return 0.0, 0.0
    f, around = m.dense_ffn / tp, 2 * s * m.hidden_size * BF16
    return s * 4 * f * BF16 + around, s * 6 * f * BF16 + around


def layer_saved(m: ModelShape, s: float, tp: int, cp: int, vendor: str = "nvidia") -> tuple[float, float]:
    """(mixer, FFN) bytes one decoder layer's forward saves for its backward: the largest mixer and FFN kinds. The
    FFN side (its norm, router, experts) runs on the s/tp sequence-parallel tokens (launch/tensor_parallel.py). With
    norms after the sublayers (norm_placement "sandwich" or "post") each side adds the norm's saved input: the
    sublayer's output, on the s/tp tokens it is reduce-scattered to."""
    mixers = []
    if m.num_attention_layers:
        mixers.append(attention_working_set(m, s, tp, cp, vendor))
    if m.num_linear_attn_layers:
        mixers.append(linear_attention_working_set(m, s, tp, cp))
    ffn = max(moe_moments(m, s / tp)[0] if m.num_moe_layers else 0.0, dense_ffn_moments(m, s, tp)[0])
    mixer = max(mixers) + s / tp * FP32  # + the input norm's row scale (its input is the layer's)
    if m.gated_norm_rank:  # A.X K2's gated norms keep the RMSNorm's output (bf16, beside the gated one the sublayer
        # takes), the gate's fp32 sigmoid and its two low-rank activations: the input norm's on every layer (the
        # mixer's side, on the s/tp tokens it runs on), the FFN norm's on the MoE layers
        gate = s / tp * (m.hidden_size * (BF16 + FP32) + 2 * m.gated_norm_rank * BF16)
        mixer, ffn = mixer + gate, ffn + (gate if m.num_moe_layers else 0.0)
    if m.moe_output_saved:  # a norm after each sublayer (sandwich, post) keeps its output (s/tp rows) and scale
        after = s / tp * norm_saved(m.hidden_size)
        return mixer + after, ffn + after
    return mixer, ffn


def layer_working_set(m: ModelShape, s: float, tp: int, cp: int, expert_grad: float = 0.0,
                      vendor: str = "nvidia") -> float:
    """One layer's working set at its backward's peak, with every gradient counted as present: what its forward
    saved (mixer and FFN: the checkpoint unit is the decoder layer), the FFN's saved set replaced by its backward
    peak, the larger of the dense FFN's (`dense_ffn_moments`) and the MoE block's (`moe_moments`). `expert_grad`:
    the bytes of the layer's own expert weight gradients, which the routed experts' backward forms only after its
    largest moment before them, so that moment needs that much less than the count says. The mixer's backward
    runs after the FFN's has freed its saved set: attention's moment is its saved set and its flash backward's
    buffers, Kimi Delta Attention's its saved set and its chunked rule's backward buffers (`kda_backward_bytes`)."""
    mixer = layer_saved(m, s, tp, cp, vendor)[0]
    ffn = dense_ffn_moments(m, s, tp)[1]
    if m.num_moe_layers:
        _, before, after = moe_moments(m, s / tp)
        ffn = max(ffn, before - expert_grad, after)
    # the FFN's backward runs first and frees its saved set; then attention's, which adds its gradients
    attention = linear = 0.0
    if m.num_attention_layers:
        attention = (attention_working_set(m, s, tp, cp, vendor) + attention_backward_bytes(m, s, tp, cp, vendor)
                     + s / tp * FP32)
    if m.num_linear_attn_layers and m.linear_attn.kind == "kda":
        linear = kda_working_set(m, s, tp, cp) + kda_backward_bytes(m, s, tp, cp) + s / tp * FP32
    return max(mixer + ffn, attention, linear)


def compressed_attention_working_set(m: ModelShape, s: float, tp: int, cp: int) -> float:
    """Bytes a DeepSeek-V4 layer's forward saves for its backward (docs/deepseek_v4.md), for an implementation with
    this core's habits (norms keeping their input and a row scale, RoPE keeping nothing but cos and sin, the frozen
    indexer keeping only its selection): the normed input; the q LoRA's projection and its normed copy; q_b's
    output (kept by its norm) and q after RoPE; the K = V head as projected and as attended (its rows all-gathered
    under CP); the compressor's kv and gate series and its entries; the attention output and its log-sum-exp, the
    output with its RoPE undone (o_a's input) and o_a's (o_b's input); a sparse layer's selection (int32); and the
    hyper-connections: the FFN site's input streams (the attention site's are the layer's input) and the two
    collapsed inputs, with their row scales. The heads, q_b and o_a split over tp; the K = V head and the
    compressors do not. The largest layer kind: a compressed_sparse_attention layer where the model has one."""
    c, h, hd = m.compressed, m.hidden_size, m.head_dim
    nh = m.num_heads / tp
    q = s * (2 * c.q_lora_rank + 2 * nh * hd) * BF16 + s * nh * FP32
    kv = s * hd * BF16 + s * max(cp, 1) * hd * BF16
    out = s * (2 * nh * hd + c.o_groups * c.o_lora_rank / tp) * BF16 + s * nh * FP32
    sparse = "compressed_sparse_attention" in m.layer_types
    rate = c.csa_rate if sparse else c.hca_rate
    series = 2 if sparse else 1  # a sparse layer's compressor pools two overlapping series
    compressor = s * 2 * series * hd * BF16 + s / rate * hd * BF16
    selection = s * c.index_topk * 4 if sparse else 0.0
    streams = s * (c.hc_mult * h + 2 * h) * BF16 + 2 * s * FP32
    return s * h * BF16 + q + kv + out + compressor + selection + streams


def attention_backward_bytes(m: ModelShape, s: float, tp: int, cp: int, vendor: str = "nvidia") -> float:
    """What the flash kernel's backward adds to attention's saved set: dq, and dk and dv of every key it attended
    (s·cp of them under CP, at the KV heads' count), in bf16 at the kernel's head width; its fp32 accumulator of dq
    and the fp32 row sums of dO·O. Small beside an MoE block's backward; at DeepSeek-V3's 128 heads of width 192
    (its dense layers) it is the layer's peak: 6.4 GB at 32K tokens."""
    nh = m.max_heads / tp
    if m.dsa is not None:  # the absorbed query's gradient, dô, Δ, and the fp32 latent gradient the atomics fill
        lat = m.mla.kv_lora_rank + m.mla.qk_rope_head_dim
        return s * nh * (lat + m.mla.kv_lora_rank) * BF16 + s * nh * FP32 + s * cp * lat * FP32
    if m.mla is not None or m.compressed is not None:  # MLA: every head's own K and V; DeepSeek-V4: one K = V head
        return _flash_backward_bytes(s, cp, nh, nh if m.mla is not None else 1, *attention_widths(m, vendor))
    return max(_flash_backward_bytes(s, cp, m.heads_at(k) / tp, kernel_kv_heads(
        m.heads_at(k) / tp, m.kv_heads_at(k) / tp, *attention_widths(m, vendor, k)), *attention_widths(m, vendor, k))
        for k in attention_kinds(m))


def _flash_backward_bytes(s: float, cp: int, nh: float, nkv: float, kw: int, vw: int) -> float:
    return s * nh * kw * (BF16 + FP32) + s * cp * nkv * (kw + vw) * BF16 + s * nh * FP32


def lm_head_bytes(m: ModelShape, s: float, tp: int, mode: str) -> float:
    """What the LM head holds while it runs. "fused" (the eager path: the loss handed to the head, three GEMMs):
    one group's fp16 tile weights (4096 tokens, or fewer within the kernel's budget), the fp32 dW accumulator and
    the fp16 copy of W ((V/tp)·h·6), and dH (fp32, s·h·4). "lean" (four GEMMs, the loss handed over too): its two
    bf16 gradients ((V/tp + s)·h·2) and a few MiB.
    "naive": NAIVE_BYTES_PER_LOGIT per logit of [s × V/tp] (docs/cost_model.md)."""
    v = m.vocab_size / tp
    if mode == "naive":
        return s * v * NAIVE_BYTES_PER_LOGIT
    if mode == "lean":
        return (v + s) * m.hidden_size * BF16 + LEAN_EXTRA_BYTES
    if mode != "fused":
        raise ValueError(f"lm_head mode must be one of {', '.join(HEAD_MODES)}, got {mode!r}")
    group = min(FUSED_HEAD_GROUP_TOKENS, max(256, FUSED_HEAD_BUDGET_B // (BF16 * v) // 256 * 256))
    return min(s, group) * v * BF16 + v * m.hidden_size * (FP32 + BF16) + s * m.hidden_size * FP32


# ---- FLOPs ---------------------------------------------------------------------------------------------------
def forward_flops_per_token(m: ModelShape, seq: float) -> dict[str, float]:
    """Forward FLOPs per token by part: 2·N over the active matmul weights, attention's quadratic term (causal:
    on average seq/2 keys; sliding layers at most the window; chunked layers half their chunk) and Gated DeltaNet's
    chunked rule (linear in seq)."""
    c = param_counts(m)
    routed = c["routed_experts"] * m.top_k / m.num_experts
    dense = c["attention"] + c["linear_attention"] + c["router"] + c["shared_expert"] + c["dense_ffn"]
    head = c["embedding"] if m.tie_embeddings else c["head"]
    out = {"matmul_layers": 2 * (dense + routed), "head": 2 * head}
    qk, vd = model_widths(m)
    if m.compressed is not None:  # DeepSeek-V4: K = V, one head of head_dim, on the window and compressed entries
        out["attention"] = 2 * m.num_heads * 2 * m.head_dim * sum(compressed_keys(m, seq, k) for k in m.layer_types)
        out["indexer"] = index_pair_flops(m) * indexing_layers(m) * compressed_entries(m.compressed.csa_rate, seq)
        return out
    ctx_full, ctx_sliding = attention_keys(m, seq)
    if m.block_sparse is not None:  # MiniMax-M3: its block-sparse layers' queries attend their selected blocks only
        sparse = len(m.block_sparse.layers)
        ctx_full = ((m.num_full_attn_layers - sparse) * ctx_full + sparse * block_sparse_keys(m, seq)
                    ) / m.num_full_attn_layers
        out["indexer"] = index_pair_flops(m) * indexing_layers(m) * seq / 2
    if m.dsa is not None:  # absorbed: q·latent over C + R channels, p·latent over C, on the selected keys
        qk, vd = m.mla.kv_lora_rank + m.mla.qk_rope_head_dim, m.mla.kv_lora_rank
        ctx_full = sparse_keys(m, seq)
        out["indexer"] = index_pair_flops(m) * indexing_layers(m) * seq / 2
    kinds = ("full_attention", "sliding_attention", "chunked_attention")  # each at its own head widths; DSA absorbed
    widths = dict.fromkeys(kinds, qk + vd) if m.dsa is not None else {k: sum(model_widths(m, k)) for k in kinds}
    out["attention"] = 2 * (widths["full_attention"] * m.heads_at("full_attention") * m.num_full_attn_layers * ctx_full
                            + widths["sliding_attention"] * m.heads_at("sliding_attention") * m.num_sliding_layers
                            * ctx_sliding
                            + widths["chunked_attention"] * m.heads_at("chunked_attention") * m.num_chunked_layers
                            * chunk_keys(m, seq))
    if m.linear_attn is not None:
        la = m.linear_attn
        out["linear_attention"] = m.num_linear_attn_layers * la.num_v_heads * delta_rule_flops_per_token_head(la)
    return out


def capped_mean(cap: float, n: float) -> float:
    """The mean of min(cap, t + 1) over t = 0 … n − 1: what a causal query sees on average of at most `cap` of the
    keys before it, over n queries."""
    if n <= cap:
        return (n + 1) / 2
    return (cap * (cap + 1) / 2 + (n - cap) * cap) / n


def sparse_keys(m: ModelShape, seq: float) -> float:
    """Keys a query of DeepSeek sparse attention attends on average over a causal sequence of `seq`: min(topk, t + 1)
    for the query at t."""
    return capped_mean(m.dsa.topk, seq)


def block_sparse_keys(m: ModelShape, seq: float) -> float:
    """Keys a query of a MiniMax-M3 block-sparse layer attends on average over a causal sequence of `seq`: every
    earlier key while the blocks so far number at most topk_blocks (t < K·B), then K − 1 whole blocks and its own
    block's keys up to it, (K − 1)·B + (t mod B) + 1 (the local blocks are forced in; without them, K whole blocks
    at most). With n = seq − K·B past the cap, q whole blocks of it and r more, the mod terms sum to
    q·B(B − 1)/2 + r(r − 1)/2."""
    b = m.block_sparse
    cap = b.topk_blocks * b.block
    if seq <= cap:
        return (seq + 1) / 2
    if not b.local_blocks:
        return capped_mean(cap, seq)
    n = seq - cap
    q, r = divmod(n, b.block)
    beyond = n * ((b.topk_blocks - 1) * b.block + 1) + q * b.block * (b.block - 1) / 2 + r * (r - 1) / 2
    return (cap * (cap + 1) / 2 + beyond) / seq


def compressed_entries(rate: int, seq: float, cap: float = math.inf) -> float:
    """The mean over t = 0 … seq − 1 of min(cap, ⌊(t + 1)/rate⌋): the compressed entries a causal query at t may see
    (an entry stands for `rate` tokens and is seen once all of them are earlier), at most `cap` of them. With
    u = t + 1 and q = ⌊seq/rate⌋, entry count j ≥ 1 holds for `rate` values of u below q·rate and the last
    seq − q·rate + 1 values of u have q."""
    q = math.floor(seq / rate)
    if q < 1:
        return 0.0

    def capped_sum(n: int) -> float:  # Σ_{j=1..n} min(cap, j)
        return n * (n + 1) / 2 if n <= cap else cap * (cap + 1) / 2 + (n - cap) * cap

    return (rate * capped_sum(q - 1) + (seq - q * rate + 1) * min(cap, q)) / seq


def compressed_keys(m: ModelShape, seq: float, kind: str) -> float:
    """Keys a DeepSeek-V4 query of a `kind` layer attends on average over a causal sequence of `seq`: its window of
    raw keys (min(window, t + 1)), and beside them the compressed entries it may see (`compressed_entries`): a
    compressed_sparse_attention layer the index_topk of them its indexer picks, a heavily_compressed_attention layer
    all."""
    c = m.compressed
    keys = capped_mean(m.sliding_window, seq)
    if kind == "compressed_sparse_attention":
        keys += compressed_entries(c.csa_rate, seq, c.index_topk)
    elif kind == "heavily_compressed_attention":
        keys += compressed_entries(c.hca_rate, seq)
    return keys


def index_pair_flops(m: ModelShape) -> int:
    """Forward FLOPs of one index score (a query against a key; DeepSeek-V4's: against a compressed key): every
    index head's product of width I."""
    if m.compressed is not None:
        return 2 * m.compressed.index_heads * m.compressed.index_head_dim
    if m.block_sparse is not None:
        return 2 * m.block_sparse.index_heads * m.block_sparse.index_head_dim
    return 2 * m.dsa.index_heads * m.dsa.index_head_dim


def indexing_layers(m: ModelShape) -> int:
    """Layers that run an indexer: DeepSeek sparse attention's (every full-attention layer but those sharing an
    earlier one's selection) or DeepSeek-V4's (its compressed_sparse_attention layers)."""
    if m.compressed is not None:
        return sum(t == "compressed_sparse_attention" for t in m.layer_types)
    if m.block_sparse is not None:
        return len(m.block_sparse.layers)
    return m.num_full_attn_layers - len(m.dsa.shared_layers) if m.dsa is not None else 0


def index_pair_seconds(m: ModelShape, hw: HwProfile) -> float:
    """Seconds the indexer spends on one (query, key) pair: its score's FLOPs at INDEX_GEMM_EFFICIENCY of the peak and
    its share of the top-k selection."""
    return (index_pair_flops(m) / (hw.peak_bf16_tflops * 1e12 * INDEX_GEMM_EFFICIENCY)
            + INDEX_SELECT_S * INDEX_SELECT_HBM / (hw.hbm_bw_tb_s * 1e12))


def sparse_attention_passes(m: ModelShape, tp: int, passes: float, recomputed: float = 0.0) -> float:
    """DeepSeek sparse attention's work a forward's FLOPs buys, in forward FLOPs at the backward kernel's rate
    (rates()["attention"]): `passes` forward and backward passes (the backward two forwards' FLOPs), and
    `recomputed` forwards more; the forward at its own rate (SPARSE_NARROW_FORWARD_EFFICIENCY where a rank's heads
    are not a multiple of 64: the kernels' 16-head programs), a rank with fewer heads than SPARSE_HEAD_BLOCK charged
    the block's time."""
    heads = m.num_heads / tp
    fwd = SPARSE_FORWARD_EFFICIENCY if heads % 64 == 0 else SPARSE_NARROW_FORWARD_EFFICIENCY
    return ((passes + recomputed) * SPARSE_BACKWARD_EFFICIENCY / fwd + 2 * passes) * max(1.0, SPARSE_HEAD_BLOCK / heads)


def attention_keys(m: ModelShape, seq: float, kernel: bool = False) -> tuple[float, float]:
    """Keys a query attends on average, (full layers, sliding layers): causal, seq/2; under a window shorter than
    the sequence, the window. `kernel`: what the kernels cost a query, in keys of the full-attention kernel
    (`window_kernel_keys` for a sliding layer)."""
    w = m.sliding_window or seq
    if w >= seq or m.compressed is not None:  # (DeepSeek-V4's keys: compressed_keys)
        return seq / 2, seq / 2
    return seq / 2, (window_kernel_keys(w) if kernel else w)


def residual_width(m: ModelShape) -> int:
    """Values a token's residual holds between layers: the hidden size, DeepSeek-V4's hc_mult streams of it."""
    return m.hidden_size * (m.compressed.hc_mult if m.compressed is not None else 1)


def compressed_cp_row(m: ModelShape, s: float) -> float:
    """Values a token sends under CP per DeepSeek-V4 attention pass, on average over its layers: what a rank needs
    of the earlier segments are their compressed entries (one head_dim entry per rate tokens; a sparse layer's with
    its index keys) and the window's raw K = V rows at a segment's edge (window · head_dim over the s tokens)."""
    c, hd = m.compressed, m.head_dim
    entries = [(hd + c.index_head_dim) / c.csa_rate if t == "compressed_sparse_attention" else hd / c.hca_rate
               if t == "heavily_compressed_attention" else 0.0 for t in m.layer_types]
    return sum(entries) / len(entries) + m.sliding_window * hd / s


def chunk_keys(m: ModelShape, seq: float) -> float:
    """Keys a query of a chunked layer attends on average: causal inside chunks of `attention_chunk` positions, so
    seq/2 up to one chunk; beyond, each whole chunk of C averages C/2 and the last, of r, r/2, weighted by their
    tokens: (n·C² + r²) / (2·seq). The chunks are documents to the full-attention kernel (launch/model.py), so
    these are its keys as well as the model's."""
    c = m.attention_chunk
    if not c or seq <= c:
        return seq / 2
    n = math.floor(seq / c)
    r = seq - n * c
    return (n * c * c + r * r) / (2 * seq)


def window_keys(window: int) -> float:
    """Keys a windowed kernel scores a query: a block of WINDOW_KEY_TILE queries reaches back window − 1 keys
    before its first, so it scores the key tiles over window + tile − 1 keys (256 for gpt-oss's 128)."""
    return -(-(window + WINDOW_KEY_TILE - 1) // WINDOW_KEY_TILE) * WINDOW_KEY_TILE


def window_kernel_keys(window: int) -> float:
    """What a windowed kernel costs a query, in keys of the full-attention kernel at the same width: the keys it
    scores (`window_keys`) at WINDOW_KEY_COST each, and WINDOW_ROW_KEYS for the row (1,501 for gpt-oss's 128)."""
    return WINDOW_KEY_COST * window_keys(window) + WINDOW_ROW_KEYS


def attention_kernel_ratio(m: ModelShape, seq: float) -> float:
    """The attention kernels' work over the model's attention FLOPs at `seq` (1 without windows shorter than seq;
    DeepSeek-V4's window and compressed entries counted as the model's keys)."""
    if m.compressed is not None:
        return 1.0
    full, slide = attention_keys(m, seq)
    _, slide_k = attention_keys(m, seq, kernel=True)
    chunked = m.num_chunked_layers * chunk_keys(m, seq)
    model = m.num_full_attn_layers * full + m.num_sliding_layers * slide + chunked
    return (m.num_full_attn_layers * full + m.num_sliding_layers * slide_k + chunked) / model if model else 1.0


# ---- communication -------------------------------------------------------------------------------------------
def gpus_per_node_used(hw: HwProfile, world: int) -> int:
    """GPUs per node a job of `world` GPUs runs on: the largest divisor of world that a node holds (12 GPUs on
    8-GPU nodes run as 2 nodes × 6), so every world size gets a launchable layout."""
    return max(d for d in range(1, min(world, hw.gpus_per_node) + 1) if world % d == 0)


def group_bw(hw: HwProfile, group: int, stride: int, node: int | None = None) -> float:
    """Per-GPU bandwidth (bytes/s) of a collective over `group` ranks spaced `stride` apart in the rank order:
    intra-node only when every such group lies inside one node of `node` GPUs (default: a full node), that is when
    its span group·stride divides the node (the groups tile the rank order in aligned blocks of that span: 12 GPUs
    as 2 nodes × 6 put ranks 4–7 of a 4-rank group on both nodes); on a mesh (xGMI) an all-to-all among fewer than
    all GPUs of a node uses only the links between them."""
    if group <= 1:
        return float("inf")
    if (node or hw.gpus_per_node) % (group * stride):
        return hw.inter_node_bw_gb_s * GB
    bw = hw.intra_node.bw_gb_s * GB
    if hw.intra_node.topology == "mesh":
        bw *= (group - 1) / (hw.gpus_per_node - 1)
    return bw


def ep_overlap_time(t_comm: float, t_gemm: float, chunks: int) -> float:
    """Chunked EP overlap: with k chunks, dispatch of chunk i+1 and combine of chunk i−1 run under the expert
    GEMMs of chunk i, so the layer costs max(comm, gemm) plus one ramp and one drain of min/k; k=1 is serial.
    With comm ≈ gemm the efficiency is k/(k+1)."""
    return max(t_comm, t_gemm) + min(t_comm, t_gemm) / chunks


def overlap_efficiency(chunks: int) -> float:
    return chunks / (chunks + 1)


def default_ep_chunks(m: ModelShape, hw: HwProfile, world: int, layout: Layout, opts: TrainOptions) -> int:
    """The chunk count of EP_CHUNK_COUNTS (chunks of at least EP_CHUNK_TOKENS local tokens) that costs the step least:
    the all-to-all time chunked overlap leaves exposed against the chunk loop's fixed time per extra chunk, over the
    slowest stage's MoE layers, each recomputed or kept (docs/cost_model.md, section 4). 1 when ep = 1: nothing to
    overlap."""
    if layout.ep <= 1:
        return 1
    s = opts.micro_batch_tokens / layout.cp
    t_a2a, t_gemm, _ = ep_layer_times(m, hw, world, layout, opts)
    per_chunk = rates(hw)["ep_chunks"]
    # the slowest stage's MoE layers, recomputed (5 transfers over 3 passes) and kept (4 over 2)
    stage, _ = slowest_stage(m, layout.pp, opts, hw)
    moe, again = _stage_counts(m, stage)["moe"], _stage_counts(m, recomputed_part(opts, stage))["moe"]
    kinds = [(again, ep_transfers(True, m.moe_output_saved)), (moe - again, ep_transfers(False))]

    def cost(k: int) -> float:
        return sum(n * (ep_exposed_time(t_a2a, t_gemm, x, k) + len(x) * (k - 1) * per_chunk) for n, x in kinds)

    counts = [k for k in EP_CHUNK_COUNTS if k == 1 or s / k >= EP_CHUNK_TOKENS]
    return min(counts, key=lambda k: (cost(k), k))


def with_default_chunks(m: ModelShape, hw: HwProfile, world: int, layout: Layout, opts: TrainOptions
                        ) -> TrainOptions:
    """`opts` with the layout's default_ep_chunks: the options the solver estimates a layout with."""
    return opts.model_copy(update={"ep_overlap_chunks": default_ep_chunks(m, hw, world, layout, opts)})


def ep_transfer_bytes(m: ModelShape, s: float, ep: int) -> float:
    """Bytes one EP all-to-all transfer sends off a rank: s·k rows of h bf16 values, (ep − 1)/ep of them."""
    return s * m.top_k * m.hidden_size * BF16 * (ep - 1) / ep


EXPERT_TERMS = ("expert_gemm", "expert_rows", "expert_weights")
BYTE_TERMS = ("expert_rows", "expert_weights", "dense_rows")  # bytes, not FLOPs


def expert_pass_work(m: ModelShape, s: float, layout: Layout) -> dict[str, float]:
    """The routed experts' grouped GEMMs in one pass (a forward-equivalent) through one MoE layer on one GPU, for s
    tokens, in the three quantities their time is charged on (docs/cost_model.md, "The routed experts"):
    expert_gemm, their FLOPs (2·3·h·f a routed row: gate, up and down); expert_rows, the bytes each routed row moves
    through them (x in, the gate and up out, the SwiGLU's product in, y out: 2h + 3f bf16 values); expert_weights,
    the bytes of the rank's experts' weights (3·h·f bf16 each, E/ep of them), read once a pass however few rows each
    expert gets. TP splits the rows (s·k/tp a rank), expert TP each expert's width."""
    if not m.num_moe_layers:
        return dict.fromkeys(EXPERT_TERMS, 0.0)
    h, f = m.hidden_size, m.expert_ffn / layout.etp
    rows = s * m.top_k / layout.tp
    per_expert = param_counts(m)["routed_experts"] / (m.num_experts * m.num_moe_layers) / layout.etp  # 3·h·f (+ bias)
    return {"expert_gemm": rows * 2 * per_expert, "expert_rows": rows * (2 * h + 3 * f) * BF16,
            "expert_weights": m.num_experts / layout.ep * 3 * h * f * BF16}


def expert_pass_seconds(m: ModelShape, s: float, layout: Layout, hw: HwProfile) -> float:
    """Seconds of `expert_pass_work` at `hw`'s rates."""
    r = rates(hw)
    return sum(w / r[k] for k, w in expert_pass_work(m, s, layout).items() if w)


def ep_layer_times(m: ModelShape, hw: HwProfile, world: int, layout: Layout, opts: TrainOptions
                   ) -> tuple[float, float, list[int]]:
    """Per MoE layer of one micro-batch: the seconds of one all-to-all transfer (s·k·h values, (ep−1)/ep of them
    leaving the rank), of the expert GEMMs in one pass, and the transfers of each pass: the forward dispatches and
    combines, the backward sends the output gradients and returns the input gradients, the recomputed forward (full
    recompute) only dispatches (launch/expert_parallel.py)."""
    ep = layout.ep
    s = opts.micro_batch_tokens / layout.cp
    t_a2a = ep_transfer_bytes(m, s, ep) / group_bw(hw, ep, 1, gpus_per_node_used(hw, world)) if ep > 1 else 0.0
    t_gemm = expert_pass_seconds(m, s, layout, hw)
    return t_a2a, t_gemm, ep_transfers(opts.recompute == "full", m.moe_output_saved)


def ep_transfers(recompute: bool, combines: bool = False) -> list[int]:
    """An MoE layer's all-to-all transfers per pass: forward, (recomputed forward,) backward. The recomputed forward
    only dispatches, but `combines` (a norm after the block keeps its output: ModelShape.moe_output_saved) where it
    must return the output too."""
    return [2, 2 if combines else 1, 2] if recompute else [2, 2]


def ep_exposed_time(t_a2a: float, t_gemm: float, transfers: list[int], chunks: int) -> float:
    """The all-to-all seconds one MoE layer leaves on the critical path over its passes at `chunks` chunks."""
    return sum(ep_overlap_time(x * t_a2a, t_gemm, chunks) - t_gemm for x in transfers)


# ---- the estimate, by section of docs/cost_model.md ---------------------------------------------------------
def ep_dispatch_bytes(m: ModelShape, s: float, chunks: int = 1) -> float:
    """What the expert-parallel code path (launch/expert_parallel.py) holds beyond the local dispatch during one MoE
    layer's backward, for the s·k token copies a rank receives (about s·k whatever ep is, under balance): rows of
    h + 8 bf16 values (the exchanged rows: h columns, the routing weight and padding), EP_HELD_ROWS a copy, and
    EP_CHUNK_ROWS more with more than one chunk (the weight gradients' one copy of every chunk's rows). Both paths
    free their saved rows at their last use and recompute the SwiGLU in their backward, so the expert-width tensors
    are the same in both and the difference is rows alone."""
    if not m.num_moe_layers:
        return 0.0
    return s * m.top_k * (EP_HELD_ROWS + (EP_CHUNK_ROWS if chunks > 1 else 0.0)) * (m.hidden_size + 8) * BF16


def ep_copy_bytes(m: ModelShape, s: float, recompute: bool, ep: int = 1) -> float:
    """Bytes the expert-parallel path moves beyond the local dispatch in one MoE layer's step, for s·k token copies
    of h + 8 bf16 values, each read and written once. On the compute stream, four regroups: in the forward the rows
    into expert order and the outputs back to source order, in the backward the same for the gradients (the
    recomputed forward's regroup stands in for the local path's combine, which it skips: nothing goes back). Then
    the exchanges: two in the forward, two in the backward, one in the recomputed forward (two, and a fifth regroup,
    where a norm after the block keeps its output: ModelShape.moe_output_saved); of each, the 1/ep of the rows a
    rank sends itself is a local copy, the rest is the all-to-all, charged as communication (section 4)."""
    if not m.num_moe_layers:
        return 0.0
    again = (2 if m.moe_output_saved else 1) if recompute else 0
    regroups = 4 + (1 if recompute and m.moe_output_saved else 0)
    return s * m.top_k * (m.hidden_size + 8) * BF16 * 2 * (regroups + (4 + again) / max(ep, 1))


def memory_terms(m: ModelShape, hw: HwProfile, world: int, layout: Layout, opts: TrainOptions,
                 ep_path: bool = False) -> tuple[dict[str, float], float, float]:
    """Section 1: bytes per GPU by component (weights, grads, master, optimizer, activations, lm_head, overhead),
    what the head holds while it runs, and what an unfused head would hold."""
    pp, tp, cp, ep, etp = layout.pp, layout.tp, layout.cp, layout.ep, layout.etp
    dp, edp = layout.dp(world), layout.edp(world)
    s = opts.micro_batch_tokens / cp  # tokens per rank per micro-batch (TP with sequence parallel: s/tp outside)
    L = stage_layers(m, pp, opts, hw)  # the largest stage's
    kept = kept_layers(opts, L)  # of them, those that keep their activations (all without recompute)
    in_head = opts.lm_head != "naive"  # the head's gradients leave it at once: nothing of [s, V] outlives it
    in_flight = min(pp, opts.micro_batches) if pp > 1 else 1  # 1F1B: the first stage holds pp micro-batches

    # persistent state: dense params over tp, then FSDP2 over dp·cp; routed experts over ep·etp, FSDP2 over edp
    local_params = local_param_count(m, world, layout, L)
    ends = stage_params(m, pp, L)[2]
    mem = {
        "weights": local_params * BYTES_WEIGHTS,
        "grads": local_params * BYTES_GRADS,
        "master": local_params * BYTES_MASTER,
        "optimizer": local_params * BYTES_OPTIMIZER,
    }
    # activations
    layer_dense, layer_expert = layer_params(m)
    unsharded = (layer_dense / tp + layer_expert / (ep * etp)) * BYTES_UNSHARDED
    if dp * cp == 1 and edp == 1:
        unsharded = 0.0  # nothing to gather: the single copy is already whole
    # the layer's own expert weight gradients, counted in the gradient term, form after its backward's largest moment
    working = layer_working_set(m, s, tp, cp, expert_grad=layer_expert / (ep * etp * edp) * BYTES_GRADS,
                                vendor=hw.vendor)
    if ep > 1 or ep_path:
        # the EP path's backward copies, on top of the layer's own
        working += ep_dispatch_bytes(m, s, opts.ep_overlap_chunks)
    head_unsharded = m.vocab_size / tp * m.hidden_size * BYTES_UNSHARDED if dp * cp > 1 else 0.0
    head = lm_head_bytes(m, s, tp, opts.lm_head) + head_unsharded
    head_own = head
    head_grad = min(ends, m.vocab_size * m.hidden_size) / (tp * dp * cp) * BYTES_GRADS
    emb_grad = ends / (tp * dp * cp) * BYTES_GRADS - head_grad  # an untied embedding's: the backward's last
    mixer, ffn = layer_saved(m, s, tp, cp, hw.vendor)
    # kept by its input norm (under recompute: the checkpoint); DeepSeek-V4's: its hc_mult residual streams
    layer_input = s * residual_width(m) * BF16 / tp
    checkpoints = (L - kept) * in_flight * layer_input
    saved = kept * in_flight * (mixer + ffn + layer_input)
    grads = mem["grads"]
    layer_grad = (grads - head_grad - emb_grad) / L
    # a recomputed layer's backward: its checkpoint and those before it are live, and the gradients of the layers
    # after it (and its own); counted against the whole gradient term. With one micro-batch in flight the k-th
    # recomputed layer from the top holds (J - k + 1) inputs and lacks (J - k) layers' gradients: the most at the
    # first or the last of the J (docs/cost_model.md, 1.2); with several, the earlier micro-batches' backward has
    # formed every gradient, and every checkpoint of this one is live
    J = L - kept
    if in_flight == 1 and opts.micro_batches == 1:
        recomputed_inputs = max(layer_input, J * layer_input - (J - 1) * layer_grad)
    else:
        recomputed_inputs = L * in_flight * layer_input
    if not kept:
        # full recompute: the peak is in a layer's backward, before the embedding's gradient exists
        acts = recomputed_inputs + working + unsharded - emb_grad
    else:
        # kept layers hold what their forward saved, but the gradients arrive one layer at a time in the backward:
        # the peak is at the last kept layer's backward (every saved set, the head's and that layer's gradients),
        # at the first layer's backward without recompute (one saved set, every gradient but the embedding's), or,
        # with recompute, at a recomputed layer's backward: counted as under full recompute (every layer's input),
        # and under 1F1B the other micro-batches' kept saved sets (the kept layers, the stage's last, are done by
        # then in this one); activations and lm_head are counted against the whole gradient term, so they shrink
        # by the gradients not yet there
        last = checkpoints + saved + (working - mixer - ffn) + unsharded - (grads - head_grad - layer_grad)
        if kept == L:
            first = in_flight * working + unsharded - emb_grad
        else:
            first = recomputed_inputs + kept * (in_flight - 1) * (mixer + ffn) + working + unsharded - emb_grad
        acts = max(last, first, 0.0)
    # DeepSeek sparse attention's layers whose selection a later layer reuses keep it (int32, s × topk) for the step,
    # and with keep_selections so does every recomputed layer with an indexer
    if m.dsa is not None:
        sources = len({m.dsa.selection_source(i) for i in m.dsa.shared_layers}) * L / m.num_layers
        if opts.keep_selections:
            sources = max(sources, indexing_layers(m) * (L - kept) / m.num_layers)
        acts += sources * in_flight * s * m.dsa.topk * 4
    if in_head or kept:
        # the fused and lean heads run (forward and their gradients) at the end of the forward, when the
        # checkpoints and the kept layers' saved sets are live and no layer's gradient exists yet: they raise the
        # peak only by what that moment needs beyond the layers' backward
        head = max(0.0, checkpoints + saved + head_own - (grads - head_grad) - acts)
    mem["activations"] = acts
    mem["lm_head"] = head
    # the optimizer step, after the activations are freed: one group's gradients cast to fp32 (the clip scales
    # them in place), the largest tensor being a group of its own
    largest = max(m.vocab_size * m.hidden_size / (tp * dp * cp),
                  layer_expert / (ep * etp * edp) * 2 / 3 if m.num_moe_layers else 0.0)
    opt_step = FP32 * max(OPT_GROUP_NUMEL, largest)
    mem["optimizer"] += max(0.0, opt_step - (acts + head))
    mem["overhead"] = hw.overhead_gb * GB
    return mem, head_own, 2 * s * m.vocab_size / tp * BF16  # unfused: the bf16 logits and their gradient


def local_param_count(m: ModelShape, world: int, layout: Layout, layers: float | None = None) -> float:
    """Parameters one GPU holds: dense (and the ends) over tp·dp·cp, routed experts over ep·etp·edp; under pp, those
    of a stage of `layers` layers (default L/pp)."""
    dense, experts, ends = stage_params(m, layout.pp, layers)
    replicated = tp_replicated_params(m, layout.pp, layers) if layout.tp > 1 else 0.0
    return ((dense - replicated + ends) / (layout.tp * layout.dp(world) * layout.cp)
            + replicated / (layout.dp(world) * layout.cp)
            + experts / (layout.ep * layout.etp * layout.edp(world)))


def tp_replicated_params(m: ModelShape, pp: int, layers: float | None = None) -> float:
    """Dense parameters of the largest stage that tensor parallelism keeps whole on every tp rank (launch/
    tensor_parallel.py): the router, the shared expert and its gate, and the norms — they run on the
    sequence-parallel tokens; attention, Gated DeltaNet, dense FFNs, the embedding and the head are split (of
    DeepSeek-V4's attention only what is per head: q_b, o_a, o_b and the sinks)."""
    c = param_counts(m)
    per_stage = m.num_layers / pp if layers is None else layers
    whole = c["router"] + c["shared_expert"] + c["norms"]
    if m.compressed is not None:  # DeepSeek-V4: all of its attention but q_b, o_a, o_b and the sinks (split by head)
        split = sum(sum(i * o // g for i, o, g, by_head in compressed_projections(m, kind) if by_head)
                    for kind in m.layer_types) + m.num_layers * m.num_heads
        whole += c["attention"] - split
    return whole / m.num_layers * per_stage


def forward_equivalents(opts: TrainOptions) -> int:
    """A recomputed layer's work per micro-batch in forward passes: forward, the recomputed forward and the backward
    at twice a forward — 4 under recompute, 3 without (a whole model's: keep_layers aside)."""
    return 4 if opts.recompute == "full" else 3


def kept_layers(opts: TrainOptions, layers: int) -> int:
    """Of a pipeline stage's `layers` decoder layers, how many keep their activations (run no recomputed forward):
    all without recompute, the last keep_layers under it."""
    return layers if opts.recompute == "none" else min(opts.keep_layers, layers)


def recomputed_part(opts: TrainOptions, stage: range) -> range:
    """The layers of `stage` that run a recomputed forward: all but its last kept_layers."""
    return range(stage.start, stage.stop - kept_layers(opts, len(stage)))


def recomputed_layers(m: ModelShape, pp: int, opts: TrainOptions, hw: HwProfile | None = None) -> list[int]:
    """The decoder layers (global indices) that run a recomputed forward: every stage's recomputed_part under the
    plan's split (pipeline_split)."""
    sizes = [m.num_layers] if pp <= 1 else pipeline_split(m, pp, opts, hw)
    out, start = [], 0
    for n in sizes:
        out += list(recomputed_part(opts, range(start, start + n)))
        start += n
    return out


def head_pass_count(mode: str) -> float:
    """The head's time in logits-sized GEMMs: the fused head's three; the lean and naive heads' measured multiples."""
    return {"lean": LEAN_HEAD_PASSES, "naive": NAIVE_HEAD_PASSES}.get(mode, 3)


def flop_terms(m: ModelShape, opts: TrainOptions, pp: int = 1, hw: HwProfile | None = None
               ) -> tuple[dict[str, float], float, float, float]:
    """Section 2: forward FLOPs per token by part, model and hardware FLOPs per token, and the head's passes. `pp`
    and `hw` place the kept layers (keep_layers: the last of each stage of the plan's split) when some are."""
    f = forward_flops_per_token(m, opts.micro_batch_tokens)
    fwd = sum(f.values())
    # the FLOPs the hardware runs count the head's GEMMs: the fused head's eager path forms its gradients in the
    # forward, three GEMMs as unfused, the lean head four; its time (head_passes) also carries the lean and naive
    # heads' measured extra
    gemms = 4 if opts.lm_head == "lean" else 3
    layers_fwd = fwd - f["head"]
    if opts.recompute == "none":
        again = 0.0
    elif not opts.keep_layers:
        again = layers_fwd
    else:  # the recomputed layers' share of the layers' forward FLOPs
        per_layer = [sum(x for op, x in w.items() if op not in BYTE_TERMS)
                     for w in layer_work(m, opts.micro_batch_tokens)]
        again = layers_fwd * sum(per_layer[i] for i in recomputed_layers(m, pp, opts, hw)) / sum(per_layer)
    # DeepSeek sparse attention's indexer runs forward only (no gradient), again where its layer is recomputed unless
    # the layer keeps its selection
    idx = f.get("indexer", 0.0)
    if opts.keep_selections and layers_fwd:
        again -= idx * again / layers_fwd
    hw_flops_tok = 3 * layers_fwd - 2 * idx + again + gemms * f["head"]
    return f, 3 * fwd - 2 * idx, hw_flops_tok, head_pass_count(opts.lm_head)


def compute_work(m: ModelShape, layout: Layout, opts: TrainOptions, ep_path: bool = False,
                 hw: HwProfile | None = None) -> dict[str, float]:
    """The work of one micro-batch on one GPU by operation (section 5): hardware FLOPs of the routed experts'
    GEMMs, the other matmuls, attention's quadratic term, the delta rule and the head; the EP path's copied bytes
    and its passes through the MoE layers; and the count of layer passes (forward-equivalents: 4 a layer with full
    recompute, 3 without). TP splits the matmuls; under PP the GPU is one of the slowest stage's (slowest_stage on
    `hw`: its layers' share of each operation, the head only if it holds it), since every pipeline slot waits for
    that stage."""
    tp = layout.tp
    s = opts.micro_batch_tokens / layout.cp
    f, head_passes = forward_flops_per_token(m, opts.micro_batch_tokens), head_pass_count(opts.lm_head)
    c = param_counts(m)
    routed = 2 * c["routed_experts"] * m.top_k / m.num_experts
    stage, has_head = slowest_stage(m, layout.pp, opts, hw)
    again = recomputed_part(opts, stage)
    # each operation's passes over its share of the model's work: three (forward, backward at two) for every layer
    # of the stage, one more for those recomputed
    share, share_again = _stage_share(m, opts, stage), _stage_share(m, opts, again)
    mult = {op: 3 * share[op] + share_again[op] for op in share}
    index_again = 0 if opts.keep_selections else 1
    layers = s / tp
    # every MoE layer's experts do the same work, so the stage's share of their FLOPs is its share of each term
    experts = {k: mult["expert_gemm"] * m.num_moe_layers * w for k, w in expert_pass_work(m, s, layout).items()}
    work = {
        **experts,
        "dense_gemm": layers * (f["matmul_layers"] - routed) * mult["dense_gemm"],
        "dense_rows": layers * dense_row_bytes_all_layers(m) * mult["dense_rows"],
        "attention": layers * f["attention"] * attention_kernel_ratio(m, opts.micro_batch_tokens)
        * (sparse_attention_passes(m, tp, share["attention"], share_again["attention"]) if m.dsa is not None
           else mult["attention"]),
        "delta_rule": layers * f.get("linear_attention", 0.0) * mult["delta_rule"],
        # DSA's indexer: forward only, each tp rank's share of the queries against all keys, once a pass (the
        # recomputed forward's not where the layers keep their selections)
        "indexer": layers * f.get("indexer", 0.0) * (share["attention"] + index_again * share_again["attention"]),
        "index_rows": layers * (len(stage) + index_again * len(again)) * indexing_layers(m) / m.num_layers,
        "lm_head": s * head_passes * f["head"] / tp if has_head else 0.0,
        "ep_dispatch": 0.0,
        "ep_passes": 0.0,
        "ep_chunks": 0.0,
        "layer_passes": 3 * len(stage) + len(again),
    }
    if layout.ep > 1 or ep_path:
        # the rows the path copies (every chunk's pass through once, so the chunk count does not change them), and
        # its passes through each MoE layer: forward, the recomputed forward, backward, each with its route's count
        # exchange and host sync (docs/cost_model.md, "Step time from its parts")
        moe, moe_again = _stage_counts(m, stage)["moe"], _stage_counts(m, again)["moe"]
        work["ep_dispatch"] = ((moe - moe_again) * ep_copy_bytes(m, s, False, layout.ep)
                               + moe_again * ep_copy_bytes(m, s, True, layout.ep))
        work["ep_passes"] = 2 * moe + moe_again
        # and each pass's chunk loop: a fixed time per chunk beyond the first (its launches and index work)
        work["ep_chunks"] = work["ep_passes"] * (opts.ep_overlap_chunks - 1)
    return work


SHARED_OPS = ("dense_gemm", "dense_rows", "expert_gemm", "attention", "delta_rule")  # split over stages by layer


def _stage_share(m: ModelShape, opts: TrainOptions, stage: range) -> dict[str, float]:
    """The part of the model's work of each operation that the layers of `stage` do (1 each for the whole model)."""
    if len(stage) == m.num_layers:
        return dict.fromkeys(SHARED_OPS, 1.0)
    if not len(stage):
        return dict.fromkeys(SHARED_OPS, 0.0)
    return dict(_stage_share_of(m, opts.micro_batch_tokens, stage.start, stage.stop))


@functools.lru_cache(maxsize=4096)
def _stage_share_of(m: ModelShape, seq: float, start: int, stop: int) -> tuple[tuple[str, float], ...]:
    lw = layer_work(m, seq)
    out = []
    for op in SHARED_OPS:
        total = sum(w[op] for w in lw)
        out.append((op, sum(w[op] for w in lw[start:stop]) / total if total else 0.0))
    return tuple(out)


def _stage_counts(m: ModelShape, stage: range) -> dict[str, int]:
    """Layers of `stage` by kind: moe (routed), dense (a dense FFN), attention (full, sliding or chunked), linear."""
    kinds = [m.layer_types[i] for i in stage]
    dense = sum(1 for i in stage if m.is_dense_layer(i))
    return {"moe": len(stage) - dense, "dense": dense, "linear": kinds.count("linear_attention"),
            "attention": len(kinds) - kinds.count("linear_attention")}


def values_padded(vendor: str) -> bool:
    """Whether full attention's kernel takes values narrower than q·k (MLA's; MiMo-V2-Flash's) zero-padded to the
    q·k width (launch/model.py): on NVIDIA GPUs cuDNN's kernel takes v at its own width; the flash kernels elsewhere
    take one head size."""
    return vendor != "nvidia"


def model_widths(m: ModelShape, kind: str = "full_attention") -> tuple[int, int]:
    """(q·k, value) head widths of the model's `kind` attention layers (its full ones by default): MLA's d_nope +
    d_rope and d_v; else the layer's head size and value width (values narrower under MiMo-V2-Flash; Gemma 4's
    sliding layers narrower heads)."""
    if m.mla is not None:
        return m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim, m.mla.v_head_dim
    return m.head_dim_at(kind), m.value_width_at(kind)


def attention_widths(m: ModelShape, vendor: str = "nvidia", kind: str = "full_attention") -> tuple[int, int]:
    """(key, value) head widths a `kind` attention layer's kernel holds (the full layers' by default): the model's,
    or both at the wider one where the kernel pads v (`values_padded`). MiMo-V2-Flash's sliding layers (sinks, a
    window of 128) always pad; they are counted at the full layers' widths."""
    qk, vd = model_widths(m, kind)
    if vd != qk and values_padded(vendor):
        return (max(qk, vd),) * 2
    return qk, vd


def attention_kernel_work(m: ModelShape, vendor: str = "nvidia") -> float:
    """The attention kernel's work over the model's attention FLOPs: 1, or with v zero-padded to the q·k width,
    P·V at Q·Kᵀ's cost (DeepSeek-V3: 384 / 320)."""
    return sum(attention_widths(m, vendor)) / sum(model_widths(m))


def attention_width(m: ModelShape) -> int:
    """The widest head full attention keeps: the wider of the query-key and value widths (what memory is counted
    at where the kernel pads v to it)."""
    return max(model_widths(m))


def kernel_width(m: ModelShape, vendor: str = "nvidia") -> float:
    """The head width whose measured efficiency the attention kernel runs at: the head size; with v at its own
    width the mean of the q·k and v widths (Q·Kᵀ and P·V each take their share of the kernel's FLOPs)."""
    return sum(attention_widths(m, vendor)) / 2


def attention_efficiency(eff: float | dict[int, float], width: int | None) -> float:
    """The attention efficiency at a head width: one figure as it is; by width, linear between the two measured
    widths around it and the nearest one's outside them (their mean without a width)."""
    if not isinstance(eff, dict):
        return eff
    if width is None:
        return sum(eff.values()) / len(eff)
    ws = sorted(eff)
    if width <= ws[0] or width >= ws[-1]:
        return eff[ws[0] if width <= ws[0] else ws[-1]]
    hi = next(w for w in ws if w >= width)
    lo = max(w for w in ws if w <= width)
    return eff[lo] if hi == lo else eff[lo] + (eff[hi] - eff[lo]) * (width - lo) / (hi - lo)


def attention_rate(peak: float, eff: float | dict[int, float], m: ModelShape | None, vendor: str) -> float:
    """Model attention FLOP/s: the peak at the kernel's head-width efficiency, over the kernel's work per model FLOP
    (MLA's padded v, where the kernel pads it)."""
    if m is None:
        return peak * attention_efficiency(eff, None)
    return peak * attention_efficiency(eff, kernel_width(m, vendor)) / attention_kernel_work(m, vendor)


def rates(hw: HwProfile, m: ModelShape | None = None) -> dict[str, float]:
    """FLOP/s (or bytes/s) each operation runs at on `hw`, and the fixed seconds per layer pass: the profile's
    measured efficiencies, or, without them, every matmul at compute_efficiency, the optimizer at HBM_EFFICIENCY
    of the bandwidth and no per-layer or EP-copy time (the assumption every profile made before measurement)."""
    peak, hbm = hw.peak_bf16_tflops * 1e12, hw.hbm_bw_tb_s * 1e12
    e = hw.efficiency
    dsa = {"indexer": float("inf"), "index_rows": 0.0}
    if m is not None and m.dsa is not None:
        dsa = {"indexer": index_pair_flops(m) / index_pair_seconds(m, hw),
               "index_rows": INDEX_ROW_S, "attention": peak * SPARSE_BACKWARD_EFFICIENCY}
    elif m is not None and (m.compressed is not None or m.block_sparse is not None):  # DeepSeek-V4's indexer (DSA's
        # kernels on compressed keys), MiniMax-M3's (its scores pooled by block): DSA's kernels' rates, assumed
        dsa = {"indexer": index_pair_flops(m) / index_pair_seconds(m, hw), "index_rows": INDEX_ROW_S}
    out = {**_rates(hw, m, peak, hbm, e), **dsa}
    if m is not None and m.linear_attn is not None and m.linear_attn.kind == "kda":
        out["delta_rule"] *= KDA_RULE_RATE
    return out


def _rates(hw: HwProfile, m: ModelShape | None, peak: float, hbm: float, e) -> dict[str, float]:
    if e is None:
        r = peak * hw.compute_efficiency
        return {"expert_gemm": r, "expert_rows": float("inf"), "expert_weights": float("inf"), "dense_gemm": r,
                "dense_rows": float("inf"),
                "attention": attention_rate(peak, hw.compute_efficiency, m, hw.vendor), "delta_rule": r, "lm_head": r,
                "optimizer": hbm * HBM_EFFICIENCY, "ep_dispatch": float("inf"), "ep_passes": 0.0,
                "ep_chunks": EP_CHUNK_MS_ASSUMED * 1e-3, "layer_passes": 0.0}
    inf = float("inf")
    return {"expert_gemm": peak * e.expert_gemm,
            "expert_rows": hbm * e.expert_rows if e.expert_rows else inf,
            "expert_weights": hbm * e.expert_weights if e.expert_weights else inf,
            "dense_gemm": peak * e.dense_gemm, "dense_rows": hbm * e.dense_rows if e.dense_rows else inf,
            "attention": attention_rate(peak, e.attention, m, hw.vendor),
            "delta_rule": peak * e.delta_rule, "lm_head": peak * e.lm_head, "optimizer": hbm * e.optimizer,
            "ep_dispatch": hbm * e.ep_dispatch, "ep_passes": e.ep_latency_ms * 1e-3,
            "ep_chunks": e.ep_chunk_ms * 1e-3, "layer_passes": e.layer_latency_ms * 1e-3}


# counted in passes (the indexer: in query rows, each pass), charged a fixed time each
PASS_TERMS = ("layer_passes", "ep_passes", "ep_chunks", "index_rows")


PER_TOKEN_TERMS = ("expert_gemm", "expert_rows", "dense_gemm", "attention", "delta_rule", "lm_head", "indexer")


def tokens_per_s_bound(m: ModelShape, hw: HwProfile, opts: TrainOptions) -> float:
    """An upper bound on any layout's tokens/s per GPU for these options: the micro-batch's tokens over the time of
    the work whose share per token no split lowers (PER_TOKEN_TERMS at tp = cp = pp = ep = 1: TP and CP divide both
    the work and the tokens a GPU holds, as PP divides the layers), with no exchange, no fixed time per pass, no
    expert weight reads (which EP makes cheaper per token) and no optimizer (which more GPUs make cheaper)."""
    t = compute_times(compute_work(m, Layout(), opts, hw=hw), hw, m)
    return opts.micro_batch_tokens / sum(t[k] for k in PER_TOKEN_TERMS)


def compute_times(work: dict[str, float], hw: HwProfile, m: ModelShape | None = None) -> dict[str, float]:
    """Seconds of each operation in compute_work: work over its rate (the PASS_TERMS times their latency); `m` sets
    attention's head width."""
    r = rates(hw, m)
    return {k: (w * r[k] if k in PASS_TERMS else (w / r[k] if w else 0.0)) for k, w in work.items()}


def delta_rule_flops_per_token_head(la) -> float:
    """Forward FLOPs of the plain chunked delta rule per token and value head: Gated DeltaNet's 6·d_k·d_v +
    4·C·(d_k + d_v); Kimi Delta Attention adds what its decay per key channel costs
    (`kda_decay_flops_per_token_head`)."""
    k, v, c = la.head_k_dim, la.head_v_dim, la.chunk_size
    plain = 6 * k * v + 4 * c * (k + v)
    return plain + kda_decay_flops_per_token_head(la) if la.kind == "kda" else plain


def kda_decay_flops_per_token_head(la) -> float:
    """What Kimi Delta Attention's decay per key channel adds to the chunked rule, per token and head (a decay per
    head, Gated DeltaNet's, scales whole rows and costs next to nothing): the in-chunk cumulative sum of the log
    decays, d_k; in the C × C × d_k decayed products k·k and q·k, the decay e^(G_i − G_j) of each pair and channel
    (a subtraction and an exponential) and one more multiply in each product, 4·C·d_k; q and β·k decayed from the
    chunk's start before they read the state, 3·d_k; the state decayed to the chunk's end, d_k·d_v/C, and the keys
    that write it, 3·d_k. 4·C·d_k + 7·d_k + d_k·d_v/C (docs/cost_model.md, section 2)."""
    k, v, c = la.head_k_dim, la.head_v_dim, la.chunk_size
    return 4 * c * k + 7 * k + k * v / c


def cp_combine_seconds(s: float, num_v_heads: float, la, cp: int, rate: float) -> float:
    """One forward-equivalent of CP's Gated DeltaNet combine on one rank and layer, in seconds: its FLOPs
    (cp_delta_rule_flops) at CP_COMBINE_EFFICIENCY of the delta rule's rate, plus CP_COMBINE_PASSES_PER_DOUBLING
    of a plain pass over the rank's s tokens per doubling of cp (both measured, see the constants)."""
    extra = cp_delta_rule_flops(s, num_v_heads, la.head_k_dim, la.head_v_dim, la.chunk_size, cp)
    plain = s * num_v_heads * delta_rule_flops_per_token_head(la)
    return (extra / CP_COMBINE_EFFICIENCY + CP_COMBINE_PASSES_PER_DOUBLING * math.log2(cp) * plain) / rate


def cp_delta_rule_flops(s: float, num_v_heads: float, k: int, v: int, chunk: int, cp: int) -> float:
    """Forward FLOPs one rank adds per Gated DeltaNet layer for CP's exact combine, beyond the plain chunked rule
    over its s tokens (per token and value head that rule costs 6·K·V + 4·C·(K + V), forward_flops_per_token): the
    augmented pass at value width V + K, 6·K² + 4·C·K more; completing the outputs, O_0 + Q_eff S_in, 2·K·V; and
    the fold of the 2·cp segment maps, 2·cp − 1 products [K×K]·[K×V] per head."""
    return s * num_v_heads * (6 * k * k + 4 * chunk * k + 2 * k * v) + (2 * cp - 1) * num_v_heads * 2 * k * k * v


def communication_terms(m: ModelShape, hw: HwProfile, world: int, layout: Layout, opts: TrainOptions
                        ) -> tuple[dict[str, float], dict[str, float]]:
    """Section 3 (and 4's overlap): bytes per micro-batch per GPU by exchange, and the seconds each costs the
    critical path (EP: what chunked overlap does not hide; FSDP: its whole traffic time, hidden later under the
    micro-batch's work)."""
    pp, tp, cp, ep, etp = layout.pp, layout.tp, layout.cp, layout.ep, layout.etp
    dp, edp = layout.dp(world), layout.edp(world)
    node = gpus_per_node_used(hw, world)
    s = opts.micro_batch_tokens / cp
    stage, _ = slowest_stage(m, pp, opts, hw)  # every pipeline slot waits for the slowest stage's exchanges
    n, again = _stage_counts(m, stage), _stage_counts(m, recomputed_part(opts, stage))
    # each kind of layer's passes: forward and backward, and the recomputed forward of those recomputed
    passes = {k: 2 * n[k] + again[k] for k in n}
    r = rates(hw)
    comm, t = {}, {}
    # EP all-to-all, per MoE layer: 4 transfers over its passes, 5 recomputed (ep_transfers), less what chunked
    # overlap hides under the expert GEMMs
    t_a2a, t_gemm, _ = ep_layer_times(m, hw, world, layout, opts)
    chunks = opts.ep_overlap_chunks if ep > 1 else 1
    kinds = [(again["moe"], ep_transfers(True, m.moe_output_saved)), (n["moe"] - again["moe"], ep_transfers(False))]
    t["ep_exposed"] = sum(k * ep_exposed_time(t_a2a, t_gemm, x, chunks) for k, x in kinds)
    comm["ep_all_to_all"] = sum(k * sum(x) for k, x in kinds) * ep_transfer_bytes(m, s, ep)
    # CP: full attention all-gathers K/V (MLA its latent) and reduce-scatters their gradients; Gated DeltaNet passes
    # its state
    t["cp"] = 0.0
    if cp > 1:
        bw = group_bw(hw, cp, tp, node)
        kv_tok = (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim if m.mla else compressed_cp_row(m, s)
                  if m.compressed is not None else 2 * m.mean_kv_width / tp)
        cp_bytes = passes["attention"] * s * (cp - 1) * kv_tok * BF16
        if m.dsa is not None:  # and the index keys, gathered in each forward pass (no gradient)
            cp_bytes += (n["attention"] + again["attention"]) * s * (cp - 1) * m.dsa.index_head_dim * BF16
        if m.block_sparse is not None:  # MiniMax-M3's block-sparse layers' index keys likewise
            cp_bytes += ((n["attention"] + again["attention"]) * indexing_layers(m) / m.num_attention_layers * s
                         * (cp - 1) * m.block_sparse.index_head_dim * BF16)
        t_combine = 0.0
        if m.mla is not None and m.dsa is None:  # DSA attends in the absorbed form: nothing expanded
            # MLA all-gathers the latent, and each rank expands the other ranks' (cp − 1)·s tokens to keys and values
            # too (kv_b_proj: forward, its backward's two GEMMs, and the recomputed forward)
            a = m.mla
            expand = 2 * a.kv_lora_rank * m.num_heads / tp * (a.qk_nope_head_dim + a.v_head_dim) * s * (cp - 1)
            t_combine += (3 * n["attention"] + again["attention"]) * expand / r["dense_gemm"]
        if m.linear_attn is not None:
            # Gated DeltaNet, exact segment combine (docs/context_parallel.md): one delta-rule pass at value
            # width V + K gives each local segment's outputs and outgoing state as affine functions of its incoming
            # state; the maps [B | M] (and the conv halos) are all-gathered, folded locally, and the outputs
            # completed. Extra per layer: that pass's width beyond the plain pass, the completion and the fold at
            # their measured share of the delta rule's rate, the maps' and halos' bytes, and the latency of the two
            # collectives.
            la = m.linear_attn
            nv = la.num_v_heads / tp
            maps = 2 * nv * la.head_k_dim * (la.head_v_dim + la.head_k_dim) * FP32  # a rank's two segments
            halo = (la.conv_kernel - 1) * (2 * la.num_k_heads * la.head_k_dim + la.num_v_heads * la.head_v_dim) / tp
            cp_bytes += passes["linear"] * (cp - 1) * (maps + 2 * halo * BF16)
            t_combine += ((passes["linear"] + n["linear"]) * cp_combine_seconds(s, nv, la, cp, r["delta_rule"])
                          + passes["linear"] * 2 * COLLECTIVE_LATENCY_S)
        comm["cp"] = cp_bytes
        t["cp"] = cp_bytes / bw + t_combine
    # TP with sequence parallel: per layer an all-gather and a reduce-scatter around the mixer, and around a dense
    # FFN (split like a mixer); the MoE runs on each rank's sequence-parallel tokens with no collective of its own
    t["tp"] = 0.0
    if tp > 1:
        split_passes = passes["moe"] + 2 * passes["dense"]  # a mixer each layer, and a dense FFN's
        tp_bytes = split_passes * 2 * s * m.hidden_size * BF16 * (tp - 1) / tp
        if m.dsa is not None:  # each DSA indexer pass all-gathers the ranks' selections (int32, topk a query)
            selecting = n["attention"] + (0 if opts.keep_selections else again["attention"])
            tp_bytes += (selecting * indexing_layers(m) / m.num_full_attn_layers * s * m.dsa.topk * 4
                         * (tp - 1) / tp)
        comm["tp"] = tp_bytes
        t["tp"] = tp_bytes / group_bw(hw, tp, 1, node)
    # FSDP2: all-gather bf16 params in forward and again in backward, reduce-scatter fp32 grads; overlapped
    dense, experts, ends = stage_params(m, pp)
    fsdp_dense = (dense + ends) / tp * (dp * cp - 1) / (dp * cp) * (2 * BF16 + FP32)
    fsdp_expert = experts / (ep * etp) * (edp - 1) / edp * (2 * BF16 + FP32)
    comm["fsdp"] = fsdp_dense + fsdp_expert
    t["fsdp"] = fsdp_dense / group_bw(hw, dp * cp, tp, node) + fsdp_expert / group_bw(hw, edp, ep * etp, node)
    # PP: activations to the next stage and gradients back
    t["pp"] = 0.0
    if pp > 1:
        pp_bytes = 2 * s * residual_width(m) * BF16 / tp
        comm["pp"] = pp_bytes
        t["pp"] = pp_bytes / group_bw(hw, pp, world // pp, node)
    return comm, t


def step_time(compute: dict[str, float], comm_t: dict[str, float], layout: Layout, opts: TrainOptions,
              t_opt: float) -> tuple[float, dict[str, float]]:
    """Section 5: the step from one micro-batch's compute and exchanges, the pipeline bubble and the optimizer;
    and its parts (they sum to the step)."""
    t_compute_mb = sum(compute.values())
    t_mb_serial = t_compute_mb + comm_t["ep_exposed"] + comm_t["cp"] + comm_t["tp"] + comm_t["pp"]
    t_mb = max(t_mb_serial, comm_t["fsdp"])  # FSDP2 prefetch hides its traffic under the layer compute
    mb = opts.micro_batches
    t_bubble = t_mb * (layout.pp - 1)  # 1F1B: (p−1) extra slots over m micro-batches, (p−1)/(m+p−1) of the step
    step = t_mb * mb + t_bubble + t_opt
    parts = {"compute": t_compute_mb * mb, "ep_exposed": comm_t["ep_exposed"] * mb, "cp": comm_t["cp"] * mb,
             "tp": comm_t["tp"] * mb, "pp_p2p": comm_t["pp"] * mb,
             "fsdp_exposed": max(0.0, comm_t["fsdp"] - t_mb_serial) * mb, "pp_bubble": t_bubble,
             "optimizer": t_opt}
    return step, parts


def estimate(m: ModelShape, hw: HwProfile, world: int, layout: Layout, opts: TrainOptions, *,
             ep_path: bool = False) -> Estimate:
    """Memory, FLOPs, communication and step time of one configuration. `ep_path` charges the expert-parallel
    code path even at ep = 1 (what the calibration grid measures at world size 1); it runs whenever ep > 1."""
    mem, head_own, unfused = memory_terms(m, hw, world, layout, opts, ep_path)
    total = sum(mem.values())
    memory_gb = {k: v / GB for k, v in mem.items()}
    memory_gb["total"] = total / GB
    memory_gb["usable"] = hw.usable_gb

    f, model_flops_tok, hw_flops_tok, _ = flop_terms(m, opts, layout.pp, hw)
    compute = compute_times(compute_work(m, layout, opts, ep_path, hw), hw, m)
    comm, comm_t = communication_terms(m, hw, world, layout, opts)
    t_opt = (local_param_count(m, world, layout, stage_layers(m, layout.pp, opts, hw)) * ADAM_BYTES_MOVED
             / rates(hw)["optimizer"])
    step, time_parts = step_time(compute, comm_t, layout, opts, t_opt)
    mb = opts.micro_batches

    tokens_step_per_gpu = opts.micro_batch_tokens / layout.cp * mb / (layout.tp * layout.pp)
    tok_s = tokens_step_per_gpu / step
    peak = hw.peak_bf16_tflops * 1e12
    hw_tflops = tok_s * hw_flops_tok / 1e12
    model_tflops = tok_s * model_flops_tok / 1e12
    for k in comm:
        comm[k] *= mb
    fwd = sum(f.values())
    return Estimate(
        memory_gb=memory_gb, lm_head_unfused_gb=unfused / GB, fits=total / GB <= hw.usable_gb, step_time_s=step,
        time_s=time_parts, tokens_per_s_per_gpu=tok_s, tflops_per_gpu=hw_tflops,
        mfu_hardware=hw_tflops * 1e12 / peak, mfu_model=model_tflops * 1e12 / peak,
        flops_per_token={"forward": fwd, "model": model_flops_tok, "hardware": hw_flops_tok, **f},
        comm_bytes=comm, lm_head_own_gb=head_own / GB, compute_s={k: v * mb for k, v in compute.items()},
    )


def dense_matmuls(m: ModelShape, kind: str, moe: bool) -> list[tuple[int, int]]:
    """(in, out) widths of one layer's dense matmuls (the mixer's projections; the router and shared expert of a MoE
    layer, or a dense FFN), each a token's GEMM row: 2·in·out FLOPs, in + out activations read and written."""
    h = m.hidden_size
    if kind == "linear_attention" and m.linear_attn.kind == "kda":
        mixer = kda_projections(m.linear_attn, h)
    elif kind == "linear_attention":
        la = m.linear_attn
        kd, vd = la.num_k_heads * la.head_k_dim, la.num_v_heads * la.head_v_dim
        mixer = [(h, 2 * kd + vd), (h, vd), (h, la.num_v_heads), (h, la.num_v_heads), (vd, h)]
    elif m.compressed is not None:  # DeepSeek-V4
        mixer = [(i, o) for i, o, _, _ in compressed_projections(m, kind)]
    elif m.mla is not None:
        a = m.mla
        qk = m.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
        if a.query_gate:  # A.X K2: the query and its output gate from both q latents
            q = [(h, a.q_lora_rank), (2 * a.q_lora_rank, qk + m.num_heads * a.v_head_dim)]
        else:
            q = [(h, a.q_lora_rank), (a.q_lora_rank, qk)] if a.q_lora_rank else [(h, qk)]
        mixer = q + [(h, a.kv_lora_rank + a.qk_rope_head_dim),
                     (a.kv_lora_rank, m.num_heads * (a.qk_nope_head_dim + a.v_head_dim)),
                     (m.num_heads * a.v_head_dim, h)]
    else:
        heads, kv_heads, hd, vw = m.heads_at(kind), m.kv_heads_at(kind), m.head_dim_at(kind), m.value_width_at(kind)
        q_out = heads * hd * (2 if m.attn_output_gate else 1)
        v = [] if m.keys_as_values and kind == "full_attention" else [(h, kv_heads * vw)]  # Gemma 4's: v is k
        mixer = [(h, q_out), (h, kv_heads * hd)] + v + [(heads * vw, h)] + ([(h, heads)] if m.head_gate else [])
    if not moe:
        return mixer + [(h, m.dense_ffn), (h, m.dense_ffn), (m.dense_ffn, h)]
    shared = [(h, m.shared_expert_ffn)] * 2 + [(m.shared_expert_ffn, h)] if m.shared_expert_ffn else []
    return mixer + [(h, m.num_experts)] + shared + ([(h, 1)] if m.shared_expert_ffn and m.shared_expert_gate else [])


def sink_merge_row_bytes(m: ModelShape, kind: str) -> int:
    """Bytes a token's sink merge moves in one pass of a layer of `kind`: SINK_MERGE_BYTES a value of the output of a
    full-attention layer with sinks (a sliding layer's merge is in its window fit), else none."""
    return (SINK_MERGE_BYTES * m.heads_at(kind) * m.head_dim_at(kind) if kind == "full_attention" and m.sinks_at(kind)
            else 0)


def dense_row_bytes(m: ModelShape, kind: str, moe: bool) -> int:
    """Bytes a token moves through one layer's dense matmuls in one pass: every one's input and output row in bf16
    (`dense_matmuls`), the scale of the norms, activations and residual adds around them too; and a full-attention
    layer's sink merge (`sink_merge_row_bytes`)."""
    return BF16 * sum(k + n for k, n in dense_matmuls(m, kind, moe)) + sink_merge_row_bytes(m, kind)


@functools.lru_cache(maxsize=1024)
def dense_row_bytes_all_layers(m: ModelShape) -> int:
    """`dense_row_bytes` summed over the model's layers (the solver asks for it for every layout it weighs)."""
    return sum(dense_row_bytes(m, kind, not m.is_dense_layer(i)) for i, kind in enumerate(m.layer_types))


# ---- pipeline stages -----------------------------------------------------------------------------------------
def layer_work(m: ModelShape, seq: float) -> list[dict[str, float]]:
    """Forward FLOPs per token of each decoder layer, by the operation whose rate it runs at (rates): dense_gemm
    (the mixer's projections; the router and the shared expert, or a dense FFN), expert_gemm (top-k routed experts),
    attention (the quadratic term over seq/2 keys, or the keys a windowed kernel scores) and delta_rule (Gated
    DeltaNet's chunked rule, linear in seq); and the routed experts' bytes per token (expert_rows, expert_weights:
    `expert_pass_work` over seq tokens, ep = 1), which FLOP counts leave out."""
    from .models import _full_attention_params, _linear_attention_params

    f = forward_flops_per_token(m, seq)
    h = m.hidden_size
    swiglu = 3 * h
    shared = (swiglu * m.shared_expert_ffn + (h if m.shared_expert_gate else 0)) if m.shared_expert_ffn else 0
    per_expert = swiglu * m.expert_ffn + ((2 * m.expert_ffn + h) if m.arch == "gpt_oss" else 0)
    full_ctx, slide_ctx = attention_keys(m, seq, kernel=True)
    out = []
    experts = {k: v / seq for k, v in expert_pass_work(m, seq, Layout()).items() if k != "expert_gemm"}
    for i, kind in enumerate(m.layer_types):
        w = {"dense_gemm": 0.0, "expert_gemm": 0.0, "attention": 0.0, "delta_rule": 0.0, "expert_rows": 0.0,
             "expert_weights": 0.0, "dense_rows": dense_row_bytes(m, kind, not m.is_dense_layer(i))}
        if m.is_dense_layer(i):
            w["dense_gemm"] += 2 * swiglu * m.dense_ffn
        else:
            w["dense_gemm"] += 2 * (h * m.num_experts + shared)
            w["expert_gemm"] += 2 * per_expert * m.top_k
            w.update(experts)
        if kind == "linear_attention":
            w["dense_gemm"] += 2 * _linear_attention_params(m)
            w["delta_rule"] += f["linear_attention"] / m.num_linear_attn_layers
        elif m.compressed is not None:  # DeepSeek-V4: K = V on the window and the compressed entries
            w["dense_gemm"] += 2 * _full_attention_params(m, kind)
            w["attention"] += 2 * m.num_heads * 2 * m.head_dim * compressed_keys(m, seq, kind)
            if kind == "compressed_sparse_attention":
                w["indexer"] = index_pair_flops(m) * compressed_entries(m.compressed.csa_rate, seq)
        else:
            qk = model_widths(m, kind)
            w["dense_gemm"] += 2 * _full_attention_params(m, kind)
            ctx = {"full_attention": full_ctx, "chunked_attention": chunk_keys(m, seq)}.get(kind, slide_ctx)
            if m.dsa is not None:  # absorbed, on the selected keys; the indexer's scores
                qk, ctx = (2 * m.mla.kv_lora_rank + m.mla.qk_rope_head_dim,), sparse_keys(m, seq)
                if i not in m.dsa.shared_layers:
                    w["indexer"] = index_pair_flops(m) * seq / 2
            w["attention"] += 2 * m.heads_at(kind) * sum(qk) * ctx
        out.append(w)
    return out


def stage_costs(m: ModelShape, seq: float, opts: TrainOptions, hw: HwProfile | None = None
                ) -> tuple[list[float], float, float]:
    """What each pipeline stage's share of a step costs per token (forward, the recomputed forward under full
    recompute, backward): ([each decoder layer], embedding, head with its loss). With a profile, in seconds: each
    operation of layer_work at its rate on `hw` and the per-layer-pass latency spread over the micro-batch's `seq`
    tokens — Gated DeltaNet's chunked rule runs at a far lower rate than attention or the GEMMs, so FLOPs alone would
    load the stages unevenly in time. Without one, in hardware FLOPs. The embedding is a lookup (0); the head is
    `head_passes` logits-sized GEMMs, as in estimate."""
    return _stage_costs(m, seq, opts, rates(hw, m) if hw is not None else None)


def _stage_costs(m: ModelShape, seq: float, opts: TrainOptions, r: dict[str, float] | None
                 ) -> tuple[list[float], float, float]:
    passes = forward_equivalents(opts)
    index_passes = 1 if opts.keep_selections else passes - 2  # the indexer: forward passes only
    costs = []
    for w in layer_work(m, seq):
        n = {op: index_passes if op == "indexer" else passes for op in w}
        if m.dsa is not None and r is not None:  # its forward and backward at their own rates
            n["attention"] = sparse_attention_passes(m, 1, 1, passes - 3)
        if r is None:
            costs.append(sum(n[op] * x for op, x in w.items() if op not in BYTE_TERMS))
        else:
            costs.append(sum(n[op] * x / r[op] for op, x in w.items() if x) + passes * r["layer_passes"] / seq
                         + index_passes * r["index_rows"] * ("indexer" in w))
    head = head_pass_count(opts.lm_head) * forward_flops_per_token(m, seq)["head"]
    return costs, 0.0, head if r is None else head / r["lm_head"]


def slowest_stage(m: ModelShape, pp: int, opts: TrainOptions, hw: HwProfile | None = None
                  ) -> tuple[range, bool]:
    """The layers of the pipeline stage with the most work per micro-batch under the plan's split (pipeline_split),
    and whether it holds the head: in steady state every stage waits for it, so it sets the time of a pipeline
    slot. With pp = 1, every layer and the head."""
    if pp <= 1:
        return range(m.num_layers), True
    start, stop, has_head = _slowest_stage(m, pp, opts, _rate_key(hw, m))
    return range(start, stop), has_head


@functools.lru_cache(maxsize=4096)
def _slowest_stage(m: ModelShape, pp: int, opts: TrainOptions, rate_key) -> tuple[int, int, bool]:
    # every estimate under pp asks (compute_work, communication_terms): remember it, as _pipeline_split
    whole = _split_options(opts, m)
    sizes = _pipeline_split(m, pp, whole, rate_key)
    costs, first, last = _stage_costs(m, opts.micro_batch_tokens, whole, None if rate_key is None else dict(rate_key))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    # a kept layer (keep_layers, 0 without recompute) runs 3 of a recomputed layer's 4 passes (every layer kept: the
    # costs are no recompute's already)
    kept = opts.keep_layers if whole.recompute == opts.recompute else 0
    totals = [sum(costs[a:a + n]) - sum(costs[a + n - min(kept, n):a + n]) / 4
              + (first if i == 0 else 0.0) + (last if i == len(sizes) - 1 else 0.0)
              for i, (a, n) in enumerate(zip(starts, sizes))]
    i = max(range(len(sizes)), key=lambda k: totals[k])
    return starts[i], starts[i] + sizes[i], i == len(sizes) - 1


def split_stages(layer_costs: list[float], stages: int, first: float = 0.0, last: float = 0.0) -> list[int]:
    """Layers per pipeline stage: `stages` contiguous, non-empty runs of layers, in order, whose largest cost (the
    first run's plus `first`, the last run's plus `last`) is the smallest possible; on a tie each stage starts as
    late as it can (the later stages, the head's among them, hold fewer layers). Exact (dynamic programming over
    the cut points, O(stages·layers²)).

    Example: costs [1, 1, 1, 3, 1, 1, 1, 3] (a full-attention layer after every three Gated DeltaNet layers costing a
    third as much), 2 stages and a head costing 2 on the last: cutting after 5 layers gives 7 and 5 + 2 = 7, after 4
    gives 6 and 8: [5, 3].

    The cut search is a binary search: for a stage ending at layer j, the earlier stages' best largest cost over layers
    0..i-1 does not fall as i grows and this stage's own cost over i..j-1 does not rise, so the cost of cutting at i
    (the larger of the two) falls, then rises, in i, and its minimum sits where the two cross. O(stages·layers·log
    layers), the same cuts as trying every i from the latest down (tests/test_pipeline.py checks the two agree)."""
    n = len(layer_costs)
    if stages < 1 or stages > n:
        raise ValueError(f"{stages} pipeline stages for {n} layers: every stage needs at least one layer")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def run(a: int, b: int) -> float:  # layers a..b-1 as stage s
        return prefix[b] - prefix[a]

    inf = float("inf")
    # best[s][j]: the smallest largest cost of layers 0..j-1 in stages 0..s; cut[s][j]: where stage s starts
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        best[0][j] = first + run(0, j)
    for s in range(1, stages):
        before = best[s - 1]
        for j in range(s + 1, n + 1) if s < stages - 1 else (n,):  # the last stage ends at n
            extra = last if s == stages - 1 else 0.0
            lo, hi = s, j - 1  # the cut i: this stage holds layers i..j-1
            a, b = lo, hi + 1  # the first i at which the earlier stages cost at least this one (hi + 1: none)
            while a < b:
                mid = (a + b) // 2
                if before[mid] >= run(mid, j) + extra:
                    b = mid
                else:
                    a = mid + 1
            over = before[a] if a <= hi else inf  # cutting at i >= a costs before[i], least at i = a
            under = run(a - 1, j) + extra if a - 1 >= lo else inf  # cutting at i < a costs this stage's, least at a - 1
            if over <= under:  # on a tie the latest cut: the last i whose earlier stages still cost `over`
                a2, b2 = a, hi
                while a2 < b2:
                    mid = (a2 + b2 + 1) // 2
                    if before[mid] <= over:
                        a2 = mid
                    else:
                        b2 = mid - 1
                best[s][j], cut[s][j] = over, a2
            else:
                best[s][j], cut[s][j] = under, a - 1
    if stages == 1:
        return [n]
    sizes, j = [], n
    for s in range(stages - 1, 0, -1):
        i = cut[s][j]
        sizes.append(j - i)
        j = i
    sizes.append(j)
    return sizes[::-1]


def pipeline_split(m: ModelShape, stages: int, opts: TrainOptions, hw: HwProfile | None = None) -> list[int]:
    """Layers per pipeline stage for `stages` stages (pp·virtual stages), balanced by stage_costs at the plan's
    micro-batch (in time on `hw`; in FLOPs without a profile): what `recipe solve` records as the plan's
    `train.pp_stages` and what the trainer builds. Under recompute the split balances every layer recomputed: the
    kept layers (keep_layers) are the same number at the end of every stage, so they leave it about as balanced."""
    return list(_pipeline_split(m, stages, _split_options(opts, m), _rate_key(hw, m)))


def _split_options(opts: TrainOptions, m: ModelShape) -> TrainOptions:
    """The options a pipeline split is balanced under: keep_layers left out (every layer counted recomputed), so
    the split and its cache entry are one for every kept-layer count; keeping every layer of the model is no
    recompute, balanced as such."""
    if not opts.keep_layers:
        return opts
    if opts.keep_layers >= m.num_layers:
        return opts.model_copy(update={"keep_layers": 0, "recompute": "none"})
    return opts.model_copy(update={"keep_layers": 0})


def _rate_key(hw: HwProfile | None, m: ModelShape):
    """A profile's rates for `m` as a hashable key (the pipeline caches' key: the split depends on nothing else of
    it)."""
    return None if hw is None else tuple(sorted(rates(hw, m).items()))


@functools.lru_cache(maxsize=4096)
def _pipeline_split(m: ModelShape, stages: int, opts: TrainOptions, rate_key) -> tuple[int, ...]:
    # the solver asks for the same split for every layout it weighs (memory_terms, stage_layers): remember it
    costs, first, last = _stage_costs(m, opts.micro_batch_tokens, opts, None if rate_key is None else dict(rate_key))
    if m.dsa is None or not m.dsa.shared_layers:
        return tuple(split_stages(costs, stages, first, last))
    # DeepSeek sparse attention's shared layers stay on their source's stage (launch/model.py hands the selection
    # over in-process): split whole groups, an indexing layer and the shared layers after it
    groups = m.dsa.selection_groups(m.num_layers)
    if len(groups) < stages:
        return tuple(split_stages(costs, stages, first, last))
    counts = split_stages([sum(costs[i] for i in g) for g in groups], stages, first, last)
    out, g = [], 0
    for c in counts:
        out.append(sum(len(groups[j]) for j in range(g, g + c)))
        g += c
    return tuple(out)


