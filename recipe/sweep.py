"""The full PP×TP×EP×CP grid under the same cost model as the solver, so "one solve instead of a sweep" is checked
against the grid's optimum rather than assumed. Points are ranked by time per token of the whole job (step time
over tokens per step), which compares layouts that put different numbers of GPUs on one sequence.

Pure Python: never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import Estimate, Layout, TrainOptions
from .hw import HwProfile
from .models import ModelShape
from .solver import cp_candidates, ep_candidates, layout_estimate, pp_candidates, tp_candidates


@dataclass
class GridPoint:
    layout: Layout
    estimate: Estimate

    def seconds_per_token(self, world: int, opts: TrainOptions) -> float:
        tokens = opts.micro_batch_tokens * opts.micro_batches * self.layout.dp(world)
        return self.estimate.step_time_s / tokens


def grid(m: ModelShape, hw: HwProfile, world: int, opts: TrainOptions, auto_chunks: bool = True) -> list[GridPoint]:
    """Every layout the divisibility rules allow for `world` GPUs, feasible or not, each with the options the solver
    estimates it with (`layout_estimate`: its EP chunk count, DSA's kept selections where they fit; "fits" as the
    solver means it: peak + margin ≤ usable)."""
    out = []
    for pp in pp_candidates(m, world):
        for tp in tp_candidates(m, hw, world // pp):
            for ep in ep_candidates(m, world // pp):
                for cp in cp_candidates(m, opts.micro_batch_tokens, world // (pp * tp), tp):
                    lay = Layout(pp=pp, tp=tp, cp=cp, ep=ep)
                    out.append(GridPoint(lay, layout_estimate(m, hw, world, lay, opts, auto_chunks)[1]))
    return out


def ranked(points: list[GridPoint], world: int, opts: TrainOptions) -> list[GridPoint]:
    """Feasible points first, fastest first; then the infeasible ones by how far over memory they are."""
    feas = sorted((p for p in points if p.estimate.fits), key=lambda p: p.seconds_per_token(world, opts))
    infeas = sorted((p for p in points if not p.estimate.fits), key=lambda p: p.estimate.total_gb)
    return feas + infeas


def rank_of(points: list[GridPoint], layout: Layout) -> int:
    """1-based position of `layout` in a ranked list (0 if absent)."""
    for i, p in enumerate(points, 1):
        if p.layout == layout:
            return i
    return 0
