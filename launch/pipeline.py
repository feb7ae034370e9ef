"""Pipeline parallelism: each rank of a pipeline holds one stage — a contiguous run of decoder layers, the embedding
with the first, the final norm, the LM head and the loss with the last — or, under interleaving, v such stages
(r, r + pp, …); torch.distributed.pipelining's Schedule1F1B (ScheduleGPipe for fewer micro-batches than stages,
ScheduleInterleaved1F1B for v stages a rank) runs the step's micro-batches through them (docs/training.md,
"Pipeline parallelism").

    split_model(model, plan, meshes)    this rank's StageGroup of StageModules (the other stages' modules are
                                        dropped): parameter names stay the whole model's (`layers.7.…`), so
                                        checkpoints and the optimizer see the same keys under any pp
    attach_pipeline(group, …)           the PipelineStages and their schedule (after FSDP2 wrapped each stage)
    Pipeline.forward_backward(trainer, batches)
                                        what Trainer.forward_backward runs under pp: the step's gradients, the
                                        metrics on every rank

The split: `train.pp_stages` of the plan (layers per stage, recipe.cost.pipeline_split: balanced by the cost model's
per-layer cost; pp entries, or v·pp for v virtual stages a rank), or the same function of the plan's shape and
micro-batch when the plan does not carry it.

What flows between stages: the hidden states [T, D] of one micro-batch forward and their gradient backward, T the
plan's micro_batch_tokens (T/cp under cp: each rank's zigzag shard; under tp each rank's sequence-parallel rows
[⌈T/tp⌉, D], sent to the rank of the same tp coordinate in the next stage, so no tp rank ever gathers the whole
sequence between stages); a schedule needs one shape for every
micro-batch, so each is padded to T with a document of loss weight 0. Everything else a stage needs — the document
layout (Packing), targets, masks, advantages, log-probs, aggregation weights — every rank already holds (every rank
packs the same step), so each stage takes the micro-batch's from the step's queue, in order (both schedules run each
stage's forwards in micro-batch order; the counts are checked after the step).

Gradients are not rescaled by the schedule (scale_grads=False): each micro-batch's loss carries its share of the
step, as without a pipeline. Under FSDP2 the schedule holds each stage's gradient reduce-scatter until its last
backward.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from launch.data import Batch
from launch.model import Packing, Transformer, layer_ropes


def stage_sizes(plan, shape) -> list[int]:
    """Layers per pipeline stage: the plan's `train.pp_stages`, else recipe.cost.pipeline_split of the plan on its
    hardware profile (what `recipe solve` records)."""
    stages = getattr(plan.train, "pp_stages", None)
    if stages:
        return list(stages)
    from recipe.cost import TrainOptions, pipeline_split

    opts = TrainOptions(micro_batch_tokens=plan.train.micro_batch_tokens, recompute=plan.train.recompute,
                        lm_head=getattr(plan.train, "lm_head", "fused"))
    return pipeline_split(shape, plan.layout.pp, opts, plan.hw_profile())


def split_selection(shape, sizes: list[int]) -> tuple[int, int] | None:
    """(layer, source) of a DeepSeek sparse attention layer that a split of `sizes` layers a stage puts on another
    stage than the layer whose selection it reuses; None when every such pair shares a stage."""
    if shape.dsa is None:
        return None
    stage_of = [s for s, size in enumerate(sizes) for _ in range(size)]
    for source, *shared in shape.dsa.selection_groups(len(stage_of)):
        apart = next((i for i in shared if stage_of[i] != stage_of[source]), None)
        if apart is not None:
            return apart, source
    return None


class StageModule(nn.Module):
    """One pipeline stage of a Transformer: layers [first, first + count) held in a ModuleDict under their global
    index, the embedding on the first stage, the final norm and LM head on the last; attribute names as the
    Transformer's, so parameter and state-dict names are the whole model's. Its forward runs one micro-batch (the
    next of the step's queue): token ids [1, T] on the first stage, hidden states [T, D] on the others; it returns
    the hidden states, or on the last stage the micro-batch's loss weighted by its share of the step [1]."""

    def __init__(self, model: Transformer, index: int, first: int, count: int, is_first: bool, is_last: bool):
        super().__init__()
        self.shape = model.shape
        self.index, self.first_layer, self.is_first, self.is_last = index, first, is_first, is_last
        self.embed_tokens = model.embed_tokens if is_first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(first, first + count)})
        self.norm = model.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None
        self.context_parallel = None
        self.tensor_parallel = None  # launch/tensor_parallel.py, under tp > 1
        self.pipeline: Pipeline | None = None  # attach_pipeline

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, weight, real = self.pipeline.take(self.index)
        packing = batch.packing
        if self.tensor_parallel is not None:  # what the dense MLPs and the final norm gather to
            self.tensor_parallel.num_tokens = packing.num_tokens
        h_TD = self.embed_tokens(x.reshape(-1)) if self.is_first else x
        ropes = layer_ropes(packing.positions, self.shape, h_TD.dtype)
        for layer in self.layers.values():
            h_TD = layer(h_TD, ropes, packing)
        if not self.is_last:
            return h_TD
        loss, metrics = self.pipeline.trainer.loss_terms(batch, hidden_TD=self.norm(h_TD))
        self.pipeline.record(metrics, weight, real)
        return torch.stack([loss * weight])  # [1], not a view (FSDP2 hooks the output)


