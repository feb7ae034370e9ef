"""Mixture of experts: top-k router (softmax, or DeepSeek-V3's sigmoid with group-limited choice) → token permutation
→ grouped expert GEMMs → unpermute and combine, plus an optional shared expert with an optional sigmoid gate.

Shape legend: T tokens, D model dim, E experts, K top-k, I expert intermediate dim, M = T·K routed rows.

The routed experts live in their own submodule (`GroupedExperts`): tokens and their top-k choices in, the weighted
sum of their experts' outputs out. How the tokens reach the experts is a pluggable `token_dispatch` (None: every
expert is local); expert parallelism (launch/expert_parallel.py) installs one that sends them across ranks, so this
module holds no communication and the expert submodule is one FSDP unit called once per forward.
Parameter names and layouts follow Hugging Face's fused-expert layout: gate_up_proj [E, 2I, D], down_proj [E, D, I];
gpt-oss's experts add biases (gate_up_proj_bias [E, 2I], down_proj_bias [E, D]) and a clamped activation
(kernels.expert_grads.GLU), and its router a bias; Step-3.7's clamped layers another clamped form (the activated gate
bounded: kernels.expert_grads.clamped_swiglu).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.expert_grads import GLU, SWIGLU, glu_forward, glu_of, slot_grads, swiglu_backward
from kernels.expert_grads import add_expert_bias_ as add_expert_bias
from kernels.rms_norm import rms_norm


# Up to LOOP_EXPERTS local experts of at least LOOP_MIN_WEIGHT elements a matrix, the per-expert loop of cuBLAS
# GEMMs runs instead of one grouped GEMM: with few, wide experts each GEMM is large and cuBLAS's is faster (Mixtral's 8
# experts, 59M and 117M elements a matrix, on one H200: the loop 2-15% faster than torch._grouped_mm at 2,048 to
# 16,384 rows an expert), while with many narrow ones the grouped kernel's one launch wins (128 experts of 3.1M: 1.2
# to 3.8 times the loop's rate; bench/bench_grouped_gemm.py). Shapes between were not measured: they keep the grouped
# kernel.
LOOP_EXPERTS = 16
LOOP_MIN_WEIGHT = 2**24


def _use_grouped_mm(x: torch.Tensor, w_shape) -> bool:
    """Whether the grouped GEMMs over experts of weights `w_shape` ([E, O, D]) run as one torch._grouped_mm."""
    # torch._grouped_mm runs on Hopper-class CUDA in bf16; its CPU backward fails on empty groups (torch 2.13), so CPU
    # and fp32 take the per-expert loop, which computes the same function; so do a few wide experts (LOOP_EXPERTS).
    few_wide = w_shape[0] <= LOOP_EXPERTS and w_shape[1] * w_shape[2] >= LOOP_MIN_WEIGHT
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and not few_wide


# On CPU a GEMM of fewer than 4 rows takes another kernel (another summation order) than a taller one; padding each
# expert's rows to 4 makes every row's result independent of how many rows share its expert, which is what makes k
# chunks equal one chunk bitwise.
_CPU_MIN_ROWS = 4


def _per_expert(x_MD, counts: list[int], w_E, transpose: bool) -> torch.Tensor:
    """Per expert e: x_e @ w_eᵀ (`transpose`) or x_e @ w_e, one GEMM each, written into one output [M, O] (no copy of
    the experts' outputs into it afterwards: the output is the size of the grouped GEMM's). Under autograd (a caller
    outside the MoE's own Function, whose forward runs without it) through _PerExpertLinear, whose backward runs the
    same loops."""
    if torch.is_grad_enabled() and (x_MD.requires_grad or w_E.requires_grad):
        return _PerExpertLinear.apply(x_MD, w_E, counts, transpose)
    out = x_MD.new_empty(x_MD.shape[0], w_E.shape[1] if transpose else w_E.shape[2])
    start = 0
    for e, n in enumerate(counts):
        if n:
            x_e, w_e = x_MD[start:start + n], (w_E[e].t() if transpose else w_E[e])
            if n < _CPU_MIN_ROWS and not x_MD.is_cuda:
                out[start:start + n] = (torch.cat([x_e, x_e.new_zeros(_CPU_MIN_ROWS - n, x_e.shape[1])]) @ w_e)[:n]
            else:
                torch.mm(x_e, w_e, out=out[start:start + n])
        start += n
    return out


class _PerExpertLinear(torch.autograd.Function):
    """_per_expert under autograd: y_e = x_e @ w_eᵀ (transpose) or x_e @ w_e; dx by the loop with the other
    orientation, dW by the weight-gradient loop."""

    @staticmethod
    def forward(ctx, x_MD, w_E, counts, transpose):
        ctx.save_for_backward(x_MD, w_E)
        ctx.counts, ctx.transpose = counts, transpose
        return _per_expert(x_MD, counts, w_E, transpose)

    @staticmethod
    def backward(ctx, g_MO):
        x_MD, w_E = ctx.saved_tensors
        counts, t = ctx.counts, ctx.transpose
        dx = _per_expert(g_MO, counts, w_E, not t) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:  # [E, O, D] as w: gᵀx (transpose) or xᵀg
            dw = _weight_grad_loop(g_MO, x_MD, counts) if t else _weight_grad_loop(x_MD, g_MO, counts)
        return dx, dw, None, None


def _weight_grad_loop(dy_MO, x_MD, counts: list[int]) -> torch.Tensor:
    out = dy_MO.new_empty(len(counts), dy_MO.shape[1], x_MD.shape[1])
    start = 0
    for e, n in enumerate(counts):  # written in place: no stacked copy of every expert's gradient
        if n:
            torch.mm(dy_MO[start:start + n].t(), x_MD[start:start + n], out=out[e])
        else:
            out[e].zero_()
        start += n
    return out


# ---- grouped GEMMs over experts (rows sorted by expert; offsets on the device, counts on the host for the loop) -
def grouped_linear(x_MD, w_EOD, counts: list[int] | None, offs_E) -> torch.Tensor:
    """Per expert e: x_e @ w_eᵀ → [M, O]."""
    if _use_grouped_mm(x_MD, w_EOD.shape):
        return torch._grouped_mm(x_MD, w_EOD.transpose(-2, -1), offs=offs_E)
    return _per_expert(x_MD, counts, w_EOD, transpose=True)


def grouped_linear_dx(dy_MO, w_EOD, counts: list[int] | None, offs_E) -> torch.Tensor:
    """Per expert e: dy_e @ w_e → [M, D] (the input gradient of `grouped_linear`)."""
    if _use_grouped_mm(dy_MO, w_EOD.shape):
        return torch._grouped_mm(dy_MO, w_EOD, offs=offs_E)
    return _per_expert(dy_MO, counts, w_EOD, transpose=False)


def grouped_weight_grad(dy_MO, x_MD, counts: list[int] | None, offs_E) -> torch.Tensor:
    """Per expert e: dy_eᵀ @ x_e → [E, O, D] (the weight gradient of `grouped_linear`; zero for an idle expert)."""
    if _use_grouped_mm(dy_MO, (offs_E.shape[0], dy_MO.shape[1], x_MD.shape[1])):
        return torch._grouped_mm(dy_MO.t(), x_MD, offs=offs_E)
    return _weight_grad_loop(dy_MO, x_MD, counts)


# the ones operand of the grouped bias-gradient GEMM: 8 columns keep its bf16 rows 16 bytes wide (the kernel's
# alignment); the first column is the sum
_ONES_COLUMNS = 8


def grouped_bias_grad(dy_MO, counts: list[int] | None, offs_E) -> torch.Tensor:
    """Per expert e: the sum of dy_e's rows → [E, O] (the gradient of a per-expert bias added to `grouped_linear`'s
    output; zero for an idle expert). Where the grouped GEMMs run (no host counts) it is the grouped weight
    gradient against a column of ones (no host sync, no atomics); else one sum an expert."""
    E, (M, O) = offs_E.shape[0], dy_MO.shape
    if counts is None or _use_grouped_mm(dy_MO, (E, O, _ONES_COLUMNS)):
        ones = dy_MO.new_ones(M, _ONES_COLUMNS)
        return torch._grouped_mm(dy_MO.t(), ones, offs=offs_E)[..., 0].contiguous()
    out = dy_MO.new_empty(E, O)
    start = 0
    for e, n in enumerate(counts):
        if n:
            torch.sum(dy_MO[start:start + n], dim=0, out=out[e])
        else:
            out[e].zero_()
        start += n
    return out


def add_expert_bias_(rows_MO, bias_EO, counts: list[int] | None, offs_E) -> torch.Tensor:
    """rows += the bias of each row's expert (rows sorted by expert), in place: one add an expert with host counts,
    else one kernel that finds each row's expert among the offsets (the expert of row m: the first offset above m)."""
    if counts is not None:
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows_MO[start:start + n] += bias_EO[e]
            start += n
        return rows_MO
    return add_expert_bias(rows_MO, bias_EO, offs_E)  # one pass over the rows (kernels/expert_grads.py)


