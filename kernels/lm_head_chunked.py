"""Chunked torch implementations of the two LM-head primitives (the CPU path, and any device without triton).

Same memory shape as the Triton path: logits never exist beyond one [chunk_tokens, chunk_vocab] fp32 tile, and the
log-sum-exp is online (running max) across vocab chunks. Same signatures as kernels/lm_head_triton.py.

Shape legend: T tokens, H hidden, V vocab rows (this rank's or this chunk's), Tc/Vc chunk sizes.
"""

from __future__ import annotations

import torch

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


def stats_from_logits(z_TV, tgt_T, inv_temp: float, with_entropy: bool, lse_T, ent_T, tz_T) -> None:
    """Per-row (lse, entropy, target x) of an fp32 logits chunk, written into the given vectors."""
    lse, ent, tz = token_stats_of_logits(z_TV * inv_temp, tgt_T, with_entropy)
    lse_T.copy_(lse)
    ent_T.copy_(ent)
    tz_T.copy_(tz)


def token_stats_of_logits(x_TV, tgt_T, with_entropy: bool):
    lse_T = torch.logsumexp(x_TV, 1)
    ent_T = torch.zeros_like(lse_T)
    if with_entropy:
        m_T = x_TV.amax(1, keepdim=True)
        e_TV = torch.exp(x_TV - m_T)
        s_T = e_TV.sum(1)
        ent_T = torch.log(s_T) - (e_TV * (x_TV - m_T)).sum(1) / s_T
    V = x_TV.shape[1]
    hit = (tgt_T >= 0) & (tgt_T < V)
    tz_T = torch.where(hit, x_TV.gather(1, tgt_T.clamp(0, V - 1)[:, None])[:, 0], 0.0)
    return lse_T, ent_T, tz_T


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
