"""Model pieces against references: the chunked delta rule against the token-by-token recurrence (odd lengths,
packed documents, GVA), packed equals unpacked for the whole model (outputs and gradients), recompute on and off give
equal gradients, the MoE permutation written out by hand."""

import pytest
import torch

from launch.gated_delta import chunk_gated_delta_rule_torch, recurrent_gated_delta_rule_ref
from launch.model import Packing, build_model
from launch.moe import GroupedExperts, MoE, permute, scatter_rows, unpermute
from launch.recompute import apply_recompute
from recipe.models import PRESETS



TINY = PRESETS["tiny-moe"]


def _rand_delta_inputs(T, G, H, K, V, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, G, K, generator=g), torch.randn(T, G, K, generator=g)
    v = torch.randn(T, H, V, generator=g)
    decay = -torch.rand(T, H, generator=g) * 0.7
    beta = torch.rand(T, H, generator=g)
    return q, k, v, decay, beta


@pytest.mark.parametrize("lengths,G,H,K,V,C", [
    ([37], 2, 4, 8, 6, 8),  # odd length, GVA r=2
    ([13, 5, 19, 1], 2, 2, 16, 8, 4),  # packed, a 1-token document, boundaries mid-chunk and on chunk edges
    ([16, 16, 3], 1, 3, 8, 8, 16),  # boundaries on chunk edges, r=3
    ([70], 2, 4, 16, 16, 64),
])
def test_chunked_delta_rule_matches_recurrence(lengths, G, H, K, V, C):
    T = sum(lengths)
    q, k, v, decay, beta = _rand_delta_inputs(T, G, H, K, V, seed=T)
    pos = Packing.from_lengths(lengths).positions
    ref = recurrent_gated_delta_rule_ref(q, k, v, decay, beta, pos)
    out = chunk_gated_delta_rule_torch(q, k, v, decay, beta, pos, C)
    err = (out - ref).abs().max().item()
    assert err < 1e-5, f"max err {err:.2e}, mean {(out - ref).abs().mean().item():.2e}"


def test_chunked_delta_rule_gradients_match_recurrence():
    q, k, v, decay, beta = _rand_delta_inputs(23, 1, 2, 4, 4, seed=3)
    pos = Packing.from_lengths([9, 14]).positions
    inputs = [x.double().requires_grad_() for x in (q, k, v, decay, beta)]
    grad_out = torch.randn(23, 2, 4, dtype=torch.float64)
    (chunk_gated_delta_rule_torch(*inputs, pos, 4).double() * grad_out).sum().backward()
    grads = [x.grad.clone() for x in inputs]
    for x in inputs:
        x.grad = None
    (recurrent_gated_delta_rule_ref(*inputs, pos) * grad_out).sum().backward()
    for a, x in zip(grads, inputs):
        assert torch.allclose(a, x.grad, atol=1e-5), (a - x.grad).abs().max()


def test_permutation_by_hand():
    top_e = torch.tensor([[2, 0], [1, 2], [0, 1]])  # 3 tokens, top-2
    order, token, counts = permute(top_e, num_experts=4)
    # flat slots: 0:e2 1:e0 2:e1 3:e2 4:e0 5:e1 → by expert (stable): e0: 1,4  e1: 2,5  e2: 0,3
    assert order.tolist() == [1, 4, 2, 5, 0, 3]
    assert token.tolist() == [0, 2, 1, 2, 0, 1]
    assert counts.tolist() == [2, 2, 2, 0]


def test_scatter_rows_is_index_copy_bitwise():
    """Whole rows moved as 8-byte words where the layout allows (bf16 and fp16 rows of 4k values, fp32 of 2k, a
    column slice of a wider buffer) and by index_copy_ elsewhere (odd widths, fp64, a misaligned slice): every case
    gives index_copy_'s bytes."""
    g = torch.Generator().manual_seed(0)
    index = torch.randperm(37, generator=g)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for width in (8, 12, 6, 3):
            src = torch.randn(37, width, generator=g).to(dtype)
            ref = torch.zeros_like(src).index_copy_(0, index, src)
            assert torch.equal(scatter_rows(torch.zeros_like(src), index, src), ref), (dtype, width)
        wide = torch.randn(37, 16 + 8, generator=g).to(dtype)  # the backward's rows: D columns + 8
        for cols in (slice(0, 16), slice(1, 17)):
            src = torch.randn(37, 16, generator=g).to(dtype)
            ref = wide.clone()
            ref[:, cols].index_copy_(0, index, src)
            got = wide.clone()
            scatter_rows(got[:, cols], index, src)
            assert torch.equal(got, ref), (dtype, cols)


