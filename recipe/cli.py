"""The `recipe` command line. Commands are thin: they parse, call plain functions, render. Bad input ends in one
line on stderr and a non-zero exit (2: unusable input, 1: no layout fits / checks failed), never a traceback."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from . import __version__

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Parallelism recipe solver and thin launcher for long-sequence MoE RL post-training.")

EXIT_INFEASIBLE, EXIT_INPUT = 1, 2


class UserError(Exception):
    def __init__(self, msg: str, code: int = EXIT_INPUT):
        super().__init__(msg)
        self.code = code


def _fail(msg: str, code: int) -> None:
    one_line = " ".join(str(msg).split())  # exactly one line, whatever the message carried
    sys.stderr.write(f"error: {one_line}\n")
    raise typer.Exit(code)


def friendly(fn):
    """Turn every expected failure into one line and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from .solver import InfeasibleError

        try:
            return fn(*args, **kwargs)
        except UserError as e:
            _fail(str(e), e.code)
        except InfeasibleError as e:
            _fail(str(e), EXIT_INFEASIBLE)
        except (ValueError, OSError) as e:
            _fail(str(e).splitlines()[0] if str(e) else type(e).__name__, EXIT_INPUT)

    return wrapper


Model = Annotated[str, typer.Option("--model", "-m", help="preset name (see `recipe models`) or path to an HF "
                                                          "config.json")]
Seq = Annotated[str, typer.Option("--seq", "-s", help="sequence length in tokens: 32k, 128k, 1m, 131072")]
Gpus = Annotated[Optional[int], typer.Option("--gpus", "-g", help="world size to solve for; default: the "
                                                                   "smallest count that fits")]
Layers = Annotated[Optional[int], typer.Option("--layers", help="a reduced-depth model: first N layers")]
Recompute = Annotated[str, typer.Option("--recompute", help="full | none")]
LmHead = Annotated[str, typer.Option("--lm-head", help="fused (the loss in the head, 3 GEMMs) | lean (the two gradients "
                                                      "and ~2 MiB, 4 GEMMs) | naive (materialized logits)")]
Mbt = Annotated[Optional[str], typer.Option("--micro-batch-tokens", help="tokens per micro-batch (default: --seq)")]
Mb = Annotated[int, typer.Option("--micro-batches", help="micro-batches per DP rank per optimizer step")]
Chunks = Annotated[Optional[int], typer.Option("--ep-chunks", help="EP all-to-all overlap chunks (1 = off; "
                                                                   "default: from the local sequence)")]
PinPP = Annotated[Optional[int], typer.Option("--pp", help="pin the pipeline degree; the rest is solved around it")]
PinTP = Annotated[Optional[int], typer.Option("--tp", help="pin the tensor-parallel degree")]
PinCP = Annotated[Optional[int], typer.Option("--cp", help="pin the context-parallel degree")]
PinEP = Annotated[Optional[int], typer.Option("--ep", help="pin the expert-parallel degree")]


def _inputs(model, seq, hw, gpus, layers, recompute, lm_head, mbt, micro_batches, ep_chunks, pins=None):
    from .cost import HEAD_MODES
    from .planfile import SolveInputs, parse_size

    if recompute not in ("full", "none"):
        raise UserError(f"--recompute must be 'full' or 'none', got {recompute!r}")
    if lm_head not in HEAD_MODES:
        raise UserError(f"--lm-head must be one of {', '.join(HEAD_MODES)}, got {lm_head!r}")
    if gpus is not None and gpus <= 0:
        raise UserError(f"--gpus must be positive, got {gpus}")
    if micro_batches <= 0:
        raise UserError(f"--micro-batches must be positive, got {micro_batches}")
    if ep_chunks is not None and ep_chunks <= 0:
        raise UserError(f"--ep-chunks must be positive, got {ep_chunks}")
    pins = {k: v for k, v in (pins or {}).items() if v is not None}
    for k, v in pins.items():
        if v <= 0:
            raise UserError(f"--{k} must be positive, got {v}")
    seq_len = parse_size(seq)
    return SolveInputs(model=model, seq_len=seq_len, hw=hw, gpus=gpus, layers=layers, recompute=recompute,
                  lm_head=lm_head, micro_batch_tokens=parse_size(mbt) if mbt else None,
                  micro_batches=micro_batches, ep_overlap_chunks=ep_chunks, pins=pins or None)


