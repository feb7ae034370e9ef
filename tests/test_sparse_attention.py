"""DeepSeek sparse attention (launch/sparse_attention.py) against references written out in full: the absorbed
sparse attention against expanded multi-head attention under the selection's mask (outputs and gradients, in one
block and in many), the indexer's selection against every score computed and sorted, and the whole model with a
top-k past every document's length against DeepSeek-V3's dense MLA with the same weights. Parity with
transformers' DeepSeek-V3.2 and GLM-5 is in tests/test_hf_parity.py; the layouts in tests/test_parallel.py. The
index-score kernel runs under TRITON_INTERPRET=1 in a subprocess (tests/interpreter.py) against the torch path."""

import sys

import pytest
import torch

import interpreter
import launch.sparse_attention as sa
from kernels.dsa_index import index_scores, index_scores_torch
from launch.model import Packing, build_model
from launch.sparse_attention import index_topk, sparse_latent_attention
from recipe.models import MLAShape, ModelShape, SigmoidRouter, SparseAttentionShape


def _expanded_reference(q_nope, q_rope, latent, w_k, w_v, idx, scale):
    """Multi-head attention over expanded keys [c W_k[h]ᵀ | r] and values c W_v[h]ᵀ, every key outside a query's
    selection masked: the form transformers runs DSA in."""
    C = w_k.shape[-1]
    c, r = latent[:, :C], latent[:, C:]
    k = torch.cat([torch.einsum("sc,hnc->hsn", c, w_k), r[None].expand(w_k.shape[0], -1, -1)], -1)  # [H, S, n + R]
    v = torch.einsum("sc,hvc->hsv", c, w_v)
    q = torch.cat([q_nope, q_rope], -1).transpose(0, 1)  # [H, T, n + R]
    allowed = torch.zeros(idx.shape[0], latent.shape[0], dtype=torch.bool)
    for t in range(idx.shape[0]):
        allowed[t, idx[t][idx[t] >= 0]] = True
    s = (q @ k.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1)  # [T, H, Dv]


@pytest.mark.parametrize("block_bytes", [1 << 28, 1 << 12])
def test_absorbed_sparse_attention_equals_expanded_attention_under_the_mask(block_bytes, monkeypatch):
    """ô W_v over the selected latents equals the expanded form's output, and so do the gradients of q, the latent
    and both weight slices (fp64): in one block of queries and in blocks of a few (the flash-style backward
    recomputes each block from its log-sum-exp). Queries select from 1 to 5 keys, some slots −1."""
    monkeypatch.setattr(sa, "BLOCK_BYTES", block_bytes)
    g = torch.Generator().manual_seed(0)
    T, H, n, R, C, Dv, K = 12, 3, 5, 2, 6, 4, 5
    f64 = dict(dtype=torch.float64)
    q_nope = torch.randn(T, H, n, generator=g, **f64).requires_grad_()
    q_rope = torch.randn(T, H, R, generator=g, **f64).requires_grad_()
    latent = torch.randn(T, C + R, generator=g, **f64).requires_grad_()
    w_k = torch.randn(H, n, C, generator=g, **f64).requires_grad_()
    w_v = torch.randn(H, Dv, C, generator=g, **f64).requires_grad_()
    idx = torch.full((T, K), -1)
    for t in range(T):
        keys = torch.randperm(t + 1, generator=g)[: min(K, 1 + t % 5)]
        idx[t, : len(keys)] = keys
    scale = 0.7
    dout = torch.randn(T, H, Dv, generator=g, **f64)

    ref = _expanded_reference(q_nope, q_rope, latent, w_k, w_v, idx, scale)
    want = torch.autograd.grad((ref * dout).sum(), (q_nope, q_rope, latent, w_k, w_v))
    q_hat = torch.cat([torch.einsum("thn,hnc->thc", q_nope, w_k), q_rope], -1)
    out = torch.einsum("thc,hvc->thv", sparse_latent_attention(q_hat, latent, idx, scale, C), w_v)
    got = torch.autograd.grad((out * dout).sum(), (q_nope, q_rope, latent, w_k, w_v))
    assert (out - ref).abs().max() < 1e-12
    for a, b in zip(got, want):
        assert (a - b).abs().max() < 1e-11 * max(1.0, b.abs().max().item())


