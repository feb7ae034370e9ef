"""Gemma 4's text model, MoE and dense, against transformers' Gemma4ForCausalLM, built tiny in fp32 with every parameter moved
off its init and the layer scalars away from 1: sliding layers (their own head width and KV heads, a window of 8
that the 40-token input reaches past) and full ones (wider heads over fewer KV heads whose values are their keys,
proportional RoPE on a quarter of each head), values at unit RMS, the dense GeGLU MLP beside the GeGLU experts with
their own norms, the scaled router, the scaled embedding tied to the head, logits soft-capped at 3 (small enough to
act). Checked: the final hidden states and capped logits, the loss through the fused and naive heads, every
parameter's gradient, the export read back by transformers, and the release's multimodal layout."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from launch.hf_io import export_hf_checkpoint, hf_to_ours, load_hf_checkpoint  # noqa: E402
from launch.model import Packing, build_model  # noqa: E402
from launch.rl import token_logprobs  # noqa: E402
from recipe.models import ModelShape, from_hf_config, trainable  # noqa: E402

CAP = 3.0
TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
            head_dim=8, global_head_dim=16, num_global_key_value_heads=2, attention_k_eq_v=True,
            enable_moe_block=True, num_experts=6, top_k_experts=2, moe_intermediate_size=16, intermediate_size=24,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2, final_logit_softcapping=CAP,
            hidden_size_per_layer_input=0, num_kv_shared_layers=0, tie_word_embeddings=True,
            vocab_size_per_layer_input=96,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                "rope_theta": 1e6}})


def _hf_model(variant: str):
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM

    cfg = TINY if variant == "moe" else {k: v for k, v in TINY.items() if k not in (
        "num_experts", "top_k_experts", "moe_intermediate_size")} | {"enable_moe_block": False}
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**cfg)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name or "scale" in name else 0.1))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand_like(b) + 0.5)
    return model


@pytest.fixture(scope="module", params=["moe", "dense"])
def saved(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma4")
    hf = _hf_model(request.param)
    hf.save_pretrained(path / "hf")
    return hf, path


def test_logits_loss_gradients_and_export_match_transformers(saved):
    hf, path = saved
    shape = from_hf_config(path / "hf" / "config.json")
    assert trainable(shape) is None
    assert (shape.head_dim, shape.sliding_head_dim, shape.num_kv_heads, shape.sliding_kv_heads) == (16, 8, 2, 4)
    assert shape.keys_as_values and shape.rope_proportional and shape.final_logit_softcap == CAP
    dense = not hf.config.enable_moe_block  # a dense Gemma 4: its MLP alone between the sandwich norms
    assert (shape.arch, shape.dense_beside_experts) == (("dense", False) if dense else ("moe", True))
    ours = build_model(shape, seed=1)
    load_hf_checkpoint(ours, path / "hf")
    assert ours.layers[1].self_attn.v_proj is None and ours.layers[0].self_attn.v_proj is not None
    assert torch.equal(ours.layers[2].layer_scalar, hf.model.layers[2].layer_scalar)

    T = 40
    ids = torch.randint(0, 96, (1, T), generator=torch.Generator().manual_seed(2))
    hf.zero_grad()
    out = hf(input_ids=ids, labels=ids, output_hidden_states=True)
    out.loss.backward()
    hidden = ours(ids[0], Packing.from_lengths([T]))
    assert (hidden - out.hidden_states[-1][0]).abs().max().item() < 1e-5
    with torch.no_grad():
        capped = CAP * torch.tanh(hidden @ ours.lm_head.weight.T / CAP)
        assert (capped - out.logits[0]).abs().max().item() < 1e-5
        # the cap acts: uncapped logits would be off by far more than the tolerance
        assert (hidden @ ours.lm_head.weight.T - out.logits[0]).abs().max().item() > 0.1

    targets = torch.cat([ids[0, 1:], torch.tensor([-1])])
    for mode in ("fused", "naive"):
        with torch.no_grad():
            logp = token_logprobs(hidden, ours.lm_head.weight, targets, mode=mode, softcap=CAP)
        assert abs(-logp[:-1].mean().item() - out.loss.item()) < 1e-5, mode
    (-token_logprobs(hidden, ours.lm_head.weight, targets, mode="fused", softcap=CAP)[:-1].mean()).backward()
    want = hf_to_ours({n: p.grad for n, p in hf.named_parameters() if p.grad is not None}, ours)
    got = {n: p.grad for n, p in ours.named_parameters()}
    assert got.keys() == want.keys()
    for n, g in got.items():
        scale = want[n].abs().max().item()
        assert scale > 0 and (g - want[n]).abs().max().item() <= 1e-4 * scale + 1e-7, n

    export_hf_checkpoint(ours, path / "ours")
    cfg = json.loads((path / "ours" / "config.json").read_text())
    assert (cfg["model_type"], cfg["global_head_dim"], cfg["final_logit_softcapping"]) == ("gemma4_text", 16, CAP)
    back = type(hf).from_pretrained(path / "ours", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (back(input_ids=ids).logits - out.logits).abs().max().item() < 1e-5
    assert from_hf_config(path / "ours" / "config.json").model_copy(update={"name": "x", "source": ""}) == \
        shape.model_copy(update={"name": "x", "source": ""})


def test_the_release_layout_loads_its_text_model(saved, tmp_path):
    """The release's checkpoint (Gemma4ForConditionalGeneration: the text model under `model.language_model.`, the
    vision and audio towers and their embedders beside it; its config a `gemma4` wrapper of the text config) loads
    into the same model as transformers' own text-model checkpoint."""
    from safetensors.torch import load_file, save_file

    hf, path = saved
    text = load_file(str(path / "hf" / "model.safetensors"))
    release = {k.replace("model.", "model.language_model.", 1): v for k, v in text.items()}
    release.update({"model.vision_tower.encoder.layers.0.mlp.fc1.weight": torch.zeros(4, 4),
                    "model.embed_vision.embedding_projection.weight": torch.zeros(4, 4),
                    "model.audio_tower.layers.0.weight": torch.zeros(2), "model.embed_audio.weight": torch.zeros(2)})
    (tmp_path / "release").mkdir()
    save_file(release, str(tmp_path / "release" / "model.safetensors"))
    wrapper = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
               "text_config": json.loads((path / "hf" / "config.json").read_text())}
    (tmp_path / "release" / "config.json").write_text(json.dumps(wrapper))
    shape = from_hf_config(tmp_path / "release" / "config.json")
    a, b = build_model(shape, seed=1), build_model(shape, seed=2)
    load_hf_checkpoint(a, tmp_path / "release")
    load_hf_checkpoint(b, path / "hf")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("change, says", [
    (dict(keys_as_values=True), "keys as values"),
    (dict(rope_proportional=True), "proportional RoPE"),
    (dict(sliding_head_dim=8, layer_types=("sliding_attention", "full_attention"), sliding_window=8),
     "a sliding layers' head width of its own")])
def test_gemma4_blocks_outside_gemma4_are_refused_in_one_line(change, says):
    shape = ModelShape(name="m", arch="qwen3_moe", hidden_size=32, num_layers=2, vocab_size=96, num_heads=4,
                       num_kv_heads=2, head_dim=16, num_experts=4, top_k=2, expert_ffn=16,
                       layer_types=("full_attention",) * 2).model_copy(update=change)
    why = trainable(shape)
    assert why is not None and says in why and "outside Gemma 4" in why and "\n" not in why
