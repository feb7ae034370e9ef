"""gpt-oss: the training core against transformers' GptOssForCausalLM and against the definitions.

- attention sinks and sliding windows (launch/sink_attention.py): every path (dense mask; the sink merged by
  log-sum-exp, per document and in the window's two causal squares a block; the sink as a key, per document and in
  masked blocks) equals the explicit softmax with the sink logit in fp64, outputs and the gradients of q, k, v and
  the sinks to 1e-12, on packed documents shorter and longer than the window, with GQA and without;
- a tiny random GptOss (4 layers alternating sliding/full, window 8, 4 query / 2 KV heads of 16, 8 experts top-2,
  YaRN with truncate false; expert gate_up weights large enough that the clamp at 7 cuts over 15% of the gate
  values) on packed documents of 21, 5, 30 and 19 tokens: logits within 1e-4 of transformers run on each
  document alone (fp32), the mean next-token loss within 1e-5, every parameter's gradient within 1e-4 of its largest
  entry (+1e-7), on the dense path and on the per-document / sliding-block paths; our export read back by
  `from_pretrained` gives transformers' own logits within 1e-5. Zeroing the sinks, dropping the clamp, or widening
  the window each moves the logits by more than 1e-2 (so the comparisons can fail);
- YaRN at gpt-oss-120b's dims with truncate false (and true) equals transformers' `_compute_yarn_parameters`;
- MXFP4: dequantization bitwise equal to transformers' `convert_moe_packed_tensors` on random blocks over every
  scale; a tiny MXFP4 checkpoint loads into ours with expert weights bitwise equal to transformers' dequantized ones
  and logits within 1e-4;
- the experts' bias gradients and bias adds, grouped-GEMM form against the per-expert loop; what stays refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import launch.sink_attention as sa
from launch.model import Packing, build_model
from recipe.models import PRESETS, from_hf_config, trainable

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
DOCS = [21, 5, 30, 19]  # packed documents: one shorter than the window, the others several windows long
CONFIG = dict(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=8,
              layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=512,
              rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                   truncate=False, original_max_position_embeddings=16))


# ---- attention sinks and sliding windows against the definition -------------------------------------------------
def _reference_attention(q, k, v, sinks, lengths, scale, window):
    """Each query's softmax over its document's keys j ≤ i (and i − j < window) plus the sink logit, one query at a
    time."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    out, start = [], 0
    for n in lengths:
        for i in range(n):
            lo = 0 if window is None else max(0, i - window + 1)
            s = torch.einsum("hd,jhd->hj", q[start + i], k[start + lo:start + i + 1]) * scale
            if sinks is not None:
                s = torch.cat([s, sinks[:, None]], dim=1)
            p = torch.softmax(s, dim=-1)[:, :i + 1 - lo]
            out.append(torch.einsum("hj,jhd->hd", p, v[start + lo:start + i + 1]))
        start += n
    return torch.stack(out)


@pytest.mark.parametrize("lengths, window, heads", [(DOCS, 8, (4, 2)), ([3, 17, 8, 9], 4, (6, 6)),
                                                    ([40], 1, (2, 1)), ([9, 16], 16, (4, 2))])
