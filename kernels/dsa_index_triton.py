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
