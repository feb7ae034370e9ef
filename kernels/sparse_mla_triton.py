"""Triton kernels of DeepSeek sparse attention's absorbed MLA (launch/sparse_attention.py): each query's heads
against the latents its indexer selected, flash-style. Shapes: q [T, H, C + R] (the absorbed query: C latent
channels, R RoPE channels), latent [S, C + R] (the value is its first C channels), idx [T, K] int32 with a query's
valid entries first (−1 after them) and count [T] of them.

    forward   one program per (query, block of BH heads): its q rows stay in registers; per tile of BK selected
              keys it gathers their latent rows, scores them (q_c·g_c + q_r·g_r), and folds them into an online
              softmax and the [BH, C] fp32 output; it writes ô and the log-sum-exp per head
    dq        one program per (query, block of heads): per tile it recomputes p = exp(s − lse), dp = dô·g_c,
              ds = p (dp − Δ) scale (Δ = Σ dô·ô, computed here and written for the next kernel), and adds ds·g to dq
    dlatent   one program per query: per tile of BK keys, over all head blocks, dg = dsᵀ q + pᵀ dô (its first C
              channels) in [BK, C + R] fp32, then added to the selected rows of the fp32 dlatent with atomics (a
              key selected by many queries receives from each: the order of those additions is not fixed)

The loops run to each query's own count of valid entries, so a query early in its document (fewer keys than K)
costs its keys only. Imported lazily (the CPU path never imports triton)."""

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
def _program_query(Q, H, qs_t, qs_h, C: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, BH: tl.constexpr):
    """A (query, block of heads) program's query t (int64: t · stride passes 2^31 at long sequences), heads, channel
    ranges and q rows."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    mh = h < H
    c, r = tl.arange(0, C), tl.arange(0, RP)
    mr = r < R
    qc, qr = _query(Q, t, h, mh, qs_t, qs_h, c, r, mr, C)
    return t, h, mh, c, r, mr, qc, qr


@triton.jit
def _tile(IDX, t, is_t, k0, n, BK: tl.constexpr):
    """Slots k0 … k0 + BK of a query's selection: which are among its n valid ones, and their latent rows."""
    kk = k0 + tl.arange(0, BK)
    valid = kk < n
    return valid, tl.load(IDX + t * is_t + kk, mask=valid, other=0).to(tl.int64)


@triton.jit
def _scores(qc, qr, L, row, valid, ls_s, c, r, mr, scale, C: tl.constexpr):
    gc = tl.load(L + row[:, None] * ls_s + c[None, :], mask=valid[:, None], other=0.0)  # [BK, C]
    gr = tl.load(L + row[:, None] * ls_s + C + r[None, :], mask=valid[:, None] & mr[None, :], other=0.0)  # [BK, RP]
    s = tl.dot(qc, tl.trans(gc)) + tl.dot(qr, tl.trans(gr))
    return gc, gr, s * scale


