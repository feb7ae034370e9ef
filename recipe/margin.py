"""Error bands and the memory margin: how far each predicted figure can be trusted, and the memory the solver holds
back so that a plan launches even where the cost model is off.

Each figure has a basis: `measured` when the hardware profile has a committed calibration grid
(hw_profiles/calibration/<name>.json, recipe/calibration.py) and `assumed` otherwise, and an error band: the grid's
worst relative error on a measured profile, ASSUMED_MEMORY_ERROR / ASSUMED_TIME_ERROR on an assumed one. A model the
training core does not build (`models.trainable`: planned only) has no step of its own measured on any profile, so
its figures are assumed everywhere; so are a model's whose attention heads are wider than any the calibration grids
timed (WIDEST_TIMED_HEAD: Gemma 4's 512-wide full layers), whose attention kernel's rate and working set the cost
model extrapolates.

The margin is the memory a plan must leave free beyond its predicted peak (docs/solver.md, "Error bands and the
memory margin", derives every term):

    margin = e/(1 − e) · peak                          the calibration's worst memory error e (an under-prediction
                                                       of e leaves the real peak at peak/(1 − e))
           + root unit        when dp·cp > 1           (E + H)·2/tp + H·2/tp: FSDP2's root unit (embedding, head)
                                                       stays unsharded from the forward to the end of the backward
                                                       (reshard_after_forward=False) with the head's bf16 gradient,
                                                       formed in the forward, less what the lm_head row already adds
           + FSDP in flight   when dp·cp > 1 or edp > 1  one more layer's unsharded gradient, bf16 and its fp32
                                                       reduce copy (6 bytes a parameter): its reduce-scatter is still
                                                       in flight while the next layer's backward runs
           + all-to-all       when ep > 1              NCCL/RCCL point-to-point buffers: (ep − 1) peers × 2
                                                       directions × P2P_CHANNELS × NCCL_BUFFER_BYTES
           + imbalance        when ep > 1              (EXPERT_IMBALANCE − 1) × the routed rows of the MoE layers live
                                                       at the peak: s·k·(2h + 3·I)·2 bytes a layer (one layer under
                                                       full recompute, every layer of the stage without)

None of the last four exists on one GPU, so no single-GPU grid can measure them. Pure Python: never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .cost import (BF16, FP32, GB, Estimate, Layout, TrainOptions, estimate, kept_layers, layer_params,
                   routed_row_bytes, stage_layers)
from .hw import HwProfile
from .models import ModelShape, param_counts, trainable

# The error band of a profile without a calibration grid (AMD, B200, a user's own profile): half as much again as the
# ±10% a measured grid must meet at most (the committed H200 grid is within it). Memory: the allocator (HIP's
# caching allocator), the attention and delta-rule kernels (what they save for the backward) and the collective
# library's buffers all differ from what was measured.
ASSUMED_MEMORY_ERROR = 0.15
# Step time on an assumed profile: its compute efficiency is the measured one scaled by a guess (hw_profiles/*.yaml,
# compute_efficiency's source), so its band is wider.
ASSUMED_TIME_ERROR = 0.25
# The busiest EP rank's routed rows over the mean: the capacity factor of 1.25 the Switch Transformer trains with
# (Fedus et al., 2021), taken as the load a dropless router's busiest rank receives beyond an even share.
EXPERT_IMBALANCE = 1.25
# NCCL's default NCCL_BUFFSIZE (4 MiB) per channel and direction of a peer connection, and the channels an
# all-to-all opens per peer (assumption; NCCL picks 2 to 8 by topology).
NCCL_BUFFER_BYTES = 4 * 2**20
P2P_CHANNELS = 4
MARGIN_PARTS = ("error", "root_unit", "fsdp_in_flight", "all_to_all", "imbalance")


@dataclass(frozen=True)
class Bands:
    """Basis and error band of each figure: `memory` (the peak) and `step_time` (and every figure derived from
    it: tokens/s, TFLOP/s, MFU)."""

    basis: dict[str, str]  # figure → "measured" | "assumed"
    error: dict[str, float]  # figure → worst relative error, a fraction

    @property
    def assumed(self) -> list[str]:
        return [k for k, v in self.basis.items() if v == "assumed"]


@dataclass(frozen=True)
class Margin:
    bands: Bands
    parts_gb: dict[str, float]  # MARGIN_PARTS → GB

    @property
    def total_gb(self) -> float:
        return sum(self.parts_gb.values())

    @property
    def multi_gpu_gb(self) -> float:
        """The allowance for what one GPU cannot measure: everything but the calibration error term."""
        return self.total_gb - self.parts_gb["error"]


ASSUMED = Bands({"memory": "assumed", "step_time": "assumed"},
               {"memory": ASSUMED_MEMORY_ERROR, "step_time": ASSUMED_TIME_ERROR})


@lru_cache(maxsize=64)
def _bands(name: str) -> Bands:
    from . import calibration

    cal = calibration.load(name)
    if cal is None:
        return ASSUMED
    return Bands({"memory": "measured", "step_time": "measured"},
                 {"memory": float(cal.memory_error), "step_time": float(cal.time_error)})


# the widest attention head (q·k or value channels) the calibration grids' steps ran
WIDEST_TIMED_HEAD = 256


@lru_cache(maxsize=256)
def planned_only(m: ModelShape) -> bool:
    """Whether the training core does not build `m` (it is planned, never run, so never measured)."""
    return trainable(m) is not None


def widest_head(m: ModelShape) -> int:
    """The widest attention head of any of `m`'s attention layers (q·k or value channels; 0 without attention)."""
    if m.mla is not None:
        return max(m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim, m.mla.v_head_dim)
    kinds = {t for t in m.layer_types if t != "linear_attention"}
    return max((max(m.head_dim_at(k), m.value_width_at(k)) for k in kinds), default=0)


