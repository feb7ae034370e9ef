"""The torch backend of the LM head: the kernels of kernels/lm_head/triton_backend.py written in torch, tile by tile
(the CPU path, and any device without triton). Same functions, same signatures, same memory shape: logits never
exist beyond one [tokens, tile] block.

Shape legend: T tokens, H hidden, V vocab rows (this rank's or this chunk's), N = ceil(V / tile width) tiles.
z = h . w; x = z / temperature, or c tanh(z / c) / temperature with a soft cap c (softcap; None: none); x2 = x log2 e;
statistics in log2 units where named *2.
"""

from __future__ import annotations

import torch

from kernels.lm_head.numerics import (
    E_LOG2, E_SCALE, LN2, LOG2E, PARTS_PER_TILE, Coefficients, TileStats, softcap_slope, weight_columns)

LOGITS_TILE_VOCAB = 4096  # the tile width of logits_tiles here (tests shrink it to cross tile edges)
TARGET_CHUNK_TOKENS = 4096  # target_logits gathers this many rows of the weight at a time


def tile_vocab(hidden_TH) -> int:
    """The vocab width of logits_tiles' tiles (its statistics are [T / this] per token)."""
    return LOGITS_TILE_VOCAB


def _x_from_z(z, inv_temp: float, softcap: float | None, log2_units: bool = False):
    """x (x2 with log2_units) from fp32 logits z: z / temperature, or c tanh(z / c) / temperature."""
    k = inv_temp * (LOG2E if log2_units else 1.0)
    if softcap is None:
        return z * k
    return torch.tanh(z * (1.0 / softcap)) * (softcap * k)


def target_logits(hidden_TH, weight_VH, tgt_T, inv_temp: float, out=None, softcap=None):
    """tz [T] fp32: each token's x at its target (0 where the target is outside [0, V)), one gathered dot a
    token in fp32, chunked so that no [T, H] fp32 copy exists."""
    T, V = hidden_TH.shape[0], weight_VH.shape[0]
    out = torch.empty(T, dtype=torch.float32, device=hidden_TH.device) if out is None else out
    for t0 in range(0, T, TARGET_CHUNK_TOKENS):
        t1 = min(t0 + TARGET_CHUNK_TOKENS, T)
        tgt = tgt_T[t0:t1]
        hit = (tgt >= 0) & (tgt < V)
        w_tH = weight_VH[tgt.clamp(0, max(V - 1, 0))].float()
        tz = _x_from_z((hidden_TH[t0:t1].float() * w_tH).sum(1), inv_temp, softcap)
        out[t0:t1] = torch.where(hit, tz, 0.0)
    return out


