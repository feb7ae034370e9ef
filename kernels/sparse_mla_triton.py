"""Triton kernels of DeepSeek sparse attention's absorbed MLA (launch/sparse_attention.py): each query's heads
against the latents its indexer selected, flash-style. Shapes: q [T, H, C + R] (the absorbed query: C latent
channels, R RoPE channels), latent [S, C + R] (the value is its first C channels), idx [T, K] int32 with a query's
valid entries first (−1 after them) and count [T] of them.

    forward   one program per (query, block of BH heads): per tile of BK selected keys it gathers their latent
              rows, scores them (q_c·g_c + q_r·g_r), and folds them into an online softmax and the [BH, C] fp32
              output; it writes ô and the log-sum-exp per head
    backward  one program per (query, block of heads): Δ = Σ dô·ô of its heads, then per tile it recomputes
              p = exp(s − lse), dp = dô·g_c, ds = p (dp − Δ) scale, adds ds·g to its dq (in registers for the whole
              loop) and adds the tile's latent gradient dsᵀ q + pᵀ dô (the second on the first C channels) to the
              selected rows of the fp32 dlatent with atomics (a key selected by many queries, or by one query's
              several head blocks, receives from each: the order of those additions is not fixed)

Programs are numbered query-major, a query's head blocks adjacent, so they run together and gather the same rows
from L2. The block sizes (`_forward_config`, `_backward_config`) are the fastest measured on an H200
(bench/bench_sparse_attention.py, docs/BENCHMARKS.md): 64 heads and 64 keys a program for the forward where the head
count is a multiple of 64 (its q re-read per tile: held across the loop, the registers spill), 16 heads and 32 keys
otherwise; 32 heads and 32 keys a program for the backward (16 and 16 at 16 heads or fewer), three pipeline stages.
The loops run to each query's own count of valid entries, so a query early in its document (fewer keys than K) costs
its keys only. Imported lazily (the CPU path never imports triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _query(Q, t, h, mh, qs_t, qs_h, c, r, mr, C: tl.constexpr):
    """A query's rows for heads h: its C latent channels and its R RoPE channels (padded to RP)."""
    q_row = Q + t * qs_t + h[:, None] * qs_h
    qc = tl.load(q_row + c[None, :], mask=mh[:, None], other=0.0)
    qr = tl.load(q_row + C + r[None, :], mask=mh[:, None] & mr[None, :], other=0.0)
    return qc, qr


@triton.jit
def _program(H, NHB: tl.constexpr, C: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, BH: tl.constexpr):
    """A (query, block of heads) program's query t (int64: t · stride passes 2^31 at long sequences), heads and
    channel ranges; programs are numbered query-major (a query's NHB head blocks adjacent)."""
    pid = tl.program_id(0).to(tl.int64)
    t = pid // NHB
    h = (pid % NHB).to(tl.int32) * BH + tl.arange(0, BH)
    c, r = tl.arange(0, C), tl.arange(0, RP)
    return t, h, h < H, c, r, r < R


@triton.jit
def _tile(IDX, t, is_t, k0, n, BK: tl.constexpr):
    """Slots k0 … k0 + BK of a query's selection: which are among its n valid ones, and their latent rows."""
    kk = k0 + tl.arange(0, BK)
    valid = kk < n
    return valid, tl.load(IDX + t * is_t + kk, mask=valid, other=0).to(tl.int64)


@triton.jit
def _gather(L, row, valid, ls_s, c, r, mr, C: tl.constexpr):
    """The selected keys' latent rows: [BK, C] and their RoPE channels [BK, RP]."""
    gc = tl.load(L + row[:, None] * ls_s + c[None, :], mask=valid[:, None], other=0.0)
    gr = tl.load(L + row[:, None] * ls_s + C + r[None, :], mask=valid[:, None] & mr[None, :], other=0.0)
    return gc, gr


@triton.jit
def _sparse_mla_fwd(Q, L, IDX, CNT, O, LSE, H, scale, qs_t, qs_h, ls_s, is_t, os_t, os_h,
                    C: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
                    NHB: tl.constexpr, Q_PER_TILE: tl.constexpr):
    t, h, mh, c, r, mr = _program(H, NHB, C, R, RP, BH)
    if not Q_PER_TILE:
        qc, qr = _query(Q, t, h, mh, qs_t, qs_h, c, r, mr, C)
    n = tl.load(CNT + t)
    m_i = tl.full((BH,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BH,), dtype=tl.float32)
    acc = tl.zeros((BH, C), dtype=tl.float32)
    for k0 in range(0, n, BK):
        valid, row = _tile(IDX, t, is_t, k0, n, BK)
        if Q_PER_TILE:
            qc, qr = _query(Q, t, h, mh, qs_t, qs_h, c, r, mr, C)
        gc, gr = _gather(L, row, valid, ls_s, c, r, mr, C)
        s = (tl.dot(qc, tl.trans(gc)) + tl.dot(qr, tl.trans(gr))) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(gc.dtype), gc)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(O + t * os_t + h[:, None] * os_h + c[None, :], o.to(O.dtype.element_ty), mask=mh[:, None])
    tl.store(LSE + t * H + h, m_i + tl.log(l_i), mask=mh)