class StageGroup(nn.Module):
    """The pipeline stages one rank holds — one (1F1B), or v under interleaving: stages r, r + pp, … — seen as one
    model by the trainer, the optimizer and checkpoints: the embedding, the layers (a ModuleDict under their global
    index) and the final norm and LM head where this rank holds them, under the Transformer's attribute names. The
    stages (`stages`, StageModule each, every one its own FSDP2 root) are not registered as submodules, so every
    parameter has exactly its whole-model name."""

    def __init__(self, stages: list[StageModule]):
        super().__init__()
        self.shape = stages[0].shape
        first = next((st for st in stages if st.is_first), None)
        last = next((st for st in stages if st.is_last), None)
        self.embed_tokens = first.embed_tokens if first is not None else None
        self.layers = nn.ModuleDict()
        self.norm = last.norm if last is not None else None
        self.lm_head = last.lm_head if last is not None else None
        self.stages = stages  # a plain list (see above)
        self.is_first, self.is_last = first is not None, last is not None
        self.context_parallel = self.tensor_parallel = None
        self.pipeline: Pipeline | None = None  # attach_pipeline
        self.sync()

    def sync(self) -> None:
        """Take the stages' layers (recompute wraps them in place of the originals), context parallel and tensor
        parallel (the trainer hands the head its group: the last stage's where this rank holds it)."""
        for st in self.stages:
            for k, layer in st.layers.items():
                self.layers[k] = layer
        self.context_parallel = self.stages[0].context_parallel
        self.tensor_parallel = self.stages[-1].tensor_parallel

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline rank's model runs through its schedule (Trainer.forward_backward)")


def split_model(model: Transformer, plan, meshes) -> StageGroup:
    """This rank's stages of `model` (its pp coordinate on the dense mesh: stage r, or with v·pp entries in
    `pp_stages` stages r, r + pp, …); `model` is left holding no module (the other stages' are freed). Raises
    LayoutError (one line) for a split that does not cover the model's layers or a model whose embedding and head
    are one tied matrix."""
    from launch.parallel import LayoutError

    pp = plan.layout.pp
    sizes = stage_sizes(plan, model.shape)
    n = len(model.layers)
    if len(sizes) % pp:
        raise LayoutError(f"train.pp_stages lists {len(sizes)} stages, not a multiple of pp={pp}")
    if sum(sizes) != n or min(sizes) < 1:
        raise LayoutError(f"train.pp_stages {sizes} does not split the {n} layers into {len(sizes)} non-empty "
                          f"stages")
    if model.shape.tie_embeddings:
        raise LayoutError("pipeline parallel puts the embedding and the LM head on different stages; this model ties "
                          "them: re-solve with --pp 1")
    rank = meshes.dense.get_local_rank("pp")
    stages = [StageModule(model, s, sum(sizes[:s]), sizes[s], s == 0, s == len(sizes) - 1)
              for s in range(rank, len(sizes), pp)]
    # the whole model gives up its modules: what this rank's stages do not hold is freed before FSDP2 and the rest
    model.layers, model.embed_tokens, model.norm, model.lm_head = nn.ModuleList(), None, None, None
    return StageGroup(stages)


