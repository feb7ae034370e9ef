"""Fused LM head (kernels.linear_cross_entropy / linear_logprobs) against a float64 torch reference.

Fresh random inputs per test, odd shapes. Three paths:
  * chunked torch (the CPU path), in this process;
  * the Triton kernels under TRITON_INTERPRET=1, in a subprocess (the variable must be set before triton is
    imported, and other tests in this process may import it first), CPU tensors, tiny shapes;
  * vocab-parallel TP=2 and FSDP2 over gloo, two spawned processes in one launch.
GPU tests (bf16, CUDA) are marked `gpu` and skipped without CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels.lm_head_reference import linear_cross_entropy_reference, linear_logprobs_reference

REPO = Path(__file__).resolve().parents[1]


def _rel(x, ref) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _inputs(T, H, V, *, logit_scale=3.0, dtype=torch.float32, device="cpu", seed=None):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())) if seed is None else seed)
    hidden = torch.randn(T, H, generator=g)
    # logits ~ N(0, logit_scale^2): weight entries N(0, (logit_scale / sqrt(H))^2)
    weight = torch.randn(V, H, generator=g) * (logit_scale / H**0.5)
    target = torch.randint(0, V, (T,), generator=g)
    return (hidden.to(device, dtype).requires_grad_(), weight.to(device, dtype).requires_grad_(),
            target.to(device))


def _ref_grads(fn, hidden, weight, *args, upstream=None, **kw):
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    out = fn(h64, w64, *args, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    ups = upstream if upstream is not None else [torch.ones_like(o) for o in outs]
    torch.autograd.backward(outs, [u.double() for u in ups])
    return out, h64.grad, w64.grad


def _ours_grads(fn, hidden, weight, *args, upstream=None, **kw):
    hidden.grad = weight.grad = None
    out = fn(hidden, weight, *args, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    ups = upstream if upstream is not None else [torch.ones_like(o) for o in outs]
    torch.autograd.backward(outs, [u.to(o.dtype) for u, o in zip(ups, outs)])
    return out, hidden.grad, weight.grad


def check_cross_entropy(T, H, V, *, backend, tol, ignore_frac=0.2, logit_scale=3.0, device="cpu",
                        dtype=torch.float32, grad_tol=None, **kw):
    hidden, weight, target = _inputs(T, H, V, logit_scale=logit_scale, device=device, dtype=dtype)
    ignore = torch.rand(T, device=device) < ignore_frac
    target = torch.where(ignore, torch.full_like(target, -100), target)
    chunk = {k: kw.pop(k) for k in ("chunk_tokens", "chunk_vocab", "impl") if k in kw}
    up = None
    if kw.get("reduction") == "none":
        up = [torch.randn(T, device=device)]
    loss, dh, dw = _ours_grads(kernels.linear_cross_entropy, hidden, weight, target, upstream=up, backend=backend,
                               **chunk, **kw)
    ref, rdh, rdw = _ref_grads(linear_cross_entropy_reference, hidden, weight, target, upstream=up, **kw)
    errs = {"loss": _rel(loss, ref), "dH": _rel(dh, rdh), "dW": _rel(dw, rdw)}
    limits = {"loss": tol, "dH": grad_tol or tol, "dW": grad_tol or tol}
    assert all(errs[k] <= limits[k] for k in errs), f"{errs} > {limits} (T={T} H={H} V={V} {kw})"
    assert torch.isfinite(dh).all() and torch.isfinite(dw).all()
    return errs


def check_logprobs(T, H, V, *, backend, tol, with_entropy=True, temperature=1.0, logit_scale=3.0, device="cpu",
                   dtype=torch.float32, grad_tol=None, **chunk):  # chunk: chunk_tokens / chunk_vocab / impl
    hidden, weight, target = _inputs(T, H, V, logit_scale=logit_scale, device=device, dtype=dtype)
    target[: max(1, T // 7)] = -100  # padding rows: logp 0, no gradient
    ups = [torch.randn(T, device=device) for _ in range(2 if with_entropy else 1)]
    kw = dict(temperature=temperature, with_entropy=with_entropy)
    out, dh, dw = _ours_grads(kernels.linear_logprobs, hidden, weight, target, upstream=ups, backend=backend,
                              **chunk, **kw)
    ref, rdh, rdw = _ref_grads(linear_logprobs_reference, hidden, weight, target, upstream=ups, **kw)
    outs, refs = (out, ref) if with_entropy else ((out,), (ref,))
    errs = {f"out{i}": _rel(o, r) for i, (o, r) in enumerate(zip(outs, refs))}
    if with_entropy:
        errs["out1"] = _rel_entropy(outs[1], refs[1])
    errs |= {"dH": _rel(dh, rdh), "dW": _rel(dw, rdw)}
    limits = {k: (grad_tol or tol) if k in ("dH", "dW") else tol for k in errs}
    assert all(errs[k] <= limits[k] for k in errs), f"{errs} > {limits} (T={T} H={H} V={V} {kw})"
    assert (outs[0][: max(1, T // 7)] == 0).all()
    return errs


def _rel_entropy(ent, ref, floor=1e-3) -> float:
    """Relative error of per-token entropies, measured against at least `floor` nats a token. A row whose softmax is
    one-hot to fp32 precision has entropy ~ r (the mass off the maximum, e.g. 1e-12 at |z| ~ 100), computed as
    log(1 + r) - ...: log of an fp32 sum within 1e-7 of 1, so the kernels (and any fp32 code) get it to ~1e-7
    absolute, not relative. When every row of a batch is that peaked (a rare draw at |z| ~ 100: seen once in
    CI, relative error 1.8e-3 of a 1e-5 norm) relative error would measure only that floor."""
    n = max(ref.numel(), 1)
    d = (ent.double() - ref.double()).norm()
    return (d / max(ref.double().norm().item(), floor * n ** 0.5)).item()


def check_policy_loss(T, H, V, *, backend, tol, temperature=1.0, logit_scale=3.0, device="cpu",
                      dtype=torch.float32, grad_tol=None, adv_spread=1.0, chunk_tokens=None, impl=None):
    """linear_policy_loss with a clipped-surrogate-like loss plus an entropy term against the float64 reference.
    adv_spread > 1 gives the token chunks advantages of very different sizes (chunk-wise fp16 scales differ)."""
    hidden, weight, target = _inputs(T, H, V, logit_scale=logit_scale, device=device, dtype=dtype)
    target[: max(1, T // 7)] = -100
    adv = torch.randn(T, device=device) * adv_spread ** torch.linspace(-1, 1, T, device=device)
    old = torch.randn(T, device=device) * 0.1 - 5.0

    def per_token(logp, ent, adv, old):
        ratio = torch.exp(logp - old)
        return -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv) - 0.01 * ent

    def token_loss(logp, ent, t0, t1):
        return per_token(logp, ent, adv[t0:t1], old[t0:t1])

    hidden.grad = weight.grad = None
    loss, logp, ent = kernels.linear_policy_loss(hidden, weight, target, token_loss, temperature=temperature,
                                                 with_entropy=True, backend=backend, chunk_tokens=chunk_tokens,
                                                 impl=impl)
    loss.backward()

    def ref_fn(h, w, t):
        lp, en = linear_logprobs_reference(h, w, t, with_entropy=True, temperature=temperature)
        return per_token(lp, en, adv.double(), old.double()).sum(), lp, en

    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref, rlp, ren = ref_fn(h64, w64, target)
    ref.backward()
    errs = {"loss": _rel(loss, ref), "logp": _rel(logp, rlp), "ent": _rel_entropy(ent, ren), "dH": _rel(hidden.grad, h64.grad),
            "dW": _rel(weight.grad, w64.grad)}
    limits = {k: (grad_tol or tol) if k in ("dH", "dW") else tol for k in errs}
    assert all(errs[k] <= limits[k] for k in errs), f"{errs} > {limits} (T={T} H={H} V={V})"
    assert (logp[: max(1, T // 7)] == 0).all() and not logp.requires_grad
    return errs


def check_all_ignored(backend, device="cpu"):
    hidden, weight, target = _inputs(9, 24, 70, device=device)
    target = torch.full_like(target, -100)
    loss = kernels.linear_cross_entropy(hidden, weight, target, backend=backend)
    loss.backward()
    assert loss.item() == 0.0
    assert (hidden.grad == 0).all() and (weight.grad == 0).all()
    # rows of a batch that are entirely ignored, reduction none: zeros there, the rest matches
    hidden.grad = weight.grad = None
    target2 = torch.randint(0, 70, (9,), device=device)
    target2[3:6] = -100
    per_tok = kernels.linear_cross_entropy(hidden, weight, target2, reduction="none", backend=backend)
    ref = linear_cross_entropy_reference(hidden.double(), weight.double(), target2, reduction="none")
    assert (per_tok[3:6] == 0).all() and _rel(per_tok, ref) < 1e-5


# ----------------------------------------------------------------------------------------------- CPU path
SHAPES = [(37, 48, 301), (5, 16, 1000), (64, 33, 257)]


@pytest.mark.parametrize("T,H,V", SHAPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_torch(T, H, V, reduction):
    check_cross_entropy(T, H, V, backend="torch", tol=1e-5, reduction=reduction)


@pytest.mark.parametrize("kw", [
    dict(z_loss=1e-3), dict(temperature=0.6), dict(temperature=1.7, z_loss=1e-4),
    dict(logit_scale=100.0),  # |z| ~ 100: any tile that skips the running max overflows exp
    dict(chunk_tokens=8, chunk_vocab=50),  # many chunks, odd sizes: chunked equals unchunked
])
def test_cross_entropy_options_torch(kw):
    check_cross_entropy(37, 48, 301, backend="torch", tol=2e-5, **kw)


@pytest.mark.parametrize("impl", ["fused", "split"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_bf16_inputs_fp16_scaled_gemms_torch(impl, reduction):
    # 16-bit inputs: dZ and the backward GEMMs run in fp16 with power-of-two scales; the error is bf16 output
    # rounding (~1e-3), and the |z| ~ 100 case checks the scales keep fp16 in range.
    for scale in (3.0, 100.0):
        check_cross_entropy(37, 48, 301, backend="torch", tol=1e-5, grad_tol=3e-3, dtype=torch.bfloat16,
                            reduction=reduction, impl=impl, logit_scale=scale, chunk_tokens=16, chunk_vocab=128)


def test_split_impl_torch():
    check_cross_entropy(37, 48, 301, backend="torch", tol=2e-5, impl="split", chunk_tokens=16, chunk_vocab=128,
                        z_loss=1e-3, temperature=0.8)
    check_logprobs(29, 40, 257, backend="torch", tol=2e-5, impl="split", chunk_tokens=16, chunk_vocab=100)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_logprobs_torch(with_entropy, temperature):
    check_logprobs(41, 40, 333, backend="torch", tol=1e-5, with_entropy=with_entropy, temperature=temperature,
                   chunk_tokens=16, chunk_vocab=100)


def test_logprobs_large_logits_torch():
    # fp32 logits of size ~300 carry ~3e-5 absolute error, which the entropy of a near one-hot softmax feels
    check_logprobs(23, 32, 211, backend="torch", tol=1e-3, grad_tol=1e-4, logit_scale=100.0)


def test_all_ignored_torch():
    check_all_ignored("torch")


def test_activation_checkpoint_non_reentrant():
    from torch.utils.checkpoint import checkpoint

    hidden, weight, target = _inputs(29, 32, 150)
    scale = torch.randn(32)

    def head(h, w):
        return kernels.linear_logprobs(torch.tanh(h * scale), w, target, with_entropy=True)

    lp, ent = checkpoint(head, hidden, weight, use_reentrant=False)
    (lp.sum() + 0.3 * ent.sum()).backward()
    dh, dw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    lp2, ent2 = head(hidden, weight)
    (lp2.sum() + 0.3 * ent2.sum()).backward()
    assert torch.equal(lp, lp2) and torch.equal(ent, ent2)
    assert _rel(dh, hidden.grad) < 1e-6 and _rel(dw, weight.grad) < 1e-6


@pytest.mark.parametrize("T,H,V", SHAPES)
@pytest.mark.parametrize("chunk_tokens", [None, 8, 5])
@pytest.mark.parametrize("kw", [dict(reduction="mean"), dict(reduction="sum", z_loss=1e-3, temperature=0.7)])
def test_eager_cross_entropy_torch(T, H, V, chunk_tokens, kw):
    check_cross_entropy(T, H, V, backend="torch", tol=2e-6, impl="eager", chunk_tokens=chunk_tokens, **kw)


@pytest.mark.parametrize("chunk_tokens", [None, 7])
def test_policy_loss_torch(chunk_tokens):
    check_policy_loss(37, 48, 301, backend="torch", tol=2e-6, chunk_tokens=chunk_tokens, temperature=1.3)


def test_policy_loss_bf16_mixed_chunk_scales_torch():
    # advantages spanning 1e-3..1e3 across the token chunks: each chunk's fp16 dlogits get their own power-of-two
    # scale and are brought to the group's smallest before the GEMMs; gradients stay at the bf16 output floor
    check_policy_loss(64, 48, 301, backend="torch", tol=2e-5, grad_tol=3e-3, dtype=torch.bfloat16,
                      adv_spread=1e3, chunk_tokens=32)


def test_eager_tile_statistics_across_tiles_torch(monkeypatch):
    # 64-wide logits tiles: each row's statistics are merged over 5 tiles (the last one partial: V = 301 = 4 * 64 +
    # 45), and the fp32 / fp16 tile weights e = exp(x - tile max) become dlogits with each tile's own max.
    # |z| ~ 100 (x ~ 140 at temperature 0.7): fp32 carries x2 ~ 200 (log2 units) to ~1e-5, so p to ~1e-5 relative.
    # (The policy loss with its entropy term is not checked at |z| ~ 100: there a one-hot row's gradient is a
    # cancellation, x - lse + ent ~ 0 from terms of ~140, and fp32 leaves 6e-3 relative error on some draws on every
    # path, the previous fp32-logits one included.)
    monkeypatch.setattr(kernels.lm_head_chunked, "LOGITS_TILE_VOCAB", 64)
    for scale, tol in ((3.0, 2e-6), (100.0, 3e-5)):
        check_cross_entropy(37, 48, 301, backend="torch", tol=tol, impl="eager", chunk_tokens=16, reduction="mean",
                            z_loss=1e-3, temperature=0.7, logit_scale=scale)
    # (the loss is a sum of terms of random sign: 1e-5, not 2e-6, relative to a sum that can come out small)
    check_policy_loss(37, 48, 301, backend="torch", tol=1e-5, chunk_tokens=16, temperature=1.3)
    check_policy_loss(37, 48, 301, backend="torch", tol=2e-5, grad_tol=3e-3, chunk_tokens=16, dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", ["torch"])
def test_eager_tail_of_a_peaked_softmax_keeps_fp16_precision(backend):
    # One vocab row dominates every token by 17 nats (e = exp(x - tile max) ~ 2^-24.5 for all the others). Stored
    # unscaled, fp16 would flush those weights to 0 or its one-bit subnormal 2^-24, and the dW rows of the other
    # tokens, made only of such weights, would be off by 37% (measured); stored times 2^14 they keep 11 bits.
    g = torch.Generator().manual_seed(5)
    T, H, V = 64, 32, 300
    u = torch.randn(H, generator=g)
    hidden = (u + 0.05 * torch.randn(T, H, generator=g)).bfloat16()
    weight = 0.02 * torch.randn(V, H, generator=g)
    weight[0] = 17.0 * u / u.square().sum()
    weight = weight.bfloat16()
    target = torch.randint(1, V, (T,), generator=g)
    target[::2] = 0
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    kernels.linear_cross_entropy(h, w, target, backend=backend).backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    linear_cross_entropy_reference(h64, w64, target).backward()
    tail = torch.ones(V, dtype=torch.bool)
    tail[0] = False
    tail[target] = False  # rows with a one-hot term are not made of tail weights only
    assert _rel(w.grad[tail], w64.grad[tail]) < 6e-3  # bf16 output rounding: ~2e-3


def test_eager_equals_generic_path():
    # the three-GEMM eager path and the four-GEMM generic path (stats, then autograd's backward) agree
    hidden, weight, target = _inputs(41, 32, 211)
    target[::6] = -100
    adv = torch.randn(41)
    loss, logp, _ = kernels.linear_policy_loss(hidden, weight, target, lambda lp, ent, a, b: lp * adv[a:b],
                                               chunk_tokens=16)
    loss.backward()
    dh, dw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logp2 = kernels.linear_logprobs(hidden, weight, target)
    (logp2 * adv).sum().backward()
    assert _rel(logp, logp2) < 1e-6 and _rel(dh, hidden.grad) < 1e-6 and _rel(dw, weight.grad) < 1e-6
    # and the loss may be scaled after the fact (backward multiplies the stored gradients by the upstream grad)
    hidden.grad = weight.grad = None
    loss, _, _ = kernels.linear_policy_loss(hidden, weight, target, lambda lp, ent, a, b: lp * adv[a:b])
    (0.25 * loss).backward()
    assert _rel(hidden.grad, 0.25 * dh) < 1e-6 and _rel(weight.grad, 0.25 * dw) < 1e-6


def _small_lean_chunks(L, kc=None, grain=4, tile=16):
    """Shrink the lean backward's chunks (and the torch path's logits tile) so that tiny shapes cross every kind
    of chunk: pass H over several token x vocab chunks inside dW's bytes, pass W's chunks in their own unwritten
    rows, then the tail buffer. Returns a restore function."""
    old = (L.GRAIN, L.PASS_H_CHUNKS, L.PASS_W_CHUNKS, kc.LOGITS_TILE_VOCAB if kc else None)
    L.GRAIN, L.PASS_H_CHUNKS, L.PASS_W_CHUNKS = grain, (4 * grain, 16 * grain), (4 * grain, 16 * grain)
    if kc:
        kc.LOGITS_TILE_VOCAB = tile

    def restore():
        L.GRAIN, L.PASS_H_CHUNKS, L.PASS_W_CHUNKS = old[:3]
        if kc:
            kc.LOGITS_TILE_VOCAB = old[3]
    return restore


def test_lean_plan_uses_own_rows_then_a_small_tail():
    from kernels import lm_head_lean as L

    # the target shape: pass H fits in dW's bytes at its wanted chunks; pass W runs in its own rows except the last
    # rows, whose scratch is the one external buffer (4.3 MiB at H = 2048)
    H, V, T = 2048, 248320, 65536
    need_h, need_w, need_direct = L._needs(H, 2, True, 256)
    assert L.fit_chunks(V * H * 2, need_h, T, V, L.PASS_H_CHUNKS) == (16384, 16384)
    plan = L.plan_vocab_pass(V, T, H * 2, need_w, need_direct)
    assert plan[0][:3] == (0, 8192, 8192) and plan[-1][1] == V
    assert all(a[1] == b[0] for a, b in zip(plan, plan[1:]))  # contiguous, in order
    for v0, v1, tc, own, direct in plan:  # an own chunk's scratch fits in the rows after it
        assert (not own) or (need_direct if direct else need_w)(tc, v1 - v0) <= (V - v1) * H * 2
    kinds = [(own, direct) for _, _, _, own, direct in plan]
    assert kinds.index((True, True)) > kinds.index((True, False)) and kinds[-1] == (False, True)
    tail = [c for c in plan if not c[3]]
    assert 0 < sum(c[1] - c[0] for c in tail) <= 2048 and need_direct(*L.tail_chunks(T, V)) < 1.6 * 2**20
    assert sum(-(-T // c[2]) for c in plan) < 1100  # launches: chunks x token chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lean_backward_torch(dtype):
    # the scratch lives in the outputs' own bytes: any overlap with rows already written would corrupt them
    from kernels import lm_head_chunked as kc, lm_head_lean as L

    restore = _small_lean_chunks(L, kc)
    try:
        kinds = {c[3:] for c in L.plan_vocab_pass(301, 37, 48 * 2, *L._needs(48, 2, True, 16)[1:])}  # bf16 case
        assert kinds == {(True, False), (True, True), (False, True)}  # cuBLAS in own rows, direct, tail
        gt = {torch.bfloat16: 3e-3, torch.float16: 5e-4}.get(dtype)  # 16-bit: the outputs' own rounding
        check_cross_entropy(37, 48, 301, backend="torch", tol=2e-6 if dtype == torch.float32 else 1e-5, grad_tol=gt,
                            impl="lean", reduction="mean", z_loss=1e-3, temperature=0.7, dtype=dtype)
        check_logprobs(29, 40, 257, backend="torch", tol=2e-5, grad_tol=gt, impl="lean", temperature=0.9,
                       dtype=dtype)
        check_cross_entropy(37, 48, 301, backend="torch", tol=2e-6, impl="lean", reduction="none")
        # one gradient only: dH alone (a frozen head) borrows no storage; dW alone starts in its own rows
        hidden, weight, target = _inputs(23, 16, 77)
        ref_loss, rdh, rdw = _ref_grads(linear_cross_entropy_reference, hidden, weight, target)
        for frozen in ("weight", "hidden"):
            h = hidden.detach().clone().requires_grad_(frozen != "hidden")
            w = weight.detach().clone().requires_grad_(frozen != "weight")
            kernels.linear_cross_entropy(h, w, target, impl="lean", backend="torch").backward()
            got, ref = (h.grad, rdh) if frozen == "weight" else (w.grad, rdw)
            assert _rel(got, ref) < 2e-6 and (w.grad if frozen == "weight" else h.grad) is None
    finally:
        restore()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_lean_with_the_loss_handed_over_torch(dtype):
    # mean CE and a policy loss with impl="lean": the first pass in token groups inside dW's bytes (eager-style, W
    # converted a chunk at a time for the dH GEMM), then pass W over every kind of chunk; several groups
    from kernels import lm_head_chunked as kc, lm_head_lean as L

    restore = _small_lean_chunks(L, kc)
    try:
        gt = {torch.bfloat16: 3e-3, torch.float16: 5e-4}.get(dtype)  # 16-bit: the outputs' own rounding
        f32 = dtype in (torch.float32, torch.float64)  # (fp64 inputs run in fp32)
        errs = check_cross_entropy(37, 48, 301, backend="torch", tol=2e-6 if f32 else 1e-5, grad_tol=gt, impl="lean",
                                   chunk_tokens=12, reduction="mean", z_loss=1e-3, temperature=0.7, dtype=dtype)
        check_cross_entropy(37, 48, 301, backend="torch", tol=2e-6 if f32 else 1e-5, grad_tol=gt, impl="lean",
                            reduction="sum", dtype=dtype)
        check_policy_loss(29, 40, 257, backend="torch", tol=2e-5, grad_tol=gt, chunk_tokens=8, temperature=1.3,
                          dtype=dtype, impl="lean", adv_spread=1e3)
        old_chunks = L.GROUP_DH_VOCAB, L.EXTERNAL_DH_VOCAB
        L.GROUP_DH_VOCAB = L.EXTERNAL_DH_VOCAB = 64  # the dH GEMM over 5 chunks of W, the last partial
        try:
            errs2 = check_cross_entropy(37, 48, 301, backend="torch", tol=2e-6 if f32 else 1e-5, grad_tol=gt,
                                        impl="lean", chunk_tokens=12, dtype=dtype)
            # and a frozen head, whose group scratch is a buffer of its own
            hidden, weight, target = _inputs(37, 48, 301, dtype=dtype)
            w = weight.detach().requires_grad_(False)
            kernels.linear_cross_entropy(hidden, w, target, impl="lean", backend="torch", chunk_tokens=12).backward()
            _, rdh, _ = _ref_grads(linear_cross_entropy_reference, hidden, weight, target)
            assert _rel(hidden.grad, rdh) < (gt or 2e-6)
        finally:
            L.GROUP_DH_VOCAB, L.EXTERNAL_DH_VOCAB = old_chunks
        assert errs["dH"] < (gt or 2e-6) and errs2["dH"] < (gt or 2e-6)
        # one gradient only: dH alone (a frozen head) borrows no storage; dW alone skips the dH GEMM
        hidden, weight, target = _inputs(23, 16, 77)
        ref_loss, rdh, rdw = _ref_grads(linear_cross_entropy_reference, hidden, weight, target)
        for frozen in ("weight", "hidden"):
            h = hidden.detach().clone().requires_grad_(frozen != "hidden")
            w = weight.detach().clone().requires_grad_(frozen != "weight")
            loss = kernels.linear_cross_entropy(h, w, target, impl="lean", backend="torch", chunk_tokens=8)
            loss.backward()
            got, ref = (h.grad, rdh) if frozen == "weight" else (w.grad, rdw)
            assert _rel(got, ref) < 2e-6 and (w.grad if frozen == "weight" else h.grad) is None
            assert _rel(loss, ref_loss) < 1e-6
    finally:
        restore()


def test_lean_group_fits_in_the_weight_gradient():
    # the target shape: 4096-token groups do not fit dW's 0.95 GiB, 1536 do (e 1536 x 248,320 x 2 B = 0.763 GB +
    # 17.9 MB of statistics + 12.6 MB of dH32 + a 134 MB fp16 chunk of W = 0.928 GB <= 1.017 GB; 1792: 1.060 GB);
    # a tiny budget falls to the last few tokens
    from kernels import lm_head_lean as L

    H, V, T = 2048, 248320, 65536
    sizes = (V, H, 2, 256, True, L.GROUP_DH_VOCAB)
    tg = L._group_tokens(V * H * 2, T, *sizes, None)
    assert tg == 1536 and L._group_need(tg, *sizes) <= V * H * 2 < L._group_need(1792, *sizes)
    assert L._group_tokens(V * H * 2, 300, *sizes, None) == 300  # a short batch: one group
    # 10 tokens' weights of budget, no dH: each token also has 970 tiles x 12 B of statistics, so 9 fit (9.77)
    assert L._group_tokens(10 * V * 2, T, V, H, 2, 256, False, 0, None) == 9
    # a frozen head (no dW to borrow): EXTERNAL_BYTES of tokens at 516,472 B each (weights, statistics, dH32): 129,
    # beside a 32 MiB chunk of W
    ext = (V, H, 2, 256, True, L.EXTERNAL_DH_VOCAB)
    assert L._group_tokens(L.EXTERNAL_BYTES + L._group_need(0, *ext), T, *ext, None) == 129


@pytest.mark.parametrize("impl", ["fused", "split", "eager", "lean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_tokens_give_zero_loss_and_zero_gradients(impl, dtype):
    hidden, weight, _ = _inputs(0, 8, 10, dtype=dtype)
    target = torch.zeros(0, dtype=torch.long)
    kernels.linear_cross_entropy(hidden, weight, target, impl=impl).backward()
    assert (weight.grad == 0).all() and hidden.grad.shape == (0, 8)
    if impl != "eager":
        weight.grad = None
        lp, ent = kernels.linear_logprobs(hidden, weight, target, impl=impl, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
        assert (weight.grad == 0).all()


def test_policy_loss_that_ignores_the_head_has_no_gradient():
    hidden, weight, target = _inputs(7, 8, 10)
    loss, logp, _ = kernels.linear_policy_loss(hidden, weight, target, lambda lp, ent, t0, t1: torch.ones(t1 - t0))
    loss.backward()
    assert loss.item() == 7.0 and (hidden.grad == 0).all() and (weight.grad == 0).all() and logp.shape == (7,)


def test_bad_arguments():
    hidden, weight, target = _inputs(4, 8, 10)
    with pytest.raises(ValueError, match="reduction"):
        kernels.linear_cross_entropy(hidden, weight, target, reduction="avg")
    with pytest.raises(ValueError, match="temperature"):
        kernels.linear_logprobs(hidden, weight, target, temperature=0.0)
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        kernels.linear_logprobs(hidden, weight[:, :5], target)
    with pytest.raises(ValueError, match="eager"):
        kernels.linear_cross_entropy(hidden, weight, target, reduction="none", impl="eager")
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        kernels.linear_policy_loss(hidden, weight[:, :5], target, lambda lp, ent, a, b: lp)
    with pytest.raises(ValueError, match="impl must be 'eager' or 'lean'"):
        kernels.linear_policy_loss(hidden, weight, target, lambda lp, ent, a, b: lp, impl="split")


def test_no_triton_import_on_cpu_path():
    code = ("import sys, torch, kernels; h = torch.randn(3, 4); w = torch.randn(5, 4); "
            "kernels.linear_cross_entropy(h, w, torch.tensor([0, 1, 2])); assert 'triton' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, env=_env())


# ------------------------------------------------------------------- Triton kernels under the interpreter
def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def check_tile_kernels() -> None:
    """The epilogue-statistics GEMM, all its variants (pointer loads or the persistent TMA kernel, whole-tile or
    two-half epilogue), and the in-place dz pass, against the torch versions with the same tile width; |z| ~ 30."""
    from kernels import lm_head_chunked as kc, lm_head_triton as kt
    from kernels.tiles import TileConfig

    hidden, weight, target = _inputs(37, 40, 301, logit_scale=30.0)
    hidden, weight = hidden.detach(), weight.detach()
    target[::5] = 500  # outside this rank's rows: no target column
    target[1] = -100  # ignored
    old = kc.LOGITS_TILE_VOCAB
    kc.LOGITS_TILE_VOCAB = 64
    try:
        e_ref = torch.empty(37, 301)
        m2_r, lse2_r, ent_r, tz_r, _ = kc.logits_tiles(hidden, weight, target, 0.7, True, e_ref)
        # the target logit (a gathered dot, not the tiles): float64 reference, 0 where the target is not a row here
        x64 = hidden.double() @ weight.double().T * 0.7
        hit = (target >= 0) & (target < 301)
        tz64 = torch.where(hit, x64.gather(1, target.clamp(0, 300)[:, None])[:, 0], 0.0)
        assert _rel(tz_r, tz64) < 1e-6 and _rel(kt.target_logits(hidden, weight, target, 0.7), tz64) < 1e-6
        a, b, c = torch.randn(3, 37)
        dz_ref = e_ref.clone()
        kc.dlogits_from_tiles(dz_ref, m2_r, 64, target, lse2_r, a, b, c, 0.7, 4.0)
        for tma in (False, True):
            for sub in (False, True):
                e = torch.full((37, 301), float("nan"))
                m2, lse2, ent, tz, tile = kt.logits_tiles(hidden, weight, target, 0.7, True, e, tma=tma, subtile=sub,
                                                          config=TileConfig(16, 64, 16, 1, 1))
                assert tile == 64
                for got, ref in ((m2, m2_r), (lse2, lse2_r), (ent, ent_r), (tz, tz_r), (e, e_ref)):
                    assert _rel(got, ref) < 1e-5, (tma, sub, _rel(got, ref))
                kt.dlogits_from_tiles(e, m2, tile, target, lse2, a, b, c, 0.7, torch.tensor(4.0))
                assert _rel(e, dz_ref) < 1e-5, (tma, sub, _rel(e, dz_ref))
        # the weights leaving through TMA stores (fp16, rows 16-byte aligned: V = 304), whole-tile and two halves;
        # the last tile is 48 columns and rows past T = 37 are clipped by the copy
        hidden2, weight2, target2 = _inputs(37, 40, 304, logit_scale=30.0)
        hidden2, weight2 = hidden2.detach(), weight2.detach()
        e2_ref = torch.empty(37, 304)
        kc.logits_tiles(hidden2, weight2, target2, 0.7, False, e2_ref)
        for sub in (False, True):
            e16 = torch.full((40, 304), float("nan"), dtype=torch.float16)[:37]
            kt.logits_tiles(hidden2, weight2, target2, 0.7, False, e16, tma=True, subtile=sub, e_tma=True,
                            config=TileConfig(16, 64, 16, 1, 1))
            assert _rel(e16.float(), e2_ref) < 1e-3, (sub, _rel(e16.float(), e2_ref))
        # the one-pass merge against torch's, 13 tiles (a masked tail of 1 at 4 per block), a row with -inf tiles
        lse2_NT = torch.randn(13, 37) * 30
        lse2_NT[:7, 5] = float("-inf")
        ent_NT = torch.rand(13, 37) * 3
        for ent_on in (False, True):
            for got, ref in zip(kt.merge_tiles(lse2_NT, ent_NT, ent_on), kc.combine_tiles(lse2_NT, ent_NT, ent_on)):
                err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()  # (entropy off: zeros, 0 / 1e-30)
                assert err < 1e-6, (ent_on, err)
    finally:
        kc.LOGITS_TILE_VOCAB = old


def interpreter_checks() -> None:
    """Run in a subprocess with TRITON_INTERPRET=1 (see __main__ below)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    small = dict(chunk_tokens=16, chunk_vocab=128)
    for kw in (dict(reduction="mean", z_loss=1e-3, temperature=0.7), dict(reduction="none"),
               dict(reduction="sum", logit_scale=100.0)):
        print("ce", kw, check_cross_entropy(37, 40, 301, backend="triton", tol=2e-5, **small, **kw))
    print("ce splits", check_cross_entropy(20, 40, 8300, backend="triton", tol=2e-5))  # 3 vocab splits
    for impl in ("fused", "split"):  # split: fp32 logits chunk from torch, streaming Triton kernels
        print(impl, "bf16", check_cross_entropy(37, 40, 301, backend="triton", tol=1e-5, grad_tol=3e-3, impl=impl,
                                                dtype=torch.bfloat16, logit_scale=30.0, **small))
    print("split", check_logprobs(29, 40, 257, backend="triton", tol=2e-5, impl="split", temperature=0.9, **small))
    print("lp", check_logprobs(29, 40, 257, backend="triton", tol=2e-5, temperature=1.3, **small))
    # entropy at |z| ~ 100: the kernels measure x - max in the log2 units of their exp2 weights; measuring it in
    # natural units put the rounding of max * ln 2 into a peaked row's entropy (up to 1e-2 relative, seen)
    print("lp |z|~100", check_logprobs(17, 32, 200, backend="triton", tol=3e-4, grad_tol=1e-4, logit_scale=100.0))
    print("split |z|~100", check_logprobs(17, 32, 200, backend="triton", tol=3e-4, grad_tol=1e-4, logit_scale=100.0,
                                          impl="split"))
    check_all_ignored("triton")
    check_tile_kernels()
    test_eager_tail_of_a_peaked_softmax_keeps_fp16_precision("triton")
    print("eager ce", check_cross_entropy(37, 40, 301, backend="triton", tol=2e-5, impl="eager", chunk_tokens=12,
                                          reduction="mean", z_loss=1e-3, temperature=0.7))
    print("eager ce splits", check_cross_entropy(20, 40, 8300, backend="triton", tol=2e-5, impl="eager"))
    print("eager bf16", check_cross_entropy(37, 40, 301, backend="triton", tol=1e-5, grad_tol=3e-3, impl="eager",
                                            dtype=torch.bfloat16, logit_scale=30.0, chunk_tokens=12))
    print("policy", check_policy_loss(29, 40, 257, backend="triton", tol=2e-5, chunk_tokens=8, temperature=1.3))
    from kernels import lm_head_lean

    restore = _small_lean_chunks(lm_head_lean, grain=16)  # several chunks of each kind, tail included
    try:
        print("lean bf16", check_cross_entropy(37, 40, 301, backend="triton", tol=1e-5, grad_tol=3e-3, impl="lean",
                                               dtype=torch.bfloat16, logit_scale=30.0))
        print("lean lp", check_logprobs(29, 40, 257, backend="triton", tol=2e-5, impl="lean", temperature=1.3))
        print("lean policy", check_policy_loss(29, 40, 257, backend="triton", tol=2e-5, chunk_tokens=8,
                                               temperature=1.3, impl="lean"))
    finally:
        restore()
    from kernels import lm_head_chunked as kc, lm_head_triton as kt

    dz, h, scale = torch.randn(37, 45).half(), torch.randn(37, 40).bfloat16(), torch.tensor(4.0)
    for first in (True, False):  # the direct dW kernel against torch: odd shapes, both write modes
        got = torch.randn(45, 40)
        ref = got.clone()
        kt.dw_acc(got, dz, h, scale, first)
        kc.dw_acc(ref, dz, h, scale, first)
        assert _rel(got, ref) < 1e-6, (first, _rel(got, ref))
    print("interpreter checks passed")


