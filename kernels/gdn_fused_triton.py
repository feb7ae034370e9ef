"""Triton kernels of kernels/gdn_fused.py and kernels/rms_norm.py: the causal depthwise conv + SiLU and the RMSNorm
(gated, or plain in either weight order), forward and backward.

Imported lazily by kernels/gdn_fused.py (never at package import), so the CPU path needs no triton.

Shape legend: T tokens, C conv channels, W conv width (taps), R rows of the gated norm (tokens x value heads),
D channels per row (head_v_dim), S strips (groups of token/row tiles that one backward program walks),
BT/BC/BR/BD tile sizes. Every kernel computes in fp32 registers and reads/writes the tensors' own dtypes.

conv forward  (grid: T tiles x C tiles). pre[t, c] = sum_s w[c, W-1-s] x[t-s, c] [pos[t] >= s]; y = silu(pre).
    Tap s is a second load of the same x rows shifted by s: the tile's rows [t0-W+1, t0+BT) are all the kernel
    touches, and all but BT of them were just read by the neighbouring tile, so HBM sees x once and y once.
conv backward (grid: S strips x C tiles; a program walks its strip tile by tile). With
    g[r, c] = dy[r, c] silu'(pre[r, c])  and  m_s(r) = [pos[r] >= s and r >= s]  (tap s of row r is live):
        dx[t, c]        = sum_s w[c, W-1-s] g[t+s, c] m_s(t+s)
        dw[c, W-1-s]    = sum_t g[t+s, c] m_s(t+s) x[t, c]
    Row t needs g on rows t..t+W-1, and g needs pre, which is not stored (only x is saved: the model runs under
    full recompute). Triton cannot shift a register tile by a row, so each of the W row offsets of g recomputes
    its pre from W shifted loads of x (W^2 loads, all but one from L1/L2) and one sigmoid: W sigmoids per
    element. HBM traffic stays x + dy in, dx out; the cost moves to instructions (docs/training.md estimates it).
    dw: each program sums its strip's rows in fp32 registers (W tiles of [BT, BC], reduced over rows once per
    strip; W <= 4) and writes one fp32 partial per strip;
    the autograd function sums the S partials in fp32 (no atomics, deterministic).
norm forward  (grid: R tiles). One tile holds BR whole rows (BD = next_pow2(D) >= D; `_norm_tile` trades rows for
    warps on wide rows), so the mean of squares is a register reduction: x (rows XS apart), gate in, y out, one
    pass. HAS_GATE: the gate and its SiLU (Gated DeltaNet's output norm); without it the plain RMSNorm, whose weight
    multiplies round(n) (OFFSET_MODE off) or whose (offset + w) multiplies n in fp32 (on).
norm backward (grid: S strips). Recomputes rstd and the forward's intermediates from x (and gate), writes dx (and
    dgate), and sums dweight over the strip in fp32 (partials summed by the autograd function).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _vendor() -> str:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "interpreter"
    return "amd" if torch.version.hip is not None else "nvidia"


_VENDOR = _vendor()

# Tiles (rows, channels, warps). All four kernels stream; what matters is bytes in flight per SM and registers.
#   conv fwd, NVIDIA/AMD: 32 x 256 over 8 warps = 8192 values, 32 a thread as 4 x 16-byte bf16 loads per tap;
#     the W-1 halo rows re-read per tile are 3/32 of the tile, from L2. ptxas (sm_90a, bf16, C divisible by 16):
#     124 registers, no spills -> 2 programs (16 warps) an SM, 2 x 16 KiB of x in flight.
#   conv bwd: 8 x 256 over 8 warps, 8 values a thread per tile. The unrolled W x W recompute issues all 21 tile
#     loads up front and the 4 dW accumulators live in registers: 8 x 256 takes 173 registers (bf16; fp32 188),
#     no spills; 16 x 256 hits the 255 cap. ptxas's loop body: ~1265 instructions per 8 values a thread, i.e.
#     ~158 per element (28 FMUL, 28 FFMA, 21 bf16 unpacks, 8 MUFU, ...): issue-bound, see docs/training.md.
#   norm: 16 rows x BD (128) over 4 warps = 2048 values, 16 a thread; 40 registers forward, 96 backward.
#   Interpreter: small (each program costs interpreter time), yet the test shapes (T ~ 40, C ~ 20) cross tile
#     edges on both axes and strips hold several tiles (the dW accumulation across tiles is exercised).
CONV_FWD_TILE = {"nvidia": (32, 256, 8), "amd": (32, 256, 8), "interpreter": (8, 16, 1)}
CONV_BWD_TILE = {"nvidia": (8, 256, 8), "amd": (8, 256, 8), "interpreter": (8, 16, 1)}
NORM_TILE = {"nvidia": (16, 4), "amd": (16, 4), "interpreter": (8, 1)}  # (rows, warps)
# Backward strips: enough programs to fill the GPU several times over (8 per SM), each strip at most
# MAX_STRIP_TILES tiles long so the fp32 partials stay small. Conv, T = 65,536, C = 8192: 8192 row tiles of 8,
# 32 channel tiles -> 128 strips of 512 rows x 32 = 4096 programs, partials 128 x 4 x 8192 x 4 B = 16 MiB.
MAX_STRIP_TILES = {"nvidia": 64, "amd": 64, "interpreter": 2}
MAX_WIDTH = 4  # conv taps the backward kernel holds accumulators for


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _strips(num_tiles: int, other_programs: int, device: torch.device) -> tuple[int, int]:
    """(tiles per strip, strips) for a backward over num_tiles tiles with other_programs programs per strip."""
    want = max(1, triton.cdiv(8 * _num_sms(device), other_programs))  # strips wanted to fill the GPU
    per = max(1, min(MAX_STRIP_TILES[_VENDOR], triton.cdiv(num_tiles, want)))
    return per, triton.cdiv(num_tiles, per)


@triton.jit
def _cast(v, dtype: tl.constexpr):
    """v (fp32) -> dtype, rounding to nearest even. bf16 is rounded by hand (add 0x7FFF plus the lowest kept bit,
    drop the low 16 bits: exact RTNE, what the GPU's cvt.rn.bf16 does) so that Triton's CPU interpreter, whose
    fp32 -> bf16 cast truncates, computes the same bits as the GPU; the final cast is then exact everywhere."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        v = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return v.to(dtype)


# ------------------------------------------------------------------------------------------- causal conv + SiLU
@triton.jit
def _conv_pre(x_ptr, w_ptr, pos_T, t_T, t_ok_T, c_C, c_ok_C, C, W: tl.constexpr, BLOCK_T: tl.constexpr,
              BLOCK_C: tl.constexpr):
    """Pre-activation of rows t_T: sum over taps s of w[c, W-1-s] * x[t-s, c], a tap reaching before the row's
    document start (position < s) or the sequence start reading zero. fp32 [BLOCK_T, BLOCK_C]."""
    pre_TC = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for s in tl.static_range(W):
        w_C = tl.load(w_ptr + c_C * W + (W - 1 - s), mask=c_ok_C, other=0.0).to(tl.float32)
        live_T = t_ok_T & (pos_T >= s) & (t_T >= s)
        src_T = (t_T - s).to(tl.int64)
        x_TC = tl.load(x_ptr + src_T[:, None] * C + c_C[None, :], mask=live_T[:, None] & c_ok_C[None, :],
                       other=0.0).to(tl.float32)
        pre_TC += x_TC * w_C[None, :]
    return pre_TC


@triton.jit
def _conv_fwd_kernel(x_ptr, w_ptr, pos_ptr, y_ptr, T, C,
                     W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    t_T = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    c_C = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok_T = t_T < T
    c_ok_C = c_C < C
    pos_T = tl.load(pos_ptr + t_T, mask=t_ok_T, other=0)
    pre_TC = _conv_pre(x_ptr, w_ptr, pos_T, t_T, t_ok_T, c_C, c_ok_C, C, W, BLOCK_T, BLOCK_C)
    y_TC = pre_TC / (1.0 + tl.exp(-pre_TC))
    out = t_T.to(tl.int64)[:, None] * C + c_C[None, :]
    tl.store(y_ptr + out, _cast(y_TC, y_ptr.dtype.element_ty), mask=t_ok_T[:, None] & c_ok_C[None, :])


@triton.jit
def _conv_bwd_kernel(x_ptr, w_ptr, pos_ptr, dy_ptr, dx_ptr, dwp_ptr, T, C, ROWS_PER_STRIP,
                     W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                     NEED_DX: tl.constexpr, NEED_DW: tl.constexpr):
    # dw[c, W-1-s] accumulates elementwise in acc{s} [BT, BC] over the whole strip and is reduced over rows once
    # at the end: a row reduction per tile would cross warps (shared memory and barriers) every tile. Four
    # accumulators, so W <= MAX_WIDTH (= 4, the models' width; the dispatcher sends wider convs to torch).
    pid_s = tl.program_id(0)
    pid_c = tl.program_id(1)
    c_C = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok_C = c_C < C
    acc0 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    strip0 = pid_s * ROWS_PER_STRIP
    strip1 = tl.minimum(strip0 + ROWS_PER_STRIP, T)
    for t0 in range(strip0, strip1, BLOCK_T):
        t_T = t0 + tl.arange(0, BLOCK_T)
        t_ok_T = t_T < strip1
        tile_ok = t_ok_T[:, None] & c_ok_C[None, :]
        x_TC = tl.load(x_ptr + t_T.to(tl.int64)[:, None] * C + c_C[None, :], mask=tile_ok,
                       other=0.0).to(tl.float32)
        dx_TC = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for s in tl.static_range(W):  # g on rows r = t + s, through tap s back to row t
            r_T = t_T + s
            r_ok_T = t_ok_T & (r_T < T)
            pos_T = tl.load(pos_ptr + r_T, mask=r_ok_T, other=0)
            pre_TC = _conv_pre(x_ptr, w_ptr, pos_T, r_T, r_ok_T, c_C, c_ok_C, C, W, BLOCK_T, BLOCK_C)
            dy_TC = tl.load(dy_ptr + r_T.to(tl.int64)[:, None] * C + c_C[None, :],
                            mask=r_ok_T[:, None] & c_ok_C[None, :], other=0.0).to(tl.float32)
            sig_TC = 1.0 / (1.0 + tl.exp(-pre_TC))
            g_TC = dy_TC * (sig_TC * (1.0 + pre_TC * (1.0 - sig_TC)))
            g_TC = tl.where((r_ok_T & (pos_T >= s))[:, None], g_TC, 0.0)  # tap s of row r reads row t
            if NEED_DX:
                w_C = tl.load(w_ptr + c_C * W + (W - 1 - s), mask=c_ok_C, other=0.0).to(tl.float32)
                dx_TC += g_TC * w_C[None, :]
            if NEED_DW:
                if s == 0:
                    acc0 += g_TC * x_TC
                elif s == 1:
                    acc1 += g_TC * x_TC
                elif s == 2:
                    acc2 += g_TC * x_TC
                else:
                    acc3 += g_TC * x_TC
        if NEED_DX:
            tl.store(dx_ptr + t_T.to(tl.int64)[:, None] * C + c_C[None, :], _cast(dx_TC, dx_ptr.dtype.element_ty),
                     mask=tile_ok)
    if NEED_DW:
        row = dwp_ptr + (pid_s * W + W - 1).to(tl.int64) * C + c_C  # dw[:, W-1-s] of this strip
        tl.store(row, tl.sum(acc0, axis=0), mask=c_ok_C)
        if W > 1:
            tl.store(row - C, tl.sum(acc1, axis=0), mask=c_ok_C)
        if W > 2:
            tl.store(row - 2 * C, tl.sum(acc2, axis=0), mask=c_ok_C)
        if W > 3:
            tl.store(row - 3 * C, tl.sum(acc3, axis=0), mask=c_ok_C)


def conv_fwd(x_TC: torch.Tensor, w_CW: torch.Tensor, pos_T: torch.Tensor, y_TC: torch.Tensor) -> None:
    T, C = x_TC.shape
    BT, BC, nw = CONV_FWD_TILE[_VENDOR]
    grid = (triton.cdiv(T, BT), triton.cdiv(C, BC))
    _conv_fwd_kernel[grid](x_TC, w_CW, pos_T, y_TC, T, C, W=w_CW.shape[1], BLOCK_T=BT, BLOCK_C=BC, num_warps=nw)


def conv_bwd(x_TC, w_CW, pos_T, dy_TC, need_dx: bool, need_dw: bool):
    """(dx [T, C] in x's dtype or None, dw [C, W] fp32 or None)."""
    T, C = x_TC.shape
    W = w_CW.shape[1]
    assert W <= MAX_WIDTH, W
    BT, BC, nw = CONV_BWD_TILE[_VENDOR]
    c_tiles = triton.cdiv(C, BC)
    per, strips = _strips(triton.cdiv(T, BT), c_tiles, x_TC.device)
    dx_TC = torch.empty_like(x_TC) if need_dx else x_TC  # (a dummy pointer when not written)
    dwp_SWC = torch.empty((strips, W, C) if need_dw else (1,), dtype=torch.float32, device=x_TC.device)
    _conv_bwd_kernel[(strips, c_tiles)](
        x_TC, w_CW, pos_T, dy_TC, dx_TC, dwp_SWC, T, C, per * BT,
        W=W, BLOCK_T=BT, BLOCK_C=BC, NEED_DX=need_dx, NEED_DW=need_dw,
        num_warps=nw)
    dw_CW = dwp_SWC.sum(0).T if need_dw else None
    return (dx_TC if need_dx else None), dw_CW


# --------------------------------------------------------------------------------------- RMSNorm, gated or plain
@triton.jit
def _norm_rows(x_ptr, g_ptr, w_ptr, r_R, d_D, R, D, XS, eps, offset,
               HAS_GATE: tl.constexpr, OFFSET_MODE: tl.constexpr, ROUND_P: tl.constexpr):
    """Loads one tile of rows (x's rows XS elements apart; the gate's and the outputs' D apart) and recomputes the
    forward: (offsets, mask, g, w, rstd, n, nq, p) in fp32. nq is n as the weight multiplies it and p the product:
    OFFSET_MODE, n·(offset + w) in fp32; otherwise w·round(n) (rounded again where ROUND_P)."""
    ok_RD = (r_R < R)[:, None] & (d_D < D)[None, :]
    off_RD = r_R.to(tl.int64)[:, None] * D + d_D[None, :]
    x_RD = tl.load(x_ptr + r_R.to(tl.int64)[:, None] * XS + d_D[None, :], mask=ok_RD, other=0.0).to(tl.float32)
    if HAS_GATE:
        g_RD = tl.load(g_ptr + off_RD, mask=ok_RD, other=0.0).to(tl.float32)
    else:
        g_RD = x_RD  # (unused)
    w_D = tl.load(w_ptr + d_D, mask=d_D < D, other=0.0).to(tl.float32)
    rstd_R = 1.0 / tl.sqrt(tl.sum(x_RD * x_RD, axis=1) / D + eps)
    n_RD = x_RD * rstd_R[:, None]
    if OFFSET_MODE:
        nq_RD = n_RD
        p_RD = n_RD * (offset + w_D[None, :])
    else:
        nq_RD = _cast(n_RD, x_ptr.dtype.element_ty).to(tl.float32)  # the reference's .type_as(x)
        p_RD = w_D[None, :] * nq_RD
        if ROUND_P:  # weight and x of one 16-bit dtype: the reference's product is rounded to it
            p_RD = _cast(p_RD, x_ptr.dtype.element_ty).to(tl.float32)
    return off_RD, ok_RD, g_RD, w_D, rstd_R, n_RD, nq_RD, p_RD


@triton.jit
def _norm_fwd_kernel(x_ptr, g_ptr, w_ptr, y_ptr, R, D, XS, eps, offset,
                     HAS_GATE: tl.constexpr, OFFSET_MODE: tl.constexpr, ROUND_P: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, SIGMOID: tl.constexpr = False):
    r_R = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d_D = tl.arange(0, BLOCK_D)
    off_RD, ok_RD, g_RD, w_D, rstd_R, n_RD, nq_RD, p_RD = _norm_rows(x_ptr, g_ptr, w_ptr, r_R, d_D, R, D, XS, eps,
                                                                     offset, HAS_GATE, OFFSET_MODE, ROUND_P)
    if HAS_GATE:
        if SIGMOID:  # KDA's output gate
            y_RD = p_RD / (1.0 + tl.exp(-g_RD))
        else:
            y_RD = p_RD * (g_RD / (1.0 + tl.exp(-g_RD)))
    else:
        y_RD = p_RD
    tl.store(y_ptr + off_RD, _cast(y_RD, y_ptr.dtype.element_ty), mask=ok_RD)


@triton.jit
def _norm_bwd_kernel(x_ptr, g_ptr, w_ptr, dy_ptr, dx_ptr, dg_ptr, dwp_ptr, R, D, XS, eps, offset, ROWS_PER_STRIP,
                     HAS_GATE: tl.constexpr, OFFSET_MODE: tl.constexpr, ROUND_P: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                     NEED_DX: tl.constexpr, NEED_DG: tl.constexpr, NEED_DW: tl.constexpr,
                     SIGMOID: tl.constexpr = False):
    pid = tl.program_id(0)
    d_D = tl.arange(0, BLOCK_D)
    dw_D = tl.zeros((BLOCK_D,), dtype=tl.float32)
    strip0 = pid * ROWS_PER_STRIP
    strip1 = tl.minimum(strip0 + ROWS_PER_STRIP, R)
    for r0 in range(strip0, strip1, BLOCK_R):
        r_R = r0 + tl.arange(0, BLOCK_R)
        off_RD, ok_RD, g_RD, w_D, rstd_R, n_RD, nq_RD, p_RD = _norm_rows(x_ptr, g_ptr, w_ptr, r_R, d_D, strip1, D,
                                                                         XS, eps, offset, HAS_GATE, OFFSET_MODE,
                                                                         ROUND_P)
        dy_RD = tl.load(dy_ptr + off_RD, mask=ok_RD, other=0.0).to(tl.float32)
        if HAS_GATE:
            sig_RD = 1.0 / (1.0 + tl.exp(-g_RD))
            if SIGMOID:
                dp_RD = dy_RD * sig_RD  # d out / d p = σ(g)
                dg_RD = dy_RD * p_RD * (sig_RD * (1.0 - sig_RD))
            else:
                dp_RD = dy_RD * (g_RD * sig_RD)  # d out / d p = silu(g)
                dg_RD = dy_RD * p_RD * (sig_RD * (1.0 + g_RD * (1.0 - sig_RD)))
            if NEED_DG:
                tl.store(dg_ptr + off_RD, _cast(dg_RD, dg_ptr.dtype.element_ty), mask=ok_RD)
        else:
            dp_RD = dy_RD
        if NEED_DW:
            dw_D += tl.sum(dp_RD * nq_RD, axis=0)
        if NEED_DX:  # the casts pass gradients through unchanged
            if OFFSET_MODE:
                dn_RD = dp_RD * (offset + w_D[None, :])
            else:
                dn_RD = dp_RD * w_D[None, :]
            dot_R = tl.sum(dn_RD * n_RD, axis=1) / D
            dx_RD = rstd_R[:, None] * (dn_RD - n_RD * dot_R[:, None])
            tl.store(dx_ptr + off_RD, _cast(dx_RD, dx_ptr.dtype.element_ty), mask=ok_RD)
    if NEED_DW:
        tl.store(dwp_ptr + pid * D + d_D, dw_D, mask=d_D < D)


def _norm_tile(D: int) -> tuple[int, int, int]:
    """(rows, BD, warps) of a norm program: NORM_TILE's rows and warps up to BD = 128 channels a row; wider rows
    keep its values a program (rows x BD), down to one row, then add warps (at most 16) to keep ~16 a thread."""
    BD = triton.next_power_of_2(D)
    rows, warps = NORM_TILE[_VENDOR]
    if BD > 128:
        rows = max(1, rows * 128 // BD)
        warps = max(warps, min(16, BD // 512)) if _VENDOR != "interpreter" else warps
    return rows, BD, warps


def _round_p(x_RD: torch.Tensor, w_D: torch.Tensor) -> bool:
    return x_RD.element_size() == 2 and torch.promote_types(x_RD.dtype, w_D.dtype) == x_RD.dtype


def norm_fwd(x_RD, g_RD, w_D, eps: float, y_RD, offset: float | None = None, sigmoid: bool = False) -> None:
    """y = RMSNorm of x's rows, times silu(gate) (sigmoid(gate) with `sigmoid`) when g_RD is given; offset None:
    w·round(n), else n·(offset + w). x_RD may be a view whose rows are evenly spaced (stride(1) = 1); g_RD and y_RD
    are contiguous."""
    R, D = x_RD.shape
    BR, BD, nw = _norm_tile(D)
    _norm_fwd_kernel[(triton.cdiv(R, BR),)](x_RD, x_RD if g_RD is None else g_RD, w_D, y_RD, R, D, x_RD.stride(0),
                                            eps, 0.0 if offset is None else offset, HAS_GATE=g_RD is not None,
                                            OFFSET_MODE=offset is not None, ROUND_P=_round_p(x_RD, w_D),
                                            BLOCK_R=BR, BLOCK_D=BD, SIGMOID=sigmoid, num_warps=nw)


def norm_bwd(x_RD, g_RD, w_D, eps: float, dy_RD, need_dx: bool, need_dg: bool, need_dw: bool,
             offset: float | None = None, sigmoid: bool = False):
    """(dx contiguous in x's dtype, dgate in gate's dtype, dweight fp32 [D]); None for those not needed (and for
    dgate without a gate)."""
    R, D = x_RD.shape
    BR, BD, nw = _norm_tile(D)
    need_dg = need_dg and g_RD is not None
    per, strips = _strips(triton.cdiv(R, BR), 1, x_RD.device)
    dx = torch.empty((R, D), dtype=x_RD.dtype, device=x_RD.device) if need_dx else dy_RD
    dg = torch.empty_like(g_RD) if need_dg else dy_RD
    dwp_SD = torch.empty((strips, D) if need_dw else (1,), dtype=torch.float32, device=x_RD.device)
    _norm_bwd_kernel[(strips,)](x_RD, x_RD if g_RD is None else g_RD, w_D, dy_RD, dx, dg, dwp_SD, R, D,
                                x_RD.stride(0), eps, 0.0 if offset is None else offset, per * BR,
                                HAS_GATE=g_RD is not None, OFFSET_MODE=offset is not None,
                                ROUND_P=_round_p(x_RD, w_D), BLOCK_R=BR, BLOCK_D=BD, NEED_DX=need_dx,
                                NEED_DG=need_dg, NEED_DW=need_dw, SIGMOID=sigmoid, num_warps=nw)
    return (dx if need_dx else None), (dg if need_dg else None), (dwp_SD.sum(0) if need_dw else None)
