"""Triton kernel of kernels/dsa_index.py: one program per [BM queries × BN keys] tile of the index scores. It loads
the tile's keys once, then for each index head j its queries' [BM, I] rows and w[:, j], and adds
w[:, j] · relu(scale · q_j kᵀ) to an fp32 accumulator; invisible keys (another document, or after the query) get
−inf. A tile whose keys are all after its last query, or all before its first query's document, skips the products.
Imported lazily (the CPU path never imports triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _index_scores_kernel(Q, W, K, OUT, QIDX, QSTART, T, S, N, lo, scale, qs_t, qs_n, ks_s, os_t,
                         I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr):
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mr, mc = rows < T, cols < S
    qi = tl.load(QIDX + rows, mask=mr, other=-1)
    qs = tl.load(QSTART + rows, mask=mr, other=1 << 62)
    key = lo + cols
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if (tl.min(key) <= tl.max(qi)) & (tl.max(key) >= tl.min(qs)):
        i = tl.arange(0, I)
        k = tl.load(K + cols[:, None] * ks_s + i[None, :], mask=mc[:, None], other=0.0)  # [BN, I]
        for j in range(N):
            q = tl.load(Q + rows[:, None] * qs_t + j * qs_n + i[None, :], mask=mr[:, None], other=0.0)  # [BM, I]
            w = tl.load(W + rows * N + j, mask=mr, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            acc += w[:, None] * tl.maximum(s * scale, 0.0)
    visible = (key[None, :] >= qs[:, None]) & (key[None, :] <= qi[:, None])
    acc = tl.where(visible, acc, float("-inf"))
    tl.store(OUT + rows[:, None] * os_t + cols[None, :], acc, mask=mr[:, None] & mc[None, :])


TILE = (64, 128, 4)  # queries and keys a program scores, and its warps


def index_scores(q_TNI: torch.Tensor, w_TN: torch.Tensor, k_SI: torch.Tensor, query_index: torch.Tensor,
                 doc_start: torch.Tensor, lo: int, scale: float, tile: tuple[int, int, int] | None = None
                 ) -> torch.Tensor:
    T, N, I = q_TNI.shape
    S = k_SI.shape[0]
    if I & (I - 1) or I < 16:
        raise ValueError(f"the index kernel takes a power-of-two index head width of at least 16, got {I}")
    out = torch.empty(T, S, dtype=torch.float32, device=q_TNI.device)
    if T == 0 or S == 0:
        return out
    BM, BN, warps = tile or TILE
    grid = (triton.cdiv(T, BM), triton.cdiv(S, BN))
    _index_scores_kernel[grid](q_TNI, w_TN, k_SI, out, query_index, doc_start, T, S, N, lo, scale,
                               q_TNI.stride(0), q_TNI.stride(1), k_SI.stride(0), out.stride(0),
                               I=I, BM=BM, BN=BN, num_warps=warps, num_stages=2,
                               PRECISION="ieee" if q_TNI.dtype == torch.float32 else "tf32")
    return out


@triton.jit
def _ordered_key(x):
    """fp32 → int64 in [0, 2^32) ordering as the floats do (−0 as +0): the bits made order-preserving as int32 (negative
    ones reflected), then shifted to non-negative."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return ordered.to(tl.int64) + 2147483648


@triton.jit
def _topk_select_kernel(SCORE, OUT, START, END, K, lo, ss_t, os_t, BLOCK: tl.constexpr):
    """One row: the K highest scores' columns, equal scores at the K-th going to the earlier column. Radix select on
    the ordered 32-bit keys, 8 bits a pass (a 256-bin histogram of the keys that match the prefix found so far; keys
    that do not go to bin 256), then one pass writing the columns above the threshold and, after them, the first
    columns equal to it; a −inf score (a key the query cannot see) is written as −1."""
    t = tl.program_id(0).to(tl.int64)
    start = tl.load(START + t)
    end = tl.load(END + t)
    row = SCORE + t * ss_t
    bins = tl.arange(0, 512)
    prefix = tl.zeros((), dtype=tl.int64)
    decided = tl.zeros((), dtype=tl.int64)  # the key bits fixed so far
    need = tl.minimum(end - start, K).to(tl.int64)  # every column in [start, end) is a key the query sees
    wanted = need
    for p in range(4):
        shift = 24 - 8 * p
        hist = tl.zeros((512,), dtype=tl.int32)
        for c0 in range(start, end, BLOCK):
            col = c0 + tl.arange(0, BLOCK)
            key = _ordered_key(tl.load(row + col, mask=col < end, other=float("-inf")))
            match = ((key & decided) == prefix) & (col < end)
            digit = tl.where(match, (key >> shift) & 255, 256).to(tl.int32)
            hist += tl.histogram(digit, 512)
        h = tl.where(bins < 256, hist, 0).to(tl.int64)
        suffix = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # keys matching so far with this digit or a higher one
        b = tl.sum(((suffix >= need) & (bins < 256)).to(tl.int64), 0) - 1
        above = tl.sum(tl.where(bins == b + 1, suffix, 0), 0)
        need = need - above
        prefix = prefix | (b << shift)
        decided = decided | (255 << shift)
    # prefix is the K-th key; `need` of the keys equal to it are taken (the earliest), every key above it
    n_above = wanted - need
    taken_above = tl.zeros((), dtype=tl.int64)
    taken_equal = tl.zeros((), dtype=tl.int64)
    for c0 in range(start, end, BLOCK):
        col = c0 + tl.arange(0, BLOCK)
        x = tl.load(row + col, mask=col < end, other=float("-inf"))
        key = _ordered_key(x)
        inside = col < end
        gt = (key > prefix) & inside
        eq = (key == prefix) & inside
        pos_gt = taken_above + tl.cumsum(gt.to(tl.int64), 0) - 1
        pos_eq = taken_equal + tl.cumsum(eq.to(tl.int64), 0) - 1
        value = tl.where(x == float("-inf"), -1, col + lo).to(tl.int32)
        tl.store(OUT + t * os_t + pos_gt, value, mask=gt)
        tl.store(OUT + t * os_t + n_above + pos_eq, value, mask=eq & (pos_eq < need))
        taken_above += tl.sum(gt.to(tl.int64), 0)
        taken_equal += tl.sum(eq.to(tl.int64), 0)


def topk_select(score: torch.Tensor, k: int, lo: int, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """[n, k] int32 key indices (column + lo; −1 for a −inf score) of each row's k highest scores among its columns
    [start, end) (every column outside them is −inf), ties at the k-th to the earlier column; the columns above the
    k-th score first, in column order, then those equal to it."""
    n = score.shape[0]
    out = torch.full((n, k), -1, dtype=torch.int32, device=score.device)
    if n and k:
        _topk_select_kernel[(n,)](score, out, start, end, k, lo, score.stride(0), out.stride(0), BLOCK=1024,
                                  num_warps=4)
    return out
