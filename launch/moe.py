"""Mixture of experts: softmax top-k router → token permutation → grouped expert GEMMs → unpermute and combine,
plus an optional shared expert with a sigmoid gate.

Shape legend: T tokens, D model dim, E experts, K top-k, I expert intermediate dim, M = T·K routed rows.

The expert compute lives in its own submodule (`GroupedExperts`) whose input is the permuted rows and the per-expert
row counts, so expert parallelism can wrap it later (dispatch all-to-all in a forward-pre hook, combine in a forward
hook, as a torchtitan ParallelStyle does) without the MoE module holding any communication.
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
        self.num_experts, self.dim, self.ffn = num_experts, dim, ffn
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, ffn))

    def forward(self, x_MD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
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
    num_tokens_per_expert_E = torch.bincount(flat_e_M, minlength=num_experts)
    return order_M, order_M // top_e_TK.shape[1], num_tokens_per_expert_E


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
        T, D = x_TD.shape
        _, top_w_TK, top_e_TK = self.gate(x_TD)
        order_M, token_M, num_tokens_per_expert_E = permute(top_e_TK, self.num_experts)
        y_MD = self.experts(x_TD[token_M], num_tokens_per_expert_E)
        # unpermute to (token, slot) order and take the weighted sum over slots (no atomics: deterministic)
        y_slots = torch.empty_like(y_MD).index_copy_(0, order_M, y_MD).view(T, self.top_k, D)
        out_TD = torch.bmm(top_w_TK.unsqueeze(1), y_slots).squeeze(1)
        if self.shared_expert is not None:
            shared_TD = self.shared_expert(x_TD)
            if self.shared_expert_gate is not None:
                shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * shared_TD
            out_TD = out_TD + shared_TD
        return out_TD