def unmeasured(m: ModelShape) -> bool:
    """Whether no measured step backs `m`'s figures on any profile: planned only, or attention heads wider than
    WIDEST_TIMED_HEAD."""
    return planned_only(m) or widest_head(m) > WIDEST_TIMED_HEAD


def bands(hw: HwProfile, m: ModelShape | None = None) -> Bands:
    """The basis and error band of each figure on this profile (its committed calibration, if any), for model `m`:
    assumed on every profile where no measured step backs it (`unmeasured`)."""
    return ASSUMED if m is not None and unmeasured(m) else _bands(hw.name)


def routed_rows_bytes(m: ModelShape, s: float, etp: int = 1) -> float:
    """What one MoE layer holds for its s·k routed rows at its backward's peak: each row's saved tensors and the
    larger backward moment (cost.routed_row_bytes, the expert width split by etp) — the part of the MoE block's
    working set that scales with the rows a rank receives."""
    return s * m.top_k * sum(routed_row_bytes(m, etp))


def memory_margin(m: ModelShape, hw: HwProfile, world: int, layout: Layout, opts: TrainOptions,
                  est: Estimate) -> Margin:
    """The margin for `layout` (formulas in the module docstring), given its estimate."""
    b = bands(hw, m)
    pp, tp, cp, ep, etp = layout.pp, layout.tp, layout.cp, layout.ep, layout.etp
    dp, edp = layout.dp(world), layout.edp(world)
    e = b.error["memory"]
    parts = dict.fromkeys(MARGIN_PARTS, 0.0)
    parts["error"] = est.total_gb * e / (1 - e) if e < 1 else est.total_gb
    c = param_counts(m)
    if dp * cp > 1:
        emb, head = c["embedding"], c["head"] or c["embedding"]  # tied: the embedding is the head
        if pp == 1:
            root = ((c["embedding"] + c["head"]) + head) * BF16 / tp
        else:  # the first stage holds the embedding, the last the head and its gradient
            root = max(emb, 2 * head) * BF16 / tp
        parts["root_unit"] = max(0.0, root / GB - est.memory_gb["lm_head"])
    layer_dense, layer_expert = layer_params(m)
    inflight = (layer_dense / tp if dp * cp > 1 else 0.0) + (layer_expert / (ep * etp) if edp > 1 else 0.0)
    parts["fsdp_in_flight"] = inflight * (BF16 + FP32) / GB
    if ep > 1 and m.num_moe_layers:
        parts["all_to_all"] = (ep - 1) * 2 * P2P_CHANNELS * NCCL_BUFFER_BYTES / GB
        s = opts.micro_batch_tokens / cp
        # the MoE layers whose routed rows are live at once: one recomputed layer's, or every kept layer's of the
        # largest stage (the plan's split, as the memory terms count its layers) in every micro-batch in flight
        kept = kept_layers(opts, stage_layers(m, pp, opts, hw))
        in_flight = min(pp, opts.micro_batches) if pp > 1 else 1
        live = max(1.0, kept * m.num_moe_layers / m.num_layers * in_flight)
        parts["imbalance"] = (EXPERT_IMBALANCE - 1) * routed_rows_bytes(m, s, etp) * live / GB
    return Margin(b, parts)


