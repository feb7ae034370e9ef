"""Triton kernels of kernels/sink_merge.py: one program per block of rows of one leading index, each row's D
channels in fp32 registers. Imported lazily (the CPU path never imports triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gdn_fused_triton import _cast  # fp32 -> 16-bit, round to nearest even (also in the interpreter)

BLOCK_ROWS = 64  # kernels/sink_merge.py MAX_R2 counts on it


@triton.jit
def _scale_rows_kernel(O, W, R2, os1, os2, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)  # i · os1 passes 2^31 past 512K tokens of 64 heads
    j = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    mj = j < R2
    m = mj[:, None] & (d < D)[None, :]
    w = tl.load(W + i * R2 + j, mask=mj, other=0.0)
    p = O + i * os1 + j[:, None] * os2 + d[None, :]
    x = tl.load(p, mask=m, other=0.0).to(tl.float32)
    tl.store(p, _cast(x * w[:, None], O.dtype.element_ty), mask=m)


@triton.jit
def _grad_rows_kernel(DO, O, G, OUT, R2, ds1, ds2, os1, os2, gs1, gs2, D: tl.constexpr, COPY: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)  # i · os1 passes 2^31 past 512K tokens of 64 heads
    j = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    mj = j < R2
    m = mj[:, None] & (d < D)[None, :]
    g = tl.load(DO + i * ds1 + j[:, None] * ds2 + d[None, :], mask=m, other=0.0)
    if COPY:  # dO rewritten at o's strides, bit for bit
        tl.store(G + i * gs1 + j[:, None] * gs2 + d[None, :], g, mask=m)
    o = tl.load(O + i * os1 + j[:, None] * os2 + d[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + i * R2 + j, tl.sum(g.to(tl.float32) * o, axis=1), mask=mj)


def scale_rows(o: torch.Tensor, w: torch.Tensor) -> None:
    """o [R1, R2, D] (rows at any strides, channels contiguous) scaled in place by w [R1, R2] (fp32, contiguous)."""
    R1, R2, D = o.shape
    w = w.contiguous()
    grid = (R1, triton.cdiv(R2, BLOCK_ROWS))
    _scale_rows_kernel[grid](o, w, R2, o.stride(0), o.stride(1), D=D, BLOCK_R=BLOCK_ROWS,
                             BLOCK_D=triton.next_power_of_2(D), num_warps=4)


def grad_rows(do: torch.Tensor, o: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    """rowsum(dO ∘ o) [R1, R2] in fp32 for dO, o [R1, R2, D] (rows at any strides, channels contiguous); where g is
    given, dO is also written to it (o's strides)."""
    R1, R2, D = o.shape
    out = torch.empty((R1, R2), dtype=torch.float32, device=o.device)
    copy = g is not None
    g = g if copy else o  # not written without COPY
    grid = (R1, triton.cdiv(R2, BLOCK_ROWS))
    _grad_rows_kernel[grid](do, o, g, out, R2, do.stride(0), do.stride(1), o.stride(0), o.stride(1), g.stride(0),
                            g.stride(1), D=D, COPY=copy, BLOCK_R=BLOCK_ROWS, BLOCK_D=triton.next_power_of_2(D),
                            num_warps=4)
    return out
