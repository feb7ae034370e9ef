"""The Triton backend of the LM head: the logits GEMM with the statistics in its epilogue, the merge of its per-tile
statistics, the target logits, the in-place dZ pass over the tile weights, dZ from an fp32 logits chunk, and the
direct dW GEMM of the lean head (docs/kernels.md, "Tile statistics in the GEMM epilogue"). kernels/lm_head/
torch_backend.py holds the same functions in torch. Imported lazily (never at package import), so the CPU path
needs no triton.

Shape legend: T tokens (a group), H hidden size, V vocab rows held by this rank, N = ceil(V / tile width) tiles.
z = h . w_v in fp32 registers; x = z / temperature, or with a soft cap c x = c tanh(z / c) / temperature (the
kernels' SOFTCAP constexpr: off, they compile to the uncapped code); x2 = x log2 e; statistics in log2 units where
named *2. Tile sizes: kernels/lm_head/tiles.py.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.lm_head.numerics import (
    E_LOG2 as _E_LOG2, LOG2E, PARTS_PER_TILE, Coefficients, TileStats, weight_columns)
from kernels.lm_head.tiles import DW_ACC_TILES, DZ_ROWS_TILE, DZ_TILES, MERGE_TILES, TARGET_TILES, logits_tile_config


def _vendor() -> tuple[str, int]:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "interpreter", 0
    if torch.version.hip is not None:
        return "amd", 9
    if torch.cuda.is_available():
        return "nvidia", torch.cuda.get_device_capability()[0]
    return "nvidia", 9


_VENDOR, _ARCH = _vendor()


def _even_k(args) -> bool:
    return args["H"] % args["BLOCK_K"] == 0


@triton.jit
def _mma_step(h_rows, w_rows, kk, H, acc, DOT_FP32: tl.constexpr, EVEN_K: tl.constexpr):
    """acc += h[rows, kk] @ w[rows_v, kk]^T, fp32 accumulation."""
    if EVEN_K:
        a = tl.load(h_rows + kk[None, :])
        b = tl.load(w_rows + kk[None, :])
    else:
        a = tl.load(h_rows + kk[None, :], mask=kk[None, :] < H, other=0.0)
        b = tl.load(w_rows + kk[None, :], mask=kk[None, :] < H, other=0.0)
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(b), acc)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _dot_fp32(t: torch.Tensor) -> bool:
    # fp32 inputs take the exact (ieee) fp32 dot; under the interpreter every dot runs in fp32 (bf16 operands to
    # tl.dot give wrong results there).
    return t.dtype == torch.float32 or _VENDOR == "interpreter"


@triton.jit
def _tanh(z, k):
    """tanh(z / c) in fp32 with k = -2 log2(e) / c: 2 / (1 + exp(-2 z / c)) - 1, an exp2 and a reciprocal (Triton's
    fp32 division), ~1e-7 absolute error; exp2 going to inf or 0 gives -1 or 1. Plain Triton, so the interpreter
    runs it (it cannot run libdevice's tanhf); the (1 - f) / (1 + f) form with f = exp(-2 |z| / c) and the sign put
    back costs 7 instructions a logit more in the logits GEMM's epilogue (SASS, sm_90a) for the same error."""
    return 2.0 / (1.0 + tl.exp2(z * k)) - 1.0


def _softcap_args(softcap, inv_temp: float) -> tuple[float, float]:
    """(k, x per unit of tanh): the runtime floats of the SOFTCAP kernels, x = _tanh(z, k) * c / temperature; no
    cap: (0, 1 / temperature), k unused."""
    if softcap is None:
        return 0.0, inv_temp
    return -2.0 * LOG2E / softcap, softcap * inv_temp


@triton.jit
def _token_rows(pid_t, T, BLOCK_T: tl.constexpr):
    """Token block pid_t: its row indices (int64, so T x stride never overflows), which are < T, and the indices
    clamped to T - 1 (clamped rows load without a mask; their results are never stored)."""
    offs_t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    return offs_t, offs_t < T, tl.minimum(offs_t, T - 1)


@triton.jit
def _logits_tile(h_ptr, w_ptr, rows, offs_v, V, H, stride_h, stride_w, DOT_FP32: tl.constexpr,
                 EVEN_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_T, BLOCK_V] tile h[rows] @ w[offs_v]^T in fp32 over the whole hidden size, by pointer loads
    (vocab rows past V are clamped to V - 1 and must be masked by the caller)."""
    h_rows = h_ptr + rows[:, None] * stride_h
    w_rows = w_ptr + tl.minimum(offs_v, V - 1).to(tl.int64)[:, None] * stride_w
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        acc = _mma_step(h_rows, w_rows, k0 + offs_k, H, acc, DOT_FP32, EVEN_K)
    return acc


# Columns past V get this bias in log2 units: their weights are exp2(-1e30) = 0 and e * y stays 0 (a finite
# bias, so no 0 * inf = NaN in the entropy sum); any real logit is far inside it.
_PAST_V = tl.constexpr(-1e30)
E_LOG2 = tl.constexpr(_E_LOG2)  # the weights are stored times 2^14 (see _tile_epilogue)


@triton.heuristics({"EVEN_K": _even_k})
@triton.jit
def _logits_tiles_kernel(
    h_ptr, w_ptr, e_ptr, m2_ptr, lse2_ptr, ent_ptr,
    T, V, VE, H, stride_h, stride_w, stride_e, k2, cap_k,
    WRITE_E: tl.constexpr, WITH_ENTROPY: tl.constexpr, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr,
    EVEN_K: tl.constexpr, SUBTILE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_T, BLOCK_V] logits tile per program, acc = h . w in fp32 registers, then per row of the tile: its
    max and the lse of the tile's own softmax (both in log2 units, x2 = acc k2, k2 = log2 e / temperature; with
    SOFTCAP x2 = _tanh(acc, cap_k) k2, k2 = c log2 e / temperature) and its entropy, stored at [tile, row]
    ([num_tiles, T] arrays, merged like vocab splits); and, if WRITE_E, the tile's weights 2^14 e,
    e = exp(x - tile max) in (0, 1], in e's dtype (fp16 keeps 11 significant bits at any magnitude: unlike x itself,
    whose fp16 rounding would grow with |x|). The target logit is not here: one gather dot per token
    (_target_logit_kernel) costs T H instead of a compare on every one of the T V logits. The token blocks of one
    vocab tile are adjacent program ids: the weight tile comes from HBM once and the [T, H] hidden block (16 MiB at
    T = 4096) stays in L2. (The persistent TMA variant below is what Hopper runs.)"""
    pid = tl.program_id(0)
    num_t = tl.cdiv(T, BLOCK_T)
    pid_v = pid // num_t
    pid_t = pid % num_t
    offs_t, t_mask, rows = _token_rows(pid_t, T, BLOCK_T)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    acc = _logits_tile(h_ptr, w_ptr, rows, offs_v, V, H, stride_h, stride_w, DOT_FP32, EVEN_K, BLOCK_T, BLOCK_V,
                       BLOCK_K)
    _tile_epilogue(acc, pid_v, offs_t, t_mask, T, V, VE, e_ptr, stride_e, m2_ptr, lse2_ptr, ent_ptr, k2, cap_k,
                   WRITE_E, WITH_ENTROPY, SOFTCAP, SUBTILE, BLOCK_V)


@triton.jit
def _tile_x2(acc, offs_v, V, k2, cap_k, SOFTCAP: tl.constexpr):
    """x2 = x log2 e for one column block of a tile, columns past V pushed to _PAST_V (one FMA an element: the bias
    is a per-column vector); SOFTCAP: of the capped logit, one _tanh an element before it."""
    if SOFTCAP:
        acc = _tanh(acc, cap_k)
    return acc * k2 + tl.where(offs_v < V, 0.0, _PAST_V)[None, :]


@triton.jit
def _store_weights(e_ptr, offs_t, t_mask, offs_v, V, stride_e, e):
    tl.store(e_ptr + offs_t[:, None] * stride_e + offs_v[None, :], e.to(e_ptr.dtype.element_ty),
             mask=t_mask[:, None] & (offs_v < V)[None, :])


@triton.jit
def _tile_epilogue(acc, pid_v, offs_t, t_mask, T, V, VE, e_ptr, stride_e, m2_ptr, lse2_ptr, ent_ptr, k2, cap_k,
                   WRITE_E: tl.constexpr, WITH_ENTROPY: tl.constexpr, SOFTCAP: tl.constexpr, SUBTILE: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    """Per row of the [BLOCK_T, BLOCK_V] tile: max m2 and lse2 of the tile's softmax (log2 units, x2 = acc k2),
    its entropy; 2^14 e = 2^(x2 - m2 + 14) stored when WRITE_E (in (0, 2^14]: fp16 keeps full precision down to
    e = 2^-28, as far below the tile's max as the scaled dZ keeps below the group's). The 2^14 is folded into the
    exponent (x2 - (m2 - 14)), and the sums are taken of the scaled weights (s' = 2^14 s, wy' = 2^14 wy): per element
    one FMA (x2), one max, one subtraction, one exp2, one add (s') and half a conversion to fp16 (docs/kernels.md).
    SUBTILE: the tile is taken in two column halves, so the exp tile beside the accumulator is half as large
    (fewer live registers): what the 256-wide tiles take (kernels/lm_head/tiles.py). The weights are stored for
    the columns below VE >= V: those from V on are 0 (their x2 is _PAST_V), the zero padding of the gradient GEMMs'
    operand (kernels/lm_head/numerics.py: aligned_width), and a VE that is a multiple of 16 lets the stores be
    vectorized where V's own mask would not."""
    if SUBTILE:
        acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, [acc.shape[0], 2, BLOCK_V // 2]), [0, 2, 1]))
        offs_v0 = pid_v * BLOCK_V + tl.arange(0, BLOCK_V // 2)
        offs_v1 = offs_v0 + BLOCK_V // 2
        x2_0 = _tile_x2(acc0, offs_v0, V, k2, cap_k, SOFTCAP)
        x2_1 = _tile_x2(acc1, offs_v1, V, k2, cap_k, SOFTCAP)
        m2 = tl.maximum(tl.max(x2_0, 1), tl.max(x2_1, 1))
        e0 = tl.exp2(x2_0 - (m2 - E_LOG2)[:, None])
        e1 = tl.exp2(x2_1 - (m2 - E_LOG2)[:, None])
        s = tl.sum(e0, 1) + tl.sum(e1, 1)
        if WITH_ENTROPY:
            wy = tl.sum(e0 * (x2_0 - m2[:, None]), 1) + tl.sum(e1 * (x2_1 - m2[:, None]), 1)
        if WRITE_E:
            _store_weights(e_ptr, offs_t, t_mask, offs_v0, VE, stride_e, e0)
            _store_weights(e_ptr, offs_t, t_mask, offs_v1, VE, stride_e, e1)
    else:
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        x2 = _tile_x2(acc, offs_v, V, k2, cap_k, SOFTCAP)
        m2 = tl.max(x2, 1)  # a real logit: every tile holds at least one column < V
        e = tl.exp2(x2 - (m2 - E_LOG2)[:, None])
        s = tl.sum(e, 1)  # >= 2^14 (the max itself)
        if WITH_ENTROPY:
            wy = tl.sum(e * (x2 - m2[:, None]), 1)
        if WRITE_E:
            _store_weights(e_ptr, offs_t, t_mask, offs_v, VE, stride_e, e)
    out = pid_v.to(tl.int64) * T + offs_t
    log2_s = tl.log2(s)  # log2 s' = log2 s + 14
    tl.store(m2_ptr + out, m2, mask=t_mask)
    tl.store(lse2_ptr + out, m2 + log2_s - E_LOG2, mask=t_mask)
    if WITH_ENTROPY:  # ln s - ln 2 sum e y / s, with s = s' 2^-14 and wy / s = wy' / s'
        tl.store(ent_ptr + out, (log2_s - E_LOG2 - wy / s) * 0.6931471805599453, mask=t_mask)


@triton.jit
def _logits_tiles_tma_kernel(
    h_desc, w_desc, e_ptr, m2_ptr, lse2_ptr, ent_ptr,
    T, V, VE, H, stride_e, k2, cap_k, NUM_PROGRAMS,
    WRITE_E: tl.constexpr, WITH_ENTROPY: tl.constexpr, SOFTCAP: tl.constexpr, SUBTILE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """_logits_tiles_kernel for Hopper: persistent (one program per SM walks tiles NUM_PROGRAMS apart, the token
    blocks of a vocab tile consecutive), operands through TMA descriptors (no address arithmetic or load
    registers; rows past T or V read as zeros). The tile loop and the K loop are one flattened loop, so the next
    tile's loads are in flight during this tile's epilogue."""
    pid = tl.program_id(0)
    num_t = tl.cdiv(T, BLOCK_T)
    num_tiles = num_t * tl.cdiv(V, BLOCK_V)
    for tile in tl.range(pid, num_tiles, NUM_PROGRAMS, flatten=True):
        pid_v = tile // num_t
        pid_t = tile % num_t
        acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            a = h_desc.load([pid_t * BLOCK_T, k0])
            b = w_desc.load([pid_v * BLOCK_V, k0])
            acc = tl.dot(a, b.T, acc)
        offs_t, t_mask, _ = _token_rows(pid_t, T, BLOCK_T)
        _tile_epilogue(acc, pid_v, offs_t, t_mask, T, V, VE, e_ptr, stride_e, m2_ptr, lse2_ptr, ent_ptr, k2, cap_k,
                       WRITE_E, WITH_ENTROPY, SOFTCAP, SUBTILE, BLOCK_V)


@triton.jit
def _target_logit_kernel(h_ptr, w_ptr, tgt_ptr, out_ptr, T, V, H, stride_h, stride_w, x_k, cap_k,
                         SOFTCAP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """tz = x at the target per token: z = h . w[target] in fp32, times x_k = 1 / temperature, or with SOFTCAP
    _tanh(z, cap_k) times x_k = c / temperature (0 where the target is not a row of this weight: ignored, or on
    another rank)."""
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
    if SOFTCAP:
        acc = _tanh(acc, cap_k)
    tl.store(out_ptr + offs_t, acc * x_k, mask=t_mask)


def target_logits(hidden_TH, weight_VH, tgt_T, inv_temp: float, out=None, softcap=None):
    """tz [T] fp32: each token's x at its target (0 where the target is outside [0, V))."""
    T, H = hidden_TH.shape
    out = torch.empty(T, dtype=torch.float32, device=hidden_TH.device) if out is None else out
    bt, bh, warps = TARGET_TILES[_VENDOR]
    cap_k, x_k = _softcap_args(softcap, inv_temp)
    _target_logit_kernel[(triton.cdiv(T, bt),)](hidden_TH, weight_VH, tgt_T, out, T, weight_VH.shape[0], H,
                                               hidden_TH.stride(0), weight_VH.stride(0), x_k, cap_k,
                                               SOFTCAP=softcap is not None, BLOCK_T=bt, BLOCK_H=bh, num_warps=warps)
    return out


@triton.jit
def _tiles_dz_kernel(
    e_ptr, stride_e, m2_ptr, tgt_ptr, lse2_ptr, a_ptr, b_ptr, c_ptr, scale_ptr, T, V, inv_temp, t_per_x,
    HAS_B: tl.constexpr, SOFTCAP: tl.constexpr, TILE_V: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """In place: the tile weights (2^14 e) -> dz = scale * (p (a + b x) + c [v == target]) * inv_temp, with
    p = e * exp2(m2 - lse2) and (only when b or the cap use it) x = (m2 + log2 e) ln 2 (m2: the tile's max, log2
    units); SOFTCAP: the p term times the slope 1 - t^2, t = x t_per_x = tanh(z / c) (t_per_x = temperature / c; c
    carries the target's own slope: numerics.cap_target_term).
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
    if HAS_B or SOFTCAP:
        x = tl.where(e > 0, (m2[:, None] + tl.log2(e) - E_LOG2) * 0.6931471805599453, 0.0)  # e = 0: p = 0
    if HAS_B:
        coef = coef + tl.load(b_ptr + rows)[:, None] * x
    if SOFTCAP:
        t = x * t_per_x
        coef = coef * ((1.0 - t) * (1.0 + t))
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
    """TMA descriptors for the logits GEMM: NVIDIA Hopper or later, 16-bit operands (not the exact fp32 dot), unit
    inner stride, rows and bases 16-byte aligned."""
    return (not dot_fp32 and _VENDOR == "nvidia" and _ARCH >= 9
            and all(t.element_size() == 2 and t.stride(1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0
                    for t in (hidden_TH, weight_VH)))


def _desc(t, block):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


def tile_vocab(hidden_TH) -> int:
    """The vocab width of logits_tiles' tiles for these inputs (its statistics are [T / this] per token)."""
    return _tile_config(hidden_TH).block_v


def _tile_config(hidden_TH):
    return logits_tile_config(_VENDOR, 4 if _dot_fp32(hidden_TH) and _VENDOR != "interpreter" else 2)


def logits_tiles(hidden_TH, weight_VH, tgt_T, inv_temp: float, with_entropy: bool, e_TV=None, parts=None,
                 merge=True, softcap=None) -> TileStats:
    """One logits GEMM with the statistics in its epilogue: the tile maxima m2 and, merged over the tiles, lse2,
    ent (zeros unless with_entropy) and tz (target_logits); writes the tile weights into e_TV (fp16 or fp32, row
    stride free; [T, >= V], its columns past V written as zeros, within the last tile) when given. parts: a flat
    fp32 buffer of at least PARTS_PER_TILE T N elements for the per-tile statistics (else allocated). merge=False:
    the tile maxima only (no lse2, ent, tz)."""
    T, H = hidden_TH.shape
    V = weight_VH.shape[0]
    dot_fp32 = _dot_fp32(hidden_TH)
    c = _tile_config(hidden_TH)
    n_tiles = triton.cdiv(V, c.block_v)
    n_parts = PARTS_PER_TILE * n_tiles * T
    if parts is None:
        parts = torch.empty(n_parts, dtype=torch.float32, device=hidden_TH.device)
    m2_NT, lse2_NT, ent_NT = parts[:n_parts].view(PARTS_PER_TILE, n_tiles, T).unbind(0)
    e_arg = e_TV if e_TV is not None else parts
    VE = weight_columns(e_TV, V, n_tiles * c.block_v)
    grid_tiles = triton.cdiv(T, c.block_t) * n_tiles
    meta = dict(WRITE_E=e_TV is not None, WITH_ENTROPY=with_entropy, SOFTCAP=softcap is not None,
                SUBTILE=c.block_v >= 256,  # 128-register accumulators: the epilogue takes two halves
                BLOCK_T=c.block_t, BLOCK_V=c.block_v, BLOCK_K=c.block_k, num_warps=c.num_warps,
                num_stages=c.num_stages)
    outs = (e_arg, m2_NT, lse2_NT, ent_NT)
    cap_k, x_k = _softcap_args(softcap, inv_temp)
    k2 = x_k * LOG2E
    if _use_tma(hidden_TH, weight_VH, dot_fp32):
        h_desc = _desc(hidden_TH, [c.block_t, c.block_k])
        w_desc = _desc(weight_VH, [c.block_v, c.block_k])
        progs = min(grid_tiles, _num_sms(hidden_TH.device))
        _logits_tiles_tma_kernel[(progs,)](h_desc, w_desc, *outs, T, V, VE, H, e_arg.stride(0), k2, cap_k, progs,
                                           **meta)
    else:
        _logits_tiles_kernel[(grid_tiles,)](
            hidden_TH, weight_VH, *outs, T, V, VE, H, hidden_TH.stride(0), weight_VH.stride(0), e_arg.stride(0),
            k2, cap_k, DOT_FP32=dot_fp32, **meta)
    if not merge:  # (the caller wants the weights and the tile maxima only)
        return TileStats(m2_NT, c.block_v)
    lse2_T, ent_T = merge_tiles(lse2_NT, ent_NT, with_entropy)
    return TileStats(m2_NT, c.block_v, lse2_T, ent_T, target_logits(hidden_TH, weight_VH, tgt_T, inv_temp,
                                                                    softcap=softcap))


def dlogits_from_tiles(e_TV, tiles: TileStats, tgt_T, lse2_T, coef: Coefficients, inv_temp: float, scale,
                       softcap=None) -> None:
    """In place over e_TV (logits_tiles' weights): scale * dloss/dz (coef.lse unused: lse2_T is it in log2
    units)."""
    T, V = e_TV.shape
    bt, bv, warps = DZ_TILES[_VENDOR]
    bv = min(bv, tiles.tile_v)
    _tiles_dz_kernel[(triton.cdiv(T, bt) * triton.cdiv(V, bv),)](
        e_TV, e_TV.stride(0), tiles.m2, tgt_T, lse2_T, coef.a, coef.b_or_a(), coef.c, scale, T, V, inv_temp,
        0.0 if softcap is None else 1.0 / (softcap * inv_temp),
        HAS_B=coef.b is not None, SOFTCAP=softcap is not None, TILE_V=tiles.tile_v, BLOCK_T=bt, BLOCK_V=bv,
        num_warps=warps,
    )


@triton.jit
def _dlogits_epilogue(acc, rows, offs_t, offs_v, t_mask, v_mask, tgt_ptr, lse_ptr, a_ptr, b_ptr, c_ptr, scale_ptr,
                      dz_ptr, stride_dz, v_off, inv_temp, x_k, cap_k, SOFTCAP: tl.constexpr):
    """dz = scale * (p (a + b x) + c [v == target]) / temperature, stored in dz's dtype, x = acc / temperature; with
    SOFTCAP x = t x_k, t = _tanh(acc, cap_k), and the p term times the slope 1 - t^2 (c carries the target's:
    numerics.cap_target_term). `scale` is a power of two that moves the tile's values into fp16's range (undone,
    exactly, after the GEMMs); 1 otherwise."""
    lse = tl.load(lse_ptr + rows)
    ca = tl.load(a_ptr + rows)
    cb = tl.load(b_ptr + rows)
    cc = tl.load(c_ptr + rows)
    tgt = tl.load(tgt_ptr + rows) - v_off
    if SOFTCAP:
        t = _tanh(acc, cap_k)
        x = t * x_k
    else:
        x = acc * inv_temp
    p = tl.exp2((x - lse[:, None]) * 1.4426950408889634)
    dz = p * (ca[:, None] + cb[:, None] * x)
    if SOFTCAP:
        dz = dz * ((1.0 - t) * (1.0 + t))
    dz += tl.where(offs_v[None, :] == tgt[:, None], cc[:, None], 0.0)
    dz = dz * (inv_temp * tl.load(scale_ptr))
    ptrs = dz_ptr + offs_t[:, None] * stride_dz + offs_v[None, :]
    tl.store(ptrs, dz.to(dz_ptr.dtype.element_ty), mask=t_mask[:, None] & v_mask[None, :])


@triton.jit
def _logits_dz_kernel(
    z_ptr, stride_z, tgt_ptr, lse_ptr, a_ptr, b_ptr, c_ptr, scale_ptr, dz_ptr, stride_dz, T, V, v_off, inv_temp,
    x_k, cap_k, SOFTCAP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """fp32 logits [T, V] (from cuBLAS) -> dlogits, elementwise; the output may be the input's own storage.

    One program owns BLOCK_T whole rows and sweeps them left to right. In place with a 2-byte output (row stride
    2V, the fused path), tile [v0, v0 + BV) is stored over fp32 elements [v0/2, (v0 + BV)/2) of the same rows,
    all read by this program already (this tile or earlier ones); the barrier makes every thread's load of the
    tile land before any thread's store. Not autotuned: timing configs would run an in-place kernel repeatedly."""
    pid = tl.program_id(0)
    offs_t, t_mask, rows = _token_rows(pid, T, BLOCK_T)
    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        v_mask = offs_v < V
        z = tl.load(z_ptr + rows[:, None] * stride_z + offs_v[None, :], mask=v_mask[None, :], other=0.0)
        tl.debug_barrier()
        _dlogits_epilogue(z, rows, offs_t, offs_v, t_mask, v_mask, tgt_ptr, lse_ptr, a_ptr, b_ptr, c_ptr,
                          scale_ptr, dz_ptr, stride_dz, v_off, inv_temp, x_k, cap_k, SOFTCAP)


def dlogits_from_logits(z_TV, tgt_T, v_off: int, coef: Coefficients, inv_temp: float, scale, out_TV, softcap=None):
    """out_TV = scale * dloss/dz from an fp32 logits chunk z. out_TV may have any row stride and may be z_TV
    itself, or a 2-byte view of z_TV's storage with row stride 2V (in place, see _logits_dz_kernel)."""
    T, V = z_TV.shape
    bt, bv, warps = DZ_ROWS_TILE[_VENDOR]
    cap_k, x_k = _softcap_args(softcap, inv_temp)
    _logits_dz_kernel[(triton.cdiv(T, bt),)](
        z_TV, z_TV.stride(0), tgt_T, coef.lse, coef.a, coef.b, coef.c, scale, out_TV, out_TV.stride(0), T, V, v_off,
        inv_temp, x_k, cap_k,
        SOFTCAP=softcap is not None, BLOCK_T=bt, BLOCK_V=bv, num_warps=warps,
    )
    return out_TV


@triton.jit
def _dw_acc_kernel(dz_ptr, h_ptr, acc_ptr, scale_ptr, T, V, H, stride_dz, stride_h, stride_acc,
                   FIRST: tl.constexpr, DOT_FP32: tl.constexpr,
                   BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc[V, H] (fp32) = or += dz[T, V]^T @ (h[T, H] x scale): dz fp16, h bf16/fp16 converted in registers
    (times a power of two: exact), fp32 accumulation over all T inside the program, one fp32 read-modify-write."""
    pid_v = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    v_mask = offs_v < V
    h_mask = offs_h < H
    scale = tl.load(scale_ptr)
    acc = tl.zeros([BLOCK_V, BLOCK_H], tl.float32)
    for k0 in range(0, T, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < T
        rows = offs_k.to(tl.int64)[:, None]
        a = tl.load(dz_ptr + rows * stride_dz + offs_v[None, :], mask=k_mask[:, None] & v_mask[None, :], other=0.0)
        b = tl.load(h_ptr + rows * stride_h + offs_h[None, :], mask=k_mask[:, None] & h_mask[None, :], other=0.0)
        b = b.to(tl.float32) * scale
        if DOT_FP32:
            acc = tl.dot(tl.trans(a.to(tl.float32)), b, acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(a), b.to(tl.float16), acc)
    ptrs = acc_ptr + offs_v.to(tl.int64)[:, None] * stride_acc + offs_h[None, :]
    mask = v_mask[:, None] & h_mask[None, :]
    if not FIRST:
        acc += tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, acc, mask=mask)


def dw_acc(acc_VH, dz_TV, h_TH, scale, first: bool) -> None:
    """acc (fp32 [V, H]) = (first) or += dz^T @ (h * scale), with dz fp16 and h 16-bit: the dW GEMM of the lean
    head without an fp16 copy of h (kernels/lm_head/lean.py)."""
    T, V = dz_TV.shape
    H = h_TH.shape[1]
    c = DW_ACC_TILES[_VENDOR]
    grid = (triton.cdiv(V, c.block_t), triton.cdiv(H, c.block_v))
    _dw_acc_kernel[grid](dz_TV, h_TH, acc_VH, scale, T, V, H, dz_TV.stride(0), h_TH.stride(0), acc_VH.stride(0),
                         FIRST=first, DOT_FP32=_VENDOR == "interpreter", BLOCK_V=c.block_t, BLOCK_H=c.block_v,
                         BLOCK_K=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages)
