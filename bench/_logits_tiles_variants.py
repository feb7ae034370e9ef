"""The logits GEMM with the statistics in its epilogue, with the switches the library dropped, for
bench/sweep_logits_tiles.py and bench/sass_logits_tiles.py to A/B against: logits_tiles(config=, tma=, subtile=,
warp_specialize=, e_tma=) and logits_tiles.last_kernel (registers and spills). Measured slower than or equal to the
library's choice on an H200 (docs/kernels.md); kernels/lm_head/triton_backend.py holds the kernel the head runs.
Returns the 5-tuple (m2, lse2, ent, tz, tile width) the sweep reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lm_head.numerics import E_LOG2 as _E_LOG2, LOG2E, PARTS_PER_TILE
from kernels.lm_head.tiles import DZ_TILES, MERGE_TILES, TARGET_TILES, logits_tile_config
from kernels.lm_head.triton_backend import (
    _ARCH, _VENDOR, _dot_fp32, _even_k, _logits_tile, _num_sms, _token_rows)


# Columns past V get this bias in log2 units: their weights are exp2(-1e30) = 0 and e * y stays 0 (a finite
# bias, so no 0 * inf = NaN in the entropy sum); any real logit is far inside it.
_PAST_V = tl.constexpr(-1e30)
E_LOG2 = tl.constexpr(_E_LOG2)  # the weights are stored times 2^14 (see _tile_epilogue)


@triton.heuristics({"EVEN_K": _even_k})
@triton.jit
def _logits_tiles_kernel(
    h_ptr, w_ptr, e_ptr, m2_ptr, lse2_ptr, ent_ptr,
    T, V, H, stride_h, stride_w, stride_e, k2,
    WRITE_E: tl.constexpr, WITH_ENTROPY: tl.constexpr, DOT_FP32: tl.constexpr, EVEN_K: tl.constexpr,
    SUBTILE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_T, BLOCK_V] logits tile per program, acc = h . w in fp32 registers, then per row of the tile: its
    max and the lse of the tile's own softmax (both in log2 units, x2 = acc k2, k2 = log2 e / temperature) and its
    entropy, stored at [tile, row] ([num_tiles, T] arrays, merged like vocab splits); and, if WRITE_E, the tile's
    weights 2^14 e, e = exp(x - tile max) in (0, 1], in e's dtype (fp16 keeps 11 significant bits at any
    magnitude: unlike x itself, whose fp16 rounding would grow with |x|). The target logit is not here: one gather
    dot per token (_target_logit_kernel) costs T H instead of a compare on every one of the T V logits. The token
    blocks of one vocab tile are adjacent program ids: the weight tile comes from HBM once and the [T, H] hidden
    block (16 MiB at T = 4096) stays in L2. (The persistent TMA variant below is what Hopper runs.)"""
    pid = tl.program_id(0)
    num_t = tl.cdiv(T, BLOCK_T)
    pid_v = pid // num_t
    pid_t = pid % num_t
    offs_t, t_mask, rows = _token_rows(pid_t, T, BLOCK_T)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    acc = _logits_tile(h_ptr, w_ptr, rows, offs_v, V, H, stride_h, stride_w, DOT_FP32, EVEN_K, BLOCK_T, BLOCK_V,
                       BLOCK_K)
    _tile_epilogue(acc, pid_v, 0, offs_t, t_mask, T, V, e_ptr, stride_e, m2_ptr, lse2_ptr, ent_ptr, k2, WRITE_E,
                   False, WITH_ENTROPY, SUBTILE, BLOCK_V)


@triton.jit
def _tile_x2(acc, offs_v, V, k2):
    """x2 = x log2 e for one column block of a tile, columns past V pushed to _PAST_V (one FMA an element: the bias
    is a per-column vector)."""
    return acc * k2 + tl.where(offs_v < V, 0.0, _PAST_V)[None, :]


@triton.jit
def _store_weights(e_ptr, offs_t, t_mask, offs_v, V, stride_e, e):
    tl.store(e_ptr + offs_t[:, None] * stride_e + offs_v[None, :], e.to(e_ptr.dtype.element_ty),
             mask=t_mask[:, None] & (offs_v < V)[None, :])


