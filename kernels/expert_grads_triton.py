"""Triton kernels of kernels/expert_grads.py (what each computes and why it is fused: see there).

Both stream rows once: every input element is read once and every output written once, fp32 in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gdn_fused_triton import _VENDOR, _cast

# (rows, columns, warps). slot_grads: a program owns BLOCK_M whole rows and walks D in BLOCK_D steps, keeping the
# row dots in fp32 registers; 16 x 256 over 4 warps is 32 values a thread per step (4 x 16-byte loads of each
# operand). swiglu: 2-D tiles of [rows, I columns], each element independent. Interpreter: small, so the test
# shapes cross tile edges on both axes and the D loop runs several steps.
SLOT_TILE = {"nvidia": (16, 256, 4), "amd": (16, 256, 4), "interpreter": (4, 16, 1)}
SWIGLU_TILE = {"nvidia": (16, 256, 4), "amd": (16, 256, 4), "interpreter": (4, 16, 1)}
# add_expert_bias_: 2-D tiles of [rows, columns]; each row finds its expert among the offsets held whole
BIAS_TILE = {"nvidia": (32, 256, 4), "amd": (32, 256, 4), "interpreter": (4, 16, 1)}


@triton.jit
def _slot_grads_kernel(dout_ptr, s_dout, w_ptr, s_w, y_ptr, s_y, g_ptr, s_g, dw_ptr, M, D,
                       BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = rows < M
    w = tl.load(w_ptr + rows * s_w, mask=r_ok, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_M], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        ok = r_ok[:, None] & (cols < D)[None, :]
        dout = tl.load(dout_ptr + rows[:, None] * s_dout + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + rows[:, None] * s_y + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        acc += tl.sum(dout * y, axis=1)
        tl.store(g_ptr + rows[:, None] * s_g + cols[None, :], (dout * w[:, None]).to(g_ptr.dtype.element_ty), mask=ok)
    tl.store(dw_ptr + rows, acc, mask=r_ok)


@triton.jit
def _gate_up_tile(h_ptr, s_h, M, I, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_I] tile of gate and of up (fp32), its rows, columns and mask."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = (rows < M)[:, None] & (cols < I)[None, :]
    h_row = h_ptr + rows[:, None] * s_h + cols[None, :]
    gate = tl.load(h_row, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(h_row + I, mask=ok, other=0.0).to(tl.float32)
    return rows, cols, ok, gate, up


@triton.jit
def _gelu_tanh_z(g):
    """z of GeGLU's gate g: gelu_tanh(g) = g·σ(z), z = 2√(2/π)(g + 0.044715 g³) (1 + tanh(v) = 2σ(2v): Triton has no
    tanh; kernels.expert_grads.GLU derives it). Both kernels take z from here, so the forward kernel's activation is
    the backward kernel's bitwise."""
    return 1.5957691216057308 * (g + 0.044715 * (g * g) * g)