@triton.jit
def _sparse_mla_fwd(Q, L, IDX, CNT, O, LSE, H, scale, qs_t, qs_h, ls_s, is_t, os_t, os_h,
                    C: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr):
    t, h, mh, c, r, mr, qc, qr = _program_query(Q, H, qs_t, qs_h, C, R, RP, BH)
    n = tl.load(CNT + t)
    m_i = tl.full((BH,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BH,), dtype=tl.float32)
    acc = tl.zeros((BH, C), dtype=tl.float32)
    for k0 in range(0, n, BK):
        valid, row = _tile(IDX, t, is_t, k0, n, BK)
        gc, gr, s = _scores(qc, qr, L, row, valid, ls_s, c, r, mr, scale, C)
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
def _sparse_mla_dq(Q, L, IDX, CNT, O, DO, LSE, DELTA, DQ, H, scale, qs_t, qs_h, ls_s, is_t, os_t, os_h,
                   C: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr):
    t, h, mh, c, r, mr, qc, qr = _program_query(Q, H, qs_t, qs_h, C, R, RP, BH)
    o_row = t * os_t + h[:, None] * os_h + c[None, :]
    do = tl.load(DO + o_row, mask=mh[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * tl.load(O + o_row, mask=mh[:, None], other=0.0).to(tl.float32), 1)
    tl.store(DELTA + t * H + h, delta, mask=mh)
    lse = tl.load(LSE + t * H + h, mask=mh, other=0.0)
    n = tl.load(CNT + t)
    dqc = tl.zeros((BH, C), dtype=tl.float32)
    dqr = tl.zeros((BH, RP), dtype=tl.float32)
    for k0 in range(0, n, BK):
        valid, row = _tile(IDX, t, is_t, k0, n, BK)
        gc, gr, s = _scores(qc, qr, L, row, valid, ls_s, c, r, mr, scale, C)
        p = tl.where(valid[None, :], tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(gc))
        ds = (p * (dp - delta[:, None]) * scale).to(gc.dtype)
        dqc += tl.dot(ds, gc)
        dqr += tl.dot(ds, gr)
    dq_row = DQ + t * qs_t + h[:, None] * qs_h
    tl.store(dq_row + c[None, :], dqc.to(DQ.dtype.element_ty), mask=mh[:, None])
    tl.store(dq_row + C + r[None, :], dqr.to(DQ.dtype.element_ty), mask=mh[:, None] & mr[None, :])


@triton.jit
def _sparse_mla_dlatent(Q, L, IDX, CNT, DO, LSE, DELTA, DL, H, scale, qs_t, qs_h, ls_s, is_t, os_t, os_h, dls_s,
                        C: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # t · stride passes 2^31 at long sequences
    c, r = tl.arange(0, C), tl.arange(0, RP)
    mr = r < R
    n = tl.load(CNT + t)
    for k0 in range(0, n, BK):
        valid, row = _tile(IDX, t, is_t, k0, n, BK)
        gc = tl.load(L + row[:, None] * ls_s + c[None, :], mask=valid[:, None], other=0.0)
        gr = tl.load(L + row[:, None] * ls_s + C + r[None, :], mask=valid[:, None] & mr[None, :], other=0.0)
        dgc = tl.zeros((BK, C), dtype=tl.float32)
        dgr = tl.zeros((BK, RP), dtype=tl.float32)
        for h0 in range(0, H, BH):
            h = h0 + tl.arange(0, BH)
            mh = h < H
            qc, qr = _query(Q, t, h, mh, qs_t, qs_h, c, r, mr, C)
            do = tl.load(DO + t * os_t + h[:, None] * os_h + c[None, :], mask=mh[:, None], other=0.0)
            lse = tl.load(LSE + t * H + h, mask=mh, other=0.0)
            delta = tl.load(DELTA + t * H + h, mask=mh, other=0.0)
            s = (tl.dot(qc, tl.trans(gc)) + tl.dot(qr, tl.trans(gr))) * scale
            p = tl.where(valid[None, :] & mh[:, None], tl.exp(s - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(gc))
            ds = (p * (dp - delta[:, None]) * scale).to(gc.dtype)
            dgc += tl.dot(tl.trans(ds), qc) + tl.dot(tl.trans(p.to(gc.dtype)), do)
            dgr += tl.dot(tl.trans(ds), qr)
        dl_row = DL + row[:, None] * dls_s
        tl.atomic_add(dl_row + c[None, :], dgc, mask=valid[:, None], sem="relaxed")
        tl.atomic_add(dl_row + C + r[None, :], dgr, mask=valid[:, None] & mr[None, :], sem="relaxed")


def _dims(q: torch.Tensor, latent: torch.Tensor, v_dim: int) -> tuple[int, int, int]:
    C, R = v_dim, q.shape[-1] - v_dim
    if C & (C - 1) or C < 16 or R < 1:
        raise ValueError(f"the sparse MLA kernels take a power-of-two latent width of at least 16 and RoPE channels "
                         f"after it, got q {tuple(q.shape)} with v width {v_dim}")
    return C, R, max(16, triton.next_power_of_2(R))


BH, BK = 16, 32  # heads a program (forward, dq) or a step (dlatent) holds; keys a tile (forward, dq)
# the dlatent kernel's tile of keys and warps (its [BK, C + R] fp32 gradient stays in registers): each tile re-reads
# every head's q and dô, so wider tiles read them fewer times (bench/bench_sparse_attention.py)
DLATENT_BK, DLATENT_WARPS = 32, 4


def forward(q: torch.Tensor, latent: torch.Tensor, idx: torch.Tensor, count: torch.Tensor, scale: float,
            v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    T, H, _ = q.shape
    C, R, RP = _dims(q, latent, v_dim)
    o = torch.empty(T, H, C, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T:
        _sparse_mla_fwd[(T, triton.cdiv(H, BH))](
            q, latent, idx, count, o, lse, H, scale, q.stride(0), q.stride(1), latent.stride(0), idx.stride(0),
            o.stride(0), o.stride(1), C=C, R=R, RP=RP, BH=BH, BK=BK, num_warps=4, num_stages=2)
    return o, lse


def backward(q: torch.Tensor, latent: torch.Tensor, idx: torch.Tensor, count: torch.Tensor, o: torch.Tensor,
             lse: torch.Tensor, do: torch.Tensor, scale: float, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    T, H, _ = q.shape
    C, R, RP = _dims(q, latent, v_dim)
    dq = torch.empty_like(q)
    delta = torch.empty(T, H, dtype=torch.float32, device=q.device)
    dlatent = torch.zeros(latent.shape, dtype=torch.float32, device=q.device)
    if T:
        args = (H, scale, q.stride(0), q.stride(1), latent.stride(0), idx.stride(0), o.stride(0), o.stride(1))
        _sparse_mla_dq[(T, triton.cdiv(H, BH))](q, latent, idx, count, o, do, lse, delta, dq, *args,
                                                 C=C, R=R, RP=RP, BH=BH, BK=BK, num_warps=4, num_stages=2)
        _sparse_mla_dlatent[(T,)](q, latent, idx, count, do, lse, delta, dlatent, *args, dlatent.stride(0),
                                  C=C, R=R, RP=RP, BH=BH, BK=DLATENT_BK, num_warps=DLATENT_WARPS, num_stages=1)
    return dq, dlatent
