"""The lean head (`lm_head: lean`): the loss handed to the head as in kernels/lm_head/fused.py, dH and dW with fp32
accumulation, and nothing beside them but [T] vectors and a few MiB: the scratch is carved out of dW's own storage
(docs/kernels.md, "The lean head"). Four logits-sized GEMMs against the fused path's three.

Shape legend: T tokens, H hidden size, V vocab rows on this rank, Tg tokens per group, Tc/Vc chunk sizes.

Why two passes. A single pass over [T, V] blocks must carry one of the two gradients across blocks in fp32: dH
([T, H], summed over vocab) or dW ([V, H], summed over tokens). With dW's fp32 accumulator (1.9 GiB at V = 248,320,
H = 2048) that is more than the two outputs can hold. So:
    pass 1 (token groups, the fused path's): the logits GEMM with its tile statistics, the loss's coefficients,
           dZ, and dH[group] = dZ W summed over the vocabulary in fp32; its scratch in dW's storage, not yet
           written. W is converted to fp16 GROUP_DH_VOCAB rows at a time (an fp16 copy of all of W would not fit),
           the group's dH32 accumulating over those chunks in cuBLAS's fp32 C: the fused path's operands and errors.
    pass W (vocab-outer): for a vocab chunk, over all token chunks: recompute the logits tile and its dZ,
           dW32[Vc, H] += dZ^T h16; then dW[chunk] = dW32.
Pass W writes dW chunk by chunk from row 0 and keeps its scratch in the rows it has not written yet (the rows after
the chunk). Chunks shrink as those rows run out; once an fp16 copy of h no longer fits behind a cuBLAS-sized chunk,
the dW GEMM becomes a Triton kernel that reads h as it is (dw_acc); those chunks shrink down to 4 rows, and the last
few dozen rows, whose scratch cannot fit behind them, use one small external buffer (TAIL_GRAINS chunks: 8192
tokens x 4 rows, 0.22 MiB at H = 2048). The stream orders every reuse of those bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist

from kernels.lm_head.fused import GROUP_TOKENS, Totals, TokenLoss, group_statistics
from kernels.lm_head.numerics import (
    LOG2E, PARTS_PER_TILE, Coefficients, Head, aligned_width, amax, backward_operands, dz_scale, gemm_acc,
    pow2_scale)

GRAIN = 256  # chunk sizes are multiples of this (tests shrink it to exercise the carving)
PASS_W_CHUNKS = (8192, 8192)  # (Tc, Vc) wanted in pass W: 128 MiB dZ + 64 MiB dW32 + 32 MiB h16 at H = 2048
CUBLAS_LEAST = (8, 4)  # in GRAINs: pass W's cuBLAS chunks stay >= 2048 x 1024; smaller ones go direct (no h16)
DIRECT_CHUNKS = (16384, 4096)  # (Tc, Vc) wanted of a direct chunk (dZ and dW32 only)
DIRECT_LEAST = (32, 1 / 64)  # in GRAINs: 8192 tokens x 4 rows
TAIL_GRAINS = DIRECT_LEAST  # (Tc, Vc) of the last chunks: 8192 x 4, 64 KiB dZ + 32 KiB dW32 + 128 KiB statistics,
#                             the external buffer (their scratch cannot fit behind them)
EXTERNAL_BYTES = 64 * 2**20  # the most pass 1 allocates when it has no dW to borrow (a frozen head)
GROUP_DH_VOCAB = 32768  # vocab rows of W converted to fp16 at a time for a group's dH GEMM (128 MiB at H = 2048)
EXTERNAL_DH_VOCAB = 8192  # the same with no dW storage to borrow (a frozen head): 32 MiB beside EXTERNAL_BYTES
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
                               f"{self.region.numel()} bytes); a bug in kernels/lm_head/lean.py's sizes")
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


def _needs(H: int, ge: int, convert: bool, tile: int) -> tuple[NeedFn, NeedFn]:
    """Scratch bytes of one chunk of the weight pass (ge: bytes per GEMM operand element; convert: 16-bit inputs are
    copied to fp16 operands), with one alignment's slack per carved tensor: with cuBLAS on an fp16 copy of h; with
    the direct dW kernel (no copy)."""
    def parts(tc, vc):
        return 4 * _parts_floats(tc, vc, tile) + _ALIGN

    def need_w(tc, vc):  # dZ, dW32, h16, tile statistics
        return tc * vc * ge + vc * H * 4 + (tc * H * ge if convert else 0) + parts(tc, vc) + 3 * _ALIGN

    def need_direct(tc, vc):  # dZ, dW32, tile statistics
        return tc * vc * ge + vc * H * 4 + parts(tc, vc) + 3 * _ALIGN

    return need_w, need_direct


class _WeightPass:
    """Pass W over one head's inputs, once the per-token lse and coefficients (a, b, c) are known."""

    def __init__(self, head: Head, coef: Coefficients):
        self.head, self.coef = head, coef
        self.ops = backward_operands(head, coef)
        self.convert = self.ops.dtype != head.hidden.dtype
        self.tile = head.kmod.tile_vocab(head.hidden)
        self.need_w, self.need_direct = _needs(head.hidden.shape[1], self.ops.dtype.itemsize, self.convert, self.tile)

    def dz_tile(self, arena, t0, t1, v0, v1, tc, vc):
        """dZ for tokens [t0, t1) x vocab rows [v0, v1), scaled by dz_scale, in a [rows, v1 - v0] arena tensor."""
        head = self.head
        dz = arena.take((t1 - t0, v1 - v0), self.ops.dtype)
        parts = arena.take((_parts_floats(tc, vc, self.tile),), torch.float32)
        tgt = head.tgt[t0:t1] - v0
        tiles = head.kmod.logits_tiles(head.hidden[t0:t1], head.weight[v0:v1], tgt, head.inv_temp, False, dz,
                                       parts=parts, merge=False, softcap=head.softcap)
        coef = self.coef.rows(t0, t1)
        head.kmod.dlogits_from_tiles(dz, tiles, tgt, coef.lse * LOG2E, coef, head.inv_temp, self.ops.dz_scale,
                                     softcap=head.softcap)
        return dz

    def run(self, dW):
        """Vocab-outer: dW chunk by chunk from row 0, each summed over token chunks in fp32; scratch: dW's rows
        after the chunk (not yet written), then the tail buffer."""
        h = self.head.hidden
        T, H = h.shape
        V = self.head.weight.shape[0]
        row_bytes = H * dW.element_size()
        inv = 1.0 / (self.ops.dz_scale * self.ops.h_scale)
        tail = None
        plan = plan_vocab_pass(V, T, row_bytes, self.need_w, self.need_direct if self.convert else None)
        for v0, v1, Tc, own, direct in plan:
            if own:
                region = _bytes_of(dW, v1)
            else:
                if tail is None:
                    tail = torch.empty((self.need_direct if self.convert else self.need_w)(*tail_chunks(T, V)),
                                       dtype=torch.uint8, device=h.device)
                region = tail
            for t0 in range(0, T, Tc):
                t1 = min(t0 + Tc, T)
                arena = _Arena(region)
                dW32 = arena.take((v1 - v0, H), torch.float32)
                if direct:  # h read as it is, converted in registers
                    dz = self.dz_tile(arena, t0, t1, v0, v1, Tc, v1 - v0)
                    self.head.kmod.dw_acc(dW32, dz, h[t0:t1], self.ops.h_scale, first=(t0 == 0))
                    continue
                h_g = h[t0:t1]
                if self.convert:
                    h_g = torch.mul(h_g, self.ops.h_scale, out=arena.take((t1 - t0, H), self.ops.dtype))
                dz = self.dz_tile(arena, t0, t1, v0, v1, Tc, v1 - v0)
                gemm_acc(dW32, dz.T, h_g, first=(t0 == 0))
            dW[v0:v1].copy_(dW32.mul_(inv))


