"""The plan's layout on real ranks: device meshes, `parallelize(model, plan, meshes)`, and which micro-batches each
data-parallel rank runs.

Two meshes over the same ranks (docs/training.md, "Layouts"):

    dense   (pp, dp, cp, tp)     attention / Gated DeltaNet / norms / router / shared expert / embedding / head:
                                 FSDP2 shards them over dp×cp (every rank of a stage holds the same copy otherwise;
                                 the dp and cp dimensions flattened into one); the cp ranks of a dp coordinate share
                                 each micro-batch, zigzag-sharded (launch/context_parallel.py); the tp ranks split
                                 the mixers' heads and the head's vocabulary and hold 1/tp of the tokens between
                                 mixers (launch/tensor_parallel.py)
    experts (pp, edp, ep, etp)   routed experts: split by ep (whole experts), FSDP2 shards each rank's experts over
                                 edp = world / (pp·ep·etp)

Both are row-major over the world (tp, then etp, innermost), so with tp = etp = 1 the ep ranks of a group are
consecutive — one node for ep ≤ GPUs per node — and EP is folded over the dp×cp ranks: the ep ranks of a group are
data-parallel or context-parallel ranks that hold different tokens and exchange them. The EP all-to-all runs on
the expert mesh's own ep process group and the CP exchanges on the dense mesh's own cp group, never on one FSDP
uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from launch.expert_parallel import ExpertParallel
from launch.recompute import apply_recompute

class LayoutError(ValueError):
    """A layout that does not match the world it was started with, or that this version cannot run."""


def check_layout(layout, world: int) -> None:
    """One line naming every factor when the plan's layout cannot run on `world` ranks (before any group starts)."""
    if layout.world != world:
        raise LayoutError(f"the plan's layout needs pp·tp·cp·dp = {layout.pp}·{layout.tp}·{layout.cp}·{layout.dp} = "
                          f"{layout.world} processes but this run has WORLD_SIZE={world}: start it with "
                          f"--nproc-per-node {layout.world} or re-solve with --gpus {world}")
    if layout.etp != 1:
        raise LayoutError(f"this version runs data, tensor, context, expert and pipeline parallelism (dp, tp, cp, ep, "
                          f"pp); the plan asks for etp={layout.etp}: re-solve it")


def check_plan_shape(plan, shape) -> None:
    """One line when a degree does not divide what it splits (recipe check's rules, recipe.check.divisibility:
    cp must cut the plan's micro-batch into 2·cp segments of whole delta-rule chunks), before any group starts."""
    from recipe.check import divisibility

    problems = divisibility(shape, plan.layout, plan.train.micro_batch_tokens, getattr(plan.train, "pp_stages", None))
    if problems:
        name, value, why = problems[0]
        raise LayoutError(f"{name}={value}: {why}")
    if plan.layout.pp > 1 and shape.tie_embeddings:
        raise LayoutError(f"pp={plan.layout.pp}: pipeline parallel puts the embedding and the LM head on different "
                          f"stages, and {shape.name} ties them: re-solve with --pp 1")
    if plan.layout.pp > 1 and shape.dsa is not None and shape.dsa.shared_layers:
        from launch.pipeline import split_selection, stage_sizes

        sizes = stage_sizes(plan, shape)
        apart = split_selection(shape, sizes)
        if apart is not None:
            raise LayoutError(f"pp={plan.layout.pp}: the stages {sizes} put layer {apart[0]} apart from layer "
                              f"{apart[1]}, whose sparse-attention selection it reuses: give both to one stage "
                              f"(train.pp_stages)")


@dataclass
class Meshes:
    dense: "dist.DeviceMesh"  # (pp, dp, cp, tp)
    experts: "dist.DeviceMesh"  # (pp, edp, ep, etp)
    data: "dist.DeviceMesh | None" = None  # dp×cp flattened (cp > 1); None: dense["dp"]

    @property
    def world(self) -> int:
        return self.dense.size()

    @property
    def device(self) -> torch.device:
        """This rank's device (the model may still be on the meta device when the layout is applied)."""
        if self.dense.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.dense.device_type)

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel coordinate (which micro-batches it runs)."""
        return self.dense.get_local_rank("dp")

    @property
    def dp_size(self) -> int:
        return self.dense.size(self.dense.mesh_dim_names.index("dp"))

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.dense.get_group("dp")

    @property
    def cp_size(self) -> int:
        return self.dense.size(self.dense.mesh_dim_names.index("cp"))

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.dense.get_group("cp")

    @property
    def data_mesh(self) -> "dist.DeviceMesh":
        """The dense parameters' FSDP mesh: dp, or dp×cp flattened when cp > 1."""
        return self.dense["dp"] if self.data is None else self.data

    @property
    def data_group(self) -> dist.ProcessGroup:
        """The ranks whose metrics add up to the step's (dp×cp: each holds its part of its micro-batches)."""
        return self.data_mesh.get_group()

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.experts.get_group("ep")


