"""The logits GEMM with the statistics in its epilogue, with the switches the library dropped, for
bench/sweep_logits_tiles.py and bench/sass_logits_tiles.py to A/B against: logits_tiles(config=, tma=, subtile=,
warp_specialize=, e_tma=) and logits_tiles.last_kernel (registers and spills). Measured slower than or equal to the
library's choice on an H200 (docs/kernels.md); kernels/lm_head/triton_backend.py holds the kernel the head runs.
Returns the 5-tuple (m2, lse2, ent, tz, tile width) the sweep reads; the merge, target logits and dZ pass are the
library's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lm_head.numerics import E_LOG2 as _E_LOG2, LOG2E, PARTS_PER_TILE
from kernels.lm_head.triton_backend import (  # the shared pieces: only the GEMM kernels differ here
    _dot_fp32, _even_k, _logits_tile, _num_sms, _store_weights, _tile_config, _tile_x2, _token_rows, _use_tma,
    merge_tiles, target_logits)


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

