"""The fused path (kernels/lm_head/fused.py: the loss handed to the head, three logits-sized GEMMs) on the torch
backend, against the float64 reference and against the autograd path."""

from __future__ import annotations

import pytest
import torch

import kernels
from lm_head_checks import check_cross_entropy, check_peaked_tail, check_policy_loss, inputs, rel

SHAPES = [(37, 48, 301), (5, 16, 1000), (64, 33, 257)]


@pytest.mark.parametrize("T,H,V", SHAPES)
@pytest.mark.parametrize("chunk_tokens", [None, 8, 5])
@pytest.mark.parametrize("kw", [dict(reduction="mean"), dict(reduction="sum", z_loss=1e-3, temperature=0.7)])
def test_cross_entropy_torch(T, H, V, chunk_tokens, kw):
    check_cross_entropy(T, H, V, backend="torch", tol=2e-6, chunk_tokens=chunk_tokens, **kw)


@pytest.mark.parametrize("kw", [dict(temperature=0.6), dict(logit_scale=100.0)])
def test_cross_entropy_options_torch(kw):
    check_cross_entropy(37, 48, 301, backend="torch", tol=2e-5, **kw)


@pytest.mark.parametrize("chunk_tokens", [None, 7])
def test_policy_loss_torch(chunk_tokens):
    check_policy_loss(37, 48, 301, backend="torch", tol=2e-6, chunk_tokens=chunk_tokens, temperature=1.3)


@pytest.mark.parametrize("softcap", [2.0, 5.0])
def test_softcap_torch(softcap, monkeypatch):
    # logits c tanh(z / c) before the temperature, z of std 3 against caps of 2 and 5 (the checks assert the capped and
    # uncapped references differ by far more than their limits): mean and sum CE and the policy loss with its entropy
    # term (dZ's slope 1 - tanh^2 read from x in the tile weights, the target's from its exact x), in several groups;
    # 64-wide tiles so rows merge over 5 tiles; bf16 through the scaled fp16 dZ
    from kernels.lm_head import torch_backend

    check_cross_entropy(37, 48, 301, backend="torch", tol=2e-6, chunk_tokens=8, reduction="mean", softcap=softcap)
    check_cross_entropy(37, 48, 301, backend="torch", tol=2e-6, reduction="sum", z_loss=1e-3, temperature=0.7,
                        softcap=softcap)
    check_policy_loss(37, 48, 301, backend="torch", tol=1e-5, chunk_tokens=7, temperature=1.3, softcap=softcap)
    monkeypatch.setattr(torch_backend, "LOGITS_TILE_VOCAB", 64)
    check_cross_entropy(37, 48, 301, backend="torch", tol=2e-6, chunk_tokens=16, temperature=0.7, softcap=softcap)
    check_policy_loss(64, 48, 301, backend="torch", tol=2e-5, grad_tol=3e-3, dtype=torch.bfloat16, adv_spread=1e3,
                      chunk_tokens=32, logit_scale=30.0, softcap=softcap)


def test_policy_loss_bf16_mixed_group_scales_torch():
    # advantages spanning 1e-3..1e3 across the token groups: each group's fp16 dlogits get their own power-of-two
    # scale, undone exactly by its GEMMs' alpha; gradients stay at the bf16 output floor
    check_policy_loss(64, 48, 301, backend="torch", tol=2e-5, grad_tol=3e-3, dtype=torch.bfloat16,
                      adv_spread=1e3, chunk_tokens=32)


def test_policy_loss_without_entropy_bf16_torch():
    # no entropy term: the head computes no entropy and the loss's coefficients have b = 0; advantages spanning
    # 1e-3..1e3 across the token groups, gradients at the bf16 output floor
    check_policy_loss(64, 48, 301, backend="torch", tol=2e-5, grad_tol=3e-3, dtype=torch.bfloat16, adv_spread=1e3,
                      chunk_tokens=32, entropy_coef=0.0)


