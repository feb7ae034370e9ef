"""Attention with per-head sinks and sliding windows (gpt-oss), on torch's SDPA, inside each packed document.

Shape legend: T tokens, Hq query heads, Hkv key/value heads, G = Hq/Hkv, Dh head dim, C = Dh + 2 rounded up to a
multiple of 8, W window, NB query blocks of W rows.

A sink is one more logit σ_h per head in every query's softmax, with no value:

    o_i = Σ_j e^(s_ij) v_j / (e^(σ_h) + Σ_j e^(s_ij)),   s_ij = scale · q_i·k_j   (j over i's visible keys)

Two extra channels make it a key that every query sees, so one SDPA call computes it exactly:

    q'_i = [q_i | σ_h/scale | 1 | 0…]   k'_j = [k_j | 0 | 0 | 0…]   sink key [0 | 1 | 0 | 0…], its value 0

q'_i·k'_j = q_i·k_j, so every real score is unchanged, and scale · q'_i·(sink key) = σ_h: the sink's term e^(σ_h)
joins the denominator and, its value being zero, adds nothing to the numerator. The sink sits in the query's
channel (the key is the same for every head), so under GQA one key head serves every query head of its group with
each head's own sink. Its gradient is autograd's through q': dL/dσ_h = Σ_i dL/dq'_i[Dh] / scale. The padding to C
(a multiple of 8: the kernels' head sizes) is zeros, which change no product.

The second channel marks padding keys (the sliding path's, below): [0 | 0 | PAD/scale | 0…] scores PAD = −10⁴ with
every query, e^(PAD − max) is exactly 0 in fp32, and its value is zero: such a key changes nothing, gradients
included (its probability is exactly 0).

A kernel that returns its log-sum-exp l_i needs no sink key: it runs the plain causal (or windowed) attention at the
heads' own size, and the sink merges in as one more partial softmax (l = log(e^l_i + e^σ_h), o scaled by
e^(l_i − l); launch/attention_parts.py, which also gives σ's gradient). Paths:
- dense (CPU, up to DENSE_MASK_MAX_TOKENS tokens): keys [sink, the T keys], one SDPA call with a [T, 1 + T] mask
  (the sink's column, and each document's causal, windowed band);
- merged, per document (full attention, and windowed layers whose documents all fit in one window, where a kernel
  takes the shapes: cuDNN on a GPU, SDPA's CPU flash kernel on CPU): one causal call each, the sink merged in;
- per document with the sink key (the same where no such kernel runs): keys [sink, the document's keys], one SDPA
  call each with a lower-right causal mask (query i sees the sink and keys 0..i: `causal_lower_right`), GQA as
  `launch.model.sdpa_kv` passes it;
- the window merged (where the flash kernel takes the shapes): all documents in one call of the flash kernel's
  variable-length form with its window (launch/attention_parts.py `window_attention`), the sink merged in;
- masked blocks (the same elsewhere): each document's queries cut into blocks of W; block b sees the keys
  [sink, block b − 1, block b] (the 2W keys before and at its own, a document's first block a block of padding keys
  before it, the last block's tail padding queries whose outputs are dropped), and a query sees key j of those when
  0 ≤ pos_q − pos_j < W. That band is the same [W, 1 + 2W] mask for every block (row r, key column c ≥ 1 at position
  (b − 1)W + c − 1: allowed iff r + 1 < c ≤ W + r + 1), so all blocks of all documents run as one batched SDPA
  call. The G query heads of a key head are stacked along the block's rows ([NB, Hkv, G·W, C] against
  [NB, Hkv, 1 + 2W, C], the mask repeated G times), so no key is copied per query head and the kernels that take a
  mask (memory-efficient, math) need no GQA support. Work and memory: (1 + 2W)/W keys a query, about twice a
  window's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DENSE_MASK_MAX_TOKENS = 4096  # CPU: one call with a [T, 1 + T] mask up to this many tokens
# the sink merged in by log-sum-exp (launch/attention_parts.py) where a kernel takes the shapes: full attention one
# cuDNN call a document, a window one windowed flash call; False: the sink as a key of the channels below (the one
# lower-right call a document, the masked blocks; tests run both)
MERGED_SINK = True
PAD = -1.0e4  # the score of a padding key (and, without sinks, of the sink key): exp underflows to exactly 0


def _channels(head_dim: int) -> int:
    return -(-(head_dim + 2) // 8) * 8


def sink_channels(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, sinks_H: torch.Tensor | None,
                  scale: float) -> tuple[torch.Tensor, ...]:
    """q, k, v with the sink and padding channels (C wide: [Dh | sink | pad | 0…]), and the sink and padding keys
    [2, Hkv, C] with their zero values [2, Hkv, C]: what every path here (and launch/context_parallel.py's) attends
    with. Sliced back to Dh after attention."""
    T, Hq, Dh = q_THD.shape
    Hkv, C = k_THD.shape[1], _channels(Dh)
    sink = (sinks_H / scale) if sinks_H is not None else q_THD.new_full((Hq,), PAD / scale)
    q = torch.cat([q_THD, sink.to(q_THD.dtype).view(1, Hq, 1).expand(T, Hq, 1), q_THD.new_ones(T, Hq, 1),
                   q_THD.new_zeros(T, Hq, C - Dh - 2)], dim=-1)
    k, v = F.pad(k_THD, (0, C - Dh)), F.pad(v_THD, (0, C - Dh))
    extra_k = k.new_zeros(2, Hkv, C)  # the sink key, then the padding key
    extra_k[0, :, Dh] = 1.0
    extra_k[1, :, Dh + 1] = PAD / scale
    return q, k, v, extra_k, v.new_zeros(2, Hkv, C)


def sink_attention(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, sinks_H: torch.Tensor | None,
                   packing, scale: float, window: int | None = None) -> torch.Tensor:
    """Causal attention inside each document of `packing` with a sink logit per query head (`sinks_H` [Hq], None:
    no sink) and, given a `window`, only keys less than `window` positions back. Returns [T, Hq, Dh]."""
    T, Dh = q_THD.shape[0], q_THD.shape[-1]
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must be at least 1 token, got {window}")
    whole = window is None or window >= max(packing.doc_lengths)  # no query's window cuts its document
    dense = not q_THD.is_cuda and T <= DENSE_MASK_MAX_TOKENS
    if not dense and MERGED_SINK:
        if whole:
            merged = _merged_per_document(q_THD, k_THD, v_THD, sinks_H, packing, scale)
        else:
            merged = _flash_window(q_THD, k_THD, v_THD, sinks_H, packing, scale, window)
        if merged is not None:
            return merged
    q, k, v, extra_k, extra_v = sink_channels(q_THD, k_THD, v_THD, sinks_H, scale)
    if dense:
        o = _dense(q, k, v, extra_k, extra_v, packing, scale, window)
    elif whole:
        o = _per_document(q, k, v, extra_k, extra_v, packing, scale)
    else:
        o = _sliding_blocks(q, k, v, extra_k, extra_v, packing, scale, window)
    return o[..., :Dh]


def _dense(q, k, v, extra_k, extra_v, packing, scale: float, window: int | None) -> torch.Tensor:
    T, Hq, _ = q.shape
    keys = torch.cat([extra_k[:1], k]).transpose(0, 1).unsqueeze(0)  # [1, Hkv, 1 + T, C]: the sink first
    vals = torch.cat([extra_v[:1], v]).transpose(0, 1).unsqueeze(0)
    lengths = torch.tensor(packing.doc_lengths, device=q.device)
    doc = torch.repeat_interleave(torch.arange(len(packing.doc_lengths), device=q.device), lengths)
    pos = packing.positions
    back = pos[:, None] - pos[None, :]
    seen = (doc[:, None] == doc[None, :]) & (back >= 0)
    if window is not None:
        seen &= back < window
    mask = torch.cat([seen.new_ones(T, 1), seen], dim=1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, vals, attn_mask=mask, scale=scale,
                                       enable_gqa=keys.shape[1] != Hq)
    return o.squeeze(0).transpose(0, 1)


def _merged_per_document(q_THD, k_THD, v_THD, sinks_H, packing, scale: float) -> torch.Tensor | None:
    """Each document's causal attention as one kernel call at the heads' own size with the sink merged in by its
    log-sum-exp (launch/attention_parts.py), or None where no kernel takes the shapes."""
    from launch.attention_parts import kernel_for, merged_attention

    q, k, v = (x.transpose(0, 1)[None] for x in (q_THD, k_THD, v_THD))  # [1, H, T, Dh]
    outs, start = [], 0
    for n in packing.doc_lengths:
        sl = slice(start, start + n)
        parts = [(k[:, :, sl], v[:, :, sl], True)]
        kernel = kernel_for(q[:, :, sl], parts)
        if kernel is None:
            return None
        outs.append(merged_attention(q[:, :, sl], parts, scale, kernel, sinks_H))
        start += n
    return torch.cat(outs, dim=2)[0].transpose(0, 1)


def _per_document(q, k, v, extra_k, extra_v, packing, scale: float) -> torch.Tensor:
    from torch.nn.attention.bias import causal_lower_right  # imports triton: only where this path runs

    from launch.model import sdpa_kv

    outs, start = [], 0
    for n in packing.doc_lengths:
        sl = slice(start, start + n)
        qd = q[sl].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, C]
        kd = torch.cat([extra_k[:1], k[sl]]).transpose(0, 1).unsqueeze(0)  # [1, Hkv, 1 + n, C]
        vd = torch.cat([extra_v[:1], v[sl]]).transpose(0, 1).unsqueeze(0)
        kd, vd, gqa = sdpa_kv(qd, kd, vd)
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, attn_mask=causal_lower_right(n, n + 1), scale=scale,
                                                   enable_gqa=gqa))
        start += n
    return torch.cat(outs, dim=2).squeeze(0).transpose(0, 1)


def band_mask(window: int, device=None) -> torch.Tensor:
    """[W, 1 + 2W] bool: row r of a block (a query at position bW + r) against the sink (column 0) and the keys of
    blocks b − 1 and b (column c ≥ 1 at position (b − 1)W + c − 1): the sink always, a key when 0 ≤ pos_q − pos_k
    < W, i.e. r + 1 < c ≤ W + r + 1."""
    r = torch.arange(window, device=device)[:, None]
    c = torch.arange(1 + 2 * window, device=device)[None, :]
    return (c == 0) | ((c > r + 1) & (c <= window + r + 1))


def _flash_window(q_THD, k_THD, v_THD, sinks_H, packing, scale: float, window: int) -> torch.Tensor | None:
    """The sliding window in one call of the flash kernel's variable-length form with its window, at the heads' own
    size, the sink merged in (launch/attention_parts.py `window_attention`); None where it does not run."""
    from launch.attention_parts import flash_window_takes, window_attention

    if not flash_window_takes(q_THD, k_THD, v_THD):
        return None
    lengths = torch.tensor(packing.doc_lengths, device=q_THD.device, dtype=torch.int32)
    cu = F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    return window_attention(q_THD, k_THD, v_THD, cu, max(packing.doc_lengths), window, scale, sinks_H)


def _sliding_blocks(q, k, v, extra_k, extra_v, packing, scale: float, window: int) -> torch.Tensor:
    T, Hq, C = q.shape
    Hkv, W = k.shape[1], window
    G = Hq // Hkv
    dev = q.device
    lengths = torch.tensor(packing.doc_lengths, device=dev)
    blocks = (lengths + W - 1) // W  # query blocks of each document
    NB = int(sum(-(-n // W) for n in packing.doc_lengths))
    first_row = W * (torch.cumsum(blocks, 0) - blocks)  # each document's first query row
    doc = torch.repeat_interleave(torch.arange(len(packing.doc_lengths), device=dev), lengths)
    row_T = first_row[doc] + packing.positions  # token t's row among the NB·W query rows
    pad_row, sink_row = T, T + 1  # in the key/value rows below: [k, sink, padding] indexed as [0, T), T + 1, T
    rows = torch.full((NB * W,), pad_row, dtype=torch.long, device=dev)
    rows[row_T] = torch.arange(T, device=dev)
    own = rows.view(NB, W)
    prev = torch.cat([own.new_full((1, W), pad_row), own[:-1]])
    prev[first_row // W] = pad_row  # a document's first block: a block of padding keys before it
    key_rows = torch.cat([own.new_full((NB, 1), sink_row), prev, own], dim=1)  # [NB, 1 + 2W]
    k_rows = torch.cat([k, extra_k[1:], extra_k[:1]])  # row T: the padding key, row T + 1: the sink key
    v_rows = torch.cat([v, extra_v])
    q_rows = torch.cat([q, q.new_zeros(1, Hq, C)])  # row T: a padding query (its output is dropped)
    # the G query heads of each key head stacked along the rows: [NB, Hkv, G·W, C]
    qb = q_rows[rows].view(NB, W, Hkv, G, C).permute(0, 2, 3, 1, 4).reshape(NB, Hkv, G * W, C)
    kb = k_rows[key_rows].transpose(1, 2)  # [NB, Hkv, 1 + 2W, C]
    vb = v_rows[key_rows].transpose(1, 2)
    mask = band_mask(W, dev).repeat(G, 1)
    o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)  # [NB, Hkv, G·W, C]
    o = o.view(NB, Hkv, G, W, C).permute(0, 3, 1, 2, 4).reshape(NB * W, Hq, C)
    return o[row_T]