def logits_tiles(hidden_TH, weight_VH, tgt_T, inv_temp: float, with_entropy: bool, e_TV=None, parts=None,
                 merge=True, softcap=None) -> TileStats:
    """The logits GEMM with the statistics in its epilogue: per [T, tile] logits block, each row's max m2 and the
    block's own lse2 and entropy; 2^14 e = 2^(x2 - m2 + 14) written into e_TV (its dtype; [T, >= V], its columns
    past V written as zeros, within the last tile) when given. parts: a flat
    fp32 buffer of at least PARTS_PER_TILE T N elements for the per-tile statistics (else allocated). merge=False:
    the tile maxima only (no lse2, ent, tz)."""
    T = hidden_TH.shape[0]
    V = weight_VH.shape[0]
    tile = LOGITS_TILE_VOCAB
    n_tiles = -(-V // tile)
    n_parts = PARTS_PER_TILE * n_tiles * T
    if parts is None:
        parts = torch.zeros(n_parts, dtype=torch.float32, device=hidden_TH.device)
    m2_NT, lse2_NT, ent_NT = parts[:n_parts].view(PARTS_PER_TILE, n_tiles, T).unbind(0)
    ent_NT.zero_()  # (written only with entropy)
    if weight_columns(e_TV, V, n_tiles * tile) > V:
        e_TV[:, V:] = 0
    h_TH = hidden_TH.float()
    for i, v0 in enumerate(range(0, V, tile)):
        v1 = min(v0 + tile, V)
        x2_Tv = _x_from_z(h_TH @ weight_VH[v0:v1].float().T, inv_temp, softcap, log2_units=True)
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
        return TileStats(m2_NT, tile)
    lse2_T, ent_T = merge_tiles(lse2_NT, ent_NT, with_entropy)
    return TileStats(m2_NT, tile, lse2_T, ent_T, target_logits(hidden_TH, weight_VH, tgt_T, inv_temp,
                                                              softcap=softcap))


def merge_tiles(lse2_NT, ent_NT, with_entropy: bool):
    """Per-tile statistics merged like vocab splits, lse in log2 units: (lse2 [T], entropy [T] or zeros)."""
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


def dlogits_from_tiles(e_TV, tiles: TileStats, tgt_T, lse2_T, coef: Coefficients, inv_temp: float, scale,
                       softcap=None) -> None:
    """In place over e_TV (2^14 e): scale * dloss/dz with p = e exp2(m2 - lse2), x = (m2 + log2 e) ln 2; with a cap
    the p term times softcap_slope(x) (coef.c carries the target's: numerics.cap_target_term)."""
    T, V = e_TV.shape
    tile_v = tiles.tile_v
    for i, v0 in enumerate(range(0, V, tile_v)):
        v1 = min(v0 + tile_v, V)
        e_Tv = e_TV[:, v0:v1].float()
        p_Tv = e_Tv * torch.exp2(tiles.m2[i] - lse2_T - E_LOG2)[:, None]
        factor = coef.a[:, None]
        if coef.b is not None or softcap is not None:  # (e = 0: p = 0, whatever x is taken as)
            x_Tv = torch.where(e_Tv > 0, (tiles.m2[i][:, None] + torch.log2(e_Tv) - E_LOG2) * LN2, 0.0)
        if coef.b is not None:
            factor = factor + coef.b[:, None] * x_Tv
        if softcap is not None:
            factor = factor * softcap_slope(x_Tv, softcap, inv_temp)
        dz_Tv = p_Tv * factor
        local = tgt_T - v0
        hit = (local >= 0) & (local < v1 - v0)
        rows = torch.nonzero(hit)[:, 0]
        dz_Tv[rows, local[rows]] += coef.c[rows]
        e_TV[:, v0:v1] = dz_Tv * (inv_temp * scale)


def dlogits_from_logits(z_TV, tgt_T, v_off: int, coef: Coefficients, inv_temp: float, scale, out_TV, softcap=None):
    """out_TV = scale * dloss/dz from an fp32 logits chunk z (coef.b given: zeros for b = 0); with a cap the p term
    times 1 - tanh^2(z / c) (coef.c carries the target's: numerics.cap_target_term)."""
    x_TV = _x_from_z(z_TV, inv_temp, softcap)
    dz_TV = torch.exp(x_TV - coef.lse[:, None]) * (coef.a[:, None] + coef.b[:, None] * x_TV)
    if softcap is not None:
        dz_TV = dz_TV * softcap_slope(x_TV, softcap, inv_temp)
    local = tgt_T - v_off
    hit = (local >= 0) & (local < z_TV.shape[1])
    rows = torch.nonzero(hit)[:, 0]
    dz_TV[rows, local[rows]] += coef.c[rows]
    out_TV.copy_(dz_TV * (inv_temp * scale))
    return out_TV


def dw_acc(acc_VH, dz_TV, h_TH, scale, first: bool) -> None:
    """acc (fp32 [V, H]) = (first) or += dz^T @ (h * scale) in fp32."""
    upd = dz_TV.float().T @ (h_TH.float() * scale)
    if first:
        acc_VH.copy_(upd)
    else:
        acc_VH.add_(upd)
