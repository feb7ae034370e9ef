"""Rich rendering for the CLI: summaries, the --explain view, tables. Library code elsewhere returns data."""

from __future__ import annotations

import os

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from .cost import Estimate
from .hw import HwProfile
from .models import ModelShape, active_params, param_counts, total_params, trainable
from .planfile import format_size
from .margin import describe, free_str, margin_of
from .solver import Solution
from .text import layout_str, recompute_words

COMPONENTS = ("weights", "grads", "master", "optimizer", "activations", "lm_head", "overhead")
COLORS = {"weights": "blue", "grads": "cyan", "master": "magenta", "optimizer": "bright_magenta",
          "activations": "green", "lm_head": "yellow", "overhead": "white"}
# one glyph per component, so that the bar and its legend read without colour too (NO_COLOR, a log file, print)
GLYPHS = {"weights": "█", "grads": "▓", "master": "▒", "optimizer": "░", "activations": "#", "lm_head": "=",
          "overhead": "+"}


def memory_bar(mem: dict, width: int = 60) -> Text:
    """One bar, one colour per component, scaled to usable memory; '|' marks the usable limit."""
    usable = mem["usable"]
    scale = width / max(usable, mem["total"])
    bar = Text()
    for k in COMPONENTS:
        n = round(mem[k] * scale)
        bar.append(GLYPHS[k] * n, style=COLORS[k])
    used = len(bar.plain)
    limit = round(usable * scale)
    if used < limit:
        bar.append("·" * (limit - used), style="dim")
    bar.append("|", style="bold red")
    bar.append(f" {mem['total']:.1f} / {usable:.1f} GB")
    return bar


def memory_legend() -> Text:
    """Each component's glyph (in its colour) and name; '·' is free memory, '|' the usable limit."""
    t = Text()
    for k in COMPONENTS:
        t.append(GLYPHS[k] * 2, style=COLORS[k])
        t.append(f" {k}  ")
    t.append("··", style="dim")
    t.append(" free  ")
    t.append("|", style="bold red")
    t.append(" usable")
    return t


def summary(m: ModelShape, hw: HwProfile, seq: int, sol: Solution, explain: bool) -> Group:
    e, deg = sol.estimate, sol.degrees
    head = Text.assemble(
        (f"{m.name}", "bold"), f" at {format_size(seq)} tokens on ", (f"{sol.world}x {hw.name}", "bold"),
        f"  ({recompute_words(sol.opts)}, {sol.opts.lm_head} LM head, "
        f"{sol.opts.ep_overlap_chunks} EP chunk{'s' if sol.opts.ep_overlap_chunks > 1 else ''}"
        + ("; pinned " + " ".join(f"{k}={v}" for k, v in sol.pins.items()) if sol.pins else "") + ")")
    lay = Text.assemble(("layout  ", "bold"), (layout_str(deg), "bold green"))
    perf = Text(f"predict {e.total_gb:.1f} GB peak of {hw.usable_gb:.1f} usable, {free_str(e)}; step "
                f"{e.step_time_s:.3f} s, "
                f"{e.tokens_per_s_per_gpu:,.0f} tok/s/GPU, {e.tflops_per_gpu:.0f} TFLOP/s/GPU, "
                f"MFU {100 * e.mfu_hardware:.1f}% hardware / {100 * e.mfu_model:.1f}% model "
                f"(dense peak {hw.peak_bf16_tflops:g})")
    reasons = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    reasons.add_column("dim")
    reasons.add_column("value", justify="right")
    reasons.add_column("binding constraint")
    reasons.add_column("why")
    if sol.count is not None:
        reasons.add_row("GPUs", str(sol.count.value), sol.count.constraint, sol.count.reason)
    if sol.recompute is not None:
        reasons.add_row("RC", str(sol.recompute.value), sol.recompute.constraint, sol.recompute.reason)
    for k in ("tp", "ep", "cp", "pp"):
        d = sol.decisions[k]
        reasons.add_row(k.upper(), str(d.value), d.constraint, d.reason)
    parts = [head, lay, perf]
    if margin_of(e) is not None:
        parts.append(Text(f"margin  {describe(margin_of(e))}"))
    parts.append(reasons)
    if explain:
        parts += [Text(""), Text("memory per GPU", style="bold"), memory_bar(e.memory_gb), memory_legend(),
                  memory_table(e, sol.opts)]
        if margin_of(e) is not None:
            parts += [Text(""), margin_table(e)]
        parts += [Text(""), decisions_table(sol), Text(""), time_table(e)]
        parts.append(Text(lm_head_note(e, sol.opts)))
    return Group(*parts)