@triton.jit
def _swiglu_bwd_kernel(h_ptr, s_h, da_ptr, s_da, dh_ptr, s_dh, a_ptr, s_a, M, I,
                       BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, GENERAL: tl.constexpr = False,
                       ALPHA: tl.constexpr = 1.0, CLAMP: tl.constexpr = False, LIMIT: tl.constexpr = 0.0,
                       OFFSET: tl.constexpr = 0.0, CLAMP_ACT: tl.constexpr = False, GELU_TANH: tl.constexpr = False):
    # GENERAL: a kernels.expert_grads.GLU other than SwiGLU (gpt-oss's clamped form, Step-3.7's with CLAMP_ACT: the
    # limit clamps the activated gate, not the gate), whose derivation is there; GELU_TANH: GeGLU (Gemma 4's),
    # gelu_tanh(gate)·up, SwiGLU's form with z(gate) for α·gate (derived there too); SwiGLU keeps its own arithmetic
    rows, cols, ok, gate, up = _gate_up_tile(h_ptr, s_h, M, I, BLOCK_M, BLOCK_I)
    da = tl.load(da_ptr + rows[:, None] * s_da + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    dh_row = dh_ptr + rows[:, None] * s_dh + cols[None, :]
    if GELU_TANH:
        z = _gelu_tanh_z(gate)
        s = tl.sigmoid(z)
        gelu = gate * s
        dz = 1.5957691216057308 * (1 + 0.134145 * (gate * gate))  # dz/dgate = 2√(2/π)(1 + 3·0.044715·gate²)
        # gelu' = s + gate·s·σ(−z)·dz/dgate: σ(−z), not 1 − s, keeps its digits where s nears 1
        dgate = da * up * (s + gelu * tl.sigmoid(-z) * dz)
        tl.store(dh_row, dgate.to(dh_ptr.dtype.element_ty), mask=ok)
        tl.store(dh_row + I, (da * gelu).to(dh_ptr.dtype.element_ty), mask=ok)
        tl.store(a_ptr + rows[:, None] * s_a + cols[None, :], (gelu * up).to(a_ptr.dtype.element_ty), mask=ok)
    elif GENERAL:
        g = gate
        u = up
        if CLAMP:
            if not CLAMP_ACT:
                g = tl.minimum(gate, LIMIT)
            u = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        s = tl.sigmoid(ALPHA * g)
        act = g * s
        u = u + OFFSET
        dgate = da * u * (s + ALPHA * act * (1 - s))
        if CLAMP_ACT:
            dgate = tl.where(act <= LIMIT, dgate, 0.0)
            act = tl.minimum(act, LIMIT)
        dup = da * act
        if CLAMP:
            if not CLAMP_ACT:
                dgate = tl.where(gate <= LIMIT, dgate, 0.0)
            dup = tl.where((up >= -LIMIT) & (up <= LIMIT), dup, 0.0)
        tl.store(dh_row, dgate.to(dh_ptr.dtype.element_ty), mask=ok)
        tl.store(dh_row + I, dup.to(dh_ptr.dtype.element_ty), mask=ok)
        tl.store(a_ptr + rows[:, None] * s_a + cols[None, :], (act * u).to(a_ptr.dtype.element_ty), mask=ok)
    else:
        sig = tl.sigmoid(gate)
        silu = gate * sig
        dgate = da * up * sig * (1 + gate * (1 - sig))
        tl.store(dh_row, dgate.to(dh_ptr.dtype.element_ty), mask=ok)
        tl.store(dh_row + I, (da * silu).to(dh_ptr.dtype.element_ty), mask=ok)
        tl.store(a_ptr + rows[:, None] * s_a + cols[None, :], (silu * up).to(a_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _glu_fwd_kernel(h_ptr, s_h, a_ptr, s_a, M, I, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
                    ALPHA: tl.constexpr = 1.0, CLAMP: tl.constexpr = False, LIMIT: tl.constexpr = 0.0,
                    OFFSET: tl.constexpr = 0.0, CLAMP_ACT: tl.constexpr = False, GELU_TANH: tl.constexpr = False):
    # a = g·σ(α·g)·(u + c), g and u clamped where the GLU has a limit (kernels.expert_grads.GLU), fp32 inside;
    # CLAMP_ACT (Step-3.7's): a = min(gate·σ(α·gate), limit)·(u + c); GELU_TANH (GeGLU): a = gelu_tanh(g)·u; each
    # the backward kernel's ops
    rows, cols, ok, g, u = _gate_up_tile(h_ptr, s_h, M, I, BLOCK_M, BLOCK_I)
    if GELU_TANH:
        act = g * tl.sigmoid(_gelu_tanh_z(g)) * u
    elif CLAMP_ACT:
        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        act = tl.minimum(g * tl.sigmoid(ALPHA * g), LIMIT) * (u + OFFSET)
    else:
        if CLAMP:
            g = tl.minimum(g, LIMIT)
            u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
        act = g * tl.sigmoid(ALPHA * g) * (u + OFFSET)
    tl.store(a_ptr + rows[:, None] * s_a + cols[None, :], act.to(a_ptr.dtype.element_ty), mask=ok)


def _unit_columns(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
            raise ValueError(f"expected a 2-D tensor with unit column stride, got shape {tuple(t.shape)} "
                             f"strides {t.stride()}")


def slot_grads(dout_MD: torch.Tensor, w_M1: torch.Tensor, y_MD: torch.Tensor, out: torch.Tensor | None = None):
    _unit_columns(dout_MD, y_MD)
    M, D = dout_MD.shape
    # a program reads each [BLOCK_M, BLOCK_D] tile of dout before it writes g's same tile: out may be dout
    g = out if out is not None else torch.empty((M, D), dtype=dout_MD.dtype, device=dout_MD.device)
    _unit_columns(g)
    dw = torch.empty((M,), dtype=torch.float32, device=dout_MD.device)
    if M:
        bm, bd, warps = SLOT_TILE[_VENDOR]
        _slot_grads_kernel[(triton.cdiv(M, bm),)](dout_MD, dout_MD.stride(0), w_M1, w_M1.stride(0), y_MD,
                                                 y_MD.stride(0), g, g.stride(0), dw, M, D,
                                                 BLOCK_M=bm, BLOCK_D=bd, num_warps=warps)
    return g, dw


def swiglu_backward(h_MF: torch.Tensor, da_MI: torch.Tensor, glu=None):
    """`glu`: a kernels.expert_grads.GLU; None or SwiGLU: SwiGLU's own arithmetic."""
    from kernels.expert_grads import SWIGLU

    _unit_columns(h_MF, da_MI)
    M, I = da_MI.shape
    dh = torch.empty((M, 2 * I), dtype=h_MF.dtype, device=h_MF.device)
    a = torch.empty((M, I), dtype=h_MF.dtype, device=h_MF.device)
    general = {}
    if glu is not None and glu.gate_act == "gelu_tanh":
        general = dict(GELU_TANH=True)
    elif glu is not None and glu != SWIGLU:
        general = dict(GENERAL=True, ALPHA=float(glu.alpha), CLAMP=glu.limit is not None,
                       LIMIT=float(glu.limit or 0.0), OFFSET=float(glu.up_offset),
                       CLAMP_ACT=bool(glu.clamp_activated))
    if M:
        bm, bi, warps = SWIGLU_TILE[_VENDOR]
        _swiglu_bwd_kernel[(triton.cdiv(M, bm), triton.cdiv(I, bi))](h_MF, h_MF.stride(0), da_MI, da_MI.stride(0),
                                                                     dh, dh.stride(0), a, a.stride(0), M, I,
                                                                     BLOCK_M=bm, BLOCK_I=bi, num_warps=warps,
                                                                     **general)
    return dh, a


def glu_forward(h_MF: torch.Tensor, glu) -> torch.Tensor:
    """The activation a [M, I] of h = [gate | up] for a kernels.expert_grads.GLU, in h's dtype, rounded once."""
    _unit_columns(h_MF)
    M, I = h_MF.shape[0], h_MF.shape[1] // 2
    a = torch.empty((M, I), dtype=h_MF.dtype, device=h_MF.device)
    if M:
        bm, bi, warps = SWIGLU_TILE[_VENDOR]
        _glu_fwd_kernel[(triton.cdiv(M, bm), triton.cdiv(I, bi))](
            h_MF, h_MF.stride(0), a, a.stride(0), M, I, BLOCK_M=bm, BLOCK_I=bi, num_warps=warps,
            ALPHA=float(glu.alpha), CLAMP=glu.limit is not None, LIMIT=float(glu.limit or 0.0),
            OFFSET=float(glu.up_offset), CLAMP_ACT=bool(glu.clamp_activated), GELU_TANH=glu.gate_act == "gelu_tanh")
    return a


@triton.jit
def _add_expert_bias_kernel(r_ptr, s_r, b_ptr, s_b, offs_ptr, M, N, E, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_E: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + e, mask=e < E, other=0).to(tl.int64)
    # the expert of row m: how many experts end at or before it (rows are sorted by expert)
    expert = tl.sum(((ends[None, :] <= rows[:, None]) & (e < E)[None, :]).to(tl.int64), axis=1)
    ok = ((rows < M) & (expert < E))[:, None] & (cols < N)[None, :]
    r_row = r_ptr + rows[:, None] * s_r + cols[None, :]
    x = tl.load(r_row, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + expert[:, None] * s_b + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(r_row, _cast(x + b, r_ptr.dtype.element_ty), mask=ok)


def add_expert_bias_(rows_MN: torch.Tensor, bias_EN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    _unit_columns(rows_MN, bias_EN)
    M, N = rows_MN.shape
    E = bias_EN.shape[0]
    if M and N:
        bm, bn, warps = BIAS_TILE[_VENDOR]
        _add_expert_bias_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
            rows_MN, rows_MN.stride(0), bias_EN, bias_EN.stride(0), offs_E, M, N, E, BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_E=triton.next_power_of_2(E), num_warps=warps)
    return rows_MN
