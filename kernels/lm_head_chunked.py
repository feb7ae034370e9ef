"""Chunked torch implementations of the two LM-head primitives (the CPU path, and any device without triton).

Same memory shape as the Triton path: logits never exist beyond one [chunk_tokens, chunk_vocab] fp32 tile, and the
log-sum-exp is online (running max) across vocab chunks. Same signatures as kernels/lm_head_triton.py.

Shape legend: T tokens, H hidden, V vocab rows (this rank's or this chunk's), Tc/Vc chunk sizes.
"""

from __future__ import annotations

import torch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# logits_tiles stores its tile weights times 2^14: e in (0, 1] lands in (0, 2^14], inside fp16's normal range down
# to e = 2^-28 (unscaled, fp16 would go subnormal, losing bits, below e = 2^-14)
E_LOG2 = 14.0
E_SCALE = 2.0**E_LOG2
# logits_tiles' per-tile statistics, fp32 [num_tiles, T] each: the tile's max, its own lse, its entropy
PARTS_PER_TILE = 3
STATS_CHUNK_TOKENS = 4096
STATS_CHUNK_VOCAB = 4096


def token_stats(hidden_TH, weight_VH, tgt_T, inv_temp: float, with_entropy: bool,
                chunk_tokens: int = STATS_CHUNK_TOKENS, chunk_vocab: int = STATS_CHUNK_VOCAB):
    """Per-token (lse, entropy, x at the target) with x = (h . w) * inv_temp, in fp32 (entropy zeros unless
    with_entropy). The entropy is log s - sum e (x - m) / s with e = exp(x - m): no cancellation at large |x|."""
    T = hidden_TH.shape[0]
    V = weight_VH.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden_TH.device)
    lse_T = torch.empty(T, **f32)
    ent_T = torch.zeros(T, **f32)
    tz_T = torch.zeros(T, **f32)
    for t0 in range(0, T, chunk_tokens):
        t1 = min(t0 + chunk_tokens, T)
        h_tH = hidden_TH[t0:t1].float()
        tgt_t = tgt_T[t0:t1]
        m_t = torch.full((t1 - t0,), float("-inf"), **f32)  # running max of x
        s_t = torch.zeros(t1 - t0, **f32)  # sum of exp(x - m)
        wy_t = torch.zeros(t1 - t0, **f32)  # sum of exp(x - m) * (x - m)
        for v0 in range(0, V, chunk_vocab):
            v1 = min(v0 + chunk_vocab, V)
            x_tv = (h_tH @ weight_VH[v0:v1].float().T) * inv_temp
            m_new = torch.maximum(m_t, x_tv.amax(1))
            alpha = torch.exp(m_t - m_new)
            e_tv = torch.exp(x_tv - m_new[:, None])
            if with_entropy:
                shift = torch.where(s_t > 0, m_t - m_new, 0.0)
                wy_t = alpha * (wy_t + shift * s_t) + (e_tv * (x_tv - m_new[:, None])).sum(1)
            s_t = s_t * alpha + e_tv.sum(1)
            m_t = m_new
            local = tgt_t - v0
            hit = (local >= 0) & (local < v1 - v0)
            tz_T[t0:t1] += torch.where(hit, x_tv.gather(1, local.clamp(0, v1 - v0 - 1)[:, None])[:, 0], 0.0)
        lse_T[t0:t1] = m_t + torch.log(s_t)
        if with_entropy:
            ent_T[t0:t1] = torch.log(s_t) - wy_t / s_t
    return lse_T, ent_T, tz_T


def combine_splits(lse_ST, ent_ST, tz_ST):
    """Merge per-split stats over dim 0 (vocab splits): with q_s = exp(lse_s - lse) the split's share of the
    mass, entropy = sum_s q_s ent_s - sum_s q_s log q_s. Empty splits carry lse = -inf and drop out."""
    max_T = lse_ST.amax(0)
    scale_ST = torch.exp(lse_ST - max_T)
    sum_T = scale_ST.sum(0)
    lse_T = max_T + torch.log(sum_T)
    log_q_ST = torch.where(scale_ST > 0, lse_ST - lse_T, 0.0)
    ent_T = (scale_ST * (ent_ST - log_q_ST)).sum(0) / sum_T
    return lse_T, ent_T, tz_ST.sum(0)