def _experts_by_autograd(ex, x, w, e):
    """The routed experts as autograd would run them from plain ops: the reference for GroupedExperts' own
    backward."""
    T, K = e.shape
    order, token, counts = permute(e, ex.num_experts)
    rows = []
    for i, x_e in enumerate(torch.split(x[token], counts.tolist())):
        gate, up = (x_e @ ex.gate_up_proj[i].T).chunk(2, dim=-1)
        rows.append((torch.nn.functional.silu(gate) * up) @ ex.down_proj[i].T)
    y = torch.zeros(T * K, x.shape[1], dtype=x.dtype).index_copy(0, order, torch.cat(rows)).view(T, K, -1)
    return torch.bmm(w.unsqueeze(1), y).squeeze(1)


def _routed_case(seed=2, T=13, K=3, E=5, D=8, F=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    ex = GroupedExperts(E, D, F).to(dtype)
    for prm in ex.parameters():
        prm.data = torch.randn(prm.shape, generator=g, dtype=dtype) * 0.4
    x = torch.randn(T, D, generator=g, dtype=dtype, requires_grad=True)
    w = torch.rand(T, K, generator=g, dtype=dtype, requires_grad=True)
    e = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    e[0] = e[1]  # two tokens with the same experts; expert E-1 idle in most draws
    return ex, x, w, e


def test_routed_experts_backward_equals_autograds():
    """GroupedExperts' written-out backward (slot gradients and the SwiGLU's in one kernel each, the input gradient
    summed over the slots) gives autograd's gradients for x, the routing weights and both weight tensors (fp32: the
    two kernels compute in fp32 whatever their inputs)."""
    ex, x, w, e = _routed_case(dtype=torch.float32)
    r = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=x.dtype)
    out = ex(x, w, e)
    (out * r).sum().backward()
    got = [out.detach(), x.grad, w.grad, ex.gate_up_proj.grad, ex.down_proj.grad]
    x.grad = w.grad = ex.gate_up_proj.grad = ex.down_proj.grad = None
    ref = _experts_by_autograd(ex, x, w, e)
    (ref * r).sum().backward()
    for name, a, b in zip(["out", "dx", "dw", "dW1", "dW2"], got,
                          [ref.detach(), x.grad, w.grad, ex.gate_up_proj.grad, ex.down_proj.grad]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (name, (a - b).abs().max())


def test_routed_experts_under_recompute_equal_without():
    """Under a non-reentrant checkpoint the recomputed forward skips the weighted sum (nothing in the backward
    reads it): the gradients are those of the plain run, bitwise, and the layer's output is the plain output."""
    ex, x, w, e = _routed_case(seed=4)
    r = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=x.dtype)

    def layer(x, w):
        return x + ex(x, w, e)

    runs = []
    for ckpt in (False, True):
        out = torch.utils.checkpoint.checkpoint(layer, x, w, use_reentrant=False) if ckpt else layer(x, w)
        (out * r).sum().backward()
        runs.append([out.detach(), x.grad, w.grad, ex.gate_up_proj.grad, ex.down_proj.grad])
        x.grad = w.grad = ex.gate_up_proj.grad = ex.down_proj.grad = None
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_routed_experts_save_rows_once():
    """For its backward the experts keep their input rows, the gate/up projection and the output rows ([M, D],
    [M, 2F], [M, D]), the order, the offsets, the routing weights and the two weight tensors: not the activation
    silu(gate)·up, which the backward's SwiGLU kernel recomputes, nor the unpermuted outputs [T, K, D]."""
    ex, x, w, e = _routed_case(seed=6, dtype=torch.float32)
    T, K = e.shape
    M, D, F, E = T * K, ex.dim, ex.ffn_dim, ex.num_experts
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        ex(x, w, e)
    assert sorted(saved) == sorted([(M, D), (M, 2 * F), (M, D), (M,), (E,), (T, K), (E, 2 * F, D), (E, D, F)]), saved


