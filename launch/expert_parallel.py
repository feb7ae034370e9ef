"""Expert parallelism: routed tokens travel to the rank that holds their expert and back, in k chunks whose
all-to-alls overlap the expert GEMMs of the chunk before.

Shape legend: T local tokens, D model dim, K top-k, E experts, R ranks of the EP group, El = E/R local experts,
I expert ffn dim, C chunks, M (token, slot) rows. "src-major": rows grouped by the rank they came from, then by
local expert (what an all-to-all delivers); "expert-major": grouped by local expert, then by source rank (what the
grouped GEMMs want).

One call per MoE layer (`ExpertParallel.__call__`, installed as `GroupedExperts.token_dispatch` by
`launch.parallel.parallelize`), so the experts stay one FSDP unit that is all-gathered once:

    route:    one stable sort of the T·K slots by (chunk, expert) (rank j owns experts [j·El, (j+1)·El))
    counts:   one all-to-all of the [R, C, El] row counts, one host sync: every split size of every chunk is known
    forward:  D(0) ; for c: D(c+1) ‖ GEMM(c) ; C(c) ‖ GEMM(c+1) ; unpermute(c)
    backward: D'(0); for c: D'(c+1) ‖ dX-GEMMs(c) ; C'(c) ‖ dX-GEMMs(c+1) ; then every dW GEMM (hides C'(C−1))

D is the dispatch all-to-all, C the combine; in the backward D' sends each slot's output gradient (and its routing
weight) to the expert, C' returns the input gradient (and the routing weight's gradient). On CUDA the all-to-alls
run on a communication stream, ordered against the compute stream by events; on CPU (gloo) they run in place.

Under full recompute the layer's forward runs twice. The recomputed forward re-issues the count exchange and the
dispatch (the experts need their input rows again) but not the combine: nothing in the backward reads the layer's
output, and the routing weights' gradient, dL/dw_tk = dL/dout_t · y_tk, is formed on the expert's rank from the
output y_tk it holds and the dL/dout_t that D' brings anyway. So a layer costs five all-to-alls per step (D, C;
D again; D', C'), against four without recompute: the minimum short of keeping the dispatched rows of every layer.

The result equals one process's MoE (launch/moe.py) to fp32 rounding, and k chunks equal one chunk bitwise on CPU:
the weight gradients are formed once, after all chunks, over the rows in one-chunk order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.expert_grads import slot_grads, swiglu_backward
from launch.moe import (combine_into, expert_ffn, free_at_last_use, grouped_bias_grad, grouped_linear_dx,
                        grouped_weight_grad, scatter_rows, unpermute)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def regroup_index(counts: torch.Tensor, perm: tuple[int, ...], total: int, per_block: bool = False) -> torch.Tensor:
    """Rows stored as contiguous segments in the row-major order of `counts` (one segment per entry, of that many
    rows); returns the row index that lists the same segments in the order of `counts.permute(perm)`.
    E.g. counts [[2, 1], [1, 2]] (src-major, R = 2 × El = 2: rows 0-1 s0e0, 2 s0e1, 3 s1e0, 4-5 s1e1) with perm
    (1, 0) (expert-major: e0 from s0, s1, then e1 from s0, s1) → [0, 1, 3, 2, 4, 5].
    `per_block`: the rows of each entry of counts' first dimension are a buffer of their own, and each row index
    counts from its buffer's first row."""
    flat = counts.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view(counts.shape)
    if per_block:
        starts = starts - starts.reshape(counts.shape[0], -1)[:, :1].view(-1, *[1] * (counts.dim() - 1))
    c_t, s_t = counts.permute(perm).reshape(-1), starts.permute(perm).reshape(-1)
    seg = torch.repeat_interleave(torch.arange(c_t.numel(), device=counts.device), c_t, output_size=total)
    return s_t[seg] + torch.arange(total, device=counts.device) - (torch.cumsum(c_t, 0) - c_t)[seg]