def dlogits(hidden_TH, weight_VH, tgt_T, v_off: int, lse_T, a_T, b_T, c_T, inv_temp: float, scale, out_TV):
    """out_TV = scale * (p * (a + b x) + c * onehot(target)) * inv_temp with p = exp(x - lse), for one chunk."""
    z_TV = hidden_TH.float() @ weight_VH.float().T
    return dlogits_from_logits(z_TV, tgt_T, v_off, lse_T, a_T, b_T, c_T, inv_temp, scale, out_TV)


def dlogits_from_logits(z_TV, tgt_T, v_off: int, lse_T, a_T, b_T, c_T, inv_temp: float, scale, out_TV):
    """out_TV = scale * dloss/dlogit from an fp32 logits chunk."""
    x_TV = z_TV * inv_temp
    dz_TV = torch.exp(x_TV - lse_T[:, None]) * (a_T[:, None] + b_T[:, None] * x_TV)
    local = tgt_T - v_off
    hit = (local >= 0) & (local < z_TV.shape[1])
    rows = torch.nonzero(hit)[:, 0]
    dz_TV[rows, local[rows]] += c_T[rows]
    out_TV.copy_(dz_TV * (inv_temp * scale))
    return out_TV


LOGITS_TILE_VOCAB = 4096  # the tile width of logits_tiles here (tests shrink it to cross tile edges)


def tile_vocab(hidden_TH) -> int:
    """The vocab width of logits_tiles' tiles (its statistics are [T / this] per token)."""
    return LOGITS_TILE_VOCAB


def target_logits(hidden_TH, weight_VH, tgt_T, inv_temp: float, out=None):
    """tz [T] fp32: each token's logit at its target (0 where the target is outside [0, V)), one gathered dot a
    token in fp32, chunked like the rest so no [T, H] fp32 copy exists."""
    T, V = hidden_TH.shape[0], weight_VH.shape[0]
    out = torch.empty(T, dtype=torch.float32, device=hidden_TH.device) if out is None else out
    for t0 in range(0, T, STATS_CHUNK_TOKENS):
        t1 = min(t0 + STATS_CHUNK_TOKENS, T)
        tgt = tgt_T[t0:t1]
        hit = (tgt >= 0) & (tgt < V)
        w_tH = weight_VH[tgt.clamp(0, max(V - 1, 0))].float()
        tz = (hidden_TH[t0:t1].float() * w_tH).sum(1) * inv_temp
        out[t0:t1] = torch.where(hit, tz, 0.0)
    return out


