"""Worker for tests/test_parallel.py: every layout case of one world size in one spawned process group (gloo on CPU;
NCCL on one GPU a rank when bench/bench_parity_nccl.py runs it with device "cuda", in fp32 or bf16).

Each case runs the same steps under the layout on every rank (FSDP2 / expert parallel / context parallel: each
data-parallel rank its share of the micro-batches, each cp rank its zigzag shard of them) and, once per data variant,
on rank 0 alone as one process (the reference: the whole step's micro-batches, no process group). Rank 0 writes, per
case, the largest relative differences of every step's loss, of step 1's other metrics and of every gradient after
step 1 (full tensors gathered from the shards), plus the expert loads the EP path saw and what the CP shards held.

A case is [name, dp, ep, ep_overlap_chunks], or [name, dp, ep, ep_overlap_chunks, cp, variant[, recompute[, tp]]]
(`variant` picks the data and loss: VARIANTS), or [name, "pieces", cp] for the CP exchanges alone in fp64
(run_pieces, cp = world), or [name, "memory"] for the run's memory figures, each reduced to its largest over ranks.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import types
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn


# The cases of each world size: [name, dp, ep, ep_overlap_chunks[, cp, variant[, recompute[, tp[, pp[, pp_stages]]]]]]
# or [name, "pieces", cp]; recompute "full", "none", "keepN" (full, the last N layers of each stage kept) or "keepsel"
# (full, DeepSeek sparse attention's selections kept for the recomputed forward). Worlds 2
# and 4 are tests/test_parallel.py's; 1 and 8 are for bench/bench_parity_nccl.py.
CASES = {
    1: [["one_rank", 1, 1, 1], ["one_rank_cp_data", 1, 1, 1, 1, "cp_off"], ["one_rank_dense", 1, 1, 1, 1, "dense"]],
    2: [["dp2", 2, 1, 1], ["ep2_k1", 2, 2, 1], ["ep2_k2", 2, 2, 2], ["ep2_k4", 2, 2, 4],
        ["ep2_k2_no_recompute", 2, 2, 2, 1, "base", "none"], ["ep2_k2_keep1", 2, 2, 2, 1, "base", "keep1"],
        ["cp2", 1, 1, 1, 2, "cp"], ["pieces_cp2", "pieces", 2],
        ["tp2", 1, 1, 1, 1, "cp", "full", 2], ["tp2_ep2", 1, 2, 2, 1, "cp_off", "full", 2],
        # two stages of 3 and 1 layers, off-policy, sequence-mean
        ["pp2", 1, 1, 1, 1, "cp_off", "full", 1, 2, [3, 1]],
        ["pp2_v2", 1, 1, 1, 1, "cp", "full", 1, 2, [1, 1, 1, 1]],  # interleaved: 2 virtual stages a rank
        ["dense_dp2", 2, 1, 1, 1, "dense"], ["max_over_ranks", "memory"],
        ["mla_cp2", 1, 1, 1, 2, "mla"], ["mla_tp2_ep2", 1, 2, 2, 1, "mla", "full", 2],
        ["oss_ep2", 2, 2, 2, 1, "oss"], ["oss_tp2_ep2", 1, 2, 1, 1, "oss", "full", 2],
        ["oss_pp2", 1, 1, 1, 1, "oss", "full", 1, 2], ["oss_cp2", 1, 1, 1, 2, "oss"],
        ["olmoe_tp2_ep2", 1, 2, 1, 1, "olmoe", "full", 2], ["qwen2moe_tp2", 1, 1, 1, 1, "qwen2moe", "full", 2],
        ["ernie_ep2", 2, 2, 2, 1, "ernie"], ["ernie_cp2", 1, 1, 1, 2, "ernie"],
        ["minimax_tp2_ep2", 1, 2, 1, 1, "minimax", "full", 2],
        ["llama4_cp2", 1, 1, 1, 2, "llama4"], ["llama4_tp2_ep2", 1, 2, 1, 1, "llama4", "full", 2],
        ["granite_tp2_ep2", 1, 2, 1, 1, "granite", "full", 2],
        ["dsa_cp2_keepsel", 1, 1, 1, 2, "dsa", "keepsel"], ["dsa_tp2_ep2", 1, 2, 2, 1, "dsa", "full", 2],
        ["dsa_pp2_keepsel", 1, 1, 1, 1, "dsa", "keepsel", 1, 2], ["swa_cp2", 1, 1, 1, 2, "swa"]],
    4: [["dp4_ep2_k1", 4, 2, 1], ["dp4_ep2_k2", 4, 2, 2], ["dp4_ep4_k1", 4, 4, 1],
        ["cp4", 1, 1, 1, 4, "cp"], ["cp2_ep2", 2, 2, 1, 2, "cp_off"], ["pieces_cp4", "pieces", 4],
        ["tp2_dp2", 2, 1, 1, 1, "base", "full", 2], ["tp2_dp2_ep4", 2, 4, 2, 1, "cp_off", "none", 2],
        ["cp2_tp2_ep4", 1, 4, 1, 2, "cp_off", "full", 2],
        ["pp2_dp2_ep2", 2, 2, 1, 1, "base", "full", 1, 2],  # the split from the cost model
        ["pp2_dp2_ep2_keep1", 2, 2, 1, 1, "base", "keep1", 1, 2, [3, 1]],  # stage 0: layers 0-1 recomputed, not 2
        ["pp4", 1, 1, 1, 1, "cp", "full", 1, 4], ["pp2_cp2", 1, 1, 1, 2, "cp", "full", 1, 2],
        ["dense_tp2_dp2", 2, 1, 1, 1, "dense", "full", 2],
        ["mla_cp2_tp2_ep4", 1, 4, 1, 2, "mla", "full", 2], ["mla_pp2_dp2_ep2", 2, 2, 1, 1, "mla", "full", 1, 2],
        ["dsa_cp2_tp2_ep4", 1, 4, 1, 2, "dsa", "full", 2], ["mimo_cp2_tp2_ep2", 1, 2, 1, 2, "mimo", "full", 2],
        ["afmoe_cp2_tp2_ep2", 1, 2, 1, 2, "afmoe", "full", 2], ["cohere_cp2_dp2_ep2", 2, 2, 1, 2, "cohere"],
        ["step_cp2_tp2_ep2", 1, 2, 1, 2, "step", "full", 2], ["kimi_cp2_tp2_ep2", 1, 2, 1, 2, "kimi", "full", 2],
        ["mistral4_cp2_tp2_ep2", 1, 2, 1, 2, "mistral4", "full", 2], ["axk1_tp2_dp2_ep2_k2", 2, 2, 2, 1, "axk1", "full", 2],
        ["gemma4_cp2_dp2_ep2_k2", 2, 2, 2, 2, "gemma4"], ["axk2_cp2_tp2_ep2", 1, 2, 1, 2, "axk2", "full", 2],
        # pp × tp: an uneven split with ep=2 over each stage's tp ranks (off-policy, sequence-mean), and interleaved
        # over 2 virtual stages a rank with a dense model's MLPs split over tp
        ["pp2_tp2_ep2", 1, 2, 2, 1, "cp_off", "full", 2, 2, [3, 1]],
        ["dense_pp2_v2_tp2", 1, 1, 1, 1, "dense", "full", 2, 2, [1, 1, 1, 1]]],
    8: [["dp8", 8, 1, 1], ["dp8_ep8_k2", 8, 8, 2], ["cp2_dp4_ep4_k2", 4, 4, 2, 2, "cp_off"],
        ["tp2_dp4_ep8", 4, 8, 1, 1, "base", "full", 2], ["cp2_tp2_dp2_ep4", 2, 4, 2, 2, "cp_off", "full", 2],
        ["pp2_dp4_ep4", 4, 4, 1, 1, "base", "full", 1, 2], ["pp2_cp2_dp2", 2, 1, 1, 2, "cp", "full", 1, 2],
        ["dense_tp2_dp4", 4, 1, 1, 1, "dense", "full", 2], ["pp2_cp2_tp2_ep2", 1, 2, 1, 2, "cp", "full", 2, 2]],
}

# variant: (micro-batch tokens, log-prob fields the rollouts carry, LossConfig fields, slow Gated DeltaNet decay and
# advantages offset by +1)
VARIANTS = {
    "base": (64, (), {}, False),
    # CP: micro-batches of up to 128 tokens (cp=2: segments of 32 = two 16-token chunks; cp=4: one chunk), documents
    # of 4-42 tokens across segment edges, a padded tail, every per-token field sharded. "cp" is on-policy with the
    # KL term (ref log-probs); "cp_off" is off-policy (old, ref and rollout log-probs: ratio, truncated IS, KL),
    # entropy bonus, sequence-mean. The +1 on the advantages keeps the loss away from zero: group-normalized
    # advantages make it a near-cancelling sum, whose relative error measures only the order of its additions
    "cp": (128, ("ref_logprobs",), {"kl_coef": 0.1}, True),
    "cp_off": (128, ("old_logprobs", "ref_logprobs", "rollout_logprobs"),
               {"kl_coef": 0.1, "entropy_coef": 0.01, "aggregation": "seq_mean"}, True),
    # a dense model (Qwen3.5 dense: Gated DeltaNet and attention layers, a SwiGLU MLP in every layer)
    "dense": (64, (), {}, False),
    # a DeepSeek-V3-style model (tiny_mla), on-policy with the KL term, micro-batches of up to 128 tokens (for CP),
    # advantages offset as "cp"'s
    "mla": (128, ("ref_logprobs",), {"kl_coef": 0.1}, True),
    # a gpt-oss-style model (tiny_oss), as "mla"
    "oss": (128, ("ref_logprobs",), {"kl_coef": 0.1}, True),
    # an OLMoE-style and a Qwen2-MoE-style model (tiny_olmoe, tiny_qwen2_moe), as "mla"
    "olmoe": (128, ("ref_logprobs",), {"kl_coef": 0.1}, True),
    "qwen2moe": (128, ("ref_logprobs",), {"kl_coef": 0.1}, True),
    "ernie": (128, ("ref_logprobs",), {"kl_coef": 0.1}, True),  # an ERNIE-4.5-style model (tiny_ernie), as "mla"
    "minimax": (128, ("ref_logprobs",), {"kl_coef": 0.1}, True),  # a MiniMax-M2-style model (tiny_minimax), as "mla"
    "llama4": (128, ("ref_logprobs",), {"kl_coef": 0.1}, True),  # a Llama-4-style model (tiny_llama4), as "mla"
    "granite": (128, ("ref_logprobs",), {"kl_coef": 0.1}, True),  # a Granite-MoE-style model (tiny_granite), as "mla"
    "dsa": (128, ("ref_logprobs",), {"kl_coef": 0.1}, True),  # DeepSeek sparse attention (tiny_dsa), as "mla"
    "swa": (128, ("ref_logprobs",), {"kl_coef": 0.1}, True),  # sliding windows without sinks (tiny_swa), as "mla"
    "mimo": (128, ("ref_logprobs",), {"kl_coef": 0.1}, True),  # a MiMo-V2-Flash-style model (tiny_mimo), as "mla"
    "afmoe": (128, ("ref_logprobs",), {"kl_coef": 0.1}, True),  # an AFMoE-style model (tiny_afmoe), as "mla"
    "cohere": (128, ("ref_logprobs",), {"kl_coef": 0.1}, True),  # a Cohere2-MoE-style model (tiny_cohere), as "mla"
    "step": (128, ("ref_logprobs",), {"kl_coef": 0.1}, True),  # a Step-3.7-style model (tiny_step), as "mla"
    "kimi": (128, ("ref_logprobs",), {"kl_coef": 0.1}, True),  # a Kimi-Linear-style model (tiny_kimi), as "mla"
    "mistral4": (128, ("ref_logprobs",), {"kl_coef": 0.1}, True),  # a Mistral-4-style model (tiny_mistral4)
    "axk1": (128, ("ref_logprobs",), {"kl_coef": 0.1}, True),  # an A.X-K1-style model (tiny_axk1), as "mla"
    "gemma4": (128, ("ref_logprobs",), {"kl_coef": 0.1}, True),  # a Gemma-4-style model (tiny_gemma4), as "mla"
    "axk2": (128, ("ref_logprobs",), {"kl_coef": 0.1}, True),  # an A.X-K2-style model (tiny_axk2), as "mla"
}
def tiny_mla():
    """DeepSeek-V3's blocks at tiny widths: MLA with the q LoRA and v narrower than q·k, a dense first layer, 8
    experts in 4 groups (2 groups chosen, sigmoid scores, correction bias, scaling 2.5), a shared expert, YaRN
    from 32 positions."""
    from recipe.models import MLAShape, ModelShape, RopeScaling, SigmoidRouter

    return ModelShape(name="tiny-mla", arch="deepseek_v3", hidden_size=64, num_layers=4, vocab_size=512,
                      layer_types=("full_attention",) * 4, num_heads=4, num_kv_heads=4, head_dim=12, qk_norm=False,
                      mla=MLAShape(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                   v_head_dim=8),
                      num_experts=8, top_k=2, expert_ffn=32, shared_expert_ffn=32, router_bias=True,
                      sigmoid_router=SigmoidRouter(groups=4, topk_groups=2, scaling=2.5), first_dense_layers=1,
                      dense_ffn=48, rope_theta=10000.0,
                      rope_scaling=RopeScaling(kind="yarn", factor=4.0, original_max_position=32, mscale=1.0,
                                               mscale_all_dim=1.0))


def tiny_dsa():
    """tiny_mla with DeepSeek sparse attention: an indexer of 2 heads of 8 channels (RoPE on pairs, GLM-5's form)
    keeping 6 keys a query, so the documents of up to 42 tokens select, across the cp segments too; the last layer
    reuses the third's selection (GLM's "shared" layers)."""
    from recipe.models import SparseAttentionShape

    return tiny_mla().model_copy(update={"name": "tiny-dsa", "dsa": SparseAttentionShape(
        topk=6, index_heads=2, index_head_dim=8, rope_pairs=True, shared_layers=(3,))})


def tiny_oss():
    """gpt-oss's blocks at tiny widths: attention sinks, sliding (window 8: the documents run to 42 tokens) and
    full layers alternating, q/k/v/o biases, 4 query heads over 2 KV heads, a biased router over 8 experts (top-2)
    with biases and the clamped GLU, YaRN (truncate false). `_model` scales its experts' gate_up weights so the clamp
    at 7 acts."""
    from recipe.models import ModelShape, RopeScaling

    return ModelShape(name="tiny-oss", arch="gpt_oss", hidden_size=64, num_layers=4, vocab_size=512,
                      layer_types=("sliding_attention", "full_attention") * 2, num_heads=4, num_kv_heads=2,
                      head_dim=16, qk_norm=False, attn_bias=True, sliding_window=8, num_experts=8, top_k=2,
                      expert_ffn=32, router_bias=True, rope_theta=150000.0, rms_norm_eps=1e-5,
                      rope_scaling=RopeScaling(kind="yarn", factor=32.0, original_max_position=16, beta_fast=32.0,
                                               beta_slow=1.0, truncate=False))


def tiny_swa():
    """Mixtral's blocks at tiny widths with sliding windows and no sinks (Mistral's and Mixtral's attention where
    their configs set a window): windows of 8 keys on layers 0-2 (the documents run to 42 tokens), a full layer
    last, 4 query heads over 2 KV heads, 8 experts (top-2, renormalized)."""
    from recipe.models import ModelShape

    return ModelShape(name="tiny-swa", arch="mixtral", hidden_size=64, num_layers=4, vocab_size=512,
                      layer_types=("sliding_attention",) * 3 + ("full_attention",), num_heads=4, num_kv_heads=2,
                      head_dim=16, qk_norm=False, sliding_window=8, num_experts=8, top_k=2, expert_ffn=32,
                      norm_topk_prob=True, rope_theta=10000.0, rms_norm_eps=1e-5)


def tiny_mimo():
    """MiMo-V2-Flash's blocks at tiny widths: a dense first layer (full attention, 2 KV heads), then sliding layers
    (windows of 8 keys) with twice the KV heads, a sink logit per head and a RoPE base of their own, a full layer
    last; q·k heads of 12 channels, values of 8 scaled by 0.6; sigmoid routing over 8 experts in 2 groups."""
    from recipe.models import ModelShape, SigmoidRouter

    return ModelShape(name="tiny-mimo", arch="glm4_moe", hf_model_type="mimo_v2_flash", hidden_size=64, num_layers=4,
                      vocab_size=512,
                      layer_types=("full_attention",) + ("sliding_attention",) * 2 + ("full_attention",),
                      num_heads=4, num_kv_heads=2, sliding_kv_heads=4, head_dim=12, v_head_dim=8, value_scale=0.6,
                      sinks="sliding", sliding_window=8, partial_rotary_factor=0.5, rope_theta=5e6,
                      sliding_rope_theta=1e4, qk_norm=False, num_experts=8, top_k=2, expert_ffn=32, router_bias=True,
                      sigmoid_router=SigmoidRouter(groups=2, topk_groups=1, scaling=1.5), first_dense_layers=1,
                      dense_ffn=48, rms_norm_eps=1e-5)


def tiny_afmoe():
    """AFMoE's blocks at tiny widths: norms before and after each sublayer, a sigmoid gate on the attention output,
    per-head q/k norms, sliding layers (windows of 8) rotated and full ones without RoPE, a dense first layer, a
    shared expert, sigmoid routing with a correction bias, the embedding times √64."""
    from recipe.models import ModelShape, SigmoidRouter

    return ModelShape(name="tiny-afmoe", arch="glm4_moe", hf_model_type="afmoe", hidden_size=64, num_layers=4,
                      vocab_size=512, layer_types=("sliding_attention", "full_attention") * 2, num_heads=4,
                      num_kv_heads=2, head_dim=16, qk_norm=True, attn_output_gate=True, nope_full_layers=True,
                      norm_placement="sandwich", embedding_scale=8.0, sliding_window=8, num_experts=8, top_k=2,
                      expert_ffn=32, shared_expert_ffn=32, router_bias=True,
                      sigmoid_router=SigmoidRouter(groups=1, topk_groups=1, scaling=1.5), first_dense_layers=1,
                      dense_ffn=48, rms_norm_eps=1e-5)


def tiny_cohere():
    """Cohere2-MoE's blocks at tiny widths: one LayerNorm a layer feeding attention and the MoE block in parallel,
    RoPE on channel pairs on the sliding layers (windows of 8) only, a dense first layer (full attention, rotated:
    the prefix's), experts chosen by sigmoid weights renormalized over the top 2, a shared expert averaged with the
    routed ones, the logits times 0.25, tied embeddings (so tp = 1)."""
    from recipe.models import ModelShape

    return ModelShape(name="tiny-cohere", arch="qwen3_moe", hf_model_type="cohere2_moe", hidden_size=64,
                      num_layers=4, vocab_size=512, layer_types=("full_attention", "sliding_attention",
                                                                 "full_attention", "sliding_attention"),
                      num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=False, sliding_window=8,
                      nope_full_layers=True, norm_placement="parallel", norm_kind="layer", rope_pairs=True,
                      logit_scale=0.25, num_experts=8, top_k=2, expert_ffn=32, shared_expert_ffn=32,
                      shared_expert_mean=True, tie_embeddings=True, rms_norm_eps=1e-5, first_dense_layers=1,
                      dense_ffn=48, rotated_prefix=True, sigmoid_top=True)


def tiny_step():
    """Step-3.7's blocks at tiny widths: a full layer (4 heads, half of each rotated at base 5e6) then sliding ones
    (windows of 8, 6 heads, all rotated at base 1e4), a sigmoid gate per head, q·k scaled by 1/√20, (1 + w) norms,
    a dense first layer, a shared expert, sigmoid routing with a correction bias, SwiGLU clamped on the last layer's
    experts and shared expert and on the dense layer (bounds small enough to act)."""
    from recipe.models import ModelShape, SigmoidRouter

    return ModelShape(name="tiny-step", arch="glm4_moe", hf_model_type="step3p5", hidden_size=64, num_layers=4,
                      vocab_size=512, layer_types=("full_attention",) + ("sliding_attention",) * 3, num_heads=4,
                      sliding_heads=6, num_kv_heads=2, head_dim=16, qk_norm=True, head_gate=True, offset_norms=True,
                      partial_rotary_factor=0.5, sliding_rotary_factor=1.0, rope_theta=5e6, sliding_rope_theta=1e4,
                      query_pre_attn_scalar=20.0, sliding_window=8, num_experts=8, top_k=2, expert_ffn=32,
                      shared_expert_ffn=32, router_bias=True,
                      sigmoid_router=SigmoidRouter(groups=1, topk_groups=1, scaling=1.5), first_dense_layers=1,
                      dense_ffn=48, rms_norm_eps=1e-5, swiglu_limits=(0.0, 0.0, 0.0, 0.05),
                      swiglu_limits_shared=(0.05, 0.0, 0.0, 0.05))


def tiny_kimi():
    """Kimi-Linear's blocks at tiny widths: KDA layers (4 heads of 8, per-channel decays, 16-token chunks) around
    a RoPE-free MLA layer, a dense first layer, a shared expert, sigmoid routing with a correction bias."""
    from recipe.models import LinearAttnShape, MLAShape, ModelShape, SigmoidRouter

    return ModelShape(name="tiny-kimi", arch="deepseek_v3", hf_model_type="kimi_linear", hidden_size=64,
                      num_layers=4, vocab_size=512,
                      layer_types=("linear_attention", "linear_attention", "full_attention", "linear_attention"),
                      num_heads=4, num_kv_heads=4, head_dim=12, qk_norm=False, nope_full_layers=True,
                      mla=MLAShape(q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                   v_head_dim=8),
                      linear_attn=LinearAttnShape(kind="kda", num_k_heads=4, num_v_heads=4, head_k_dim=8,
                                                  head_v_dim=8, chunk_size=16),
                      num_experts=8, top_k=2, expert_ffn=32, shared_expert_ffn=32, router_bias=True,
                      sigmoid_router=SigmoidRouter(groups=1, topk_groups=1, scaling=2.5), first_dense_layers=1,
                      dense_ffn=48, rms_norm_eps=1e-5)


def tiny_mistral4():
    """Mistral 4's blocks at tiny widths: tiny_mla's MLA (q LoRA, YaRN from 32 positions) with the query scale by
    position (period 8: every micro-batch's documents cross it, under CP on global positions), a softmax router
    renormalized and scaled 1.5, a dense first layer, a shared expert."""
    from dataclasses import replace

    from recipe.models import SoftmaxRouter

    return replace(tiny_mla(), name="tiny-mistral4", hf_model_type="mistral4", router_bias=False,
                   sigmoid_router=None, softmax_router=SoftmaxRouter(scaling=1.5), query_scale_period=8,
                   query_scale_beta=0.1)


def tiny_axk1():
    """A.X K1's blocks at tiny widths: tiny_mla's with an RMSNorm on each MoE block's output (its MoE layers only),
    which keeps the experts' output for the backward (the recomputed forward combines it again)."""
    from dataclasses import replace

    return replace(tiny_mla(), name="tiny-axk1", hf_model_type="axk1", moe_output_norm=True)


def tiny_axk2():
    """tiny_dsa's blocks as A.X K2 has them: the query projection fused with a gate on each head's output, the
    block norms with a low-rank gate (rank 4); every layer selecting for itself."""
    from recipe.models import MLAShape

    dsa = tiny_dsa()
    return dsa.model_copy(update={"name": "tiny-axk2", "hf_model_type": "axk2", "gated_norm_rank": 4,
                                  "mla": MLAShape(**{**dsa.mla.__dict__, "query_gate": True}),
                                  "dsa": dsa.dsa.model_copy(update={"shared_layers": ()})})


def tiny_gemma4():
    """Gemma 4's blocks at tiny widths: sliding layers (windows of 8, heads of 8 channels over 4 KV heads, RoPE on
    whole heads at 1e4) and full ones (heads of 16 over 2 KV heads whose values are their keys, proportional RoPE on
    a quarter at 1e6), values at unit RMS, the softmax unscaled; a dense GeGLU MLP beside GeGLU experts, each side
    normed, the scaled router; the embedding times √64, tied to the head; logits soft-capped at 0.5 (small enough
    to act at init's logits)."""
    from recipe.models import ModelShape

    return ModelShape(name="tiny-gemma4", arch="moe", hf_model_type="gemma4_text", hidden_size=64, num_layers=4,
                      vocab_size=512, layer_types=("sliding_attention", "full_attention") * 2, num_heads=4,
                      num_kv_heads=2, sliding_kv_heads=4, head_dim=16, sliding_head_dim=8, keys_as_values=True,
                      qk_norm=True, partial_rotary_factor=0.25, sliding_rotary_factor=1.0, rope_theta=1e6,
                      sliding_rope_theta=1e4, rope_proportional=True, query_pre_attn_scalar=1.0, sliding_window=8,
                      num_experts=8, top_k=2, expert_ffn=32, shared_expert_ffn=48, dense_beside_experts=True,
                      norm_placement="sandwich", embedding_scale=8.0, tie_embeddings=True, final_logit_softcap=0.5,
                      rms_norm_eps=1e-6)


def tiny_olmoe():
    """OLMoE's blocks at tiny widths: q/k norms over all heads together (their sums of squares added over the tp
    ranks), q/k/v/o biases, softmax routing over 8 experts (top-2) without renormalization, a pad token whose
    embedding row is frozen (326: in the second tp rank's half of the vocabulary, and in both steps' data)."""
    from recipe.models import ModelShape

    return ModelShape(name="tiny-olmoe", arch="olmoe", hidden_size=64, num_layers=4, vocab_size=512,
                      layer_types=("full_attention",) * 4, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                      attn_bias=True, num_experts=8, top_k=2, expert_ffn=32, norm_topk_prob=False, rope_theta=10000.0,
                      rms_norm_eps=1e-5, pad_token_id=326)


def tiny_minimax():
    """MiniMax-M2's blocks at tiny widths: q/k norms over all heads together (their sums of squares added over the tp
    ranks), half of each head rotated, sigmoid scores over 8 experts (top-2) chosen with a correction bias and
    renormalized, no shared expert."""
    from recipe.models import ModelShape, SigmoidRouter

    return ModelShape(name="tiny-minimax", arch="minimax_m2", hidden_size=64, num_layers=4, vocab_size=512,
                      layer_types=("full_attention",) * 4, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                      partial_rotary_factor=0.5, num_experts=8, top_k=2, expert_ffn=32, router_bias=True,
                      sigmoid_router=SigmoidRouter(), rope_theta=5e6)


def tiny_llama4():
    """Llama 4's blocks at tiny widths: chunked attention in runs of 8 positions (documents run to 42 tokens, CP
    segments are 32: runs cross segment edges) with RoPE on channel pairs and q/k at unit RMS, a RoPE-free global
    layer whose query temperature changes every 4 positions, MoE every second layer (8 experts, top-2 by the sigmoid
    of their logits, weighting the experts' input; a shared expert), dense layers between."""
    from recipe.models import Llama4Attention, ModelShape

    return ModelShape(name="tiny-llama4", arch="llama4", hidden_size=64, num_layers=4, vocab_size=512,
                      layer_types=("chunked_attention", "chunked_attention", "full_attention", "chunked_attention"),
                      num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=False, attention_chunk=8,
                      llama4=Llama4Attention(floor_scale=4, attn_scale=0.25), num_experts=8, top_k=2,
                      expert_ffn=32, shared_expert_ffn=32, moe_layer_step=2, dense_ffn=48, norm_topk_prob=False,
                      rope_theta=500000.0, rms_norm_eps=1e-5)


def tiny_granite():
    """Granite MoE's blocks at tiny widths: its four multipliers away from 1 (embedding ×3 through the
    vocabulary-parallel embedding under tp, attention's scale 0.2, each branch ×0.5, the logits ÷2.5 in the head),
    softmax top-2 of 8 experts over the chosen logits, a shared expert, untied embeddings (so tp splits them)."""
    from recipe.models import GraniteScales, ModelShape

    return ModelShape(name="tiny-granite", arch="granitemoe", hidden_size=64, num_layers=4, vocab_size=512,
                      layer_types=("full_attention",) * 4, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=False,
                      num_experts=8, top_k=2, expert_ffn=32, shared_expert_ffn=32, rope_theta=10000.0,
                      granite=GraniteScales(embedding=3.0, attention=0.2, residual=0.5, logits=2.5))


def tiny_qwen2_moe():
    """Qwen2-MoE's blocks at tiny widths: q/k/v biases (none on o_proj), a shared expert behind a sigmoid gate,
    softmax routing over 8 experts (top-2) without renormalization."""
    from recipe.models import ModelShape

    return ModelShape(name="tiny-qwen2-moe", arch="qwen2_moe", hidden_size=64, num_layers=4, vocab_size=512,
                      layer_types=("full_attention",) * 4, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=False,
                      attn_bias=True, num_experts=8, top_k=2, expert_ffn=32, shared_expert_ffn=48,
                      shared_expert_gate=True, norm_topk_prob=False)


def tiny_ernie():
    """ERNIE-4.5 MoE's blocks at tiny widths: a dense first layer, softmax scores over 8 experts (top-2) steered by a
    correction bias, the chosen weights renormalized, 2 shared experts, interleaved RoPE, tied embeddings."""
    from recipe.models import ModelShape, SigmoidRouter

    return ModelShape(name="tiny-ernie", arch="ernie4_5_moe", hidden_size=64, num_layers=4, vocab_size=512,
                      layer_types=("full_attention",) * 4, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=False,
                      num_experts=8, top_k=2, expert_ffn=32, shared_expert_ffn=64, router_bias=True,
                      sigmoid_router=SigmoidRouter(), first_dense_layers=1, dense_ffn=48, tie_embeddings=True,
                      rope_theta=500000.0, rms_norm_eps=1e-5)


# exp(A_log) per value head, so that the state entering a segment matters: with softplus(·) ≈ 1.3 a head keeps
# e^{-0.5}..e^{-2.5} of its state over a 32-token segment (the initial A_log = log U(1, 16) forgets it within a few
# tokens, and the combine would go untested)
SLOW_DECAY = (0.012, 0.02, 0.04, 0.06)


def tiny_dense():
    """tiny-moe's attention and Gated DeltaNet layers with a dense SwiGLU in every layer, no experts."""
    from recipe.models import PRESETS

    moe = PRESETS["tiny-moe"]
    return moe.model_copy(update=dict(name="tiny-dense", arch="qwen3_5", num_experts=1, top_k=1, shared_expert_ffn=0,
                                      shared_expert_gate=False, first_dense_layers=moe.num_layers, dense_ffn=48))


# the model each variant trains (the others train tiny-moe)
VARIANT_SHAPES = {"dense": tiny_dense, "mla": tiny_mla, "dsa": tiny_dsa, "oss": tiny_oss, "olmoe": tiny_olmoe,
                  "qwen2moe": tiny_qwen2_moe, "ernie": tiny_ernie, "minimax": tiny_minimax, "llama4": tiny_llama4,
                  "granite": tiny_granite, "swa": tiny_swa, "mimo": tiny_mimo, "afmoe": tiny_afmoe, "cohere": tiny_cohere,
                  "step": tiny_step, "kimi": tiny_kimi, "mistral4": tiny_mistral4,
                  "axk1": tiny_axk1, "gemma4": tiny_gemma4, "axk2": tiny_axk2}


def _shape(variant: str):
    from recipe.models import PRESETS

    build = VARIANT_SHAPES.get(variant)
    return build() if build else PRESETS["tiny-moe"]


# where the cases run: set once per process by main()
_RUN = {"device": torch.device("cpu"), "dtype": torch.float32}


def _model(shape, variant: str):
    from launch.model import LINEAR_MIXERS, build_model

    model = build_model(shape, device=_RUN["device"], dtype=_RUN["dtype"], seed=1)
    with torch.no_grad():  # a correction bias that steers the choice (it is zero at init)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.linspace(-0.05, 0.05, b.numel(), device=b.device).roll(int(name.split(".")[1])))
        for name, b in model.named_buffers():  # Gemma 4's layer scalars away from 1, so that they count
            if name.endswith("layer_scalar"):
                b.fill_(0.8 + 0.1 * int(name.split(".")[1]))
        if shape.hf_model_type == "gemma4_text":  # its unscaled softmax over unit-RMS q and k scores with a spread
            # of √Dh at init's norm weights, so sharp that fp32's rounding moves step 1's gradients by ~5e-6 and, through
            # Adam's first step (lr·sign(g)), step 2's loss by up to 1e-5; q norms of 0.25 (a trained model's are small)
            for name, p in model.named_parameters():
                if name.endswith("q_norm.weight"):
                    p.fill_(0.25)
        if shape.arch == "gpt_oss":  # gate and up values of ±8 or so: the clamp at 7 acts (init std 0.02 gives ~0.2)
            for name, p in model.named_parameters():
                if name.endswith("experts.gate_up_proj"):
                    p.mul_(50.0)
    if VARIANTS[variant][3]:
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, LINEAR_MIXERS):
                    m.A_log.copy_(torch.tensor(SLOW_DECAY[:m.num_v_heads]).log().to(m.A_log))
    return model


def _plan(dp: int, ep: int, chunks: int, recompute: str = "full", cp: int = 1, tp: int = 1, pp: int = 1,
          tokens: int = 64, pp_stages: list[int] | None = None):
    from recipe.hw import load_profile
    from recipe.plan import LayoutSpec

    world = dp * cp * tp * pp
    layout = LayoutSpec(pp=pp, tp=tp, cp=cp, ep=ep, dp=dp, etp=1, edp=world // (pp * ep))
    recompute, keep, keep_sel = _recompute(recompute)
    return types.SimpleNamespace(layout=layout, hw_profile=lambda: load_profile("cpu"), train=types.SimpleNamespace(
        recompute=recompute, keep_layers=keep, keep_selections=keep_sel, ep_overlap_chunks=chunks,
        micro_batch_tokens=tokens, lm_head="fused", pp_stages=pp_stages))


def _recompute(name: str) -> tuple[str, int, bool]:
    """A case's recompute field as (recompute, keep_layers, keep_selections): "keepN" is full recompute with N layers
    kept, "keepsel" full recompute with DeepSeek sparse attention's selections kept."""
    if name == "keepsel":
        return "full", 0, True
    return ("full", int(name[4:]), False) if name.startswith("keep") else (name, 0, False)


def _steps_data(vocab: int, tokens: int = 64, fields: tuple[str, ...] = (), offset: float = 0.0):
    """Two steps of packed multi-document micro-batches of uneven sizes (at 64 tokens, 5 micro-batches: dp=2 and dp=4
    both pad), the rollouts carrying the log-prob `fields`, advantages plus `offset`."""
    from launch.data import TOKEN_FIELDS, make_batch, pack_rollouts, synthetic_rollouts

    rollouts = synthetic_rollouts(5, 3, vocab, prompt_len=(2, 12), response_len=(2, 30), seed=3,
                                  with_logprobs=bool(fields))
    for r in rollouts:
        for name in set(TOKEN_FIELDS) - set(fields):
            setattr(r, name, None)
        r.advantages = [a + offset for a in r.advantages]
    steps = []
    for s in range(2):
        chosen = rollouts[s * 7:s * 7 + 8]
        steps.append([make_batch(g, _RUN["device"]) for g in pack_rollouts(chosen, tokens)])
    return steps


def _config(variant: str):
    from launch.rl import LossConfig
    from launch.train import TrainConfig

    return TrainConfig(lr=3e-3, objective="rl", weight_decay=0.01, loss=LossConfig(**VARIANTS[variant][2]))


def _run(model, trainer, steps):
    losses, grads, first = [], None, None
    for i, batches in enumerate(steps):
        trainer.optimizer.zero_grad()
        metrics = trainer.forward_backward(batches)
        losses.append(metrics["loss"])
        if i == 0:
            first = metrics
            grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().cpu().clone()
                     for n, p in zip(trainer.optimizer.names, trainer.optimizer.params)}
        norm = trainer.optimizer.step()
        if i == 0:  # the clipping norm: every shard and replica counted once
            first["grad_norm"] = norm
    return losses, grads, first


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    """Largest difference relative to the reference tensor's largest entry, or to `floor` (three thousandths of
    the largest gradient anywhere) for a gradient that is itself a near-cancelling sum (A_log, dt_bias, in_proj_a:
    the only tensors under the floor, at 1e-5 to 1.6e-3 of the largest gradient): there the fp32 one-process
    gradient is itself 2-8e-5 of a thousandth of the largest gradient off the fp64 one, and any change of summation
    order (the experts' grouping under EP, a tensor-parallel MLP's partial sums) moves it by about as much."""
    return float((a - b).abs().max() / max(float(b.abs().max()), floor))


def run_case(name: str, dp: int, ep: int, chunks: int, cp: int = 1, variant: str = "base",
             recompute: str = "full", tp: int = 1, pp: int = 1, pp_stages: list[int] | None = None, *, data,
             references) -> dict:
    from launch.parallel import build_meshes, moe_layers, parallelize
    from launch.train import Trainer

    shape = _shape(variant)
    steps = data[variant]
    plan = _plan(dp, ep, chunks, recompute, cp=cp, tp=tp, pp=pp, tokens=VARIANTS[variant][0], pp_stages=pp_stages)
    meshes = build_meshes(plan.layout, _RUN["device"].type)
    model = parallelize(_model(shape, variant), plan, meshes, param_dtype=_RUN["dtype"])
    trainer = Trainer(model, _config(variant), recompute=plan.train.recompute, keep_layers=plan.train.keep_layers,
                      keep_selections=plan.train.keep_selections, lm_head="fused", dp_rank=meshes.dp_rank,
                      dp_size=meshes.dp_size, dp_group=meshes.dp_group, metrics_group=meshes.data_group)
    shards = []
    if trainer.context_parallel is not None:
        orig_shard = trainer.context_parallel.shard

        def shard(batch, orig_shard=orig_shard):
            out = orig_shard(batch)
            shards.append(out.packing.cp)
            return out
        trainer.context_parallel.shard = shard
    loads, calls = [], [0]
    layers = moe_layers(model)
    for experts in layers:
        if experts.token_dispatch is not None:
            dispatch = experts.token_dispatch
            orig, orig_a2a = dispatch.route, dispatch.all_to_all

            def route(top_e, orig=orig):
                out = orig(top_e)
                loads.append(out.recv_RCEl.tolist())  # rows per (source rank, chunk, local expert) this rank received
                return out

            def all_to_all(*a, orig_a2a=orig_a2a, **kw):
                calls[0] += 1
                return orig_a2a(*a, **kw)
            dispatch.route, dispatch.all_to_all = route, all_to_all
    stage_calls = _count_stage_forwards(model)
    indexers = [mod for mod in model.modules() if type(mod).__name__ == "Indexer"]
    index_calls = [0]
    index_rows = [0, 0]  # the index queries the indexers projected, of the tokens they projected keys for
    for mod in indexers:
        def count_index(*a, orig=mod.forward, **kw):
            index_calls[0] += 1
            q, w, k = orig(*a, **kw)
            index_rows[0] += q.shape[0]
            index_rows[1] += k.shape[0]
            return q, w, k
        mod.forward = count_index
    selection_rows = [0, 0]  # DSA under tp: the queries this rank selected for, of the queries its mixers saw
    tp_state = getattr(model, "tensor_parallel", None)
    if indexers and tp_state is not None:
        def gather_rows(x_local, num_rows, orig=tp_state.gather_rows):
            selection_rows[0] += x_local.shape[0]
            selection_rows[1] += num_rows
            return orig(x_local, num_rows)
        tp_state.gather_rows = gather_rows
    exported = None
    if pp > 1:  # what an export writes (before the steps: the weights every rank built), gathered to rank 0
        from launch.pipeline import gathered_state_dict

        exported = gathered_state_dict(model)
    losses, grads, metrics = _run(model, trainer, steps)  # every rank: the gradients are gathered collectively
    pipeline = None
    if pp > 1:  # each stage holds its own layers: every rank's gradients, and what each stage ran, to every rank
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (grads, model.pipeline.index, sorted(model.layers.keys(), key=int),
                                       model.embed_tokens is not None, model.lm_head is not None, stage_calls[0]))
        grads = {n: g for g_r, *_ in every for n, g in g_r.items()}
        pipeline = sorted({(i, tuple(layers), emb, head, calls) for _, i, layers, emb, head, calls in every})
    if references is None:  # rank 0 compares
        return {"name": name}
    forwards = sum(-(-len(b) // dp) for b in steps)  # micro-batches this rank ran, padding included
    ref_losses, ref_grads, ref_metrics = references[variant]
    floor = 3e-3 * max(float(g.abs().max()) for g in ref_grads.values())
    grad_rel = {n: _rel(grads[n], ref_grads[n], floor) for n in ref_grads}
    return {"name": name, "loss_rel": [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)],
            "losses": losses, "ref_losses": ref_losses,
            "metric_rel": {k: abs(metrics[k] - v) / max(abs(v), 1e-12) for k, v in ref_metrics.items()},
            "grad_rel": max(grad_rel.values()), "worst_grad": max(grad_rel, key=grad_rel.get),
            "cp_segment_len": sorted({s.segment_len for s in shards}),
            "cp_padding": [s.num_padding for s in shards],
            # a piece starting after its document's start: the document crosses a segment edge into this shard
            "cp_docs_cross_segments": any(a > start for s in shards for _, _, a, start in s.pieces),
            "zero_rows_for_an_expert": any(0 in per_expert for load in loads for src in load for per_expert in src),
            "num_micro_batches": [len(b) for b in steps],
            # TP: a micro-batch whose token count is not a multiple of tp (sequence-parallel padding), and one
            # with a document across the edge between two tp ranks' sequence-parallel rows
            "tp_padded": tp > 1 and any(b.packing.num_tokens % tp for s in steps for b in s),
            "tp_docs_cross_shard_edges": tp > 1 and any(_crosses_tp_edge(b.packing, tp) for s in steps for b in s),
            # DeepSeek sparse attention: indexer passes per indexing layer of this rank and micro-batch (2 under full
            # recompute, 1 where the selections are kept for the recomputed forward)
            "indexer_passes": index_calls[0] / (len(indexers) * forwards) if indexers else None,
            # and under tp the share of the queries this rank selected keys for (each rank its sequence-parallel
            # share, the selections all-gathered)
            "selection_rows_share": selection_rows[0] / selection_rows[1] if selection_rows[1] else None,
            # and the share of the tokens it projected index queries for (its own share only)
            "index_query_share": index_rows[0] / index_rows[1] if index_rows[1] else None,
            "tensor_parallel_params": sum(1 for p in model.parameters() if getattr(p, "device_mesh", None) is not None
                                          and "tp" in (p.device_mesh.mesh_dim_names or ())),
            # PP: per stage (index, its layers, holds the embedding, holds the head, forwards it ran)
            "pipeline": pipeline,
            # PP: the stages' gathered state dict equals the whole model's, name for name and bit for bit
            "export_equal": None if exported is None else _same_state(exported, _model(shape, variant).state_dict()),
            # the layers this rank runs under recompute (global indices), in order
            "recomputed_layers": [int(k) for k, x in (model.layers.items() if isinstance(model.layers, nn.ModuleDict)
                                                     else enumerate(model.layers))
                                  if hasattr(x, "_checkpoint_wrapped_module")],
            "all_to_alls_per_layer_chunk_micro_batch": calls[0] / (len(layers) * forwards * chunks) if ep > 1 else None,
            "grads": {n: g for n, g in grads.items()}}


def _same_state(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in b)


def _crosses_tp_edge(packing, tp: int) -> bool:
    """A document runs across the edge between two tp ranks' sequence-parallel rows (⌈T/tp⌉ each)."""
    n = -(-packing.num_tokens // tp)
    return any(int(packing.positions[j * n]) > 0 for j in range(1, tp) if j * n < packing.num_tokens)


def _count_stage_forwards(model) -> list[int]:
    """How many forwards a pipeline rank's stages run (1 per micro-batch and stage, padding included)."""
    calls = [0]
    for stage in getattr(model, "stages", []):  # a pipeline rank's stages (one, or v interleaved)
        stage.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def run_pieces(name: str, cp: int) -> dict:
    """The three CP exchanges alone, in fp64, over every rank of the world (cp = world): full attention (the dense-mask
    and the per-piece path), the conv with its halo and the delta rule with its state combine, each against the
    one-process function on the same random inputs — outputs and every input gradient, the conv weight's summed
    over ranks. Documents: one boundary exactly on a segment edge, others inside segments, a 1-token document,
    documents across edges, a padded tail; delta-rule decays slow enough that each segment's incoming state matters
    (and `delta_without_combine` is how far off the outputs are from zero incoming states)."""
    import launch.context_parallel as cpm
    from kernels.gdn_fused import causal_conv1d_silu
    from launch.data import Rollout, make_batch
    from launch.gated_delta import chunk_factors, chunk_gated_delta_rule_torch, chunk_outputs
    from launch.model import Packing, causal_attention

    f64, chunk, L = torch.float64, 4, 8  # two 4-token chunks a segment, conv width 4 (halo 3)
    lengths = {2: [8, 5, 13, 1, 2], 4: [8, 5, 14, 2, 16, 11, 3]}[cp]  # 29 of 32 / 59 of 64 tokens; 8 is an edge
    T, Tp = sum(lengths), 2 * cp * L
    ctx = cpm.ContextParallel(dist.group.WORLD, chunk=chunk, conv_halo=3)
    batch = make_batch([Rollout([0] * n, [0] * n, [0.0] * n) for n in lengths])
    local = ctx.shard(batch)
    idx, packing, full = local.packing.cp.index, local.packing, Packing.from_lengths(lengths)
    real = idx < T
    gen = torch.Generator().manual_seed(7)  # the same inputs on every rank

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=f64)

    def compare(cp_out, ref_out, cp_inputs, ref_inputs, cp_param=None, ref_param=None):
        """Largest difference of the outputs (real tokens) and of every input gradient (padding rows: zero)."""
        r_out = rand(*ref_out.shape)  # a random cotangent, the same on every rank
        r_pad = torch.cat([r_out, r_out.new_zeros(Tp - T, *r_out.shape[1:])])
        (cp_out * r_pad[idx]).sum().backward()
        (ref_out * r_out).sum().backward()
        err = float((cp_out[real] - ref_out[idx[real]]).abs().max())
        for a, b in zip(cp_inputs, ref_inputs):
            g_ref = torch.cat([b.grad, b.grad.new_zeros(Tp - T, *b.grad.shape[1:])])[idx]
            err = max(err, float((a.grad - g_ref).abs().max()))
        if cp_param is not None:
            g = cp_param.grad.clone()
            dist.all_reduce(g)
            err = max(err, float((g - ref_param.grad).abs().max()))
        return err

    def leaves(*xs):
        return [x[:T].clone().requires_grad_() for x in xs], [x[idx].clone().requires_grad_() for x in xs]

    out = {"name": name}
    # full attention: 4 query heads over 2 KV heads
    q, k, v = rand(Tp, 4, 8), rand(Tp, 2, 8), rand(Tp, 2, 8)
    for path, limit, split in (("attn_dense", cpm.DENSE_MASK_MAX_TOKENS, True), ("attn_pieces", 0, True),
                               ("attn_lower_right", 0, False)):
        (rq, rk, rv), (lq, lk, lv) = leaves(q, k, v)
        saved = cpm.DENSE_MASK_MAX_TOKENS, cpm.SPLIT_PIECES
        cpm.DENSE_MASK_MAX_TOKENS, cpm.SPLIT_PIECES = limit, split
        o = ctx.attention(lq, lk, lv, packing, 8 ** -0.5)
        cpm.DENSE_MASK_MAX_TOKENS, cpm.SPLIT_PIECES = saved
        out[path] = compare(o, causal_attention(rq, rk, rv, full, 8 ** -0.5), [lq, lk, lv], [rq, rk, rv])
    # gpt-oss's attention: a sink logit per query head, full and sliding (a window inside a segment, and one
    # reaching back past a whole segment), merged pieces and one lower-right call
    from launch.sink_attention import sink_attention

    sinks = rand(4)
    for path, window, split in (("sink_full", None, True), ("sink_full_lower_right", None, False),
                                ("sink_window5", 5, True), ("sink_window40", 40, True)):
        (rq, rk, rv), (lq, lk, lv) = leaves(q, k, v)
        rs, ls = sinks.clone().requires_grad_(), sinks.clone().requires_grad_()
        saved, cpm.SPLIT_PIECES = cpm.SPLIT_PIECES, split
        o = ctx.sink_attention(lq, lk, lv, ls, packing, 8 ** -0.5, window)
        cpm.SPLIT_PIECES = saved
        out[path] = compare(o, sink_attention(rq, rk, rv, rs, full, 8 ** -0.5, window), [lq, lk, lv], [rq, rk, rv],
                            ls, rs)
    # causal conv + SiLU, 6 channels, width 4
    x, w = rand(Tp, 6), rand(6, 4)
    (rx,), (lx,) = leaves(x)
    rw, lw = w.clone().requires_grad_(), w.clone().requires_grad_()
    out["conv"] = compare(ctx.causal_conv(lx, lw, packing, "torch"), causal_conv1d_silu(rx, rw, full.positions),
                          [lx], [rx], lw, rw)
    # delta rule: 1 key head, 2 value heads, K = 4, V = 3; log decays in [-0.1, -0.01]
    q, k, v = rand(Tp, 1, 4), rand(Tp, 1, 4), rand(Tp, 2, 3)
    g = -(0.01 + 0.09 * torch.rand(Tp, 2, generator=gen, dtype=f64))
    beta = torch.rand(Tp, 2, generator=gen, dtype=f64)
    ref_in, loc_in = leaves(q, k, v, g, beta)
    o = ctx.delta_rule(*loc_in, packing, chunk, "torch")
    ref = chunk_gated_delta_rule_torch(*ref_in, full.positions, chunk)
    with torch.no_grad():
        alone = chunk_outputs(chunk_factors(*loc_in, packing.positions, chunk), o.new_zeros(2, 2, 4, 3))
        out["delta_without_combine"] = float((alone[real] - ref[idx[real]]).abs().max())
    out["delta"] = compare(o, ref, loc_in, ref_in)
    names = ("attn_dense", "attn_pieces", "attn_lower_right", "sink_full", "sink_full_lower_right", "sink_window5",
             "sink_window40", "conv", "delta", "delta_without_combine")
    errs = torch.tensor([out[k] for k in names], dtype=f64)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    out.update(zip(names, errs.tolist()))
    out["edges_with_a_document_start"] = sum(1 for j in range(1, 2 * cp) if int(local.packing.cp.positions[j * L]) == 0)
    return out


def _reference_trainer(shape, variant: str):
    """The one-process run of a variant: the model as `recipe launch` runs it on one GPU or CPU (in bf16, bf16
    parameters with fp32 masters beside them), no process group."""
    from launch.parallel import parallelize
    from launch.train import Trainer

    model = _model(shape, variant)
    if _RUN["dtype"] != torch.float32:
        model = parallelize(model, _plan(1, 1, 1, tokens=VARIANTS[variant][0]), None, param_dtype=_RUN["dtype"])
    return Trainer(model, _config(variant), recompute="full", lm_head="fused")


def main(rank: int, world: int, port: int, cases: list, out_path: str, device: str = "cpu",
         dtype: str = "fp32") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    _RUN["dtype"] = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    if device == "cuda":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on both sides of the comparison
        torch.backends.cudnn.allow_tf32 = False
        _RUN["device"] = torch.device("cuda", rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300 if device == "cuda" else 120),
                            device_id=_RUN["device"] if device == "cuda" else None)

    variants = sorted({case[5] if len(case) > 5 else "base" for case in cases
                       if case[1] not in ("pieces", "memory")})
    data, references = {}, ({} if rank == 0 else None)
    for v in variants:
        shape = _shape(v)
        tokens, fields, _, cp_variant = VARIANTS[v]
        data[v] = _steps_data(shape.vocab_size, tokens, fields, 1.0 if cp_variant else 0.0)
        if rank == 0:  # the one-process reference, once per variant
            ref_trainer = _reference_trainer(shape, v)
            references[v] = _run(ref_trainer.model, ref_trainer, data[v])
    results = []
    for case in cases:
        if case[1] == "pieces":
            results.append(run_pieces(case[0], case[2]))
        elif case[1] == "memory":  # the run's memory figures: each the largest over ranks
            from launch.job import max_over_ranks

            results.append({"name": case[0], "max": max_over_ranks(
                {"peak_mem_gb": 1.0 + rank, "peak_device_gb": 10.0 - rank}, _RUN["device"])})
        else:
            results.append(run_case(*case, data=data, references=references))
    if rank == 0:
        by_name = {r["name"]: r for r in results}
        bitwise = {}
        for r in results:  # chunked EP against its one-chunk twin: bitwise
            if r["name"].endswith("_k1"):
                continue
            twin = r["name"].rsplit("_k", 1)[0] + "_k1"
            if twin in by_name:
                t = by_name[twin]
                bitwise[r["name"]] = (r["losses"] == t["losses"]
                                      and all(torch.equal(r["grads"][n], t["grads"][n]) for n in r["grads"]))
        for r in results:
            r.pop("grads", None)
            r["bitwise_equal_k1"] = bitwise.get(r["name"])
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def spawn(world: int, cases: list, out_path: str | Path, device: str = "cpu", dtype: str = "fp32") -> list[dict]:
    """Run `cases` in `world` spawned processes on a free local port; rank 0's results, one dict a case."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(main, args=(world, port, cases, str(out_path), device, dtype), nprocs=world, join=True)
    return json.loads(Path(out_path).read_text())


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5], *sys.argv[6:8])