def solve_inputs(inputs, base_dir: Path | None = None):
    """Inputs → (model, hw, solution). Shared by solve, compare and check."""
    from .cost import TrainOptions
    from .hw import load_profile
    from .models import resolve_model
    from .planfile import _relative
    from .solver import solve, solve_min_gpus

    m = resolve_model(_relative(inputs.model, base_dir))
    if inputs.layers:
        m = m.with_layers(inputs.layers)
    hw = load_profile(_relative(inputs.hw, base_dir))
    opts = TrainOptions(recompute=inputs.recompute, lm_head=inputs.lm_head,
                        ep_overlap_chunks=inputs.ep_overlap_chunks or 1,
                        micro_batch_tokens=inputs.micro_batch_tokens or inputs.seq_len,
                        micro_batches=inputs.micro_batches)
    auto = inputs.ep_overlap_chunks is None
    pins = getattr(inputs, "pins", None)
    sol = solve(m, hw, inputs.gpus, opts, auto, pins=pins) if inputs.gpus else solve_min_gpus(m, hw, opts, auto, pins)
    return m, hw, sol


@app.command()
@friendly
def solve(
    model: Model,
    seq: Seq,
    hw: Annotated[str, typer.Option("--hw", help="profile name (see `recipe hw`) or path to a profile YAML")],
    gpus: Gpus = None,
    layers: Layers = None,
    recompute: Recompute = "full",
    lm_head: LmHead = "fused",
    micro_batch_tokens: Mbt = None,
    micro_batches: Mb = 1,
    ep_chunks: Chunks = None,
    pp: PinPP = None,
    tp: PinTP = None,
    cp: PinCP = None,
    ep: PinEP = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="write the plan here ('-' = stdout)")] = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help="plan format: yaml | json")] = "yaml",
    explain: Annotated[bool, typer.Option("--explain", help="each decision, memory bar, rejected alternatives")] = False,
):
    """Solve PP, TP, EP and CP for a model, a sequence length and a hardware profile; write a plan. --pp/--tp/--cp/--ep
    pin degrees ("what if"): the others are solved around them."""
    from .planfile import dumps, plan_dict, write_atomic

    if fmt not in ("yaml", "json"):
        raise UserError(f"--format must be 'yaml' or 'json', got {fmt!r}")
    inputs = _inputs(model, seq, hw, gpus, layers, recompute, lm_head, micro_batch_tokens, micro_batches, ep_chunks,
                     pins={"pp": pp, "tp": tp, "cp": cp, "ep": ep})
    m, prof, sol = solve_inputs(inputs)
    if inputs.seq_len > m.max_position:
        sys.stderr.write(f"note: {inputs.seq_len:,} tokens exceed {m.name}'s max_position_embeddings "
                         f"{m.max_position:,}: the plan assumes you extend its positions (e.g. YaRN)\n")
    plan = plan_dict(inputs, m, prof, sol)
    text = dumps(plan, fmt)
    if str(output) == "-":
        sys.stdout.write(text)
        return
    if output is not None and output.is_dir():
        raise UserError(f"-o {output} is a directory; give a file name")
    if explain:
        from .report import console, summary

        console().print(summary(m, prof, inputs.seq_len, sol, explain=True))
    else:
        from .summary import summary_text

        sys.stdout.write(summary_text(m, prof, inputs.seq_len, sol))
    if output is not None:
        write_atomic(output, text)
        sys.stdout.write(f"wrote {output}\n")


