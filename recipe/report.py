"""Rich rendering for the CLI: summaries, the --explain view, tables. Library code elsewhere returns data."""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from .cost import Estimate
from .hw import HwProfile
from .models import ModelShape, active_params, param_counts, total_params
from .planfile import format_size
from .solver import Solution

COMPONENTS = ("weights", "grads", "master", "optimizer", "activations", "lm_head", "overhead")
COLORS = {"weights": "blue", "grads": "cyan", "master": "magenta", "optimizer": "bright_magenta",
          "activations": "green", "lm_head": "yellow", "overhead": "white"}


def layout_str(deg: dict) -> str:
    return " ".join(f"{k.upper()}={deg[k]}" for k in ("pp", "tp", "cp", "ep", "dp", "edp"))


def memory_bar(mem: dict, width: int = 60) -> Text:
    """One bar, one colour per component, scaled to usable memory; '|' marks the usable limit."""
    usable = mem["usable"]
    scale = width / max(usable, mem["total"])
    bar = Text()
    for k in COMPONENTS:
        n = round(mem[k] * scale)
        bar.append("█" * n, style=COLORS[k])
    used = len(bar.plain)
    limit = round(usable * scale)
    if used < limit:
        bar.append("·" * (limit - used), style="dim")
    bar.append("|", style="bold red")
    bar.append(f" {mem['total']:.1f} / {usable:.1f} GB")
    return bar


def memory_legend() -> Text:
    t = Text()
    for k in COMPONENTS:
        t.append("█ ", style=COLORS[k])
        t.append(f"{k}  ")
    return t


def summary(m: ModelShape, hw: HwProfile, seq: int, sol: Solution, explain: bool) -> Group:
    e, deg = sol.estimate, sol.degrees
    head = Text.assemble(
        (f"{m.name}", "bold"), f" at {format_size(seq)} tokens on ", (f"{sol.world}x {hw.name}", "bold"),
        f"  ({sol.opts.recompute} recompute, {sol.opts.lm_head} LM head, "
        f"{sol.opts.ep_overlap_chunks} EP chunk{'s' if sol.opts.ep_overlap_chunks > 1 else ''}"
        + ("; pinned " + " ".join(f"{k}={v}" for k, v in sol.pins.items()) if sol.pins else "") + ")")
    lay = Text.assemble(("layout  ", "bold"), (layout_str(deg), "bold green"))
    perf = Text(f"predict {e.total_gb:.1f} GB peak of {hw.usable_gb:.1f} usable; step {e.step_time_s:.3f} s, "
                f"{e.tokens_per_s_per_gpu:,.0f} tok/s/GPU, {e.tflops_per_gpu:.0f} TFLOP/s/GPU, "
                f"MFU {100 * e.mfu_hardware:.1f}% hardware / {100 * e.mfu_model:.1f}% model "
                f"(dense peak {hw.peak_bf16_tflops:g})")
    reasons = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    reasons.add_column("dim")
    reasons.add_column("value", justify="right")
    reasons.add_column("binding constraint")
    reasons.add_column("why")
    for k in ("tp", "ep", "cp", "pp"):
        d = sol.decisions[k]
        reasons.add_row(k.upper(), str(d.value), d.constraint, d.reason)
    parts = [head, lay, perf, reasons]
    if explain:
        parts += [Text(""), Text("memory per GPU", style="bold"), memory_bar(e.memory_gb), memory_legend(),
                  memory_table(e), Text(""), decisions_table(sol), Text(""), time_table(e)]
        when = {"fused": "at the end of the forward", "lean": "at the end of the forward",
                "naive": "its logits live from forward to backward"}[sol.opts.lm_head]
        parts.append(Text(f"LM head: {sol.opts.lm_head} it holds {e.lm_head_own_gb:.2f} GB while it runs ({when}; "
                          f"{e.memory_gb['lm_head']:.2f} GB beyond a layer's working set); materialized "
                          f"logits and their gradient would take {e.lm_head_unfused_gb:.2f} GB"))
    return Group(*parts)