def head_overlaps(opts) -> bool:
    """Whether the head's memory overlaps a layer's working set (recompute, and a head that takes its loss): then the
    lm_head component is only what it needs beyond that working set, often 0."""
    return opts.recompute == "full" and opts.lm_head != "naive"


def lm_head_note(e: Estimate, opts) -> str:
    """Why the lm_head row says what it says, next to what the head holds while it runs."""
    own, added, unfused = e.lm_head_own_gb, e.memory_gb["lm_head"], e.lm_head_unfused_gb
    if opts.lm_head == "naive":
        what = (f"LM head (naive): its logits and their gradient, {own:.2f} GB, live from the forward to the "
                f"backward, all of it on top of the activations (the lm_head row)")
    elif head_overlaps(opts):
        live = ("layers' checkpoints and the kept layers' activations are" if opts.keep_layers
                else "layers' checkpoints are")
        what = (f"LM head ({opts.lm_head}): holds {own:.2f} GB while it runs, at the end of the forward, when only the "
                f"{live} live; the activations row already reserves a layer's recompute working set, "
                f"not in use then, so the head adds only what it needs beyond that: {added:.2f} GB (the lm_head row)")
    else:
        what = (f"LM head ({opts.lm_head}): holds {own:.2f} GB while it runs; without recompute every layer's "
                f"activations are still live then, so all of it adds to the peak (the lm_head row)")
    return what + f". Materialized logits and their gradient would take {unfused:.2f} GB."


def memory_table(e: Estimate, opts=None) -> Table:
    t = Table(box=None, show_header=True, header_style="bold")
    t.add_column("component")
    t.add_column("GB", justify="right")
    t.add_column("share", justify="right")
    t.add_column("")
    for k in COMPONENTS:
        note = ""
        if k == "lm_head" and opts is not None:
            note = (f"beyond a layer's working set (holds {e.lm_head_own_gb:.2f} GB while it runs; see below)"
                    if head_overlaps(opts) else f"holds {e.lm_head_own_gb:.2f} GB")
        t.add_row(Text(GLYPHS[k] + " ", style=COLORS[k]) + Text(k), f"{e.memory_gb[k]:.2f}",
                  f"{100 * e.memory_gb[k] / e.memory_gb['total']:.0f}%", note)
    t.add_row("total", f"{e.memory_gb['total']:.2f}", "", "", style="bold")
    return t


def margin_table(e: Estimate) -> Table:
    """The memory held back beyond the peak, term by term, and the headroom left (docs/solver.md)."""
    mg = margin_of(e)
    t = Table(title="memory margin (held back beyond the peak)", box=None, show_header=True, header_style="bold",
              title_justify="left")
    t.add_column("term")
    t.add_column("GB", justify="right")
    t.add_column("")
    b = mg.bands
    notes = {"error": f"memory error ±{100 * b.error['memory']:.1f}% ({b.basis['memory']}): e/(1 − e) × peak",
             "root_unit": "FSDP2 root unit (embedding, head, head gradient) unsharded through the backward",
             "fsdp_in_flight": "one more layer's unsharded gradient while its reduce-scatter runs",
             "all_to_all": "NCCL/RCCL point-to-point buffers of the EP all-to-all",
             "imbalance": "routed rows of the busiest EP rank beyond an even share"}
    for k, v in mg.parts_gb.items():
        t.add_row(k, f"{v:.2f}", notes[k])
    t.add_row("total", f"{mg.total_gb:.2f}", f"peak + margin {e.total_gb + mg.total_gb:.2f} of "
                                            f"{e.memory_gb['usable']:.2f} usable; {free_str(e)}", style="bold")
    return t


def decisions_table(sol: Solution) -> Table:
    t = Table(title="decisions", box=None, show_header=True, header_style="bold", title_justify="left")
    t.add_column("dim")
    t.add_column("numbers")
    t.add_column("rejected alternative")
    rows = [("GPUs", sol.count)] if sol.count is not None else []
    rows += [("RC", sol.recompute)] if sol.recompute is not None else []
    for k, d in rows + [(k.upper(), sol.decisions[k]) for k in ("tp", "ep", "cp", "pp")]:
        nums = ", ".join(f"{a}={b}" for a, b in d.numbers.items())
        t.add_row(f"{k}={d.value}", nums, d.rejected or "—")
    return t


def time_table(e: Estimate) -> Table:
    t = Table(title="step time", box=None, show_header=True, header_style="bold", title_justify="left")
    t.add_column("part")
    t.add_column("s", justify="right")
    for k, v in e.time_s.items():
        if v > 0:
            t.add_row(k, f"{v:.4f}")
    t.add_row("step", f"{e.step_time_s:.4f}", style="bold")
    return t