class GroupedExperts(nn.Module):
    """Every routed expert: y = act(x W1ᵀ [+ b1]) W2ᵀ [+ b2], act the `activation` GLU of h = [gate | up] (SwiGLU;
    gpt-oss's clamped form, with the biases)."""

    def __init__(self, num_experts: int, dim: int, ffn: int, activation: GLU = SWIGLU, bias: bool = False):
        super().__init__()
        self.num_experts, self.dim, self.ffn_dim = num_experts, dim, ffn
        self.activation = activation
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, ffn))
        if bias:  # [gate | up] as the rows of gate_up_proj
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * ffn))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, dim))
        else:
            self.register_parameter("gate_up_proj_bias", None)
            self.register_parameter("down_proj_bias", None)
        # (module, x_TD, top_w_TK, top_e_TK) -> out_TD; None: all experts are local (launch/expert_parallel.py)
        self.token_dispatch = None
        # whether the backward reads the experts' output (a norm after the MoE block saves it: the decoder layer sets
        # this), so a recomputed forward must combine it too
        self.output_read = False

    def forward(self, x_TD: torch.Tensor, top_w_TK: torch.Tensor, top_e_TK: torch.Tensor) -> torch.Tensor:
        """Σ_k top_w_TK[t, k] · expert_{top_e_TK[t, k]}(x_TD[t]) for every token t."""
        if self.token_dispatch is not None:
            return self.token_dispatch(self, x_TD, top_w_TK, top_e_TK)
        return _RoutedExperts.apply(x_TD, top_w_TK, top_e_TK, self.gate_up_proj, self.down_proj,
                                    self.gate_up_proj_bias, self.down_proj_bias, self.activation, self.output_read)