def test_routed_experts_free_their_saved_rows_at_last_use():
    """Without recompute the autograd node holds what the forward saved until its backward returns: the experts'
    backward frees the storage of its saved rows (x, h, y) itself at their last use, unless the graph is kept for
    another backward (`retain_graph`), where a second backward gives the same gradients."""
    ex, x, w, e = _routed_case(seed=8, dtype=torch.float32)
    T, K = e.shape
    M, D, F = T * K, ex.dim, ex.ffn_dim
    r = torch.randn(x.shape, generator=torch.Generator().manual_seed(9), dtype=x.dtype)

    def run(**kw):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = ex(x, w, e)
        rows = [t for t in saved if tuple(t.shape) in ((M, D), (M, 2 * F))]
        assert len(rows) == 3
        (out * r).sum().backward(**kw)
        grads = [x.grad.clone(), w.grad.clone(), ex.gate_up_proj.grad.clone(), ex.down_proj.grad.clone()]
        x.grad = w.grad = ex.gate_up_proj.grad = ex.down_proj.grad = None
        return out, rows, grads

    _, rows, grads = run()
    assert [t.untyped_storage().nbytes() for t in rows] == [0, 0, 0]
    out, rows, kept = run(retain_graph=True)
    assert all(t.untyped_storage().nbytes() == t.numel() * 4 for t in rows)
    (out * r).sum().backward()
    again = [x.grad, w.grad, ex.gate_up_proj.grad, ex.down_proj.grad]
    for a, b, c in zip(grads, kept, again):
        assert torch.equal(a, b) and torch.equal(a, c)
    x.grad = w.grad = ex.gate_up_proj.grad = ex.down_proj.grad = None


def test_unpermute_inverts_the_permutation():
    top_e = torch.tensor([[2, 0], [1, 2], [0, 1]])
    order, token, _ = permute(top_e, num_experts=4)
    rows = torch.arange(6.0).unsqueeze(1) * 10  # row i: expert-order row i
    slots = unpermute(rows, order)
    assert slots[order].equal(rows) and slots.squeeze(1).tolist() == [40.0, 0.0, 20.0, 50.0, 10.0, 30.0]


def test_moe_matches_dense_per_token_loop():
    torch.manual_seed(0)
    moe = MoE(dim=8, num_experts=5, top_k=2, ffn=6, shared_ffn=4, shared_gate=True)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(11, 8)
    out = moe(x)
    probs = torch.softmax(x @ moe.gate.weight.T, -1)
    w, e = probs.topk(2, -1)
    w = w / w.sum(-1, keepdim=True)
    ref = torch.zeros_like(x)
    for t in range(11):
        for j in range(2):
            gate, up = (moe.experts.gate_up_proj[e[t, j]] @ x[t]).chunk(2)
            ref[t] += w[t, j] * (moe.experts.down_proj[e[t, j]] @ (torch.nn.functional.silu(gate) * up))
        ref[t] += torch.sigmoid(moe.shared_expert_gate(x[t])) * moe.shared_expert(x[t])
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()


def _loss_and_grads(model, ids, packing):
    model.zero_grad()
    h = model(ids, packing)
    loss = (h * torch.linspace(-1, 1, h.shape[-1])).pow(2).mean()
    loss.backward()
    return h.detach(), {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
                        for n, p in model.named_parameters() if p.grad is not None}


