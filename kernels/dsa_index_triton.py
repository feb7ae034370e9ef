"""Triton kernels of kernels/dsa_index.py.

Index scores: one program per [BM queries × BN keys] tile. It loads the tile's keys once, then for each index head j
its queries' [BM, I] rows and w[:, j], and adds w[:, j] · relu(scale · q_j kᵀ) to an fp32 accumulator; invisible keys
(another document, or after the query) get −inf. A tile whose keys are all after its last query, or all before its
first query's document, skips the products.

Top-k selection (`select`): four kernels a block of queries, one program a row each, passing a row's state through a
small int32 array: the bracket (`_select_bracket`: a short row's threshold, a long row's sample), the gather
(`_select_gather`), the search (`_select_search`) and the write in key order (`_select_write`); kernels/dsa_index.py
and docs/sparse_attention.md derive them.

Imported lazily (the CPU path never imports triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import dsa_index


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
                 doc_start: torch.Tensor, lo: int, scale: float, tile: tuple[int, int, int] | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    T, N, I = q_TNI.shape
    S = k_SI.shape[0]
    if I & (I - 1) or I < 16:
        raise ValueError(f"the index kernel takes a power-of-two index head width of at least 16, got {I}")
    if out is None:
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


# ---------------------------------------------------------------------------------------------------------------
# Top-k selection: one program a row (kernels/dsa_index.py, "Selection"). Scores are compared as order-preserving
# uint32 keys (a float's bits, negative ones inverted, the sign bit set on the others; −0 as +0).

SELECT_CONFIG = dict(BLOCK=1024, num_warps=4)  # scores a program reads at a time (< 2^16), and its warps
SELECT_CAP = dsa_index.SELECT_CAP
SELECT_SAMPLE = 4096  # scores sampled (evenly spaced) to bracket the k-th (a power of two, at most SELECT_CAP)
SELECT_Z = 5.0  # the bracket's half width, in standard deviations of the sample's count above the k-th


@triton.jit
def _ordered(s):
    bits = tl.where(s == 0.0, 0.0, s).to(tl.uint32, bitcast=True)  # −0 counts as +0
    sign = tl.full(bits.shape, 0x80000000, tl.uint32)
    return tl.where(bits >= sign, bits ^ tl.full(bits.shape, 0xFFFFFFFF, tl.uint32), bits | sign)


@triton.jit
def _kth_largest(u, valid, need):
    """The need-th largest of the valid keys u: the largest t with at least `need` of them ≥ t, found bit by bit
    from the top; all ones where need < 1."""
    t = tl.zeros((), dtype=tl.uint32)
    one = tl.full((), 1, tl.uint32)
    for bit in tl.static_range(31, -1, -1):
        c = t | (one << bit)
        n = tl.sum((valid & (u >= c)).to(tl.int32), axis=0)
        t = tl.where(n >= need, c, t)
    return t


@triton.jit
def _keys_at(src, start, offs, last):
    """Columns start + offs of a row, which of them are at most `last`, and their scores' keys (0 past `last`)."""
    cols = start + offs
    inside = cols <= last
    return cols, inside, _ordered(tl.load(src + cols, mask=inside, other=0.0))


@triton.jit
def _count_from(src, a, b, t, strict: tl.constexpr, BLOCK: tl.constexpr):
    """How many of the keys in columns a..b are above t (strict) or at least t."""
    offs = tl.arange(0, BLOCK)
    n = 0
    for start in range(a, b + 1, BLOCK):
        cols, inside, u = _keys_at(src, start, offs, b)
        hit = (u > t) if strict else (u >= t)
        n += tl.sum((inside & hit).to(tl.int32), axis=0)
    return n


# a row's state between the kernels (int32; keys stored by their bits): what the bracket kernel left it, the bracket,
# the gather's counts, then the threshold and the count above it
MODE, HI, LO, C_HI, E_HI, E_LO, GATHERED, T, ABOVE = (tl.constexpr(i) for i in range(9))
STATE_WIDTH = tl.constexpr(16)  # (a row's 64 bytes)


@triton.jit
def _row_span(QIDX, QSTART, row, S, lo):
    a = tl.maximum(tl.load(QSTART + row) - lo, 0)
    b = tl.minimum(tl.load(QIDX + row) - lo, S - 1)  # the row's visible columns are a..b
    return a, b