def logits_tiles(hidden_TH, weight_VH, tgt_T, inv_temp: float, with_entropy: bool, e_TV=None, config=None,
                 parts=None, merge=True):
    """The Triton logits_tiles in torch, tile by tile: per [T, tile] logits block, each row's max m2 and the
    block's own lse2 (log2 units: x2 = x log2 e) and entropy; 2^14 e = 2^(x2 - m2 + 14) written into e_TV (its
    dtype) when given. Returns (m2 [num_tiles, T], lse2 [T], ent [T], tz [T] (target_logits), tile width). parts:
    a flat fp32 buffer of at least PARTS_PER_TILE T num_tiles elements for the per-tile statistics (else
    allocated). merge=False: lse2, ent, tz come back as None."""
    T = hidden_TH.shape[0]
    V = weight_VH.shape[0]
    tile = LOGITS_TILE_VOCAB
    n_tiles = -(-V // tile)
    n_parts = PARTS_PER_TILE * n_tiles * T
    if parts is None:
        parts = torch.zeros(n_parts, dtype=torch.float32, device=hidden_TH.device)
    m2_NT, lse2_NT, ent_NT = parts[:n_parts].view(PARTS_PER_TILE, n_tiles, T).unbind(0)
    ent_NT.zero_()  # (written only with entropy)
    h_TH = hidden_TH.float()
    for i, v0 in enumerate(range(0, V, tile)):
        v1 = min(v0 + tile, V)
        x2_Tv = (h_TH @ weight_VH[v0:v1].float().T) * (inv_temp * LOG2E)
        m2_NT[i] = x2_Tv.amax(1)
        y2_Tv = x2_Tv - m2_NT[i][:, None]
        e_Tv = torch.exp2(y2_Tv)
        s_T = e_Tv.sum(1)
        lse2_NT[i] = m2_NT[i] + torch.log2(s_T)
        if with_entropy:
            ent_NT[i] = torch.log(s_T) - (e_Tv * y2_Tv).sum(1) * LN2 / s_T
        if e_TV is not None:
            e_TV[:, v0:v1] = e_Tv * E_SCALE
    if not merge:
        return m2_NT, None, None, None, tile
    lse2_T, ent_T = combine_tiles(lse2_NT, ent_NT, with_entropy)
    return m2_NT, lse2_T, ent_T, target_logits(hidden_TH, weight_VH, tgt_T, inv_temp), tile


def combine_tiles(lse2_NT, ent_NT, with_entropy: bool):
    """combine_splits for per-tile stats with lse in log2 units: (lse2 [T], entropy [T] or zeros)."""
    if lse2_NT.shape[0] == 1:
        return lse2_NT[0], (ent_NT[0] if with_entropy else torch.zeros_like(ent_NT[0]))
    max_T = lse2_NT.amax(0)
    q_NT = torch.exp2(lse2_NT - max_T)  # the tile's share of the mass, times sum_T
    sum_T = q_NT.sum(0)
    lse2_T = max_T + torch.log2(sum_T)
    if with_entropy:
        log_q_NT = torch.where(q_NT > 0, (lse2_NT - lse2_T) * LN2, 0.0)
        ent_T = (q_NT * (ent_NT - log_q_NT)).sum(0) / sum_T
    else:
        ent_T = torch.zeros_like(lse2_T)
    return lse2_T, ent_T


def dlogits_from_tiles(e_TV, m2_NT, tile_v: int, tgt_T, lse2_T, a_T, b_T, c_T, inv_temp: float, scale,
                       has_b: bool = True) -> None:
    """In place over e_TV (2^14 e): scale * dloss/dlogit with p = e exp2(m2 - lse2), x = (m2 + log2 e) ln 2."""
    T, V = e_TV.shape
    for i, v0 in enumerate(range(0, V, tile_v)):
        v1 = min(v0 + tile_v, V)
        e_Tv = e_TV[:, v0:v1].float()
        p_Tv = e_Tv * torch.exp2(m2_NT[i] - lse2_T - E_LOG2)[:, None]
        coef = a_T[:, None]
        if has_b:
            x_Tv = torch.where(e_Tv > 0, (m2_NT[i][:, None] + torch.log2(e_Tv) - E_LOG2) * LN2, 0.0)
            coef = coef + b_T[:, None] * x_Tv
        dz_Tv = p_Tv * coef
        local = tgt_T - v0
        hit = (local >= 0) & (local < v1 - v0)
        rows = torch.nonzero(hit)[:, 0]
        dz_Tv[rows, local[rows]] += c_T[rows]
        e_TV[:, v0:v1] = dz_Tv * (inv_temp * scale)


def dw_acc(acc_VH, dz_TV, h_TH, scale, first: bool) -> None:
    """acc (fp32 [V, H]) = (first) or += dz^T @ (h * scale) in fp32: the Triton dw_acc in torch."""
    upd = dz_TV.float().T @ (h_TH.float() * scale)
    if first:
        acc_VH.copy_(upd)
    else:
        acc_VH.add_(upd)