def _zero_grads(hidden_TH, weight_VH, need_h: bool, need_w: bool):
    return (torch.zeros_like(hidden_TH) if need_h else None), (torch.zeros_like(weight_VH) if need_w else None)


@dataclass(frozen=True)
class GroupShape:
    """What sizes pass 1's scratch for a token group: V (the tile weights' row width: the vocabulary, padded where
    the dH GEMM pads it), H, the bytes of a tile weight (e_bytes), the tile width,
    whether dH is wanted, and w_rows of W in fp16 for the dH GEMM (0: W is used as it is)."""

    V: int
    H: int
    e_bytes: int
    tile: int
    need_h: bool
    w_rows: int

    def need(self, tc: int) -> int:
        """Scratch bytes of a group of tc tokens: its tile weights [tc, V] (dZ is written over them), their
        statistics and, with dH, the group's fp32 dH and w_rows of W in fp16."""
        need = tc * self.V * self.e_bytes + 4 * _parts_floats(tc, self.V, self.tile) + 4 * _ALIGN
        if self.need_h:
            need += tc * self.H * 4 + self.w_rows * self.H * 2
        return need

    def tokens(self, budget: int, T: int, want: int | None) -> int:
        """The largest group, up to `want` (default GROUP_TOKENS) and in multiples of GRAIN when it is that large,
        whose scratch fits budget bytes (the need is affine in the group's tokens); 1 if none does."""
        tc = min(T, int(want) if want else GROUP_TOKENS)
        fixed = self.need(0)
        fit = max(0, budget - fixed) // (self.need(1) - fixed)
        if fit < tc:
            tc = fit // GRAIN * GRAIN if fit >= GRAIN else fit
        return max(1, tc)


