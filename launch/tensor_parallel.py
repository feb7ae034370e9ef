"""Tensor parallelism over the dense mesh's "tp" dimension: attention and Gated DeltaNet heads split across the tp
ranks, sequence parallelism for everything between two mixers, and the vocabulary-parallel LM head.

Shape legend: T tokens of the micro-batch, Tl = ⌈T / tp⌉ tokens a rank holds between mixers, D model dim.

Parameters (DTensors on the 1-D tp mesh, as ColwiseParallel / RowwiseParallel / SequenceParallel place them; FSDP2
then shards each over dp, so checkpoints hold the whole tensors under the same names for every layout):

    Shard(0)    attention q_proj (per head [query | gate] rows), k_proj, v_proj (and their biases), gpt-oss's
                sinks (one per query head); MLA's q_proj or q_b_proj and
                kv_b_proj (per head rows); Gated DeltaNet in_proj_qkv and conv1d (rows grouped per key head,
                launch/model.py), in_proj_z, in_proj_b, in_proj_a, dt_bias, A_log; KDA's q/k/v projections and
                convs, f_b_proj, dt_bias, A_log, b_proj, g_b_proj; a dense layer's MLP gate_proj
                and up_proj; embed_tokens and lm_head (vocabulary rows)
    Shard(1)    o_proj, out_proj, a dense MLP's down_proj (rowwise: each rank's share gives a partial sum)
    Shard(0)    OLMoE's q/k norms (a weight per channel of q_proj's and k_proj's rows: their sums of squares are
                summed over the tp ranks, TensorParallel.all_reduce)
    Replicate   every other dense parameter: the residual-stream RMSNorms, q/k norms and the Gated DeltaNet and KDA
                output norms, KDA's f_a_proj and g_a_proj (low-rank inputs every head reads), MLA's q_a_proj, kv_a_proj_with_mqa and their norms (the latents every head reads), router,
                shared expert and its gate; an attention o_proj bias (each rank adds 1/tp of it to its partial sum,
                `Attention.o_proj_bias_share`: the reduce-scatter adds it up to one bias, and each rank's gradient,
                1/tp of the bias's, sums to it)

DeepSeek sparse attention's indexer (frozen, replicated) projects every token's index key on every rank, but each
rank projects the index queries, scores and selects keys (the indexer's cost) for its `row_share` of the queries
only, and the selections are all-gathered (`gather_rows`, 4·topk bytes a query).

The residual stream between mixers is sequence-parallel: each tp rank holds Tl of the micro-batch's tokens (the
sequence zero-padded to tp·Tl). Per decoder layer:

    x_local ─ input norm ─ all-gather ─▶ mixer (this rank's heads, all T tokens) ─ reduce-scatter ─▶ + x_local
            ─ post norm ─ router, routed experts (EP), shared expert on the Tl local tokens ─▶ + x_local

so the tp ranks send different tokens to the experts (with the mixer's tokens replicated, every routed token would
reach its experts tp times and their gradients count tp times). A dense layer's gated MLP is split like a mixer
(its intermediate channels over tp, an all-gather before it and a reduce-scatter after it). Under context
parallelism the T tokens are the rank's zigzag shard of the micro-batch, and the mixers' CP exchanges
(launch/context_parallel.py) run on this rank's heads over the cp group. The embedding is vocabulary-parallel: each rank looks up the T tokens in its V/tp rows
(zero for the others) and a reduce-scatter leaves it the sum for its Tl rows. After the final norm an all-gather
hands the head all T tokens, whose backward keeps this rank's rows of the head's hidden gradient (the head already
sums that gradient over the vocabulary shards).

The compute runs on local tensors: a forward pre-hook on each module swaps its tp DTensors for their local shards
(`to_local`, the gradient of a replicated parameter marked Partial: each rank's tokens or heads give part of it) and
a post-hook puts them back; FSDP2 turns each Partial gradient into the sum over tp (one all-reduce) before it
reduce-scatters over dp. The model itself holds no collective: the SP gathers and scatters are hooks on the mixers,
the embedding and the final norm, installed here.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class _GatherTokens(torch.autograd.Function):
    """[Tl, D] per rank → [T, D] on every rank. Backward: `reduce` sums each rank's gradient of the whole sequence
    and hands every rank its rows (reduce-scatter: the mixers' ranks each use all tokens for their own heads); or,
    where the gradient is already the whole sum on every rank (the head), keeps this rank's rows."""

    @staticmethod
    def forward(ctx, x, tp, num_tokens: int, reduce: bool):
        ctx.tp, ctx.num_tokens, ctx.reduce = tp, num_tokens, reduce
        out = x.new_empty(tp.size * x.shape[0], *x.shape[1:])
        _all_gather_single(out, x.contiguous(), group=tp.group)
        return out if out.shape[0] == num_tokens else out[:num_tokens].clone()

    @staticmethod
    def backward(ctx, g):
        tp = ctx.tp
        g = tp.pad(g.contiguous())
        if ctx.reduce:
            out = g.new_empty(g.shape[0] // tp.size, *g.shape[1:])
            _reduce_scatter_single(out, g, group=tp.group)
            return out, None, None, None
        n = g.shape[0] // tp.size
        return g[tp.rank * n:(tp.rank + 1) * n].clone(), None, None, None


class _ReduceScatterTokens(torch.autograd.Function):
    """[T, D] partial sums per rank → this rank's Tl rows of their sum. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp, ctx.num_tokens = tp, x.shape[0]
        x = tp.pad(x.contiguous())
        out = x.new_empty(x.shape[0] // tp.size, *x.shape[1:])
        _reduce_scatter_single(out, x, group=tp.group)
        return out

    @staticmethod
    def backward(ctx, g):
        tp = ctx.tp
        out = g.new_empty(tp.size * g.shape[0], *g.shape[1:])
        _all_gather_single(out, g.contiguous(), group=tp.group)
        return out[:ctx.num_tokens], None


class TensorParallel:
    """The tp group and the sequence-parallel token split of the micro-batch in flight (installed as
    `tensor_parallel` on the model; the trainer reads the head's group and local weight from it)."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.group = mesh.get_group()
        self.size, self.rank = mesh.size(), mesh.get_local_rank()
        self.num_tokens = 0  # T of the micro-batch in flight (the model's forward pre-hook sets it)

    def local_len(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.size)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Zero rows up to tp·Tl."""
        pad = self.size * self.local_len(x.shape[0]) - x.shape[0]
        return F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)) if pad else x

    def gather(self, x_local: torch.Tensor, num_tokens: int, reduce: bool = True) -> torch.Tensor:
        return _GatherTokens.apply(x_local, self, num_tokens, reduce)

    def reduce_scatter(self, x_TD: torch.Tensor) -> torch.Tensor:
        return _ReduceScatterTokens.apply(x_TD, self)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the tp ranks, its gradient the sum of theirs (OLMoE's q/k norms' sums of squares)."""
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(x, group=self.group)

    def row_share(self, num_rows: int) -> tuple[int, int]:
        """This rank's rows [a, b) of `num_rows`, split as the sequence-parallel tokens are (Tl a rank, the last
        ranks' fewer or none)."""
        n = self.local_len(num_rows)
        a = min(num_rows, self.rank * n)
        return a, min(num_rows, a + n)

    @torch.no_grad()
    def gather_rows(self, x_local: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Every rank's `row_share` of a tensor without gradient → its [num_rows, …] on every rank (DeepSeek sparse
        attention's selections: each rank selects the keys of its share of the queries)."""
        n = self.local_len(num_rows)
        x = F.pad(x_local, (0, 0) * (x_local.dim() - 1) + (0, n - x_local.shape[0]))
        out = x.new_empty(self.size * n, *x.shape[1:])
        _all_gather_single(out, x.contiguous(), group=self.group)
        return out[:num_rows]

    def head_weight(self, weight_VD: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary rows of the LM head (for kernels' vocab-parallel head, with `group`)."""
        return weight_VD.to_local() if hasattr(weight_VD, "to_local") else weight_VD


# ---- parameter placements -------------------------------------------------------------------------------------
def _placements(model: nn.Module) -> dict[str, str]:
    """Parameter name → "row" (Shard(0)), "col" (Shard(1)) or "rep" (Replicate) for every tp parameter; the routed
    experts are left out (expert parallelism places them)."""
    from launch.model import Attention, GatedDeltaNet, HeadsRMSNorm, KimiDeltaAttention, MLAttention

    out: dict[str, str] = {}
    for name, m in model.named_modules():
        prefix = name + "." if name else ""
        if isinstance(m, MLAttention):  # the heads' expansions split; the shared latent and RoPE key replicated
            for p in ("q_proj", "q_b_proj", "q_gate_proj", "kv_b_proj"):
                if hasattr(m, p):
                    out[f"{prefix}{p}.weight"] = "row"
            out[f"{prefix}o_proj.weight"] = "col"
        elif isinstance(m, Attention):
            for p in ("q_proj", "k_proj", "v_proj"):
                if getattr(m, p) is None:  # Gemma 4's full layers: the values are the keys' projection
                    continue
                out[f"{prefix}{p}.weight"] = "row"
                if getattr(m, p).bias is not None:
                    out[f"{prefix}{p}.bias"] = "row"
            if m.sinks is not None:  # one per query head: split with the heads
                out[f"{prefix}sinks"] = "row"
            if m.g_proj is not None:  # Step-3.7's gate: a row per query head
                out[f"{prefix}g_proj.weight"] = "row"
            if isinstance(m.q_norm, HeadsRMSNorm):  # a weight per channel of the projection: split with its rows
                out[f"{prefix}q_norm.weight"] = out[f"{prefix}k_norm.weight"] = "row"
            out[f"{prefix}o_proj.weight"] = "col"
        elif isinstance(m, GatedDeltaNet):
            for p in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                      "conv1d.weight", "dt_bias", "A_log"):
                out[prefix + p] = "row"
            out[prefix + "out_proj.weight"] = "col"
        elif isinstance(m, KimiDeltaAttention):  # every per-head tensor split with the heads; f_a_proj and
            # g_a_proj (the low-rank bottlenecks every head reads) and the per-head-channel o_norm replicated
            for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
                      "v_conv1d.weight", "f_b_proj.weight", "dt_bias", "A_log", "b_proj.weight", "g_b_proj.weight"):
                out[prefix + p] = "row"
            out[prefix + "o_proj.weight"] = "col"
        elif _is_dense_mlp(name, m):
            out[prefix + "gate_proj.weight"] = out[prefix + "up_proj.weight"] = "row"
            out[prefix + "down_proj.weight"] = "col"
    for held in ("lm_head", "embed_tokens"):  # a pipeline stage holds either, both or neither
        if getattr(model, held, None) is not None:
            out[held + ".weight"] = "row"
    for name, p in model.named_parameters():
        if name not in out and not _is_routed_expert(name):
            out[name] = "rep"
    return out


def _is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _is_dense_mlp(name: str, module: nn.Module) -> bool:
    """A decoder layer's own gated MLP (dense models, dense-first layers), not an MoE's shared expert."""
    from launch.moe import GatedMLP

    return isinstance(module, GatedMLP) and name.endswith(".mlp")


def check_model(model: nn.Module, tp: int) -> None:
    """One line for a model this tensor parallelism cannot split exactly."""
    from launch.model import ATTENTION_MIXERS, LINEAR_MIXERS, Attention

    s = model.shape
    if s.tp_refusal:
        raise ValueError(f"tp={tp}: {s.name} {s.tp_refusal}; use tp=1")
    for m in model.modules():
        if isinstance(m, ATTENTION_MIXERS):
            if m.o_proj.bias is not None and not isinstance(m, Attention):  # Attention adds its share of it
                raise ValueError(f"tp={tp}: {s.name}'s attention output projection has a bias (not split by this "
                                 f"tensor parallelism); use tp=1")
            if m.num_heads % tp or m.num_kv_heads % tp:
                raise ValueError(f"tp={tp} does not divide {s.name}'s {m.num_heads} query / {m.num_kv_heads} KV heads")
        if isinstance(m, LINEAR_MIXERS) and m.num_k_heads % tp:
            raise ValueError(f"tp={tp} does not divide {s.name}'s {m.num_k_heads} linear-attention key heads")
    if s.vocab_size % tp:
        raise ValueError(f"tp={tp} does not divide {s.name}'s vocabulary of {s.vocab_size}")
    for name, m in model.named_modules():
        if _is_dense_mlp(name, m) and m.gate_proj.out_features % tp:
            raise ValueError(f"tp={tp} does not divide {s.name}'s dense MLP width {m.gate_proj.out_features}")


def _distribute(model: nn.Module, mesh) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    tp, rank = mesh.size(), mesh.get_local_rank()
    kinds = _placements(model)
    for name, kind in kinds.items():
        mod_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(mod_name)
        frozen = not getattr(module, leaf).requires_grad  # DSA's indexer: it stays frozen
        full = getattr(module, leaf).detach()
        if kind == "rep":
            local, placement = full.clone(), Replicate()
        else:
            dim = 0 if kind == "row" else 1
            local, placement = full.chunk(tp, dim)[rank].clone(), Shard(dim)
        setattr(module, leaf, nn.Parameter(DTensor.from_local(local, mesh, [placement], run_check=False),
                                           requires_grad=not frozen))


def _localize(modules: list[nn.Module], mesh) -> None:
    """Pre-hook: swap every tp DTensor parameter of each module's subtree for its local shard (a replicated one's
    gradient marked Partial); post-hook: put the DTensors back (FSDP2's own hooks see its parameters unchanged)."""
    from torch.distributed.tensor import DTensor, Partial

    def pre(module, args):
        swapped = []
        for m in module.modules():
            for leaf, p in list(m._parameters.items()):
                if isinstance(p, DTensor) and p.device_mesh == mesh:
                    grad = [Partial()] if p.placements[0].is_replicate() else list(p.placements)
                    m._parameters[leaf] = p.to_local(grad_placements=grad)
                    swapped.append((m, leaf, p))
        module._tp_swapped = swapped

    def post(module, args, out):
        for m, leaf, p in module.__dict__.pop("_tp_swapped", ()):
            m._parameters[leaf] = p
        return out

    for m in modules:
        m.register_forward_pre_hook(pre)
        m.register_forward_hook(post)


def apply_tensor_parallel(model: nn.Module, mesh) -> TensorParallel:
    """Split `model` (on the meta device, or built whole with the same weights on every rank) over the 1-D tp
    `mesh` and install the sequence-parallel hooks; returns the TensorParallel, also set as `model.tensor_parallel`.

    `model` is a Transformer, or one pipeline stage of it (launch/pipeline.py: its layers in a ModuleDict, the
    embedding on the first stage, the final norm and head on the last). A Transformer's forward sets the micro-batch's
    token count T (`num_tokens`, what the dense MLPs and the final norm gather to) from its packing; a stage sets it
    itself, from the micro-batch it takes. Between two stages flow the sequence-parallel rows [Tl, D]."""
    from launch.model import ATTENTION_MIXERS, LINEAR_MIXERS, Transformer

    check_model(model, mesh.size())
    tp = TensorParallel(mesh)
    _distribute(model, mesh)
    mixers, blocks, mlps = [], [], []
    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for layer in layers:
        mixer = next(m for m in layer.children() if isinstance(m, (*ATTENTION_MIXERS, *LINEAR_MIXERS)))
        mixers.append(mixer)
        blocks += [m for m in layer.children() if m is not mixer]  # norms, the MoE / MLP
        mlps += [m for name, m in layer.named_children() if _is_dense_mlp("." + name, m)]
    embed, final_norm = getattr(model, "embed_tokens", None), getattr(model, "norm", None)
    _localize([m for m in (*mixers, *blocks, embed, final_norm) if m is not None], mesh)
    for mixer in mixers:
        if hasattr(mixer, "o_proj_bias_share"):  # each rank's partial output carries 1/tp of o_proj's bias
            mixer.o_proj_bias_share = 1.0 / tp.size
        for norm in (getattr(mixer, "q_norm", None), getattr(mixer, "k_norm", None)):
            if hasattr(norm, "sum_over_ranks"):  # a norm over all heads: this rank's heads are some of them
                norm.sum_over_ranks = tp.all_reduce
        if getattr(mixer, "indexer", None) is not None:  # DSA: each rank selects for its share of the queries
            mixer.selection_split = tp

    def model_pre(module, args):  # Transformer.forward(input_ids_T, packing)
        tp.num_tokens = args[1].num_tokens

    rows = model.shape.vocab_size // tp.size  # this rank's vocabulary rows: [rank·rows, (rank+1)·rows)
    inside = {}
    if embed is not None:
        pad = getattr(embed, "pad_row", None)  # the frozen row, where this rank holds it
        embed.padding_idx = pad - tp.rank * rows if pad is not None and 0 <= pad - tp.rank * rows < rows else None

    def embed_pre(module, args):
        ids = args[0] - tp.rank * rows
        inside["mask"] = (ids >= 0) & (ids < rows)
        return (torch.where(inside["mask"], ids, 0), *args[1:])

    def embed_post(module, args, out):
        return tp.reduce_scatter(torch.where(inside.pop("mask")[:, None], out, 0.0))

    def mixer_pre(module, args):
        x_local, *rest = args
        return (tp.gather(x_local, rest[-1].num_tokens), *rest)

    def mixer_post(module, args, out):
        return tp.reduce_scatter(out)

    def mlp_pre(module, args):
        return (tp.gather(args[0], tp.num_tokens), *args[1:])

    def norm_post(module, args, out):
        return tp.gather(out, tp.num_tokens, reduce=False)

    if isinstance(model, Transformer):
        model.register_forward_pre_hook(model_pre)
    if embed is not None:
        embed.register_forward_pre_hook(embed_pre)
        embed.register_forward_hook(embed_post)
    for mixer in mixers:
        mixer.register_forward_pre_hook(mixer_pre)
        mixer.register_forward_hook(mixer_post)
    for mlp in mlps:
        mlp.register_forward_pre_hook(mlp_pre)
        mlp.register_forward_hook(mixer_post)
    if final_norm is not None:
        final_norm.register_forward_hook(norm_post)
    model.tensor_parallel = tp
    return tp