def memory_table(e: Estimate) -> Table:
    t = Table(box=None, show_header=True, header_style="bold")
    t.add_column("component")
    t.add_column("GB", justify="right")
    t.add_column("share", justify="right")
    for k in COMPONENTS:
        t.add_row(k, f"{e.memory_gb[k]:.2f}", f"{100 * e.memory_gb[k] / e.memory_gb['total']:.0f}%")
    t.add_row("total", f"{e.memory_gb['total']:.2f}", "", style="bold")
    return t


def decisions_table(sol: Solution) -> Table:
    t = Table(title="decisions", box=None, show_header=True, header_style="bold", title_justify="left")
    t.add_column("dim")
    t.add_column("numbers")
    t.add_column("rejected alternative")
    for k in ("tp", "ep", "cp", "pp"):
        d = sol.decisions[k]
        nums = ", ".join(f"{a}={b}" for a, b in d.numbers.items())
        t.add_row(f"{k.upper()}={d.value}", nums, d.rejected or "—")
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
    for c in ("profile", "bf16 dense TF/s", "HBM GB", "usable GB", "HBM TB/s", "GPUs/node", "intra-node",
              "inter GB/s", "warp", "smem/LDS KB", "SMs/CUs", "collective"):
        t.add_column(c, justify="left" if c in ("profile", "intra-node", "collective") else "right")
    for p in profiles:
        t.add_row(p.name, f"{p.peak_bf16_tflops:g}", f"{p.hbm_gb:g}", f"{p.usable_gb:.1f}", f"{p.hbm_bw_tb_s:g}",
                  str(p.gpus_per_node), f"{p.intra_node.kind} {p.intra_node.bw_gb_s:g} GB/s {p.intra_node.topology}",
                  f"{p.inter_node_bw_gb_s:g}", str(p.warp_size), f"{p.smem_kb_per_sm:g}", str(p.num_sms),
                  p.collective)
    return t


def models_table(models: list[ModelShape]) -> Table:
    t = Table(show_header=True, header_style="bold")
    for c in ("model", "layers", "hidden", "experts (top-k)", "vocab", "total", "active", "routed experts"):
        t.add_column(c, justify="left" if c == "model" else "right")
    for m in models:
        tot = total_params(m)
        t.add_row(m.name, str(m.num_layers), str(m.hidden_size), f"{m.num_experts} ({m.top_k})", f"{m.vocab_size:,}",
                  _count(tot), _count(active_params(m)), f"{100 * param_counts(m)['routed_experts'] / tot:.0f}%")
    return t


def _count(n: float) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def compare_table(rows: list[tuple[HwProfile, Solution]]) -> Table:
    t = Table(show_header=True, header_style="bold")
    t.add_column("")
    for hw, _ in rows:
        t.add_column(hw.name, justify="right")

    def row(label, f):
        t.add_row(label, *[f(hw, s) for hw, s in rows])

    row("GPUs", lambda hw, s: str(s.world))
    row("layout", lambda hw, s: layout_str(s.degrees))
    for k in COMPONENTS:
        row(f"{k} GB", lambda hw, s, k=k: f"{s.estimate.memory_gb[k]:.1f}")
    row("peak / usable GB", lambda hw, s: f"{s.estimate.total_gb:.1f} / {hw.usable_gb:.1f}")
    row("step s", lambda hw, s: f"{s.estimate.step_time_s:.3f}")
    row("tok/s/GPU", lambda hw, s: f"{s.estimate.tokens_per_s_per_gpu:,.0f}")
    row("TFLOP/s/GPU (hw)", lambda hw, s: f"{s.estimate.tflops_per_gpu:.0f}")
    row("MFU hw / model", lambda hw, s: f"{100 * s.estimate.mfu_hardware:.1f}% / {100 * s.estimate.mfu_model:.1f}%")
    return t


def techniques_table(rows: list[tuple[HwProfile, dict]]) -> Table:
    """The seed's §8 question: how much each technique matters on each part."""
    t = Table(title="what each technique buys on each part", show_header=True, header_style="bold",
              title_justify="left")
    t.add_column("technique")
    for hw, _ in rows:
        t.add_column(hw.name)
    labels = {"recompute": "full recompute", "fused_head": "fused LM head", "cp": "context parallel",
              "fsdp": "FSDP2 sharding", "ep_overlap": "chunked EP overlap"}
    for key, label in labels.items():
        t.add_row(label, *[info[key] for _, info in rows])
    return t


def console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False, soft_wrap=False, width=160)
