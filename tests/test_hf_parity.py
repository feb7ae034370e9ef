"""Parity with Hugging Face transformers' own implementations: tiny random Qwen3.5-MoE, Qwen3-Next, Qwen3-MoE,
Qwen2-MoE (also with dense layers between MoE ones), Llama 4 (Scout's and Maverick's forms), GLM-4.7-Flash, Granite
MoE (with and without its shared expert; its multipliers), Hunyuan-A13B (q/k norms after RoPE, NTK-alpha RoPE), OLMoE
(q/k norms over all heads; with attention biases; also with clip_qkv acting), ERNIE-4.5 MoE, MiniMax-M2, Mixtral,
DeepSeek-V3 (with and without the q LoRA, YaRN RoPE, group-limited routing), DeepSeek-V3.2, GLM-5 and A.X K2
(DeepSeek sparse attention; A.X K2's gated query and gated norms), DeepSeek-V2 and
V2-Lite (softmax routing, group-limited and plain), GLM-4.5, dots.llm1, Qwen3-VL-MoE's text model, gpt-oss (attention
sinks, sliding and full layers, YaRN without truncation; packed documents, MXFP4: tests/test_gpt_oss.py), and the
dense Qwen3.5, Llama (also under llama3 RoPE scaling), Qwen2 and Qwen3 (also under YaRN), and sliding windows (Mistral,
Ministral, Qwen2, Qwen3, Mixtral) built in transformers,
saved, loaded into ours (logits fp32 atol 1e-4, loss), and exported back."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from launch.hf_io import export_hf_checkpoint, load_hf_checkpoint  # noqa: E402
from launch.model import Packing, build_model, logits_divisor  # noqa: E402
from launch.rl import token_logprobs  # noqa: E402
from recipe.models import from_hf_config  # noqa: E402



COMMON = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, rms_norm_eps=1e-6)
LINEAR = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
              shared_expert_intermediate_size=24, num_hidden_layers=3,
              layer_types=["linear_attention", "full_attention", "linear_attention"])


DENSE = {  # model_type: (config, model, what sets it apart)
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_theta=500000.0)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(rope_theta=1e6)),  # q/k/v biases
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(rope_theta=1e6)),  # q/k norms
    # sliding windows of 8 keys (the 75- and 40-token tests reach well past them): Mistral's on every layer, Qwen2's
    # from max_window_layers on (its first layer full), Ministral's by layer_types
    "mistral_swa": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=8,
                                                                                      rope_theta=1e6)),
    "qwen2_swa": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        rope_theta=1e6, use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3_swa": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        rope_theta=1e6, use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    # Ministral: Mistral's blocks, sliding and full layers by layer_types
    "ministral": (transformers.MinistralConfig, transformers.MinistralForCausalLM, dict(
        rope_theta=1e6, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    # RoPE scalings, stretched from 16 positions so the 75-token test reaches past the original context
    "llama31": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "qwen3_yarn": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=16),
        max_position_embeddings=64)),
    # Cohere2 dense (Command R7B): one LayerNorm a layer feeding attention and MLP in parallel, RoPE on pairs on the
    # sliding layers (8 keys) only, the logits times its scale, tied
    "cohere2": (transformers.Cohere2Config, transformers.Cohere2ForCausalLM, dict(
        rope_theta=5e4, sliding_window=8, layer_types=["sliding_attention", "full_attention"], logit_scale=0.5)),
    # ERNIE-4.5 dense: Llama's blocks, RoPE on channel pairs, tied embeddings
    "ernie4_5": (transformers.Ernie4_5Config, transformers.Ernie4_5ForCausalLM, dict(rope_theta=5e5)),
    # GLM-4 (0414): norms around each sublayer (its own names), q/k/v biases, RoPE on pairs of half of each head,
    # gate/up fused in its checkpoints
    "glm4": (transformers.Glm4Config, transformers.Glm4ForCausalLM, dict(rope_theta=1e4, pad_token_id=0)),
    # Phi-3 / Phi-4: Llama's blocks with q/k/v and gate/up fused in its checkpoints, RoPE on three quarters of each
    # head (Phi-4-mini's share), a window of 8 keys over every layer
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(
        rope_theta=1e4, partial_rotary_factor=0.75, sliding_window=8, pad_token_id=0)),
    # SmolLM3: Llama's blocks, every second layer without RoPE
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM, dict(
        rope_theta=1e6, no_rope_layer_interval=2, pad_token_id=0)),
    # EXAONE 4.0: norms after each sublayer, per-head q/k norms, a sliding layer (8 keys, rotated) then a full one
    # without RoPE
    "exaone4": (transformers.Exaone4Config, transformers.Exaone4ForCausalLM, dict(
        rope_theta=1e6, sliding_window=8, sliding_window_pattern=2)),
    # Granite 3.x dense: Llama's blocks with the four multipliers (values away from 1)
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM, dict(
        rope_theta=10000.0, embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.5,
        logits_scaling=4.0)),
    # Gemma 1: Llama's blocks with (1 + w) norms, GeGLU, the embedding times √32, tied
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, dict(rope_theta=10000.0)),
    # OLMo 2: norms after each sublayer, q/k normed over all heads together; OLMo 3: and a sliding layer (8 keys)
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, dict(rope_theta=500000.0)),
    "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM, dict(
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], rope_theta=500000.0)),
    # Gemma 3: sandwich (1 + w) norms, GeGLU, q·k scaled by 1/√12, a sliding layer (8 keys, RoPE at 1e4 unscaled)
    # then a full one (RoPE at 1e6, linear ×4, in the releases' legacy fields), the embedding times √32, tied
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        query_pre_attn_scalar=12, sliding_window=8, sliding_window_pattern=2, rope_theta=1e6,
        rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 4.0}, max_position_embeddings=64)),
}
# DeepSeek-V3: v narrower than q·k (6 vs 12: the padded flash path), 4 groups of 2 experts, 2 of them chosen; YaRN
DEEPSEEK = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8,
                n_group=4, topk_group=2, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                first_k_dense_replace=1, intermediate_size=40, num_hidden_layers=3, routed_scaling_factor=2.5,
                rms_norm_eps=1e-6, max_position_embeddings=64,
                rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32, beta_slow=1,
                                     mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=16))
MLA_ARCHS = {"deepseek_v3": DEEPSEEK,  # Moonlight: no q LoRA, one expert group, plain RoPE
             "moonlight": {**DEEPSEEK, "q_lora_rank": None, "n_group": 1, "topk_group": 1,
                           "rope_parameters": dict(rope_type="default", rope_theta=50000.0)}}
# GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's blocks, its dense layers given by type (here the first), one expert
# group, scaling 1.8, plain RoPE
GLM_LITE = {k: v for k, v in DEEPSEEK.items() if k != "first_k_dense_replace"} | {
    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.8, "mlp_layer_types": ["dense", "sparse", "sparse"],
    "rope_parameters": dict(rope_type="default", rope_theta=1e6)}
# DeepSeek sparse attention: DeepSeek-V3's test shape with an indexer of 16 heads of 8 channels keeping 8 keys a query
# (the 75- and 40-token tests select), RoPE on the index channels in halves (V3.2) or pairs (GLM-5). Sixteen heads, so
# that no two scores tie: equal scores go to the earlier key here and to torch.topk's choice in transformers (with 3
# heads, 1 key in 8 scores exactly 0, every head's ReLU at zero)
DSA = dict(DEEPSEEK, index_topk=8, index_n_heads=16, index_head_dim=8)
DSA_ARCHS = {"deepseek_v32": (transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM, DSA),
             "glm_moe_dsa": (transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM, DSA),
             # its third layer reuses the second's selection (GLM's "shared" indexer layers: no indexer of its own)
             "glm_moe_dsa_shared": (transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM,
                                    dict(DSA, indexer_types=["full", "full", "shared"])),
             # A.X K2: the query projection fused with a gate on each head's output (from the q LoRA's normed and
             # raw latents), block norms with a low-rank gate of rank 4; its checkpoints' names (`q_b_proj`,
             # `W_down`, `W_up`) as transformers saves them
             "axk2": (transformers.AXK2Config, transformers.AXK2ForCausalLM, dict(DSA, gated_norm_rank=4))}
# DeepSeek-V2: softmax routing in 2 groups of 4 experts (each scored by its best), the 2 experts from the best group
# only (the limit binds: V2's own keeps 3 groups of 8 for 6 experts), weights not renormalized, times 16 (V2's
# factor); V2-Lite: no q LoRA, plain top-k ("greedy"), plain RoPE
DEEPSEEK_V2 = {"deepseek_v2": {**DEEPSEEK, "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1,
                               "routed_scaling_factor": 16.0, "norm_topk_prob": False},
               "deepseek_v2_lite": {**DEEPSEEK, "q_lora_rank": None, "topk_method": "greedy", "n_group": None,
                                    "topk_group": None, "routed_scaling_factor": 1.0, "norm_topk_prob": False,
                                    "rope_parameters": dict(rope_type="default", rope_theta=10000.0)}}
# Llama 4: chunks of 16 positions on the RoPE layers (the 75-token test crosses four), a NoPE layer whose query
# temperature changes every 8 positions (floor_scale 8); Scout's form: every layer MoE, q/k at unit RMS, here 2 of 6
# experts a token (the published top 1 is Maverick's test); Maverick's: MoE every second layer (dense ones between),
# no q/k norm, llama3 RoPE scaling
LLAMA4_BASE = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   num_local_experts=6, intermediate_size=16, intermediate_size_mlp=40, num_hidden_layers=4,
                   no_rope_layers=[1, 1, 0, 1], attention_chunk_size=16, floor_scale=8, attn_scale=0.25,
                   rms_norm_eps=1e-5, max_position_embeddings=256)
LLAMA4 = {"llama4": {**LLAMA4_BASE, "num_experts_per_tok": 2, "interleave_moe_layer_step": 1, "use_qk_norm": True,
                     "rope_parameters": dict(rope_type="default", rope_theta=500000.0)},
          "llama4_maverick": {**LLAMA4_BASE, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
                              "use_qk_norm": False, "rope_parameters": dict(
                                  rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=16)}}
# Granite 3.x MoE: its four multipliers away from 1 (the embedding ×3, attention's scale 0.2 for 1/√16, each branch
# ×0.5 before its residual add, the logits ÷2.5); granitemoeshared adds a shared expert
GRANITE = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=16,
               num_local_experts=6, num_experts_per_tok=2, num_hidden_layers=2, embedding_multiplier=3.0,
               attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.5, rms_norm_eps=1e-6)
# Hunyuan-A13B: q/k norms after RoPE, a shared expert of the experts' width, NTK-alpha RoPE (alpha 1000: the base
# 1e4 stretched to 1e4 · 1000^(16/14)), top-k as a per-layer list
HUNYUAN = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               intermediate_size=16, num_experts=6, moe_topk=[2, 2], num_hidden_layers=2, rms_norm_eps=1e-5,
               rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, alpha=1000.0, factor=1.0))
# Qwen2-MoE with a dense layer between MoE ones (decoder_sparse_step 2)
QWEN2_SPARSE = dict(decoder_sparse_step=2, num_hidden_layers=4, intermediate_size=40)
# the shape's arch where it is not the name
ARCH = {"moonlight": "deepseek_v3", "mixtral_swa": "mixtral", **{a: "deepseek_v3" for a in DEEPSEEK_V2}, **{a: "dense" for a in DENSE},
        "llama4_maverick": "llama4", "qwen2_moe_sparse": "qwen2_moe", "glm4_moe_lite": "deepseek_v3",
        **{a: "deepseek_v3" for a in DSA_ARCHS},
        "granitemoeshared": "granitemoe", "olmoe_clip": "olmoe", "hunyuan_v1_moe": "hunyuan_moe", "dots1": "glm4_moe", "granitemoe_swa": "granitemoe",
        "solar_open": "glm4_moe", "mimo_v2_flash": "glm4_moe", "hy_v3": "glm4_moe",
        "exaone_moe": "glm4_moe", "afmoe": "glm4_moe", "flex_olmo": "olmoe", "cohere2_moe": "qwen3_moe",
        "cohere2_moe_sigmoid": "qwen3_moe", "kimi_linear": "deepseek_v3", "mistral4": "deepseek_v3",
        "axk1": "deepseek_v3", "mellum": "qwen3_moe",
        "laguna": "glm4_moe"}


def _hf_model(arch: str):
    if arch == "qwen3_5_moe":
        cfg = transformers.Qwen3_5MoeTextConfig(**COMMON, **LINEAR)
        cls = transformers.Qwen3_5MoeForCausalLM
    elif arch == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(**COMMON, **LINEAR, intermediate_size=24, norm_topk_prob=True,
                                           partial_rotary_factor=0.25)
        cls = transformers.Qwen3NextForCausalLM
    elif arch == "qwen3_5":
        dense = {k: v for k, v in COMMON.items() if not k.startswith(("num_experts", "moe_"))}
        linear = {k: v for k, v in LINEAR.items() if not k.startswith("shared_")}
        cfg = transformers.Qwen3_5TextConfig(**dense, **linear, intermediate_size=40)
        cls = transformers.Qwen3_5ForCausalLM
    elif arch in ("mixtral", "mixtral_swa"):  # Mixtral's own names: num_local_experts, intermediate_size the experts'
        # width; with a sliding window of 8 keys on every layer
        moe = {k: v for k, v in COMMON.items() if not k.startswith(("num_experts", "moe_"))}
        cfg = transformers.MixtralConfig(**moe, num_local_experts=6, num_experts_per_tok=2, intermediate_size=16,
                                         num_hidden_layers=2, rope_theta=1e6,
                                         sliding_window=8 if arch == "mixtral_swa" else None)
        cls = transformers.MixtralForCausalLM
    elif arch in MLA_ARCHS:
        cfg = transformers.DeepseekV3Config(**MLA_ARCHS[arch])
        cls = transformers.DeepseekV3ForCausalLM
    elif arch in DSA_ARCHS:
        config, cls, fields = DSA_ARCHS[arch]
        cfg = config(**fields)
    elif arch == "glm4_moe_lite":
        cfg = transformers.Glm4MoeLiteConfig(**GLM_LITE)
        cls = transformers.Glm4MoeLiteForCausalLM
    elif arch in DEEPSEEK_V2:
        cfg = transformers.DeepseekV2Config(**DEEPSEEK_V2[arch])
        cls = transformers.DeepseekV2ForCausalLM
    elif arch == "gpt_oss":  # sinks, sliding (window 8) and full layers, biased router and experts, clamped GLU
        attn = {k: v for k, v in COMMON.items() if not k.startswith(("num_experts", "moe_"))}
        cfg = transformers.GptOssConfig(**attn, num_local_experts=6, num_experts_per_tok=2, intermediate_size=16,
                                        num_hidden_layers=2, sliding_window=8, max_position_embeddings=512,
                                        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0,
                                                             beta_fast=32.0, beta_slow=1.0, truncate=False,
                                                             original_max_position_embeddings=16))
        cls = transformers.GptOssForCausalLM
    elif arch == "ernie4_5_moe":  # softmax scores steered by a correction bias, 2 shared experts, a dense first
        # layer, interleaved RoPE, tied embeddings
        moe = {k: v for k, v in COMMON.items() if k not in ("num_experts", "num_experts_per_tok")}
        cfg = transformers.Ernie4_5_MoeConfig(**moe, moe_num_experts=6, moe_k=2, moe_num_shared_experts=2,
                                              moe_layer_start_index=1, moe_layer_end_index=2, intermediate_size=40,
                                              num_hidden_layers=3, tie_word_embeddings=True,
                                              rope_parameters=dict(rope_type="default", rope_theta=500000.0))
        cls = transformers.Ernie4_5_MoeForCausalLM
    elif arch in ("olmoe", "olmoe_clip"):  # q/k norms over all heads together (the head width hidden / heads, as
        # OLMoE's norms need); olmoe_clip: q, k (normed) and v clamped at ±0.5, which cuts a share of each
        moe = {k: v for k, v in COMMON.items() if k not in ("head_dim", "moe_intermediate_size")}
        cfg = transformers.OlmoeConfig(**moe, num_hidden_layers=2, intermediate_size=16, attention_bias=True,
                                       clip_qkv=0.5 if arch == "olmoe_clip" else None,
                                       rope_parameters=dict(rope_type="default", rope_theta=10000.0))
        cls = transformers.OlmoeForCausalLM
    elif arch == "minimax_m2":  # q/k norms over all heads together, half of each head rotated, sigmoid routing
        # steered by a correction bias, Mixtral's names for the block and its experts
        moe = {k: v for k, v in COMMON.items() if not k.startswith(("num_experts", "moe_"))}
        cfg = transformers.MiniMaxM2Config(**moe, num_local_experts=6, num_experts_per_tok=2, intermediate_size=16,
                                           num_hidden_layers=2, rope_parameters=dict(
                                               rope_type="default", rope_theta=5e6, partial_rotary_factor=0.5))
        cls = transformers.MiniMaxM2ForCausalLM
    elif arch in ("qwen2_moe", "qwen2_moe_sparse"):  # q/k/v biases, a gated shared expert, top-k weights not
        # renormalized
        sparse = QWEN2_SPARSE if arch == "qwen2_moe_sparse" else dict(num_hidden_layers=2, intermediate_size=24)
        cfg = transformers.Qwen2MoeConfig(**COMMON, **sparse, shared_expert_intermediate_size=24,
                                          rope_parameters=dict(rope_type="default", rope_theta=1e6))
        cls = transformers.Qwen2MoeForCausalLM
    elif arch == "hunyuan_v1_moe":
        cfg, cls = transformers.HunYuanMoEV1Config(**HUNYUAN), transformers.HunYuanMoEV1ForCausalLM
    elif arch == "granitemoe":
        cfg, cls = transformers.GraniteMoeConfig(**GRANITE), transformers.GraniteMoeForCausalLM
    elif arch == "granitemoe_swa":  # Granite's multipliers, a sink logit per head on every layer, windows of 8 on the
        # sliding layers (each 2nd from the first full), the full layers without RoPE, the sliding ones at base 1e4
        cfg = transformers.GraniteMoeSWAConfig(**GRANITE, shared_intermediate_size=24, sliding_window=8,
                                               layer_types=["full_attention", "sliding_attention"],
                                               layer_rope_theta=[0, 10000.0])
        cls = transformers.GraniteMoeSWAForCausalLM
    elif arch == "granitemoeshared":
        cfg = transformers.GraniteMoeSharedConfig(**GRANITE, shared_intermediate_size=24)
        cls = transformers.GraniteMoeSharedForCausalLM
    elif arch in LLAMA4:
        cfg = transformers.Llama4TextConfig(**LLAMA4[arch])
        cls = transformers.Llama4ForCausalLM
    elif arch == "glm4_moe":  # q/k/v biases, half the head rotated, sigmoid routing in 2 groups
        cfg = transformers.Glm4MoeConfig(**{k: v for k, v in COMMON.items() if k != "num_experts"},
                                         n_routed_experts=6, n_group=2, topk_group=1, n_shared_experts=1,
                                         first_k_dense_replace=1, intermediate_size=40, num_hidden_layers=3,
                                         attention_bias=True, routed_scaling_factor=1.5, partial_rotary_factor=0.5)
        cls = transformers.Glm4MoeForCausalLM
    elif arch == "dots1":  # GLM-4.5's block with Qwen3's per-head q/k norms, every channel rotated; 2 groups
        cfg = transformers.Dots1Config(**{k: v for k, v in COMMON.items() if k != "num_experts"},
                                       n_routed_experts=6, n_group=2, topk_group=1, n_shared_experts=1,
                                       first_k_dense_replace=1, intermediate_size=40, num_hidden_layers=3,
                                       routed_scaling_factor=1.5, norm_topk_prob=True)
        cls = transformers.Dots1ForCausalLM
    elif arch == "solar_open":  # GLM-4.5's MoE (2 groups) under Llama's attention with q/k/v biases; no dense layer
        cfg = transformers.SolarOpenConfig(**{k: v for k, v in COMMON.items() if k != "num_experts"},
                                           n_routed_experts=6, n_group=2, topk_group=1, n_shared_experts=1,
                                           num_hidden_layers=2, attention_bias=True, routed_scaling_factor=1.5)
        cls = transformers.SolarOpenForCausalLM
    elif arch == "mimo_v2_flash":  # sliding layers (window 8) with twice the KV heads, sinks and their own RoPE base;
        # v narrower than q·k (8 of 12), the values scaled; a dense first layer; 2 groups of routed experts
        cfg = transformers.MiMoV2FlashConfig(
            **{k: v for k, v in COMMON.items() if k not in ("num_experts", "head_dim")}, head_dim=12, v_head_dim=8,
            n_routed_experts=6, n_group=2, topk_group=1, intermediate_size=40, num_hidden_layers=3,
            routed_scaling_factor=1.5, sliding_window=8, attention_value_scale=0.6,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            rope_parameters={"full_attention": dict(rope_type="default", rope_theta=5e6, partial_rotary_factor=0.5),
                             "sliding_attention": dict(rope_type="default", rope_theta=1e4,
                                                       partial_rotary_factor=0.5)})
        cls = transformers.MiMoV2FlashForCausalLM
    elif arch == "hy_v3":  # per-head q/k norms, a shared expert, a dense first layer, the weights scaled by 1.5
        cfg = transformers.HYV3Config(**COMMON, intermediate_size=40, num_hidden_layers=3, num_shared_experts=1,
                                      router_scaling_factor=1.5)
        cls = transformers.HYV3ForCausalLM
    elif arch == "exaone_moe":  # K-EXAONE: sliding layers (window 8) rotated, every 2nd layer full and without RoPE,
        # per-head q/k norms, a dense first layer, a shared expert, 2 groups of routed experts
        cfg = transformers.ExaoneMoeConfig(**COMMON, intermediate_size=40, num_hidden_layers=4, sliding_window=8,
                                           sliding_window_pattern=2, n_group=2, topk_group=1, routed_scaling_factor=1.5)
        cls = transformers.ExaoneMoeForCausalLM
    elif arch == "cohere2_moe":  # Cohere's: one LayerNorm a layer feeding attention and experts in parallel, RoPE on
        # channel pairs on the sliding layers (window 8) only, the logits scaled, a shared expert averaged in, tied
        cfg = transformers.Cohere2MoeConfig(
            **{k: v for k, v in COMMON.items() if k not in ("moe_intermediate_size", "rms_norm_eps")},
            intermediate_size=16, num_hidden_layers=4, sliding_window=8, sliding_window_pattern=2,
            num_shared_experts=1, shared_expert_combination_strategy="average", logit_scale=0.25,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cls = transformers.Cohere2MoeForCausalLM
    elif arch == "cohere2_moe_sigmoid":  # the same blocks with sigmoid expert selection (renormalized over the k),
        # a dense first layer of its own width (its attention full: the prefix's own pattern), RMSNorm, shared summed
        cfg = transformers.Cohere2MoeConfig(
            **{k: v for k, v in COMMON.items() if k != "moe_intermediate_size"},
            intermediate_size=16, num_hidden_layers=4, sliding_window=8, sliding_window_pattern=2,
            num_shared_experts=1, shared_expert_combination_strategy="sum", logit_scale=0.25,
            expert_selection_fn="sigmoid", norm_topk_prob=True, first_k_dense_replace=1,
            prefix_dense_intermediate_size=24, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cls = transformers.Cohere2MoeForCausalLM
    elif arch == "afmoe":  # Arcee's Trinity: sandwich norms, the output gate, RoPE on the sliding layers (window 8)
        # only, per-head q/k norms, a dense first layer, a shared expert, muP's √h on the embedding
        cfg = transformers.AfmoeConfig(**COMMON, intermediate_size=40, num_hidden_layers=4, num_dense_layers=1,
                                       num_shared_experts=1, sliding_window=8, global_attn_every_n_layers=2,
                                       route_scale=1.5, mup_enabled=True)
        cls = transformers.AfmoeForCausalLM
    elif arch == "laguna":  # Laguna: a softplus gate per query head, full layers (4 heads, half of each rotated at
        # base 5e5) and sliding ones (window 8, 6 heads, all rotated at 1e4), a dense first layer, sigmoid routing
        # with a correction bias, the routed experts' output times 1.5, a shared expert of its own width
        cfg = transformers.LagunaConfig(
            **{k: v for k, v in COMMON.items()}, num_hidden_layers=4, intermediate_size=40, sliding_window=8,
            shared_expert_intermediate_size=24, moe_routed_scaling_factor=1.5, gating="per-head",
            max_position_embeddings=64, layer_types=["full_attention"] + ["sliding_attention"] * 3,
            mlp_layer_types=["dense"] + ["sparse"] * 3, num_attention_heads_per_layer=[4, 6, 6, 6],
            rope_parameters={"full_attention": dict(rope_type="default", rope_theta=500000.0,
                                                    partial_rotary_factor=0.5),
                             "sliding_attention": dict(rope_type="default", rope_theta=10000.0,
                                                       partial_rotary_factor=1.0)})
        cls = transformers.LagunaForCausalLM
    elif arch == "mellum":  # Mellum 2: Qwen3-MoE's blocks, three sliding layers (window 8) to a full one, the full
        # layers' YaRN (×4 from 16 positions, an explicit attention factor) and base 5e5, the sliding ones plain at 1e4
        cfg = transformers.MellumConfig(
            **{k: v for k, v in COMMON.items()}, num_hidden_layers=4, intermediate_size=40, sliding_window=8,
            max_position_embeddings=64, norm_topk_prob=True,
            layer_types=["sliding_attention"] * 3 + ["full_attention"], mlp_layer_types=["sparse"] * 4,
            rope_parameters={"full_attention": dict(rope_type="yarn", rope_theta=500000.0, factor=4.0,
                                                    original_max_position_embeddings=16, beta_fast=32.0,
                                                    beta_slow=1.0, attention_factor=1.2),
                             "sliding_attention": dict(rope_type="default", rope_theta=10000.0)})
        cls = transformers.MellumForCausalLM
    elif arch == "axk1":  # A.X K1: DeepSeek-V3's test shape with an RMSNorm on each MoE block's output
        cfg = transformers.AXK1Config(**{k: v for k, v in DEEPSEEK.items() if k != "num_mtp_layers"})
        cls = transformers.AXK1ForCausalLM
    elif arch == "mistral4":  # DeepSeek-V3's MLA (q LoRA, v narrower than q·k, YaRN from 16 positions) under a
        # softmax router (renormalized, scaled 1.5), a dense first layer, the query scale by position (its period
        # 16: the 75- and 40-token tests cross several)
        mla = {k: v for k, v in DEEPSEEK.items() if k not in ("n_group", "topk_group", "routed_scaling_factor",
                                                             "rope_parameters", "max_position_embeddings")}
        cfg = transformers.Mistral4Config(**mla, n_group=1, topk_group=1, routed_scaling_factor=1.5,
                                          max_position_embeddings=64, pad_token_id=0, rope_parameters=dict(
                                              rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32,
                                              beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
                                              original_max_position_embeddings=16, llama_4_scaling_beta=0.1))
        cls = transformers.Mistral4ForCausalLM
    elif arch == "kimi_linear":  # KDA layers (2 heads of 8, 4-wide convs) around a RoPE-free MLA layer (no q LoRA),
        # a dense first layer, sigmoid routing with a correction bias, one shared expert; the releases' config form
        cfg = transformers.KimiLinearConfig(
            vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
            kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, num_local_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1, intermediate_size=40,
            num_hidden_layers=4, routed_scaling_factor=2.5, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, first_k_dense_replace=1,
            linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 2, "head_dim": 8,
                                "short_conv_kernel_size": 4})
        cls = transformers.KimiLinearForCausalLM
    elif arch == "flex_olmo":  # OLMoE's blocks with OLMo-2's norms after each sublayer
        cfg = transformers.FlexOlmoConfig(**{k: v for k, v in COMMON.items() if k != "moe_intermediate_size"},
                                          intermediate_size=16, num_hidden_layers=2, pad_token_id=1, eos_token_id=2)
        cls = transformers.FlexOlmoForCausalLM
    elif arch in DENSE:
        config_cls, cls, extra = DENSE[arch]
        dense = {k: v for k, v in COMMON.items() if not k.startswith(("num_experts", "moe_"))}
        cfg = config_cls(**dense, **extra, num_hidden_layers=2, intermediate_size=40)
    else:
        cfg = transformers.Qwen3MoeConfig(**COMMON, num_hidden_layers=2, norm_topk_prob=True, intermediate_size=24)
        cls = transformers.Qwen3MoeForCausalLM
    return _built(cls, cfg)


def _built(cls, cfg):
    """transformers' `cls` of `cfg`, fp32, in eval mode, seeded, with every parameter moved off its init (norm
    weights 0/1, zero routers) so that all of it counts."""
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name or "A_log" in name or "dt_bias" in name else 0.1))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # steers the choice: different from zero, so it counts
                b.copy_(torch.randn_like(b) * 0.1)
    return model


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next", "qwen3_moe", "qwen2_moe", "qwen2_moe_sparse", "olmoe",
                                  "olmoe_clip",
                                  "ernie4_5_moe", "minimax_m2", "mixtral", "mixtral_swa", *MLA_ARCHS, *DEEPSEEK_V2, "glm4_moe_lite",
                                  *DSA_ARCHS, "glm4_moe", "dots1", "solar_open", "mimo_v2_flash", "hy_v3", "exaone_moe",
                                  "afmoe", "flex_olmo", "cohere2_moe", "cohere2_moe_sigmoid", "gpt_oss", *LLAMA4, "granitemoe", "granitemoeshared",
                                  "kimi_linear", "mistral4", "axk1", "mellum", "laguna",
                                  "granitemoe_swa", "hunyuan_v1_moe",
                                  "qwen3_5", *DENSE])
def test_logits_and_loss_match_transformers(arch, tmp_path):
    hf = _hf_model(arch)
    hf.save_pretrained(tmp_path / "hf")
    shape = from_hf_config(tmp_path / "hf" / "config.json")
    assert shape.arch == ARCH.get(arch, arch)
    ours = build_model(shape, seed=1)
    load_hf_checkpoint(ours, tmp_path / "hf")
    ours.eval()

    T = 75  # crosses the 64-token chunk of the delta rule
    ids = torch.randint(0, shape.vocab_size, (1, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = hf(input_ids=ids, labels=ids)
        hidden = ours(ids[0], Packing.from_lengths([T]))
        logits = hidden @ ours.lm_head.weight.T / logits_divisor(shape)  # Granite divides its logits
    err = (logits - out.logits[0]).abs().max().item()
    assert err < 1e-4, f"{arch}: max |logits − transformers| = {err:.3e}"

    targets = torch.cat([ids[0, 1:], torch.tensor([-1])])
    for mode in ("fused", "naive"):
        with torch.no_grad():
            logp = token_logprobs(hidden, ours.lm_head.weight, targets, mode=mode, temperature=logits_divisor(shape))
        loss = -logp[:-1].mean()
        assert abs(loss.item() - out.loss.item()) < 1e-5, (mode, loss.item(), out.loss.item())

    # export back: transformers reads our files and computes the same logits
    export_hf_checkpoint(ours, tmp_path / "ours")
    if shape.sigmoid_router is not None:  # a bf16 export keeps the correction bias in fp32, bit for bit
        from safetensors import safe_open

        export_hf_checkpoint(ours, tmp_path / "bf16", dtype=torch.bfloat16)
        f = safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt")
        # ERNIE's [1, E] beside the router; MiniMax-M2's on its block
        where = {"ernie4_5_moe": "mlp.moe_statics.e_score_correction_bias", "hy_v3": "mlp.expert_bias", "afmoe": "mlp.expert_bias",
                 "exaone_moe": "mlp.e_score_correction_bias",
                 "minimax_m2": "block_sparse_moe.e_score_correction_bias",
                 "kimi_linear": "block_sparse_moe.gate.e_score_correction_bias",
                 "laguna": "mlp.experts.e_score_correction_bias"}.get(
            arch, "mlp.gate.e_score_correction_bias")
        bias = f.get_tensor(f"model.layers.1.{where}").reshape(-1)
        assert bias.dtype == torch.float32 and torch.equal(bias, ours.layers[1].mlp.gate.e_score_correction_bias)
        router = {"minimax_m2": "block_sparse_moe.gate", "hy_v3": "mlp.router.gate", "afmoe": "mlp.router.gate",
                  "kimi_linear": "block_sparse_moe.gate"}.get(arch, "mlp.gate")
        assert f.get_tensor(f"model.layers.1.{router}.weight").dtype == torch.bfloat16
    back = type(hf).from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    with torch.no_grad():
        err_back = (back(input_ids=ids).logits - out.logits).abs().max().item()
    assert err_back < 1e-5, f"{arch}: re-imported transformers model differs by {err_back:.3e}"


@pytest.mark.parametrize("config_cls", [transformers.Qwen2Config, transformers.Qwen3Config])
def test_a_qwen_window_without_layer_types_slides_what_transformers_slides(config_cls, tmp_path):
    """A Qwen2/Qwen3 config.json with use_sliding_window and no layer_types (the older releases write none) slides
    the layers transformers derives: from max_window_layers on."""
    import json

    cfg = config_cls(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     num_hidden_layers=4, intermediate_size=40, use_sliding_window=True, sliding_window=8,
                     max_window_layers=1)
    d = cfg.to_dict()
    d.pop("layer_types")
    (tmp_path / "config.json").write_text(json.dumps(d))
    shape = from_hf_config(tmp_path / "config.json")
    assert shape.layer_types == tuple(cfg.layer_types) == ("full_attention",) + ("sliding_attention",) * 3
    assert shape.sliding_window == 8


def test_a_glm45_config_without_its_defaults_reads_as_transformers_builds_it(tmp_path):
    """A GLM-4.5 config.json without partial_rotary_factor or first_k_dense_replace: transformers rotates half of
    each head and keeps one dense layer; Solar Open (GLM-4.5's MoE) rotates every channel and has none."""
    import json

    for config_cls, prf, first in ((transformers.Glm4MoeConfig, 0.5, 1), (transformers.SolarOpenConfig, 1.0, 0)):
        cfg = config_cls(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, num_hidden_layers=3)
        d = cfg.to_dict()
        for k in ("partial_rotary_factor", "first_k_dense_replace"):
            d.pop(k, None)
        d["rope_parameters"].pop("partial_rotary_factor", None)
        (tmp_path / "config.json").write_text(json.dumps(d))
        shape = from_hf_config(tmp_path / "config.json")
        model = config_cls(**d)
        assert shape.partial_rotary_factor == prf == getattr(model, "partial_rotary_factor", 1.0)
        assert shape.first_dense_layers == first == getattr(model, "first_k_dense_replace", 0)


def test_load_errors_name_the_tensors(tmp_path):
    hf = _hf_model("qwen3_5_moe")
    hf.save_pretrained(tmp_path / "hf")
    shape = from_hf_config(tmp_path / "hf" / "config.json")
    wrong = build_model(shape.model_copy(update={"expert_ffn": 8}))
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    with pytest.raises(ValueError, match="shape mismatch: layers.0.mlp.experts.gate_up_proj"):
        load_hf_checkpoint(wrong, tmp_path / "hf")
    assert all(torch.equal(v, before[k]) for k, v in wrong.state_dict().items())  # checked before any copy
    with pytest.raises(ValueError, match="no safetensors checkpoint"):
        load_hf_checkpoint(wrong, tmp_path)


def test_a_sharded_checkpoint_loads_layer_by_layer(tmp_path):
    """A checkpoint saved in several files (an index, as large models are published) loads to the same weights as
    the same checkpoint in one file; the loader reads it one decoder layer at a time."""
    hf = _hf_model("qwen3_5_moe")
    hf.save_pretrained(tmp_path / "one")
    hf.save_pretrained(tmp_path / "many", max_shard_size="100KB")
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    shape = from_hf_config(tmp_path / "one" / "config.json")
    _load_the_same(shape, tmp_path / "one", tmp_path / "many")


def _pack_int4_reference(q: torch.Tensor) -> torch.Tensor:
    """int4 values [O, I] (I a multiple of 8) packed as compressed-tensors writes them, by plain integer arithmetic:
    word j of a row holds values 8j..8j+7, value i of the word (stored + 8) at bits 4i..4i+3."""
    rows = []
    for row in q.tolist():
        words = []
        for j in range(0, len(row), 8):
            v = sum((row[j + i] + 8) << (4 * i) for i in range(8))
            words.append(v - (1 << 32) if v >= 1 << 31 else v)  # the word's bits as a signed int32
        rows.append(words)
    return torch.tensor(rows, dtype=torch.int32)


def _load_the_same(shape, one, other):
    """Models of `shape` built from different seeds and loaded from the checkpoints `one` and `other` hold the same
    weights, bit for bit; returns the first."""
    a, b = build_model(shape, seed=1), build_model(shape, seed=2)
    load_hf_checkpoint(a, one)
    load_hf_checkpoint(b, other)
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    return a


def test_a_pack_quantized_int4_checkpoint_loads_dequantized(tmp_path):
    """Kimi-K2.5's int4 release in miniature: a DeepSeek-V3 text model under `language_model.` beside a vision
    tower and projector (skipped), its routed experts compressed-tensors pack-quantized (4-bit symmetric integers, a
    scale per group of 8 inputs here, 32 in the release; `weight_packed`, `weight_scale`, `weight_shape`), the rest
    bf16 as the release's ignore list keeps them. It loads to exactly each integer times its group's scale (checked
    against weights written unquantized); scales missing, or an asymmetric form, are refused in one line."""
    import json

    from safetensors.torch import load_file, save_file

    hf = _hf_model("deepseek_v3")
    hf.save_pretrained(tmp_path / "hf")
    sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    gen = torch.Generator().manual_seed(4)
    packed, want = {}, {}
    for k, w in sd.items():
        name = "language_model." + k  # model.layers… → language_model.model.layers…, lm_head → language_model.lm_head
        if ".mlp.experts." not in k:
            packed[name] = want[k] = w
            continue
        o, i = w.shape
        scale = (w.float().view(o, i // 8, 8).abs().amax(-1) / 7 + 1e-4).to(torch.bfloat16)  # [O, I/8]
        q = torch.randint(-8, 8, (o, i), generator=gen, dtype=torch.int32)  # every code, both extremes
        base = name[: -len(".weight")]
        packed[base + ".weight_packed"] = _pack_int4_reference(q)
        packed[base + ".weight_scale"] = scale
        packed[base + ".weight_shape"] = torch.tensor([o, i], dtype=torch.int32)
        want[k] = (q.float() * scale.float().repeat_interleave(8, 1)).to(torch.bfloat16)
    packed["vision_tower.encoder.blocks.0.wqkv.weight"] = torch.ones(4, 4)
    packed["mm_projector.proj.0.weight"] = torch.ones(4, 4)
    (tmp_path / "int4").mkdir()
    save_file(packed, str(tmp_path / "int4" / "model.safetensors"))
    text = json.loads((tmp_path / "hf" / "config.json").read_text())
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "int", "symmetric": True, "group_size": 8, "strategy": "group"}}}}
    cfg = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"], "text_config": text,
           "quantization_config": quant}
    (tmp_path / "int4" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "want").mkdir()
    save_file(want, str(tmp_path / "want" / "model.safetensors"))
    shape = from_hf_config(tmp_path / "int4" / "config.json")
    a = _load_the_same(shape, tmp_path / "int4", tmp_path / "want")
    assert a.state_dict()["layers.1.mlp.experts.gate_up_proj"].abs().max() > 0
    del packed["language_model.model.layers.2.mlp.experts.1.up_proj.weight_scale"]
    save_file(packed, str(tmp_path / "int4" / "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj.weight_packed: packed integers without their weight_scale"):
        load_hf_checkpoint(a, tmp_path / "int4")
    quant["config_groups"]["group_0"]["weights"]["symmetric"] = False
    (tmp_path / "int4" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="symmetric False, group 8 are not read"):
        load_hf_checkpoint(a, tmp_path / "int4")


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "olmoe", "ernie4_5_moe", "minimax_m2", "mixtral", "mixtral_swa",
                                  "deepseek_v3", "deepseek_v2", "glm4_moe_lite", *DSA_ARCHS, "glm4_moe", "solar_open",
                                  "mimo_v2_flash", "hy_v3", "exaone_moe", "afmoe", "flex_olmo", "cohere2_moe", "cohere2_moe_sigmoid",
                                  "gpt_oss", "kimi_linear", "mistral4", "axk1", "mellum", "laguna",
                                  *LLAMA4, "granitemoeshared", "granitemoe_swa", "olmoe_clip", "hunyuan_v1_moe", "mistral_swa", "qwen2_swa", "qwen3_swa", "ministral",
                                  "gemma3", "olmo2", "olmo3", "gemma", "granite", "exaone4", "smollm3", "phi3", "glm4", "ernie4_5", "cohere2"])