def test_packed_equals_unpacked():
    """Three documents packed into one sequence give the same outputs as each run alone; the boundaries sit
    mid-chunk (chunk 16) so a leaking conv tap, state or attention score would show."""
    model = build_model(TINY, seed=0)
    lengths = [21, 7, 30]
    ids = torch.randint(0, TINY.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        packed = model(ids, Packing.from_lengths(lengths))
        alone = torch.cat([model(doc, Packing.from_lengths([len(doc)])) for doc in ids.split(lengths)])
    err = (packed - alone).abs().max().item()
    assert err < 1e-5, f"packed vs one at a time: max err {err:.2e}"


def test_llama4_packed_equals_unpacked_and_chunks_restart_per_document():
    """Llama 4's chunked layers cut each document into runs of `attention_chunk` positions from its own start: three
    documents packed give each one's outputs alone (boundaries mid-run), and the packing the chunked layers see is
    the runs, documents of their own."""
    from dist_cases import tiny_llama4

    shape = tiny_llama4()
    model = build_model(shape, seed=0)
    lengths = [21, 7, 30]
    packing = Packing.from_lengths(lengths)
    assert packing.chunked(8).doc_lengths == (8, 8, 5, 7, 8, 8, 8, 6) and packing.chunked(8) is packing.chunked(8)
    ids = torch.randint(0, shape.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        packed = model(ids, packing)
        alone = torch.cat([model(doc, Packing.from_lengths([len(doc)])) for doc in ids.split(lengths)])
    err = (packed - alone).abs().max().item()
    assert err < 1e-5, f"packed vs one at a time: max err {err:.2e}"


def test_packed_gradients_equal_sum_of_unpacked():
    model = build_model(TINY, seed=1)
    lengths = [19, 26]
    ids = torch.randint(0, TINY.vocab_size, (45,), generator=torch.Generator().manual_seed(1))
    model.zero_grad()
    model(ids, Packing.from_lengths(lengths)).pow(2).sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for doc in ids.split(lengths):
        model(doc, Packing.from_lengths([len(doc)])).pow(2).sum().backward()
    assert len(packed) == len(list(model.parameters())) - 1  # all but the LM head (applied by the loss)
    for n, p in model.named_parameters():
        if n in packed:
            scale = p.grad.abs().max().item()
            assert (packed[n] - p.grad).abs().max().item() <= 3e-4 * scale + 1e-7, n  # fp32 sums in another order


def test_recompute_on_and_off_give_equal_gradients():
    ids = torch.randint(0, TINY.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    packing = Packing.from_lengths([25, 15])
    h0, g0 = _loss_and_grads(build_model(TINY, seed=3), ids, packing)
    ckpt = apply_recompute(build_model(TINY, seed=3), "full")
    assert all(hasattr(layer, "_checkpoint_wrapped_module") for layer in ckpt.layers)
    h1, g1 = _loss_and_grads(ckpt, ids, packing)
    assert torch.equal(h0, h1)
    assert g0.keys() == g1.keys()
    for n in g0:
        assert torch.allclose(g0[n], g1[n], rtol=0, atol=1e-7), n
    with pytest.raises(ValueError, match="recompute must be one of"):
        apply_recompute(ckpt, "selective")
    # partial recompute: the last layers keep their activations; the gradients are the same again
    n = len(TINY.layer_types)
    part = apply_recompute(build_model(TINY, seed=3), "full", keep_layers=1)
    assert [hasattr(layer, "_checkpoint_wrapped_module") for layer in part.layers] == [True] * (n - 1) + [False]
    h2, g2 = _loss_and_grads(part, ids, packing)
    assert torch.equal(h0, h2)
    for k in g0:
        assert torch.allclose(g0[k], g2[k], rtol=0, atol=1e-7), k
    # idempotent with the same count (the trainer applies it again to a parallelized model); more kept than layers:
    # none wrapped
    assert apply_recompute(part, "full", keep_layers=1) is part and not hasattr(part.layers[-1],
                                                                                "_checkpoint_wrapped_module")
    assert not any(hasattr(x, "_checkpoint_wrapped_module")
                   for x in apply_recompute(build_model(TINY, seed=3), "full", keep_layers=n + 3).layers)
    for bad, why in (((ckpt, "none", 1), "needs recompute 'full'"), ((ckpt, "full", -1), "non-negative integer")):
        with pytest.raises(ValueError, match=why):
            apply_recompute(*bad)


@pytest.mark.parametrize("placement", ["sandwich", "post"])
def test_recompute_equals_no_recompute_with_norms_after_the_moe(placement):
    """Norms after the sublayers (AFMoE's sandwich, FlexOlmo's post) keep the MoE block's output for their backward,
    so a recomputed forward must combine the experts' rows where under "pre" it skips that (nothing reads it): the
    gradients with recompute equal those without, bit for bit (the combine skipped, they were off everywhere)."""
    shape = TINY.model_copy(update={"norm_placement": placement, "hf_model_type": "afmoe"})
    ids = torch.randint(0, shape.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    packing = Packing.from_lengths([25, 15])
    model = build_model(shape, seed=3)
    assert all(layer.mlp.experts.output_read for layer in model.layers if isinstance(layer.mlp, MoE))
    h0, g0 = _loss_and_grads(model, ids, packing)
    h1, g1 = _loss_and_grads(apply_recompute(build_model(shape, seed=3), "full"), ids, packing)
    assert torch.equal(h0, h1) and g0.keys() == g1.keys()
    for n in g0:
        assert torch.allclose(g0[n], g1[n], rtol=0, atol=1e-7), n


def test_unsupported_shapes_fail_loudly():
    from recipe.models import trainable

    assert trainable(PRESETS["mixtral-8x7b"]) is None  # trained (tests/test_hf_parity.py holds it to transformers)
    meta = build_model(PRESETS["mixtral-8x7b"].with_layers(1), device="meta")
    assert meta.layers[0].self_attn.q_norm is None and meta.layers[0].mlp.experts.gate_up_proj.shape == (8, 28672, 4096)
    # DeepSeek-V3 is trained: MLA's projections at the preset's widths, the router's correction bias fp32 in bf16
    ds = build_model(PRESETS["deepseek-v3"].with_layers(4), device="meta", dtype=torch.bfloat16)
    attn, moe = ds.layers[3].self_attn, ds.layers[3].mlp
    assert attn.q_b_proj.weight.shape == (128 * 192, 1536) and attn.kv_b_proj.weight.shape == (128 * 256, 512)
    assert attn.kv_a_proj_with_mqa.weight.shape == (512 + 64, 7168) and attn.o_proj.weight.shape == (7168, 128 * 128)
    assert moe.gate.e_score_correction_bias.dtype == torch.float32 and moe.gate.weight.dtype == torch.bfloat16
    assert moe.shared_expert.gate_proj.weight.shape == (2048, 7168) and ds.layers[2].mlp.gate_proj.out_features == 18432
    from pathlib import Path

    from recipe.models import from_hf_config

    # Qwen2-MoE with mlp_only_layers: planned only
    planned = from_hf_config(Path(__file__).parent / "fixtures" / "configs" / "qwen1.5-moe-a2.7b.json").model_copy(
        update={"arch": "moe"})
    with pytest.raises(ValueError, match="arch 'moe' is planned"):
        build_model(planned.with_layers(1), device="meta")
    with pytest.raises(ValueError, match="document lengths must be positive"):
        Packing.from_lengths([3, 0])


def test_a_model_built_on_meta_and_materialized_equals_one_built_whole():
    """What a distributed run does (launch/job.py): the model built on the meta device, wrapped (here: recompute,
    which adds a module level to parameter names), then given storage and initialized — the same weights as a
    model built whole for the seed, since each parameter's values depend only on the seed and its whole-model
    name; another seed gives other weights. The embedding's pad row starts at zero either way, as transformers
    initializes it."""
    from launch.model import materialize

    shape = PRESETS["tiny-moe"].model_copy(update={"pad_token_id": 5})
    whole = build_model(shape, seed=3).state_dict()
    meta = apply_recompute(build_model(shape, device="meta"), "full")
    assert all(p.is_meta for p in meta.parameters())
    got = materialize(meta, "cpu", seed=3).state_dict()
    assert sorted(got) == sorted(whole) and all(torch.equal(got[k], whole[k]) for k in whole)
    emb = whole["embed_tokens.weight"]
    assert not emb[5].any() and emb[4].any() and emb[6].any()
    other = build_model(shape, seed=4).state_dict()
    assert not torch.equal(other["embed_tokens.weight"], whole["embed_tokens.weight"])


def _rms_norm_autograd(x, w, eps, offset):
    """RMSNorm written as autograd records it: the reference for the one-Function norm."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (x32 * (offset + w.float())).type_as(x)
    return w * x32.type_as(x)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm_function_equals_autograds(offset, dtype, tol):
    """The norm's one autograd Function against autograd's graph of the same forward: outputs and both gradients,
    over 3-D input (a per-head norm's [T, H, Dh]), both weightings, fp32 and bf16."""
    from launch.model import RMSNorm

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 3, 16, generator=g) * 3).to(dtype).requires_grad_()
    norm = RMSNorm(16, 1e-6, offset).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=g) * 0.5 + (0 if offset else 1))
    dy = torch.randn(5, 3, 16, generator=g).to(dtype)
    y = norm(x)
    dx, dw = torch.autograd.grad(y, (x, norm.weight), dy)
    ry = _rms_norm_autograd(x, norm.weight, 1e-6, offset)
    rdx, rdw = torch.autograd.grad(ry, (x, norm.weight), dy)
    for a, b in ((y, ry), (dx, rdx), (dw, rdw)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert (a.float() - b.float()).norm() <= tol * b.float().norm(), (a, b)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_saves_its_input_and_the_row_scale_only(offset):
    """For its backward the norm keeps x (shared with its caller's tensor, no copy), the weight and the per-row
    reciprocal RMS [.., 1] in fp32: not the fp32 copy of x nor the fp32 normalized x that autograd's graph keeps
    (8 to 10 bytes an element more)."""
    from launch.model import RMSNorm

    x = torch.randn(6, 32, dtype=torch.bfloat16, requires_grad=True)
    norm = RMSNorm(32, 1e-6, offset).to(torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        norm(x)
    assert sorted((tuple(t.shape), t.dtype) for t in saved) == sorted(
        [((6, 32), torch.bfloat16), ((32,), torch.bfloat16), ((6, 1), torch.float32)])
    assert any(t.data_ptr() == x.data_ptr() for t in saved)


def test_attention_gqa_inside_sdpa_equals_repeated_heads():
    """GQA by SDPA's own grouping equals the K/V heads repeated to the query heads' count (head i reads K/V head
    i // (Hq / Hkv)), outputs and gradients, for one document (causal flag) and packed ones (the mask)."""
    from launch.model import causal_attention

    g = torch.Generator().manual_seed(4)
    T, Hq, Hkv, Dh = 12, 6, 2, 8
    q, k, v = (torch.randn(T, h, Dh, generator=g, requires_grad=True) for h in (Hq, Hkv, Hkv))
    dy = torch.randn(T, Hq, Dh, generator=g)
    for lengths in ([T], [5, 7]):
        pack = Packing.from_lengths(lengths, "cpu")
        out = causal_attention(q, k, v, pack, Dh ** -0.5)
        grads = torch.autograd.grad(out, (q, k, v), dy)
        kr, vr = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
        ref = causal_attention(q, kr, vr, pack, Dh ** -0.5)
        rgrads = torch.autograd.grad(ref, (q, k, v), dy)
        torch.testing.assert_close(out, ref)
        for a, b in zip(grads, rgrads):
            torch.testing.assert_close(a, b)


def test_values_at_their_own_width_equal_the_padded_path(monkeypatch):
    """MiMo-V2-Flash's values are narrower than its q·k heads: where cuDNN takes a full-attention layer they go to
    the kernel at their own width, elsewhere zero-padded and cut after. Both give the same outputs and gradients
    (whole model, packed documents; here `cudnn_takes` is made to say yes so the CPU runs the unpadded path); the
    sliding layers with sinks keep their padded path either way."""
    import launch.model as lm
    from dist_cases import tiny_mimo

    shape = tiny_mimo()
    pack = Packing.from_lengths([20, 12], "cpu")
    ids = torch.randint(0, shape.vocab_size, (32,), generator=torch.Generator().manual_seed(3))
    widths = []
    real = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q, k, v, *a, **kw):
        widths.append((q.shape[-1], v.shape[-1]))
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    runs = []
    for own in (False, True):
        monkeypatch.setattr(lm, "cudnn_takes", lambda q, k, v, own=own: own)
        widths.clear()
        model = build_model(shape, device="cpu", dtype=torch.float32, seed=0)
        model(ids, pack).float().pow(2).mean().backward()
        runs.append(({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                     sorted(set(widths))))
    (g_pad, w_pad), (g_own, w_own) = runs
    # full layers: q·k 12 wide, v 8 or padded to 12; the sliding layers' sink channels (16) either way
    assert w_pad == [(12, 12), (16, 16)] and w_own == [(12, 8), (16, 16)], (w_pad, w_own)
    assert g_pad.keys() == g_own.keys()
    for n in g_pad:
        torch.testing.assert_close(g_own[n], g_pad[n], rtol=1e-5, atol=1e-6, msg=n)


def test_sdpa_without_flash_leaves_the_priority_order_alone():
    """MLA's attention runs SDPA without the flash kernel; the context restores the enabled backends exactly (also
    where one was disabled before it) and never sets the priority order (torch's GPU-dependent default, filled in at
    the process's first SDPA call, must not be overwritten by the order saved before it)."""
    from launch.model import sdpa_without_flash

    flash, cudnn = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()
    before = torch._C._get_sdp_priority_order()
    try:
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
        with sdpa_without_flash():
            assert torch._C._get_sdp_priority_order() == before
            assert not torch.backends.cuda.flash_sdp_enabled()
            assert torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch._C._get_sdp_priority_order() == before
        assert not torch.backends.cuda.flash_sdp_enabled() and not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_flash_sdp(flash)
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
