"""DeepSeek sparse attention's index scores and top-k selection (launch/sparse_attention.py). Scores, for a block of
queries and a span of keys,

    score(t, s) = Σ_j w[t, j] · relu(scale · qI[t, j] · kI[s])      where doc_start[t] ≤ s ≤ query_index[t], else −inf

as one [queries, span] fp32 tensor. The torch path forms the [queries, N, span] products of all N index heads and
sums them; the Triton kernel (kernels/dsa_index_triton.py) keeps one [BM, BN] fp32 tile of the sum in registers and
runs the N heads' products into it one after another (tensor-core dots of bf16 inputs into fp32), so no per-head
tensor is ever written, and tiles with no visible key are not computed.

Selection (`select_keys`): each query's K highest scores, equal scores at the K-th going to the earlier key, so
that the selection is the same whatever span of keys a block is scored against (one process or a context-parallel
rank), where torch.topk's own choice among ties is not (ReLU makes exact ties common: a key no index head responds
to scores 0); the keys come out in ascending order, −1 after them (a query that sees fewer than K). Ascending keys
make the attention's order of summation the same whatever block or rank selects them.

The Triton kernel (kernels/dsa_index_triton.py) selects one row a program, reading only the row's visible columns.
Scores compare as order-preserving uint32 keys. It finds the K-th highest key t exactly, then writes, in one pass in
key order, every key above t and the first K − #(above t) keys equal to it (a running count: the earlier keys). A row
of at most 8,192 visible keys is held in registers and t found by a bitwise search (32 masked counts, from the top
bit: the largest t with at least K keys ≥ t). A longer row of n keys is bracketed first: an evenly spaced sample of
4,096 of its scores, whose count above the K-th is about 4,096·K/n with a standard deviation σ of
√(4,096·f(1 − f)), f = K/n, gives two of its order statistics, 5σ + 1 either side of that count; one pass counts
the keys above the bracket and at its two ends and gathers those strictly inside it (about 10σ/4,096 of the row:
~2,700 of 131,072 at K = 2,048), and the bitwise search over the gathered ones places t. Where the sample missed
(the K-th outside the bracket) or more than 8,192 keys fall inside it, the row takes the same bitwise search over
the whole row, a pass a bit (`bench/bench_sparse_attention.py` counts those rows). So a long row is read twice (the
bracket's pass, the write) plus the sample, never sorted, and the result never depends on the sample; the kernels'
derivation is in docs/sparse_attention.md. The torch path (`topk_select`, the reference) runs topk on the fp32
scores, selects again on int64 ranks (`_ranked`) the rows whose K-th score also sits outside the selection, and
sorts each row's keys.

Backends as in kernels/gdn_fused.py: "auto" runs Triton on CUDA/ROCm tensors when triton is installed and the torch
path otherwise.
"""

from __future__ import annotations

import torch

from kernels.gdn_fused import _pick_backend

SELECT_CAP = 8192  # keys the selection kernel holds in registers for its exact search (a power of two)


def index_scores_torch(q_TNI: torch.Tensor, w_TN: torch.Tensor, k_SI: torch.Tensor, query_index: torch.Tensor,
                       doc_start: torch.Tensor, lo: int, scale: float) -> torch.Tensor:
    """The torch path (the CPU path, and the reference the kernel is tested against). k_SI holds the span's keys,
    the first being key `lo`; query_index and doc_start are the queries' [T] int64 key indices."""
    T, N, I = q_TNI.shape
    s = torch.relu(q_TNI.float().reshape(T * N, I) @ k_SI.float().T * scale).view(T, N, -1)
    score = torch.bmm(w_TN.float().unsqueeze(1), s).squeeze(1)
    keys = torch.arange(lo, lo + k_SI.shape[0], device=q_TNI.device)
    visible = (keys[None, :] >= doc_start[:, None]) & (keys[None, :] <= query_index[:, None])
    return score.masked_fill(~visible, float("-inf"))


def index_scores(q_TNI: torch.Tensor, w_TN: torch.Tensor, k_SI: torch.Tensor, query_index: torch.Tensor,
                 doc_start: torch.Tensor, lo: int, scale: float, backend: str | None = "auto",
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """[T, S] fp32 index scores of T queries (qI [T, N, I], head weights w [T, N]) against the span's S keys
    (kI [S, I], key `lo` first), −inf outside each query's document or after it (module docstring). The Triton
    path writes them into `out` ([T, S] fp32, rows contiguous) where given: a buffer reused across blocks."""
    if _pick_backend(q_TNI, backend) == "torch":
        return index_scores_torch(q_TNI, w_TN, k_SI, query_index, doc_start, lo, scale)
    from kernels import dsa_index_triton  # lazy: the CPU path never imports triton

    return dsa_index_triton.index_scores(q_TNI.contiguous(), w_TN.float().contiguous(), k_SI.contiguous(),
                                         query_index, doc_start, lo, scale, out=out)


def select_keys(score: torch.Tensor, query_index: torch.Tensor, doc_start: torch.Tensor, lo: int, k: int,
                out: torch.Tensor, backend: str | None = "auto") -> None:
    """Writes each row's k highest-scoring keys (module docstring, "Selection") into out[:, :k] (int32, −1 past a
    query's visible keys), for a block of queries' [n, S] scores over the keys lo..lo + S − 1 (`index_scores`: −inf
    outside each query's doc_start..query_index)."""
    # the kernels' gathered keys hold a bracket around the k-th only while k is well inside SELECT_CAP (DSA's 2,048
    # is a quarter of it); a larger k selects by topk
    if _pick_backend(score, backend) == "torch" or k > SELECT_CAP // 2:
        out[:, :k] = topk_select(score, k, lo)
        return
    from kernels import dsa_index_triton  # lazy: the CPU path never imports triton

    out[:, :k] = -1
    dsa_index_triton.select(score, query_index, doc_start, lo, k, out)


def topk_select(score: torch.Tensor, k: int, lo: int) -> torch.Tensor:
    """[n, k] int32: each row's k highest scores' keys (column + lo), ties at the k-th to the earlier key, the keys a
    query sees in ascending order and −1 after them (a −inf score: a key its query does not see). A row has a tie at
    its k-th score left out exactly when more than k of its scores are at least the k-th (every higher one is
    selected), and only those rows are selected again on int64 ranks. Ascending keys make the selection's order, and
    so the attention's order of summation, the same whatever block or rank selects it (topk's order among equal
    scores is not)."""
    val, idx = score.topk(k, dim=-1, sorted=False)
    kth = val.amin(-1, keepdim=True)
    tied = torch.isfinite(kth[:, 0]) & ((score >= kth).sum(-1) > k)
    if bool(tied.any()):
        rows = tied.nonzero().squeeze(1)
        keys = torch.arange(lo, lo + score.shape[1], device=score.device)
        idx[rows] = _ranked(score[rows], keys).topk(k, dim=-1, sorted=False).indices
        val = score.gather(1, idx)
    last = torch.iinfo(torch.int32).max  # the unseen keys sort after the seen ones, then read −1
    idx = torch.where(torch.isfinite(val), idx.int() + lo, last).sort(dim=-1).values
    return torch.where(idx == last, -1, idx)


def _ranked(score: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """int64 ranks that order as the fp32 scores do, equal scores broken by the earlier key. The float's bits are made
    order-preserving as integers (negative ones reflected), −0 counted as +0."""
    bits = (score + 0.0).view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(torch.int64) << 32) | ((1 << 32) - 1 - keys)
