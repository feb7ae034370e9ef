"""Mixture of experts: softmax top-k router → token permutation → grouped expert GEMMs → unpermute and combine,
plus an optional shared expert with a sigmoid gate.

Shape legend: T tokens, D model dim, E experts, K top-k, I expert intermediate dim, M = T·K routed rows.

The routed experts live in their own submodule (`GroupedExperts`): tokens and their top-k choices in, the weighted
sum of their experts' outputs out. How the tokens reach the experts is a pluggable `token_dispatch` (None: every
expert is local); expert parallelism (launch/expert_parallel.py) installs one that sends them across ranks, so this
module holds no communication and the expert submodule is one FSDP unit called once per forward.
Parameter names and layouts follow Hugging Face's fused-expert layout: gate_up_proj [E, 2I, D], down_proj [E, D, I].
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def _use_grouped_mm(x: torch.Tensor) -> bool:
    # torch._grouped_mm runs on Hopper-class CUDA in bf16; its CPU backward fails on empty groups (torch 2.13), so CPU
    # and fp32 take the per-expert loop, which computes the same function.
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, dim: int, ffn: int):
        super().__init__()
        self.num_experts, self.dim, self.ffn_dim = num_experts, dim, ffn
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, ffn))
        # (module, x_TD, top_w_TK, top_e_TK) -> out_TD; None: all experts are local (launch/expert_parallel.py)
        self.token_dispatch = None

    def forward(self, x_TD: torch.Tensor, top_w_TK: torch.Tensor, top_e_TK: torch.Tensor) -> torch.Tensor:
        """Σ_k top_w_TK[t, k] · expert_{top_e_TK[t, k]}(x_TD[t]) for every token t."""
        if self.token_dispatch is not None:
            return self.token_dispatch(self, x_TD, top_w_TK, top_e_TK)
        T, K = top_e_TK.shape
        order_M, token_M, num_tokens_per_expert_E = permute(top_e_TK, self.num_experts)
        y_MD = self.ffn(x_TD[token_M], num_tokens_per_expert_E)
        return combine(y_MD, order_M, top_w_TK)

    def ffn(self, x_MD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """Rows of x are sorted by expert; expert e owns the next num_tokens_per_expert_E[e] rows."""
        if _use_grouped_mm(x_MD):
            offsets_E = torch.cumsum(num_tokens_per_expert_E, 0, dtype=torch.int32)
            h_MF = torch._grouped_mm(x_MD, self.gate_up_proj.transpose(-2, -1), offs=offsets_E)
            gate, up = h_MF.chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs=offsets_E)
        counts = num_tokens_per_expert_E.tolist()  # host sync: the loop needs the split sizes
        outs = []
        for e, x_e in enumerate(torch.split(x_MD, counts)):
            if counts[e] == 0:
                continue
            gate, up = F.linear(x_e, self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, self.down_proj[e]))
        return torch.cat(outs) if outs else x_MD.new_zeros(0, self.dim)


class TopKRouter(nn.Module):
    def __init__(self, num_experts: int, dim: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, dim))

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (router logits [T, E], top-k weights [T, K] in x's dtype, top-k expert ids [T, K])."""
        logits_TE = F.linear(x_TD, self.weight)
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        top_w_TK, top_e_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w_TK = top_w_TK / top_w_TK.sum(-1, keepdim=True)
        return logits_TE, top_w_TK.to(x_TD.dtype), top_e_TK


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn, bias=False)
        self.up_proj = nn.Linear(dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def permute(top_e_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the T·K (token, slot) pairs by expert. Returns (order_M: flat slot index of each sorted row,
    token_M: its token, num_tokens_per_expert_E). Stable, so recompute reproduces the same order."""
    flat_e_M = top_e_TK.reshape(-1)
    order_M = torch.argsort(flat_e_M, stable=True)
    # a scatter-add, not bincount: bincount sizes its output from the largest id, a device-to-host sync on CUDA
    num_tokens_per_expert_E = torch.zeros(num_experts, dtype=torch.int64, device=flat_e_M.device)
    num_tokens_per_expert_E.scatter_add_(0, flat_e_M, torch.ones_like(flat_e_M))
    return order_M, order_M // top_e_TK.shape[1], num_tokens_per_expert_E


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """The rows of a 2-D tensor as 8-byte words (the same bytes), where its layout allows; else None."""
    r = 8 // t.element_size()
    if r < 2 or t.dim() != 2 or t.stride(1) != 1 or t.shape[1] % r or t.stride(0) % r or t.storage_offset() % r:
        return None
    return t.view(torch.int64)


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst[index[i]] = src[i] for every row i (index_copy_ along dim 0), moving 8-byte words where the rows allow:
    a 16-bit index_copy_ addresses each value on its own and runs at ~40% of the word copy's speed on an H200
    (bench/bench_row_moves.py). Not differentiable; returns dst."""
    dw, sw = _words(dst), _words(src)
    if dw is not None and sw is not None:
        dw.index_copy_(0, index, sw)
    else:
        dst.index_copy_(0, index, src)
    return dst


class _Unpermute(torch.autograd.Function):
    """Rows into the places `order_M` gives (scatter_rows); the gradient gathers them back."""

    @staticmethod
    def forward(ctx, y_MD, order_M):
        ctx.save_for_backward(order_M)
        return scatter_rows(torch.empty_like(y_MD), order_M, y_MD)

    @staticmethod
    def backward(ctx, g_MD):
        (order_M,) = ctx.saved_tensors
        return g_MD.index_select(0, order_M), None


def combine(y_MD: torch.Tensor, order_M: torch.Tensor, top_w_TK: torch.Tensor) -> torch.Tensor:
    """Unpermute the expert outputs to (token, slot) order and take the weighted sum over slots (a scatter of
    whole rows and a batched product, no atomics: deterministic, so recompute reproduces it bitwise)."""
    T, K = top_w_TK.shape
    y_TKD = _Unpermute.apply(y_MD, order_M).view(T, K, y_MD.shape[-1])
    return torch.bmm(top_w_TK.unsqueeze(1), y_TKD).squeeze(1).clone()  # a view would trip FSDP2's output hook


class MoE(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, ffn: int, shared_ffn: int = 0,
                 shared_gate: bool = False, norm_topk_prob: bool = True):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = TopKRouter(num_experts, dim, top_k, norm_topk_prob)
        self.experts = GroupedExperts(num_experts, dim, ffn)
        self.shared_expert = SwiGLU(dim, shared_ffn) if shared_ffn else None
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if shared_ffn and shared_gate else None

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        _, top_w_TK, top_e_TK = self.gate(x_TD)
        out_TD = self.experts(x_TD, top_w_TK, top_e_TK)
        if self.shared_expert is not None:
            shared_TD = self.shared_expert(x_TD)
            if self.shared_expert_gate is not None:
                shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * shared_TD
            out_TD = out_TD + shared_TD
        return out_TD