@triton.jit
def _tile_epilogue(acc, pid_v, t0, offs_t, t_mask, T, V, e_ptr, stride_e, m2_ptr, lse2_ptr, ent_ptr, k2,
                   WRITE_E: tl.constexpr, E_TMA: tl.constexpr, WITH_ENTROPY: tl.constexpr, SUBTILE: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    """Per row of the [BLOCK_T, BLOCK_V] tile: max m2 and lse2 of the tile's softmax (log2 units, x2 = acc k2),
    its entropy; 2^14 e = 2^(x2 - m2 + 14) stored when WRITE_E (in (0, 2^14]: fp16 keeps full precision down to
    e = 2^-28, as far below the tile's max as the scaled dZ keeps below the group's). The 2^14 is folded into the
    exponent (x2 - (m2 - 14)), and the sums are taken of the scaled weights (s' = 2^14 s, wy' = 2^14 wy): per element
    one FMA (x2), one max, one subtraction, one exp2, one add (s') and half a conversion to fp16 (docs/kernels.md).
    SUBTILE: the tile is taken in two column halves, so the exp tile beside the accumulator is half as large
    (fewer live registers). E_TMA: e_ptr is a TMA descriptor of e (fp16) and the weights leave through TMA stores
    from row t0 (rows past T and columns past V are clipped by the copy engine)."""
    if SUBTILE:
        acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, [acc.shape[0], 2, BLOCK_V // 2]), [0, 2, 1]))
        offs_v0 = pid_v * BLOCK_V + tl.arange(0, BLOCK_V // 2)
        offs_v1 = offs_v0 + BLOCK_V // 2
        x2_0 = _tile_x2(acc0, offs_v0, V, k2)
        x2_1 = _tile_x2(acc1, offs_v1, V, k2)
        m2 = tl.maximum(tl.max(x2_0, 1), tl.max(x2_1, 1))
        e0 = tl.exp2(x2_0 - (m2 - E_LOG2)[:, None])
        e1 = tl.exp2(x2_1 - (m2 - E_LOG2)[:, None])
        s = tl.sum(e0, 1) + tl.sum(e1, 1)
        if WITH_ENTROPY:
            wy = tl.sum(e0 * (x2_0 - m2[:, None]), 1) + tl.sum(e1 * (x2_1 - m2[:, None]), 1)
        if WRITE_E:
            if E_TMA:
                e_ptr.store([t0, pid_v * BLOCK_V], e0.to(tl.float16))
                e_ptr.store([t0, pid_v * BLOCK_V + BLOCK_V // 2], e1.to(tl.float16))
            else:
                _store_weights(e_ptr, offs_t, t_mask, offs_v0, V, stride_e, e0)
                _store_weights(e_ptr, offs_t, t_mask, offs_v1, V, stride_e, e1)
    else:
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        x2 = _tile_x2(acc, offs_v, V, k2)
        m2 = tl.max(x2, 1)  # a real logit: every tile holds at least one column < V
        e = tl.exp2(x2 - (m2 - E_LOG2)[:, None])
        s = tl.sum(e, 1)  # >= 2^14 (the max itself)
        if WITH_ENTROPY:
            wy = tl.sum(e * (x2 - m2[:, None]), 1)
        if WRITE_E:
            if E_TMA:
                e_ptr.store([t0, pid_v * BLOCK_V], e.to(tl.float16))
            else:
                _store_weights(e_ptr, offs_t, t_mask, offs_v, V, stride_e, e)
    out = pid_v.to(tl.int64) * T + offs_t
    log2_s = tl.log2(s)  # log2 s' = log2 s + 14
    tl.store(m2_ptr + out, m2, mask=t_mask)
    tl.store(lse2_ptr + out, m2 + log2_s - E_LOG2, mask=t_mask)
    if WITH_ENTROPY:  # ln s - ln 2 sum e y / s, with s = s' 2^-14 and wy / s = wy' / s'
        tl.store(ent_ptr + out, (log2_s - E_LOG2 - wy / s) * 0.6931471805599453, mask=t_mask)


@triton.jit
def _logits_tiles_tma_kernel(
    h_desc, w_desc, e_ptr, m2_ptr, lse2_ptr, ent_ptr,
    T, V, H, stride_e, k2, NUM_PROGRAMS,
    WRITE_E: tl.constexpr, E_TMA: tl.constexpr, WITH_ENTROPY: tl.constexpr, SUBTILE: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """_logits_tiles_kernel for Hopper: persistent (one program per SM walks tiles NUM_PROGRAMS apart, the token
    blocks of a vocab tile consecutive), operands through TMA descriptors (no address arithmetic or load
    registers; rows past T or V read as zeros). The tile loop and the K loop are one flattened loop, so the next
    tile's loads are in flight during this tile's epilogue."""
    pid = tl.program_id(0)
    num_t = tl.cdiv(T, BLOCK_T)
    num_tiles = num_t * tl.cdiv(V, BLOCK_V)
    for tile in tl.range(pid, num_tiles, NUM_PROGRAMS, flatten=True, warp_specialize=WARP_SPECIALIZE):
        pid_v = tile // num_t
        pid_t = tile % num_t
        acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            a = h_desc.load([pid_t * BLOCK_T, k0])
            b = w_desc.load([pid_v * BLOCK_V, k0])
            acc = tl.dot(a, b.T, acc)
        offs_t, t_mask, _ = _token_rows(pid_t, T, BLOCK_T)
        _tile_epilogue(acc, pid_v, pid_t * BLOCK_T, offs_t, t_mask, T, V, e_ptr, stride_e, m2_ptr, lse2_ptr, ent_ptr,
                       k2, WRITE_E, E_TMA, WITH_ENTROPY, SUBTILE, BLOCK_V)


@triton.jit
def _target_logit_kernel(h_ptr, w_ptr, tgt_ptr, out_ptr, T, V, H, stride_h, stride_w, inv_temp,
                         BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """tz = (h . w[target]) / temperature per token, fp32 accumulation (0 where the target is not a row of this
    weight: ignored, or on another rank)."""
    pid = tl.program_id(0)
    offs_t, t_mask, rows = _token_rows(pid, T, BLOCK_T)
    tgt = tl.load(tgt_ptr + rows)
    hit = t_mask & (tgt >= 0) & (tgt < V)
    w_rows = w_ptr + tl.where(hit, tgt, 0).to(tl.int64)[:, None] * stride_w
    h_rows = h_ptr + rows[:, None] * stride_h
    acc = tl.zeros([BLOCK_T], tl.float32)
    for k0 in range(0, H, BLOCK_H):
        kk = k0 + tl.arange(0, BLOCK_H)
        k_mask = (kk < H)[None, :]
        a = tl.load(h_rows + kk[None, :], mask=k_mask, other=0.0).to(tl.float32)
        b = tl.load(w_rows + kk[None, :], mask=k_mask & hit[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(a * b, 1)
    tl.store(out_ptr + offs_t, acc * inv_temp, mask=t_mask)


def target_logits(hidden_TH, weight_VH, tgt_T, inv_temp: float, out=None):
    """tz [T] fp32: each token's logit at its target (0 where the target is outside [0, V))."""
    T, H = hidden_TH.shape
    out = torch.empty(T, dtype=torch.float32, device=hidden_TH.device) if out is None else out
    bt, bh, warps = TARGET_TILES[_VENDOR]
    _target_logit_kernel[(triton.cdiv(T, bt),)](hidden_TH, weight_VH, tgt_T, out, T, weight_VH.shape[0], H,
                                               hidden_TH.stride(0), weight_VH.stride(0), inv_temp,
                                               BLOCK_T=bt, BLOCK_H=bh, num_warps=warps)
    return out


@triton.jit
def _tiles_dz_kernel(
    e_ptr, stride_e, m2_ptr, tgt_ptr, lse2_ptr, a_ptr, b_ptr, c_ptr, scale_ptr, T, V, inv_temp,
    HAS_B: tl.constexpr, TILE_V: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """In place: the tile weights (2^14 e) -> dz = scale * (p (a + b x) + c [v == target]) * inv_temp, with
    p = e * exp2(m2 - lse2) and (only when b is used) x = (m2 + log2 e) ln 2 (m2: the tile's max, log2 units).
    BLOCK_V divides TILE_V, so each program's columns share one tile max per row. Elementwise: each element is
    read and written by one program."""
    pid = tl.program_id(0)
    num_v = tl.cdiv(V, BLOCK_V)
    pid_t = pid // num_v
    pid_v = pid % num_v
    offs_t, t_mask, rows = _token_rows(pid_t, T, BLOCK_T)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = t_mask[:, None] & (offs_v < V)[None, :]
    m2 = tl.load(m2_ptr + ((pid_v * BLOCK_V) // TILE_V).to(tl.int64) * T + rows)
    lse2 = tl.load(lse2_ptr + rows)
    ptrs = e_ptr + offs_t[:, None] * stride_e + offs_v[None, :]
    e = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    p = e * tl.exp2(m2 - lse2 - E_LOG2)[:, None]  # e is stored times 2^14
    coef = tl.load(a_ptr + rows)[:, None]
    if HAS_B:
        x = tl.where(e > 0, (m2[:, None] + tl.log2(e) - E_LOG2) * 0.6931471805599453, 0.0)  # e = 0: p x = 0
        coef = coef + tl.load(b_ptr + rows)[:, None] * x
    dz = p * coef
    tgt = tl.load(tgt_ptr + rows)
    dz += tl.where(offs_v[None, :] == tgt[:, None], tl.load(c_ptr + rows)[:, None], 0.0)
    dz = dz * (inv_temp * tl.load(scale_ptr))
    tl.store(ptrs, dz.to(e_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _merge_tiles_kernel(lse2_ptr, ent_ptr, out_lse2_ptr, out_ent_ptr, T, N,
                        WITH_ENTROPY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """Per row, merge the N tiles' (lse2, entropy) ([N, T] arrays, rows contiguous) like vocab splits, in one pass:
    running max m, S = sum 2^(l - m), A = sum 2^(l - m) ent, B = sum 2^(l - m) (l - m); then lse2 = m + log2 S and,
    with q = 2^(l - lse2) a tile's share, entropy = sum q ent - sum q ln q = A / S - (B / S - log2 S) ln 2."""
    pid = tl.program_id(0)
    offs_t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    S = tl.zeros([BLOCK_T], tl.float32)
    A = tl.zeros([BLOCK_T], tl.float32)
    B = tl.zeros([BLOCK_T], tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask = (offs_n < N)[:, None] & t_mask[None, :]
        idx = offs_n.to(tl.int64)[:, None] * T + offs_t[None, :]
        l = tl.load(lse2_ptr + idx, mask=mask, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(l, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no tile with mass yet: no -inf - -inf
        alpha = tl.exp2(m - m_ref)  # 0 while m = -inf
        w = tl.exp2(l - m_ref[None, :])  # masked or empty tiles: 0
        if WITH_ENTROPY:
            d = tl.where(w > 0, l - m_ref[None, :], 0.0)
            ent = tl.load(ent_ptr + idx, mask=mask, other=0.0)
            B = alpha * (B + tl.where(S > 0, m - m_ref, 0.0) * S) + tl.sum(w * d, 0)
            A = alpha * A + tl.sum(w * ent, 0)
        S = alpha * S + tl.sum(w, 0)
        m = m_new
    log2_s = tl.log2(S)
    tl.store(out_lse2_ptr + offs_t, m + log2_s, mask=t_mask)
    if WITH_ENTROPY:
        tl.store(out_ent_ptr + offs_t, A / S - (B / S - log2_s) * 0.6931471805599453, mask=t_mask)
    else:
        tl.store(out_ent_ptr + offs_t, tl.zeros([BLOCK_T], tl.float32), mask=t_mask)


def merge_tiles(lse2_NT, ent_NT, with_entropy: bool):
    """combine_tiles in one Triton pass: (lse2 [T], entropy [T] or zeros)."""
    N, T = lse2_NT.shape
    out = torch.empty((2, T), dtype=torch.float32, device=lse2_NT.device)
    bn, bt, warps = MERGE_TILES[_VENDOR]
    _merge_tiles_kernel[(triton.cdiv(T, bt),)](lse2_NT, ent_NT, out[0], out[1], T, N, WITH_ENTROPY=with_entropy,
                                              BLOCK_N=bn, BLOCK_T=bt, num_warps=warps)
    return out[0], out[1]


def _use_tma(hidden_TH, weight_VH, dot_fp32: bool) -> bool:
    """TMA descriptors: NVIDIA Hopper or later, 16-bit operands, rows 16-byte aligned (H a multiple of 8)."""
    return (_VENDOR == "nvidia" and _ARCH >= 9 and not dot_fp32 and hidden_TH.shape[1] % 8 == 0
            and hidden_TH.data_ptr() % 16 == 0 and weight_VH.data_ptr() % 16 == 0)


def tile_vocab(hidden_TH) -> int:
    """The vocab width of logits_tiles' tiles for these inputs (its statistics are [T / this] per token)."""
    return _tile_config(hidden_TH).block_v


def _tile_config(hidden_TH):
    return logits_tile_config(_VENDOR, 4 if _dot_fp32(hidden_TH) and _VENDOR != "interpreter" else 2)


def logits_tiles(hidden_TH, weight_VH, tgt_T, inv_temp: float, with_entropy: bool, e_TV=None, config=None,
                 tma=None, subtile=None, warp_specialize=False, e_tma=False, parts=None, merge=True):
    """One logits GEMM with the statistics in its epilogue. Returns (m2 [num_tiles, T] tile maxima and lse2 [T],
    both in log2 units; ent [T] (zeros unless with_entropy), tz [T] (target_logits), tile width); writes the tile
    weights into e_TV (fp16 or fp32, row stride free) when given. config, tma, subtile, warp_specialize, e_tma (the
    weights leave through TMA stores: an fp16 e_TV with 16-byte aligned rows; timed slower): overrides for
    benchmarks. parts: a flat fp32 buffer of at least PARTS_PER_TILE T ceil(V / tile_vocab) elements for the per-tile
    statistics (else allocated). merge=False: no merged row statistics and no target logits (lse2, ent, tz returned
    as None)."""
    T, H = hidden_TH.shape
    V = weight_VH.shape[0]
    dot_fp32 = _dot_fp32(hidden_TH)
    c = config or _tile_config(hidden_TH)
    n_tiles = triton.cdiv(V, c.block_v)
    n_parts = PARTS_PER_TILE * n_tiles * T
    if parts is None:
        parts = torch.empty(n_parts, dtype=torch.float32, device=hidden_TH.device)
    m2_NT, lse2_NT, ent_NT = parts[:n_parts].view(PARTS_PER_TILE, n_tiles, T).unbind(0)
    e_arg = e_TV if e_TV is not None else parts
    grid_tiles = triton.cdiv(T, c.block_t) * n_tiles
    meta = dict(WRITE_E=e_TV is not None, WITH_ENTROPY=with_entropy,
                SUBTILE=c.block_v >= 256 if subtile is None else subtile,  # 128-register accumulators: halves
                BLOCK_T=c.block_t, BLOCK_V=c.block_v, BLOCK_K=c.block_k, num_warps=c.num_warps,
                num_stages=c.num_stages)
    outs = (e_arg, m2_NT, lse2_NT, ent_NT)
    k2 = inv_temp * LOG2E
    if _use_tma(hidden_TH, weight_VH, dot_fp32) if tma is None else tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        h_desc = TensorDescriptor.from_tensor(hidden_TH, [c.block_t, c.block_k])
        w_desc = TensorDescriptor.from_tensor(weight_VH, [c.block_v, c.block_k])
        progs = min(grid_tiles, _num_sms(hidden_TH.device))
        e_tma = e_tma and e_TV is not None and e_TV.dtype == torch.float16 and (e_TV.stride(0) * 2) % 16 == 0
        if e_tma:
            e_desc = TensorDescriptor.from_tensor(e_TV, [c.block_t, c.block_v // 2 if meta["SUBTILE"] else c.block_v])
            outs = (e_desc,) + outs[1:]
        logits_tiles.last_kernel = _logits_tiles_tma_kernel[(progs,)](
            h_desc, w_desc, *outs, T, V, H, e_arg.stride(0), k2, progs,
            E_TMA=e_tma, WARP_SPECIALIZE=warp_specialize, **meta)
    else:
        logits_tiles.last_kernel = _logits_tiles_kernel[(grid_tiles,)](
            hidden_TH, weight_VH, *outs, T, V, H, hidden_TH.stride(0), weight_VH.stride(0), e_arg.stride(0),
            k2, DOT_FP32=dot_fp32, **meta)
    if not merge:  # (the caller wants the weights and the tile maxima only)
        return m2_NT, None, None, None, c.block_v
    lse2_T, ent_T = merge_tiles(lse2_NT, ent_NT, with_entropy)
    return m2_NT, lse2_T, ent_T, target_logits(hidden_TH, weight_VH, tgt_T, inv_temp), c.block_v


logits_tiles.last_kernel = None  # the compiled kernel of the latest call (registers and spills, for benchmarks)


def dlogits_from_tiles(e_TV, m2_NT, tile_v: int, tgt_T, lse2_T, a_T, b_T, c_T, inv_temp: float, scale,
                       has_b: bool = True) -> None:
    """In place over e_TV (logits_tiles' weights): scale * dloss/dlogit."""
    T, V = e_TV.shape
    bt, bv, warps = DZ_TILES[_VENDOR]
    bv = min(bv, tile_v)
    _tiles_dz_kernel[(triton.cdiv(T, bt) * triton.cdiv(V, bv),)](
        e_TV, e_TV.stride(0), m2_NT, tgt_T, lse2_T, a_T, b_T, c_T, scale, T, V, inv_temp,
        HAS_B=has_b, TILE_V=tile_v, BLOCK_T=bt, BLOCK_V=bv, num_warps=warps,
    )