@pytest.mark.parametrize("flatten", ["1", "0"])
def test_triton_kernels_interpreter(flatten):
    out = subprocess.run([sys.executable, __file__, "interpreter"], cwd=REPO, capture_output=True, text=True,
                         env=_env(TRITON_INTERPRET="1", KERNELS_LM_HEAD_FLATTEN=flatten), timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "interpreter checks passed" in out.stdout


# ------------------------------------------------------------------------- TP=2 and FSDP2 over gloo
def _dist_worker(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # Vocab-parallel: each rank holds V/2 rows; stats and dH combine over the group.
        hidden, weight, target = _inputs(33, 40, 2 * 151, seed=1234)  # same inputs on both ranks
        target[:4] = -100
        up_lp, up_ent = torch.randn(33, generator=torch.Generator().manual_seed(7)), torch.randn(33)
        dist.broadcast(up_ent, src=0)
        V_local = weight.shape[0] // world
        w_local = weight.detach()[rank * V_local:(rank + 1) * V_local].clone().requires_grad_()
        for kw in (dict(z_loss=1e-3, temperature=0.9), dict(reduction="none")):
            loss = kernels.linear_cross_entropy(hidden, w_local, target, tp_group=dist.group.WORLD, **kw)
            up = [up_lp] if kw.get("reduction") == "none" else None
            hidden.grad = None
            torch.autograd.backward([loss], up or [torch.ones_like(loss)])
            ref, rdh, rdw = _ref_grads(linear_cross_entropy_reference, hidden, weight, target, upstream=up, **kw)
            rdw_local = rdw[rank * V_local:(rank + 1) * V_local]
            errs = (_rel(loss, ref), _rel(hidden.grad, rdh), _rel(w_local.grad, rdw_local))
            assert max(errs) < 1e-5, f"TP CE rank {rank} {kw}: {errs}"
            w_local.grad = None
        lp, ent = kernels.linear_logprobs(hidden, w_local, target, with_entropy=True, temperature=1.2,
                                          tp_group=dist.group.WORLD)
        hidden.grad = None
        torch.autograd.backward([lp, ent], [up_lp, up_ent])
        ref, rdh, rdw = _ref_grads(linear_logprobs_reference, hidden, weight, target, upstream=[up_lp, up_ent],
                                   with_entropy=True, temperature=1.2)
        errs = (_rel(lp, ref[0]), _rel(ent, ref[1]), _rel(hidden.grad, rdh),
                _rel(w_local.grad, rdw[rank * V_local:(rank + 1) * V_local]))
        assert max(errs) < 1e-5, f"TP logprobs rank {rank}: {errs}"
        # the lean backward, vocab-parallel: its per-chunk dH all-reduce follows the same plan on both ranks
        hidden.grad = w_local.grad = None
        lp, ent = kernels.linear_logprobs(hidden, w_local, target, with_entropy=True, temperature=1.2,
                                          tp_group=dist.group.WORLD, impl="lean")
        torch.autograd.backward([lp, ent], [up_lp, up_ent])
        errs = (_rel(lp, ref[0]), _rel(ent, ref[1]), _rel(hidden.grad, rdh),
                _rel(w_local.grad, rdw[rank * V_local:(rank + 1) * V_local]))
        assert max(errs) < 1e-5, f"TP lean logprobs rank {rank}: {errs}"
        # the fused policy loss, vocab-parallel: same numbers on both ranks, each its own dW rows
        hidden.grad = w_local.grad = None
        loss, lp2, ent2 = kernels.linear_policy_loss(
            hidden, w_local, target, lambda lp, en, a, b: lp * up_lp[a:b] + en * up_ent[a:b], with_entropy=True,
            temperature=1.2, tp_group=dist.group.WORLD, chunk_tokens=8)
        loss.backward()
        errs = (_rel(lp2, ref[0]), _rel(ent2, ref[1]), _rel(hidden.grad, rdh),
                _rel(w_local.grad, rdw[rank * V_local:(rank + 1) * V_local]))
        assert max(errs) < 1e-5, f"TP policy loss rank {rank}: {errs}"
        # and through the lean head (its first pass combines each group's statistics and sums dH over the group)
        hidden.grad = w_local.grad = None
        loss, lp3, ent3 = kernels.linear_policy_loss(
            hidden, w_local, target, lambda lp, en, a, b: lp * up_lp[a:b] + en * up_ent[a:b], with_entropy=True,
            temperature=1.2, tp_group=dist.group.WORLD, chunk_tokens=8, impl="lean")
        loss.backward()
        errs = (_rel(lp3, ref[0]), _rel(ent3, ref[1]), _rel(hidden.grad, rdh),
                _rel(w_local.grad, rdw[rank * V_local:(rank + 1) * V_local]))
        assert max(errs) < 1e-5, f"TP lean policy loss rank {rank}: {errs}"

        # FSDP2: the head's weight is a sharded DTensor parameter; inside forward FSDP hands the kernel the
        # gathered plain tensor (no .full_tensor()), and the reduce-scatter of its gradient is FSDP's.
        class Head(torch.nn.Module):
            def __init__(self, w):
                super().__init__()
                self.weight = torch.nn.Parameter(w.detach().clone())

            def forward(self, h, t):
                return kernels.linear_cross_entropy(h, self.weight, t)

        head = Head(weight)
        fully_shard(head, mesh=init_device_mesh("cpu", (world,)))
        h_r, t_r = hidden.detach()[rank::world], target[rank::world]  # each rank its own tokens
        head(h_r, t_r).backward()
        full_grad = head.weight.grad.full_tensor()
        ref_grad = torch.zeros_like(weight, dtype=torch.float64)
        for r in range(world):
            _, _, g = _ref_grads(linear_cross_entropy_reference, hidden[r::world], weight, target[r::world])
            ref_grad += g / world  # FSDP2 averages gradients over the data-parallel group
        assert _rel(full_grad, ref_grad) < 1e-5, f"FSDP2 rank {rank}: {_rel(full_grad, ref_grad)}"
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_vocab_parallel_tp2_and_fsdp2_gloo():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_dist_worker, args=(2, port), nprocs=2, join=True)


# ------------------------------------------------------------------------------------------ GPU (bf16)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("impl", ["fused", "split", "eager", "lean"])
@pytest.mark.parametrize("T,H,V", [(1000, 256, 5003), (4099, 512, 32771)])
def test_gpu_bf16_cross_entropy(T, H, V, impl):
    # bf16 operands, fp32 logits and accumulators: loss at fp32 accuracy; gradients limited by the bf16 dlogits
    # tile and the bf16 output rounding (the accuracy goal: dH 7e-3, dW 2e-3).
    errs = check_cross_entropy(T, H, V, backend="triton", tol=1e-5, device="cuda", dtype=torch.bfloat16,
                               z_loss=1e-4, chunk_tokens=1024, chunk_vocab=4096, grad_tol=2e-3, impl=impl)
    print(errs)


@pytest.mark.gpu
@needs_cuda
def test_gpu_lean_holds_its_outputs_and_a_few_mib():
    # impl="lean": the peak above the inputs over forward + backward is dH + dW (the gradients autograd returns)
    # plus the tail buffer (0.2 MiB at H = 1024), [T] vectors and per-chunk statistics; the generic backward holds an fp32 dH beside them
    from kernels import lm_head_lean, lm_head_triton

    T, H, V = 8192, 1024, 50257
    hidden, weight, target = _inputs(T, H, V, device="cuda", dtype=torch.bfloat16)
    outputs = (T + V) * H * 2
    need_direct = lm_head_lean._needs(H, 2, True, lm_head_triton.tile_vocab(hidden))[2]
    peaks = {}
    for impl in ("lean", "split"):
        for timed in (False, True):  # the first run warms up (compilation, cuBLAS workspaces)
            hidden.grad = weight.grad = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            kernels.linear_cross_entropy(hidden, weight, target, impl=impl).backward()
            torch.cuda.synchronize()
            peaks[impl] = torch.cuda.max_memory_allocated() - base
    print({k: f"{(v - outputs) / 2**20:.2f} MiB above the outputs" for k, v in peaks.items()})
    assert peaks["lean"] <= outputs + need_direct(*lm_head_lean.tail_chunks(T, V)) + 2 * 2**20
    assert peaks["split"] > outputs + T * H * 4  # (the comparison is meaningful: fp32 dH beside the outputs)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_logprobs_entropy(dtype):
    # logits of size ~90 (logit_scale 30): fp32 rounding of the logits shows in the entropy at ~2e-5
    grad_tol = 5e-5 if dtype == torch.float32 else 2e-3
    print(check_logprobs(3001, 256, 20011, backend="triton", tol=1e-4, device="cuda", dtype=dtype,
                         temperature=0.9, logit_scale=30.0, grad_tol=grad_tol))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_policy_loss(dtype):
    # fp32: the entropy term's gradient is a cancellation (x - lse + ent at |x| ~ 30); its error is 4.6e-5 with p
    # from exp(x - lse) and 5.1e-5 with p = e exp(m - lse) from the tile weights (measured on the torch path, which
    # runs the same arithmetic, at this shape)
    grad_tol = 7e-5 if dtype == torch.float32 else 2e-3
    print(check_policy_loss(3001, 256, 20011, backend="triton", tol=1e-4, device="cuda", dtype=dtype,
                            temperature=0.9, logit_scale=30.0, grad_tol=grad_tol, adv_spread=100.0,
                            chunk_tokens=1024))


if __name__ == "__main__" and sys.argv[1:] == ["interpreter"]:
    interpreter_checks()