def test_tile_statistics_across_tiles_torch(monkeypatch):
    # 64-wide logits tiles: each row's statistics are merged over 5 tiles (the last one partial: V = 301 = 4 * 64 +
    # 45), and the fp32 / fp16 tile weights e = exp(x - tile max) become dlogits with each tile's own max.
    # |z| ~ 100 (x ~ 140 at temperature 0.7): fp32 carries x2 ~ 200 (log2 units) to ~1e-5, so p to ~1e-5 relative.
    # (The policy loss with its entropy term is not checked at |z| ~ 100: there a one-hot row's gradient is a
    # cancellation, x - lse + ent ~ 0 from terms of ~140, and fp32 leaves 6e-3 relative error on some draws on every
    # path.)
    from kernels.lm_head import torch_backend

    monkeypatch.setattr(torch_backend, "LOGITS_TILE_VOCAB", 64)
    for scale, tol in ((3.0, 2e-6), (100.0, 3e-5)):
        check_cross_entropy(37, 48, 301, backend="torch", tol=tol, chunk_tokens=16, reduction="mean",
                            z_loss=1e-3, temperature=0.7, logit_scale=scale)
    # (the loss is a sum of terms of random sign: 1e-5, not 2e-6, relative to a sum that can come out small)
    check_policy_loss(37, 48, 301, backend="torch", tol=1e-5, chunk_tokens=16, temperature=1.3)
    check_policy_loss(37, 48, 301, backend="torch", tol=2e-5, grad_tol=3e-3, chunk_tokens=16, dtype=torch.bfloat16)


def test_tail_of_a_peaked_softmax_keeps_fp16_precision_torch():
    check_peaked_tail("torch")


def test_fused_equals_autograd_path():
    # the three-GEMM fused path and the four-GEMM autograd path (stats, then autograd's backward) agree
    hidden, weight, target = inputs(41, 32, 211)
    target[::6] = -100
    adv = torch.randn(41)
    loss, logp, _ = kernels.linear_policy_loss(hidden, weight, target, lambda lp, ent, a, b: lp * adv[a:b],
                                               chunk_tokens=16)
    loss.backward()
    dh, dw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logp2 = kernels.linear_logprobs(hidden, weight, target)
    (logp2 * adv).sum().backward()
    assert rel(logp, logp2) < 1e-6 and rel(dh, hidden.grad) < 1e-6 and rel(dw, weight.grad) < 1e-6
    # and the loss may be scaled after the fact (backward multiplies the stored gradients by the upstream grad)
    hidden.grad = weight.grad = None
    loss, _, _ = kernels.linear_policy_loss(hidden, weight, target, lambda lp, ent, a, b: lp * adv[a:b])
    (0.25 * loss).backward()
    assert rel(hidden.grad, 0.25 * dh) < 1e-6 and rel(weight.grad, 0.25 * dw) < 1e-6


def test_group_size_worked_example():
    # bf16 at V = 248,320: 2 B x 4096 x V = 1.9 GiB fits the 2 GiB buffer, so groups of GROUP_TOKENS = 4096; fp32
    # weights (4 B) fit 2048 tokens (2 GiB / (4 B x V) = 2162, rounded down to a multiple of 256)
    from kernels.lm_head.fused import group_size

    assert group_size(65536, 248320, None, 2) == 4096
    assert group_size(65536, 248320, None, 4) == 2048
    assert group_size(300, 248320, None, 2) == 300 and group_size(65536, 248320, 1000, 2) == 1000


def test_odd_vocabulary_pads_the_gradient_gemms(monkeypatch):
    # V = 301: the gradient GEMMs see a vocabulary extent of 320 (a multiple of GEMM_ALIGN), dZ's extra columns and
    # W16's extra rows zero, every leading dimension 16-byte aligned; the gradients equal the float64 reference
    import kernels.lm_head.fused as fused
    from kernels.lm_head.numerics import GEMM_ALIGN, aligned_width

    assert aligned_width(301) == 320 and aligned_width(320) == 320 and aligned_width(1) == GEMM_ALIGN
    assert aligned_width(301, 16) == 304 and aligned_width(301, 256) == 320  # inside the last logits tile
    kinds = []
    real = fused.gemm_acc

    def spy(acc, a, b, first, alpha=1.0):
        for t in (acc, a, b):
            assert max(t.stride()) % 8 == 0, t.stride()  # the leading dimension: 16 bytes of fp16
        if b.shape[0] == 320:  # dH = dZ W16 over K = 320: the padding of both is zero
            kinds.append("dH")
            assert a.shape[1] == 320 and a[:, 301:].abs().max() == 0 and b[301:].abs().max() == 0
        else:  # dW32 += dZ^T h16 over M = 320
            kinds.append("dW")
            assert a.shape[0] == acc.shape[0] == 320 and a[301:].abs().max() == 0
        real(acc, a, b, first, alpha)

    monkeypatch.setattr(fused, "gemm_acc", spy)
    check_cross_entropy(37, 48, 301, backend="torch", tol=2e-5, grad_tol=3e-3, dtype=torch.bfloat16,
                        chunk_tokens=16)
    assert kinds.count("dH") == kinds.count("dW") == 3  # three groups of 16 tokens
