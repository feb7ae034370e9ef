"""Shared by the LM-head tests: random inputs, the float64 reference side by side, and checks of each public function
(loss or outputs and both gradients, relative errors against limits) that the torch, interpreter, GPU and gloo tests
run with their own backend and tolerances."""

from __future__ import annotations

from pathlib import Path

import torch

import kernels
from kernels.lm_head.reference import linear_cross_entropy_reference, linear_logprobs_reference

REPO = Path(__file__).resolve().parents[1]


def rel(x, ref) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def inputs(T, H, V, *, logit_scale=3.0, dtype=torch.float32, device="cpu", seed=None):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())) if seed is None else seed)
    hidden = torch.randn(T, H, generator=g)
    # logits ~ N(0, logit_scale^2): weight entries N(0, (logit_scale / sqrt(H))^2)
    weight = torch.randn(V, H, generator=g) * (logit_scale / H**0.5)
    target = torch.randint(0, V, (T,), generator=g)
    return (hidden.to(device, dtype).requires_grad_(), weight.to(device, dtype).requires_grad_(),
            target.to(device))


def ref_grads(fn, hidden, weight, *args, upstream=None, **kw):
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    out = fn(h64, w64, *args, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    ups = upstream if upstream is not None else [torch.ones_like(o) for o in outs]
    torch.autograd.backward(outs, [u.double() for u in ups])
    return out, h64.grad, w64.grad


def ours_grads(fn, hidden, weight, *args, upstream=None, **kw):
    hidden.grad = weight.grad = None
    out = fn(hidden, weight, *args, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    ups = upstream if upstream is not None else [torch.ones_like(o) for o in outs]
    torch.autograd.backward(outs, [u.to(o.dtype) for u, o in zip(ups, outs)])
    return out, hidden.grad, weight.grad


def assert_cap_matters(fn, hidden, weight, *args, limits, upstream=None, softcap=None, **kw):
    """With a soft cap, the float64 reference with and without it must differ by over 3x the check's limits (and 1%):
    some output (a loss summed over tokens of both signs may move little, its log-probs do), dH and dW each; so a
    check that passes could not have passed with the cap ignored."""
    if not softcap:
        return
    min_rel = max(0.01, 3 * max(limits.values()))
    capped = ref_grads(fn, hidden, weight, *args, upstream=upstream, softcap=softcap, **kw)
    plain = ref_grads(fn, hidden, weight, *args, upstream=upstream, **kw)
    for name, c, p in zip(("outputs", "dH", "dW"), capped, plain):
        c, p = (c, p) if isinstance(c, tuple) else ((c,), (p,))
        moved = max(rel(pi, ci) for ci, pi in zip(c, p))
        assert moved > min_rel, f"softcap {softcap} barely moves {name}: {moved} <= {min_rel}"


def check_cross_entropy(T, H, V, *, backend, tol, ignore_frac=0.2, logit_scale=3.0, device="cpu",
                        dtype=torch.float32, grad_tol=None, **kw):
    hidden, weight, target = inputs(T, H, V, logit_scale=logit_scale, device=device, dtype=dtype)
    ignore = torch.rand(T, device=device) < ignore_frac
    target = torch.where(ignore, torch.full_like(target, -100), target)
    chunk = {k: kw.pop(k) for k in ("chunk_tokens", "chunk_vocab", "mode") if k in kw}
    up = None
    if kw.get("reduction") == "none":
        up = [torch.randn(T, device=device)]
    loss, dh, dw = ours_grads(kernels.linear_cross_entropy, hidden, weight, target, upstream=up, backend=backend,
                               **chunk, **kw)
    ref, rdh, rdw = ref_grads(linear_cross_entropy_reference, hidden, weight, target, upstream=up, **kw)
    errs = {"loss": rel(loss, ref), "dH": rel(dh, rdh), "dW": rel(dw, rdw)}
    limits = {"loss": tol, "dH": grad_tol or tol, "dW": grad_tol or tol}
    assert all(errs[k] <= limits[k] for k in errs), f"{errs} > {limits} (T={T} H={H} V={V} {kw})"
    assert torch.isfinite(dh).all() and torch.isfinite(dw).all()
    assert_cap_matters(linear_cross_entropy_reference, hidden, weight, target, limits=limits, upstream=up, **kw)
    return errs


def check_logprobs(T, H, V, *, backend, tol, with_entropy=True, temperature=1.0, logit_scale=3.0, device="cpu",
                   dtype=torch.float32, grad_tol=None, softcap=None, **chunk):  # chunk: chunk_tokens / chunk_vocab
    hidden, weight, target = inputs(T, H, V, logit_scale=logit_scale, device=device, dtype=dtype)
    target[: max(1, T // 7)] = -100  # padding rows: logp 0, no gradient
    ups = [torch.randn(T, device=device) for _ in range(2 if with_entropy else 1)]
    kw = dict(temperature=temperature, with_entropy=with_entropy) | (dict(softcap=softcap) if softcap else {})
    out, dh, dw = ours_grads(kernels.linear_logprobs, hidden, weight, target, upstream=ups, backend=backend,
                              **chunk, **kw)
    ref, rdh, rdw = ref_grads(linear_logprobs_reference, hidden, weight, target, upstream=ups, **kw)
    outs, refs = (out, ref) if with_entropy else ((out,), (ref,))
    errs = {f"out{i}": rel(o, r) for i, (o, r) in enumerate(zip(outs, refs))}
    if with_entropy:
        errs["out1"] = rel_entropy(outs[1], refs[1])
    errs |= {"dH": rel(dh, rdh), "dW": rel(dw, rdw)}
    limits = {k: (grad_tol or tol) if k in ("dH", "dW") else tol for k in errs}
    assert all(errs[k] <= limits[k] for k in errs), f"{errs} > {limits} (T={T} H={H} V={V} {kw})"
    assert (outs[0][: max(1, T // 7)] == 0).all()
    assert_cap_matters(linear_logprobs_reference, hidden, weight, target, limits=limits, upstream=ups, **kw)
    return errs


def rel_entropy(ent, ref, floor=1e-3) -> float:
    """Relative error of per-token entropies, measured against at least `floor` nats a token. A row whose softmax is
    one-hot to fp32 precision has entropy ~ r (the mass off the maximum, e.g. 1e-12 at |z| ~ 100), computed as
    log(1 + r) - ...: log of an fp32 sum within 1e-7 of 1, so the kernels (and any fp32 code) get it to ~1e-7
    absolute, not relative. When every row of a batch is that peaked (a rare draw at |z| ~ 100: seen once in
    CI, relative error 1.8e-3 of a 1e-5 norm) relative error would measure only that floor."""
    n = max(ref.numel(), 1)
    d = (ent.double() - ref.double()).norm()
    return (d / max(ref.double().norm().item(), floor * n ** 0.5)).item()


def check_policy_loss(T, H, V, *, backend, tol, temperature=1.0, logit_scale=3.0, device="cpu",
                      dtype=torch.float32, grad_tol=None, adv_spread=1.0, chunk_tokens=None, mode=None,
                      entropy_coef=0.01, softcap=None):
    """linear_policy_loss with a clipped-surrogate-like loss plus an entropy term (none at entropy_coef 0: the head
    then computes no entropy) against the float64 reference. adv_spread > 1 gives the token chunks advantages of
    very different sizes (chunk-wise fp16 scales differ)."""
    hidden, weight, target = inputs(T, H, V, logit_scale=logit_scale, device=device, dtype=dtype)
    target[: max(1, T // 7)] = -100
    adv = torch.randn(T, device=device) * adv_spread ** torch.linspace(-1, 1, T, device=device)
    old = torch.randn(T, device=device) * 0.1 - 5.0

    def per_token(logp, ent, adv, old):
        ratio = torch.exp(logp - old)
        surrogate = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
        return surrogate - entropy_coef * ent if entropy_coef else surrogate

    def token_loss(logp, ent, t0, t1):
        return per_token(logp, ent, adv[t0:t1], old[t0:t1])

    hidden.grad = weight.grad = None
    loss, logp, ent = kernels.linear_policy_loss(hidden, weight, target, token_loss, temperature=temperature,
                                                 softcap=softcap, with_entropy=bool(entropy_coef), backend=backend,
                                                 chunk_tokens=chunk_tokens, mode=mode)
    loss.backward()

    def ref_fn(h, w, t, softcap=softcap):
        lp, en = linear_logprobs_reference(h, w, t, with_entropy=True, temperature=temperature, softcap=softcap)
        return per_token(lp, en, adv.double(), old.double()).sum(), lp, en

    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    ref, rlp, ren = ref_fn(h64, w64, target)
    ref.backward()
    errs = {"loss": rel(loss, ref), "logp": rel(logp, rlp), "dH": rel(hidden.grad, h64.grad),
            "dW": rel(weight.grad, w64.grad)}
    if entropy_coef:
        errs["ent"] = rel_entropy(ent, ren)
    limits = {k: (grad_tol or tol) if k in ("dH", "dW") else tol for k in errs}
    assert all(errs[k] <= limits[k] for k in errs), f"{errs} > {limits} (T={T} H={H} V={V})"
    assert (logp[: max(1, T // 7)] == 0).all() and not logp.requires_grad
    assert_cap_matters(lambda h, w, t, softcap=None: ref_fn(h, w, t, softcap), hidden, weight, target,
                       limits=limits, softcap=softcap, upstream=[torch.ones(()), torch.zeros(T), torch.zeros(T)])
    return errs


def check_all_ignored(backend, device="cpu"):
    hidden, weight, target = inputs(9, 24, 70, device=device)
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
    assert (per_tok[3:6] == 0).all() and rel(per_tok, ref) < 1e-5


def tile_peaked_inputs():
    """One vocab row dominates every token by 17 nats (e = exp(x - tile max) ~ 2^-24.5 for all the others), bf16."""
    g = torch.Generator().manual_seed(5)
    T, H, V = 64, 32, 300
    u = torch.randn(H, generator=g)
    hidden = (u + 0.05 * torch.randn(T, H, generator=g)).bfloat16()
    weight = 0.02 * torch.randn(V, H, generator=g)
    weight[0] = 17.0 * u / u.square().sum()
    weight = weight.bfloat16()
    target = torch.randint(1, V, (T,), generator=g)
    target[::2] = 0
    return hidden, weight, target


def check_peaked_tail(backend):
    """Stored unscaled, fp16 would flush the tail weights to 0 or its one-bit subnormal 2^-24, and the dW rows of the
    other tokens, made only of such weights, would be off by 37% (measured); stored times 2^14 they keep 11 bits."""
    hidden, weight, target = tile_peaked_inputs()
    V = weight.shape[0]
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    kernels.linear_cross_entropy(h, w, target, backend=backend).backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    linear_cross_entropy_reference(h64, w64, target).backward()
    tail = torch.ones(V, dtype=torch.bool)
    tail[0] = False
    tail[target] = False  # rows with a one-hot term are not made of tail weights only
    assert rel(w.grad[tail], w64.grad[tail]) < 6e-3  # bf16 output rounding: ~2e-3


def small_lean_chunks(monkeypatch, grain=4, tile=16):
    """Shrink the lean head's chunks (and the torch backend's logits tile) so that tiny shapes cross every kind of
    chunk: pass W's chunks in their own unwritten rows, the direct dW kernel, then the tail buffer."""
    from kernels.lm_head import lean, torch_backend

    monkeypatch.setattr(lean, "GRAIN", grain)
    monkeypatch.setattr(lean, "PASS_W_CHUNKS", (4 * grain, 16 * grain))
    monkeypatch.setattr(torch_backend, "LOGITS_TILE_VOCAB", tile)
