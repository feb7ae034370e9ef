"""Model shapes: parameter counts by group (hand-worked), presets against published totals, HF config reading."""

from __future__ import annotations

import json

import pytest

from recipe.models import (PRESETS, active_matmul_params, active_params, from_hf_config, param_counts,
                           resolve_model, total_params)

Q35 = PRESETS["qwen35-35b"]


def _b(n: float) -> float:
    return n / 1e9


# ---- qwen35-35b, group by group ------------------------------------------------------------------------------
def test_qwen35_35b_totals():
    assert abs(_b(total_params(Q35)) - 34.66) < 0.01
    assert abs(_b(active_params(Q35)) - 3.46) < 0.01


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
    # active: everything but the 248 of 256 experts a token is not routed to
    assert active_params(Q35) == total_params(Q35) - c["routed_experts"] + c["routed_experts"] * 8 // 256


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
    ("qwen3-next-80b", 80.0, 0.01),
    ("qwen35-122b", 122.0, 0.01),
    ("qwen35-397b", 397.0, 0.01),
])
def test_presets_against_published_totals(name, published_b, rel):
    total = _b(total_params(PRESETS[name]))
    assert abs(total - published_b) <= rel * published_b, f"{name}: {total:.3f}B vs published {published_b}B"


@pytest.mark.parametrize("name, published_active_b", [
    ("qwen3-30b-a3b", 3.3), ("qwen3-235b-a22b", 22.0), ("deepseek-v3", 37.0), ("mixtral-8x7b", 12.9),
])
def test_presets_active_against_published(name, published_active_b):
    assert abs(_b(active_params(PRESETS[name])) - published_active_b) <= 0.05 * published_active_b


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


def test_hf_deepseek_v3_equals_preset(tmp_path):
    cfg = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 129280,
           "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
           "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
           "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
           "first_k_dense_replace": 3, "intermediate_size": 18432, "num_nextn_predict_layers": 1,
           "rope_theta": 10000, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "norm_topk_prob": True,
           "tie_word_embeddings": False}
    m = from_hf_config(_write(tmp_path, "DeepSeek-V3", cfg))
    assert _same_shape(m, PRESETS["deepseek-v3"])
    assert m.head_dim == 128 + 64
    assert total_params(m) == total_params(PRESETS["deepseek-v3"])


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
    with pytest.raises(ValueError, match="'llama' is not supported"):
        from_hf_config(_write(tmp_path, "llama", {"model_type": "llama", "hidden_size": 4096}))
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
