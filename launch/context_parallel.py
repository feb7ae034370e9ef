"""Context parallelism: one packed micro-batch split over the cp ranks of a group, exact against one process.

Shape legend: T tokens of the whole (padded) micro-batch, L = T / (2·cp) tokens per segment, Tl = 2·L local tokens,
H heads, Hkv key/value heads, Dh head dim, K/V delta-rule key/value head dims, C conv channels, W conv width.

Zigzag: the micro-batch is padded to a multiple of 2·cp·chunk and cut into 2·cp equal segments; rank r holds segments
r and 2·cp−1−r (in that order), so every rank holds the same causal work. Every per-token field is sharded the same
way; documents cross segment edges freely. docs/context_parallel.md derives each exchange:

    full attention   all-gather K/V over the cp group (backward: reduce-scatter dK/dV), local queries against
                     every key under the causal same-document mask, on global token indices
    causal conv      all-gather of each segment's last W−1 rows (the halo), prepended to the next segment
    delta rule       each segment as an affine map of its incoming state, S_out = M·S_in + B (one pass from a zero
                     state), all-gathered, folded in sequence order on every rank, then each segment's outputs from
                     its true incoming state

`ContextParallel` is installed by `launch.parallel.parallelize` as `Transformer.context_parallel` (the trainer shards
each micro-batch with it) and as `context_parallel` on every Attention and GatedDeltaNet module (their forward calls
it), so the model itself holds no collectives. Autograd runs through every piece; the one collective with a custom
backward is the all-gather, whose backward is the reduce-scatter of its input's gradient (summed in fp32).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.gdn_fused import causal_conv1d_silu
from launch.gated_delta import (chunk_factors, fla_rule, fla_status, fold_state_maps, segment_pass,
                                with_incoming_states)
from launch.attention_parts import kernel_for, merged_attention
from launch.model import Packing, sdpa_kv

# CPU attention materializes the [Tl, T] mask up to this many key tokens (as launch/model.py's causal_attention)
DENSE_MASK_MAX_TOKENS = 4096
# a piece whose document starts before it runs as prefix + square merged (launch/attention_parts.py) where a kernel
# takes them; False: one lower-right causal SDPA call, the fallback (tests run both)
SPLIT_PIECES = True


@dataclass(frozen=True)
class ContextShard:
    """What a rank knows about the micro-batch its shard came from (`Packing.cp` of a sharded batch)."""

    rank: int
    size: int  # cp
    segment_len: int  # L
    index: torch.Tensor  # [Tl] global token index of each local token (segment r, then segment 2·cp−1−r)
    positions: torch.Tensor  # [T] position of every token of the padded micro-batch (0 starts a document)
    doc: torch.Tensor  # [T] document id of every token of the padded micro-batch
    # local runs of one document inside one segment: (local start, length, global start, document's global start)
    pieces: tuple[tuple[int, int, int, int], ...]
    num_padding: int  # padding tokens at the end of the micro-batch (their own document, loss weight 0)

    @property
    def num_tokens(self) -> int:
        return 2 * self.size * self.segment_len

    def chunked(self, chunk: int) -> "ContextShard":
        """The shard as chunked attention sees it (Llama 4's): every document of the micro-batch cut into runs of
        `chunk` positions from its start, each run a document of its own, so each local piece is cut where a run
        ends and attends from its run's first token."""
        pieces = []
        for local, n, a, start in self.pieces:
            g = a
            while g < a + n:
                run = start + (g - start) // chunk * chunk
                end = min(a + n, run + chunk)
                pieces.append((local + g - a, end - g, g, run))
                g = end
        runs_per_doc = self.positions.shape[0] // chunk + 1
        return dataclasses.replace(self, pieces=tuple(pieces), positions=self.positions % chunk,
                                   doc=self.doc * runs_per_doc + torch.div(self.positions, chunk,
                                                                           rounding_mode="floor"))


def zigzag_index(num_tokens: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global indices of rank `rank`'s tokens: segment `rank`, then segment 2·cp−1−rank (of 2·cp equal ones)."""
    if num_tokens % (2 * cp):
        raise ValueError(f"{num_tokens} tokens do not split into 2·cp={2 * cp} equal segments")
    seg = num_tokens // (2 * cp)
    return torch.cat([torch.arange(rank * seg, (rank + 1) * seg, device=device),
                      torch.arange((2 * cp - 1 - rank) * seg, (2 * cp - rank) * seg, device=device)])


def segment_owner(j: int, cp: int) -> tuple[int, int]:
    """(rank, slot) holding global segment j: slot 0 is a rank's first segment, slot 1 its second."""
    return (j, 0) if j < cp else (2 * cp - 1 - j, 1)


def padded_length(num_tokens: int, cp: int, chunk: int) -> int:
    """The micro-batch length CP runs: the next multiple of 2·cp·chunk (segments of whole delta-rule chunks)."""
    multiple = 2 * cp * chunk
    return -(-num_tokens // multiple) * multiple


# torch ≥ 2.13 names the single-tensor collectives *_single (the *_tensor names still work, with a warning)
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class _AllGather(torch.autograd.Function):
    """Concatenate every rank's x along dim 0 (rank order); backward: each rank gets the sum over ranks of the
    gradient of its own rows (a reduce-scatter, in fp32 or wider)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.size = group, dist.get_world_size(group)
        out = x.new_empty((ctx.size * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, dy):
        dy32 = dy.to(torch.promote_types(dy.dtype, torch.float32)).contiguous()
        dx = dy32.new_empty((dy.shape[0] // ctx.size, *dy.shape[1:]))
        _reduce_scatter_single(dx, dy32, group=ctx.group)
        return dx.to(dy.dtype), None


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    return _AllGather.apply(x, group)


class ContextParallel:
    """CP over `group` (the dense mesh's cp dimension). `chunk`: the delta rule's chunk size (1 without Gated
    DeltaNet layers), so segments are whole chunks; `conv_halo`: the conv's W−1 rows carried across segment edges."""

    def __init__(self, group, chunk: int = 1, conv_halo: int = 0):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        # segments are whole chunks and hold at least the halo's rows (so a halo comes from one segment)
        self.chunk = chunk * max(1, -(-conv_halo // chunk))
        self.key_index = None

    # ---- data --------------------------------------------------------------------------------------------------
    def shard(self, batch):
        """This rank's zigzag shard of a packed micro-batch (launch.data.Batch): padded to a multiple of
        2·cp·chunk with one padding document (input 0, target −1, loss mask 0), every per-token field (and every
        [T] tensor in `batch.extra`) indexed alike; `packing.cp` describes the whole micro-batch."""
        return shard_batch(batch, self.rank, self.size, self.chunk)

    # ---- full attention ----------------------------------------------------------------------------------------
    def attention(self, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, packing: Packing,
                  scale: float) -> torch.Tensor:
        """Local queries [Tl, H, Dh] against the keys and values of the whole micro-batch (all-gathered), causal
        inside each document on global token indices; v may be narrower than q·k (one gather of k and v side by side
        on the channels). Returns [Tl, H, Dv]."""
        k, v = all_gather(torch.cat([k_THD, v_THD], -1), self.group).split([k_THD.shape[-1], v_THD.shape[-1]], -1)
        return self._attend(q_THD, k, v, packing, scale)

    def latent_attention(self, q_THD: torch.Tensor, latent_TC: torch.Tensor, expand, packing: Packing,
                         scale: float) -> torch.Tensor:
        """Multi-head latent attention's form of `attention`: what is all-gathered is each token's latent
        [Tl, C] (MLA: the normed KV latent and the RoPE'd shared key, 576 values a token for DeepSeek-V3, where
        its expanded K and V are 128 heads × 384), and `expand(latent [n, C]) -> (k, v)` [n, H, Dh] rebuilds the
        whole micro-batch's keys and values on every rank (the expansion's gradient flows back through the
        gather to each rank's own tokens). `expand(latent, q)` keeps v at its own width where cuDNN takes the
        shapes, else pads it to the q·k width; the output is at v's width either way in its first channels."""
        k, v = expand(all_gather(latent_TC, self.group), q_THD)
        return self._attend(q_THD, k, v, packing, scale)

    def gather_in_order(self, packing: Packing, *rows: torch.Tensor) -> list[torch.Tensor]:
        """The whole micro-batch's rows of each per-token tensor [Tl, …]: all-gathered, in global token order (the
        gradient flows back to each rank's own rows). DeepSeek sparse attention's keys and latents
        (launch/sparse_attention.py)."""
        order = torch.argsort(self._key_index(_shard_of(packing), rows[0].device))
        return [all_gather(x.contiguous(), self.group)[order] for x in rows]

    @staticmethod
    def key_positions(packing: Packing) -> tuple[torch.Tensor, torch.Tensor]:
        """Each local token's global index and its document's first global index (int64 CPU tensors [Tl]): where
        DeepSeek sparse attention's local queries sit among the gathered keys."""
        shard = _shard_of(packing)
        query_index = torch.empty(shard.index.shape[0], dtype=torch.int64)
        doc_start = torch.empty_like(query_index)
        for local, n, a, start in shard.pieces:
            query_index[local:local + n] = torch.arange(a, a + n)
            doc_start[local:local + n] = start
        return query_index, doc_start

    def sink_attention(self, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor,
                       sinks_H: torch.Tensor | None, packing: Packing, scale: float,
                       window: int | None = None) -> torch.Tensor:
        """gpt-oss's attention (launch/sink_attention.py: a sink logit per head; with `window`, keys fewer than
        `window` positions back) of the local queries against the all-gathered keys, per local document piece:
        full attention as the piece's prefix keys and its own square with the sink merged in as one more part
        (`_sink_piece`: the kernels of launch/attention_parts.py); a sliding layer as one document of the keys the
        window reaches before the piece (at most window − 1, all-gathered like the rest) and the piece, whose
        extra leading queries are zeros and their outputs dropped. Returns [Tl, Hq, Dh]."""
        from launch.sink_attention import sink_attention

        shard = _shard_of(packing)
        kv = all_gather(torch.stack([k_THD, v_THD], 1), self.group)
        order = torch.argsort(self._key_index(shard, q_THD.device))
        k_all, v_all = kv[order, 0], kv[order, 1]
        outs = []
        for local, n, a, start in shard.pieces:
            q = q_THD[local:local + n]
            if window is None:
                outs.append(_sink_piece(q, k_all[start:a + n], v_all[start:a + n], sinks_H, scale))
                continue
            lo = max(start, a - window + 1)
            q_ext = torch.cat([q.new_zeros(a - lo, *q.shape[1:]), q])
            doc = Packing.from_lengths([a - lo + n], device=q.device)
            outs.append(sink_attention(q_ext, k_all[lo:a + n], v_all[lo:a + n], sinks_H, doc, scale, window)[a - lo:])
        return torch.cat(outs)

    def _attend(self, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, packing: Packing,
                scale: float) -> torch.Tensor:
        """Local queries against the all-gathered keys and values [cp·Tl, Hkv, D] (rank-major)."""
        shard = _shard_of(packing)
        key_index = self._key_index(shard, q_THD.device)
        if not q_THD.is_cuda and shard.num_tokens <= DENSE_MASK_MAX_TOKENS:
            qi, ki = shard.index, key_index
            mask = (shard.doc[qi][:, None] == shard.doc[ki][None, :]) & (ki[None, :] <= qi[:, None])
            q, k, v = (x.transpose(0, 1)[None] for x in (q_THD, k_THD, v_THD))
            k, v, gqa = sdpa_kv(q, k, v)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
            return o[0].transpose(0, 1)
        order = torch.argsort(key_index)
        return _attention_by_piece(q_THD, k_THD[order], v_THD[order], shard, scale)

    def _key_index(self, shard: ContextShard, device) -> torch.Tensor:
        """Global token index of each all-gathered key row (rank-major zigzag shards)."""
        n = shard.num_tokens
        if self.key_index is None or self.key_index.numel() != n or self.key_index.device != device:
            self.key_index = torch.cat([zigzag_index(n, self.size, r, device) for r in range(self.size)])
        return self.key_index

    # ---- Gated DeltaNet ----------------------------------------------------------------------------------------
    def causal_conv(self, x_TC: torch.Tensor, weight_CW: torch.Tensor, packing: Packing,
                    backend: str = "auto") -> torch.Tensor:
        """The depthwise causal conv + SiLU of both local segments, each with the previous segment's last W−1 rows
        in front (all-gathered; zeros before segment 0): a tap reads them only where the token's position allows,
        i.e. inside its document."""
        shard = _shard_of(packing)
        h, L = weight_CW.shape[1] - 1, shard.segment_len
        if h == 0:
            return causal_conv1d_silu(x_TC, weight_CW, packing.positions, backend=backend)
        tails = all_gather(torch.stack([x_TC[L - h:L], x_TC[2 * L - h:]]), self.group)  # [cp·2, h, C]
        halos = []
        for j in (self.rank, 2 * self.size - 1 - self.rank):
            if j == 0:
                halos.append(x_TC.new_zeros(h, x_TC.shape[1]))
            else:
                r, slot = segment_owner(j - 1, self.size)
                halos.append(tails[2 * r + slot])
        zeros = packing.positions.new_zeros(h)
        x_ext = torch.cat([halos[0], x_TC[:L], halos[1], x_TC[L:]])
        pos_ext = torch.cat([zeros, packing.positions[:L], zeros, packing.positions[L:]])
        y = causal_conv1d_silu(x_ext, weight_CW, pos_ext, backend=backend)
        return torch.cat([y[h:h + L], y[2 * h + L:]])

    def delta_rule(self, q_TGK, k_TGK, v_THV, g_TH, beta_TH, packing: Packing, chunk_size: int,
                   backend: str = "auto") -> torch.Tensor:
        """The gated delta rule on both local segments with their true incoming states: one augmented pass gives
        each segment's outputs and outgoing state as affine functions of its incoming state; the maps are
        all-gathered and folded in sequence order, and the folded states complete the outputs. Returns [Tl, H, V].
        `backend`: auto | torch (the chunked torch rule) | fla (flash-linear-attention's kernels, CUDA)."""
        shard = _shard_of(packing)
        if shard.segment_len % chunk_size:
            raise ValueError(f"segments of {shard.segment_len} tokens are not whole {chunk_size}-token chunks")
        if backend not in ("auto", "torch", "fla"):
            raise ValueError(f"delta-rule backend must be auto, torch or fla, got {backend!r}")
        o_aug, maps = local_segment_pass(q_TGK, k_TGK, v_THV, g_TH, beta_TH, packing, chunk_size, backend)
        return with_incoming_states(o_aug, self.incoming_states(maps)).to(v_THV.dtype)

    def incoming_states(self, local_maps: torch.Tensor) -> torch.Tensor:
        """This rank's two segments' incoming states [2, H, K, V] from their maps [2, H, K, V+K] = [B | M]: every
        segment's map all-gathered, folded in sequence order (2·cp−1 small products, on every rank)."""
        gathered = all_gather(local_maps, self.group)  # [cp·2, ...], rank-major
        order = [2 * r + slot for r, slot in (segment_owner(j, self.size) for j in range(2 * self.size))]
        states = fold_state_maps(gathered[order])
        return states[[self.rank, 2 * self.size - 1 - self.rank]]


def _shard_of(packing: Packing) -> ContextShard:
    if packing.cp is None:
        raise ValueError("context parallel needs a sharded micro-batch (ContextParallel.shard)")
    return packing.cp


def _sink_piece(q_nHD, k_mHD, v_mHD, sinks_H, scale: float) -> torch.Tensor:
    """A full-attention piece with sinks: its n queries at the end of the m keys, every query's softmax with its
    head's sink logit. Where a kernel takes them, the prefix keys (every one visible) and the piece's own causal
    square run as `_attention_by_piece`'s parts with the sink merged in as one more (launch/attention_parts.py), at
    the heads' own size; else one lower-right causal call over [sink key, keys] (launch/sink_attention.py's
    channels)."""
    from torch.nn.attention.bias import causal_lower_right

    from launch.sink_attention import sink_channels

    n, Dh = q_nHD.shape[0], q_nHD.shape[-1]
    before = k_mHD.shape[0] - n
    q, k, v = (x.transpose(0, 1)[None] for x in (q_nHD, k_mHD, v_mHD))
    parts = ([(k[:, :, :before], v[:, :, :before], False)] if before else []) + [(k[:, :, before:], v[:, :, before:],
                                                                                   True)]
    kernel = kernel_for(q, parts) if SPLIT_PIECES else None
    if kernel is not None:
        return merged_attention(q, parts, scale, kernel, sinks_H)[0].transpose(0, 1)
    qc, kc, vc, extra_k, extra_v = sink_channels(q_nHD, k_mHD, v_mHD, sinks_H, scale)
    qc = qc.transpose(0, 1)[None]
    kc, vc = (torch.cat([e[:1], x]).transpose(0, 1)[None] for e, x in ((extra_k, kc), (extra_v, vc)))
    kc, vc, gqa = sdpa_kv(qc, kc, vc)
    o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=causal_lower_right(n, before + 1 + n), scale=scale,
                                       enable_gqa=gqa)
    return o[0].transpose(0, 1)[..., :Dh]


def _attention_by_piece(q_THD, k_THD, v_THD, shard: ContextShard, scale: float) -> torch.Tensor:
    """Per local document piece, its queries [a, b) against the document's keys [start, b) (keys in global order):
    where the document starts before the piece, its prefix keys and its own square as two kernel calls merged
    exactly (launch/attention_parts.py: cuDNN on a GPU that takes them), else one SDPA call, lower-right causal;
    GQA inside the kernel where it runs there (`sdpa_kv`), so the backward keeps the piece's K/V at the KV heads'
    count."""
    from torch.nn.attention.bias import causal_lower_right

    outs = []
    for local, n, a, start in shard.pieces:
        q, k, v = (x.transpose(0, 1)[None] for x in (q_THD[local:local + n], k_THD[start:a + n],
                                                       v_THD[start:a + n]))
        m = a - start
        parts = [(k[:, :, :m], v[:, :, :m], False), (k[:, :, m:], v[:, :, m:], True)]
        kernel = kernel_for(q, parts) if m > 0 and SPLIT_PIECES else None
        if kernel is not None:
            o = merged_attention(q, parts, scale, kernel)
            outs.append(o[0].transpose(0, 1))
            continue
        k, v, gqa = sdpa_kv(q, k, v)
        mask = causal_lower_right(n, a + n - start) if a > start else None
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def local_segment_pass(q_TGK, k_TGK, v_THV, g_TH, beta_TH, packing: Packing, chunk_size: int,
                       backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's augmented pass over its two segments: outputs [Tl, H, V+K] = [O_0 | Q_eff] and maps
    [2, H, K, V+K] = [B | M] (segment_pass). `backend` "auto": flash-linear-attention's kernels on CUDA where usable
    (fla_segment_pass; tests/test_model_gpu.py and bench/bench_cp_gdn.py check them against fla on the whole
    sequence), the torch rule elsewhere; "torch" or "fla" to choose."""
    use_fla = backend != "torch" and q_TGK.is_cuda and fla_status(q_TGK.shape[-1], g_TH.dim() == 3)[0]
    if backend == "fla" and not use_fla:
        raise RuntimeError("delta-rule backend 'fla' requested but unusable here")
    if use_fla:
        return fla_segment_pass(q_TGK, k_TGK, v_THV, g_TH, beta_TH, _shard_of(packing))
    return segment_pass(chunk_factors(q_TGK, k_TGK, v_THV, g_TH, beta_TH, packing.positions, chunk_size), 2)


def delta_rule_on_one_device(xs, doc_lengths: list[int], cp: int, chunk_size: int,
                             backend: str = "auto") -> torch.Tensor:
    """The combine with all `cp` ranks simulated in this process, outputs [T, H, V] in sequence order: each rank's
    zigzag shard of the packed micro-batch (documents `doc_lengths`, whole chunks per segment) through
    local_segment_pass, the maps stacked in rank order as the all-gather delivers them, folded, each rank's outputs
    completed and put back. What the GPU test and bench/bench_cp_gdn.py hold against the rule over the whole
    sequence; xs = (q, k, v, g, β) of the whole micro-batch."""
    from launch.data import Batch

    T = xs[0].shape[0]
    ids = torch.zeros(T, dtype=torch.long, device=xs[0].device)
    batch = Batch(ids, ids, Packing.from_lengths(doc_lengths, ids.device), ids.bool(), ids.float(), ids)
    packings = [shard_batch(batch, r, cp, chunk_size).packing for r in range(cp)]
    passes = [local_segment_pass(*(x[p.cp.index] for x in xs), p, chunk_size, backend) for p in packings]
    order = [2 * r + slot for r, slot in (segment_owner(j, cp) for j in range(2 * cp))]
    states = fold_state_maps(torch.cat([m for _, m in passes])[order])
    out = torch.zeros(T, *xs[2].shape[1:], device=xs[0].device, dtype=xs[2].dtype)
    for r, (p, (o_aug, _)) in enumerate(zip(packings, passes)):
        out = out.index_put((p.cp.index,), with_incoming_states(o_aug, states[[r, 2 * cp - 1 - r]]).to(out.dtype))
    return out


def _fla_call(q_TGK, k_TGK, v_THV, g_TH, beta_TH, cu, initial_NHKV):
    o, final = fla_rule(g_TH.dim() == 3)(
        q_TGK[None].contiguous(), k_TGK[None].contiguous(), v_THV[None].contiguous(),
        g=g_TH[None].float().contiguous(), beta=beta_TH[None].to(q_TGK.dtype).contiguous(),
        scale=q_TGK.shape[-1] ** -0.5, initial_state=initial_NHKV, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    return o[0], final


def _fla_layout(shard: ContextShard, device):
    """The local document pieces as varlen sequences: cu_seqlens, each segment's first and last piece, and whether
    the first continues a document from the segment before."""
    L = shard.segment_len
    lengths = [n for _, n, _, _ in shard.pieces]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long, device=device)
    first = [next(i for i, p in enumerate(shard.pieces) if p[0] == s * L) for s in (0, 1)]
    last = [max(i for i, p in enumerate(shard.pieces) if s * L <= p[0] < (s + 1) * L) for s in (0, 1)]
    continues = [shard.pieces[i][2] > shard.pieces[i][3] for i in first]
    return cu, first, last, continues


def _initial_states(n: int, first: list[int], continues: list[bool], state: torch.Tensor) -> torch.Tensor:
    """[n, ...]: `state` entering each segment's first piece where it continues a document, zero elsewhere."""
    rows = [torch.zeros_like(state)] * n
    for s, i in enumerate(first):
        if continues[s]:
            rows[i] = state
    return torch.stack(rows)


def fla_segment_pass(q_TGK, k_TGK, v_THV, g_TH, beta_TH, shard: ContextShard) -> tuple[torch.Tensor, torch.Tensor]:
    """`segment_pass` for both local segments in one fla call over the local document pieces: values [v | 0], and
    [0 | I] entering each segment's first piece where it continues a document (zero elsewhere: a piece that starts
    a document starts from zero, so a segment with a document start inside ends with M = 0). Returns the augmented
    outputs [Tl, H, V+K] = [O_0 | Q_eff] (in the inputs' dtype, as fla writes them) and the maps [2, H, K, V+K] =
    [B | M] in fp32."""
    H, V, K = v_THV.shape[1], v_THV.shape[2], q_TGK.shape[-1]
    cu, first, last, continues = _fla_layout(shard, q_TGK.device)
    eye = torch.cat([torch.zeros(H, K, V, device=q_TGK.device), torch.eye(K, device=q_TGK.device).expand(H, K, K)], -1)
    init = _initial_states(len(shard.pieces), first, continues, eye)
    o_aug, final = _fla_call(q_TGK, k_TGK, torch.cat([v_THV, v_THV.new_zeros(v_THV.shape[0], H, K)], -1), g_TH,
                             beta_TH, cu, init)
    return o_aug, final[last].float()


def shard_batch(batch, rank: int, cp: int, chunk: int = 1):
    """Rank `rank`'s zigzag shard of a packed micro-batch (see ContextParallel.shard)."""
    T = batch.num_tokens
    Tp = padded_length(T, cp, chunk)
    pad = Tp - T
    device = batch.input_ids.device
    positions = batch.packing.positions
    doc_lengths = list(batch.packing.doc_lengths) + ([pad] if pad else [])
    if pad:
        positions = torch.cat([positions, torch.arange(pad, device=device, dtype=positions.dtype)])
    doc = torch.repeat_interleave(torch.arange(len(doc_lengths), device=device),
                                  torch.tensor(doc_lengths, device=device))
    index = zigzag_index(Tp, cp, rank, device)

    def take(x, fill):
        if x is None:
            return None
        if pad:
            x = torch.cat([x, x.new_full((pad, *x.shape[1:]), fill)])
        return x[index]

    # document pieces, on the host: runs of one document inside each local segment
    L = Tp // (2 * cp)
    starts, s = [], 0
    for n in doc_lengths:
        starts.append(s)
        s += n
    doc_host = doc.tolist()
    pieces = []
    for slot, j in enumerate((rank, 2 * cp - 1 - rank)):
        a = j * L
        while a < (j + 1) * L:
            d = doc_host[a]
            b = min((j + 1) * L, starts[d] + doc_lengths[d])
            pieces.append((slot * L + a - j * L, b - a, a, starts[d]))
            a = b
    lengths = [n for _, n, _, _ in pieces]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    shard = ContextShard(rank=rank, size=cp, segment_len=L, index=index, positions=positions, doc=doc,
                         pieces=tuple(pieces), num_padding=pad)
    packing = Packing(positions[index], cu.to(device), tuple(lengths), cp=shard)
    extra = {k: take(v, 0) if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == T else v
             for k, v in batch.extra.items()}
    return dataclasses.replace(
        batch, input_ids=take(batch.input_ids, 0), targets=take(batch.targets, -1), packing=packing,
        loss_mask=take(batch.loss_mask, False), advantages=take(batch.advantages, 0.0),
        seq_id=take(batch.seq_id, batch.num_seqs), old_logprobs=take(batch.old_logprobs, 0.0),
        ref_logprobs=take(batch.ref_logprobs, 0.0), rollout_logprobs=take(batch.rollout_logprobs, 0.0), extra=extra)