def init_distributed(device_type: str, timeout_s: float = 600.0) -> None:
    """The default process group for this torchrun rank (NCCL on CUDA, gloo on CPU), with a timeout so that a rank
    that dies does not leave the others waiting forever."""
    if dist.is_initialized():
        return
    import os

    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:  # not under torchrun: the usual env:// rendezvous
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    # Under torchrun the workers of every attempt meet in the agent's store, which outlives a restart: the addresses
    # the killed attempt's ranks published there would be read back by the new ones (gloo: "connection refused").
    # Every attempt gets its own key prefix.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_store, timeout=timeout)
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"recipe/attempt_{restart}", store), rank=rank,
                            world_size=world, timeout=timeout)


def build_meshes(layout, device_type: str) -> Meshes:
    """The dense and expert meshes of the plan's layout over the initialized default group."""
    backend = dist.get_backend()
    # cp and tp get process groups of their own for the same reason as ep below
    own = {name: backend for name, size in (("cp", layout.cp), ("tp", layout.tp)) if size > 1}
    dense = dist.init_device_mesh(device_type, (layout.pp, layout.dp, layout.cp, layout.tp),
                                  mesh_dim_names=("pp", "dp", "cp", "tp"), backend_override=own or None)
    # the ep dimension gets a process group of its own even where it spans the world (the mesh would otherwise
    # reuse the default group, which FSDP's collectives on the dense mesh also use)
    experts = dist.init_device_mesh(device_type, (layout.pp, layout.edp, layout.ep, layout.etp),
                                    mesh_dim_names=("pp", "edp", "ep", "etp"), backend_override={"ep": backend})
    data = dense["dp", "cp"]._flatten("dp_cp") if layout.cp > 1 else None
    return Meshes(dense, experts, data)


def parallelize(model: nn.Module, plan, meshes: Meshes | None, *, param_dtype: torch.dtype = torch.bfloat16,
                ep_dispatch: bool | None = None) -> nn.Module:
    """Apply the plan's layout to a model built on the meta device (then `launch.model.materialize` it: each rank
    allocates and initializes only its shards), or to one built whole on every rank (same seed, same weights), in
    this order:

    1. tensor parallel (tp > 1): attention and Gated DeltaNet heads split over the tp ranks, the LM head on the
       vocabulary, sequence parallelism between the mixers (launch/tensor_parallel.py); installed as
       `tensor_parallel` on the model (the trainer hands the head its group)
    2. context parallel (cp > 1): one ContextParallel on the cp group (launch/context_parallel.py) installed as
       `context_parallel` on the model (the trainer shards each micro-batch with it) and on every attention and
       Gated DeltaNet module (K/V all-gather, conv halo, delta-rule state combine)
    3. expert parallel: each rank keeps its ep-th of the experts (a DTensor sharded on the ep mesh, so checkpoints
       hold the whole tensor) and the token dispatch of launch/expert_parallel.py replaces the local one
    4. activation recompute (plan.train.recompute, but the last keep_layers of each stage): inside the FSDP unit,
       so the recomputed forward re-gathers its parameters through FSDP's own hooks
    5. FSDP2: routed experts of each layer over edp, each decoder layer over dp×cp, the root (embedding, final
       norm, LM head) over dp×cp; bf16 parameters for compute, fp32 gradient reduction, gradients summed (the loss
       is weighted by each micro-batch's share of the global batch), prefetch set explicitly

    Under pp > 1 a step 0 comes first: the model is cut to this rank's pipeline stages (launch/pipeline.py: one, or
    v under interleaving), the steps below wrap each stage (each its own FSDP2 root), and the StageGroup holding
    them is returned with the schedule attached.

    `meshes` None: one process (recompute only). `ep_dispatch` True runs the EP code path even at ep = 1 (one
    process: the all-to-alls are local copies), for measuring it."""
    layout = plan.layout
    if meshes is not None:
        check_layout(layout, meshes.world)
    # 0: pipeline parallel: this rank keeps its stages only (launch/pipeline.py); the steps below apply to each
    units = [model]
    if layout.pp > 1:
        if meshes is None:
            raise LayoutError("pipeline parallel needs a process group (run under torchrun)")
        from launch.pipeline import split_model

        model = split_model(model, plan, meshes)
        units = model.stages
    for unit in units:
        _parallelize_unit(unit, plan, meshes, param_dtype, ep_dispatch)
    if layout.pp > 1:  # the schedule drives the FSDP2-wrapped stages
        from launch.pipeline import attach_pipeline

        attach_pipeline(model, plan, meshes, param_dtype)
    return model