def lean_run(head: Head, token_loss: TokenLoss, with_entropy: bool, chunk_tokens, need_h: bool, need_w: bool):
    """Pass 1 and pass W (module docstring). Returns what fused_run does: (Totals, dH or None, dW or None)."""
    hidden_TH, weight_VH = head.hidden, head.weight
    T, H = hidden_TH.shape
    V = weight_VH.shape[0]
    dev = hidden_TH.device
    f32 = dict(dtype=torch.float32, device=dev)
    totals = Totals.empty(T, with_entropy, dev)
    a_T, c_T = torch.empty(T, **f32), torch.empty(T, **f32)
    b_T = None
    if T == 0:
        return (totals,) + _zero_grads(hidden_TH, weight_VH, need_h, need_w)
    in_dtype = hidden_TH.dtype
    if hidden_TH.element_size() != 2 and in_dtype != torch.float32:  # fp64 and the like: the kernels run in fp32
        hidden_TH, weight_VH = hidden_TH.float(), weight_VH.float()
        head = replace(head, hidden=hidden_TH, weight=weight_VH)
    dH = torch.empty_like(hidden_TH) if need_h else None
    dW = torch.empty_like(weight_VH) if need_w else None
    half = hidden_TH.element_size() == 2
    e_dtype = torch.float16 if half else torch.float32
    convert = half and weight_VH.dtype != torch.float16  # bf16 W: fp16 chunks for the dH GEMM
    one = torch.ones((), **f32)
    w_scale = pow2_scale(amax(weight_VH)) if convert else one
    tile = head.kmod.tile_vocab(hidden_TH)
    # with fp16 chunks of W, the dH GEMM's vocabulary extent is padded to Vp (zero columns of e past V against zero
    # rows of the chunk: numerics.aligned_width), e's rows Vp apart
    Vp = aligned_width(V, tile) if convert else V
    shape = GroupShape(Vp, H, e_dtype.itemsize, tile, need_h, min(Vp, GROUP_DH_VOCAB) if convert and need_h else 0)
    region = _bytes_of(dW) if dW is not None else None
    Tg = shape.tokens(region.numel() if region is not None else 0, T, chunk_tokens)
    if region is None or shape.need(Tg) > region.numel():  # a buffer of its own: EXTERNAL_BYTES of tokens
        shape = GroupShape(Vp, H, e_dtype.itemsize, tile, need_h,
                           min(Vp, EXTERNAL_DH_VOCAB) if convert and need_h else 0)
        Tg = shape.tokens(EXTERNAL_BYTES + shape.need(0), T, chunk_tokens)
        region = torch.empty(shape.need(Tg), dtype=torch.uint8, device=dev)
    w_rows = shape.w_rows
    for g0 in range(0, T, Tg):
        g1 = min(g0 + Tg, T)
        arena = _Arena(region)
        e = arena.take((g1 - g0, Vp), e_dtype)  # the logits GEMM writes its columns past V as zeros
        parts = arena.take((_parts_floats(g1 - g0, Vp, tile),), torch.float32)
        tiles, coef = group_statistics(head, g0, g1, with_entropy, token_loss, e, totals, parts=parts)
        a_T[g0:g1].copy_(coef.a)
        c_T[g0:g1].copy_(coef.c)
        if coef.b is not None:
            if b_T is None:
                b_T = torch.zeros(T, **f32)
            b_T[g0:g1].copy_(coef.b)
        if not need_h:
            continue
        scale = dz_scale(coef, head.inv_temp) if half else one
        head.kmod.dlogits_from_tiles(e, tiles, head.tgt[g0:g1], tiles.lse2, coef, head.inv_temp, scale,
                                     softcap=head.softcap)
        dH32 = arena.take((g1 - g0, H), torch.float32)
        if convert:  # fp32 C across the chunks of W: no 16-bit partial sums; the scales come off once, on device
            w16 = arena.take((w_rows, H), torch.float16)
            for v0 in range(0, Vp, w_rows):
                v1 = min(v0 + w_rows, Vp)
                vr = min(v1, V)  # W's rows in this chunk; those after them are the padding's zeros
                w_c = w16[: v1 - v0]
                torch.mul(weight_VH[v0:vr], w_scale, out=w_c[: vr - v0])
                w_c[vr - v0:].zero_()
                gemm_acc(dH32, e[:, v0:v1], w_c, first=(v0 == 0))
        else:
            gemm_acc(dH32, e, weight_VH, first=True)
        dH32.div_(scale * w_scale)
        if head.tp_group is not None:
            dist.all_reduce(dH32, group=head.tp_group)  # hidden is replicated over the group: sum the partials
        dH[g0:g1].copy_(dH32)
    if need_w:
        _WeightPass(head, Coefficients(totals.lse, a_T, b_T, c_T)).run(dW)
    if in_dtype != hidden_TH.dtype:
        dH, dW = (None if g is None else g.to(in_dtype) for g in (dH, dW))
    return totals, dH, dW