def pad_batch(batch: Batch, tokens: int) -> Batch:
    """The micro-batch padded to `tokens` with one more document of loss weight 0 (token 0, target −1, no loss,
    its own sequence id): the padding attends only to itself and moves no gradient. Per-token `extra` entries
    (token_weight) get zeros."""
    pad = tokens - batch.num_tokens
    if pad < 0:
        raise ValueError(f"a micro-batch of {batch.num_tokens} tokens is longer than micro_batch_tokens={tokens}")
    if pad == 0:
        return batch
    T = batch.num_tokens

    def grow(t: torch.Tensor | None, fill) -> torch.Tensor | None:
        if t is None:
            return None
        return torch.cat([t, torch.full((pad,), fill, dtype=t.dtype, device=t.device)])

    extra = {k: grow(v, 0) if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape[0] == T else v
             for k, v in batch.extra.items()}
    device = batch.input_ids.device
    return dataclasses.replace(
        batch, input_ids=grow(batch.input_ids, 0), targets=grow(batch.targets, -1),
        packing=Packing.from_lengths([*batch.packing.doc_lengths, pad], device),
        loss_mask=grow(batch.loss_mask, False), advantages=grow(batch.advantages, 0.0),
        seq_id=grow(batch.seq_id, batch.num_seqs), old_logprobs=grow(batch.old_logprobs, 0.0),
        ref_logprobs=grow(batch.ref_logprobs, 0.0), rollout_logprobs=grow(batch.rollout_logprobs, 0.0), extra=extra)


