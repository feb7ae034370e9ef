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

With the loss handed over (lean_eager_run: linear_cross_entropy mean/sum and linear_policy_loss with impl="lean"),
the forward's statistics and pass H are one pass in token groups, the eager path's, in dW's storage: four GEMMs.
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


class _Passes:
    """The two passes over one head's inputs, once the per-token lse and coefficients (a, b, c) are known."""

    def __init__(self, hidden_TH, weight_VH, tgt_T, lse_T, a_T, b_T, c_T, inv_temp: float, kmod, tp_group):
        self.h, self.w, self.tgt, self.lse, self.a, self.b, self.c = hidden_TH, weight_VH, tgt_T, lse_T, a_T, b_T, c_T
        self.inv_temp, self.kmod, self.tp_group = inv_temp, kmod, tp_group
        self.gemm_dtype, self.dz_scale, self.h_scale, self.w_scale = _lh._backward_operands(
            hidden_TH, weight_VH, lse_T, a_T, b_T, c_T, inv_temp)
        self.convert = self.gemm_dtype != hidden_TH.dtype
        self.tile = kmod.tile_vocab(hidden_TH)
        self.need_h, self.need_w, self.need_direct = _needs(hidden_TH.shape[1], self.gemm_dtype.itemsize,
                                                            self.convert, self.tile)

    def dz_tile(self, arena, t0, t1, v0, v1, tc, vc):
        """dZ for tokens [t0, t1) x vocab rows [v0, v1), scaled by dz_scale, in a [rows, v1 - v0] arena tensor."""
        dz = arena.take((t1 - t0, v1 - v0), self.gemm_dtype)
        parts = arena.take((_parts_floats(tc, vc, self.tile),), torch.float32)
        tgt = self.tgt[t0:t1] - v0
        m2, _, _, _, tile_v = self.kmod.logits_tiles(self.h[t0:t1], self.w[v0:v1], tgt, self.inv_temp, False, dz,
                                                     parts=parts, merge=False)
        b = self.a if self.b is None else self.b  # (not read without b)
        self.kmod.dlogits_from_tiles(dz, m2, tile_v, tgt, self.lse[t0:t1] * LOG2E, self.a[t0:t1], b[t0:t1],
                                     self.c[t0:t1], self.inv_temp, self.dz_scale, self.b is not None)
        return dz

    def pass_h(self, dH, region):
        """Token-outer: dH chunk by chunk, each summed over vocab chunks in fp32; scratch: the byte region (dW's
        storage while it is unwritten), or, when it is None or too small, a buffer of its own of at most
        EXTERNAL_BYTES (the smallest chunks if even those do not fit)."""
        T, H = self.h.shape
        V = self.w.shape[0]
        sizes = fit_chunks(region.numel(), self.need_h, T, V, PASS_H_CHUNKS) if region is not None else None
        if sizes is None:
            sizes = fit_chunks(EXTERNAL_BYTES, self.need_h, T, V, PASS_H_CHUNKS) or (min(T, GRAIN), min(V, GRAIN))
            region = torch.empty(self.need_h(*sizes), dtype=torch.uint8, device=self.h.device)
        Tc, Vc = sizes
        inv = 1.0 / (self.dz_scale * self.w_scale)
        for t0 in range(0, T, Tc):
            t1 = min(t0 + Tc, T)
            for v0 in range(0, V, Vc):
                v1 = min(v0 + Vc, V)
                arena = _Arena(region)
                dH32 = arena.take((Tc, H), torch.float32)[: t1 - t0]
                w_g = self.w[v0:v1]
                if self.convert:
                    w_g = torch.mul(w_g, self.w_scale, out=arena.take((v1 - v0, H), self.gemm_dtype))
                dz = self.dz_tile(arena, t0, t1, v0, v1, Tc, Vc)
                _lh._gemm_acc(dH32, dz, w_g, first=(v0 == 0))
            dH32.mul_(inv)
            if self.tp_group is not None:
                dist.all_reduce(dH32, group=self.tp_group)  # hidden is replicated over the group: sum the partials
            dH[t0:t1].copy_(dH32)

    def pass_w(self, dW):
        """Vocab-outer: dW chunk by chunk from row 0, each summed over token chunks in fp32; scratch: dW's rows
        after the chunk (not yet written), then the tail buffer."""
        T, H = self.h.shape
        V = self.w.shape[0]
        row_bytes = H * dW.element_size()
        inv = 1.0 / (self.dz_scale * self.h_scale)
        tail = None
        plan = plan_vocab_pass(V, T, row_bytes, self.need_w, self.need_direct if self.convert else None)
        for v0, v1, Tc, own, direct in plan:
            if own:
                region = _bytes_of(dW, v1)
            else:
                if tail is None:
                    tail = torch.empty((self.need_direct if self.convert else self.need_w)(*tail_chunks(T, V)),
                                       dtype=torch.uint8, device=self.h.device)
                region = tail
            for t0 in range(0, T, Tc):
                t1 = min(t0 + Tc, T)
                arena = _Arena(region)
                dW32 = arena.take((v1 - v0, H), torch.float32)
                if direct:  # h read as it is, converted in registers
                    dz = self.dz_tile(arena, t0, t1, v0, v1, Tc, v1 - v0)
                    self.kmod.dw_acc(dW32, dz, self.h[t0:t1], self.h_scale, first=(t0 == 0))
                    continue
                h_g = self.h[t0:t1]
                if self.convert:
                    h_g = torch.mul(h_g, self.h_scale, out=arena.take((t1 - t0, H), self.gemm_dtype))
                dz = self.dz_tile(arena, t0, t1, v0, v1, Tc, v1 - v0)
                _lh._gemm_acc(dW32, dz.T, h_g, first=(t0 == 0))
            dW[v0:v1].copy_(dW32.mul_(inv))


