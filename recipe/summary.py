"""The default `recipe solve` summary as plain text: no rich import on the fast path (--explain uses rich)."""

from __future__ import annotations

from .hw import HwProfile
from .margin import describe, free_str, margin_of
from .models import ModelShape
from .planfile import format_size
from .text import layout_str, recompute_words


def summary_text(m: ModelShape, hw: HwProfile, seq: int, sol) -> str:
    e, o = sol.estimate, sol.opts
    chunks = f"{o.ep_overlap_chunks} EP chunk{'s' if o.ep_overlap_chunks > 1 else ''}"
    pinned = "; pinned " + " ".join(f"{k}={v}" for k, v in sol.pins.items()) if sol.pins else ""
    lines = [
        f"{m.name} at {format_size(seq)} tokens on {sol.world}x {hw.name}  "
        f"({recompute_words(o)}, {o.lm_head} LM head, {chunks}{pinned})",
        f"layout   {layout_str(sol.degrees)}",
        f"predict  {e.total_gb:.1f} GB peak of {hw.usable_gb:.1f} usable, {free_str(e)}; step {e.step_time_s:.3f} s, "
        f"{e.tokens_per_s_per_gpu:,.0f} tok/s/GPU, {e.tflops_per_gpu:.0f} TFLOP/s/GPU, MFU "
        f"{100 * e.mfu_hardware:.1f}% hardware / {100 * e.mfu_model:.1f}% model (dense peak {hw.peak_bf16_tflops:g})",
    ]
    if margin_of(e) is not None:
        lines.append(f"margin   {describe(margin_of(e))}")
    dims = [k for k in ("tp", "ep", "cp", "pp")]
    width = max(len(sol.decisions[k].constraint) for k in dims)
    if getattr(sol, "count", None) is not None:
        c = sol.count
        lines.append(f"GPUs={c.value:<3} {c.constraint} ({c.reason})" + (f"; rejected {c.rejected}" if c.rejected
                                                                          else ""))
    if getattr(sol, "recompute", None) is not None:
        r = sol.recompute
        lines.append(f"RC={r.value:<5} {r.constraint}: {r.reason}" + (f"; rejected {r.rejected}" if r.rejected else ""))
    for k in dims:
        d = sol.decisions[k]
        lines.append(f"{k.upper()}={d.value:<4} {d.constraint:<{width}}  {d.reason}")
    return "\n".join(lines) + "\n"