def test_the_indexer_keeps_each_querys_top_scores_inside_its_document(monkeypatch):
    """Every score computed and masked (documents of 7, 1 and 12 tokens; a key at or before the query, in its
    document), the top 4 by a stable sort (equal scores: the earlier key) — the selection equals index_topk's as a
    set, in blocks of any size, and a query with fewer keys than 4 selects them all and pads with −1. A third of
    the index queries are zero, so their scores tie at 0 and the earliest keys win."""
    g = torch.Generator().manual_seed(1)
    lengths, N, I, K = [7, 1, 12], 3, 4, 4
    T = sum(lengths)
    q = torch.randn(T, N, I, generator=g)
    q[::3] = 0.0
    w = torch.randn(T, N, generator=g)
    k = torch.randn(T, I, generator=g)
    starts = [s for n, s in zip(lengths, [0, 7, 8]) for _ in range(n)]
    score = (w[:, :, None] * torch.relu(torch.einsum("tni,si->tns", q, k) * 0.5)).sum(1)
    keys = torch.arange(T)
    visible = (keys[None] >= torch.tensor(starts)[:, None]) & (keys[None] <= keys[:, None])
    score = score.masked_fill(~visible, float("-inf"))
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :K]
    want = torch.where(visible.gather(1, order), order, torch.full_like(order, -1))
    for block in (1 << 30, 64):
        monkeypatch.setattr(sa, "INDEX_BLOCK_BYTES", block)
        got = index_topk(q, w, k, list(range(T)), starts, K, 0.5)
        assert torch.equal(got.long().sort(-1).values, want.sort(-1).values), block
        assert ((got >= 0).int().diff(dim=1) <= 0).all()  # a query's keys first, −1 after them
    assert (want[7] == torch.tensor([7, -1, -1, -1])).all()  # the one-token document
    assert (want[0] == torch.tensor([0, -1, -1, -1])).all() and (want[9][:2] == torch.tensor([8, 9])).all()


def _shapes(topk: int):
    dense = ModelShape(name="mla", arch="deepseek_v3", hidden_size=32, num_layers=2, vocab_size=64,
                       layer_types=("full_attention",) * 2, num_heads=4, num_kv_heads=4, head_dim=12, qk_norm=False,
                       mla=MLAShape(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                    v_head_dim=6),
                       num_experts=4, top_k=2, expert_ffn=16, router_bias=True,
                       sigmoid_router=SigmoidRouter(groups=1, topk_groups=1, scaling=1.0), rope_theta=10000.0)
    return dense, dense.model_copy(update={"dsa": SparseAttentionShape(topk=topk, index_heads=2, index_head_dim=8)})