def hw_table(profiles: list[HwProfile]) -> Table:
    t = Table(show_header=True, header_style="bold")
    for c in ("profile", "bf16 dense TF/s", "HBM GiB", "usable GB", "HBM TB/s", "GPUs/node", "intra-node",
              "inter GB/s", "warp", "smem/LDS KB", "SMs/CUs", "collective"):
        t.add_column(c, justify="left" if c in ("profile", "intra-node", "collective") else "right")
    for p in profiles:
        t.add_row(p.name, f"{p.peak_bf16_tflops:g}", f"{p.hbm_gib:g}", f"{p.usable_gb:.1f}", f"{p.hbm_bw_tb_s:g}",
                  str(p.gpus_per_node), f"{p.intra_node.kind} {p.intra_node.bw_gb_s:g} GB/s {p.intra_node.topology}",
                  f"{p.inter_node_bw_gb_s:g}", str(p.warp_size), f"{p.smem_kb_per_sm:g}", str(p.num_sms),
                  p.collective)
    return t


def models_table(models: list[ModelShape]) -> Table:
    t = Table(show_header=True, header_style="bold")
    for c in ("model", "layers", "hidden", "experts (top-k)", "vocab", "total", "active", "routed experts",
              "launch"):
        t.add_column(c, justify="left" if c in ("model", "launch") else "right")
    for m in models:
        tot = total_params(m)
        t.add_row(m.name, str(m.num_layers), str(m.hidden_size), f"{m.num_experts} ({m.top_k})", f"{m.vocab_size:,}",
                  _count(tot), _count(active_params(m)), f"{100 * param_counts(m)['routed_experts'] / tot:.0f}%",
                  "trains" if trainable(m) is None else "plans only")
    return t


def _count(n: float) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def compare_table(cols) -> Table:
    """cols: (profile, solution or None, why it does not fit). A profile on which nothing fits gets its reason in
    its column ("does not fit on 8 (needs 16)") and dashes below; the others read as usual."""
    t = Table(show_header=True, header_style="bold")
    t.add_column("")
    for col in cols:
        t.add_column(col[0].name, justify="right")

    def row(label, f, first: bool = False):
        t.add_row(label, *[f(hw, s) if s is not None else (Text(why, style="bold red") if first else "—")
                           for hw, s, why in cols])

    row("GPUs", lambda hw, s: str(s.world), first=True)
    row("layout", lambda hw, s: layout_str(s.degrees))
    for k in COMPONENTS:
        row(f"{k} GB", lambda hw, s, k=k: f"{s.estimate.memory_gb[k]:.1f}")
    row("peak / usable GB", lambda hw, s: f"{s.estimate.total_gb:.1f} / {hw.usable_gb:.1f}")
    row("margin GB", lambda hw, s: f"{s.margin.total_gb:.1f} ({s.margin.bands.basis['memory']})"
        if s.margin is not None else "—")
    row("step s", lambda hw, s: f"{s.estimate.step_time_s:.3f}")
    row("tok/s/GPU", lambda hw, s: f"{s.estimate.tokens_per_s_per_gpu:,.0f}")
    row("TFLOP/s/GPU (hw)", lambda hw, s: f"{s.estimate.tflops_per_gpu:.0f}")
    row("MFU hw / model", lambda hw, s: f"{100 * s.estimate.mfu_hardware:.1f}% / {100 * s.estimate.mfu_model:.1f}%")
    return t


def techniques_table(rows: list[tuple[HwProfile, dict | None]]) -> Table:
    """How much each technique matters on each part (a dash where nothing fits)."""
    t = Table(title="what each technique buys on each part", show_header=True, header_style="bold",
              title_justify="left")
    t.add_column("technique")
    for hw, _ in rows:
        t.add_column(hw.name)
    labels = {"recompute": "full recompute", "selections": "kept index selections", "fused_head": "fused LM head",
              "cp": "context parallel", "fsdp": "FSDP2 sharding", "ep_overlap": "chunked EP overlap"}
    for key, label in labels.items():
        if not any(info is not None and key in info for _, info in rows):  # DSA's row, for a DSA model only
            continue
        t.add_row(label, *[info.get(key, "—") if info is not None else "—" for _, info in rows])
    return t


def console(stderr: bool = False) -> Console:
    """A terminal's own width (tables wrap to fit it; COLUMNS overrides); 160 columns into a pipe or a file, so
    logs keep one row per line."""
    c = Console(stderr=stderr, highlight=False, soft_wrap=False)
    if not c.is_terminal and not os.environ.get("COLUMNS"):
        c.width = 160
    return c