@pytest.mark.parametrize("path", ["dense", "merged", "sink_key"])
def test_sink_attention_equals_the_definition(lengths, window, heads, path, monkeypatch):
    """Every path: the dense mask; the sink merged by log-sum-exp (SDPA's CPU flash kernel), per document and the
    window as two causal squares a query block; the sink as a key, per document and in the masked blocks."""
    if path != "dense":
        monkeypatch.setattr(sa, "DENSE_MASK_MAX_TOKENS", 0)
    monkeypatch.setattr(sa, "MERGED_SINK", path != "sink_key")
    g = torch.Generator().manual_seed(len(lengths) * 7 + window)
    T, (Hq, Hkv) = sum(lengths), heads
    f64 = dict(dtype=torch.float64, generator=g)
    q, k, v = torch.randn(T, Hq, 16, **f64), torch.randn(T, Hkv, 16, **f64), torch.randn(T, Hkv, 16, **f64)
    sinks = torch.randn(Hq, **f64)
    packing = Packing.from_lengths(lengths)
    for w in (None, window):
        for sink in (sinks, None):
            leaves = [x.clone().requires_grad_() for x in (q, k, v) + ((sink,) if sink is not None else ())]
            ref_leaves = [x.detach().clone().requires_grad_() for x in leaves]
            s_ours = leaves[3] if sink is not None else None
            s_ref = ref_leaves[3] if sink is not None else None
            o = sa.sink_attention(*leaves[:3], s_ours, packing, 0.25, w)
            r = _reference_attention(*ref_leaves[:3], s_ref, lengths, 0.25, w)
            cot = torch.randn(r.shape, **f64)
            (o * cot).sum().backward()
            (r * cot).sum().backward()
            assert (o - r).abs().max() < 1e-12, (w, sink is not None)
            for a, b in zip(leaves, ref_leaves):
                assert (a.grad - b.grad).abs().max() < 1e-12, (w, sink is not None, a.shape)


def test_band_mask_by_hand():
    """Window 2: row r of a block sees the sink and the keys at c ∈ (r + 1, r + 3] of [sink, previous block, own]."""
    assert sa.band_mask(2).int().tolist() == [[1, 0, 1, 1, 0], [1, 0, 0, 1, 1]]


# ---- the whole model against transformers --------------------------------------------------------------------------
def _hf_gpt_oss(**overrides):
    cfg = transformers.GptOssConfig(**{**CONFIG, **overrides})
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).float().eval()
    with torch.no_grad():  # every parameter off its init; gate_up large enough that the clamp at ±7 acts
        for name, p in model.named_parameters():
            if name.endswith("experts.gate_up_proj"):
                p.copy_(torch.randn_like(p))
            else:
                p.add_(torch.randn_like(p) * (0.3 if "norm" in name or "sinks" in name else 0.1))
    return model


def _hf_per_document(hf, ids):
    out, start = [], 0
    for n in DOCS:
        out.append(hf(input_ids=ids[None, start:start + n]).logits[0])
        start += n
    return torch.cat(out)


def _targets(ids):
    targets = torch.cat([ids[1:], ids.new_tensor([-1])])
    targets[torch.tensor(DOCS).cumsum(0) - 1] = -1  # a document's last token predicts nothing
    return targets


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    from launch.hf_io import load_hf_checkpoint

    folder = tmp_path_factory.mktemp("gpt_oss")
    hf = _hf_gpt_oss()
    hf.save_pretrained(folder / "hf")
    shape = from_hf_config(folder / "hf" / "config.json")
    ours = build_model(shape, seed=1)
    load_hf_checkpoint(ours, folder / "hf")
    ids = torch.randint(0, shape.vocab_size, (sum(DOCS),), generator=torch.Generator().manual_seed(2))
    return hf, ours, ids, folder


def _our_logits(ours, ids):
    return ours(ids, Packing.from_lengths(DOCS)) @ ours.lm_head.weight.T


@pytest.mark.parametrize("path", ["dense", "per_document_and_blocks"])
def test_logits_loss_and_gradients_match_transformers(hf_pair, path, monkeypatch):
    from launch.hf_io import hf_to_ours
    from launch.rl import token_logprobs

    if path != "dense":
        monkeypatch.setattr(sa, "DENSE_MASK_MAX_TOKENS", 0)
    hf, ours, ids, _ = hf_pair
    shape = ours.shape
    assert shape.arch == "gpt_oss" and shape.num_sliding_layers == 2 and shape.sliding_window == 8
    assert shape.rope_scaling.kind == "yarn" and shape.rope_scaling.truncate is False
    hf.zero_grad()
    hf_logits = _hf_per_document(hf, ids)
    targets = _targets(ids)
    keep = targets >= 0
    hf_loss = F.cross_entropy(hf_logits[keep], targets[keep])
    hf_loss.backward()
    want = hf_to_ours({n: p.grad for n, p in hf.named_parameters()}, ours)

    ours.zero_grad()
    hidden = ours(ids, Packing.from_lengths(DOCS))
    err = (hidden.detach() @ ours.lm_head.weight.detach().T - hf_logits.detach()).abs().max().item()
    assert err < 1e-4, f"max |logits − transformers| = {err:.3e}"
    loss = -token_logprobs(hidden, ours.lm_head.weight, targets, mode="fused")[keep].mean()
    assert abs(loss.item() - hf_loss.item()) < 1e-5
    loss.backward()
    got = {n: p.grad for n, p in ours.named_parameters()}
    assert got.keys() == want.keys() and any(n.endswith("sinks") for n in got)
    for n, g in got.items():
        scale = want[n].abs().max().item()
        assert scale > 0 and (g - want[n]).abs().max().item() <= 1e-4 * scale + 1e-7, n


