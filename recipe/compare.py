"""`recipe compare`: what each technique buys on each part, answered by the cost model.

For one solved plan per profile, each technique is switched off in turn (the rest of the layout kept) and the
difference in memory or time is reported."""

from __future__ import annotations

from pathlib import Path

from .cost import Layout, estimate
from .models import param_counts
from .cost import BYTES_GRADS, BYTES_MASTER, BYTES_OPTIMIZER, BYTES_WEIGHTS, GB
from .hw import HwProfile
from .models import ModelShape
from .solver import Solution, solve_keep_layers

SEQS = (8192, 16384, 32768, 65536, 131072, 262144)


def technique_effects(m: ModelShape, hw: HwProfile, sol: Solution) -> dict[str, str]:
    e, lay, o, w = sol.estimate, sol.layout, sol.opts, sol.world
    usable = hw.usable_gb
    out = {}
    no_rc = estimate(m, hw, w, lay, o.model_copy(update={"recompute": "none", "keep_layers": 0}))
    out["recompute"] = (f"needed: without it {no_rc.total_gb:.0f} GB > {usable:.0f}" if not no_rc.fits else
                        f"optional: without it {no_rc.total_gb:.0f} GB fits, {100 * (1 - no_rc.step_time_s / e.step_time_s):+.0f}% step time")
    if o.recompute == "full" and not o.keep_layers and not no_rc.fits:
        # partial recompute: what the layout's free memory would buy (--recompute auto weighs it)
        part = solve_keep_layers(m, hw, sol)
        if part is not None:
            k = part.opts.keep_layers
            out["recompute"] += (f"; {'the last layer' if k == 1 else f'the last {k} layers'} could keep "
                                 f"{'its' if k == 1 else 'their'} activations: "
                                 f"{100 * (1 - part.estimate.step_time_s / e.step_time_s):.0f}% less step time")
    if m.dsa is not None and o.recompute == "full":
        # DeepSeek sparse attention: the recomputed forward reusing the forward's index selections, or not
        other = estimate(m, hw, w, lay, o.model_copy(update={"keep_selections": not o.keep_selections}))
        kept, recomputed = (e, other) if o.keep_selections else (other, e)
        gain = f"{100 * (1 - kept.step_time_s / recomputed.step_time_s):.0f}% of the step"
        compute = recomputed.time_s["compute"] - kept.time_s["compute"]
        if recomputed.step_time_s - kept.step_time_s < compute / 2:  # the step is bound by exchanges, not compute
            gain += f" ({compute:.1f} s of compute, behind the exchanges that bound the step)"
        extra = f"{kept.total_gb - recomputed.total_gb:.1f} GB"
        out["selections"] = (f"kept: saves {gain} for {extra}" if o.keep_selections else
                             f"recomputed: keeping them would save {gain} but needs {extra} more, past the margin")
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
                             f"of the step against k=1, its chunk loop's {e.compute_s['ep_chunks']:.2f} s included")
    else:
        out["ep_overlap"] = "no EP all-to-all (ep=1)"
    return out


COMPONENTS = ("weights", "grads", "master", "optimizer", "activations", "lm_head", "overhead")


def memory_curves(m: ModelShape, hw: HwProfile, world: int, seqs=SEQS) -> tuple[dict[str, list[float]], list]:
    """Memory by component of the solver's plan at each sequence length (GB; NaN where nothing fits), and the layout
    chosen at each length (None where nothing fits), for the plot."""
    from .cost import TrainOptions
    from .solver import InfeasibleError, solve

    curves: dict[str, list[float]] = {k: [] for k in COMPONENTS}
    layouts = []
    for s in seqs:
        try:
            sol = solve(m, hw, world, TrainOptions(micro_batch_tokens=s))
            mem, lay = sol.estimate.memory_gb, sol.layout
        except InfeasibleError:
            mem, lay = {}, None
        for k in COMPONENTS:
            curves[k].append(mem.get(k, float("nan")))
        layouts.append(lay)
    return curves, layouts


def size_label(tokens: int) -> str:
    """8192 → '8k', 1048576 → '1m', 12288 → '12k'; otherwise the count."""
    from .planfile import format_size

    return format_size(tokens)


def _layout_label(lay) -> str:
    """'cp=2 ep=8' (pp and tp only when they split)."""
    shown = [k for k in ("pp", "tp", "cp", "ep") if k in ("cp", "ep") or getattr(lay, k) > 1]
    return " ".join(f"{k}={getattr(lay, k)}" for k in shown)


def memory_figure(m: ModelShape, profiles: list[HwProfile], worlds: list[int], seq_len: int | None = None):
    """The figure of `recipe compare --plot`: one panel per profile, memory by component (stacked) against the
    sequence length on a log2 axis labelled 8k … 256k, the usable limit, the requested length marked, each change of
    the solver's layout annotated; the legend below the panels, off the data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = sorted(set(SEQS) | ({seq_len} if seq_len else set()))
    n = len(profiles)
    fig, axes = plt.subplots(1, n, figsize=(5.2 * n, 4.6), squeeze=False)
    handles = labels = None
    for ax, hw, w in zip(axes[0], profiles, worlds):
        curves, layouts = memory_curves(m, hw, w, seqs)
        stack = ax.stackplot(seqs, *curves.values(), labels=list(curves), alpha=0.9)
        limit = ax.axhline(hw.usable_gb, color="red", linestyle="--", linewidth=1.2, label="usable")
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqs)
        ax.set_xticklabels([size_label(s) for s in seqs])
        ax.minorticks_off()
        ax.set_xlim(seqs[0], seqs[-1])
        top = max([hw.usable_gb] + [sum(v) for v in zip(*curves.values()) if all(x == x for x in v)])
        ax.set_ylim(0, top * 1.25)
        marks = []
        if seq_len:
            marks = [ax.axvline(seq_len, color="black", linestyle=":", linewidth=1.2,
                                label=f"requested {size_label(seq_len)}")]
        prev, first = None, True
        for s, lay in zip(seqs, layouts):
            if lay == prev and not (lay is None and first):
                continue
            text = "does not fit" if lay is None else _layout_label(lay)
            if not first:
                ax.axvline(s, color="dimgray", linewidth=0.6, alpha=0.6)
            last = s == seqs[-1]
            ax.annotate(text, (s, top * 1.22), xytext=(-3 if last else 3, 0), textcoords="offset points",
                        ha="right" if last else "left", va="top", fontsize=7,
                        color="red" if lay is None else "dimgray")
            prev, first = lay, False
        ax.set_title(f"{hw.name}: {w} GPU{'s' if w > 1 else ''}\n{m.name}, the solver's layout at each length",
                     fontsize=10)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("GB per GPU")
        if handles is None:
            handles, labels = [*stack, limit, *marks], [*curves, "usable", *[mk.get_label() for mk in marks]]
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def plot_memory(m: ModelShape, profiles: list[HwProfile], worlds: list[int], path, seq_len: int | None = None):
    """Draw `memory_figure` and write it to `path` (its extension picks the format; recipe/safeio.py writes it, so a
    directory, a device or a symlink is handled like every other output). Returns the path written."""
    import io

    from .safeio import write_atomic

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'recipe[plot]'") from None
    import matplotlib.pyplot as plt

    fig = memory_figure(m, profiles, worlds, seq_len)
    buf = io.BytesIO()
    try:
        fig.savefig(buf, dpi=110, format=Path(path).suffix.lower().lstrip(".") or "png", bbox_inches="tight")
    finally:
        plt.close(fig)
    write_atomic(path, buf.getvalue(), flag="--plot")
    return Path(path)