def chunk_regroup_index(recv_RCEl: torch.Tensor, total: int) -> torch.Tensor:
    """Every chunk's regroup at once: chunk c's received rows are source-major segments ([R, El] of
    recv_RCEl[:, c]); the result, cut at the chunks' row totals, is each chunk's `regroup_index(recv_RCEl[:, c],
    (1, 0), n_c)` (expert-major, indices local to the chunk), for the kernels of one call instead of C."""
    # [C, R, El]: the chunks' buffers one after another, each counted from its own first row
    return regroup_index(recv_RCEl.permute(1, 0, 2), (0, 2, 1), total, per_block=True)


def chunk_orders(top_e_TK: torch.Tensor, num_chunks: int, num_experts: int):
    """The slots of each of `num_chunks` token chunks (chunk c: tokens c·T//C to (c+1)·T//C) sorted by expert, in
    one stable sort by (chunk, expert): each chunk's order is the one a stable sort of that chunk alone gives.
    Returns ([(slot order local to the chunk, its tokens)] per chunk, as views, and the [C, E] slot counts)."""
    T, K = top_e_TK.shape
    C = num_chunks
    token_M = torch.arange(T * K, device=top_e_TK.device) // K
    chunk_M = ((token_M + 1) * C - 1) // T  # the chunk of token t: ⌊c·T/C⌋ ≤ t < ⌊(c+1)·T/C⌋
    key_M = chunk_M * num_experts + top_e_TK.reshape(-1)
    order_M = torch.argsort(key_M, stable=True)
    # the sort keeps every chunk in its own slot range, so chunk_M is also the chunk of each sorted position
    local_M = order_M - (chunk_M * T // C) * K
    counts_CE = torch.zeros(C * num_experts, dtype=torch.int64, device=top_e_TK.device)
    counts_CE.scatter_add_(0, key_M, torch.ones_like(key_M))
    slots = [(c * T // C * K, (c + 1) * T // C * K) for c in range(C)]
    return [(local_M[a:b], order_M[a:b] // K) for a, b in slots], counts_CE.view(C, num_experts)


class ExpertParallel:
    """The token dispatch for one EP group: `group` is the EP process group (its own, so the all-to-alls never
    queue behind FSDP's collectives), `num_chunks` the k of the overlap (1: none), `comm_stream` the CUDA stream the
    all-to-alls run on (None: the current stream; always None on CPU)."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int, num_chunks: int = 1, comm_stream=None):
        self.group, self.num_ranks = group, dist.get_world_size(group)
        if num_experts % self.num_ranks:
            raise ValueError(f"ep={self.num_ranks} does not divide the {num_experts} experts")
        if num_chunks < 1:
            raise ValueError(f"ep_overlap_chunks must be ≥ 1, got {num_chunks}")
        self.num_experts, self.num_chunks, self.comm_stream = num_experts, num_chunks, comm_stream

    def __call__(self, experts, x_TD, top_w_TK, top_e_TK) -> torch.Tensor:
        w1, w2 = _local(experts.gate_up_proj), _local(experts.down_proj)
        if w1.shape[0] * self.num_ranks != self.num_experts:
            raise ValueError(f"expert weights hold {w1.shape[0]} experts on this rank; ep={self.num_ranks} over "
                             f"{self.num_experts} experts needs {self.num_experts // self.num_ranks}")
        b1, b2 = (None if b is None else _local(b) for b in (experts.gate_up_proj_bias, experts.down_proj_bias))
        return _DispatchExpertsCombine.apply(x_TD, top_w_TK, top_e_TK, w1, w2, b1, b2, experts.activation, self,
                                             experts.output_read)

    # ---- communication -------------------------------------------------------------------------------------
    def all_to_all(self, x, out_splits: list[int], in_splits: list[int]):
        """Rows of x (grouped by destination, in_splits of them each) to every rank; returns (received rows, an
        event the consumer waits on, or None). On CUDA it runs on the comm stream once the compute stream has run
        everything queued before this call.

        That wait also guards the receive buffer: it comes from the compute stream's pool, where its memory may
        have been freed by a tensor that kernels queued earlier on the compute stream still read or write; the
        transfer must not write it before they ran. (Waiting on an earlier event instead, one recorded before the
        chunk loop, let the recomputed forward's dispatch D(c+3), with no combine queued between, overwrite chunk
        c's freed receive buffer before chunk c's regroup had read it.)"""
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        if self.comm_stream is None:
            dist.all_to_all_single(out, x, out_splits, in_splits, group=self.group)
            return out, None
        after = torch.cuda.Event()
        after.record()
        with torch.cuda.stream(self.comm_stream):
            self.comm_stream.wait_event(after)
            dist.all_to_all_single(out, x, out_splits, in_splits, group=self.group)
            done = torch.cuda.Event()
            done.record(self.comm_stream)
        x.record_stream(self.comm_stream)  # x's memory must outlive the transfer, whatever the compute stream does
        return out, done

    @staticmethod
    def wait(pending):
        out, done = pending
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
        return out

    # ---- routing -------------------------------------------------------------------------------------------
    def route(self, top_e_TK: torch.Tensor) -> "Route":
        """Chunks of the local tokens, their slot orders and every split size (one count all-to-all, one host
        sync)."""
        T = top_e_TK.shape[0]
        C, R, E = self.num_chunks, self.num_ranks, self.num_experts
        El = E // R
        bounds = [(c * T // C, (c + 1) * T // C) for c in range(C)]
        orders, counts_CE = chunk_orders(top_e_TK, C, E)
        send_RCEl = counts_CE.view(C, R, El).transpose(0, 1).contiguous()
        recv_RCEl = torch.empty_like(send_RCEl)
        dist.all_to_all_single(recv_RCEl, send_RCEl, group=self.group)
        local_CEl = recv_RCEl.sum(0)
        host = torch.stack([send_RCEl, recv_RCEl]).tolist()  # host sync: the split sizes of every chunk
        recv = [[sum(host[1][r][c]) for r in range(R)] for c in range(C)]
        return Route(bounds, orders, recv_RCEl, chunk_regroup_index(recv_RCEl, sum(map(sum, recv))),
                     send=[[sum(host[0][r][c]) for r in range(R)] for c in range(C)],
                     recv=recv,
                     local=[[sum(host[1][r][c][e] for r in range(R)) for e in range(El)] for c in range(C)],
                     offs_CEl=torch.cumsum(local_CEl, 1).to(torch.int32),
                     offs_El=torch.cumsum(local_CEl.sum(0), 0).to(torch.int32))


@dataclass
class Route:
    """Where one layer's rows go: token bounds of each chunk, each chunk's (order_M, token_M), the [R, C, El] rows
    received per (source rank, chunk, local expert) on the device, and on the host the split sizes per chunk (sent
    to / received from each rank) and rows per local expert; group offsets for the grouped GEMMs on the device
    (per chunk, and over all chunks for the weight gradients)."""

    bounds: list[tuple[int, int]]
    orders: list[tuple[torch.Tensor, torch.Tensor]]
    recv_RCEl: torch.Tensor
    regroup: torch.Tensor  # every chunk's received rows to expert order, chunk after chunk (Route.regroup_of)
    send: list[list[int]]
    recv: list[list[int]]
    local: list[list[int]]
    offs_CEl: torch.Tensor
    offs_El: torch.Tensor

    @staticmethod
    def rows_of(recv: list[list[int]], c: int) -> slice:
        """Chunk c's rows among every chunk's received rows, chunk after chunk."""
        start = sum(map(sum, recv[:c]))
        return slice(start, start + sum(recv[c]))

    @staticmethod
    def regroup_of(regroup: torch.Tensor, recv: list[list[int]], c: int) -> torch.Tensor:
        """Chunk c's part of `regroup`: the row index that puts its received rows in expert order."""
        return regroup[Route.rows_of(recv, c)]


# rows of a backward all-to-all carry D gradient columns plus one column for the routing weight (or its gradient),
# padded to keep each bf16 row a multiple of 16 bytes (vectorized copies)
_EXTRA = 8


class _DispatchExpertsCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, top_w_TK, top_e_TK, w1_EFD, w2_EDI, b1_EF, b2_ED, glu, ep: ExpertParallel,
                output_read: bool = False):
        # inside the backward pass (graph task running): this is the recompute of a checkpointed layer, which skips
        # the combine unless the backward reads the output (GroupedExperts.output_read): then it runs as a forward
        recompute = torch._C._current_graph_task_id() != -1 and not output_read
        rt = ep.route(top_e_TK)
        C = len(rt.bounds)
        # each chunk's send rows ([M_c, D], sorted by global expert) are gathered just before their transfer is
        # queued and dropped once it is (record_stream keeps them alive for it): one chunk's rows at a time
        pending = {0: ep.all_to_all(x_TD[rt.orders[0][1]], rt.recv[0], rt.send[0])}
        combined, saved = {}, []
        out_TD = torch.zeros_like(x_TD)

        def combine(c):  # chunk c's returned rows into its tokens' outputs
            t0, t1 = rt.bounds[c]
            combine_into(out_TD[t0:t1], ep.wait(combined.pop(c)), rt.orders[c][0], top_w_TK[t0:t1])

        for c in range(C):
            if c + 1 < C:
                pending[c + 1] = ep.all_to_all(x_TD[rt.orders[c + 1][1]], rt.recv[c + 1], rt.send[c + 1])
            idx = Route.regroup_of(rt.regroup, rt.recv, c)
            x_em = ep.wait(pending.pop(c))[idx]
            h_em, y_em = expert_ffn(x_em, w1_EFD, w2_EDI, rt.local[c], rt.offs_CEl[c], glu, b1_EF, b2_ED)
            saved += [x_em, h_em, y_em]
            if recompute:
                continue
            y_src = scatter_rows(torch.empty_like(y_em), idx, y_em)
            combined[c] = ep.all_to_all(y_src, rt.send[c], rt.recv[c])
            if c > 0:
                combine(c - 1)
        if not recompute:
            combine(C - 1)
        ctx.ep, ctx.rt_host = ep, (rt.bounds, rt.send, rt.recv, rt.local)
        ctx.glu, ctx.bias_dtypes = glu, tuple(None if b is None else b.dtype for b in (b1_EF, b2_ED))
        ctx.save_for_backward(top_w_TK, top_e_TK, w1_EFD, w2_EDI, rt.recv_RCEl, rt.regroup, rt.offs_CEl, rt.offs_El,
                              *saved)
        return out_TD

    @staticmethod
    def backward(ctx, dout_TD):
        top_w_TK, top_e_TK, w1, w2, recv_RCEl, regroup, offs_CEl, offs_El, *saved = ctx.saved_tensors
        # each chunk's saved rows (x, h, y: the forward's own tensors) are freed at their last use, unless the graph
        # is kept for another backward (`saved` and the autograd node would otherwise hold them to the end)
        ep, (bounds, send, recv, local) = ctx.ep, ctx.rt_host
        C, D, K, dtype = len(bounds), dout_TD.shape[1], top_w_TK.shape[1], saved[2].dtype
        # the slot order of each chunk again (the forward's sort)
        orders = [order_M for order_M, _ in chunk_orders(top_e_TK, C, ep.num_experts)[0]]
        g_out = dout_TD.to(dtype)  # (itself when it is already)
        w_M = top_w_TK.reshape(-1).to(dtype)

        def send_rows(c):
            # D': each slot gets its token's output gradient and its routing weight (column D), gathered straight
            # into the send rows in expert order (the padding columns travel unread); as in the forward, built
            # just before the transfer is queued and dropped once it is
            (t0, t1), order_M = bounds[c], orders[c]
            rows = dout_TD.new_empty((len(order_M), D + _EXTRA), dtype=dtype)
            torch.index_select(g_out[t0:t1], 0, order_M // K, out=rows[:, :D])
            torch.index_select(w_M[t0 * K:t1 * K], 0, order_M, out=rows[:, D])
            return rows

        # the weight gradients take every chunk's rows in one-chunk order (expert, source rank, chunk): with more
        # than one chunk each chunk's g, a and dh are copied to their place there as they are made (`dest`: the
        # place of each row of the chunks' concatenated rows, chunk after chunk) and dropped
        total = sum(map(sum, recv))
        dest = regroup_index(recv_RCEl.permute(2, 0, 1), (2, 0, 1), total) if C > 1 else None
        wholes: dict[str, torch.Tensor] = {}

        def place(name: str, c: int, part: torch.Tensor) -> None:
            if dest is None:
                wholes[name] = part
                return
            if name not in wholes:
                wholes[name] = part.new_empty((total, *part.shape[1:]))
            scatter_rows(wholes[name], dest[Route.rows_of(recv, c)], part)

        pending = {0: ep.all_to_all(send_rows(0), recv[0], send[0])}
        returned = {}
        dx_TD = torch.zeros_like(dout_TD, dtype=dtype)
        dw_TK = torch.zeros_like(top_w_TK)
        for c in range(C):
            if c + 1 < C:
                pending[c + 1] = ep.all_to_all(send_rows(c + 1), recv[c + 1], send[c + 1])
            n = sum(recv[c])
            idx = Route.regroup_of(regroup, recv, c)
            rows = ep.wait(pending.pop(c))[idx]
            # g = dL/dy of each slot, dw = dL/dw_tk = dL/dout_t · y_tk (fp32)
            g, dw = slot_grads(rows[:, :D], rows[:, D:D + 1], saved[3 * c + 2])
            del rows
            free_at_last_use(saved[3 * c + 2])
            # the SwiGLU's input gradient and its output a (the down projection's input, for its weight gradient)
            dh, a = swiglu_backward(saved[3 * c + 1], grouped_linear_dx(g, w2, local[c], offs_CEl[c]), glu=ctx.glu)
            free_at_last_use(saved[3 * c + 1])
            place("g", c, g), place("a", c, a)
            del g, a
            # dX and dL/dw back to source-major, placed straight into the send rows
            back = dout_TD.new_empty((n, D + _EXTRA), dtype=dtype)
            scatter_rows(back[:, :D], idx, grouped_linear_dx(dh, w1, local[c], offs_CEl[c]))
            place("dh", c, dh)
            del dh
            back[:, D].index_copy_(0, idx, dw.to(dtype))
            returned[c] = ep.all_to_all(back, send[c], recv[c])
            del back
            if c > 0:
                _scatter_back(dx_TD, dw_TK, ep.wait(returned.pop(c - 1)), orders[c - 1], bounds[c - 1], D)
        # weight gradients once, over every chunk's rows in one-chunk order (with one chunk x is the saved tensor
        # itself; with more, each chunk's is freed once copied to its place)
        El = w1.shape[0]
        per_expert = [sum(local[c][e] for c in range(C)) for e in range(El)]
        for c in range(C):
            place("x", c, saved[3 * c])
            if C > 1:
                free_at_last_use(saved[3 * c])
        xs, gs, acts, dhs = (wholes.pop(k) for k in ("x", "g", "a", "dh"))
        # bias gradients (gpt-oss): each expert's sums of g's and dh's rows, in the same one-chunk order
        b1_dtype, b2_dtype = ctx.bias_dtypes
        db2 = None if b2_dtype is None else grouped_bias_grad(gs, per_expert, offs_El).to(b2_dtype)
        db1 = None if b1_dtype is None else grouped_bias_grad(dhs, per_expert, offs_El).to(b1_dtype)
        dw2 = grouped_weight_grad(gs, acts, per_expert, offs_El)
        del gs, acts
        dw1 = grouped_weight_grad(dhs, xs, per_expert, offs_El)
        if C == 1:
            free_at_last_use(xs)
        del dhs, xs
        _scatter_back(dx_TD, dw_TK, ep.wait(returned.pop(C - 1)), orders[C - 1], bounds[C - 1], D)
        return dx_TD.to(dout_TD.dtype), dw_TK, None, dw1.to(w1.dtype), dw2.to(w2.dtype), db1, db2, None, None, None


def _scatter_back(dx_TD, dw_TK, rows_M, order_M, bounds, D: int) -> None:
    """C' rows (input gradient, then the routing weight's gradient in column D, per slot, sorted by expert) into
    token order."""
    t0, t1 = bounds
    K = dw_TK.shape[1]
    slots = unpermute(rows_M, order_M).view(t1 - t0, K, -1)
    dx_TD[t0:t1] = slots[..., :D].sum(1)
    dw_TK[t0:t1] = slots[..., D].to(dw_TK.dtype)
