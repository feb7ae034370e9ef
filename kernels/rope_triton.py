"""Triton kernel of kernels/rope.py: one program per (token, block of heads) rotates the first R channels of each
head and copies the rest, forward or backward (the transposed rotation), in fp32 registers, one rounding to the
output dtype (to nearest even, `_cast`, so that the CPU interpreter computes the GPU's bits). Imported lazily (the
CPU path never imports triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gdn_fused_triton import _cast  # fp32 -> 16-bit, round to nearest even (also in the interpreter)


@triton.jit
def _rope_kernel(X, COS, SIN, Y, H, xs_t, xs_h, ys_t, ys_h, cs_t,
                 D: tl.constexpr, HALF: tl.constexpr, IN_PAIRS: tl.constexpr, OUT_PAIRS: tl.constexpr,
                 SAME_HALVES: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr,
                 BLOCK_P: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # t · stride passes 2^31 for a view into a wide tensor at long sequences
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_I)
    mh = h < H
    mi = i < HALF
    m = mh[:, None] & mi[None, :]
    # the angles of this token: cos and sin of the first half, and of the second (equal for the pair form)
    c1 = tl.load(COS + t * cs_t + i, mask=mi, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(SIN + t * cs_t + i, mask=mi, other=0.0).to(tl.float32)[None, :]
    if SAME_HALVES:
        c2 = c1
        s2 = s1
    else:
        c2 = tl.load(COS + t * cs_t + HALF + i, mask=mi, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(SIN + t * cs_t + HALF + i, mask=mi, other=0.0).to(tl.float32)[None, :]
    x_row = X + t * xs_t + h[:, None] * xs_h
    y_row = Y + t * ys_t + h[:, None] * ys_h
    if IN_PAIRS:  # channel pairs (2i, 2i + 1)
        a = tl.load(x_row + 2 * i[None, :], mask=m, other=0.0).to(tl.float32)
        b = tl.load(x_row + 2 * i[None, :] + 1, mask=m, other=0.0).to(tl.float32)
    else:  # halves (i, HALF + i)
        a = tl.load(x_row + i[None, :], mask=m, other=0.0).to(tl.float32)
        b = tl.load(x_row + HALF + i[None, :], mask=m, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose of the rotation below
        ya = a * c1 + b * s2
        yb = b * c2 - a * s1
    else:
        ya = a * c1 - b * s1
        yb = b * c2 + a * s2
    if OUT_PAIRS:
        tl.store(y_row + 2 * i[None, :], _cast(ya, Y.dtype.element_ty), mask=m)
        tl.store(y_row + 2 * i[None, :] + 1, _cast(yb, Y.dtype.element_ty), mask=m)
    else:
        tl.store(y_row + i[None, :], _cast(ya, Y.dtype.element_ty), mask=m)
        tl.store(y_row + HALF + i[None, :], _cast(yb, Y.dtype.element_ty), mask=m)
    if BLOCK_P > 0:  # the channels past the rotated ones pass through
        p = 2 * HALF + tl.arange(0, BLOCK_P)
        mp = mh[:, None] & (p < D)[None, :]
        tl.store(y_row + p[None, :], tl.load(x_row + p[None, :], mask=mp, other=0.0), mask=mp)


def rope(x_THD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor, rotary: int, pairs: bool,
         backward: bool) -> torch.Tensor:
    """y [T, H, D] (contiguous) of x [T, H, D] (any token and head strides, channels contiguous): the first `rotary`
    channels rotated (forward) or rotated back (backward), the rest copied. `pairs`: the rotated channels are pairs
    (2i, 2i + 1), written as halves forward and read as halves backward."""
    T, H, D = x_THD.shape
    half = rotary // 2
    y = torch.empty((T, H, D), dtype=x_THD.dtype, device=x_THD.device)
    if T == 0 or H == 0:
        return y
    block_i = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(H), 4096 // max(block_i, 1)))
    rest = D - rotary
    block_p = triton.next_power_of_2(rest) if rest else 0
    grid = (T, triton.cdiv(H, block_h))
    _rope_kernel[grid](x_THD, cos_TR, sin_TR, y, H, x_THD.stride(0), x_THD.stride(1), y.stride(0), y.stride(1),
                       cos_TR.stride(0), D=D, HALF=half, IN_PAIRS=pairs and not backward,
                       OUT_PAIRS=pairs and backward, SAME_HALVES=pairs, BACKWARD=backward, BLOCK_H=block_h,
                       BLOCK_I=block_i, BLOCK_P=block_p, num_warps=4)
    return y