def _zero_grads(hidden_TH, weight_VH, need_h: bool, need_w: bool):
    return (torch.zeros_like(hidden_TH) if need_h else None), (torch.zeros_like(weight_VH) if need_w else None)


def lean_backward(hidden_TH, weight_VH, tgt_T, lse_T, a_T, b_T, c_T, inv_temp: float, backend: str,
                  need_h: bool, need_w: bool, tp_group):
    """(dH [T, H] or None, dW [V, H] or None) in the inputs' dtypes; see the module docstring. b_T None: b = 0."""
    T = hidden_TH.shape[0]
    if T == 0 or not (need_h or need_w):
        return _zero_grads(hidden_TH, weight_VH, need_h, need_w)
    passes = _Passes(hidden_TH, weight_VH, tgt_T, lse_T, a_T, b_T, c_T, inv_temp, _lh._backend_module(backend),
                     tp_group)
    dH = torch.empty_like(hidden_TH) if need_h else None
    dW = torch.empty_like(weight_VH) if need_w else None
    if need_h:  # pass H first, in dW's storage while it is unwritten (else a buffer of its own)
        passes.pass_h(dH, _bytes_of(dW) if need_w else None)
    if need_w:
        passes.pass_w(dW)
    return dH, dW


GROUP_DH_VOCAB = 32768  # vocab rows of W converted to fp16 at a time for a group's dH GEMM (128 MiB at H = 2048)
EXTERNAL_DH_VOCAB = 8192  # the same with no dW storage to borrow (a frozen head): 32 MiB beside EXTERNAL_BYTES


def _group_need(tc: int, V: int, H: int, e_bytes: int, tile: int, need_h: bool, w_rows: int) -> int:
    """Scratch bytes of one token group of lean_eager_run's first pass: its tile weights [tc, V] (dZ is written over
    them), their statistics and, with dH, the group's fp32 dH and w_rows of W in fp16 (0: W is used as it is)."""
    need = tc * V * e_bytes + 4 * _parts_floats(tc, V, tile) + 4 * _ALIGN
    if need_h:
        need += tc * H * 4 + w_rows * H * 2
    return need


def _group_tokens(budget: int, T: int, V: int, H: int, e_bytes: int, tile: int, need_h: bool, w_rows: int,
                  want: int | None) -> int:
    """The largest group, up to `want` (default EAGER_GROUP_TOKENS) and in multiples of GRAIN when it is that large,
    whose scratch fits budget bytes (the need is affine in the group's tokens); 1 if none does."""
    from kernels.lm_head_eager import EAGER_GROUP_TOKENS

    tc = min(T, int(want) if want else EAGER_GROUP_TOKENS)
    fixed = _group_need(0, V, H, e_bytes, tile, need_h, w_rows)
    fit = max(0, budget - fixed) // (_group_need(1, V, H, e_bytes, tile, need_h, w_rows) - fixed)
    if fit < tc:
        tc = fit // GRAIN * GRAIN if fit >= GRAIN else fit
    return max(1, tc)