@app.command()
@friendly
def sweep(
    model: Model,
    seq: Seq,
    hw: Annotated[str, typer.Option("--hw", help="profile name or path")],
    gpus: Annotated[int, typer.Option("--gpus", "-g", help="world size")],
    layers: Layers = None,
    recompute: Recompute = "full",
    lm_head: LmHead = "fused",
    micro_batch_tokens: Mbt = None,
    micro_batches: Mb = 1,
    top: Annotated[int, typer.Option("--top", help="rows to show")] = 15,
):
    """Evaluate the whole PP×TP×EP×CP grid under the same cost model; show where the solver's choice ranks."""
    from rich.table import Table

    from .report import console, layout_str
    from .sweep import grid, rank_of, ranked

    inputs = _inputs(model, seq, hw, gpus, layers, recompute, lm_head, micro_batch_tokens, micro_batches, None)
    m, prof, sol = solve_inputs(inputs)
    opts = sol.opts.model_copy(update={"ep_overlap_chunks": 1})
    points = ranked(grid(m, prof, gpus, opts), gpus, opts)
    n_fit = sum(p.estimate.fits for p in points)
    r = rank_of(points, sol.layout)
    best = points[0].seconds_per_token(gpus, opts)
    t = Table(show_header=True, header_style="bold")
    for c in ("#", "layout", "peak GB", "fits", "step s", "tok/s/GPU", "vs best"):
        t.add_column(c, justify="left" if c == "layout" else "right")
    for i, p in enumerate(points[:top], 1):
        mark = " ◀ solver" if p.layout == sol.layout else ""
        t.add_row(str(i), layout_str(p.layout.degrees(gpus)) + mark, f"{p.estimate.total_gb:.1f}",
                  "yes" if p.estimate.fits else "no", f"{p.estimate.step_time_s:.3f}",
                  f"{p.estimate.tokens_per_s_per_gpu:,.0f}",
                  f"{p.seconds_per_token(gpus, opts) / best:.3f}" if p.estimate.fits else "—")
    out = console()
    out.print(t)
    mine = next(p for p in points if p.layout == sol.layout)
    out.print(f"{len(points)} grid points, {n_fit} fit {prof.usable_gb:.1f} GB; the solver's layout ranks #{r} "
              f"({mine.seconds_per_token(gpus, opts) / best:.3f}× the grid optimum's time per token)")


@app.command()
@friendly
def compare(
    model: Model,
    seq: Seq,
    hw: Annotated[str, typer.Option("--hw", help="comma-separated profiles, e.g. h100,mi300x,mi355x")],
    gpus: Gpus = None,
    layers: Layers = None,
    micro_batch_tokens: Mbt = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="PNG: memory by component against sequence "
                                                                "length for each profile (needs matplotlib)")] = None,
):
    """Put the plans for several hardware profiles side by side, with what each technique buys on each."""
    from .compare import technique_effects
    from .report import compare_table, console, techniques_table

    names = [h.strip() for h in hw.split(",") if h.strip()]
    if not names:
        raise UserError("--hw needs at least one profile")
    rows, effects = [], []
    for name in names:
        inputs = _inputs(model, seq, name, gpus, layers, "full", "fused", micro_batch_tokens, 1, None)
        m, prof, sol = solve_inputs(inputs)
        rows.append((prof, sol))
        effects.append((prof, technique_effects(m, prof, sol)))
    out = console()
    out.print(compare_table(rows))
    out.print(techniques_table(effects))
    if plot is not None:
        from .compare import plot_memory

        plot_memory(model, layers, [p for p, _ in rows], [s.world for _, s in rows], plot)
        out.print(f"wrote {plot}")


@app.command("hw")
@friendly
def hw_cmd(
    show: Annotated[Optional[str], typer.Argument(help="a profile to print with its sources")] = None,
):
    """List the hardware profiles (or show one with the source of every figure)."""
    from .hw import all_profiles, load_profile
    from .report import console, hw_table

    out = console()
    if show:
        p = load_profile(show)
        out.print(hw_table([p]))
        for k, v in p.sources.items():
            out.print(f"  [bold]{k}[/]: {v}", soft_wrap=True)
        return
    out.print(hw_table(all_profiles()))


@app.command()
@friendly
def models(
    model: Annotated[Optional[str], typer.Argument(help="a preset or config.json to break down by group")] = None,
):
    """List the model presets with total and active parameters (or break one down by group)."""
    from rich.table import Table

    from .models import PRESETS, mtp_params, param_counts, resolve_model
    from .report import console, models_table

    out = console()
    if model is None:
        out.print(models_table(list(PRESETS.values())))
        return
    m = resolve_model(model)
    out.print(models_table([m]))
    t = Table("group", "parameters", show_header=True, header_style="bold")
    for k, v in param_counts(m).items():
        t.add_row(k, f"{v:,}")
    if m.mtp_layers:
        t.add_row("(mtp, not counted)", f"{mtp_params(m):,}")
    out.print(t)


@app.command()
def version():
    """Print the solver version."""
    typer.echo(__version__)


from .check_cli import check as _check  # noqa: E402

app.command("check")(_check)

from .launch_cli import launch as _launch  # noqa: E402

app.command("launch")(_launch)


def main() -> None:  # pragma: no cover
    app()