def test_gradients_match_transformers(arch, tmp_path):
    """The backward too: every parameter's gradient of the mean next-token loss (ours through the fused head) equals
    transformers' (its loss.backward()), its fused expert tensors mapped onto our names by the loader's own map.
    OLMoE's and ERNIE-4.5's configs name a pad token (1 and 0, transformers' defaults), which the input holds twice:
    its embedding row gets no gradient from the lookup in either (ERNIE's tied head still updates it)."""
    from launch.hf_io import hf_to_ours

    hf = _hf_model(arch)
    hf.save_pretrained(tmp_path / "hf")
    shape = from_hf_config(tmp_path / "hf" / "config.json")
    ours = build_model(shape, seed=1)
    load_hf_checkpoint(ours, tmp_path / "hf")
    T = 40
    ids = torch.randint(0, shape.vocab_size, (1, T), generator=torch.Generator().manual_seed(3))
    assert shape.pad_token_id == {"olmoe": 1, "olmoe_clip": 1, "ernie4_5_moe": 0, "hunyuan_v1_moe": 0,
                                  "exaone_moe": 0, "flex_olmo": 1, "cohere2_moe": 0, "kimi_linear": 0, "mistral4": 0,
                                  "cohere2_moe_sigmoid": 0, "gemma3": 0, "olmo2": 1, "olmo3": 1, "gemma": 0, "smollm3": 0, "phi3": 0, "glm4": 0, "ernie4_5": 0, "cohere2": 0}.get(arch)
    if shape.pad_token_id is not None:
        ids[0, [3, 17]] = shape.pad_token_id
    hf.zero_grad()
    hf(input_ids=ids, labels=ids).loss.backward()
    # not ERNIE's bias; nor DSA's indexer, which runs without gradient in both
    want = hf_to_ours({n: p.grad for n, p in hf.named_parameters() if p.grad is not None}, ours)
    hidden = ours(ids[0], Packing.from_lengths([T]))
    targets = torch.cat([ids[0, 1:], torch.tensor([-1])])
    (-token_logprobs(hidden, ours.lm_head.weight, targets, mode="fused",
                     temperature=logits_divisor(shape))[:-1].mean()).backward()
    got = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys()
    assert all(p.grad is None for p in ours.parameters() if not p.requires_grad)
    for n, g in got.items():
        scale = want[n].abs().max().item()
        assert scale > 0 and (g - want[n]).abs().max().item() <= 1e-4 * scale + 1e-7, n
    if arch == "olmoe":  # untied: the pad row's gradient is exactly zero, where the other input tokens' are not
        row = got["embed_tokens.weight"]
        assert torch.equal(row[1], torch.zeros_like(row[1])) and row[ids[0, 0]].abs().max() > 0