def _parallelize_unit(model: nn.Module, plan, meshes: Meshes | None, param_dtype: torch.dtype,
                      ep_dispatch: bool | None) -> None:
    """Steps 1-5 of parallelize on a whole model or one pipeline stage."""
    layout = plan.layout
    # 1: tensor parallel
    if layout.tp > 1:
        if meshes is None:
            raise LayoutError("tensor parallel needs a process group (run under torchrun)")
        from launch.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, meshes.dense["tp"])
    # 2: context parallel
    if layout.cp > 1:
        if meshes is None:
            raise LayoutError("context parallel needs a process group (run under torchrun)")
        _apply_context_parallel(model, meshes)
    # 3: expert parallel
    ep = layout.ep
    if ep_dispatch or ep > 1:
        if meshes is None:
            raise LayoutError("the expert-parallel path needs a process group (run under torchrun)")
        _apply_expert_parallel(model, meshes, plan.train.ep_overlap_chunks)
    # 4: activation recompute
    apply_recompute(model, plan.train.recompute, getattr(plan.train, "keep_layers", 0),
                    getattr(plan.train, "keep_selections", False))
    # 5: FSDP2
    if meshes is not None and meshes.world > 1:
        _apply_fsdp(model, meshes, param_dtype)


def moe_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "token_dispatch")]


def _apply_expert_parallel(model: nn.Module, meshes: Meshes, num_chunks: int) -> None:
    from torch.distributed.tensor import DTensor, Shard

    ep_mesh = meshes.experts["ep"]
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    stream = None
    if next(model.parameters()).is_cuda:
        stream = torch.cuda.Stream()  # one communication stream for every layer's all-to-alls
    for experts in moe_layers(model):
        if experts.num_experts % ep:
            raise LayoutError(f"ep={ep} does not divide the {experts.num_experts} experts")
        per_rank = experts.num_experts // ep
        if ep > 1:
            for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
                full = getattr(experts, name)
                if full is None:  # no expert biases (every family but gpt-oss)
                    continue
                local = full.detach()[rank * per_rank:(rank + 1) * per_rank].clone()
                setattr(experts, name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)))
        experts.token_dispatch = ExpertParallel(meshes.ep_group, experts.num_experts, num_chunks, stream)


def _apply_context_parallel(model: nn.Module, meshes: Meshes) -> None:
    from launch.context_parallel import ContextParallel
    from launch.model import ATTENTION_MIXERS, LINEAR_MIXERS

    gdn = [m for m in model.modules() if isinstance(m, LINEAR_MIXERS)]
    chunk = max((m.chunk_size for m in gdn), default=1)
    halo = max((m.conv_kernel - 1 for m in gdn), default=0)
    cp = ContextParallel(meshes.cp_group, chunk=chunk, conv_halo=halo)
    model.context_parallel = cp
    for m in model.modules():
        if isinstance(m, (*ATTENTION_MIXERS, *LINEAR_MIXERS)):
            m.context_parallel = cp


def _apply_fsdp(model: nn.Module, meshes: Meshes, param_dtype: torch.dtype) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    dense_mesh = meshes.data_mesh  # dp, or dp×cp flattened
    edp_mesh = meshes.experts["edp"]
    edp = edp_mesh.size()

    def expert_placement(p):
        # fewer local experts than edp ranks: shard inside each expert (dim 1) rather than pad whole experts
        local_experts = p.to_local().shape[0] if hasattr(p, "to_local") else p.shape[0]
        return Shard(1) if local_experts < edp else Shard(0)

    layers = list(model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers)
    # each MoE layer's routed experts (None for a dense-FFN layer: no expert unit)
    experts = [next((m for m in layer.modules() if hasattr(m, "token_dispatch")), None) for layer in layers]
    for layer, ex in zip(layers, experts):
        if ex is not None:
            fully_shard(ex, mesh=edp_mesh, mp_policy=mp, shard_placement_fn=expert_placement)
        fully_shard(layer, mesh=dense_mesh, mp_policy=mp)
    fully_shard(model, mesh=dense_mesh, mp_policy=mp, reshard_after_forward=False)  # root: the head reads it next
    expert_units = [ex for ex in experts if ex is not None]
    for unit in [model, *layers, *expert_units]:
        unit.set_gradient_divide_factor(1.0)  # sum, not mean: each rank's loss already carries its global share
        unit.set_force_sum_reduction_for_comms(True)  # plain SUM on every backend (gloo has no PREMUL_SUM)
    # explicit prefetch: the EP path syncs the host once per MoE layer (split sizes), which would otherwise delay
    # issuing the next layer's all-gather until the GPU catches up
    for i in range(len(layers)):
        if i + 1 < len(layers):
            layers[i].set_modules_to_forward_prefetch([layers[i + 1]])
        if i > 0:
            layers[i].set_modules_to_backward_prefetch([layers[i - 1]])
    for a, b in zip(expert_units, expert_units[1:]):
        a.set_modules_to_forward_prefetch([b])
        b.set_modules_to_backward_prefetch([a])


def micro_batch_share(num_micro_batches: int, dp_rank: int, dp_size: int) -> list[int | None]:
    """The global micro-batches data-parallel rank `dp_rank` runs: j = dp_rank, dp_rank + dp_size, …; every rank
    runs the same number (⌈G/dp⌉, so each collective has all its ranks), a rank short of one repeats a micro-batch
    with loss weight 0 (None here)."""
    per_rank = math.ceil(num_micro_batches / dp_size)
    mine = list(range(dp_rank, num_micro_batches, dp_size))
    return mine + [None] * (per_rank - len(mine))
