"""The fused path (kernels/lm_head/fused.py: the loss handed to the head, three logits-sized GEMMs) on the torch
backend, against the float64 reference and against the autograd path."""

from __future__ import annotations

import pytest
import torch

import kernels
from lm_head_checks import check_cross_entropy, check_peaked_tail, check_policy_loss, dz_in_gemms_inputs, inputs, rel

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


def test_policy_loss_bf16_mixed_group_scales_torch():
    # advantages spanning 1e-3..1e3 across the token groups: each group's fp16 dlogits get their own power-of-two
    # scale, undone exactly by its GEMMs' alpha; gradients stay at the bf16 output floor
    check_policy_loss(64, 48, 301, backend="torch", tol=2e-5, grad_tol=3e-3, dtype=torch.bfloat16,
                      adv_spread=1e3, chunk_tokens=32)


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


def test_dz_in_gemms_forms_the_dz_pass_values():
    """The factor u (one per row and logits tile) times the stored weights is what the dZ pass stores, to fp16's
    rounding (one ulp of the fp32 product off the target column); the target column's dZ, formed in fp32 from the
    target logit, is the pass's value before its fp16 rounding. Temperature 0.7, dZ scale 4, policy-like a and c."""
    from kernels.lm_head import torch_backend as kc
    from kernels.lm_head.fused import gradients_from_weights
    from kernels.lm_head.numerics import Head

    hidden, weight, target, e, st, coef = dz_in_gemms_inputs()
    T, V = e.shape
    dz_pass = e.clone()
    kc.dlogits_from_tiles(dz_pass, st, target, st.lse2, coef, 0.7, torch.tensor(4.0))
    head = Head(hidden, weight, target, 0.7, None, kc)
    dz_captured = {}

    class Spy:  # the torch backend's kernels, recording the dZ they form
        def dh_from_weights(self, e_TV, u_NT, tile_v, tgt_T, dz_tgt_T, w_VH, out_TH, alpha):
            d = kc._weights_times_factors(e_TV, u_NT, tile_v).float()
            hit = (tgt_T >= 0) & (tgt_T < V)
            rows = torch.nonzero(hit)[:, 0]
            assert (d[rows, tgt_T[rows]] == 0).all()  # zeroed in the weights
            d[rows, tgt_T[rows]] = dz_tgt_T[rows]
            dz_captured["dz"] = d
            kc.dh_from_weights(e_TV, u_NT, tile_v, tgt_T, dz_tgt_T, w_VH, out_TH, alpha)

        dw_from_weights = staticmethod(kc.dw_from_weights)

    head = Head(hidden, weight, target, 0.7, None, Spy())
    gradients_from_weights(head, 0, T, e, st, coef, st.tz, torch.tensor(4.0), weight.half(),
                           torch.empty(T, weight.shape[1]), None, None, torch.tensor(1.0), torch.tensor(1.0))
    dz, ref = dz_captured["dz"], dz_pass.float()
    hit = (target >= 0) & (target < V)
    rows = torch.nonzero(hit)[:, 0]
    on_target = torch.zeros_like(ref, dtype=torch.bool)
    on_target[rows, target[rows]] = True
    ulp = 2.0 ** (torch.floor(torch.log2(ref.abs().clamp_min(2.0 ** -24))) - 10)
    assert ((dz - ref).abs() <= ulp)[~on_target].all()
    assert ((dz - ref).abs() <= ulp)[on_target].all()  # the pass rounded it once; here it is exact


@pytest.mark.parametrize("kw", [dict(reduction="mean"), dict(reduction="sum", z_loss=1e-3, temperature=0.7)])
def test_dz_in_gemms_cross_entropy_torch(monkeypatch, kw):
    from kernels.lm_head import fused

    monkeypatch.setattr(fused, "DZ_IN_GEMMS", True)
    check_cross_entropy(37, 48, 301, backend="torch", tol=2e-5, grad_tol=3e-3, dtype=torch.bfloat16,
                        logit_scale=30.0, chunk_tokens=16, **kw)


def test_dz_in_gemms_policy_loss_and_peaked_tail_torch(monkeypatch):
    from kernels.lm_head import fused

    monkeypatch.setattr(fused, "DZ_IN_GEMMS", True)
    check_policy_loss(64, 48, 301, backend="torch", tol=2e-5, grad_tol=3e-3, dtype=torch.bfloat16, adv_spread=1e3,
                      chunk_tokens=32, entropy_coef=0.0)  # (with an entropy term the dZ pass runs: b != 0)
    check_peaked_tail("torch")