def topk_in_best_groups(choice_TE: torch.Tensor, top_k: int, groups: int, topk_groups: int,
                        group_score) -> torch.Tensor:
    """Expert ids [T, K]: the top-k of `choice_TE` among the `topk_groups` best of `groups` equal expert groups, a
    group scored by `group_score` over its [T, G, E/G] choice values (DeepSeek-V3's: its two best summed; V2's: its
    best). No gradient: the choice steers, it is not trained."""
    with torch.no_grad():
        if groups > 1:
            T, E = choice_TE.shape
            best_TG = group_score(choice_TE.view(T, groups, E // groups)).topk(topk_groups, dim=-1).indices
            keep_TG = torch.zeros(T, groups, dtype=torch.bool, device=choice_TE.device).scatter_(1, best_TG, True)
            choice_TE = choice_TE.masked_fill(~keep_TG.repeat_interleave(E // groups, dim=1), float("-inf"))
        return choice_TE.topk(top_k, dim=-1).indices


class TopKRouter(nn.Module):
    """Softmax routing: the top-k experts of softmax(logits), renormalized over the k when norm_topk_prob. With a
    bias (gpt-oss: logits = x Wᵀ + b) and renormalized, the k are chosen on the logits and weighted by a softmax
    over those k logits, as gpt-oss computes it: the same weights as softmax, top-k, renormalize. DeepSeek-V2
    (recipe.models.SoftmaxRouter): the k chosen among the `topk_groups` best of `groups` expert groups (a group
    scored by its most probable expert), the weights times `scaling`. `sigmoid_of_top` (Llama 4, Cohere2-MoE's
    sigmoid selection): the k chosen on the logits and weighted by the sigmoid of each, in fp32, renormalized over
    the k when norm_topk_prob (Llama 4's is off)."""

    def __init__(self, num_experts: int, dim: int, top_k: int, norm_topk_prob: bool, bias: bool = False,
                 groups: int = 1, topk_groups: int = 1, scaling: float = 1.0, sigmoid_of_top: bool = False):
        super().__init__()
        self.sigmoid_of_top = sigmoid_of_top
        if num_experts % groups:
            raise ValueError(f"{num_experts} experts cannot form {groups} equal groups")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.groups, self.topk_groups, self.scaling = groups, topk_groups, scaling
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (router logits [T, E], top-k weights [T, K] in x's dtype, top-k expert ids [T, K])."""
        logits_TE = F.linear(x_TD, self.weight, self.bias)
        if self.sigmoid_of_top:
            top_l_TK, top_e_TK = torch.topk(logits_TE, self.top_k, dim=-1)
            top_w_TK = torch.sigmoid(top_l_TK.float())
            if self.norm_topk_prob:
                top_w_TK = top_w_TK / top_w_TK.sum(-1, keepdim=True)
            return logits_TE, top_w_TK.to(x_TD.dtype), top_e_TK
        if self.bias is not None and self.norm_topk_prob:
            top_l_TK, top_e_TK = torch.topk(logits_TE, self.top_k, dim=-1)
            return logits_TE, torch.softmax(top_l_TK.float(), dim=-1).to(x_TD.dtype), top_e_TK
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        if self.groups > 1:
            top_e_TK = topk_in_best_groups(probs_TE, self.top_k, self.groups, self.topk_groups,
                                           lambda g_TGE: g_TGE.amax(-1))
            top_w_TK = probs_TE.gather(1, top_e_TK)
        else:
            top_w_TK, top_e_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w_TK = top_w_TK / top_w_TK.sum(-1, keepdim=True)
        if self.scaling != 1.0:
            top_w_TK = top_w_TK * self.scaling
        return logits_TE, top_w_TK.to(x_TD.dtype), top_e_TK


class SigmoidTopKRouter(nn.Module):
    """DeepSeek-V3 / GLM-4.5 routing (recipe.models.SigmoidRouter): sigmoid scores (`softmax`: a softmax over the
    experts, ERNIE-4.5's); the top-k experts chosen on score +
    `e_score_correction_bias` among the `topk_groups` best of `groups` expert groups (a group scored by the sum of
    its two best); weighted by their scores without the bias, renormalized (norm_topk_prob), times `scaling`. The
    correction bias is a buffer: it steers the choice, which has no gradient, so the loss cannot train it; it is
    loaded and saved with the weights and stays fp32 whatever dtype the module is cast to (its values differ by
    steps finer than bf16 resolves near 1)."""

    def __init__(self, num_experts: int, dim: int, top_k: int, norm_topk_prob: bool, groups: int = 1,
                 topk_groups: int = 1, scaling: float = 1.0, softmax: bool = False):
        super().__init__()
        self.softmax = softmax
        if num_experts % groups or (groups > 1 and num_experts // groups < 2):
            raise ValueError(f"{num_experts} experts cannot form {groups} groups of two or more")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.groups, self.topk_groups, self.scaling = groups, topk_groups, scaling
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        moved = self.e_score_correction_bias
        if moved.dtype != torch.float32:  # a cast: keep the fp32 values, on the new device
            self.e_score_correction_bias = bias.to(device=moved.device, dtype=torch.float32)
        return self

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (router logits [T, E], top-k weights [T, K] in x's dtype, top-k expert ids [T, K])."""
        logits_TE = F.linear(x_TD, self.weight)
        scores_TE = torch.softmax(logits_TE.float(), dim=-1) if self.softmax else torch.sigmoid(logits_TE.float())
        top_e_TK = topk_in_best_groups(scores_TE.detach() + self.e_score_correction_bias, self.top_k, self.groups,
                                       self.topk_groups, lambda g_TGE: g_TGE.topk(2, dim=-1).values.sum(-1))
        top_w_TK = scores_TE.gather(1, top_e_TK)
        if self.norm_topk_prob:
            top_w_TK = top_w_TK / (top_w_TK.sum(-1, keepdim=True) + 1e-20)
        return logits_TE, (top_w_TK * self.scaling).to(x_TD.dtype), top_e_TK


class ScaledRouter(nn.Module):
    """Gemma 4's router: its input (the FFN block's, before any norm) at unit RMS in fp32 with no weight, times a
    learned scale per channel and 1/√D, projected to the experts' logits; the top k of their softmax renormalized,
    each times its expert's learned scale (`per_expert_scale`)."""

    def __init__(self, num_experts: int, dim: int, top_k: int, eps: float):
        super().__init__()
        self.top_k, self.eps = top_k, eps
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.scale = nn.Parameter(torch.ones(dim))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))
        self.backend = "auto"  # the unit-RMS norm's: auto | torch | triton (kernels/rms_norm.py)

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (router logits [T, E], top-k weights [T, K] in x's dtype, top-k expert ids [T, K])."""
        h_TD = rms_norm(x_TD, x_TD.new_ones(x_TD.shape[-1]), self.eps, 0.0, backend=self.backend)
        logits_TE = F.linear(h_TD * self.scale * x_TD.shape[-1] ** -0.5, self.weight)
        top_w_TK, top_e_TK = torch.topk(torch.softmax(logits_TE.float(), dim=-1), self.top_k, dim=-1)
        top_w_TK = top_w_TK / top_w_TK.sum(-1, keepdim=True) * self.per_expert_scale[top_e_TK]
        return logits_TE, top_w_TK.to(x_TD.dtype), top_e_TK


class GatedMLP(nn.Module):
    """down(glu(gate(x), up(x))): SwiGLU by default; Step-3.7's clamped layers' clamped form
    (kernels.expert_grads.clamped_swiglu), Gemma 4's GeGLU (GEGLU_TANH): the routed experts' activations."""

    def __init__(self, dim: int, ffn: int, glu: GLU = SWIGLU):
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn, bias=False)
        self.up_proj = nn.Linear(dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, dim, bias=False)
        self.glu = glu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu_of(self.gate_proj(x), self.up_proj(x), self.glu))


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


def unpermute(rows_M: torch.Tensor, order_M: torch.Tensor) -> torch.Tensor:
    """Rows in expert order back to flat (token, slot) order: out[order_M[i]] = rows_M[i] (see `permute`)."""
    return scatter_rows(torch.empty_like(rows_M), order_M, rows_M)


def free_at_last_use(*tensors: torch.Tensor) -> None:
    """Release the storage of tensors a Function saved for its backward once that backward reads them no more, if
    the running backward drops the graph's saved tensors when it ends (no `retain_graph`), as the autograd node
    would free them a moment later anyway. Without this, a tensor saved by `save_for_backward` outside activation
    checkpointing stays alive through the whole backward of its Function, whatever the backward deletes: the node
    holds it. (Under non-reentrant checkpointing the recomputed tensors have no other owner, and `del` alone frees
    them.) Nothing is freed where torch does not say whether the graph is kept. Each tensor must own its storage
    whole (a fresh result, not a view into another live tensor)."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    if keep is None or keep():
        return
    for t in tensors:
        t.untyped_storage().resize_(0)


def expert_ffn(x_MD, w1_EFD, w2_EDI, counts: list[int] | None, offs_E, glu: GLU = SWIGLU, b1_EF=None,
               b2_ED=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts over rows sorted by expert: (h = x W1ᵀ + b1, [gate | up]; y = glu(h) W2ᵀ + b2), the biases
    optional (gpt-oss's), the activation SwiGLU (silu(gate)·up) or another `GLU`."""
    h_MF = grouped_linear(x_MD, w1_EFD, counts, offs_E)
    if b1_EF is not None:
        add_expert_bias_(h_MF, b1_EF, counts, offs_E)
    y_MD = grouped_linear(glu_forward(h_MF, glu), w2_EDI, counts, offs_E)
    if b2_ED is not None:
        add_expert_bias_(y_MD, b2_ED, counts, offs_E)
    return h_MF, y_MD


def combine_into(out_TD: torch.Tensor, y_MD: torch.Tensor, order_M: torch.Tensor, top_w_TK: torch.Tensor) -> None:
    """out_t = Σ_k w_tk · y_tk: the expert rows back to (token, slot) order and their weighted sum, a batched product
    written into out_TD (a fresh tensor, not a view, which FSDP2's output hook needs; no atomics, so recompute
    reproduces it bitwise)."""
    T, K = top_w_TK.shape
    torch.bmm(top_w_TK.unsqueeze(1), unpermute(y_MD, order_M).view(T, K, -1), out=out_TD.unsqueeze(1))


class _RoutedExperts(torch.autograd.Function):
    """Every routed expert on this rank, forward and backward written out (what autograd would do, less what it
    would keep and the kernels it would add):

        forward:  x_M = x[token_M] (sorted by expert); h = x_M W1ᵀ (+ b1); y = glu(h) W2ᵀ (+ b2);
                  out_t = Σ_k w_tk y_tk (glu: SwiGLU's silu(gate)·up, or gpt-oss's or Step-3.7's clamped form)
        backward: g = dL/dout_t · w_tk and dL/dw_tk = dL/dout_t · y_tk, one kernel over the rows (slot_grads);
                  dh and the activation a from g W2 and h, one kernel (swiglu_backward); the weight gradients
                  gᵀa and dhᵀx_M, the bias gradients each expert's sums of g's and dh's rows;
                  dx_M = dh W1, back to (token, slot) order and summed over the slots

    It saves x_M, h and y (the activation is recomputed in the backward's SwiGLU kernel), where autograd's graph of
    the same forward keeps the activation and silu(gate) as well, and its backward forms the routing weights'
    gradient and the slot gradients as batched products of one-row matrices. Under full recompute the recomputed
    forward skips the combine: nothing in the backward reads the layer's output (the expert-parallel path,
    launch/expert_parallel.py, does the same) — unless `output_read` says something after the block saves it (a
    norm on the MoE's output: ModelShape.norm_placement "sandwich" or "post")."""

    @staticmethod
    def forward(ctx, x_TD, top_w_TK, top_e_TK, w1_EFD, w2_EDI, b1_EF=None, b2_ED=None, glu: GLU = SWIGLU,
                output_read: bool = False):
        # inside the backward pass (graph task running): this is the recompute of a checkpointed layer
        recompute = torch._C._current_graph_task_id() != -1 and not output_read
        order_M, token_M, counts_E = permute(top_e_TK, w1_EFD.shape[0])
        offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
        # the loop needs them on the host
        ctx.counts = None if _use_grouped_mm(x_TD, w1_EFD.shape) else counts_E.tolist()
        ctx.glu, ctx.bias_dtypes = glu, tuple(None if b is None else b.dtype for b in (b1_EF, b2_ED))
        x_MD = x_TD[token_M]
        h_MF, y_MD = expert_ffn(x_MD, w1_EFD, w2_EDI, ctx.counts, offs_E, glu, b1_EF, b2_ED)
        ctx.save_for_backward(x_MD, h_MF, y_MD, order_M, offs_E, top_w_TK, w1_EFD, w2_EDI)
        out_TD = x_TD.new_empty(x_TD.shape)
        if not recompute:
            combine_into(out_TD, y_MD, order_M, top_w_TK)
        return out_TD

    @staticmethod
    def backward(ctx, dout_TD):
        # every tensor is dropped at its last use: the saved rows (x, h, y: fresh tensors of the forward's own) are
        # freed there too, with or without recompute, unless the graph is kept for another backward
        x_MD, h_MF, y_MD, order_M, offs_E, top_w_TK, w1, w2 = ctx.saved_tensors
        counts, (T, K), dtype = ctx.counts, top_w_TK.shape, y_MD.dtype
        g_MD = dout_TD.to(dtype).index_select(0, order_M // K)  # dL/dout of each row's token, then g over it
        g_MD, dw_M = slot_grads(g_MD, top_w_TK.reshape(-1).index_select(0, order_M).to(dtype).unsqueeze(1), y_MD,
                                out=g_MD)
        free_at_last_use(y_MD)
        del y_MD
        b1_dtype, b2_dtype = ctx.bias_dtypes
        db2 = None if b2_dtype is None else grouped_bias_grad(g_MD, counts, offs_E).to(b2_dtype)
        dh_MF, a_MI = swiglu_backward(h_MF, grouped_linear_dx(g_MD, w2, counts, offs_E), glu=ctx.glu)
        free_at_last_use(h_MF)
        del h_MF
        dw2 = grouped_weight_grad(g_MD, a_MI, counts, offs_E)
        del g_MD, a_MI
        db1 = None if b1_dtype is None else grouped_bias_grad(dh_MF, counts, offs_E).to(b1_dtype)
        dw1 = grouped_weight_grad(dh_MF, x_MD, counts, offs_E)
        free_at_last_use(x_MD)
        del x_MD
        dx_MD = grouped_linear_dx(dh_MF, w1, counts, offs_E)
        del dh_MF
        dx_TD = unpermute(dx_MD, order_M).view(T, K, -1).sum(1)
        dw_TK = dw_M.new_empty(T * K).index_copy_(0, order_M, dw_M).view(T, K)
        return (dx_TD.to(dout_TD.dtype), dw_TK.to(top_w_TK.dtype), None, dw1.to(w1.dtype), dw2.to(w2.dtype), db1,
                db2, None, None)


class MoE(nn.Module):
    """Router → routed experts (+ shared expert). gpt-oss: `router_bias` (its router, TopKRouter's biased form),
    `expert_bias` and its clamped `activation`. ERNIE-4.5: `softmax_scores` (its router, SigmoidTopKRouter scoring
    by a softmax). Llama 4: `weights_on_input`: each of a token's k experts takes the token times its weight (the
    sigmoid of its logit, TopKRouter's `sigmoid_of_top`) and the k outputs are summed unweighted, as one routed
    row a (token, slot) pair with weight 1. Cohere2-MoE's sigmoid selection: `sigmoid_top` (the same weights, on the
    experts' outputs). Step-3.7's clamped layers: the experts' `activation` a clamped GLU, the shared expert's
    `shared_glu`. Gemma 4: `scaled_router` (ScaledRouter, whose norm's eps it is), GeGLU on both sides; its layer
    (launch/model.py) calls the gate, experts and shared expert apart, each side normed."""

    def __init__(self, dim: int, num_experts: int, top_k: int, ffn: int, shared_ffn: int = 0,
                 shared_gate: bool = False, norm_topk_prob: bool = True, sigmoid_router=None,
                 router_bias: bool = False, activation: GLU = SWIGLU, expert_bias: bool = False,
                 softmax_scores: bool = False, softmax_router=None, weights_on_input: bool = False,
                 shared_mean: bool = False, sigmoid_top: bool = False, shared_glu: GLU = SWIGLU,
                 scaled_router: float | None = None):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.shared_mean = shared_mean  # Cohere's "average": the mean of the routed and shared experts' outputs
        self.weights_on_input = weights_on_input
        if scaled_router is not None:
            self.gate = ScaledRouter(num_experts, dim, top_k, scaled_router)
        elif sigmoid_router is None:
            grouped = {} if softmax_router is None else dict(  # a recipe.models.SoftmaxRouter (DeepSeek-V2)
                groups=softmax_router.groups, topk_groups=softmax_router.topk_groups, scaling=softmax_router.scaling)
            self.gate = TopKRouter(num_experts, dim, top_k, norm_topk_prob, bias=router_bias,
                                   sigmoid_of_top=weights_on_input or sigmoid_top, **grouped)
        else:  # a recipe.models.SigmoidRouter
            self.gate = SigmoidTopKRouter(num_experts, dim, top_k, norm_topk_prob, sigmoid_router.groups,
                                          sigmoid_router.topk_groups, sigmoid_router.scaling, softmax_scores)
        self.experts = GroupedExperts(num_experts, dim, ffn, activation, expert_bias)
        self.shared_expert = GatedMLP(dim, shared_ffn, shared_glu) if shared_ffn else None
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if shared_ffn and shared_gate else None

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        _, top_w_TK, top_e_TK = self.gate(x_TD)
        if self.weights_on_input:
            T, K = top_w_TK.shape
            rows = x_TD if K == 1 else x_TD.unsqueeze(1).expand(T, K, x_TD.shape[1]).reshape(T * K, -1)
            rows = rows * top_w_TK.reshape(T * K, 1)
            out_TD = self.experts(rows, top_w_TK.new_ones(T * K, 1), top_e_TK.reshape(T * K, 1))
            if K > 1:
                out_TD = out_TD.view(T, K, -1).sum(1)
        else:
            out_TD = self.experts(x_TD, top_w_TK, top_e_TK)
        if self.shared_expert is not None:
            shared_TD = self.shared_expert(x_TD)
            if self.shared_expert_gate is not None:
                shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * shared_TD
            out_TD = out_TD + shared_TD
            if self.shared_mean:
                out_TD = out_TD * 0.5
        return out_TD