def test_fp8_dequantization_by_hand_and_stacked():
    """Each fp8 value times the scale of its block, by hand on a 3 x 5 weight of 2 x 2 blocks (the last row and
    column blocks cut short); a stacked [E, O, I] weight (Step-3.7's experts) dequantizes as its experts one by one."""
    from launch.hf_io import dequantize_fp8

    w = torch.arange(15, dtype=torch.float32).reshape(3, 5).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 2.0, 4.0], [0.5, 0.25, 8.0]])
    want = torch.tensor([[0, 1, 4, 6, 16], [5, 6, 14, 16, 36], [5, 5.5, 3, 3.25, 112]], dtype=torch.float32)
    assert torch.equal(dequantize_fp8(w, scale, (2, 2)).float(), want)
    stacked = torch.randn(3, 5, 7).to(torch.float8_e4m3fn)
    scales = torch.rand(3, 3, 4) + 0.5
    got = dequantize_fp8(stacked, scales, (2, 2))
    assert got.shape == (3, 5, 7) and all(torch.equal(got[e], dequantize_fp8(stacked[e], scales[e], (2, 2)))
                                          for e in range(3))


def test_a_block_quantized_fp8_checkpoint_loads_dequantized(tmp_path):
    """A DeepSeek-V3-style fp8 release (float8_e4m3 weights, a `weight_scale_inv` per block of
    `quantization_config.weight_block_size`, here 8 × 8 with ragged edge blocks) loads to exactly the weights the
    blocks' scales give (checked against a block reshape, not the loader's broadcast), each within fp8's rounding
    of the original; an fp8 weight without its scales is refused in one line."""
    import json

    from safetensors.torch import load_file, save_file

    hf = _hf_model("deepseek_v3")
    hf.save_pretrained(tmp_path / "hf")
    sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    fp8, want = {}, {}
    for k, w in sd.items():
        quantize = w.dim() == 2 and ".layers." in k and "norm" not in k and not k.endswith("mlp.gate.weight")
        if not quantize:
            fp8[k] = want[k] = w
            continue
        o, i = w.shape
        po, pi = -o % 8, -i % 8  # ragged edges: pad to whole blocks to find each block's max
        blocks = torch.nn.functional.pad(w.float(), (0, pi, 0, po)).view((o + po) // 8, 8, (i + pi) // 8, 8)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0 + 1e-12
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        fp8[k] = q.view(o + po, i + pi)[:o, :i].contiguous()
        fp8[k[: -len(".weight")] + ".weight_scale_inv"] = scale
        want[k] = (q.float() * scale[:, None, :, None]).view(o + po, i + pi)[:o, :i].to(torch.bfloat16).contiguous()
    (tmp_path / "fp8").mkdir()
    save_file(fp8, str(tmp_path / "fp8" / "model.safetensors"))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [8, 8]}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "want").mkdir()
    save_file(want, str(tmp_path / "want" / "model.safetensors"))
    shape = from_hf_config(tmp_path / "fp8" / "config.json")
    a, orig = _load_the_same(shape, tmp_path / "fp8", tmp_path / "want"), build_model(shape, seed=3)
    load_hf_checkpoint(orig, tmp_path / "hf")
    sa = a.state_dict()
    so = orig.state_dict()
    for k in ("layers.1.self_attn.kv_b_proj.weight", "layers.2.mlp.experts.gate_up_proj",
              "layers.0.mlp.down_proj.weight"):
        err = ((sa[k] - so[k]).norm() / so[k].norm()).item()
        assert 0 < err < 0.05, (k, err)  # e4m3 keeps 3 mantissa bits: a few percent
    del fp8["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"]
    save_file(fp8, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(ValueError, match="kv_b_proj.weight: an fp8 tensor without its weight_scale_inv"):
        load_hf_checkpoint(a, tmp_path / "fp8")


@pytest.mark.parametrize("layout", ["release", "transformers"])
def test_a_llama4_multimodal_checkpoint_loads_its_text_model(layout, tmp_path):
    """Llama 4's multimodal checkpoints: Meta's release names the text model `language_model.model.*` and its head
    `language_model.lm_head.weight` beside `vision_model.*` and `multi_modal_projector.*`; transformers'
    `Llama4ForConditionalGeneration` writes `model.language_model.*`, `lm_head.weight`, `model.vision_model.*` and
    `model.multi_modal_projector.*`. Either loads to the text model's weights, the vision tower and projector
    skipped."""
    from safetensors.torch import load_file, save_file

    hf = _hf_model("llama4")
    hf.save_pretrained(tmp_path / "text")
    shape = from_hf_config(tmp_path / "text" / "config.json")
    want = build_model(shape, seed=1)
    load_hf_checkpoint(want, tmp_path / "text")
    text, prefix = load_file(str(tmp_path / "text" / "model.safetensors")), {
        "release": ("language_model.model.", "language_model.", ""),
        "transformers": ("model.language_model.", "", "model.")}[layout]
    body, head, other = prefix
    renamed = {(head + k if k == "lm_head.weight" else body + k.removeprefix("model.")): v for k, v in text.items()}
    renamed[other + "vision_model.patch_embedding.linear.weight"] = torch.zeros(4, 4)
    renamed[other + "multi_modal_projector.linear_1.weight"] = torch.zeros(4, 4)
    (tmp_path / "mm").mkdir()
    save_file(renamed, str(tmp_path / "mm" / "model.safetensors"))
    got = build_model(shape, seed=2)
    load_hf_checkpoint(got, tmp_path / "mm")
    sw, sg = want.state_dict(), got.state_dict()
    assert all(torch.equal(sw[k], sg[k]) for k in sw)


def _text_model_equals_the_multimodal_model(hf, shape, tmp_path, exported_as: str) -> None:
    """Ours, loaded from the multimodal checkpoint in tmp_path/hf, gives `hf`'s logits on text; exported, it is the
    text model `exported_as`, whose logits are the same."""
    ours = build_model(shape, seed=1)
    load_hf_checkpoint(ours, tmp_path / "hf")
    ours.eval()
    T = 40
    ids = torch.randint(0, shape.vocab_size, (1, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(input_ids=ids).logits[0]
        logits = ours(ids[0], Packing.from_lengths([T])) @ ours.lm_head.weight.T
    assert (logits - want).abs().max().item() < 1e-4
    export_hf_checkpoint(ours, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert type(back).__name__ == exported_as
    with torch.no_grad():
        assert (back(input_ids=ids).logits[0] - want).abs().max().item() < 1e-5


def test_a_glm45v_checkpoint_trains_its_text_model(tmp_path):
    """GLM-4.5V (`glm4v_moe`): GLM-4.5's blocks (q/k/v biases, half of each head rotated, sigmoid routing in 2
    groups, a shared expert, a dense first layer) under `model.language_model.`, its multimodal RoPE plain RoPE on
    text, the vision tower (`model.visual.`) skipped. Ours gives the multimodal model's logits on text; exported, it
    is a GLM-4.5 text model with the same logits."""
    text = {k: v for k, v in COMMON.items() if k != "num_experts"} | dict(
        n_routed_experts=6, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
        intermediate_size=40, num_hidden_layers=3, attention_bias=True, routed_scaling_factor=1.5,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                             mrope_section=[2, 1, 1]))
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
    hf = _built(transformers.Glm4vMoeForConditionalGeneration,
                transformers.Glm4vMoeConfig(text_config=text, vision_config=vision))
    hf.save_pretrained(tmp_path / "hf")
    shape = from_hf_config(tmp_path / "hf" / "config.json")
    assert (shape.arch, shape.hf_model_type, shape.partial_rotary_factor, shape.first_dense_layers) == (
        "glm4_moe", "glm4v_moe", 0.5, 1)
    _text_model_equals_the_multimodal_model(hf, shape, tmp_path, "Glm4MoeForCausalLM")


@pytest.mark.parametrize("layout", ["thinker", "release"])
def test_a_qwen3_omni_checkpoint_trains_its_thinkers_text_model(layout, tmp_path):
    """Qwen3-Omni (`qwen3_omni_moe`): its thinker's text model is Qwen3-VL-MoE's (Qwen3-MoE's blocks, multimodal
    RoPE plain on text), read from transformers' thinker save (`model.`, beside `audio_tower.` and `visual.`) or from
    the release's layout (all of it under `thinker.`, beside the talker and the code-to-wave model; the config's text
    model under `thinker_config`), the rest skipped. Ours gives the thinker's logits on text; exported, it is a
    Qwen3-MoE text model with the same logits."""
    import json

    from safetensors.torch import load_file, save_file

    text = {k: v for k, v in COMMON.items() if k != "moe_intermediate_size"} | dict(
        moe_intermediate_size=8, intermediate_size=24, num_hidden_layers=2, norm_topk_prob=True,
        rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[2, 3, 3], mrope_interleaved=True))
    audio = dict(num_mel_bins=8, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=16, d_model=16,
                 output_dim=32, downsample_hidden_size=8, max_source_positions=20, n_window=4)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                  num_position_embeddings=16, deepstack_visual_indexes=[0])
    hf = _built(transformers.Qwen3OmniMoeThinkerForConditionalGeneration,
                transformers.Qwen3OmniMoeThinkerConfig(text_config=text, audio_config=audio, vision_config=vision))
    hf.save_pretrained(tmp_path / "hf")
    if layout == "release":
        sd = load_file(tmp_path / "hf" / "model.safetensors")
        sd = {"thinker." + k: v for k, v in sd.items()} | {"talker.model.layers.0.mlp.gate.weight": torch.ones(2, 2),
                                                          "code2wav.decoder.0.weight": torch.ones(2)}
        save_file(sd, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
        thinker = json.loads((tmp_path / "hf" / "config.json").read_text())
        (tmp_path / "hf" / "config.json").write_text(json.dumps(
            {"model_type": "qwen3_omni_moe", "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
             "thinker_config": thinker, "talker_config": {"model_type": "qwen3_omni_moe_talker"}}))
    shape = from_hf_config(tmp_path / "hf" / "config.json")
    assert (shape.arch, shape.hf_model_type, shape.expert_ffn, shape.rope_scaling) == (
        "qwen3_moe", "qwen3_omni_moe", 8, None)
    _text_model_equals_the_multimodal_model(hf, shape, tmp_path, "Qwen3MoeForCausalLM")


@pytest.mark.parametrize("layout", ["transformers", "release"])
def test_a_qwen3_vl_moe_checkpoint_trains_its_text_model(layout, tmp_path):
    """Qwen3-VL-MoE (`qwen3_vl_moe`): its text model is Qwen3-MoE's blocks under `model.language_model.`, whose
    multimodal RoPE rotates a text-only sequence as plain RoPE. Ours, loaded from transformers' own save or from the
    releases' layout (fused experts with the input dimension first, here rewritten so), gives the multimodal model's
    logits on text; exported, it is a Qwen3-MoE text model with the same logits."""
    from safetensors.torch import load_file, save_file

    text = {k: v for k, v in COMMON.items() if k != "moe_intermediate_size"} | dict(
        moe_intermediate_size=8, intermediate_size=24, num_hidden_layers=2, norm_topk_prob=True,
        rope_parameters=dict(rope_type="default", rope_theta=5e6, mrope_section=[2, 3, 3], mrope_interleaved=True))
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32,
                  num_position_embeddings=16, deepstack_visual_indexes=[0])
    torch.manual_seed(0)
    hf = transformers.Qwen3VLMoeForConditionalGeneration(
        transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.1))
    hf.save_pretrained(tmp_path / "hf")
    if layout == "release":
        sd = load_file(tmp_path / "hf" / "model.safetensors")
        sd = {k: v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v
              for k, v in sd.items()}
        assert sd["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (6, 32, 16)
        save_file(sd, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    shape = from_hf_config(tmp_path / "hf" / "config.json")
    assert (shape.arch, shape.hf_model_type, shape.expert_ffn, shape.rope_scaling) == (
        "qwen3_moe", "qwen3_vl_moe", 8, None)
    _text_model_equals_the_multimodal_model(hf, shape, tmp_path, "Qwen3MoeForCausalLM")


# Step-3.7's text model: a full layer (4 heads, half of each rotated at base 5e6 under llama3 scaling from 16
# positions) and three sliding ones (window 8, 6 heads, all rotated at base 1e4, unscaled), a gate per head, q·k scaled by 1/√20, (1 + w) norms, a dense first layer, a
# shared expert, and clamped SwiGLU on the last layer's experts, shared expert and the dense layer (bounds small
# enough to clamp this model's activations); one MTP layer in the checkpoint, skipped
STEP = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_attention_groups=2,
            head_dim=16, intermediate_size=40, moe_num_experts=6, moe_top_k=2, moe_intermediate_size=16,
            share_expert_dim=24, moe_layers_enum="1,2,3,4", sliding_window=8,
            layer_types=["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"],
            rope_theta=[5e6, 1e4, 1e4, 1e4, 5e6], partial_rotary_factors=[0.5, 1.0, 1.0, 1.0, 0.5],
            attention_other_setting={"attention_type": "sliding_attention", "num_attention_heads": 6,
                                     "num_attention_groups": 2, "head_dim": 16},
            swiglu_limits=[0.0, 0.0, 0.0, 0.02, 0.0], swiglu_limits_shared=[0.02, 0.0, 0.0, 0.02, 0.0],
            moe_router_scaling_factor=1.5, query_pre_attn_scalar=20, num_nextn_predict_layers=1, rms_norm_eps=1e-6,
            max_position_embeddings=128, pad_token_id=1,
            rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 16})


