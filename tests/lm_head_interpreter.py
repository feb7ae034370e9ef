"""The Triton kernels of the LM head under TRITON_INTERPRET=1 (CPU tensors, tiny shapes), one named check each;
tests/test_kernels_lm_head_triton.py runs them all in one subprocess (tests/interpreter.py) and asserts each.
"""

from __future__ import annotations

import sys

import torch

from lm_head_checks import (
    check_all_ignored, check_cross_entropy, check_logprobs, check_peaked_tail, check_policy_loss, inputs, rel)

SMALL = dict(chunk_tokens=16, chunk_vocab=128)
# The soft-capped cases (logits c tanh(z / c) before the temperature; the kernels' SOFTCAP variants) ride along in the
# checks of their path below: z of std 3 against caps of 3 to 5, where the checks assert the capped and uncapped
# references differ by far more than their limits.


def ce_per_token():
    check_cross_entropy(37, 40, 301, backend="triton", tol=2e-5, reduction="none", **SMALL)
    # |z| ~ 100: fp32 carries x2 ~ 200 (log2 units) to ~1e-5, so p to ~1e-5 relative and the gradients to ~2e-5 (the
    # torch backend's check at this scale holds 3e-5 too)
    check_cross_entropy(37, 40, 301, backend="triton", tol=3e-5, reduction="none", logit_scale=100.0, **SMALL)
    check_cross_entropy(37, 40, 301, backend="triton", tol=2e-5, reduction="none", temperature=0.8, softcap=4.0,
                        **SMALL)


def ce_per_token_bf16():
    check_cross_entropy(37, 40, 301, backend="triton", tol=1e-5, grad_tol=3e-3, reduction="none",
                        dtype=torch.bfloat16, logit_scale=30.0, **SMALL)


def logprobs():
    check_logprobs(29, 40, 257, backend="triton", tol=2e-5, temperature=1.3, **SMALL)
    check_logprobs(29, 40, 257, backend="triton", tol=2e-5, temperature=1.3, softcap=3.0, **SMALL)


def logprobs_large_logits():
    # entropy at |z| ~ 100: the kernels measure x - max in the log2 units of their exp2 weights; measuring it in
    # natural units put the rounding of max * ln 2 into a peaked row's entropy (up to 1e-2 relative, seen)
    check_logprobs(17, 32, 200, backend="triton", tol=3e-4, grad_tol=1e-4, logit_scale=100.0)


def all_ignored():
    check_all_ignored("triton")


def fused_ce():
    check_cross_entropy(37, 40, 301, backend="triton", tol=2e-5, chunk_tokens=12, reduction="mean", z_loss=1e-3,
                        temperature=0.7)
    check_cross_entropy(20, 40, 8300, backend="triton", tol=2e-5)  # 130 tiles
    check_cross_entropy(37, 40, 301, backend="triton", tol=2e-5, chunk_tokens=12, reduction="sum", temperature=0.7,
                        softcap=3.0)


def fused_ce_bf16():
    check_cross_entropy(37, 40, 301, backend="triton", tol=1e-5, grad_tol=3e-3, dtype=torch.bfloat16,
                        logit_scale=30.0, chunk_tokens=12)
    # most logits saturated (|z| ~ 30, cap 5): the slope read from fp16 tile weights
    check_cross_entropy(37, 40, 301, backend="triton", tol=1e-5, grad_tol=3e-3, dtype=torch.bfloat16,
                        logit_scale=30.0, chunk_tokens=12, softcap=5.0)


def fused_policy_loss():
    check_policy_loss(29, 40, 257, backend="triton", tol=2e-5, chunk_tokens=8, temperature=1.3)
    check_policy_loss(29, 40, 257, backend="triton", tol=2e-5, chunk_tokens=8, temperature=1.3, softcap=3.0)


def fused_policy_loss_bf16_without_entropy():
    check_policy_loss(29, 40, 257, backend="triton", tol=2e-5, grad_tol=3e-3, dtype=torch.bfloat16, chunk_tokens=8,
                      temperature=1.3, entropy_coef=0.0)


def peaked_tail():
    check_peaked_tail("triton")


def _small_lean_chunks(grain=16):
    from kernels.lm_head import lean

    lean.GRAIN, lean.PASS_W_CHUNKS = grain, (4 * grain, 16 * grain)  # (a process of its own: nothing to restore)


def lean_ce_bf16():
    _small_lean_chunks()  # several chunks of each kind, tail included
    check_cross_entropy(37, 40, 301, backend="triton", tol=1e-5, grad_tol=3e-3, mode="lean", dtype=torch.bfloat16,
                        logit_scale=30.0)


def lean_policy_loss():
    _small_lean_chunks()
    check_policy_loss(29, 40, 257, backend="triton", tol=2e-5, chunk_tokens=8, temperature=1.3, mode="lean")
    check_policy_loss(17, 40, 129, backend="triton", tol=2e-5, chunk_tokens=8, temperature=1.3, mode="lean",
                      softcap=3.0)


