"""The lean backward of the LM head (impl="lean"): dH and dW with fp32 accumulation and nothing beside them but a
few MiB, the scratch carved out of the outputs' own storage (docs/kernels.md, "The lean backward").

Shape legend: T tokens, H hidden size, V vocab rows on this rank, Tc/Vc chunk sizes. Inputs as in
kernels/lm_head.py's _backward_chunks: per-token lse and the coefficients (a, b, c) of dloss/dx.

Why two passes. A single pass over [T, V] blocks must carry one of the two gradients across blocks in fp32: dH
([T, H], summed over vocab) or dW ([V, H], summed over tokens). The smaller, dH32, is 0.5 GiB at T = 65,536,
H = 2048; with dW (0.95 GiB at V = 248,320) that is 1.45 GiB, more than the two outputs (1.20 GiB) can hold. So each
gradient gets its own pass, in the loop order that finishes its rows one chunk at a time:
    pass H (token-outer): for a token chunk, over all vocab chunks: recompute the logits tile and its dZ,
           dH32[Tc, H] += dZ W16; then dH[chunk] = dH32 (cast once).
    pass W (vocab-outer): for a vocab chunk, over all token chunks: recompute, dW32[Vc, H] += dZ^T h16;
           then dW[chunk] = dW32.
Five logits-sized GEMMs in all (the forward's statistics, two recomputations, dH, dW) against four for the
generic backward, in exchange for memory: the accumulators are chunk-sized.

Where the scratch lives. Pass H runs first, while dW's storage (V H 2 bytes) is not yet written: its dZ tile, dH32
chunk, fp16 W chunk and tile statistics are views of those bytes. Pass W then writes dW chunk by chunk from row 0
and keeps its scratch in the rows it has not written yet (the rows after the chunk). Chunks shrink as those rows
run out; once an fp16 copy of h no longer fits behind a cuBLAS-sized chunk, the dW GEMM becomes a Triton kernel that
reads h as it is (dw_acc); those chunks shrink down to 4 rows, and the last few dozen rows, whose scratch cannot
fit behind them, use one small external buffer (TAIL_GRAINS chunks: 8192 tokens x 4 rows, 0.22 MiB at H = 2048).
The stream orders every reuse of those bytes.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from kernels import lm_head as _lh
from kernels.lm_head_chunked import LOG2E, PARTS_PER_TILE

GRAIN = 256  # chunk sizes are multiples of this (tests shrink it to exercise the carving)
PASS_H_CHUNKS = (16384, 16384)  # (Tc, Vc) wanted in pass H: 4 token chunks at T = 65,536, so W is converted 4 times
PASS_W_CHUNKS = (8192, 8192)  # (Tc, Vc) wanted in pass W: 128 MiB dZ + 64 MiB dW32 + 32 MiB h16 at H = 2048
CUBLAS_LEAST = (8, 4)  # in GRAINs: pass W's cuBLAS chunks stay >= 2048 x 1024; smaller ones go direct (no h16)
DIRECT_CHUNKS = (16384, 4096)  # (Tc, Vc) wanted of a direct chunk (dZ and dW32 only)
DIRECT_LEAST = (32, 1 / 64)  # in GRAINs: 8192 tokens x 4 rows
TAIL_GRAINS = DIRECT_LEAST  # (Tc, Vc) of the last chunks: 8192 x 4, 64 KiB dZ + 32 KiB dW32 + 128 KiB statistics,
#                             the external buffer (their scratch cannot fit behind them)
EXTERNAL_BYTES = 64 * 2**20  # the most pass H allocates when it has no dW to borrow (its chunks fit this)
_ALIGN = 256  # bytes: each carved tensor starts on this boundary (TMA wants 16, cuBLAS likes 256)

NeedFn = Callable[[int, int], int]


class _Arena:
    """Typed tensors carved one after another out of a byte region (a view of some tensor's storage)."""

    def __init__(self, region_u8: torch.Tensor):
        self.region = region_u8
        self.off = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        start = self.off + (-(self.region.data_ptr() + self.off)) % _ALIGN
        n = math.prod(shape) * dtype.itemsize
        if start + n > self.region.numel():
            raise RuntimeError(f"lean LM-head backward: scratch plan overflows its region ({start + n} > "
                               f"{self.region.numel()} bytes); a bug in lm_head_lean's sizes")
        self.off = start + n
        return self.region[start:start + n].view(dtype).view(shape)


def _bytes_of(t: torch.Tensor, first_row: int = 0) -> torch.Tensor:
    """The bytes of rows [first_row, end) of a contiguous 2-D tensor, as a uint8 view."""
    return t[first_row:].reshape(-1).view(torch.uint8)


def _shrink(tc: int, vc: int, t_min: int, v_min: int) -> tuple[int, int] | None:
    """Halve the larger of the two chunk sizes (multiples of GRAIN, not below the minimum); None at the minimum."""
    def half(n, least):  # multiples of GRAIN down to GRAIN, then plain halving (the tail's few rows)
        n2 = n // 2 // GRAIN * GRAIN if n >= 2 * GRAIN else n // 2
        return max(least, n2)

    if vc >= tc and vc > v_min:
        return tc, half(vc, v_min)
    if tc > t_min:
        return half(tc, t_min), vc
    if vc > v_min:
        return tc, half(vc, v_min)
    return None


def _largest(fits: Callable[[int, int], bool], T: int, V: int, want: tuple[int, int],
             least: tuple[float, float] = (1, 1)) -> tuple[int, int] | None:
    """The largest (Tc, Vc), from `want` down by halving to `least` (in GRAINs), for which fits(Tc, Vc)."""
    t_min, v_min = min(T, max(1, int(least[0] * GRAIN))), min(V, max(1, int(least[1] * GRAIN)))
    sizes: tuple[int, int] | None = (min(T, max(want[0], t_min)), min(V, max(want[1], v_min)))
    while sizes is not None:
        if fits(*sizes):
            return sizes
        sizes = _shrink(*sizes, t_min, v_min)
    return None


def fit_chunks(budget: int, need: NeedFn, T: int, V: int, want: tuple[int, int]) -> tuple[int, int] | None:
    """The largest (Tc, Vc), from `want` down by halving, whose need(Tc, Vc) fits in budget bytes."""
    return _largest(lambda tc, vc: need(tc, vc) <= budget, T, V, want)


def tail_chunks(T: int, V: int) -> tuple[int, int]:
    """(Tc, Vc) of pass W's last chunks, whose scratch is the external buffer."""
    return min(T, max(1, int(TAIL_GRAINS[0] * GRAIN))), min(V, max(1, int(TAIL_GRAINS[1] * GRAIN)))


def plan_vocab_pass(V: int, T: int, row_bytes: int, need_w: NeedFn, need_direct: NeedFn | None = None
                    ) -> list[tuple[int, int, int, bool, bool]]:
    """Pass W's chunks [(v0, v1, Tc, own, direct)], rows in order. own: the scratch fits in dW's rows [v1, V), not
    yet written (row_bytes each); else it is the external tail buffer. direct: the dW GEMM reads h as it is
    (kmod.dw_acc, scratch need_direct) instead of cuBLAS on an fp16 copy of h (need_w): the chunks that cannot
    hold a cuBLAS-sized copy of h behind them. need_direct None: inputs that need no copy (fp32)."""
    chunks = []
    v0 = 0
    while v0 < V:
        R = V - v0

        def behind(need):
            return lambda tc, vc: need(tc, vc) <= (R - vc) * row_bytes

        direct = False
        sizes = _largest(behind(need_w), T, R, PASS_W_CHUNKS, CUBLAS_LEAST if need_direct else (1, 1))
        if sizes is None and need_direct is not None:
            direct = True
            sizes = _largest(behind(need_direct), T, R, DIRECT_CHUNKS, DIRECT_LEAST)
        own = sizes is not None
        if sizes is None:
            direct = need_direct is not None
            sizes = tail_chunks(T, R)
        chunks.append((v0, v0 + sizes[1], sizes[0], own, direct))
        v0 += sizes[1]
    return chunks


def _parts_floats(tc: int, vc: int, tile: int) -> int:
    """fp32 elements of logits_tiles' per-tile statistics for a [tc, vc] chunk: PARTS_PER_TILE per token per tile."""
    return PARTS_PER_TILE * tc * -(-vc // tile)


def _needs(H: int, ge: int, convert: bool, tile: int):
    """Scratch bytes of one chunk (ge: bytes per GEMM operand element; convert: 16-bit inputs are copied to fp16
    operands), with one alignment's slack per carved tensor: pass H; pass W with cuBLAS on an fp16 copy of h;
    pass W with the direct dW kernel (no copy)."""
    def parts(tc, vc):
        return 4 * _parts_floats(tc, vc, tile) + _ALIGN

    def need_h(tc, vc):  # dZ, dH32, W16, tile statistics
        return tc * vc * ge + tc * H * 4 + (vc * H * ge if convert else 0) + parts(tc, vc) + 3 * _ALIGN

    def need_w(tc, vc):  # dZ, dW32, h16, tile statistics
        return tc * vc * ge + vc * H * 4 + (tc * H * ge if convert else 0) + parts(tc, vc) + 3 * _ALIGN

    def need_direct(tc, vc):  # dZ, dW32, tile statistics
        return tc * vc * ge + vc * H * 4 + parts(tc, vc) + 3 * _ALIGN

    return need_h, need_w, need_direct


def lean_backward(hidden_TH, weight_VH, tgt_T, lse_T, a_T, b_T, c_T, inv_temp: float, backend: str,
                  need_h: bool, need_w: bool, tp_group):
    """(dH [T, H] or None, dW [V, H] or None) in the inputs' dtypes; see the module docstring. b_T None: b = 0."""
    T, H = hidden_TH.shape
    V = weight_VH.shape[0]
    if T == 0 or not (need_h or need_w):
        return (torch.zeros_like(hidden_TH) if need_h else None), (torch.zeros_like(weight_VH) if need_w else None)
    kmod = _lh._backend_module(backend)
    dev = hidden_TH.device
    gemm_dtype, dz_scale, h_scale, w_scale = _lh._backward_operands(hidden_TH, weight_VH, lse_T, a_T, b_T, c_T,
                                                                    inv_temp)
    ge = gemm_dtype.itemsize
    convert = gemm_dtype != hidden_TH.dtype
    tile = kmod.tile_vocab(hidden_TH)
    need_h_fn, need_w_fn, need_direct_fn = _needs(H, ge, convert, tile)
    dH = torch.empty_like(hidden_TH) if need_h else None
    dW = torch.empty_like(weight_VH) if need_w else None

    def dz_tile(arena, t0, t1, v0, v1, tc, vc):
        """dZ for tokens [t0, t1) x vocab rows [v0, v1), scaled by dz_scale, in a [rows, v1 - v0] arena tensor."""
        dz = arena.take((t1 - t0, v1 - v0), gemm_dtype)
        parts = arena.take((_parts_floats(tc, vc, tile),), torch.float32)
        tgt = tgt_T[t0:t1] - v0
        m2, _, _, _, tile_v = kmod.logits_tiles(hidden_TH[t0:t1], weight_VH[v0:v1], tgt, inv_temp, False, dz,
                                                parts=parts, merge=False)
        b = a_T if b_T is None else b_T  # (not read without b)
        kmod.dlogits_from_tiles(dz, m2, tile_v, tgt, lse_T[t0:t1] * LOG2E, a_T[t0:t1], b[t0:t1], c_T[t0:t1], inv_temp,
                                dz_scale, b_T is not None)
        return dz

    if need_h:  # pass H, token-outer; scratch: dW's storage while it is unwritten
        sizes = fit_chunks(dW.numel() * dW.element_size(), need_h_fn, T, V, PASS_H_CHUNKS) if need_w else None
        if sizes is not None:
            region = _bytes_of(dW)
        else:  # no dW to borrow, or too small: a buffer of its own (the smallest chunks if EXTERNAL_BYTES is short)
            sizes = fit_chunks(EXTERNAL_BYTES, need_h_fn, T, V, PASS_H_CHUNKS) or (min(T, GRAIN), min(V, GRAIN))
            region = torch.empty(need_h_fn(*sizes), dtype=torch.uint8, device=dev)
        Tc, Vc = sizes
        inv = 1.0 / (dz_scale * w_scale)
        for t0 in range(0, T, Tc):
            t1 = min(t0 + Tc, T)
            for v0 in range(0, V, Vc):
                v1 = min(v0 + Vc, V)
                arena = _Arena(region)
                dH32 = arena.take((Tc, H), torch.float32)[: t1 - t0]
                w_g = weight_VH[v0:v1]
                if convert:
                    w_g = torch.mul(w_g, w_scale, out=arena.take((v1 - v0, H), gemm_dtype))
                dz = dz_tile(arena, t0, t1, v0, v1, Tc, Vc)
                _lh._gemm_acc(dH32, dz, w_g, first=(v0 == 0))
            dH32.mul_(inv)
            if tp_group is not None:
                dist.all_reduce(dH32, group=tp_group)  # hidden is replicated over the group: sum the partials
            dH[t0:t1].copy_(dH32)

    if need_w:  # pass W, vocab-outer; scratch: dW's rows after the chunk, then the tail buffer
        row_bytes = H * dW.element_size()
        inv = 1.0 / (dz_scale * h_scale)
        tail = None
        plan = plan_vocab_pass(V, T, row_bytes, need_w_fn, need_direct_fn if convert else None)
        for v0, v1, Tc, own, direct in plan:
            if own:
                region = _bytes_of(dW, v1)
            else:
                if tail is None:
                    tail = torch.empty((need_direct_fn if convert else need_w_fn)(*tail_chunks(T, V)),
                                       dtype=torch.uint8, device=dev)
                region = tail
            for t0 in range(0, T, Tc):
                t1 = min(t0 + Tc, T)
                arena = _Arena(region)
                dW32 = arena.take((v1 - v0, H), torch.float32)
                if direct:  # h read as it is, converted in registers
                    dz = dz_tile(arena, t0, t1, v0, v1, Tc, v1 - v0)
                    kmod.dw_acc(dW32, dz, hidden_TH[t0:t1], h_scale, first=(t0 == 0))
                    continue
                h_g = hidden_TH[t0:t1]
                if convert:
                    h_g = torch.mul(h_g, h_scale, out=arena.take((t1 - t0, H), gemm_dtype))
                dz = dz_tile(arena, t0, t1, v0, v1, Tc, v1 - v0)
                _lh._gemm_acc(dW32, dz.T, h_g, first=(t0 == 0))
            dW[v0:v1].copy_(dW32.mul_(inv))
    return dH, dW