def lean_eager_run(hidden_TH, weight_VH, tgt_T, token_loss, inv_temp: float, with_entropy: bool, tp_group,
                   backend: str, chunk_tokens, need_h: bool, need_w: bool):
    """The lean head with the loss handed to it (docs/kernels.md, "Four GEMMs when the loss is known"): a first
    pass in token groups is the eager path's (the logits GEMM with its tile statistics, the loss's coefficients,
    dZ, and dH = dZ W summed over the vocabulary in fp32), its scratch in dW's storage, not yet written; then pass W
    as in lean_backward. Four logits-sized GEMMs; nothing beside dH and dW but [T] vectors and the tail buffer.
    Returns what kernels/lm_head_eager.py's eager_run does: (loss, tz, lse, ent, dH or None, dW or None).

    The fp16 copy of W that the eager path's dH GEMM reads would not fit, so W is converted GROUP_DH_VOCAB rows at a
    time and the group's dH32 accumulates over those chunks (cuBLAS's fp32 C): the same fp16 operands, so the same
    errors as the eager path."""
    from kernels.lm_head_eager import group_statistics

    T, H = hidden_TH.shape
    V = weight_VH.shape[0]
    dev = hidden_TH.device
    f32 = dict(dtype=torch.float32, device=dev)
    tz_T, lse_T, a_T, c_T = (torch.empty(T, **f32) for _ in range(4))
    ent_T = (torch.empty if with_entropy else torch.zeros)(T, **f32)
    b_T = None
    loss = torch.zeros((), **f32)
    if T == 0:
        return (loss, tz_T, lse_T, ent_T) + _zero_grads(hidden_TH, weight_VH, need_h, need_w)
    in_dtype = hidden_TH.dtype
    if hidden_TH.element_size() != 2 and in_dtype != torch.float32:  # fp64 and the like: the kernels run in fp32
        hidden_TH, weight_VH = hidden_TH.float(), weight_VH.float()
    kmod = _lh._backend_module(backend)
    dH = torch.empty_like(hidden_TH) if need_h else None
    dW = torch.empty_like(weight_VH) if need_w else None
    half = hidden_TH.element_size() == 2
    e_dtype = torch.float16 if half else torch.float32
    convert = half and weight_VH.dtype != torch.float16  # bf16 W: fp16 chunks for the dH GEMM
    one = torch.ones((), **f32)
    w_scale = _lh._pow2_scale(_lh._amax(weight_VH)) if convert else one
    tile = kmod.tile_vocab(hidden_TH)
    w_rows = min(V, GROUP_DH_VOCAB) if convert and need_h else 0
    sizes = (V, H, e_dtype.itemsize, tile, need_h, w_rows)
    region = _bytes_of(dW) if dW is not None else None
    Tg = _group_tokens(region.numel() if region is not None else 0, T, *sizes, chunk_tokens)
    if region is None or _group_need(Tg, *sizes) > region.numel():  # a buffer of its own: EXTERNAL_BYTES of tokens
        w_rows = min(V, EXTERNAL_DH_VOCAB) if convert and need_h else 0
        sizes = sizes[:-1] + (w_rows,)
        Tg = _group_tokens(EXTERNAL_BYTES + _group_need(0, *sizes), T, *sizes, chunk_tokens)
        region = torch.empty(_group_need(Tg, *sizes), dtype=torch.uint8, device=dev)
    for g0 in range(0, T, Tg):
        g1 = min(g0 + Tg, T)
        arena = _Arena(region)
        e = arena.take((g1 - g0, V), e_dtype)
        parts = arena.take((_parts_floats(g1 - g0, V, tile),), torch.float32)
        m2, lse2, tile_v, a, b, c = group_statistics(kmod, hidden_TH, weight_VH, tgt_T, g0, g1, inv_temp,
                                                     with_entropy, tp_group, token_loss, e, tz_T, lse_T, ent_T,
                                                     loss, parts=parts)
        a_T[g0:g1].copy_(a)
        c_T[g0:g1].copy_(c)
        if b is not None:
            if b_T is None:
                b_T = torch.zeros(T, **f32)
            b_T[g0:g1].copy_(b)
        if not need_h:
            continue
        scale = _lh._dz_scale(lse_T[g0:g1], a, b, c, inv_temp) if half else one
        kmod.dlogits_from_tiles(e, m2, tile_v, tgt_T[g0:g1], lse2, a, a if b is None else b, c, inv_temp, scale,
                                b is not None)
        dH32 = arena.take((g1 - g0, H), torch.float32)
        if convert:  # fp32 C across the chunks of W: no 16-bit partial sums; the scales come off once, on device
            w16 = arena.take((w_rows, H), torch.float16)
            for v0 in range(0, V, w_rows):
                v1 = min(v0 + w_rows, V)
                w_c = torch.mul(weight_VH[v0:v1], w_scale, out=w16[: v1 - v0])
                _lh._gemm_acc(dH32, e[:, v0:v1], w_c, first=(v0 == 0))
        else:
            _lh._gemm_acc(dH32, e, weight_VH, first=True)
        dH32.div_(scale * w_scale)
        if tp_group is not None:
            dist.all_reduce(dH32, group=tp_group)  # hidden is replicated over the group: sum the partials
        dH[g0:g1].copy_(dH32)
    if need_w:
        _Passes(hidden_TH, weight_VH, tgt_T, lse_T, a_T, b_T, c_T, inv_temp, kmod, tp_group).pass_w(dW)
    if in_dtype != hidden_TH.dtype:
        dH, dW = (None if g is None else g.to(in_dtype) for g in (dH, dW))
    return loss, tz_T, lse_T, ent_T, dH, dW