def _step_hub_checkpoint(sd: dict, head: torch.Tensor) -> dict:
    """transformers' Step3p7TextModel state under the hub's names (the reverse of its conversion for step3p7), with the multimodal release's vision tensors."""
    out = {"lm_head.weight": head}
    for k, v in sd.items():
        layer = k.split(".mlp.")[0]
        if k.endswith("mlp.experts.gate_up_proj"):
            out[f"model.{layer}.moe.gate_proj.weight"], out[f"model.{layer}.moe.up_proj.weight"] = v.chunk(2, dim=1)
            continue
        k = (k.replace("mlp.experts.down_proj", "moe.down_proj.weight").replace("mlp.gate.weight", "moe.gate.weight")
             .replace("mlp.gate.e_score_correction_bias", "moe.router_bias").replace("mlp.shared_experts.", "share_expert."))
        out["model." + k] = v
    out["model.layers.4.self_attn.q_proj.weight"] = torch.zeros(4 * 16, 32)  # the MTP layer's, skipped
    # Step-3.7-Flash's vision tower and projector beside the text model, skipped
    out["vision_model.conv1.weight"], out["vit_large_projector.weight"] = torch.zeros(4, 3), torch.zeros(32, 8)
    return out


def test_step37_matches_transformers_text_model(tmp_path):
    """Step-3.7 (transformers' Step3p7TextModel, the text model of Step3p7ForConditionalGeneration) from a checkpoint
    in its releases' names and config form: the final hidden states equal transformers' (fp32, 1e-5), the loss through
    the fused head equals the plain log-softmax's, every gradient of a loss on the hidden states equals transformers'
    (the clamps and the per-head gate included), and the export (the releases' names, transformers' config fields)
    reads back to the same shape and outputs. The clamps act: with them lifted the output moves."""
    import json

    from safetensors.torch import save_file
    from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig
    from transformers.models.step3p7.modeling_step3p7 import Step3p7TextModel

    from launch.hf_io import hf_to_ours
    from recipe.models import trainable

    cfg = Step3p7TextConfig(**STEP)
    hf = _built(Step3p7TextModel, cfg)
    head = torch.randn(96, 32, generator=torch.Generator().manual_seed(4)) * 0.1
    (tmp_path / "hub").mkdir()
    save_file({k: v.contiguous() for k, v in _step_hub_checkpoint(hf.state_dict(), head).items()},
              str(tmp_path / "hub" / "model.safetensors"))
    (tmp_path / "hub" / "config.json").write_text(json.dumps({"model_type": "step3p5", **STEP}))
    shape = from_hf_config(tmp_path / "hub" / "config.json")
    assert (shape.arch, shape.sliding_heads, shape.head_gate, shape.query_pre_attn_scalar) == ("glm4_moe", 6, True, 20.0)
    assert (shape.rope_scaling.kind, shape.sliding_rope_plain, trainable(shape)) == ("llama3", True, None)
    ours = build_model(shape, seed=1)
    load_hf_checkpoint(ours, tmp_path / "hub")
    ours.eval()

    T = 40
    ids = torch.randint(0, 96, (1, T), generator=torch.Generator().manual_seed(2))
    weights = torch.randn(T, 32, generator=torch.Generator().manual_seed(5))
    want = hf(input_ids=ids).last_hidden_state[0]
    hidden = ours(ids[0], Packing.from_lengths([T]))
    assert (hidden - want).abs().max().item() < 1e-5
    targets = torch.cat([ids[0, 1:], torch.tensor([-1])])
    with torch.no_grad():
        ref = torch.log_softmax(hidden @ head.T, -1)[:-1].gather(1, targets[:-1, None]).mean()
        fused = token_logprobs(hidden, ours.lm_head.weight, targets, mode="fused")[:-1].mean()
    assert abs(fused.item() - ref.item()) < 1e-5

    (want * weights).sum().backward()
    (hidden * weights).sum().backward()
    theirs = hf_to_ours({n: p.grad for n, p in hf.named_parameters() if p.grad is not None}, ours)
    got = {n: p.grad for n, p in ours.named_parameters() if n != "lm_head.weight"}
    assert got.keys() == theirs.keys()
    for n, g in got.items():
        scale = theirs[n].abs().max().item()
        assert scale > 0 and (g - theirs[n]).abs().max().item() <= 1e-4 * scale + 1e-7, n

    export_hf_checkpoint(ours, tmp_path / "ours")
    exported = json.loads((tmp_path / "ours" / "config.json").read_text())
    back_shape = from_hf_config(tmp_path / "ours" / "config.json")
    same = {"name": "x", "source": "", "mtp_layers": 0}  # (the export holds no MTP layer)
    assert back_shape.model_copy(update=same) == shape.model_copy(update=same)
    again = Step3p7TextConfig(**{k: v for k, v in exported.items() if k not in ("model_type", "architectures")})
    assert (again.num_sliding_attention_heads, again.swiglu_limits, again.mlp_layer_types) == (
        6, [0.0, 0.0, 0.0, 0.02], ["dense", "sparse", "sparse", "sparse"])
    back = build_model(back_shape, seed=3)
    load_hf_checkpoint(back, tmp_path / "ours")
    with torch.no_grad():
        assert torch.equal(back(ids[0], Packing.from_lengths([T])), hidden.detach())
        unclamped = build_model(shape.model_copy(update={"swiglu_limits": (), "swiglu_limits_shared": ()}), seed=1)
        unclamped.load_state_dict(ours.state_dict())
        assert (unclamped(ids[0], Packing.from_lengths([T])) - hidden).abs().max().item() > 1e-3