def test_export_reads_back_in_transformers(hf_pair):
    from launch.hf_io import export_hf_checkpoint

    hf, ours, ids, folder = hf_pair
    export_hf_checkpoint(ours, folder / "ours")
    cfg = json.loads((folder / "ours" / "config.json").read_text())
    assert cfg["model_type"] == "gpt_oss" and "quantization_config" not in cfg
    back = transformers.GptOssForCausalLM.from_pretrained(folder / "ours", dtype=torch.float32).eval()
    with torch.no_grad():
        err = (_hf_per_document(back, ids) - _hf_per_document(hf, ids)).abs().max().item()
    assert err < 1e-5, f"re-imported transformers model differs by {err:.3e}"


def test_sinks_clamp_and_window_each_change_the_logits(hf_pair):
    """The comparisons above can fail: without the sinks, the clamp or the window our logits leave transformers'
    by more than 1e-2 (the clamp cuts over 15% of the gate values layer 0's experts compute)."""
    from kernels.expert_grads import GLU

    hf, ours, ids, _ = hf_pair
    attn, experts = ours.layers[0].self_attn, ours.layers[0].mlp.experts
    seen = []
    hook = experts.register_forward_pre_hook(lambda m, args: seen.append(args))
    with torch.no_grad():
        want = _hf_per_document(hf, ids)
        base = (_our_logits(ours, ids) - want).abs().max().item()
        hook.remove()
        x, _, top_e = seen[0]
        I = experts.ffn_dim
        gate = torch.einsum("td,tkid->tki", x, experts.gate_up_proj[top_e, :I]) + experts.gate_up_proj_bias[top_e, :I]
        assert (gate > 7).float().mean() > 0.15
        changes = {}
        sinks = [layer.self_attn.sinks.clone() for layer in ours.layers]
        for layer in ours.layers:
            layer.self_attn.sinks.zero_()
        changes["sinks"] = (_our_logits(ours, ids) - want).abs().max().item()
        for layer, s in zip(ours.layers, sinks):
            layer.self_attn.sinks.copy_(s)
        glu = [layer.mlp.experts.activation for layer in ours.layers]
        for layer in ours.layers:
            layer.mlp.experts.activation = GLU(alpha=1.702, up_offset=1.0)
        changes["clamp"] = (_our_logits(ours, ids) - want).abs().max().item()
        for layer, a in zip(ours.layers, glu):
            layer.mlp.experts.activation = a
        attn.window = None
        changes["window"] = (_our_logits(ours, ids) - want).abs().max().item()
        attn.window = 8
        assert (_our_logits(ours, ids) - want).abs().max().item() == base < 1e-4
    assert min(changes.values()) > 1e-2, changes


