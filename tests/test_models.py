"""Model shapes: parameter counts by group (hand-worked), presets against published totals, HF config reading."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from recipe.models import (PRESETS, SparseAttentionShape, active_matmul_params, active_params, from_hf_config,
                           param_counts, resolve_model, total_params, trainable)

Q35 = PRESETS["qwen35-35b"]


def _b(n: float) -> float:
    return n / 1e9


# ---- qwen35-35b, group by group ------------------------------------------------------------------------------
def test_qwen35_35b_totals():
    assert abs(_b(total_params(Q35)) - 34.66) < 0.01
    assert abs(_b(active_params(Q35)) - 2.95) < 0.01  # the input embedding (0.51B, a lookup) is not active


def test_qwen35_35b_groups_hand_worked():
    h, vocab = 2048, 248320
    c = param_counts(Q35)
    assert c["embedding"] == vocab * h == 508_559_360
    assert c["head"] == vocab * h  # untied
    # 10 gated full-attention layers: q (+ gate) 16·256·2, k and v 2·2·256, o 16·256 → h, q/k norms 2·256
    attn_layer = h * (16 * 256 * 2 + 2 * 2 * 256) + 16 * 256 * h + 2 * 256
    assert c["attention"] == 10 * attn_layer == 272_634_880
    # 30 Gated DeltaNet layers: key dim 16·128 = 2048, value dim 32·128 = 4096
    kd, vd = 16 * 128, 32 * 128
    gdn_layer = (h * (2 * kd + 2 * vd)  # in_proj_qkvz
                 + h * 2 * 32  # in_proj_ba
                 + (2 * kd + vd) * 4  # depthwise conv, kernel 4
                 + 2 * 32  # dt_bias, A_log
                 + 128  # gated RMSNorm
                 + vd * h)  # out_proj
    assert c["linear_attention"] == 30 * gdn_layer == 1_011_553_920
    assert c["router"] == 40 * h * 256
    assert c["shared_expert"] == 40 * (3 * h * 512 + h)  # SwiGLU + sigmoid gate
    assert c["routed_experts"] == 40 * 256 * 3 * 2048 * 512 == 32_212_254_720
    assert c["dense_ffn"] == 0
    assert c["norms"] == 40 * 2 * h + h
    assert total_params(Q35) == sum(c.values())
    # routed experts are ~93% of the model (40·256·3·2048·512 of 34.66B)
    assert 0.92 < c["routed_experts"] / total_params(Q35) < 0.94
    # active: everything but the 248 of 256 experts a token is not routed to and the input embedding (a lookup)
    assert active_params(Q35) == (total_params(Q35) - c["embedding"] - c["routed_experts"]
                                  + c["routed_experts"] * 8 // 256)


def test_qwen35_35b_four_layers_matches_design():
    """The transformers baseline of docs/BENCHMARKS.md: 4 layers (3 GDN + 1 attention), 4.38B params, 752M active matmul."""
    m4 = Q35.with_layers(4)
    assert m4.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert m4.name == "qwen35-35b@4L"
    assert abs(_b(total_params(m4)) - 4.38) < 0.005
    assert abs(active_matmul_params(m4) / 1e6 - 752) < 1


@pytest.mark.parametrize("n", [0, -1, 41])
def test_with_layers_rejects_out_of_range(n):
    with pytest.raises(ValueError, match="--layers"):
        Q35.with_layers(n)


@pytest.mark.parametrize("name, published_b, rel", [
    ("qwen3-30b-a3b", 30.5, 0.005),
    ("qwen3-235b-a22b", 235.0, 0.005),
    ("deepseek-v3", 671.0, 0.005),
    ("mixtral-8x7b", 46.7, 0.005),
    ("gpt-oss-120b", 116.8, 0.005),
    ("gpt-oss-20b", 20.91, 0.005),
    ("qwen3-next-80b", 80.0, 0.01),
    ("qwen35-122b", 122.0, 0.01),
    ("qwen35-397b", 397.0, 0.01),
    ("deepseek-v32", 671.0, 0.005),  # DeepSeek-V3's 671B; its indexer adds 0.85B (0.13%)
    ("glm5", 744.0, 0.005),  # zai-org/GLM-5 model card: 744B (40B active)
])
def test_presets_against_published_totals(name, published_b, rel):
    total = _b(total_params(PRESETS[name]))
    assert abs(total - published_b) <= rel * published_b, f"{name}: {total:.3f}B vs published {published_b}B"


@pytest.mark.parametrize("name, published_active_b", [
    ("qwen3-30b-a3b", 3.3), ("qwen3-235b-a22b", 22.0), ("deepseek-v3", 37.0), ("mixtral-8x7b", 12.9),
])
def test_presets_active_against_published(name, published_active_b):
    """These publishers count the input embedding as active; `active_params` does not (it is a lookup)."""
    m = PRESETS[name]
    assert abs(_b(active_params(m) + param_counts(m)["embedding"]) - published_active_b) <= 0.05 * published_active_b


def test_tiny_moe_is_tiny_and_has_every_block():
    m = PRESETS["tiny-moe"]
    assert total_params(m) * 4 < 4e6  # a few MB in fp32
    assert m.num_full_attn_layers and m.num_linear_attn_layers and m.shared_expert_ffn


# ---- Hugging Face config.json --------------------------------------------------------------------------------
def _qwen35_text(**over) -> dict:
    cfg = {
        "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40, "vocab_size": 248320,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144, "num_experts": 256, "num_experts_per_tok": 8,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "attn_output_gate": True,
        "rope_parameters": {"rope_theta": 10000000, "partial_rotary_factor": 0.25},
        "mtp_num_hidden_layers": 1,
    }
    cfg.update(over)
    return cfg


def _write(tmp_path, name: str, cfg: dict):
    d = tmp_path / name
    d.mkdir()
    p = d / "config.json"
    p.write_text(json.dumps(cfg))
    return p


def _same_shape(a, b) -> bool:
    skip = {"name", "source"}
    return a.model_dump(exclude=skip) == b.model_dump(exclude=skip)


def test_hf_qwen35_with_text_config_and_layer_types(tmp_path):
    text = _qwen35_text(layer_types=["linear_attention"] * 3 + ["full_attention"])
    text["layer_types"] = text["layer_types"] * 10
    cfg = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
           "text_config": text, "vision_config": {"depth": 27}, "tie_word_embeddings": False}
    m = from_hf_config(_write(tmp_path, "Qwen3.5-35B-A3B", cfg))
    assert m.name == "Qwen3.5-35B-A3B"
    assert _same_shape(m, Q35)
    assert total_params(m) == total_params(Q35)


def test_hf_qwen35_with_full_attention_interval(tmp_path):
    cfg = _qwen35_text(full_attention_interval=4)
    m = from_hf_config(_write(tmp_path, "interval", cfg))
    assert m.layer_types == Q35.layer_types
    assert _same_shape(m, Q35)


def test_hf_mtp_layers(tmp_path):
    m0 = from_hf_config(_write(tmp_path, "no-mtp", _qwen35_text(full_attention_interval=4,
                                                                 mtp_num_hidden_layers=0)))
    m2 = from_hf_config(_write(tmp_path, "mtp2", _qwen35_text(full_attention_interval=4, mtp_num_hidden_layers=2)))
    assert (m0.mtp_layers, m2.mtp_layers) == (0, 2)
    assert total_params(m0) == total_params(m2)  # MTP layers are counted apart from the text stack


def test_hf_qwen3_moe_equals_preset(tmp_path):
    cfg = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "vocab_size": 151936,
           "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "rope_theta": 1000000.0,
           "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
           "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "norm_topk_prob": True,
           "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": []}
    m = from_hf_config(_write(tmp_path, "Qwen3-30B-A3B", cfg))
    assert _same_shape(m, PRESETS["qwen3-30b-a3b"])


def test_dsa_presets_are_their_configs():
    """GLM-5's preset is what its config (transformers' GlmMoeDsaConfig defaults, bench/configs/glm-5.json) reads
    to; DeepSeek-V3.2's is DeepSeek-V3's with the indexer (64 heads of 128 keeping 2,048 keys, RoPE in halves) and
    its own model type: nothing else differs."""
    glm = from_hf_config(Path(__file__).parents[1] / "bench" / "configs" / "glm-5.json")
    assert _same_shape(glm, PRESETS["glm5"]) and glm.dsa.rope_pairs and not glm.dsa.shared_layers
    v32, v3 = PRESETS["deepseek-v32"], PRESETS["deepseek-v3"]
    assert v32.dsa == SparseAttentionShape(topk=2048, index_heads=64, index_head_dim=128, rope_pairs=False)
    skip = {"name", "source", "dsa", "hf_model_type"}
    assert v32.model_dump(exclude=skip) == v3.model_dump(exclude=skip) and v32.hf_model_type == "deepseek_v32"
    assert trainable(v32) is None and trainable(PRESETS["glm5"]) is None


@pytest.mark.parametrize("preset, model_type", [("mimo-v2-flash", "mimo_v2_flash"),
                                                ("solar-open-100b", "solar_open"),
                                                ("deepseek-v4-flash", "deepseek_v4")])
def test_presets_are_transformers_default_configs(tmp_path, preset, model_type):
    """MiMo-V2-Flash's, Solar Open's and DeepSeek-V4-Flash's presets are what transformers' default configs (their
    releases' shapes) read to, and the core trains the first two; their parameters equal transformers' own (308.8B,
    102.7B and 284.3B, beside the published 309B, 102.6B and 284B; DeepSeek-V4's hash-routed layers have no
    correction bias, its hyper-connections and compressors count too)."""
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type)
    cfg.save_pretrained(tmp_path / preset)
    m = from_hf_config(tmp_path / preset / "config.json")
    assert _same_shape(m, PRESETS[preset])
    assert (trainable(PRESETS[preset]) is None) == (model_type != "deepseek_v4")
    cls = {"mimo_v2_flash": "MiMoV2FlashForCausalLM", "solar_open": "SolarOpenForCausalLM",
           "deepseek_v4": "DeepseekV4ForCausalLM"}[model_type]
    assert total_params(m) == _meta_params(getattr(transformers, cls), cfg)


def test_hf_deepseek_v3_equals_preset(tmp_path):
    cfg = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 129280,
           "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
           "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
           "first_k_dense_replace": 3, "intermediate_size": 18432, "num_nextn_predict_layers": 1,
           "rope_theta": 10000, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "norm_topk_prob": True,
           "tie_word_embeddings": False, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
           "scoring_func": "sigmoid", "topk_method": "noaux_tc",
           "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"}}
    m = from_hf_config(_write(tmp_path, "DeepSeek-V3", cfg))
    assert _same_shape(m, PRESETS["deepseek-v3"])
    assert m.head_dim == 128 + 64
    assert (m.sigmoid_router.groups, m.sigmoid_router.topk_groups, m.sigmoid_router.scaling) == (8, 4, 2.5)
    assert (m.rope_scaling.kind, m.rope_scaling.factor, m.rope_scaling.original_max_position) == ("yarn", 40, 4096)
    # the stretch alone implies YaRN's factor (transformers' rule): 163,840 / 4,096
    del cfg["rope_scaling"]["factor"]
    assert from_hf_config(_write(tmp_path, "DeepSeek-V3-implied", cfg)).rope_scaling.factor == 40.0
    assert total_params(m) == total_params(PRESETS["deepseek-v3"])


@pytest.mark.parametrize("fixture, preset", [("moonlight-16b-a3b", "moonlight-16b"), ("glm-4.5-air", "glm45-air"),
                                             ("deepseek-v3", "deepseek-v3"), ("gpt-oss-120b", "gpt-oss-120b"),
                                             ("gpt-oss-20b", "gpt-oss-20b"), ("minimax-m2", "minimax-m2")])
def test_published_configs_read_to_the_trained_presets(fixture, preset):
    """The published config.json fields (tests/fixtures/configs/, with the router's and RoPE scaling's) read to the
    preset in every field but the name: what `recipe solve --model config.json` plans is what the preset plans,
    and what `recipe launch` trains is the published network."""
    assert _same_shape(from_hf_config(Path(__file__).parent / "fixtures" / "configs" / f"{fixture}.json"),
                       PRESETS[preset])


def test_sigmoid_router_fields_default_as_transformers_does(tmp_path):
    """A DeepSeek-V3 config without n_group / topk_group / routed_scaling_factor reads transformers' defaults for
    the type (8, 4, 2.5), a GLM-4.5 one GLM's (1, 1, 1.0)."""
    ds = json.loads((Path(__file__).parent / "fixtures" / "configs" / "deepseek-v3.json").read_text())
    for k in ("n_group", "topk_group", "routed_scaling_factor"):
        del ds[k]
    r = from_hf_config(_write(tmp_path, "ds", ds)).sigmoid_router
    assert (r.groups, r.topk_groups, r.scaling) == (8, 4, 2.5)
    glm = json.loads((Path(__file__).parent / "fixtures" / "configs" / "glm-4.5.json").read_text())
    r = from_hf_config(_write(tmp_path, "glm", glm)).sigmoid_router
    assert (r.groups, r.topk_groups, r.scaling) == (1, 1, 1.0)


def test_rope_scaling_and_routing_read_or_refused(tmp_path):
    """transformers' newer `rope_parameters` is read like the legacy `rope_scaling`; a scaling the core does not
    apply is named by trainable() in one line; DeepSeek-V2's softmax routing is read (plain or group-limited top-k,
    its scaling) and trained, an unknown topk_method refused, as are malformed fields for every command."""
    from recipe.models import SoftmaxRouter, trainable

    llama = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128,
             "num_attention_heads": 4, "intermediate_size": 96,
             "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192}}
    m = from_hf_config(_write(tmp_path, "llama31", llama))
    assert (m.rope_scaling.kind, m.rope_scaling.factor, m.rope_scaling.high_freq_factor) == ("llama3", 8.0, 4.0)
    assert trainable(m) is None
    llama["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}
    llama["max_position_embeddings"] = 4096
    m = from_hf_config(_write(tmp_path, "phi", llama))
    assert trainable(m) == "phi: RoPE scaling 'longrope' is planned by `recipe solve` but not trained by this core"
    llama["rope_parameters"] = {"rope_type": "yarn", "factor": "big", "original_max_position_embeddings": 8}
    with pytest.raises(ValueError, match="rope_parameters.factor'"):
        from_hf_config(_write(tmp_path, "bad", llama))
    llama["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match="yarn rope scaling needs original_max_position_embeddings"):
        from_hf_config(_write(tmp_path, "bad2", llama))
    v2 = {"model_type": "deepseek_v2", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128,
          "num_attention_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
          "v_head_dim": 8, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    m = from_hf_config(_write(tmp_path, "v2", v2))  # transformers' defaults: "greedy", scaling 1
    assert m.sigmoid_router is None and m.softmax_router == SoftmaxRouter() and trainable(m) is None
    v2.update(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=16.0)
    m = from_hf_config(_write(tmp_path, "v2g", v2))  # DeepSeek-V2's own routing
    assert m.softmax_router == SoftmaxRouter(groups=4, topk_groups=2, scaling=16.0) and trainable(m) is None
    assert m.fingerprint_dict()["softmax_router"] == {"groups": 4, "topk_groups": 2, "scaling": 16.0}
    published = {n: from_hf_config(Path(__file__).parent / "fixtures" / "configs" / f"{n}.json").softmax_router
                 for n in ("deepseek-v2", "deepseek-v2-lite")}
    assert published == {"deepseek-v2": SoftmaxRouter(groups=8, topk_groups=3, scaling=16.0),
                         "deepseek-v2-lite": SoftmaxRouter()}
    v2["topk_method"] = "noaux_tc"
    with pytest.raises(ValueError, match="field 'topk_method': expected DeepSeek-V2's greedy or group_limited_greedy, "
                                         "got 'noaux_tc'"):
        from_hf_config(_write(tmp_path, "v2bad", v2))
    glm = {"model_type": "glm4_moe", "hidden_size": 64, "num_hidden_layers": 3, "vocab_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "n_routed_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 1, "intermediate_size": 96,
           "first_k_dense_replace": 1, "n_group": 3, "topk_group": 4, "attention_bias": True}
    with pytest.raises(ValueError, match="topk_groups=4 > groups=3"):
        from_hf_config(_write(tmp_path, "glm", glm))


@pytest.mark.parametrize("drop", ["hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                                  "num_experts", "num_experts_per_tok", "linear_num_value_heads"])
def test_hf_missing_field_is_named(tmp_path, drop):
    cfg = _qwen35_text(full_attention_interval=4)
    del cfg[drop]
    with pytest.raises(ValueError, match=f"missing field '{drop}'"):
        from_hf_config(_write(tmp_path, "bad", cfg))


def test_hf_bad_configs(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        from_hf_config(tmp_path / "nope" / "config.json")
    p = tmp_path / "garbage.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        from_hf_config(p)
    p.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        from_hf_config(p)
    with pytest.raises(ValueError, match="'foo' is not supported and lacks the standard fields"):
        from_hf_config(_write(tmp_path, "foo", {"model_type": "foo", "hidden_size": 4096}))
    # layer_types shorter than the layer count: a shape error, one line, naming the mismatch
    short = _qwen35_text(layer_types=["full_attention"] * 3)
    with pytest.raises(ValueError, match="layer_types has 3 entries"):
        from_hf_config(_write(tmp_path, "short", short))
    # v heads not a multiple of k heads
    with pytest.raises(ValueError, match="num_v_heads"):
        from_hf_config(_write(tmp_path, "gdn", _qwen35_text(full_attention_interval=4, linear_num_value_heads=24,
                                                           linear_num_key_heads=16)))


def test_resolve_model_presets_paths_and_close_names(tmp_path):
    assert resolve_model("qwen35-35b") is Q35
    p = _write(tmp_path, "m", _qwen35_text(full_attention_interval=4))
    assert _same_shape(resolve_model(str(p)), Q35)
    assert _same_shape(resolve_model(str(p.parent)), Q35)  # a directory holding config.json
    with pytest.raises(ValueError) as e:
        resolve_model("qwen35-35")
    assert "unknown model 'qwen35-35'" in str(e.value) and "did you mean qwen35-35b" in str(e.value)
    with pytest.raises(ValueError, match="did you mean.*deepseek-v3"):
        resolve_model("deepseek-v2")


# ---- published configs (tests/fixtures/configs/, sources in its README.md) ----------------------------------
FIXTURES = Path(__file__).parent / "fixtures" / "configs"

# fixture: (published total B, published active B, how the publisher counts active, source of the figures).
# Figures are strings so that their precision is known: a figure matches within 1% or one unit of its last digit,
# whichever is wider, since publishers round or cut ("2.4B" for DeepSeek-V2-Lite's 2.45B; "3B" is 2B..4B). How active is counted: "ours" = everything a token multiplies through
# (routed experts it is sent to, attention, shared experts, dense FFNs, router, LM head), not the input embedding;
# "+embedding": the publisher also counts the input embedding; "-head": the publisher counts neither the embedding
# nor the LM head (the non-embedding count). None: not published (dense: active = total − input embedding).
PUBLISHED = {
    "qwen3.5-35b-a3b": ("35", "3", "ours", "Qwen/Qwen3.5-35B-A3B model card (35B total, 3B activated)"),
    "qwen3.5-27b": ("27", None, None, "Qwen/Qwen3.5-27B model card (27B parameters, dense)"),
    "qwen3-next-80b-a3b": ("80", "3", "-head", "Qwen/Qwen3-Next-80B-A3B-Instruct model card (80B, 3B activated)"),
    "qwen3-30b-a3b": ("30.5", "3.3", "+embedding", "Qwen/Qwen3-30B-A3B model card (30.5B, 3.3B activated)"),
    "qwen1.5-moe-a2.7b": ("14.3", "2.7", "+embedding", "Qwen/Qwen1.5-MoE-A2.7B model card (14.3B, 2.7B activated)"),
    "qwen2-57b-a14b": ("57", "14", "+embedding", "Qwen2 technical report, arXiv:2407.10671 (57B, 14B activated)"),
    "deepseek-v2": ("236", "21", "ours", "DeepSeek-V2 paper, arXiv:2405.04434 (236B total, 21B activated)"),
    "deepseek-v2-lite": ("15.7", "2.4", "ours", "DeepSeek-V2 paper, appendix B (15.7B total, 2.4B activated)"),
    "deepseek-v3": ("671", "37", "ours", "DeepSeek-V3 report, arXiv:2412.19437 (671B total, 37B activated)"),
    "kimi-k2": ("1000", "32", "ours", "moonshotai/Kimi-K2-Instruct model card (1T total, 32B activated)"),
    "moonlight-16b-a3b": ("16", "3", "ours", "moonshotai/Moonlight-16B-A3B model card (16B total, 3B activated)"),
    "kimi-linear-48b-a3b": ("48", "3", "ours", "moonshotai/Kimi-Linear-48B-A3B-Instruct, by its name (48B total, 3B "
                                               "activated)"),
    "mellum2-12b-a2.5b": ("12", "2.5", "+embedding", "JetBrains/Mellum2-12B-A2.5B-Base, by its name (12B total, "
                                                     "2.5B active)"),
    "mixtral-8x7b": ("46.7", "12.9", "+embedding", "Mistral AI, 'Mixtral of experts' (46.7B total, 12.9B a token)"),
    "mixtral-8x22b": ("141", "39", "+embedding", "Mistral AI, Mixtral 8x22B announcement (141B, 39B active)"),
    "olmoe-1b-7b": ("6.9", "1.3", "+embedding", "OLMoE paper, arXiv:2409.02060 (6.9B total, 1.3B active)"),
    "glm-4.5": ("355", "32", "-head", "GLM-4.5 report, arXiv:2508.06471 (355B total, 32B activated)"),
    "glm-4.5-air": ("106", "12", "-head", "GLM-4.5 report, arXiv:2508.06471 (106B total, 12B activated)"),
    "ernie-4.5-21b-a3b": ("21", "3", "ours", "baidu/ERNIE-4.5-21B-A3B-PT model card (21B total, 3B activated)"),
    "minimax-m2": ("230", "10", "ours", "MiniMaxAI/MiniMax-M2 model card (230B total, 10B activated)"),
    "llama-4-scout-17b-16e": ("109", "17", "+embedding", "Meta Llama 4 model card (109B total, 17B active)"),
    "llama-4-maverick-17b-128e": ("400", "17", "+embedding", "Meta Llama 4 model card (400B total, 17B active)"),
    "granite-3.0-3b-a800m": ("3.3", "0.8", "-head", "IBM Granite 3.0 report (3.3B total, 800M active)"),
    "granite-3.0-1b-a400m": ("1.3", "0.4", "-head", "IBM Granite 3.0 report (1.3B total, 400M active)"),
    "gpt-oss-120b": ("116.83", "5.13", "ours", "OpenAI gpt-oss model card, table 1 (116.83B total, 5.13B active)"),
    "gpt-oss-20b": ("20.91", "3.61", "ours", "OpenAI gpt-oss model card, table 1 (20.91B total, 3.61B active)"),
    "gemma-4-26b-a4b": ("25.2", "3.8", "ours", "google/gemma-4-26B-A4B-it model card (25.2B total, 3.8B active)"),
    "llama-3-8b": ("8.03", None, None, "meta-llama/Meta-Llama-3-8B on Hugging Face (8.03B params)"),
    "llama-3.1-70b": ("70.6", None, None, "meta-llama/Llama-3.1-70B on Hugging Face (70.6B params)"),
    "qwen3-8b": ("8.2", None, None, "Qwen/Qwen3-8B model card (8.2B; 6.95B non-embedding)"),
    "qwen2.5-7b": ("7.61", None, None, "Qwen/Qwen2.5-7B model card (7.61B; 6.53B non-embedding)"),
}
# Where a figure is further off than its precision, the reason (and the wider tolerance):
WIDER = {
    ("llama-4-scout-17b-16e", "total"): (0.015, "Meta's 109B includes the vision encoder (~0.9B); text stack only"),
    ("kimi-linear-48b-a3b", "total"): (0.025, "the release holds 49.1B (transformers' KimiLinearForCausalLM counts "
                                              "the same); the name's 48B is 48.4B without the embedding and LM head"),
}
NON_EMBEDDING = {"qwen3-8b": "6.95", "qwen2.5-7b": "6.53", "qwen3-30b-a3b": "29.9"}  # same model cards


def _tolerance(fig: str, rel: float = 0.01) -> float:
    decimals = len(fig.split(".")[1]) if "." in fig else 0
    unit = 10.0 ** -decimals if decimals or fig.rstrip("0") == fig else 10.0 ** (len(fig) - len(fig.rstrip("0")))
    return max(rel * float(fig), unit)


def test_every_fixture_has_a_published_figure():
    assert sorted(p.stem for p in FIXTURES.glob("*.json")) == sorted(PUBLISHED)
    assert all(name in (FIXTURES / "README.md").read_text() for name in PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_fixture_counts_against_published(name):
    total_fig, active_fig, how, source = PUBLISHED[name]
    m = from_hf_config(FIXTURES / f"{name}.json")
    c = param_counts(m)
    total = _b(total_params(m))
    rel = WIDER.get((name, "total"), (0.01,))[0]
    assert abs(total - float(total_fig)) <= _tolerance(total_fig, rel), f"{name}: {total:.3f}B vs {total_fig}B ({source})"
    embed = 0 if m.tie_embeddings else c["embedding"]
    if active_fig is None:  # dense: every weight but the input embedding, and nothing to route
        assert m.num_experts == m.top_k == 1 and m.first_dense_layers == m.num_layers and c["routed_experts"] == 0
        assert active_params(m) == total_params(m) - c["embedding"]
        if name in NON_EMBEDDING:
            fig = NON_EMBEDDING[name]
            non_embed = _b(total_params(m) - c["embedding"] - c["head"])
            assert abs(non_embed - float(fig)) <= _tolerance(fig), f"{name}: non-embedding {non_embed:.3f}B vs {fig}B"
        return
    active = active_params(m) + {"ours": 0, "+embedding": embed, "-head": -(c["head"] or c["embedding"])}[how]
    rel = WIDER.get((name, "active"), (0.01,))[0]
    assert abs(_b(active) - float(active_fig)) <= _tolerance(active_fig, rel), \
        f"{name}: active {_b(active):.3f}B ({how}) vs {active_fig}B ({source})"


def test_fixture_shapes():
    """The features each family brings, read from its config."""
    rd = lambda n: from_hf_config(FIXTURES / f"{n}.json")  # noqa: E731
    lite, v3, moon, kimi = rd("deepseek-v2-lite"), rd("deepseek-v3"), rd("moonlight-16b-a3b"), rd("kimi-k2")
    assert lite.mla.q_lora_rank == 0 and moon.mla.q_lora_rank == 0 and v3.mla.q_lora_rank == 1536  # q LoRA or not
    assert (lite.first_dense_layers, v3.first_dense_layers, kimi.first_dense_layers) == (1, 3, 1)
    assert lite.shared_expert_ffn == 2 * 1408 and kimi.num_experts == 384 and v3.mtp_layers == 1
    assert not lite.router_bias and v3.router_bias  # V2: softmax gate; V3: sigmoid with a bias
    scout, mav = rd("llama-4-scout-17b-16e"), rd("llama-4-maverick-17b-128e")
    assert scout.num_moe_layers == 48 and mav.num_moe_layers == 24 and mav.dense_ffn == 16384  # interleaved
    assert [mav.is_dense_layer(i) for i in range(4)] == [True, False, True, False]  # MoE at odd layers
    assert scout.attention_chunk == 8192 and scout.num_chunked_layers == 36 and scout.num_full_attn_layers == 12
    assert scout.layer_types[:4] == ("chunked_attention",) * 3 + ("full_attention",) and scout.arch == "llama4"
    assert scout.shared_expert_ffn == 8192 and scout.llama4.qk_norm and not mav.llama4.qk_norm
    assert trainable(scout) is None and trainable(mav) is None
    assert _same_shape(scout, PRESETS["llama4-scout"]) and _same_shape(mav, PRESETS["llama4-maverick"])
    assert scout.rope_scaling.kind == "llama3" and mav.rope_scaling is None and scout.llama4.temperature_tuning
    oss = rd("gpt-oss-120b")
    assert oss.num_sliding_layers == oss.num_full_attn_layers == 18 and oss.sliding_window == 128
    assert param_counts(oss)["attention"] > 0 and oss.arch == "gpt_oss"  # attention sinks counted per head
    # the published config without rope_scaling reads as transformers reads it (YaRN ×32, truncate false): the preset
    assert _same_shape(oss, PRESETS["gpt-oss-120b"]) and oss.rope_scaling.truncate is False
    glm, ernie = rd("glm-4.5"), rd("ernie-4.5-21b-a3b")
    assert glm.partial_rotary_factor == 0.5 and glm.attn_bias and glm.qk_norm and glm.first_dense_layers == 3
    assert ernie.tie_embeddings and ernie.shared_expert_ffn == 3072 and ernie.first_dense_layers == 1
    assert rd("qwen2-57b-a14b").shared_expert_gate and rd("olmoe-1b-7b").qk_norm
    assert _same_shape(rd("qwen2-57b-a14b"), PRESETS["qwen2-57b-a14b"])
    assert _same_shape(rd("qwen1.5-moe-a2.7b"), PRESETS["qwen15-moe-a27b"])
    assert _same_shape(rd("olmoe-1b-7b"), PRESETS["olmoe-1b-7b"])
    assert _same_shape(ernie, PRESETS["ernie45-21b-a3b"]) and ernie.arch == "ernie4_5_moe"
    assert rd("qwen3-next-80b-a3b").num_linear_attn_layers == 36
    assert _same_shape(rd("qwen3.5-35b-a3b"), Q35)
    assert _same_shape(rd("qwen3-30b-a3b"), PRESETS["qwen3-30b-a3b"])


def test_hf_qwen35_dense_reads_as_hybrid_dense(tmp_path):
    cfg = _qwen35_text(model_type="qwen3_5_text", intermediate_size=8192, full_attention_interval=4)
    for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
        del cfg[k]
    m = from_hf_config(_write(tmp_path, "q35dense", cfg))
    assert m.arch == "qwen3_5" and m.num_linear_attn_layers == 30 and m.num_experts == 1
    assert param_counts(m)["dense_ffn"] == 40 * 3 * 2048 * 8192 and param_counts(m)["shared_expert"] == 0


def test_hf_unknown_model_type_read_with_a_warning(tmp_path, capsys):
    cfg = json.loads((FIXTURES / "llama-3-8b.json").read_text())
    cfg["model_type"] = "my_llama"
    m = from_hf_config(_write(tmp_path, "mine", cfg))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'my_llama' is not known" in err and "dense" in err
    assert total_params(m) == total_params(from_hf_config(FIXTURES / "llama-3-8b.json"))
    moe = json.loads((FIXTURES / "olmoe-1b-7b.json").read_text())
    moe["model_type"] = "my_moe"
    assert from_hf_config(_write(tmp_path, "mine-moe", moe)).num_experts == 64
    assert "as a MoE model" in capsys.readouterr().err


@pytest.mark.parametrize("name, drop", [("llama-3-8b", "intermediate_size"), ("deepseek-v2-lite", "kv_lora_rank"),
                                        ("ernie-4.5-21b-a3b", "moe_k"), ("olmoe-1b-7b", "num_experts"),
                                        ("mixtral-8x7b", "vocab_size")])
def test_hf_fixture_missing_field_is_named(tmp_path, name, drop):
    cfg = json.loads((FIXTURES / f"{name}.json").read_text())
    cfg.pop(drop)
    with pytest.raises(ValueError) as e:
        from_hf_config(_write(tmp_path, "bad", cfg))
    msg = str(e.value)
    assert "\n" not in msg and drop in msg, msg


@pytest.mark.parametrize("field, value", [("hidden_size", 0), ("num_hidden_layers", -2), ("vocab_size", None),
                                          ("intermediate_size", "big"), ("num_attention_heads", 0)])
def test_hf_bad_values_are_named(tmp_path, field, value):
    cfg = json.loads((FIXTURES / "llama-3-8b.json").read_text())
    cfg[field] = value
    with pytest.raises(ValueError) as e:
        from_hf_config(_write(tmp_path, "bad", cfg))
    assert "\n" not in str(e.value) and field.split("_")[0] in str(e.value), str(e.value)


def _gpus_for(name: str) -> int:
    total_b = total_params(from_hf_config(FIXTURES / f"{name}.json")) / 1e9
    return 8 if total_b < 40 else 64 if total_b < 250 else 256


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_fixture_models_solve_and_sweep(name):
    """`recipe models PATH`, `recipe solve --model PATH` and `recipe sweep` on every family: no error, no
    traceback, and the solver's layout within 5% of the grid optimum."""
    import re

    from typer.testing import CliRunner

    from recipe.cli import app

    runner, path, gpus = CliRunner(), str(FIXTURES / f"{name}.json"), str(_gpus_for(name))
    r = runner.invoke(app, ["models", path])
    assert r.exit_code == 0 and "routed_experts" in r.stdout and "input embedding" in r.stdout, r.output
    r = runner.invoke(app, ["solve", "--model", path, "--seq", "8k", "--hw", "h200", "--gpus", gpus])
    assert r.exit_code == 0 and r.exception is None, r.output
    assert "Traceback" not in r.output
    if from_hf_config(path).arch in ("dense", "qwen3_5"):
        assert "EP=1 " in r.stdout  # nothing to shard over EP
    r = runner.invoke(app, ["sweep", "--model", path, "--seq", "8k", "--hw", "h200", "--gpus", gpus])
    assert r.exit_code == 0 and r.exception is None, r.output
    m = re.search(r"ranks #(\d+) \((\d+\.\d+)× the grid optimum", r.stdout.replace("\n", " "))
    assert m and float(m.group(2)) <= 1.05, r.stdout[-400:]


def test_cli_missing_field_exits_2_with_one_line(tmp_path):
    from typer.testing import CliRunner

    from recipe.cli import app

    cfg = json.loads((FIXTURES / "glm-4.5-air.json").read_text())
    del cfg["n_routed_experts"]
    p = _write(tmp_path, "glm", cfg)
    for args in (["models", str(p)], ["solve", "--model", str(p), "--seq", "8k", "--hw", "h200", "--gpus", "8"]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2 and "Traceback" not in r.output
        assert r.stderr.strip().count("\n") == 0 and "'num_experts'" in r.stderr, r.stderr


@pytest.mark.parametrize("top_k", [0, 65, None])
def test_hf_top_k_outside_the_experts_is_named(tmp_path, top_k):
    """top-k must pick between 1 and num_experts experts (ERNIE-4.5's 6 of 64 shows it need not divide them)."""
    cfg = json.loads((FIXTURES / "ernie-4.5-21b-a3b.json").read_text())
    assert from_hf_config(_write(tmp_path, "ok", cfg)).top_k == 6 and cfg["moe_num_experts"] == 64
    cfg["moe_k"] = top_k
    with pytest.raises(ValueError) as e:
        from_hf_config(_write(tmp_path, "bad", cfg))
    assert "\n" not in str(e.value) and ("top_k" in str(e.value) or "moe_k" in str(e.value)), str(e.value)


def test_qwen2_moe_and_ernie_dense_layers_and_windows_by_hand(tmp_path):
    """Qwen2-MoE's layer i is MoE where (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers: 8 layers
    at step 2 are 4 dense (i = 0, 2, 4, 6: the shape's moe_layer_step, trained); step 1 with mlp_only_layers [0, 5]
    2 dense, counted as leading dense layers of intermediate_size and planned only (arch moe). use_sliding_window slides the layers from
    max_window_layers on (6 of 8 full). ERNIE-4.5's MoE layers run from moe_layer_start_index to
    moe_layer_end_index: start 1, end 5 of 8 leaves 3 dense (0, 6, 7), planned only; use_bias too. Planned only, its
    router still counts the correction bias the checkpoint holds (E values a MoE layer)."""
    base = json.loads((FIXTURES / "qwen1.5-moe-a2.7b.json").read_text()) | {"num_hidden_layers": 8}
    rd = lambda name, **over: from_hf_config(_write(tmp_path, name, base | over))  # noqa: E731
    plain = rd("all")
    assert (plain.arch, plain.first_dense_layers, plain.attn_bias, plain.norm_topk_prob) == ("qwen2_moe", 0, True, False)
    step2 = rd("step2", decoder_sparse_step=2)
    assert (step2.arch, step2.first_dense_layers, step2.dense_ffn, step2.num_moe_layers) == ("qwen2_moe", 0, 5632, 4)
    assert [step2.is_dense_layer(i) for i in range(8)] == [True, False] * 4 and trainable(step2) is None
    only = rd("only", mlp_only_layers=[0, 5])
    assert (only.arch, only.first_dense_layers) == ("moe", 2)
    window = rd("window", use_sliding_window=True, sliding_window=4096, max_window_layers=6)
    assert window.layer_types == ("full_attention",) * 6 + ("sliding_attention",) * 2 and window.sliding_window == 4096
    assert trainable(window) is None  # its last two layers slide (Attention's window)
    ernie = json.loads((FIXTURES / "ernie-4.5-21b-a3b.json").read_text()) | {"num_hidden_layers": 8}
    rd = lambda name, **over: from_hf_config(_write(tmp_path, name, ernie | over))  # noqa: E731
    whole = rd("e")
    assert (whole.arch, whole.first_dense_layers) == ("ernie4_5_moe", 1)
    cut = rd("cut", moe_layer_end_index=5)
    assert (cut.arch, cut.first_dense_layers, cut.sigmoid_router) == ("moe", 3, None) and trainable(cut)
    assert param_counts(cut)["router"] == 5 * (cut.hidden_size + 1) * cut.num_experts
    assert rd("biased", use_bias=True).arch == "moe"


def test_pad_token_id_read_checked_and_left_out_of_the_fingerprint_when_absent(tmp_path):
    """A config's pad_token_id (the embedding row transformers' padding_idx freezes) is read from the text config or
    the top level, a negative id counted from the end of the vocabulary as torch does; an id outside the vocabulary
    or not a whole number is a one-line error; a shape without one keeps the fingerprint it had before the field
    existed, and the export writes it back."""
    from launch.hf_io import hf_config
    from recipe.planfile import fingerprint

    base = json.loads((FIXTURES / "olmoe-1b-7b.json").read_text())
    rd = lambda name, **over: from_hf_config(_write(tmp_path, name, base | over))  # noqa: E731
    assert rd("none").pad_token_id is None and rd("one", pad_token_id=1).pad_token_id == 1
    assert rd("last", pad_token_id=-1).pad_token_id == base["vocab_size"] - 1
    with pytest.raises(ValueError, match="field 'pad_token_id': expected a token id of the 50,304-row vocabulary, "
                                         "got 50304"):
        rd("over", pad_token_id=50304)
    with pytest.raises(ValueError, match="field 'pad_token_id': expected a whole number, got 'x'"):
        rd("text", pad_token_id="x")
    q = json.loads((FIXTURES / "qwen3.5-35b-a3b.json").read_text())
    assert "text_config" in q
    assert from_hf_config(_write(tmp_path, "top", q | {"pad_token_id": 7})).pad_token_id == 7
    m = PRESETS["olmoe-1b-7b"]
    assert fingerprint(m.fingerprint_dict()) == fingerprint(m.model_copy(update={"pad_token_id": None})
                                                            .fingerprint_dict())
    assert "pad_token_id" not in m.fingerprint_dict() and m.model_copy(update={"pad_token_id": 1}).fingerprint_dict()[
        "pad_token_id"] == 1
    torch = pytest.importorskip("torch")  # noqa: F841 - launch.hf_io imports it
    assert hf_config(rd("exp", pad_token_id=1))["pad_token_id"] == 1 and "pad_token_id" not in hf_config(rd("no"))
    with pytest.raises(ValueError, match="pad_token_id=600 is not a token of the 512-row vocabulary"):
        dataclasses.replace(PRESETS["tiny-moe"], pad_token_id=600)


def test_minimax_m2_forms_by_hand(tmp_path):
    """MiniMax-M2 rotates `rotary_dim` channels of each head (64 of 128: a partial RoPE factor of 0.5) and agrees
    with a `partial_rotary_factor` given beside it, or says which two disagree; its MTP modules are counted apart
    (3 of 1 layer); per-head q/k norms, a shared expert or softmax scoring are planned only (arch moe), the router
    still counting the correction bias (E values a layer)."""
    base = json.loads((FIXTURES / "minimax-m2.json").read_text()) | {"num_hidden_layers": 4}
    rd = lambda name, **over: from_hf_config(_write(tmp_path, name, base | over))  # noqa: E731
    m = rd("m")
    assert (m.arch, m.partial_rotary_factor, m.mtp_layers, m.qk_norm, m.shared_expert_ffn) == ("minimax_m2", 0.5, 3,
                                                                                                 True, 0)
    assert m.sigmoid_router is not None and m.sigmoid_router.scaling == 1.0 and m.norm_topk_prob and not trainable(m)
    assert rd("both", rope_parameters={"rope_theta": 5e6, "partial_rotary_factor": 0.5}).partial_rotary_factor == 0.5
    with pytest.raises(ValueError, match="field 'rotary_dim': 64 channels of 128 disagree with partial_rotary_factor "
                                         "0.25"):
        rd("clash", partial_rotary_factor=0.25)
    with pytest.raises(ValueError, match="field 'rotary_dim': expected a whole number from 1 to head_dim 128, got 256"):
        rd("wide", rotary_dim=256)
    assert rd("hf", rotary_dim=None, rope_parameters={"rope_theta": 5e6, "partial_rotary_factor": 0.5}) == \
        m.model_copy(update={"source": str(tmp_path / "hf" / "config.json"), "name": "hf"})
    assert rd("no_mtp", use_mtp=False).mtp_layers == 0
    for name, over in (("per_head", {"qk_norm_type": "per_head"}), ("shared", {"shared_intermediate_size": 1536}),
                       ("softmax", {"scoring_func": "softmax"})):
        planned = rd(name, **over)
        assert (planned.arch, planned.sigmoid_router) == ("moe", None) and trainable(planned), name
        assert param_counts(planned)["router"] == 4 * (planned.hidden_size + 1) * planned.num_experts, name


def test_gpt_oss_with_another_glu_limit_is_planned_only(tmp_path):
    """The core's clamped GLU clamps at gpt-oss's published 7 (`swiglu_limit`); a config with another limit is
    planned (its windows kept) but not trained, and the two constants are one figure."""
    torch = pytest.importorskip("torch")  # noqa: F841 - kernels.expert_grads imports it
    from kernels.expert_grads import GPT_OSS_GLU
    from recipe.models import GPT_OSS_SWIGLU_LIMIT

    assert GPT_OSS_GLU.limit == GPT_OSS_SWIGLU_LIMIT == 7.0
    base = json.loads((FIXTURES / "gpt-oss-20b.json").read_text())
    rd = lambda name, **over: from_hf_config(_write(tmp_path, name, base | over))  # noqa: E731
    seven = rd("seven", swiglu_limit=7.0)
    assert seven.arch == "gpt_oss" and not trainable(seven)
    other = rd("ten", swiglu_limit=10.0)
    assert other.arch == "moe" and other.sliding_window == 128 and trainable(other)
    with pytest.raises(ValueError, match="field 'swiglu_limit': expected a finite number"):
        rd("bad", swiglu_limit="7")


def test_llama4_fields_read_and_refused_in_one_line(tmp_path):
    """Llama 4's own fields: the RoPE layers (no_rope_layers, by default all but every 4th) are the chunked ones,
    attn_temperature_tuning may be written as a number (on where not zero), and a moe_layers list that is not every
    interleave_moe_layer_step-th layer, flags of the wrong count, a null chunk with RoPE layers or layer_types that
    disagree with no_rope_layers are each one line naming the field. Chunked layers cost half a sliding window of
    the chunk's width at long sequences: the keys are causal inside each chunk."""
    from recipe.cost import chunk_keys

    base = json.loads((FIXTURES / "llama-4-scout-17b-16e.json").read_text())

    def rd(name, **over):
        cfg = json.loads(json.dumps(base))
        cfg["text_config"].update(over)
        return from_hf_config(_write(tmp_path, name, cfg))

    assert rd("t4", attn_temperature_tuning=4).llama4.temperature_tuning
    assert rd("empty", no_rope_layers=[]).layer_types == rd("default").layer_types  # empty: the default pattern
    assert not rd("t0", attn_temperature_tuning=0).llama4.temperature_tuning
    flags = [1, 0] * 24
    m = rd("flags", no_rope_layers=flags)
    assert m.layer_types[:2] == ("chunked_attention", "full_attention") and m.num_chunked_layers == 24
    for name, over, field in (("moe", {"moe_layers": [0, 1]}, "moe_layers"),
                              ("few", {"no_rope_layers": [1, 0]}, "no_rope_layers"),
                              ("null", {"attention_chunk_size": None}, "attention_chunk_size"),
                              ("types", {"layer_types": ["full_attention"] * 48}, "layer_types"),
                              ("temp", {"attn_temperature_tuning": "yes"}, "attn_temperature_tuning")):
        with pytest.raises(ValueError) as e:
            rd(name, **over)
        assert "\n" not in str(e.value) and f"'{field}'" in str(e.value), str(e.value)
    scout = rd("scout")
    assert chunk_keys(scout, 4096) == 2048  # within one chunk: causal
    assert chunk_keys(scout, 32768) == 4096  # four whole chunks: C/2
    assert chunk_keys(scout, 12288) == (8192**2 + 4096**2) / (2 * 12288)  # a whole chunk and half of one


def test_glm47_flash_reads_as_deepseek_v3_blocks(tmp_path):
    """GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek-V3's blocks (multi-head latent attention, sigmoid routing with a
    correction bias), its dense layers given by `mlp_layer_types` (transformers' default: one, then sparse), its
    router's defaults one group and scaling 1.8, exported under its own type (hf_model_type, which leaves other
    shapes' fingerprints alone); a pattern whose dense layers do not lead, or an unknown kind, is one line naming the
    field. transformers' default config is the 30B-A3B shape."""
    import transformers

    transformers.Glm4MoeLiteConfig().save_pretrained(tmp_path / "flash")
    m = from_hf_config(tmp_path / "flash" / "config.json")
    assert (m.arch, m.hf_model_type, m.first_dense_layers, m.mla.v_head_dim) == ("deepseek_v3", "glm4_moe_lite", 1, 256)
    assert (m.sigmoid_router.groups, m.sigmoid_router.scaling, m.top_k, m.num_experts) == (1, 1.8, 4, 64)
    assert 29.5e9 < total_params(m) < 30.5e9 and trainable(m) is None
    assert "hf_model_type" not in PRESETS["deepseek-v3"].fingerprint_dict()
    cfg = json.loads((tmp_path / "flash" / "config.json").read_text())
    for name, types in (("mid", ["sparse", "dense"] + ["sparse"] * 45), ("odd", ["dense", "moe"] + ["sparse"] * 45)):
        with pytest.raises(ValueError) as e:
            from_hf_config(_write(tmp_path, name, cfg | {"mlp_layer_types": types}))
        assert "\n" not in str(e.value) and "'mlp_layer_types'" in str(e.value), str(e.value)
    two = from_hf_config(_write(tmp_path, "two", cfg | {"mlp_layer_types": ["dense"] * 2 + ["sparse"] * 45}))
    assert two.first_dense_layers == 2
    # the core rotates MLA's rope channels in pairs (rope_interleave, the default): halves are planned only
    halves = from_hf_config(_write(tmp_path, "halves", cfg | {"rope_interleave": False}))
    assert halves.arch == "moe" and halves.mla is not None and "planned" in trainable(halves)


def test_deepseek_v32_reads_as_deepseek_v3_blocks_with_its_indexer(tmp_path):
    """DeepSeek-V3.2 (`deepseek_v32`): DeepSeek-V3's blocks (multi-head latent attention, sigmoid routing in 8 groups,
    3 dense layers) and its sparse attention's indexer (transformers' defaults: 64 heads of 128, the top 2,048
    keys, RoPE in halves); trained, exported under its own type; the new field leaves other shapes' fingerprints
    alone. transformers' default config is V3.2's 671B shape. Bad indexer fields are one-line errors."""
    import transformers

    transformers.DeepseekV32Config().save_pretrained(tmp_path / "v32")
    m = from_hf_config(tmp_path / "v32" / "config.json")
    v3 = PRESETS["deepseek-v3"]
    assert (m.arch, m.hf_model_type) == ("deepseek_v3", "deepseek_v32")
    assert m.dsa == SparseAttentionShape(topk=2048, index_heads=64, index_head_dim=128, rope_pairs=False)
    assert (m.mla, m.first_dense_layers, m.sigmoid_router, m.num_experts, m.top_k) == (
        v3.mla, v3.first_dense_layers, v3.sigmoid_router, v3.num_experts, v3.top_k)
    assert trainable(m) is None
    assert "dsa" not in v3.fingerprint_dict() and "dsa" in m.fingerprint_dict()
    cfg = json.loads((tmp_path / "v32" / "config.json").read_text())
    for key, bad in (("index_topk", 0), ("index_topk", "2048"), ("index_n_heads", 0), ("index_head_dim", 1.5)):
        with pytest.raises(ValueError) as e:
            from_hf_config(_write(tmp_path, f"bad{key}{bad}", cfg | {key: bad}))
        assert "\n" not in str(e.value) and key in str(e.value), str(e.value)
    assert from_hf_config(_write(tmp_path, "null", cfg | {"index_topk": None})).dsa.topk == 2048  # the default


def test_hunyuan_reads_its_lists_and_its_alpha_rope(tmp_path):
    """Hunyuan-A13B (`hunyuan_v1_moe`): `num_experts` and `moe_topk` given once or once a layer (the same for every
    layer: a list that varies is one line naming the field), experts and shared expert of `intermediate_size`, per-
    head q/k norms; its NTK-alpha RoPE (rope_type dynamic with `alpha`) trains, while a dynamic scaling without alpha
    (the length-dependent one) is planned only; an alpha leaves other shapes' fingerprints as they were."""
    base = {"model_type": "hunyuan_v1_moe", "hidden_size": 4096, "num_hidden_layers": 4, "vocab_size": 128167,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
            "num_experts": 64, "moe_topk": [8, 8, 8, 8],
            "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0}}
    m = from_hf_config(_write(tmp_path, "a13b", base))
    assert (m.arch, m.num_experts, m.top_k, m.expert_ffn, m.shared_expert_ffn, m.qk_norm) == (
        "hunyuan_moe", 64, 8, 3072, 3072, True)
    assert m.rope_scaling.alpha == 1000.0 and trainable(m) is None
    with pytest.raises(ValueError) as e:
        from_hf_config(_write(tmp_path, "varies", base | {"moe_topk": [8, 8, 4, 8]}))
    assert "\n" not in str(e.value) and "'moe_topk'" in str(e.value), str(e.value)
    plain_dynamic = from_hf_config(_write(tmp_path, "dyn", base | {"rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}))
    assert "RoPE scaling 'dynamic'" in trainable(plain_dynamic)
    assert "alpha" not in PRESETS["deepseek-v3"].fingerprint_dict()["rope_scaling"]


def _meta_params(model_cls, cfg, skip: tuple[str, ...] = (), biases: bool = True) -> int:
    """transformers' own parameter count for a config (built on the meta device: no memory), the names holding any
    of `skip` left out; with `biases`, the routers' correction biases, which it keeps as buffers and the shapes
    count as parameters."""
    import torch

    with torch.device("meta"):
        model = model_cls(cfg)
    bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")) if biases else 0
    return bias + sum(p.numel() for n, p in model.named_parameters() if not any(k in n for k in skip))


def _step_hub(layers: int = 5, mtp: int = 3, **extra) -> dict:
    """A Step-3.5/3.7 text config in the hub's form (its per-layer lists also covering the MTP layers)."""
    types = (["full_attention"] + ["sliding_attention"] * 3) * 4
    return {"model_type": "step3p5", "hidden_size": 64, "num_hidden_layers": layers, "vocab_size": 128,
            "num_attention_heads": 4, "num_attention_groups": 2, "head_dim": 16, "intermediate_size": 96,
            "moe_num_experts": 8, "moe_top_k": 2, "moe_intermediate_size": 32, "share_expert_dim": 48,
            "moe_layers_enum": ",".join(str(i) for i in range(2, layers)), "sliding_window": 16,
            "layer_types": types[:layers + mtp], "rope_theta": [5e6 if t == "full_attention" else 1e4
                                                               for t in types[:layers + mtp]],
            "partial_rotary_factors": [0.5 if t == "full_attention" else 1.0 for t in types[:layers + mtp]],
            "attention_other_setting": {"attention_type": "sliding_attention", "num_attention_heads": 6,
                                        "num_attention_groups": 2, "head_dim": 16},
            "swiglu_limits": [0.0] * (layers - 1) + [7.0] + [0.0] * mtp,
            "swiglu_limits_shared": [None] * (layers - 1) + [16.0] + [None] * mtp,
            "moe_router_scaling_factor": 3.0, "num_nextn_predict_layers": mtp, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 4096, "pad_token_id": 1, **extra}


def test_step37_reads_its_hub_and_transformers_forms_alike(tmp_path):
    """Step-3.7's text config in the hub's form (per-layer RoPE lists and clamps that also cover the MTP layers,
    `attention_other_setting`, `moe_layers_enum`) reads as transformers' Step3p7TextConfig reads it, and as that
    config saved; by hand: 6 query heads on the sliding layers beside 4, their own RoPE base and rotated share, two
    dense layers first, a shared expert of 48, the last layer's bounds, the MTP layers counted apart. Its parameters
    equal transformers' Step3p7TextModel's (the routers' correction biases aside). What transformers does not
    read (sliding KV heads or a head size of their own) is planned only or refused in one line."""
    import transformers
    from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig

    hub = _step_hub()
    ours = from_hf_config(_write(tmp_path, "hub", hub))
    cfg = Step3p7TextConfig(**{k: v for k, v in hub.items() if k != "model_type"})
    cfg.save_pretrained(tmp_path / "hf")
    theirs = from_hf_config(tmp_path / "hf" / "config.json")
    wrapped = from_hf_config(_write(tmp_path, "wrapped", {"model_type": "step3p7", "text_config": hub}))
    same = lambda m: dataclasses.replace(m, name="x", source="")  # noqa: E731
    assert same(ours) == same(theirs) == same(wrapped)
    assert (ours.arch, ours.hf_model_type, trainable(ours)) == ("glm4_moe", "step3p5", None)
    assert (ours.num_heads, ours.sliding_heads, ours.num_kv_heads, ours.head_gate, ours.offset_norms) == (
        4, 6, 2, True, True)
    assert (ours.rope_theta, ours.sliding_rope_theta, ours.partial_rotary_factor, ours.sliding_rotary_factor) == (
        5e6, 1e4, 0.5, 1.0)
    assert (ours.first_dense_layers, ours.dense_ffn, ours.shared_expert_ffn, ours.mtp_layers) == (2, 96, 48, 3)
    assert ours.swiglu_limits == (0.0,) * 4 + (7.0,) and ours.swiglu_limits_shared == (0.0,) * 4 + (16.0,)
    assert ours.sigmoid_router.scaling == 3.0 and ours.layer_types == tuple(hub["layer_types"][:5])
    assert (6, "sliding layers' attention heads") in ours.tp_splits()
    assert total_params(ours) - param_counts(ours)["head"] == _meta_params(
        transformers.models.step3p7.modeling_step3p7.Step3p7TextModel, cfg)
    # by hand: a sliding layer's attention, 6 heads of 16 over 2 KV heads, a gate per head, two q/k norm weights
    att = 64 * (6 * 16 + 6 + 2 * 2 * 16) + 6 * 16 * 64 + 2 * 16
    assert param_counts(ours.with_layers(2))["attention"] == att + 64 * (4 * 16 + 4 + 2 * 2 * 16) + 4 * 16 * 64 + 32
    # the releases' rope_scaling is the full layers' alone (transformers puts it in their rope_parameters)
    scaled = dict(rope_scaling={"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 32.0,
                                "original_max_position_embeddings": 1024})
    hub_scaled = from_hf_config(_write(tmp_path, "scaled", _step_hub(**scaled)))
    Step3p7TextConfig(**{k: v for k, v in _step_hub(**scaled).items() if k != "model_type"}).save_pretrained(
        tmp_path / "hf_scaled")
    assert same(hub_scaled) == same(from_hf_config(tmp_path / "hf_scaled" / "config.json"))
    assert (hub_scaled.rope_scaling.kind, hub_scaled.sliding_rope_plain, trainable(hub_scaled)) == ("llama3", True, None)
    planned = from_hf_config(_write(tmp_path, "kv", _step_hub(attention_other_setting={"num_attention_heads": 6,
                                                                                        "num_attention_groups": 1})))
    assert planned.sliding_kv_heads == 1 and "not trained" in trainable(planned)
    with pytest.raises(ValueError) as e:
        from_hf_config(_write(tmp_path, "hd", _step_hub(attention_other_setting={"head_dim": 32})))
    assert "\n" not in str(e.value) and "attention_other_setting.head_dim" in str(e.value)
    for key, v in (("swiglu_limits", [7.0]), ("moe_layers_enum", "2,x"), ("partial_rotary_factors", [0.5])):
        with pytest.raises(ValueError) as e:
            from_hf_config(_write(tmp_path, f"bad_{key}", _step_hub(**{key: v})))
        assert "\n" not in str(e.value) and key in str(e.value), str(e.value)


_KIMI_LA = json.loads((FIXTURES / "kimi-linear-48b-a3b.json").read_text())["linear_attn_config"]


def _kimi_hub(**extra) -> dict:
    """Kimi-Linear-48B-A3B's release config (tests/fixtures/configs/), fields replaced by `extra`."""
    return json.loads((FIXTURES / "kimi-linear-48b-a3b.json").read_text()) | extra


def test_kimi_linear_reads_its_hub_and_transformers_forms_alike(tmp_path):
    """Kimi-Linear's release config (`linear_attn_config` with 1-indexed layer lists, the MoE fields by its own
    names) reads as transformers' KimiLinearConfig reads it, as that config saved, and as transformers' own form
    (0-indexed `layer_types`, `mlp_layer_types`, `linear_*`, the standard MoE names) — the preset, exactly: 20 KDA
    layers of 32 heads of 128, 7 MLA layers without RoPE (every fourth and the last), one dense layer, 256 experts
    (top 8) and one shared, sigmoid routing scaled by 2.446. Its parameters equal transformers' (49.1B on the meta
    device, the routers' correction biases counted), and the core trains it."""
    import transformers

    hub = _kimi_hub()
    ours = from_hf_config(_write(tmp_path, "hub", hub))
    cfg = transformers.KimiLinearConfig(**{k: v for k, v in hub.items() if k != "model_type"})
    cfg.save_pretrained(tmp_path / "saved")
    saved = from_hf_config(tmp_path / "saved" / "config.json")
    own = {"model_type": "kimi_linear", "layer_types": cfg.layer_types, "mlp_layer_types": cfg.mlp_layer_types,
           "linear_num_heads": 32, "linear_head_dim": 128, "linear_conv_kernel_dim": 4, "num_local_experts": 256,
           "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
           "max_position_embeddings": 1048576, "routed_scaling_factor": 2.446,
           **{k: hub[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                                  "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                  "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size", "intermediate_size",
                                  "rope_theta", "rms_norm_eps", "tie_word_embeddings", "pad_token_id")}}
    standard = from_hf_config(_write(tmp_path, "standard", own))
    same = lambda m: dataclasses.replace(m, name="x", source="")  # noqa: E731
    assert same(ours) == same(saved) == same(standard) == same(PRESETS["kimi-linear-48b"])
    # what transformers itself reads from the file
    assert list(ours.layer_types) == cfg.layer_types
    assert ["dense" if ours.is_dense_layer(i) else "sparse" for i in range(27)] == cfg.mlp_layer_types
    la = ours.linear_attn
    assert (la.kind, la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim, la.conv_kernel) == (
        "kda", cfg.linear_num_heads, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_head_dim,
        cfg.linear_conv_kernel_dim)
    assert (ours.num_experts, ours.top_k, ours.shared_expert_ffn, ours.norm_topk_prob, ours.max_position) == (
        cfg.num_local_experts, cfg.num_experts_per_tok, cfg.n_shared_experts * cfg.moe_intermediate_size,
        cfg.norm_topk_prob, cfg.max_position_embeddings)
    r = ours.sigmoid_router
    assert (r.groups, r.topk_groups, r.scaling) == (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
    assert (ours.mla.q_lora_rank, ours.mla.kv_lora_rank, ours.head_dim, ours.dense_ffn, ours.first_dense_layers) == (
        0, 512, 192, 9216, 1)
    assert [i + 1 for i, t in enumerate(ours.layer_types) if t == "full_attention"] == hub["linear_attn_config"][
        "full_attn_layers"]
    assert not any(ours.rotated(i) for i, t in enumerate(ours.layer_types) if t == "full_attention")
    assert (ours.arch, ours.hf_model_type, ours.nope_full_layers, ours.mtp_layers, ours.rope_scaling) == (
        "deepseek_v3", "kimi_linear", True, 0, None)
    assert trainable(ours) is None
    assert total_params(ours) == _meta_params(transformers.KimiLinearForCausalLM, cfg) == 49_122_681_728
    assert (32, "KDA heads") in ours.tp_splits()


def test_kimi_linear_small_model_counts_as_transformers_builds_it(tmp_path):
    """A small Kimi-Linear built by transformers on the CPU (fp32): its parameters, layer by layer, are ours. A KDA
    layer by hand (h = 64, 2 heads of 16, HD = 32, convs of 4): q, k, v 3·64·32; the convs 3·32·4; f_a 64·16, f_b
    16·32, dt_bias 32, A_log 2; b_proj 64·2; g_a 64·16, g_b 16·32; o_norm 16; o_proj 32·64."""
    import torch
    import transformers

    from recipe.models import kda_params

    hub = {"model_type": "kimi_linear", "hidden_size": 64, "num_hidden_layers": 5, "vocab_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32,
           "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True,
           "linear_attn_config": {"kda_layers": [1, 2, 4, 5], "full_attn_layers": [3], "num_heads": 2,
                                  "head_dim": 16, "short_conv_kernel_size": 4},
           "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2, "moe_intermediate_size": 32,
           "intermediate_size": 96, "first_k_dense_replace": 2, "moe_renormalize": True, "num_expert_group": 1,
           "topk_group": 1, "routed_scaling_factor": 2.446, "rms_norm_eps": 1e-5, "model_max_length": 4096,
           "pad_token_id": 0, "tie_word_embeddings": False}
    m = from_hf_config(_write(tmp_path, "small", hub))
    cfg = transformers.KimiLinearConfig(**{k: v for k, v in hub.items() if k != "model_type"})
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(cfg).float()
    kda = 3 * 64 * 32 + 3 * 32 * 4 + 64 * 16 + 16 * 32 + 32 + 2 + 64 * 2 + 64 * 16 + 16 * 32 + 16 + 32 * 64
    assert kda == 11_826 == kda_params(m.linear_attn, 64)
    layers = model.model.layers
    assert [sum(p.numel() for p in layers[i].self_attn.parameters()) for i in (0, 1, 3, 4)] == [kda] * 4
    c = param_counts(m)
    assert c["linear_attention"] == 4 * kda
    assert c["attention"] == sum(p.numel() for p in layers[2].self_attn.parameters())
    assert (m.first_dense_layers, m.shared_expert_ffn, m.layer_types[2]) == (2, 64, "full_attention")
    bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert total_params(m) == sum(p.numel() for p in model.parameters()) + bias


@pytest.mark.parametrize("extra, says", [
    ({"linear_attn_config": {**_KIMI_LA, "gate_lower_bound": -5.0}}, "linear_attn_config.gate_lower_bound"),
    ({"linear_attn_config": {**_KIMI_LA, "use_full_rank_gate": True}}, "linear_attn_config.use_full_rank_gate"),
    ({"use_full_rank_gate": True}, "field 'use_full_rank_gate'"),
    ({"linear_attn_config": {**_KIMI_LA, "kda_layer_index_base": 0}}, "linear_attn_config.kda_layer_index_base"),
    ({"linear_attn_config": {k: v for k, v in _KIMI_LA.items() if k != "num_heads"}},
     "missing field 'linear_attn_config.num_heads'"),
    ({"linear_attn_config": {k: v for k, v in _KIMI_LA.items() if k != "head_dim"}},
     "missing field 'linear_attn_config.head_dim'"),
    ({"linear_attn_config": {**_KIMI_LA, "full_attn_layers": [1, 4, 8, 12, 16, 20, 24, 27]}}, "layer 1 is in both"),
    ({"linear_attn_config": {**_KIMI_LA, "kda_layers": _KIMI_LA["kda_layers"][:-1]}}, "layer 26 is in neither"),
    ({"linear_attn_config": {**_KIMI_LA, "kda_layers": [0] + _KIMI_LA["kda_layers"]}},
     "field 'linear_attn_config.kda_layers': expected a list of layer numbers from 1 to 27"),
    ({"mla_use_nope": False}, "field 'mla_use_nope': expected true"),
    ({"num_nextn_predict_layers": 1}, "field 'num_nextn_predict_layers': expected 0"),
    ({"moe_layer_freq": 2}, "field 'moe_layer_freq'"),
    ({"moe_router_activation_func": "softmax"}, "field 'moe_router_activation_func'"),
    ({"linear_attn_config": [1, 2]}, "field 'linear_attn_config': expected an object")])
def test_kimi_linear_variants_not_built_are_refused_in_one_line(tmp_path, extra, says):
    """KDA variants the release does not have (a lower-bounded or full-rank decay gate, layer lists numbered from
    other than 1, a layer in both lists or in neither, heads missing from `linear_attn_config`), MLA with RoPE,
    MTP layers, MoE off some layers and another router: `recipe solve` refuses each in one line, exit 2."""
    from typer.testing import CliRunner

    from recipe.cli import app

    p = _write(tmp_path, "kimi", _kimi_hub(**extra))
    r = CliRunner().invoke(app, ["solve", "--model", str(p), "--seq", "8k", "--hw", "h100"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.stderr.strip().count("\n") == 0 and says in r.stderr, r.stderr


def test_kimi_delta_attention_is_trained_only_as_kimi_linear():
    """A KDA layer, or linear attention beside MLA, outside Kimi-Linear's model type is planned but not trained, and
    Kimi-Linear without its KDA layers is not Kimi-Linear."""
    from recipe.models import LinearAttnShape

    kimi = PRESETS["kimi-linear-48b"]
    q35 = PRESETS["qwen35-35b"]
    kda = dataclasses.replace(q35.linear_attn, kind="kda", num_v_heads=16)
    assert "Kimi Delta Attention" in trainable(dataclasses.replace(q35, linear_attn=kda))
    assert "Kimi Delta Attention" in trainable(dataclasses.replace(kimi, hf_model_type=None))
    gdn = LinearAttnShape(num_k_heads=32, num_v_heads=32, head_k_dim=128, head_v_dim=128)
    assert "Kimi-Linear without its KDA" in trainable(dataclasses.replace(kimi, linear_attn=gdn))
    # a Gated DeltaNet shape's fingerprint leaves its kind out (the plans solved before the field keep theirs)
    assert "kind" not in q35.fingerprint_dict()["linear_attn"]
    assert kimi.fingerprint_dict()["linear_attn"]["kind"] == "kda"


def test_granite_swa_rope_bases_by_layer_read_as_the_layer_kinds_take_them(tmp_path):
    """Granite-SWA's `layer_rope_theta` (a base a layer, 0: no RoPE) trains where the bases follow the layer kinds:
    one for all, none for the full layers (nope_full_layers), or the sliding layers' own (sliding_rope_theta); bases
    that differ within a kind, or sliding layers without RoPE, are planned only. Every layer has sinks."""
    import transformers

    kinds = ["full_attention", "sliding_attention"] * 2
    base = transformers.GraniteMoeSWAConfig(num_hidden_layers=4, layer_types=kinds).to_dict()
    cases = {"plain": ([1e4] * 4, (1e4, None, False, "granitemoe")),
             "nope": ([0, 1e4, 0, 1e4], (1e4, None, True, "granitemoe")),
             "own": ([5e5, 1e4, 5e5, 1e4], (5e5, 1e4, False, "granitemoe")),
             "mixed": ([1e4, 1e4, 1e4, 2e4], (None, None, None, "moe")),
             "sliding_nope": ([1e4, 0, 1e4, 0], (None, None, None, "moe"))}
    for name, (thetas, (theta, sliding, nope, arch)) in cases.items():
        m = from_hf_config(_write(tmp_path, name, base | {"layer_rope_theta": thetas}))
        assert m.arch == arch, name
        if arch == "granitemoe":
            assert (m.rope_theta, m.sliding_rope_theta, m.nope_full_layers, m.sinks) == (theta, sliding, nope, "all")
            assert trainable(m) is None, name
        else:
            assert "not trained" in trainable(m), name


def test_deepseek_v4_reads_its_layer_kinds_rates_and_hash_layers(tmp_path):
    """DeepSeek-V4 (`deepseek_v4`): its layer kinds from `layer_types`, or from the older `compress_ratios` (0, 4,
    128 a layer), its rates from `compress_rates` or the older scalars, its hash-routed layers from
    `mlp_layer_types` or `num_hash_layers`; planned, not trained (one line says so). The compressed kinds are refused
    for any other model type, and a cut keeps as many hash-routed layers as it has layers."""
    import transformers

    cfg = transformers.DeepseekV4Config(num_hidden_layers=5).to_dict()
    m = from_hf_config(_write(tmp_path, "v4", cfg))
    assert m.layer_types == ("heavily_compressed_attention",) * 3 + (
        "compressed_sparse_attention", "heavily_compressed_attention")
    assert (m.arch, m.num_kv_heads, m.head_dim, m.sliding_window, m.compressed.hash_layers) == (
        "deepseek_v4", 1, 512, 128, 3)
    assert "not trained" in trainable(m) and "\n" not in trainable(m)
    legacy = {k: v for k, v in cfg.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates")} | {
        "compress_ratios": [0, 4, 128, 4, 0], "num_hash_layers": 2, "compress_rate_csa": 8}
    old = from_hf_config(_write(tmp_path, "legacy", legacy))
    assert old.layer_types == ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                               "compressed_sparse_attention", "sliding_attention")
    assert (old.compressed.hash_layers, old.compressed.csa_rate, old.compressed.hca_rate) == (2, 8, 128)
    assert m.with_layers(2).compressed.hash_layers == 2 and m.with_layers(4).compressed.hash_layers == 3
    for i, (key, bad) in enumerate((("mlp_layer_types", ["moe", "hash_moe", "moe", "moe", "moe"]),
                                    ("compress_ratios", [0, 4, 64, 4, 0]))):
        broken = (legacy if key == "compress_ratios" else cfg) | {key: bad}
        with pytest.raises(ValueError, match=f"field '{key}'") as e:
            from_hf_config(_write(tmp_path, f"bad{i}", broken))
        assert "\n" not in str(e.value)
    other = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 100, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "layer_types": ["compressed_sparse_attention", "full_attention"]}
    with pytest.raises(ValueError, match="layer type 'compressed_sparse_attention'"):
        from_hf_config(_write(tmp_path, "other", other))


def test_glm5_reads_as_deepseek_v3_blocks_with_its_indexer(tmp_path):
    """GLM-5 (`glm_moe_dsa`): DeepSeek-V3.2's blocks (multi-head latent attention with q·k 256 and v 256 wide, DSA's
    indexer: 32 heads, RoPE in pairs) with one expert group, scaling 2.5 and three dense layers. transformers' default
    config is GLM-5's shape; cut to five layers its parameters (the indexer's with them) equal transformers' own."""
    import transformers

    transformers.GlmMoeDsaConfig().save_pretrained(tmp_path / "glm5")
    m = from_hf_config(tmp_path / "glm5" / "config.json")
    assert (m.arch, m.hf_model_type) == ("deepseek_v3", "glm_moe_dsa")
    assert m.dsa == SparseAttentionShape(topk=2048, index_heads=32, index_head_dim=128, rope_pairs=True)
    assert (m.mla.q_lora_rank, m.mla.kv_lora_rank, m.mla.qk_nope_head_dim, m.mla.qk_rope_head_dim,
            m.mla.v_head_dim) == (2048, 512, 192, 64, 256)
    assert (m.num_layers, m.first_dense_layers, m.num_experts, m.top_k, m.shared_expert_ffn) == (78, 3, 256, 8, 2048)
    assert (m.sigmoid_router.groups, m.sigmoid_router.topk_groups, m.sigmoid_router.scaling) == (1, 1, 2.5)
    assert m.num_full_attn_layers == 78 and trainable(m) is None
    assert 740e9 < total_params(m) < 750e9  # GLM-5: 744B
    cfg = transformers.GlmMoeDsaConfig(num_hidden_layers=5)
    cfg.save_pretrained(tmp_path / "glm5-5")
    five = from_hf_config(tmp_path / "glm5-5" / "config.json")
    assert total_params(five) == _meta_params(transformers.GlmMoeDsaForCausalLM, cfg)
    cut = json.loads((tmp_path / "glm5-5" / "config.json").read_text())
    del cut["first_k_dense_replace"], cut["mlp_layer_types"]  # transformers' default: three dense layers
    assert from_hf_config(_write(tmp_path, "cut", cut)).first_dense_layers == 3
    # layers sharing an earlier layer's selection: by list, by pattern, or by transformers' freq/offset schedule
    # (the same layers transformers' config derives), each reusing the last indexing layer before it; malformed lists
    # in one line
    del cut["indexer_types"]
    for i, extra in enumerate(({"indexer_types": ["full", "shared", "full", "shared", "shared"]},
                               {"index_topk_pattern": "FSFSS"})):
        assert from_hf_config(_write(tmp_path, f"shared{i}", cut | extra)).dsa.shared_layers == (1, 3, 4)
    sched = transformers.GlmMoeDsaConfig(num_hidden_layers=5, index_topk_freq=2, index_skip_topk_offset=1)
    want = tuple(i for i, t in enumerate(sched.indexer_types) if t == "shared")
    shared = from_hf_config(_write(tmp_path, "sched", cut | {"index_topk_freq": 2, "index_skip_topk_offset": 1}))
    assert want and shared.dsa.shared_layers == want
    assert trainable(shared) is None
    assert [shared.dsa.selection_source(i) for i in want] == [max(j for j in range(i) if j not in want) for i in want]
    assert shared.with_layers(2).dsa.shared_layers == tuple(i for i in want if i < 2)
    for i, bad in enumerate((["shared"] * 5, ["full"] * 4, ["full", "sparse", "full", "full", "full"], "FSFSS")):
        with pytest.raises(ValueError) as e:
            from_hf_config(_write(tmp_path, f"badtypes{i}", cut | {"indexer_types": bad}))
        assert "\n" not in str(e.value) and "indexer_types" in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="field 'index_topk_pattern'"):
        from_hf_config(_write(tmp_path, "badpattern", cut | {"index_topk_pattern": "FXS"}))


@pytest.mark.parametrize("model_type, cls, rel", [
    ("hy_v3", "HYV3ForCausalLM", 0), ("flex_olmo", "FlexOlmoForCausalLM", 0),
    ("qwen3_vl_moe", "Qwen3VLMoeTextModel", 0),
    ("step3p7", "Step3p7TextModel", 0), ("mimo_v2_flash", "MiMoV2FlashForCausalLM", 0),
    ("exaone_moe", "ExaoneMoeForCausalLM", 0), ("afmoe", "AfmoeForCausalLM", 0),
    ("cohere2_moe", "Cohere2MoeForCausalLM", 0)])
def test_moe_types_read_by_their_fields_as_transformers_counts(tmp_path, capsys, model_type, cls, rel):
    """Qwen3-VL-MoE's text model reads as Qwen3-MoE's blocks, MiMo-V2-Flash as its own (its sliding layers'
    doubled KV heads and sinks, values narrower than its keys), Hunyuan-V3 (hy_v3) and K-EXAONE (exaone_moe) as
    GLM-4.5's blocks (a shared expert by count, `num_shared_experts` × the experts' width, the dense first layer by
    `mlp_layer_types`; K-EXAONE's full layers without RoPE), exactly.
    AFMoE (four norms a layer, the output gate) and FlexOlmo (OLMoE's blocks, two norms after the sublayers) too.
    Step-3.7's text model as GLM-4.5's blocks with its gate per head, (1 + w) norms and a shared expert by width
    (`share_expert_dim`). Their parameters (transformers' default configs cut to four layers; the text model of
    the multimodal ones) equal transformers' own, the routers' correction biases (buffers there) aside. Cohere2-MoE
    (one LayerNorm a layer, its parallel block) is counted exactly too."""
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type)
    cfg = getattr(cfg, "text_config", None) or cfg
    for k in ("layer_types", "mlp_layer_types"):
        if getattr(cfg, k, None):
            setattr(cfg, k, getattr(cfg, k)[:4])
    cfg.num_hidden_layers = 4
    cfg.save_pretrained(tmp_path / model_type)
    m = from_hf_config(tmp_path / model_type / "config.json")
    known = model_type in ("qwen3_vl_moe", "mimo_v2_flash", "hy_v3", "exaone_moe", "afmoe", "flex_olmo",
                           "cohere2_moe", "step3p7")  # trained
    assert ("is not known; read by its standard fields as a MoE model" in capsys.readouterr().err) != known
    theirs = _meta_params(getattr(transformers, cls), cfg, skip=() if known else ("q_norm", "k_norm"),
                          biases=model_type in ("mimo_v2_flash", "hy_v3", "exaone_moe", "afmoe", "step3p7"))
    theirs += param_counts(m)["head"] if cls.endswith("TextModel") else 0  # the text model without its head
    assert abs(total_params(m) - theirs) <= rel * theirs, (total_params(m), theirs)
    if model_type == "hy_v3":
        assert (m.first_dense_layers, m.dense_ffn, m.shared_expert_ffn) == (1, 13312, 1536)
        assert (m.arch, m.qk_norm, m.sigmoid_router.scaling, trainable(m)) == ("glm4_moe", True, 2.826, None)
    if model_type == "exaone_moe":  # K-EXAONE: three sliding layers (4,096 keys) to a full one without RoPE
        assert (m.layer_types, m.sliding_window, m.nope_full_layers, m.first_dense_layers, trainable(m)) == (
            ("sliding_attention",) * 3 + ("full_attention",), 4096, True, 1, None)
    if model_type == "mimo_v2_flash":
        assert (m.sliding_window, m.num_sliding_layers, m.first_dense_layers) == (128, 3, 1)
        assert (m.sliding_kv_heads, m.v_head_dim, m.value_scale, m.sliding_rope_theta, m.rope_theta) == (
            8, 128, 0.707, 1e4, 5e6)
        assert trainable(m) is None


def test_generic_moe_shared_experts_dense_layers_and_windows_by_hand(tmp_path, capsys):
    """An unknown MoE type: shared experts by width or by count, dense layers by `first_k_dense_replace` or by
    `mlp_layer_types` (counted wherever they sit), the window of its sliding layers; hand-worked counts."""
    base = dict(model_type="my_moe", hidden_size=64, num_hidden_layers=4, num_attention_heads=4, vocab_size=100,
                num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, intermediate_size=128)
    by_count = from_hf_config(_write(tmp_path, "a", base | {"n_shared_experts": 2, "first_k_dense_replace": 1}))
    assert (by_count.shared_expert_ffn, by_count.num_dense_layers, by_count.dense_ffn) == (64, 1, 128)
    c = param_counts(by_count)
    assert c["shared_expert"] == 3 * 64 * 64 * 3 and c["dense_ffn"] == 3 * 64 * 128
    assert c["routed_experts"] == 3 * 8 * 3 * 64 * 32 and c["router"] == 3 * 64 * 8
    by_width = from_hf_config(_write(tmp_path, "b", base | {"share_expert_dim": 48, "mlp_layer_types": [
        "sparse", "dense", "sparse", "dense"]}))
    assert (by_width.shared_expert_ffn, by_width.num_dense_layers) == (48, 2)
    slid = from_hf_config(_write(tmp_path, "c", base | {"sliding_window": 16, "layer_types": [
        "sliding_attention", "full_attention"] * 2}))
    assert (slid.sliding_window, slid.num_sliding_layers) == (16, 2)
    capsys.readouterr()
    for bad in (["dense"], ["dense", "moe", "sparse", "sparse"], "dense"):
        with pytest.raises(ValueError) as e:
            from_hf_config(_write(tmp_path, f"bad{len(bad)}{bad[0]}", base | {"mlp_layer_types": bad}))
        assert "\n" not in str(e.value) and "mlp_layer_types" in str(e.value), str(e.value)


def test_mistral_slides_every_layer_unless_its_window_is_null(tmp_path):
    """transformers' Mistral slides every layer over `sliding_window` keys, 4096 where the field is absent (v0.1);
    v0.2 and later write null. A sliding Mistral is planned and trained with its window (tests/test_hf_parity.py);
    Mixtral slides every layer the same way where its config sets a window (every release writes null)."""
    cfg = json.loads((FIXTURES / "llama-3-8b.json").read_text()) | {"model_type": "mistral"}
    cfg.pop("sliding_window", None)
    v01 = from_hf_config(_write(tmp_path, "v01", cfg))
    assert (v01.sliding_window, v01.num_sliding_layers) == (4096, v01.num_layers)
    assert trainable(v01) is None
    mixtral = json.loads((FIXTURES / "mixtral-8x7b.json").read_text())
    assert from_hf_config(_write(tmp_path, "mixtral", mixtral)).num_sliding_layers == 0
    windowed = from_hf_config(_write(tmp_path, "mixtral_w", mixtral | {"sliding_window": 4096}))
    assert (windowed.sliding_window, windowed.num_sliding_layers) == (4096, windowed.num_layers)
    v03 = from_hf_config(_write(tmp_path, "v03", cfg | {"sliding_window": None}))
    assert (v03.sliding_window, v03.num_sliding_layers) == (None, 0) and trainable(v03) is None


@pytest.mark.parametrize("cfg, says", [
    (dict(model_type="qwen3_next", layer_types=["qwen_sparse_attention", "full_attention"]),
     "layer type 'qwen_sparse_attention' (model_type 'qwen3_next') is not planned"),
    (dict(model_type="kimi_linear", linear_attn_config={"gate_lower_bound": -5.0}),
     "field 'linear_attn_config.gate_lower_bound': expected null (KDA with a lower-bounded decay gate is not planned)"),
    (dict(model_type="jamba"), "model_type 'jamba' has Mamba layers, which this tool does not plan"),
    # families whose standard fields would read as blocks they do not have
    (dict(model_type="jetmoe"), "model_type 'jetmoe' has mixture-of-attention experts"),
    (dict(model_type="longcat_flash"), "model_type 'longcat_flash' has zero-computation experts"),
    (dict(model_type="lfm2_moe"), "model_type 'lfm2_moe' has short-convolution layers"),
    (dict(model_type="arcee"), "model_type 'arcee' has an MLP without a gate"),
    (dict(model_type="qwen4_exp_text"), "model_type 'qwen4_exp_text' has hyper-connections, hashed n-gram"),
    (dict(model_type="glm5_next_text"), "model_type 'glm5_next_text' has hyper-connections (mHC)"),
    (dict(model_type="hy_v4"), "model_type 'hy_v4' has hyper-connections (iHC)"),
    (dict(model_type="doge"), "model_type 'doge' has cross-domain experts"),  # read as FFNs: 8,000 times too many
    (dict(model_type="openai_privacy_filter"), "has bidirectional attention (a token classifier"),
    (dict(model_type="diffusion_gemma_text"), "has bidirectional denoising layers (a diffusion language model"),
    # dense families the Llama reading would miscount: GPT-NeoX's ungated MLP (+32%), an encoder, Gemma 3's blocks
    (dict(model_type="gpt_neox"), "model_type 'gpt_neox' has an MLP without a gate"),
    (dict(model_type="roberta"), "has bidirectional encoder layers (an encoder, not a causal language model)"),
    (dict(model_type="gemma4_unified_text"), "has Gemma's blocks with an encoder")])
def test_mixers_the_tool_does_not_plan_are_refused_in_one_line(tmp_path, cfg, says):
    from typer.testing import CliRunner

    from recipe.cli import app

    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64)
    p = _write(tmp_path, cfg["model_type"], base | cfg)
    r = CliRunner().invoke(app, ["solve", "--model", str(p), "--seq", "8k", "--hw", "h200", "--gpus", "8"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.stderr.strip().count("\n") == 0 and says in r.stderr, r.stderr


def test_cohere2_moe_dense_prefix_and_sigmoid_selection_read_as_transformers_builds_them(tmp_path):
    """A Cohere2-MoE config that names its dense prefix by `first_k_dense_replace` (no layer lists) reads as
    transformers' Cohere2MoeConfig derives it: the prefix's layers by their own sliding-window pattern (1: all full,
    and then rotated, as transformers forces RoPE there), the rest by `sliding_window_pattern`, the dense layers
    first at `prefix_dense_intermediate_size`; sigmoid selection with its renormalization flag. A dense layer after
    a sparse one, a prefix without its width, or another selection function is refused in one line."""
    import transformers

    raw = dict(model_type="cohere2_moe", vocab_size=256, hidden_size=64, num_attention_heads=4,
               num_key_value_heads=2, num_hidden_layers=7, num_experts=8, num_experts_per_tok=2,
               intermediate_size=32, first_k_dense_replace=2, prefix_dense_intermediate_size=96,
               sliding_window_pattern=3, sliding_window=16, expert_selection_fn="sigmoid", norm_topk_prob=False)
    for pattern in (1, 2):
        cfg = raw | {"prefix_dense_sliding_window_pattern": pattern}
        ref = transformers.Cohere2MoeConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
        m = from_hf_config(_write(tmp_path, f"p{pattern}", cfg))
        assert list(m.layer_types) == ref.layer_types
        assert ["dense" if m.is_dense_layer(i) else "sparse" for i in range(7)] == ref.mlp_layer_types
        assert (m.first_dense_layers, m.dense_ffn, m.sigmoid_top, m.norm_topk_prob, m.rotated_prefix) == (
            2, 96, True, False, pattern == 1)
        # RoPE where transformers applies it: the sliding layers, and the prefix where its pattern is 1
        assert [m.rotated(i) for i in range(7)] == [t == "sliding_attention" or (i < 2 and pattern == 1)
                                                   for i, t in enumerate(ref.layer_types)]
        assert trainable(m) is None
    for i, (extra, field) in enumerate((({"mlp_layer_types": ["sparse", "dense"] + ["sparse"] * 5}, "mlp_layer_types"),
                                        ({"prefix_dense_intermediate_size": None}, "prefix_dense_intermediate_size"),
                                        ({"expert_selection_fn": "relu"}, "expert_selection_fn"))):
        with pytest.raises(ValueError) as e:
            from_hf_config(_write(tmp_path, f"bad{i}", raw | extra))
        assert "\n" not in str(e.value) and field in str(e.value), str(e.value)


def test_mistral4_reads_as_transformers_and_its_mistral3_wrapper(tmp_path):
    """Mistral Small 4's text model (transformers' Mistral4Config defaults, the release's figures), alone and as the
    `text_config` of its `mistral3` wrapper (beside a pixtral vision tower): the preset exactly, DeepSeek-V3's MLA
    under a softmax router without a correction bias, YaRN ×128 from 8192, the query scale by position from
    `rope_parameters` (β 0.1 over 8192 positions); 118.97B parameters as transformers counts them; trained. A
    non-zero scaling β without its period, or expert groups (scored by their two best), stay out of training."""
    import transformers

    cfg = transformers.Mistral4Config()
    cfg.save_pretrained(tmp_path / "alone")
    alone = from_hf_config(tmp_path / "alone" / "config.json")
    wrapped = from_hf_config(_write(tmp_path, "wrapped", {
        "model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
        "text_config": json.loads((tmp_path / "alone" / "config.json").read_text()),
        "vision_config": {"model_type": "pixtral", "hidden_size": 1024}}))
    same = lambda m: dataclasses.replace(m, name="x", source="")  # noqa: E731
    assert same(alone) == same(wrapped) == same(PRESETS["mistral-small-4"])
    assert (alone.arch, alone.hf_model_type, alone.router_bias, alone.sigmoid_router) == (
        "deepseek_v3", "mistral4", False, None)
    r = alone.softmax_router
    assert (r.groups, r.topk_groups, r.scaling) == (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
    assert (alone.query_scale_period, alone.query_scale_beta) == (
        cfg.rope_parameters["original_max_position_embeddings"], cfg.rope_parameters["llama_4_scaling_beta"])
    assert (alone.rope_scaling.kind, alone.rope_scaling.factor, alone.rope_scaling.original_max_position) == (
        "yarn", 128.0, 8192)
    assert trainable(alone) is None
    assert total_params(alone) == _meta_params(transformers.Mistral4ForCausalLM, cfg) == 118_972_826_624
    raw = json.loads((tmp_path / "alone" / "config.json").read_text())
    no_period = raw | {"rope_parameters": {k: v for k, v in raw["rope_parameters"].items()
                                           if k != "original_max_position_embeddings"} | {"rope_type": "default"}}
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        from_hf_config(_write(tmp_path, "no_period", no_period))
    grouped = from_hf_config(_write(tmp_path, "grouped", raw | {"n_group": 4, "topk_group": 2}))
    assert "expert groups" in trainable(grouped)


def test_minimax_m3_reads_as_transformers_builds_it(tmp_path):
    """MiniMax-M3 (transformers' MiniMaxM3VLTextConfig defaults, MiniMaxAI/MiniMax-M3's figures) with block-sparse
    layers and dense layers first: as transformers saves it and in the releases' form (`sparse_attention_config`
    with a flag a layer, `moe_layer_freq`), it reads alike, as transformers reads both; the block-sparse layers are
    full attention with the indexer's fields (`block_sparse`); per-head q/k norms, (1 + w) norms, RoPE on 64 of 128
    channels, a sigmoid router ×2.0 beside a shared expert; its parameters (the indexers' among them) as
    transformers counts them; planned, not trained (one line). Unknown layer types are refused in one line."""
    import transformers

    from recipe.models import block_index_params

    types = ["full_attention" if i % 4 == 0 else "minimax_m3_sparse" for i in range(60)]
    mlp = ["dense"] * 2 + ["sparse"] * 58
    cfg = transformers.MiniMaxM3VLTextConfig(layer_types=types, mlp_layer_types=mlp)
    cfg.save_pretrained(tmp_path / "m3")
    shape = from_hf_config(tmp_path / "m3" / "config.json")
    b = shape.block_sparse
    assert (b.block, b.topk_blocks, b.local_blocks, b.index_heads, b.index_head_dim) == (128, 16, 1, 4, 128)
    assert b.layers == tuple(i for i, t in enumerate(types) if t == "minimax_m3_sparse") and len(b.layers) == 45
    assert set(shape.layer_types) == {"full_attention"} and (shape.num_heads, shape.num_kv_heads) == (64, 4)
    assert (shape.first_dense_layers, shape.dense_ffn, shape.expert_ffn, shape.shared_expert_ffn) == (2, 12288, 3072,
                                                                                                      3072)
    assert (shape.partial_rotary_factor, shape.qk_norm, shape.offset_norms, shape.top_k) == (0.5, True, True, 4)
    assert shape.sigmoid_router.scaling == 2.0 and shape.hf_model_type == "minimax_m3"
    assert total_params(shape) == _meta_params(transformers.MiniMaxM3VLForCausalLM, cfg)
    assert block_index_params(shape) == 6144 * 4 * 128 + 6144 * 128 + 2 * 128
    why = trainable(shape)
    assert why is not None and "not trained" in why and "\n" not in why
    release = json.loads((tmp_path / "m3" / "config.json").read_text())
    release = {k: v for k, v in release.items() if k not in ("layer_types", "mlp_layer_types")} | {
        "sparse_attention_config": {"sparse_attention_freq": [int(t != "full_attention") for t in types],
                                    "sparse_topk_blocks": 16, "sparse_block_size": 128},
        "moe_layer_freq": [int(t == "sparse") for t in mlp]}
    theirs = transformers.MiniMaxM3VLTextConfig(**{k: v for k, v in release.items() if k != "model_type"})
    assert theirs.layer_types == types and theirs.mlp_layer_types == mlp
    same = {"name": "x", "source": ""}
    assert from_hf_config(_write(tmp_path, "release", release)).model_copy(update=same) == shape.model_copy(update=same)
    with pytest.raises(ValueError) as e:
        from_hf_config(_write(tmp_path, "bad", release | {"layer_types": ["sliding_attention"] * 60}))
    assert "field 'layer_types': expected 60 entries of" in str(e.value) and "\n" not in str(e.value)


def test_axk2_reads_as_transformers_builds_it(tmp_path):
    """A.X K2 (transformers' AXK2Config defaults: A.X-K2-Light's figures): DeepSeek-V3.2's blocks (MLA with the q
    LoRA, sparse attention on every layer, 16 index heads; ungrouped sigmoid routing, a shared expert, one dense
    layer first) with the gated query (q_gate_proj from both q latents: each head's query and its output's gate) and
    gated block norms of rank 16; its parameters as transformers counts them; the attention's matmuls the cost
    model charges hold every attention weight but the norms and the frozen indexer; trained. A config without the q
    LoRA, or with dense layers between MoE ones, is refused in one line."""
    import transformers

    from recipe.cost import dense_matmuls
    from recipe.models import _full_attention_params, indexer_params

    cfg = transformers.AXK2Config()
    cfg.save_pretrained(tmp_path / "axk2")
    shape = from_hf_config(tmp_path / "axk2" / "config.json")
    a, d, r = shape.mla, shape.dsa, shape.sigmoid_router
    assert (shape.arch, shape.hf_model_type, a.query_gate, shape.gated_norm_rank) == ("deepseek_v3", "axk2", True, 16)
    assert (a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim) == (384, 128, 64, 32, 64)
    assert (d.topk, d.index_heads, d.index_head_dim, d.shared_layers) == (2048, 16, 128, ())
    assert (r.groups, r.topk_groups, r.scaling) == (1, 1, 2.5) and shape.first_dense_layers == 1
    assert shape.shared_expert_ffn == 512 and trainable(shape) is None
    assert total_params(shape) == _meta_params(transformers.AXK2ForCausalLM, cfg)
    mixer = dense_matmuls(shape, "full_attention", moe=True)[:5]  # q_a, q_gate, kv_a, kv_b, o
    assert sum(k * n for k, n in mixer) == _full_attention_params(shape, "full_attention") - indexer_params(shape) \
        - a.q_lora_rank - a.kv_lora_rank
    assert mixer[1] == (2 * 384, 32 * (96 + 64))  # both latents in; each head's query and its 64 gates out
    text = json.loads((tmp_path / "axk2" / "config.json").read_text())
    for i, (change, says) in enumerate((
            (dict(q_lora_rank=None), "field 'q_lora_rank': expected a positive whole number"),
            (dict(mlp_layer_types=["dense", "sparse", "dense"] + ["sparse"] * 45),
             "field 'mlp_layer_types': expected the dense layers first"))):
        with pytest.raises(ValueError) as e:
            from_hf_config(_write(tmp_path, f"bad{i}", text | change))
        assert says in str(e.value) and "\n" not in str(e.value)


def test_axk1_reads_as_transformers_builds_it(tmp_path):
    """A.X K1 (transformers' AXK1Config defaults, the release's figures): the preset exactly, DeepSeek-V3's blocks
    with an RMSNorm on each MoE block's output (its 60 MoE layers; the dense first layer has none), grouped sigmoid
    routing (8 groups, 4 chosen); its parameters as transformers counts them (518.98B, the 60 output norms among
    them); trained. The output norm keeps the experts' output for the backward, which the cost model's expert
    parallelism charges (a combine again in the recomputed forward)."""
    import transformers

    cfg = transformers.AXK1Config()
    cfg.save_pretrained(tmp_path / "axk1")
    shape = from_hf_config(tmp_path / "axk1" / "config.json")
    assert dataclasses.replace(shape, name="x", source="") == dataclasses.replace(PRESETS["ax-k1"], name="x",
                                                                                    source="")
    assert (shape.moe_output_norm, shape.moe_output_saved, shape.hf_model_type) == (True, True, "axk1")
    r = shape.sigmoid_router
    assert (r.groups, r.topk_groups, r.scaling) == (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
    assert trainable(shape) is None
    assert total_params(shape) == _meta_params(transformers.AXK1ForCausalLM, cfg) == 518_983_063_808
    plain = dataclasses.replace(shape, moe_output_norm=False)
    assert total_params(shape) - total_params(plain) == 60 * cfg.hidden_size
    assert "outside A.X K1" in trainable(dataclasses.replace(shape, hf_model_type=None))


def test_mellum_reads_as_transformers_and_the_preset(tmp_path):
    """Mellum 2's release config: the preset exactly (three 1024-token sliding layers to a full one, the full layers'
    YaRN ×16 with its attention factor, the sliding ones plain at the same base), equal to what transformers'
    MellumConfig reads from it; trained. Sliding layers at a base of their own (transformers' default form) read as
    such; a sliding layers' rotated share of its own is planned only."""
    import transformers

    raw = json.loads((FIXTURES / "mellum2-12b-a2.5b.json").read_text())
    shape = from_hf_config(FIXTURES / "mellum2-12b-a2.5b.json")
    assert dataclasses.replace(shape, name="x", source="") == dataclasses.replace(PRESETS["mellum2-12b"], name="x",
                                                                                    source="")
    cfg = transformers.MellumConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert list(shape.layer_types) == cfg.layer_types and shape.sliding_window == cfg.sliding_window
    full = cfg.rope_parameters["full_attention"]
    assert (shape.rope_scaling.kind, shape.rope_scaling.factor, shape.rope_scaling.attention_factor) == (
        full["rope_type"], full["factor"], full["attention_factor"])
    assert shape.sliding_rope_plain and shape.sliding_rope_theta is None and trainable(shape) is None
    own = raw | {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    two_bases = from_hf_config(_write(tmp_path, "mellum_bases", own))
    assert (two_bases.rope_theta, two_bases.sliding_rope_theta, two_bases.rope_scaling) == (5e5, 1e4, None)
    assert trainable(two_bases) is None
    share = raw | {"rope_parameters": raw["rope_parameters"] | {
        "sliding_attention": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5}}}
    assert "not trained" in trainable(from_hf_config(_write(tmp_path, "mellum_share", share)))


_LAGUNA = {"architectures": ["LagunaForCausalLM"], "model_type": "laguna", "vocab_size": 100352, "hidden_size": 2048,
           "intermediate_size": 8192, "num_hidden_layers": 40, "num_attention_heads": 48, "num_key_value_heads": 8,
           "head_dim": 128, "sliding_window": 512, "num_experts": 256, "num_experts_per_tok": 8,
           "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "moe_routed_scaling_factor": 2.5,
           "tie_word_embeddings": False, "gating": "per-head", "max_position_embeddings": 262144,
           "layer_types": ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(40)],
           "mlp_layer_types": ["dense"] + ["sparse"] * 39,
           "num_attention_heads_per_layer": [48 if i % 4 == 0 else 64 for i in range(40)]}


def test_laguna_reads_as_transformers_builds_it(tmp_path):
    """Laguna XS.2's config (its RoPE left to transformers' defaults): the preset exactly, read as transformers'
    LagunaConfig reads it (48 query heads on the full layers, 64 on the sliding ones; half of each full head rotated
    at base 5e5, the sliding heads whole at 1e4; a softplus gate per head; the routed output times 2.5), the same
    from the config transformers saves; its parameters as transformers counts them; trained. A gate per channel,
    soft-capped router logits and head counts that do not follow the layer kinds are planned only; router weights
    on the experts' input are refused in one line."""
    import transformers

    shape = from_hf_config(_write(tmp_path, "laguna", _LAGUNA))
    same = lambda m: dataclasses.replace(m, name="x", source="")  # noqa: E731
    assert same(shape) == same(PRESETS["laguna-xs2"])
    cfg = transformers.LagunaConfig(**{k: v for k, v in _LAGUNA.items() if k != "model_type"})
    cfg.save_pretrained(tmp_path / "saved")
    assert same(from_hf_config(tmp_path / "saved" / "config.json")) == same(shape)
    assert [shape.heads_at(k) for k in shape.layer_types] == cfg.num_attention_heads_per_layer
    full, sliding = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
    assert (shape.rope_theta_at("full_attention"), shape.rotary_factor_at("full_attention")) == (
        full["rope_theta"], full["partial_rotary_factor"])
    assert (shape.rope_theta_at("sliding_attention"), shape.rotary_factor_at("sliding_attention")) == (
        sliding["rope_theta"], sliding["partial_rotary_factor"])
    assert (shape.head_gate, shape.head_gate_activation, shape.sigmoid_router.scaling) == (True, "softplus", 2.5)
    assert trainable(shape) is None
    assert total_params(shape) == _meta_params(transformers.LagunaForCausalLM, cfg)
    for i, extra in enumerate(({"gating": "per-element"}, {"moe_router_logit_softcapping": 30.0}, {
            "num_attention_heads_per_layer": [48 if i % 4 == 0 else 64 + 8 * (i % 2) for i in range(40)]})):
        assert "not trained" in trainable(from_hf_config(_write(tmp_path, f"variant{i}", _LAGUNA | extra))), extra
    with pytest.raises(ValueError, match="moe_apply_router_weight_on_input"):
        from_hf_config(_write(tmp_path, "on_input", _LAGUNA | {"moe_apply_router_weight_on_input": True}))


def test_an_unknown_dense_type_is_planned_not_trained(tmp_path):
    """Gemma 2's config has Llama's field names, but its norms sit before and after each sublayer and scale by
    (1 + w), its attention scores are soft-capped and its MLP is GeGLU: read by its standard fields it plans as a
    Llama block, and the core refuses to train that block (one line) rather than load weights into the wrong
    math; a Llama config of the same fields trains."""
    import transformers

    transformers.Gemma2Config(num_hidden_layers=2).save_pretrained(tmp_path / "gemma2")
    shape = from_hf_config(tmp_path / "gemma2" / "config.json")
    why = trainable(shape)
    assert shape.arch == "dense" and shape.hf_model_type == "gemma2"
    assert why is not None and "model_type 'gemma2' was read by its standard fields" in why and "\n" not in why
    transformers.LlamaConfig(num_hidden_layers=2).save_pretrained(tmp_path / "llama")
    assert trainable(from_hf_config(tmp_path / "llama" / "config.json")) is None


def test_olmo3_reads_its_releases_legacy_fields_as_transformers_does(tmp_path):
    """An OLMo 3 config in the legacy fields (`rope_theta`, a YaRN `rope_scaling` for the full layers, no layer
    types) reads as the config transformers builds from it and saves: three sliding layers (4,096 keys, RoPE
    unscaled) to one full (YaRN), norms after each sublayer, q/k normed over all heads together; its parameters as
    transformers counts them; trained. OLMo 2 reads with transformers' RoPE base (1e4) where it gives none."""
    import transformers

    raw = dict(model_type="olmo3", hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
               num_attention_heads=8, num_key_value_heads=8, vocab_size=1000, rope_theta=500000.0,
               rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
                             "beta_fast": 32, "beta_slow": 1, "attention_factor": 1.2079},
               max_position_embeddings=65536)
    ours = from_hf_config(_write(tmp_path, "raw", raw))
    cfg = transformers.Olmo3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    cfg.save_pretrained(tmp_path / "saved")
    same = {"name": "x", "source": ""}
    assert from_hf_config(tmp_path / "saved" / "config.json").model_copy(update=same) == ours.model_copy(update=same)
    assert list(ours.layer_types) == cfg.layer_types and ours.sliding_window == 4096
    assert (ours.rope_scaling.kind, ours.sliding_rope_plain, ours.norm_placement, ours.whole_qk_norm) == (
        "yarn", True, "post", True)
    assert total_params(ours) == _meta_params(transformers.Olmo3ForCausalLM, cfg) and trainable(ours) is None
    olmo2 = from_hf_config(_write(tmp_path, "olmo2", {k: v for k, v in raw.items() if not k.startswith("rope")}
                                  | {"model_type": "olmo2"}))
    assert (olmo2.rope_theta, olmo2.rope_scaling, olmo2.rms_norm_eps, trainable(olmo2)) == (10000.0, None, 1e-5, None)


def test_gemma3_reads_its_releases_legacy_fields_as_transformers_does(tmp_path):
    """A Gemma 3 release config in its legacy fields (a `gemma3` wrapper's text_config: `rope_theta` and
    `rope_scaling` linear ×8 for the full layers, `rope_local_base_freq` for the sliding ones,
    `sliding_window_pattern` 6, no layer types) reads as the config transformers builds from it and saves: five
    sliding layers (RoPE at 1e4, unscaled) to one full (1e6, linear ×8), (1 + w) sandwich norms, the softmax scale
    1/√query_pre_attn_scalar, the embedding times √hidden_size; trained. Attention-logit soft-capping is refused in
    one line."""
    import transformers

    text = dict(model_type="gemma3_text", hidden_size=2560, intermediate_size=10240, num_hidden_layers=12,
                num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                sliding_window=1024, sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                rope_scaling={"rope_type": "linear", "factor": 8.0}, vocab_size=262208, final_logit_softcapping=None)
    release = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text}
    ours = from_hf_config(_write(tmp_path, "release", release))
    cfg = transformers.Gemma3TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    cfg.save_pretrained(tmp_path / "saved")
    same = {"name": "x", "source": ""}
    assert from_hf_config(tmp_path / "saved" / "config.json").model_copy(update=same) == ours.model_copy(update=same)
    assert list(ours.layer_types) == cfg.layer_types and ours.layer_types[5] == "full_attention"
    assert (ours.rope_theta, ours.sliding_rope_theta, ours.sliding_rope_plain) == (1e6, 1e4, True)
    assert (ours.rope_scaling.kind, ours.rope_scaling.factor) == ("linear", 8.0)
    assert (ours.offset_norms, ours.norm_placement, ours.query_pre_attn_scalar) == (True, "sandwich", 256.0)
    assert ours.embedding_scale == 2560 ** 0.5 and ours.tie_embeddings and trainable(ours) is None
    assert total_params(ours) == _meta_params(transformers.Gemma3ForCausalLM, cfg)
    with pytest.raises(ValueError) as e:
        from_hf_config(_write(tmp_path, "capped", text | {"attn_logit_softcapping": 50.0}))
    assert "field 'attn_logit_softcapping': expected null" in str(e.value) and "\n" not in str(e.value)


def test_gemma4_reads_as_transformers_builds_it(tmp_path):
    """Gemma 4 26B-A4B's release config (a `gemma4` wrapper's text_config), the bare text config and transformers'
    Gemma4TextConfig as saved read alike, as the preset: five sliding layers of 256-wide heads (8 KV heads, 1,024
    keys, RoPE at 1e4 on whole heads) to one full layer of 512-wide heads (2 KV heads whose values are their keys,
    RoPE at 1e6 on a quarter), the dense MLP beside the experts as a shared expert of its width. Its parameters equal
    transformers' (25.23B on the meta device), and so do a small config's without keys as values and with
    transformers' default layer types (the last forced full). The full layers' RoPE reads as proportional, the
    logits' soft cap as given; the core trains it (its numerics against transformers: tests/test_gemma4.py)."""
    import transformers

    release = json.loads((FIXTURES / "gemma-4-26b-a4b.json").read_text())
    text = release["text_config"]
    ours = from_hf_config(_write(tmp_path, "release", release))
    bare = from_hf_config(_write(tmp_path, "bare", text))
    cfg = transformers.Gemma4TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    cfg.save_pretrained(tmp_path / "saved")
    saved = from_hf_config(tmp_path / "saved" / "config.json")
    same = lambda m: dataclasses.replace(m, name="x", source="")  # noqa: E731
    assert same(ours) == same(bare) == same(saved) == same(PRESETS["gemma4-26b-a4b"])
    full, sliding = cfg.per_layer_config[5], cfg.per_layer_config[0]
    assert (ours.head_dim, ours.num_kv_heads, ours.sliding_head_dim, ours.sliding_kv_heads) == (
        full.head_dim, full.num_key_value_heads, sliding.head_dim, sliding.num_key_value_heads) == (512, 2, 256, 8)
    assert list(ours.layer_types) == cfg.layer_types and ours.sliding_window == cfg.sliding_window == 1024
    assert (ours.partial_rotary_factor, ours.sliding_rotary_factor, ours.rope_theta, ours.sliding_rope_theta) == (
        0.25, 1.0, 1e6, 1e4)
    assert total_params(ours) == _meta_params(transformers.Gemma4ForCausalLM, cfg) == 25_233_141_760
    assert abs(active_params(ours) / 1e9 - 3.8) < 0.05
    assert trainable(ours) is None and ours.rope_proportional and ours.final_logit_softcap == 30.0
    # a small one: values projected on the full layers, transformers' default layer types (5 sliding : 1 full,
    # the last forced full), its default head widths and RoPE
    small = dict(model_type="gemma4_text", hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=96, vocab_size=128, enable_moe_block=True, num_experts=8,
                 top_k_experts=2, moe_intermediate_size=32, global_head_dim=32, head_dim=16,
                 hidden_size_per_layer_input=0)
    mine = from_hf_config(_write(tmp_path, "small", small))
    theirs = transformers.Gemma4TextConfig(**{k: v for k, v in small.items() if k != "model_type"})
    assert list(mine.layer_types) == theirs.layer_types and theirs.layer_types[-1] == "full_attention"
    assert not mine.keys_as_values and mine.sliding_kv_heads is None
    assert total_params(mine) == _meta_params(transformers.Gemma4ForCausalLM, theirs)
    # overrides by layer as transformers saves them: one of the KV heads alone keeps the base head width
    types = ["sliding_attention"] * 5 + ["full_attention"]
    by_layer = {k: v for k, v in small.items() if k != "global_head_dim"} | {
        "num_hidden_layers": 6, "layer_types": types, "attention_k_eq_v": True,
        "per_layer_config": {"5": {"num_key_value_heads": 1}}}
    mine = from_hf_config(_write(tmp_path, "by_layer", by_layer))
    theirs = transformers.Gemma4TextConfig(**{k: v for k, v in by_layer.items() if k != "model_type"})
    assert (mine.head_dim, mine.sliding_head_dim, mine.num_kv_heads, mine.sliding_kv_heads) == (16, None, 1, 2)
    assert total_params(mine) == _meta_params(transformers.Gemma4ForCausalLM, theirs)
    with pytest.raises(ValueError, match="per_layer_config': expected one override for every full-attention layer"):
        from_hf_config(_write(tmp_path, "uneven", by_layer | {"per_layer_config": {"0": {"head_dim": 32}}}))


@pytest.mark.parametrize("change, says", [
    (dict(enable_moe_block="yes"), "field 'enable_moe_block': expected true or false"),
    (dict(hidden_size_per_layer_input=256), "field 'hidden_size_per_layer_input': expected 0 or null (per-layer"),
    ({"hidden_size_per_layer_input": None}, None),  # null: none, as transformers reads it
    (dict(num_kv_shared_layers=4), "field 'num_kv_shared_layers': expected 0 or null"),
    (dict(use_bidirectional_attention="all"), "field 'use_bidirectional_attention': expected \"vision\" or null"),
    (dict(hidden_activation="gelu"), "field 'hidden_activation': expected \"gelu_pytorch_tanh\"")])
def test_gemma4_variants_not_planned_are_refused_in_one_line(tmp_path, change, says):
    text = json.loads((FIXTURES / "gemma-4-26b-a4b.json").read_text())["text_config"] | change
    if says is None:
        assert from_hf_config(_write(tmp_path, "g", text)).dense_beside_experts
        return
    with pytest.raises(ValueError) as e:
        from_hf_config(_write(tmp_path, "g", text))
    assert says in str(e.value) and "\n" not in str(e.value)
    # a field left out reads as transformers' default: per-layer input embeddings of 256
    absent = {k: v for k, v in text.items() if k != "hidden_size_per_layer_input"} | {"enable_moe_block": True}
    with pytest.raises(ValueError, match="hidden_size_per_layer_input': expected 0 or null"):
        from_hf_config(_write(tmp_path, "absent", absent))