@triton.jit
def _sparse_mla_bwd(Q, L, IDX, CNT, O, DO, LSE, DQ, DL, H, scale, qs_t, qs_h, ls_s, is_t, os_t, os_h, dls_s,
                    C: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
                    NHB: tl.constexpr):
    t, h, mh, c, r, mr = _program(H, NHB, C, R, RP, BH)
    qc, qr = _query(Q, t, h, mh, qs_t, qs_h, c, r, mr, C)
    o_row = t * os_t + h[:, None] * os_h + c[None, :]
    do = tl.load(DO + o_row, mask=mh[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * tl.load(O + o_row, mask=mh[:, None], other=0.0).to(tl.float32), 1)
    lse = tl.load(LSE + t * H + h, mask=mh, other=0.0)
    n = tl.load(CNT + t)
    dqc = tl.zeros((BH, C), dtype=tl.float32)
    dqr = tl.zeros((BH, RP), dtype=tl.float32)
    for k0 in range(0, n, BK):
        valid, row = _tile(IDX, t, is_t, k0, n, BK)
        gc, gr = _gather(L, row, valid, ls_s, c, r, mr, C)
        s = (tl.dot(qc, tl.trans(gc)) + tl.dot(qr, tl.trans(gr))) * scale
        p = tl.where(valid[None, :] & mh[:, None], tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(gc))
        ds = (p * (dp - delta[:, None]) * scale).to(gc.dtype)
        dqc += tl.dot(ds, gc)
        dqr += tl.dot(ds, gr)
        dgc = tl.dot(tl.trans(ds), qc) + tl.dot(tl.trans(p.to(gc.dtype)), do)
        dgr = tl.dot(tl.trans(ds), qr)
        dl_row = DL + row[:, None] * dls_s
        tl.atomic_add(dl_row + c[None, :], dgc, mask=valid[:, None], sem="relaxed")
        tl.atomic_add(dl_row + C + r[None, :], dgr, mask=valid[:, None] & mr[None, :], sem="relaxed")
    dq_row = DQ + t * qs_t + h[:, None] * qs_h
    tl.store(dq_row + c[None, :], dqc.to(DQ.dtype.element_ty), mask=mh[:, None])
    tl.store(dq_row + C + r[None, :], dqr.to(DQ.dtype.element_ty), mask=mh[:, None] & mr[None, :])


def _dims(q: torch.Tensor, latent: torch.Tensor, v_dim: int) -> tuple[int, int, int]:
    C, R = v_dim, q.shape[-1] - v_dim
    if C & (C - 1) or C < 16 or R < 1:
        raise ValueError(f"the sparse MLA kernels take a power-of-two latent width of at least 16 and RoPE channels "
                         f"after it, got q {tuple(q.shape)} with v width {v_dim}")
    return C, R, max(16, triton.next_power_of_2(R))


def _forward_config(H: int) -> dict:
    """Heads and keys a forward program holds, its warps and pipeline stages, and whether q is re-read per tile."""
    if H % 64 == 0:
        return dict(BH=64, BK=64, num_warps=8, num_stages=3, Q_PER_TILE=True)
    return dict(BH=16, BK=32, num_warps=4, num_stages=2, Q_PER_TILE=False)


def _backward_config(H: int) -> dict:
    if H <= 16:
        return dict(BH=16, BK=16, num_warps=4, num_stages=3)
    return dict(BH=32, BK=32, num_warps=8, num_stages=3)


def forward(q: torch.Tensor, latent: torch.Tensor, idx: torch.Tensor, count: torch.Tensor, scale: float,
            v_dim: int, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    T, H, _ = q.shape
    C, R, RP = _dims(q, latent, v_dim)
    o = torch.empty(T, H, C, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    cfg = config or _forward_config(H)
    if T:
        nhb = triton.cdiv(H, cfg["BH"])
        _sparse_mla_fwd[(T * nhb,)](
            q, latent, idx, count, o, lse, H, scale, q.stride(0), q.stride(1), latent.stride(0), idx.stride(0),
            o.stride(0), o.stride(1), C=C, R=R, RP=RP, NHB=nhb, **cfg)
    return o, lse


def backward(q: torch.Tensor, latent: torch.Tensor, idx: torch.Tensor, count: torch.Tensor, o: torch.Tensor,
             lse: torch.Tensor, do: torch.Tensor, scale: float, v_dim: int, config: dict | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    T, H, _ = q.shape
    C, R, RP = _dims(q, latent, v_dim)
    dq = torch.empty_like(q)
    dlatent = torch.zeros(latent.shape, dtype=torch.float32, device=q.device)
    cfg = config or _backward_config(H)
    if T:
        nhb = triton.cdiv(H, cfg["BH"])
        _sparse_mla_bwd[(T * nhb,)](
            q, latent, idx, count, o, do, lse, dq, dlatent, H, scale, q.stride(0), q.stride(1), latent.stride(0),
            idx.stride(0), o.stride(0), o.stride(1), dlatent.stride(0), C=C, R=R, RP=RP, NHB=nhb, **cfg)
    return dq, dlatent