def test_a_top_k_past_every_document_is_dense_mla_and_a_small_one_is_not():
    """With index_topk at least every document's length the indexer keeps every causal key, and DSA's absorbed
    attention equals DeepSeek-V3's expanded dense MLA with the same weights (the indexer's aside); with 3 keys a
    query it differs (the selection acts)."""
    dense, _ = _shapes(64)
    ref = build_model(dense, seed=3)
    packing = Packing.from_lengths([20, 13])
    ids = torch.randint(0, 64, (33,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref(ids, packing)
        for topk, same in ((20, True), (3, False)):
            model = build_model(_shapes(topk)[1], seed=3)
            missing, unexpected = model.load_state_dict(ref.state_dict(), strict=False)
            assert not unexpected and all(".indexer." in m for m in missing)
            err = (model(ids, packing) - want).abs().max().item()
            assert (err < 1e-5) == same, (topk, err)


def test_kept_selections_spare_the_recomputed_indexer_and_change_nothing(monkeypatch):
    """Under full recompute with keep_selections each layer's indexer runs in its forward only: its recomputed
    forward takes the selection the forward left on the packing (and takes it off: nothing is left for a later step
    on the same packing), so the indexer runs 3 times a step on 4 layers where the last shares the third's selection,
    not 6, and the loss and every gradient are the same bit for bit. A forward without grad leaves nothing; the
    option needs full recompute."""
    from launch.model import Indexer
    from launch.recompute import apply_recompute

    dense, dsa = _shapes(3)
    shape = dsa.model_copy(update={"num_layers": 4, "layer_types": ("full_attention",) * 4,
                                   "dsa": dsa.dsa.model_copy(update={"shared_layers": (3,)})})
    ids = torch.randint(0, 64, (33,), generator=torch.Generator().manual_seed(4))
    calls = [0]
    forward = Indexer.forward

    def counted(self, *a, **kw):
        calls[0] += 1
        return forward(self, *a, **kw)
    monkeypatch.setattr(Indexer, "forward", counted)
    runs = []
    for keep in (False, True):
        model = apply_recompute(build_model(shape, seed=3), "full", keep_selections=keep)
        calls[0] = 0
        packing = Packing.from_lengths([20, 13])
        for _ in range(2):  # the same packing twice: the second step selects afresh
            loss = model(ids, packing).float().square().mean()
            loss.backward()
            assert not [k for k in packing.handoff.values if k[0] == "recompute_selection"]
        runs.append((calls[0], loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
        with torch.no_grad():
            idle = Packing.from_lengths([20, 13])
            model(ids, idle)
            assert not [k for k in idle.handoff.values if k[0] == "recompute_selection"]
    (full_calls, full_loss, full_grads), (kept_calls, kept_loss, kept_grads) = runs
    assert (full_calls, kept_calls) == (2 * 2 * 3, 2 * 3)
    assert kept_loss == full_loss and kept_grads.keys() == full_grads.keys()
    assert all(torch.equal(kept_grads[n], full_grads[n]) for n in full_grads)
    with pytest.raises(ValueError, match="keep_selections needs recompute 'full'"):
        apply_recompute(build_model(shape, seed=3), "none", keep_selections=True)


def index_kernel_checks():
    """The Triton index scores equal the torch path's (fp32, products in IEEE fp32) on 70 queries (two row tiles)
    against a span of 150 keys starting at key 20 (two column tiles), three documents, one whole key tile invisible
    to the first rows; the −inf pattern is the same exactly."""
    g = torch.Generator().manual_seed(5)
    T, N, I, lo, S = 70, 3, 16, 20, 150
    q, w, k = torch.randn(T, N, I, generator=g), torch.randn(T, N, generator=g), torch.randn(S, I, generator=g)
    query_index = torch.arange(100, 100 + T)
    doc_start = torch.where(query_index < 120, torch.tensor(20), torch.where(query_index < 150, 120, 150))
    want = index_scores_torch(q, w, k, query_index, doc_start, lo, 0.25)
    got = index_scores(q, w, k, query_index, doc_start, lo, 0.25, backend="triton")
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert (got[fin] - want[fin]).abs().max() < 1e-5 and fin.sum() > 1000


def sparse_mla_kernel_checks():
    """The Triton forward and backward kernels equal the torch blocks (fp32; the kernels' products in the
    interpreter's fp32) on 5 queries × 20 heads with a 16 + 4 latent (RoPE channels padded to 16 in the kernel) and
    40 slots (two or three key tiles): counts 1, 7, 33, 40 and 12, the rest −1, some keys selected by several
    queries (their dlatent rows summed by the atomics). Through the autograd function with the configurations the
    20 heads pick, then each configuration directly: the forward's 64-head block (one partial block, q re-read per
    tile) and 16-head blocks (the second partial); the backward's 32-head block (partial) and 16-head blocks of 16
    keys (its atomics from two head blocks a query)."""
    from kernels import sparse_mla_triton as k
    from launch.sparse_attention import _SparseLatentAttention, _SparseLatentAttentionTriton

    g = torch.Generator().manual_seed(6)
    T, H, C, R, S, K = 5, 20, 16, 4, 50, 40
    q = torch.randn(T, H, C + R, generator=g).requires_grad_()
    latent = torch.randn(S, C + R, generator=g).requires_grad_()
    idx = torch.full((T, K), -1, dtype=torch.int32)
    for t, n in enumerate((1, 7, 33, 40, 12)):
        idx[t, :n] = torch.randperm(S, generator=g)[:n].int()
    do = torch.randn(T, H, C, generator=g)
    want_o = _SparseLatentAttention.apply(q, latent, idx, 0.3, C)
    want = torch.autograd.grad((want_o * do).sum(), (q, latent))
    got_o = _SparseLatentAttentionTriton.apply(q, latent, idx, 0.3, C)
    got = torch.autograd.grad((got_o * do).sum(), (q, latent))
    assert (got_o - want_o).abs().max() < 1e-5
    for a, b in zip(got, want):
        assert (a - b).abs().max() < 1e-4 * max(1.0, b.abs().max().item())
    count = (idx >= 0).sum(1, dtype=torch.int32)
    qd, ld = q.detach(), latent.detach()
    for cfg in (dict(BH=64, BK=64, Q_PER_TILE=True), dict(BH=16, BK=32, Q_PER_TILE=False)):
        o, lse = k.forward(qd, ld, idx, count, 0.3, C, config=cfg)
        assert (o - want_o).abs().max() < 1e-5, cfg
    for cfg in (dict(BH=32, BK=32), dict(BH=16, BK=16)):
        dq, dl = k.backward(qd, ld, idx, count, o, lse, do, 0.3, C, config=cfg)
        for a, b in zip((dq, dl), want):
            assert (a - b).abs().max() < 1e-4 * max(1.0, b.abs().max().item()), cfg


def select_kernel_checks():
    """The selection kernel equals the torch path (topk on fp32, ties at the k-th to the earlier key, keys ascending,
    −1 after) row for row, its sizes shrunk (blocks of 16 scores, 64 candidates, samples of 32) so that 40 rows of
    up to 300 keys take every path: rows that see no more than k = 20 keys, rows held whole (≤ 64 visible), sampled
    rows bracketed, and sampled rows the sample missed or whose bracket held more than 64 keys (the whole-row
    search). Scores with exact ties (ReLU zeros, small integers), negative scores with −0 among them, a heavy tail;
    the span starts at key 7, two documents."""
    from kernels import dsa_index_triton as kt
    from kernels.dsa_index import select_keys, topk_select

    g = torch.Generator().manual_seed(7)
    n, S, lo, k = 40, 300, 7, 20
    query_index = lo + torch.linspace(3, S - 1, n).long()
    doc_start = torch.where(torch.arange(n) % 3 == 0, torch.tensor(lo + 30), torch.tensor(lo))
    doc_start = torch.minimum(doc_start, query_index)
    score = torch.randn(n, S, generator=g)
    score[0::4] = torch.relu(score[0::4])
    score[1::4] = torch.randint(0, 4, (len(range(1, n, 4)), S), generator=g).float()
    score[2::4] = score[2::4] * -1e-3
    score[2::4, ::5] = -0.0
    score[3::4] = score[3::4].exp()
    keys = torch.arange(lo, lo + S)
    visible = (keys[None] >= doc_start[:, None]) & (keys[None] <= query_index[:, None])
    score = score.masked_fill(~visible, float("-inf"))
    want = topk_select(score, k, lo)
    saved = kt.SELECT_CONFIG, kt.SELECT_CAP, kt.SELECT_SAMPLE, kt.select
    flags = []
    kt.SELECT_CONFIG, kt.SELECT_CAP, kt.SELECT_SAMPLE = dict(BLOCK=16, num_warps=1), 64, 32
    kt.select = lambda *a: flags.append(saved[3](*a)) or flags[-1]
    try:
        got = torch.full((n, k + 3), 5, dtype=torch.int32)
        select_keys(score, query_index, doc_start, lo, k, got, backend="triton")
        # a span no longer than the candidates (no gathering, no scratch rows): the first 50 keys
        short = torch.full((n, k), 5, dtype=torch.int32)
        qi_short = torch.minimum(query_index, torch.tensor(lo + 49))
        select_keys(score[:, :50].contiguous(), qi_short, doc_start, lo, k, short, backend="triton")
        assert torch.equal(short, topk_select(score[:, :50], k, lo)[:, :k])
    finally:
        kt.SELECT_CONFIG, kt.SELECT_CAP, kt.SELECT_SAMPLE, kt.select = saved
    slow = flags[0]
    assert torch.equal(got[:, :k], want) and bool((got[:, k:] == 5).all())
    n_vis = visible.sum(1)
    sampled = n_vis > 64
    assert bool((n_vis <= k).any()) and bool(((n_vis > k) & ~sampled).any())
    assert bool(slow[sampled].any()) and not bool(slow[sampled].all()) and not bool(slow[~sampled].any())


INTERPRETER_CHECKS = {f.__name__: f for f in (index_kernel_checks, sparse_mla_kernel_checks, select_kernel_checks)}
interpreter_results, test_triton_kernels_interpreter = interpreter.pytest_cases(__file__, INTERPRETER_CHECKS)


if __name__ == "__main__" and sys.argv[1:2] == ["interpreter"]:
    from interpreter import main

    main(INTERPRETER_CHECKS, sys.argv[2:])
