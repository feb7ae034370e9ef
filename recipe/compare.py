"""`recipe compare`: what each technique buys on each part — the seed's §8 question, answered by the cost model.

For one solved plan per profile, each technique is switched off in turn (the rest of the layout kept) and the
difference in memory or time is reported."""

from __future__ import annotations

from pathlib import Path

from .cost import Layout, estimate
from .models import param_counts
from .cost import BYTES_GRADS, BYTES_MASTER, BYTES_OPTIMIZER, BYTES_WEIGHTS, GB
from .hw import HwProfile
from .models import ModelShape
from .solver import Solution

SEQS = (8192, 16384, 32768, 65536, 131072, 262144)


def technique_effects(m: ModelShape, hw: HwProfile, sol: Solution) -> dict[str, str]:
    e, lay, o, w = sol.estimate, sol.layout, sol.opts, sol.world
    usable = hw.usable_gb
    out = {}
    no_rc = estimate(m, hw, w, lay, o.model_copy(update={"recompute": "none"}))
    out["recompute"] = (f"needed: without it {no_rc.total_gb:.0f} GB > {usable:.0f}" if not no_rc.fits else
                        f"optional: without it {no_rc.total_gb:.0f} GB fits, {100 * (1 - no_rc.step_time_s / e.step_time_s):+.0f}% step time")
    naive = estimate(m, hw, w, lay, o.model_copy(update={"lm_head": "naive"}))
    out["fused_head"] = (f"saves {e.lm_head_unfused_gb:.1f} GB of logits ({100 * e.lm_head_unfused_gb / usable:.0f}% "
                         f"of usable){'; needed' if not naive.fits else ''}")
    if lay.cp == 1:
        out["cp"] = "not needed (cp=1)"
    else:
        at1 = estimate(m, hw, w, Layout(pp=lay.pp, tp=lay.tp, cp=1, ep=lay.ep), o)
        out["cp"] = f"cp={lay.cp}: at cp=1 the peak would be {at1.total_gb:.0f} GB > {usable:.0f}"
    per_param = BYTES_WEIGHTS + BYTES_GRADS + BYTES_MASTER + BYTES_OPTIMIZER
    c = param_counts(m)
    replicated = ((sum(c.values()) - c["routed_experts"]) / (lay.pp * lay.tp)
                  + c["routed_experts"] / (lay.pp * lay.ep)) * per_param / GB
    persistent = sum(e.memory_gb[k] for k in ("weights", "grads", "master", "optimizer"))
    out["fsdp"] = (f"persistent {persistent:.0f} GB sharded vs {replicated:.0f} GB replicated "
                   f"({100 * replicated / usable:.0f}% of usable)")
    if lay.ep > 1:
        serial = estimate(m, hw, w, lay, o.model_copy(update={"ep_overlap_chunks": 1}))
        out["ep_overlap"] = (f"k={o.ep_overlap_chunks}: saves {100 * (1 - e.step_time_s / serial.step_time_s):.1f}% "
                             f"of the step")
    else:
        out["ep_overlap"] = "no EP all-to-all (ep=1)"
    return out


def memory_curves(m: ModelShape, hw: HwProfile, world: int) -> dict[str, list[float]]:
    """Memory by component of the solver's plan at each sequence length (GB), for the plot."""
    from .cost import TrainOptions
    from .solver import InfeasibleError, solve

    curves: dict[str, list[float]] = {}
    for s in SEQS:
        try:
            sol = solve(m, hw, world, TrainOptions(micro_batch_tokens=s))
            mem = sol.estimate.memory_gb
        except InfeasibleError:
            mem = {}
        for k in ("weights", "grads", "master", "optimizer", "activations", "lm_head", "overhead"):
            curves.setdefault(k, []).append(mem.get(k, float("nan")))
    return curves


def plot_memory(model: str, layers: int | None, profiles: list[HwProfile], worlds: list[int], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'recipe[plot]'") from None
    from .models import resolve_model

    m = resolve_model(model)
    if layers:
        m = m.with_layers(layers)
    fig, axes = plt.subplots(1, len(profiles), figsize=(5 * len(profiles), 4), sharey=False, squeeze=False)
    for ax, hw, w in zip(axes[0], profiles, worlds):
        curves = memory_curves(m, hw, w)
        xs = [s // 1024 for s in SEQS]
        ax.stackplot(xs, *curves.values(), labels=list(curves))
        ax.axhline(hw.usable_gb, color="red", linestyle="--", label="usable")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{m.name} on {w}x {hw.name} (solver's layout per length)")
        ax.set_xlabel("sequence length (K tokens)")
        ax.set_ylabel("GB per GPU")
    axes[0][0].legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