@triton.jit
def _select_bracket(SCORE, QIDX, QSTART, STATE, S, lo, k, zed, ss_r, CAP: tl.constexpr, SAMPLE: tl.constexpr):
    """A row of at most k visible keys takes them all (t = 0, below every score's key); one of at most CAP is held
    whole and its threshold found here; a longer one gets its bracket from an evenly spaced sample (mode 1)."""
    row = tl.program_id(0).to(tl.int64)
    a, b = _row_span(QIDX, QSTART, row, S, lo)
    n_vis = b - a + 1
    src = SCORE + row * ss_r
    st = STATE + row * STATE_WIDTH
    if n_vis > CAP:
        j = tl.arange(0, SAMPLE).to(tl.int64)
        us = _ordered(tl.load(src + a + j * n_vis // SAMPLE))
        f = k.to(tl.float32) / n_vis.to(tl.float32)
        half = zed * tl.sqrt(SAMPLE * f * (1.0 - f)) + 1.0
        hi_t = _kth_largest(us, j < SAMPLE, tl.floor(SAMPLE * f - half).to(tl.int32))  # all ones where < 1
        lo_t = _kth_largest(us, j < SAMPLE, tl.minimum(tl.ceil(SAMPLE * f + half).to(tl.int32), SAMPLE))
        tl.store(st + MODE, 1)
        tl.store(st + HI, hi_t.to(tl.int32, bitcast=True))
        tl.store(st + LO, lo_t.to(tl.int32, bitcast=True))
    else:
        t = tl.zeros((), dtype=tl.uint32)
        above = 0
        if n_vis > k:
            cap = tl.arange(0, CAP)
            u = _ordered(tl.load(src + a + cap, mask=cap < n_vis, other=0.0))
            t = _kth_largest(u, cap < n_vis, k)
            above = tl.sum(((cap < n_vis) & (u > t)).to(tl.int32), axis=0)
        tl.store(st + MODE, 0)
        tl.store(st + T, t.to(tl.int32, bitcast=True))
        tl.store(st + ABOVE, above)


@triton.jit
def _select_gather(SCORE, QIDX, QSTART, STATE, SCRATCH, S, lo, ss_r, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """A bracketed row's pass: the keys above the bracket and at its two ends counted, those strictly inside it
    gathered (the first CAP of them) and counted."""
    row = tl.program_id(0).to(tl.int64)
    st = STATE + row * STATE_WIDTH
    if tl.load(st + MODE) == 1:
        a, b = _row_span(QIDX, QSTART, row, S, lo)
        src = SCORE + row * ss_r
        hi_t = tl.load(st + HI).to(tl.uint32, bitcast=True)
        lo_t = tl.load(st + LO).to(tl.uint32, bitcast=True)
        offs = tl.arange(0, BLOCK)
        above = tl.zeros([BLOCK], dtype=tl.int32)  # counts a lane, summed after the pass
        at_hi = tl.zeros([BLOCK], dtype=tl.int32)
        at_lo = tl.zeros([BLOCK], dtype=tl.int32)
        m = 0
        dst = SCRATCH + row * CAP
        for start in range(a, b + 1, BLOCK):
            cols, inside, u = _keys_at(src, start, offs, b)
            above += (inside & (u > hi_t)).to(tl.int32)
            at_hi += (inside & (u == hi_t)).to(tl.int32)
            at_lo += (inside & (u == lo_t) & (lo_t < hi_t)).to(tl.int32)
            between = (inside & (u > lo_t) & (u < hi_t)).to(tl.int32)
            pos = m + tl.cumsum(between, axis=0) - 1
            tl.store(dst + pos, u.to(tl.int32, bitcast=True), mask=(between != 0) & (pos < CAP))
            m += tl.sum(between, axis=0)
        tl.store(st + C_HI, tl.sum(above, axis=0))
        tl.store(st + E_HI, tl.sum(at_hi, axis=0))
        tl.store(st + E_LO, tl.sum(at_lo, axis=0))
        tl.store(st + GATHERED, m)


@triton.jit
def _select_search(SCORE, QIDX, QSTART, STATE, SCRATCH, SLOW, S, lo, k, ss_r, CAP: tl.constexpr,
                   BLOCK: tl.constexpr):
    """A bracketed row's threshold: at an end of the bracket, or the search over the gathered keys; where the sample
    missed or the bracket held more than CAP keys, the search over the whole row (one pass a bit; SLOW set)."""
    row = tl.program_id(0).to(tl.int64)
    st = STATE + row * STATE_WIDTH
    if tl.load(st + MODE) == 1:
        hi_t = tl.load(st + HI).to(tl.uint32, bitcast=True)
        lo_t = tl.load(st + LO).to(tl.uint32, bitcast=True)
        c_hi = tl.load(st + C_HI)
        e_hi = tl.load(st + E_HI)
        e_lo = tl.load(st + E_LO)
        m = tl.load(st + GATHERED)
        t = tl.zeros((), dtype=tl.uint32)
        above = 0
        slow = 0
        if c_hi >= k:
            slow = 1
        elif c_hi + e_hi >= k:
            t = hi_t
            above = c_hi
        elif c_hi + e_hi + m >= k:
            if m > CAP:
                slow = 1
            else:
                cap = tl.arange(0, CAP)
                gathered = cap < m
                uc = tl.load(SCRATCH + row * CAP + cap, mask=gathered, other=0).to(tl.uint32, bitcast=True)
                t = _kth_largest(uc, gathered, k - c_hi - e_hi)
                above = c_hi + e_hi + tl.sum((gathered & (uc > t)).to(tl.int32), axis=0)
        elif c_hi + e_hi + m + e_lo >= k:
            t = lo_t
            above = c_hi + e_hi + m
        else:
            slow = 1
        if slow == 1:
            a, b = _row_span(QIDX, QSTART, row, S, lo)
            src = SCORE + row * ss_r
            bit = tl.full((), 0x80000000, tl.uint32)
            for _ in range(32):
                c = t | bit
                t = tl.where(_count_from(src, a, b, c, False, BLOCK) >= k, c, t)
                bit = bit >> 1
            above = _count_from(src, a, b, t, True, BLOCK)
            tl.store(SLOW + row, 1)
        tl.store(st + T, t.to(tl.int32, bitcast=True))
        tl.store(st + ABOVE, above)


@triton.jit
def _select_write(SCORE, OUT, QIDX, QSTART, STATE, S, lo, k, ss_r, os_r, BLOCK: tl.constexpr):
    """In key order: every key above the threshold t, then the first k − #(above t) keys equal to it."""
    row = tl.program_id(0).to(tl.int64)
    a, b = _row_span(QIDX, QSTART, row, S, lo)
    src = SCORE + row * ss_r
    st = STATE + row * STATE_WIDTH
    t = tl.load(st + T).to(tl.uint32, bitcast=True)
    need_eq = k - tl.load(st + ABOVE)
    offs = tl.arange(0, BLOCK)
    n_sel = 0
    n_eq = 0
    dst = OUT + row * os_r
    for start in range(a, b + 1, BLOCK):
        cols, inside, u = _keys_at(src, start, offs, b)
        above = (inside & (u > t)).to(tl.int32)
        eq = (inside & (u == t)).to(tl.int32)
        both = above + (eq << 16)  # one scan for both running counts (BLOCK < 2^16)
        run = tl.cumsum(both, axis=0)
        run_eq = n_eq + (run >> 16)  # keys equal to t up to and including this one, in the row
        taken = tl.minimum(run_eq, need_eq) - tl.minimum(n_eq, need_eq)
        sel = (above != 0) | ((eq != 0) & (run_eq <= need_eq))
        pos = n_sel + (run & 0xFFFF) + taken - 1
        tl.store(dst + pos, (cols + lo).to(tl.int32), mask=sel & (pos < k))
        total = tl.sum(both, axis=0)
        n_sel += (total & 0xFFFF) + tl.minimum(n_eq + (total >> 16), need_eq) - tl.minimum(n_eq, need_eq)
        n_eq += total >> 16


def select(score: torch.Tensor, query_index: torch.Tensor, doc_start: torch.Tensor, lo: int, k: int,
           out: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """Writes each row's selected keys (kernels/dsa_index.py `select_keys`) into `out`, whose rows hold at least
    min(k, visible) int32 and are −1 beyond them; returns the [n] int32 flags of the rows whose sample missed (1:
    selected by the whole-row search). `config`: the streaming kernels' BLOCK and num_warps (SELECT_CONFIG)."""
    n, S = score.shape
    slow = torch.zeros(n, dtype=torch.int32, device=score.device)
    if n == 0 or S == 0:
        return slow
    cfg = config or SELECT_CONFIG
    state = torch.empty(n, STATE_WIDTH.value, dtype=torch.int32, device=score.device)
    # the gathered keys of the rows longer than SELECT_CAP (none where the span is not)
    scratch = torch.empty(n if S > SELECT_CAP else 1, SELECT_CAP, dtype=torch.int32, device=score.device)
    args = (query_index, doc_start, state)
    _select_bracket[(n,)](score, *args, S, lo, k, SELECT_Z, score.stride(0), CAP=SELECT_CAP, SAMPLE=SELECT_SAMPLE,
                          num_warps=8)
    _select_gather[(n,)](score, *args, scratch, S, lo, score.stride(0), CAP=SELECT_CAP, **cfg)
    _select_search[(n,)](score, *args, scratch, slow, S, lo, k, score.stride(0), CAP=SELECT_CAP, num_warps=8,
                         BLOCK=cfg["BLOCK"])
    _select_write[(n,)](score, out, *args, S, lo, k, score.stride(0), out.stride(0), **cfg)
    return slow