def _summed_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The schedule's loss function: the stage already returns the micro-batch's weighted loss."""
    return output.sum()


class Pipeline:
    """This rank's PipelineStages (one per StageModule of the group) and their schedule over the dense mesh's pp
    group — Schedule1F1B for one stage a rank (GPipe below pp micro-batches), ScheduleInterleaved1F1B for v — and
    the step's micro-batch queue the stages' forwards take from."""

    def __init__(self, group: StageGroup, meshes, tokens: int, num_stages: int, dtype: torch.dtype):
        from torch.distributed.pipelining import PipelineStage

        self.module, self.tokens, self.num_stages = group, tokens, num_stages
        local = tokens // meshes.cp_size  # under cp each rank holds its zigzag shard of every micro-batch
        tp = meshes.dense.size(meshes.dense.mesh_dim_names.index("tp"))
        rows = -(-local // tp)  # under tp the sequence-parallel rows [Tl, D] flow between stages
        self.tp_rank = meshes.dense.get_local_rank("tp")
        self.group = meshes.dense.get_group("pp")
        self.pp = meshes.dense.size(meshes.dense.mesh_dim_names.index("pp"))
        self.index = meshes.dense.get_local_rank("pp")
        self.metrics_group = meshes.data_group
        device = meshes.device  # the stages may still be on the meta device (materialized after)
        hidden = group.shape.hidden_size
        self.stages = []
        for st in group.stages:
            # shapes are static (every micro-batch padded to `tokens`): no shape inference at the first step
            inputs = (torch.empty(1, local, dtype=torch.int64, device=device) if st.is_first else
                      torch.empty(rows, hidden, dtype=dtype, device=device, requires_grad=True))
            outputs = (torch.empty(1, dtype=torch.float32, device=device, requires_grad=True) if st.is_last else
                       torch.empty(rows, hidden, dtype=dtype, device=device, requires_grad=True))
            self.stages.append(PipelineStage(st, st.index, num_stages, device, input_args=inputs,
                                             output_args=outputs, group=self.group))
            st.pipeline = self
        self._schedule, self._n = None, 0
        self.trainer = None
        self._queue: list[tuple[Batch, float, bool]] = []
        self._taken: dict[int, int] = {}
        self._sums: dict[str, torch.Tensor | float] = {}

    def micro_batches(self, n: int) -> int:
        """How many micro-batches the schedule runs for n of this rank's: n with one stage a rank (GPipe below pp
        micro-batches, 1F1B from pp on); under interleaving a multiple of pp, at least pp (its rounds)."""
        if len(self.stages) == 1:
            return n
        return -(-max(n, self.pp) // self.pp) * self.pp

    def schedule(self, n: int):
        """The schedule for n micro-batches (rebuilt when n changes: the stages' buffers are per micro-batch)."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        if self._schedule is None or self._n != n:
            if len(self.stages) == 1:
                # fewer micro-batches than stages: 1F1B would run all forwards, then all backwards anyway — GPipe,
                # which (unlike Schedule1F1B) takes n < pp, with no weight-0 micro-batches to fill the pipeline
                kind = Schedule1F1B if n >= self.pp else ScheduleGPipe
                self._schedule = kind(self.stages[0], n, loss_fn=_summed_loss, scale_grads=False)
            else:
                self._schedule = ScheduleInterleaved1F1B(self.stages, n, loss_fn=_summed_loss, scale_grads=False)
            self._n = n
        return self._schedule

    def take(self, stage: int) -> tuple[Batch, float, bool]:
        """The next micro-batch of stage `stage` (each stage runs its forwards in micro-batch order)."""
        i = self._taken.get(stage, 0)
        self._taken[stage] = i + 1
        return self._queue[i]

    def record(self, metrics: dict[str, torch.Tensor], weight: float, real: bool) -> None:
        for k, v in metrics.items():  # every key, also from padding forwards: the same keys on every rank
            add = (v if k == "num_tokens" else v * weight) if real else 0.0
            self._sums[k] = self._sums.get(k, 0.0) + add

    def forward_backward(self, trainer, batches: list[Batch]) -> dict[str, float]:
        """Trainer.forward_backward under pp: this data-parallel rank's share of the step's micro-batches (under
        interleaving topped up with weight-0 repeats to what the schedule needs) through the schedule; the last
        stage's metrics, summed over its data-parallel ranks, on every rank."""
        from launch.parallel import micro_batch_share

        weights = trainer._weights(batches)
        share = micro_batch_share(len(batches), trainer.dp_rank, trainer.dp_size)
        share += [None] * (self.micro_batches(len(share)) - len(share))
        cp = self.module.context_parallel
        self._queue = []
        for j in share:
            batch, weight = (batches[j], weights[j]) if j is not None else (batches[0], 0.0)
            batch = pad_batch(trainer.with_loss_weights(batch), self.tokens)
            self._queue.append((cp.shard(batch) if cp is not None else batch, weight, j is not None))
        self._taken, self._sums, self.trainer = {}, {}, trainer
        args = (torch.stack([b.input_ids for b, _, _ in self._queue]),) if self.module.is_first else ()
        target = torch.zeros(len(share), device=batches[0].input_ids.device) if self.module.is_last else None
        try:
            self.schedule(len(share)).step(*args, target=target, return_outputs=False)
        finally:
            self.trainer, queued, self._queue = None, len(self._queue), []
        ran = [self._taken.get(st.index, 0) for st in self.module.stages]
        if ran != [queued] * len(ran):
            raise RuntimeError(f"pipeline rank {self.index}: its stages ran {ran} forwards for {queued} micro-batches")
        metrics = None
        if self.module.is_last:
            keys = sorted(self._sums)
            device = batches[0].input_ids.device
            out = torch.stack([torch.as_tensor(self._sums[k], dtype=torch.float32, device=device).reshape(())
                               for k in keys])
            if self.metrics_group is not None and dist.get_world_size(self.metrics_group) > 1:
                dist.all_reduce(out, group=self.metrics_group)
            metrics = dict(zip(keys, out.tolist()))
        box = [metrics]
        dist.broadcast_object_list(box, group=self.group, group_src=self.pp - 1)  # the last stage: rank pp − 1
        return box[0]


def attach_pipeline(group: StageGroup, plan, meshes, dtype: torch.dtype) -> StageGroup:
    """Take the parallelized stages' layers into the group and install the Pipeline as `group.pipeline`, which
    Trainer.forward_backward runs."""
    group.sync()
    num_stages = len(stage_sizes(plan, group.shape))
    group.pipeline = Pipeline(group, meshes, plan.train.micro_batch_tokens, num_stages, dtype)
    return group


def gathered_state_dict(stage: StageGroup) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict as full CPU tensors on global rank 0 (None on the other ranks), every stage's
    parameters under their global names: each stage gathers its sharded tensors one at a time (bounded device
    memory), its first data-parallel (and tensor-parallel) rank keeps them in host memory, and rank 0 collects the
    stages'."""
    from torch.distributed.tensor import DTensor

    pipeline = stage.pipeline
    keep = (pipeline.metrics_group is None or dist.get_rank(pipeline.metrics_group) == 0) and pipeline.tp_rank == 0
    mine: dict[str, torch.Tensor] = {}
    for name, t in stage.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if keep:
            mine[name] = full.detach().cpu()
        del full
    stages = [None] * dist.get_world_size()
    dist.gather_object(mine if keep else None, stages if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    return {k: v for part in stages if part for k, v in part.items()}