def estimate_with_margin(m: ModelShape, hw: HwProfile, world: int, layout: Layout, opts: TrainOptions) -> Estimate:
    """The cost model's estimate with the margin attached (`est.margin`) and `est.fits` meaning what the solver
    means by it: predicted peak + margin ≤ usable memory."""
    est = estimate(m, hw, world, layout, opts)
    mg = memory_margin(m, hw, world, layout, opts, est)
    est.margin = mg
    est.fits = est.total_gb + mg.total_gb <= hw.usable_gb
    return est


def margin_of(est: Estimate) -> Margin | None:
    return getattr(est, "margin", None)


def assumed_warning(hw: HwProfile, m: ModelShape | None = None) -> str | None:
    """The one line `recipe solve` prints when a figure rests on assumed constants (None when all are measured):
    the profile has no calibration grid, or (on one that has) the core does not train model `m`."""
    b = bands(hw, m)
    if not b.assumed:
        return None
    band = (f"error band ±{100 * b.error['memory']:.0f}% memory, ±{100 * b.error['step_time']:.0f}% step time; the "
            f"margin holds the memory band back")
    if not _bands(hw.name).assumed and planned_only(m):
        return (f"warning: {m.name} is planned, not trained by this core, so no step of it has been measured: its "
                f"predictions on {hw.name} are assumed ({band})")
    if not _bands(hw.name).assumed:
        return (f"warning: {m.name}'s attention heads of {widest_head(m)} channels are wider than any measured step's "
                f"({WIDEST_TIMED_HEAD}): its predictions on {hw.name} are assumed ({band})")
    what = " and ".join("memory" if k == "memory" else "step time" for k in b.assumed)
    return (f"warning: {hw.name} has no calibration grid (hw_profiles/calibration/{hw.name}.json): its {what} "
            f"predictions are assumed, not measured ({band})")


_PART_WORDS = {"root_unit": "root unit", "fsdp_in_flight": "FSDP in flight", "all_to_all": "all-to-all buffers",
               "imbalance": "expert imbalance"}


def describe(mg: Margin) -> str:
    """'22.6 GB held back: memory error ±10% (assumed) 14.5 GB + multi-GPU allowance 8.1 GB (root unit 3.05, FSDP in
    flight 5.06); step time ±25% (assumed)'."""
    b, p = mg.bands, mg.parts_gb
    terms = ", ".join(f"{w} {p[k]:.2f}" for k, w in _PART_WORDS.items() if p[k] >= 0.005)
    allowance = f" + multi-GPU allowance {mg.multi_gpu_gb:.1f} GB ({terms})" if terms else ""
    return (f"{mg.total_gb:.1f} GB held back: memory error ±{100 * b.error['memory']:.0f}% ({b.basis['memory']}) "
            f"{p['error']:.1f} GB{allowance}; step time ±{100 * b.error['step_time']:.0f}% ({b.basis['step_time']})")


def free_str(est: Estimate) -> str:
    """'54.7 GB (30%) free' of the usable memory."""
    usable = est.memory_gb["usable"]
    return f"{est.headroom_gb:.1f} GB ({100 * est.headroom_gb / usable:.0f}%) free"