def test_yarn_with_and_without_truncate_matches_transformers():
    """gpt-oss-120b's RoPE (YaRN ×32 from 4,096, β 32/1, truncate false: the ramp's ends are not rounded to whole
    channels) and the same with truncate true: inverse frequencies and attention factor as transformers'."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from launch.model import rope_frequencies

    shape = PRESETS["gpt-oss-120b"]
    assert shape.rope_scaling.truncate is False and shape.rope_scaling.factor == 32.0
    results = []
    for truncate in (False, True):
        s = shape.model_copy(update={"rope_scaling": shape.rope_scaling.model_copy(update={"truncate": truncate})})
        cfg = transformers.GptOssConfig(rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0,
                                                             beta_fast=32.0, beta_slow=1.0, truncate=truncate,
                                                             original_max_position_embeddings=4096))
        want, want_attn = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
        got, attn = rope_frequencies(s)
        assert torch.allclose(got, want, rtol=1e-6, atol=0) and abs(attn - want_attn) < 1e-12, truncate
        results.append(got)
    assert not torch.allclose(results[0], results[1], rtol=1e-3)  # truncate matters at these dims


# ---- MXFP4 ---------------------------------------------------------------------------------------------------------
def _quantize_mxfp4(w: torch.Tensor):
    """A tensor in transformers' layout [E, C, R] as MXFP4: per run of 32 values along C, the power of two that
    brings the largest to at most 6, each value rounded to the nearest e2m1 code."""
    from launch.hf_io import FP4_E2M1

    rows = w.transpose(1, 2).float()
    E, R, C = rows.shape
    runs = rows.reshape(E, R, C // 32, 32)
    exp = torch.ceil(torch.log2(runs.abs().amax(-1).clamp_min(1e-30) / 6.0))
    code = (runs / torch.exp2(exp)[..., None])[..., None].sub(torch.tensor(FP4_E2M1)).abs().argmin(-1)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8), (exp + 127).to(torch.uint8)


def test_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from launch.hf_io import dequantize_mxfp4

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 256, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.arange(3 * 256 * 2).remainder(256).to(torch.uint8).view(3, 256, 2)  # every scale, 0 to 255
    ours, theirs = dequantize_mxfp4(blocks, scales), convert_moe_packed_tensors(blocks, scales)
    assert ours.shape == theirs.shape == (3, 64, 256) and ours.dtype == theirs.dtype == torch.bfloat16
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)  # bitwise, 2^128's inf and NaN too
    one = dequantize_mxfp4(torch.tensor([[[[0x21] + [0] * 15]]], dtype=torch.uint8),
                           torch.tensor([[[128]]], dtype=torch.uint8))
    assert one[0, :2, 0].tolist() == [1.0, 2.0]  # codes 1 (0.5, low nibble first) and 2 (1.0), times 2^(128−127)


def test_a_tiny_mxfp4_checkpoint_loads_dequantized(tmp_path):
    """gpt-oss's release layout: each expert matrix as `_blocks` and `_scales`, quantization_config mxfp4. Ours
    reads it to the expert weights transformers dequantizes (bitwise) and the same logits; a `_blocks` tensor
    without its scales is refused in one line."""
    from safetensors.torch import load_file, save_file

    from launch.hf_io import load_hf_checkpoint

    hf = _hf_gpt_oss(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    hf.save_pretrained(tmp_path / "hf")
    packed = {}
    for key, t in load_file(str(tmp_path / "hf" / "model.safetensors")).items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[key + "_blocks"], packed[key + "_scales"] = _quantize_mxfp4(t)
        else:
            packed[key] = t
    (tmp_path / "mx").mkdir()
    save_file(packed, str(tmp_path / "mx" / "model.safetensors"))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "mx" / "config.json").write_text(json.dumps(cfg))
    theirs = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path / "mx", quantization_config=transformers.Mxfp4Config(dequantize=True)).float().eval()
    ours = build_model(from_hf_config(tmp_path / "mx" / "config.json"), seed=1)
    load_hf_checkpoint(ours, tmp_path / "mx")
    for i in range(2):
        w = theirs.model.layers[i].mlp.experts.gate_up_proj.detach()
        assert torch.equal(ours.layers[i].mlp.experts.gate_up_proj, torch.cat([w[..., 0::2], w[..., 1::2]], -1)
                           .transpose(1, 2))
        assert torch.equal(ours.layers[i].mlp.experts.down_proj,
                           theirs.model.layers[i].mlp.experts.down_proj.detach().transpose(1, 2))
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        err = (ours(ids, Packing.from_lengths([40])) @ ours.lm_head.weight.T - theirs(input_ids=ids[None]).logits[0])
    assert err.abs().max().item() < 1e-4
    del packed["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(packed, str(tmp_path / "mx" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj_blocks: MXFP4 blocks without their down_proj_scales$"):
        load_hf_checkpoint(ours, tmp_path / "mx")


# ---- the pieces ---------------------------------------------------------------------------------------------------
def test_expert_bias_gradients_and_adds_two_ways():
    """A per-expert bias's gradient (each expert's sum of its rows) and its add: the grouped-GEMM form (no host
    counts) equals the per-expert loop, an idle expert's gradient zero."""
    from launch.moe import add_expert_bias_, grouped_bias_grad

    counts = [3, 0, 5, 1]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    dy, b = torch.randn(9, 8), torch.randn(4, 8)
    loop, grouped = grouped_bias_grad(dy, counts, offs), grouped_bias_grad(dy, None, offs)
    rows = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    want = torch.zeros(4, 8).index_add_(0, rows, dy)
    torch.testing.assert_close(loop, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(grouped, want, rtol=0, atol=1e-6)
    assert loop[1].abs().max() == 0
    assert torch.equal(add_expert_bias_(dy.clone(), b, counts, offs), dy + b[rows])
    assert torch.equal(add_expert_bias_(dy.clone(), b, None, offs), dy + b[rows])


def test_the_router_takes_the_top_logits_and_softmaxes_them():
    from launch.moe import TopKRouter

    router = TopKRouter(6, 4, 2, True, bias=True)
    with torch.no_grad():
        router.weight.copy_(torch.randn(6, 4))
        router.bias.copy_(torch.randn(6))
    x = torch.randn(5, 4)
    logits, w, e = router(x)
    torch.testing.assert_close(logits, x @ router.weight.T + router.bias)
    probs = torch.softmax(logits, -1)
    top, idx = probs.topk(2, -1)
    assert torch.equal(e, idx)
    torch.testing.assert_close(w, top / top.sum(-1, keepdim=True))  # softmax, top-k, renormalize: the same weights


def test_what_trains_and_what_is_refused():
    """gpt-oss trains (sliding windows included, at any cp: launch/context_parallel.py runs its attention), as do
    other families' sliding layers (tests/test_hf_parity.py: Mistral, Mixtral, Qwen2); a window that no layer
    applies is refused rather than trained as full attention."""
    oss = PRESETS["gpt-oss-120b"]
    assert trainable(oss) is None
    mixtral = PRESETS["mixtral-8x7b"]
    assert "a sliding_window on no sliding_attention layer" in trainable(mixtral.model_copy(update={"sliding_window": 4096}))
    sliding = mixtral.model_copy(update={"sliding_window": 4096, "layer_types": ("sliding_attention",) * 32})
    assert trainable(sliding) is None
    assert "without a sliding_window" in trainable(oss.model_copy(update={"sliding_window": None}))
    meta = build_model(oss.with_layers(2), device="meta")
    a0, a1 = meta.layers[0].self_attn, meta.layers[1].self_attn
    assert (a0.window, a1.window) == (128, None) and a0.sinks.shape == (64,) and a0.o_proj.bias is not None
    experts = meta.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (128, 2 * 2880, 2880) and experts.gate_up_proj_bias.shape == (128, 5760)
    assert experts.down_proj_bias.shape == (128, 2880) and meta.layers[0].mlp.gate.bias.shape == (128,)


def test_a_config_without_rope_or_layer_types_reads_as_transformers_defaults(tmp_path):
    """transformers fills a gpt_oss config's missing rope_parameters (YaRN, truncate false), layer_types (sliding
    first, alternating) and rope base; so does the reader."""
    fixture = json.loads((FIXTURES / "gpt-oss-120b.json").read_text())
    for k in ("layer_types", "rope_theta", "sliding_window"):
        fixture.pop(k)
    (tmp_path / "config.json").write_text(json.dumps(fixture))
    m = from_hf_config(tmp_path / "config.json")
    ref = transformers.GptOssConfig(**{k: v for k, v in fixture.items() if k != "model_type"})
    assert list(m.layer_types) == ref.layer_types and m.sliding_window == ref.sliding_window
    assert m.rope_theta == ref.rope_parameters["rope_theta"] and m.rope_scaling == PRESETS["gpt-oss-120b"].rope_scaling
    assert m.rms_norm_eps == ref.rms_norm_eps