def tile_kernels():
    """The epilogue-statistics GEMM, by pointer loads and as the persistent TMA kernel Hopper runs, whole-tile and
    two-half epilogue, and the in-place dz pass, against the torch backend with the same tile width; |z| ~ 30,
    uncapped and soft-capped at 20 (the SOFTCAP variants of each kernel)."""
    from kernels.lm_head import torch_backend as kc, triton_backend as kt
    from kernels.lm_head.numerics import Coefficients
    from kernels.lm_head.tiles import TileConfig

    hidden, weight, target = inputs(37, 40, 301, logit_scale=30.0)
    hidden, weight = hidden.detach(), weight.detach()
    target[::5] = 500  # outside this rank's rows: no target column
    target[1] = -100  # ignored
    kc.LOGITS_TILE_VOCAB = 64
    e_ref = torch.empty(37, 301)
    ref = kc.logits_tiles(hidden, weight, target, 0.7, True, e_ref)
    # the target logit (a gathered dot, not the tiles): float64 reference, 0 where the target is not a row here
    x64 = hidden.double() @ weight.double().T * 0.7
    hit = (target >= 0) & (target < 301)
    tz64 = torch.where(hit, x64.gather(1, target.clamp(0, 300)[:, None])[:, 0], 0.0)
    assert rel(ref.tz, tz64) < 1e-6 and rel(kt.target_logits(hidden, weight, target, 0.7), tz64) < 1e-6
    z64 = torch.where(hit, (hidden.double() @ weight.double().T).gather(1, target.clamp(0, 300)[:, None])[:, 0], 0.0)
    tz64_cap = 20.0 * torch.tanh(z64 / 20.0) * 0.7
    for kmod in (kc, kt):
        assert rel(kmod.target_logits(hidden, weight, target, 0.7, softcap=20.0), tz64_cap) < 1e-6, kmod
    a, b, c = torch.randn(3, 37)
    coef = Coefficients(ref.lse2, a, b, c)
    dz_ref = e_ref.clone()
    kc.dlogits_from_tiles(dz_ref, ref, target, ref.lse2, coef, 0.7, 4.0)
    kt_use_tma, kt_tile = kt._use_tma, kt._tile_config
    try:
        for tma, block_v, cap in ((False, 64, None), (False, 128, 20.0), (True, 64, 20.0), (True, 128, None)):
            # block_v 128: the two-half epilogue (SUBTILE) of the 256-wide tiles, at half size
            kt._use_tma = lambda *args, tma=tma: tma
            kt._tile_config = lambda h, bv=block_v: TileConfig(16, bv, 16, 1, 1)
            kc.LOGITS_TILE_VOCAB = block_v
            case = (tma, block_v, cap)
            ref = kc.logits_tiles(hidden, weight, target, 0.7, True, e_ref, softcap=cap)
            dz_ref = e_ref.clone()
            kc.dlogits_from_tiles(dz_ref, ref, target, ref.lse2, coef, 0.7, 4.0, softcap=cap)
            e = torch.full((37, 301), float("nan"))
            st = kt.logits_tiles(hidden, weight, target, 0.7, True, e, softcap=cap)
            assert st.tile_v == block_v
            for got, want in ((st.m2, ref.m2), (st.lse2, ref.lse2), (st.ent, ref.ent), (st.tz, ref.tz), (e, e_ref)):
                assert rel(got, want) < 1e-5, (case, rel(got, want))
            e_pad = torch.full((37, 320), float("nan"))  # padded to 320 columns (numerics.aligned_width)
            kt.logits_tiles(hidden, weight, target, 0.7, True, e_pad, softcap=cap)
            assert torch.equal(e_pad[:, :301], e) and not e_pad[:, 301:].any(), case
            kt.dlogits_from_tiles(e, st, target, st.lse2, coef, 0.7, torch.tensor(4.0), softcap=cap)
            assert rel(e, dz_ref) < 1e-5, (case, rel(e, dz_ref))
            kt.dlogits_from_tiles(e_pad, st, target, st.lse2, coef, 0.7, torch.tensor(4.0), softcap=cap)
            assert torch.equal(e_pad[:, :301], e) and not e_pad[:, 301:].any(), case
            # and the torch backend's the same way
            kc.logits_tiles(hidden, weight, target, 0.7, True, e_pad.fill_(float("nan")), softcap=cap)
            assert torch.equal(e_pad[:, :301], e_ref) and not e_pad[:, 301:].any(), case
        # the capped and uncapped tiles differ (|z| ~ 30 against a cap of 20)
        assert rel(kc.logits_tiles(hidden, weight, target, 0.7, True, softcap=20.0).lse2, ref.lse2) > 1e-2
    finally:
        kt._use_tma, kt._tile_config = kt_use_tma, kt_tile
    # the one-pass merge against torch's, 13 tiles (a masked tail of 1 at 4 per block), a row with -inf tiles
    lse2_NT = torch.randn(13, 37) * 30
    lse2_NT[:7, 5] = float("-inf")
    ent_NT = torch.rand(13, 37) * 3
    for ent_on in (False, True):
        for got, want in zip(kt.merge_tiles(lse2_NT, ent_NT, ent_on), kc.merge_tiles(lse2_NT, ent_NT, ent_on)):
            err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()  # (entropy off: zeros, 0 / 1e-30)
            assert err < 1e-6, (ent_on, err)


def direct_dw():
    """The lean head's direct dW kernel against torch: odd shapes, both write modes."""
    from kernels.lm_head import torch_backend as kc, triton_backend as kt

    dz, h, scale = torch.randn(37, 45).half(), torch.randn(37, 40).bfloat16(), torch.tensor(4.0)
    for first in (True, False):
        got = torch.randn(45, 40)
        want = got.clone()
        kt.dw_acc(got, dz, h, scale, first)
        kc.dw_acc(want, dz, h, scale, first)
        assert rel(got, want) < 1e-6, (first, rel(got, want))


CHECKS = {f.__name__: f for f in (ce_per_token, ce_per_token_bf16, logprobs, logprobs_large_logits, all_ignored,
                                  fused_ce, fused_ce_bf16, fused_policy_loss, fused_policy_loss_bf16_without_entropy,
                                  peaked_tail, lean_ce_bf16, lean_policy_loss, tile_kernels, direct_dw)}


if __name__ == "__main__" and sys.argv[1:2] == ["interpreter"]:
    from interpreter import main

    main(CHECKS, sys.argv[2:])
