"""The `recipe` command line. Commands are thin: they parse, call plain functions, render.

Exit codes, one rule for every command (README.md, "Exit codes"): 0 done; 1 the question was well-formed and the
answer is no (no layout fits, a check found drift or a misfit); 2 unusable input (a malformed or out-of-range option,
an unknown name, a file that cannot be read, or a path that must not be written); 3 a bug in recipe (one line naming
it; RECIPE_TRACEBACK=1 shows the traceback); 130 interrupted. Every failure is one line on stderr, never a traceback
— the usage errors of the argument parser too. `recipe launch` exits with the training's status.

Writing: every file goes through recipe/safeio.py (regular files only, symlinks followed, mode kept, atomic, inputs
never overwritten). Reading stdout through a pipe that closes early (`recipe solve … | head -1`) ends quietly."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

try:  # typer >= 0.28 carries its own copy of click; before, it used click itself
    from typer._click import exceptions as _cx
except ImportError:  # pragma: no cover
    from click import exceptions as _cx
_NO_ARGS = getattr(_cx, "NoArgsIsHelpError", ())  # click >= 8.2 raises it for `recipe` alone (help already shown)

from . import __version__
from .solving import solve_inputs
from .text import one_line

EXIT_INFEASIBLE, EXIT_INPUT, EXIT_BUG = 1, 2, 3


class UserError(Exception):
    def __init__(self, msg: str, code: int = EXIT_INPUT):
        super().__init__(msg)
        self.code = code


def _one_line(msg: object) -> str:
    """An error message as exactly one line: its line breaks and runs of spaces become one space (a wrapped message
    reads on), anything else unprintable is escaped (text.one_line)."""
    return one_line(" ".join(str(msg).split()), limit=2000)


def _fail(msg: str, code: int) -> None:
    sys.stderr.write(f"error: {_one_line(msg)}\n")
    raise typer.Exit(code)


class _QuietPipe:
    """stdout that turns quiet once its reader has gone (`recipe hw | head -1`): the first EPIPE points the rest of
    the output at /dev/null, so the command ends with its own exit code and no "Broken pipe" line."""

    def __init__(self, stream):
        self._stream = stream
        self._closed = False

    def _gone(self) -> None:
        self._closed = True
        try:
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, self._stream.fileno())  # the interpreter's own flush at exit writes nowhere too
            os.close(fd)
        except (OSError, ValueError, AttributeError):
            pass

    def write(self, text):
        if self._closed:
            return len(text)
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def flush(self):
        if self._closed:
            return
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _quiet_stdout() -> None:
    if not isinstance(sys.stdout, _QuietPipe) and sys.stdout is not None:
        sys.stdout = _QuietPipe(sys.stdout)


class _Group(TyperGroup):
    """The root command: usage errors (an unknown option, a missing one, `--gpus 1e3`) as one line with exit 2, an
    early-closed stdout ends quietly, and an unexpected exception is one line with exit 3 instead of a traceback."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        _quiet_stdout()
        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False,
                              **extra)
            code = rv if isinstance(rv, int) and not isinstance(rv, bool) else 0
        except _NO_ARGS:
            code = EXIT_INPUT  # the help is printed already
        except _cx.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else "recipe"
            sys.stderr.write(f"error: {_one_line(e.format_message()).rstrip('.')} (see `{where} --help`)\n")
            code = e.exit_code
        except _cx.ClickException as e:
            sys.stderr.write(f"error: {_one_line(e.format_message())}\n")
            code = e.exit_code
        except typer.Abort:
            sys.stderr.write("error: aborted\n")
            code = 130
        except (typer.Exit, getattr(_cx, "Exit", typer.Exit)) as e:
            code = e.exit_code
        except (ValueError, OSError) as e:  # raised while parsing (every command turns its own into one line):
            # e.g. typer's path options stat their value, and a NUL byte in it is a ValueError
            sys.stderr.write(f"error: unusable argument ({_one_line(e) or type(e).__name__})\n")
            code = EXIT_INPUT
        except Exception as e:  # a bug: one line, and the traceback on request
            if os.environ.get("RECIPE_TRACEBACK"):
                raise
            first = (str(e).strip().splitlines() or [""])[0]
            sys.stderr.write(f"error: internal error ({type(e).__name__}{': ' + first[:200] if first else ''}); "
                             f"RECIPE_TRACEBACK=1 shows where — please report it\n")
            code = EXIT_BUG
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        if standalone_mode:
            sys.exit(code)
        return code


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
        except BrokenPipeError:
            raise
        except (ValueError, OSError) as e:
            if isinstance(e, OSError) and e.filename and e.strerror:
                _fail(f"{e.filename}: {e.strerror}", EXIT_INPUT)
            _fail(str(e).splitlines()[0] if str(e).strip() else type(e).__name__, EXIT_INPUT)

    return wrapper


app = typer.Typer(cls=_Group, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Parallelism recipe solver and thin launcher for long-sequence MoE RL post-training.")

Model = Annotated[str, typer.Option("--model", "-m", help="preset name (see `recipe models`) or path to an HF "
                                                          "config.json")]
Seq = Annotated[str, typer.Option("--seq", "-s", help="sequence length in tokens: 32k, 128k, 1m, 131072")]
Gpus = Annotated[Optional[int], typer.Option("--gpus", "-g", help=(
    "world size to solve for; default: the smallest count (1, 2, 4, then whole nodes) at which some layout's "
    "predicted peak plus the memory margin fits usable memory, or, below one node, the whole node when it needs "
    "less CP/TP/PP at 97% or more of the throughput per GPU; then, up to twice that count, the smallest whose GPU-hours "
    "a token are within 1.5x the cheapest's"))]
Layers = Annotated[Optional[int], typer.Option("--layers", help="a reduced-depth model: first N layers")]
Recompute = Annotated[str, typer.Option("--recompute", help="full | none | auto (at the GPU count solved under full "
                                                            "recompute, the faster of no recompute and of the last "
                                                            "layers of each stage keeping their activations, every "
                                                            "dimension solved again, where it runs 3% or more "
                                                            "tokens/s per GPU)")]
LmHead = Annotated[str, typer.Option("--lm-head", help="fused (the loss in the head, 3 GEMMs) | lean (the two gradients "
                                                      "and ~2 MiB, 4 GEMMs) | naive (materialized logits)")]
Mbt = Annotated[Optional[str], typer.Option("--micro-batch-tokens", help="tokens per micro-batch (default: --seq)")]
Mb = Annotated[int, typer.Option("--micro-batches", help="micro-batches per DP rank per optimizer step")]
Chunks = Annotated[Optional[int], typer.Option("--ep-chunks", help="EP all-to-all overlap chunks (1 = off; "
                                                                   "default: the count the cost model finds fastest)")]
PinPP = Annotated[Optional[int], typer.Option("--pp", help="pin the pipeline degree; the rest is solved around it")]
PinTP = Annotated[Optional[int], typer.Option("--tp", help="pin the tensor-parallel degree")]
PinCP = Annotated[Optional[int], typer.Option("--cp", help="pin the context-parallel degree")]
PinEP = Annotated[Optional[int], typer.Option("--ep", help="pin the expert-parallel degree")]


def _bounded(flag: str, v: int | None, hi: int) -> None:
    if v is not None and not 0 < v <= hi:
        raise UserError(f"{flag} must be positive, got {v}" if v <= 0 else f"{flag} must be between 1 and {hi:,}, "
                                                                          f"got {v:,}")


def _inputs(model, seq, hw, gpus, layers, recompute, lm_head, mbt, micro_batches, ep_chunks, pins=None):
    """The command-line options → SolveInputs, every value checked against its range (exit 2 beyond it)."""
    from .cost import HEAD_MODES
    from .planfile import INPUT_LIMITS, SolveInputs, parse_size
    from .solver import MAX_WORLD

    if recompute not in ("full", "none", "auto"):
        raise UserError(f"--recompute must be 'full', 'none' or 'auto', got {recompute!r}")
    if lm_head not in HEAD_MODES:
        raise UserError(f"--lm-head must be one of {', '.join(HEAD_MODES)}, got {lm_head!r}")
    _bounded("--gpus", gpus, MAX_WORLD)
    _bounded("--layers", layers, INPUT_LIMITS["layers"])
    _bounded("--micro-batches", micro_batches, INPUT_LIMITS["micro_batches"])
    _bounded("--ep-chunks", ep_chunks, INPUT_LIMITS["ep_overlap_chunks"])
    pins = {k: v for k, v in (pins or {}).items() if v is not None}
    for k, v in pins.items():
        _bounded(f"--{k}", v, MAX_WORLD)
    seq_len = parse_size(seq)
    return SolveInputs(model=model, seq_len=seq_len, hw=hw, gpus=gpus, layers=layers, recompute=recompute,
                  lm_head=lm_head, micro_batch_tokens=parse_size(mbt) if mbt else None,
                  micro_batches=micro_batches, ep_overlap_chunks=ep_chunks, pins=pins or None)


def _input_files(model: str, hw: str) -> dict[str, str]:
    """The files a solve reads (a config.json, a profile YAML), to keep -o from writing over them."""
    from .hw import builtin_names
    from .models import PRESETS

    out = {}
    if model not in PRESETS and os.path.exists(model):
        out["--model"] = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if hw not in builtin_names() and os.path.exists(hw):
        out["--hw"] = hw
    return out


def _plan_format(fmt: str | None, output: Path | None) -> str:
    """--format, or the one -o's extension names (.json → json, .yaml/.yml → yaml); a contradiction is refused."""
    if fmt is not None and fmt not in ("yaml", "json"):
        raise UserError(f"--format must be 'yaml' or 'json', got {fmt!r}")
    suffix = output.suffix.lower() if output is not None and str(output) != "-" else ""
    implied = {".json": "json", ".yaml": "yaml", ".yml": "yaml"}.get(suffix)
    if fmt is not None and implied is not None and fmt != implied:
        raise UserError(f"--format {fmt} contradicts -o {output} (a {suffix} file): drop --format or name the file "
                        f"{output.with_suffix('.' + fmt)}")
    return fmt or implied or "yaml"


def _write_json(data) -> None:
    import json

    sys.stdout.write(json.dumps(data, indent=2, allow_nan=False) + "\n")


TableFormat = Annotated[str, typer.Option("--format", "-f", help="text (a table) | json (for scripts)")]


def _table_format(fmt: str) -> str:
    if fmt not in ("text", "json"):
        raise UserError(f"--format must be 'text' or 'json', got {fmt!r}")
    return fmt


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
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="write the plan here ('-' = stdout); "
                                                                         "a .json name writes JSON")] = None,
    fmt: Annotated[Optional[str], typer.Option("--format", "-f", help="plan format: yaml | json [default: from -o's "
                                                                      "extension, else yaml]; without -o the plan "
                                                                      "is printed in it instead of the summary",
                                               show_default=False)] = None,
    explain: Annotated[bool, typer.Option("--explain", help="each decision, memory bar, rejected alternatives")] = False,
):
    """Solve PP, TP, EP and CP for a model, a sequence length and a hardware profile; write a plan. --pp/--tp/--cp/--ep
    pin degrees ("what if"): the others are solved around them."""
    from .planfile import dumps, plan_dict, write_atomic

    fmt_given = fmt is not None
    fmt = _plan_format(fmt, output)
    to_stdout = str(output) == "-" or (output is None and fmt_given)
    if explain and to_stdout:
        raise UserError("--explain prints the summary on stdout, where the plan goes with "
                        f"{'-o -' if output is not None else '--format and no -o'}: write the plan with -o FILE")
    inputs = _inputs(model, seq, hw, gpus, layers, recompute, lm_head, micro_batch_tokens, micro_batches, ep_chunks,
                     pins={"pp": pp, "tp": tp, "cp": cp, "ep": ep})
    if output is not None and not to_stdout:
        from .safeio import check_writable

        check_writable(output, inputs=_input_files(model, hw))  # refused before the solve, not after it
    m, prof, sol = solve_inputs(inputs)
    if inputs.seq_len > m.max_position:
        sys.stderr.write(f"note: {inputs.seq_len:,} tokens exceed {m.name}'s max_position_embeddings "
                         f"{m.max_position:,}: the plan assumes you extend its positions (e.g. YaRN)\n")
    text = dumps(plan_dict(inputs, m, prof, sol), fmt)
    if to_stdout:
        sys.stdout.write(text)
        _note_cheaper_count(m, prof, sol, inputs)
        _warn_assumed(prof, m)
        return
    if output is not None:  # written before anything is printed: a closed stdout cannot cost the plan
        write_atomic(output, text, inputs=_input_files(model, hw))
    if explain:
        from .report import console, summary

        console().print(summary(m, prof, inputs.seq_len, sol, explain=True))
    else:
        from .summary import summary_text

        sys.stdout.write(summary_text(m, prof, inputs.seq_len, sol))
    if output is not None:
        sys.stdout.write(f"wrote {output}\n")
    _note_cheaper_count(m, prof, sol, inputs)
    _warn_assumed(prof, m)


def _note_cheaper_count(m, prof, sol, inputs) -> None:
    """With --gpus N: one line on stderr when a count up to 2N would take the default count rule's place, i.e. run
    1.5x or more the tokens/s per GPU of N (docs/solver.md, "World size")."""
    if not inputs.gpus:
        return
    from .solver import cheaper_count
    from .text import layout_str

    other = cheaper_count(m, prof, sol, inputs.ep_overlap_chunks is None, inputs.pins)
    if other is None:
        return
    a, b = sol.estimate.tokens_per_s_per_gpu, other.estimate.tokens_per_s_per_gpu
    sys.stdout.flush()
    sys.stderr.write(f"note: {other.world} GPUs run {b / a:.2f}x the tokens/s per GPU of these {sol.world} "
                     f"({layout_str(other.degrees)}, {b:,.0f} against {a:,.0f}): fewer GPU-hours a token and a "
                     f"shorter step; without --gpus the count is chosen this way\n")


def _warn_assumed(prof, m=None) -> None:
    """One line on stderr when a predicted figure rests on assumed constants (no calibration grid, or a model the
    core does not train)."""
    from .margin import assumed_warning

    warning = assumed_warning(prof, m)
    if warning:
        sys.stdout.flush()
        sys.stderr.write(warning + "\n")


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
    top: Annotated[int, typer.Option("--top", help="rows to show (1 to 10,000)")] = 15,
    fmt: TableFormat = "text",
):
    """Evaluate the whole PP×TP×EP×CP grid under the same cost model; show where the solver's choice ranks."""
    from .sweep import grid, rank_of, ranked

    fmt = _table_format(fmt)
    _bounded("--top", top, 10_000)
    inputs = _inputs(model, seq, hw, gpus, layers, recompute, lm_head, micro_batch_tokens, micro_batches, None)
    m, prof, sol = solve_inputs(inputs)
    opts = sol.opts.model_copy(update={"ep_overlap_chunks": 1})
    points = ranked(grid(m, prof, gpus, opts), gpus, opts)
    n_fit = sum(p.estimate.fits for p in points)
    r = rank_of(points, sol.layout)
    best = points[0].seconds_per_token(gpus, opts)
    mine = next(p for p in points if p.layout == sol.layout)
    if fmt == "json":
        from .views import sweep_data

        _write_json(sweep_data(m, prof, gpus, opts, points[:top], sol, r, n_fit, len(points), best, mine))
        return
    from rich.table import Table

    from .report import console
    from .text import layout_str

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
    out.print(f"{len(points)} grid points, {n_fit} fit {prof.usable_gb:.1f} GB usable with the memory margin; the "
              f"solver's layout ranks #{r} "
              f"({mine.seconds_per_token(gpus, opts) / best:.3f}× the grid optimum's time per token)")


PLOT_FORMATS = ("png", "svg", "pdf")


def _plot_path(plot: Path) -> Path:
    """--plot's file: a name without an extension gets .png (and is reported as written with it); only the
    formats matplotlib writes without extra packages; a directory, device or input is refused by safeio."""
    from .safeio import check_writable

    raw = str(plot)
    if raw.endswith(("/", os.sep)) or os.path.isdir(raw):
        raise UserError(f"--plot {raw} is a directory; give a file name such as {os.path.join(raw, 'memory.png')}")
    if os.path.exists(raw) or os.path.islink(raw):
        check_writable(plot, flag="--plot")  # a device, FIFO or read-only file as named: refused as named
    if plot.suffix == "":
        plot = plot.with_name(plot.name + ".png")
    elif plot.suffix.lower().lstrip(".") not in PLOT_FORMATS:
        raise UserError(f"--plot {raw}: the figure is written as {', '.join('.' + f for f in PLOT_FORMATS)}; "
                        f"name the file with one of them")
    check_writable(plot, flag="--plot")
    return plot


@app.command()
@friendly
def compare(
    model: Model,
    seq: Seq,
    hw: Annotated[str, typer.Option("--hw", help="comma-separated profiles, e.g. h100,mi300x,mi355x")],
    gpus: Gpus = None,
    layers: Layers = None,
    micro_batch_tokens: Mbt = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="figure (.png, .svg or .pdf; no extension: .png): "
                                                                "memory by component against sequence length for "
                                                                "each profile (needs matplotlib)")] = None,
    fmt: TableFormat = "text",
):
    """Put the plans for several hardware profiles side by side, with what each technique buys on each. A profile on
    which the model does not fit shows "does not fit (needs N)" in its column; exit 1 only when none fits."""
    from .compare import technique_effects
    from .solver import InfeasibleError

    fmt = _table_format(fmt)
    names = [h.strip() for h in hw.split(",") if h.strip()]
    if not names:
        raise UserError("--hw needs at least one profile")
    if len(names) > 16:
        raise UserError(f"--hw names {len(names)} profiles; compare at most 16 side by side")
    if plot is not None:
        plot = _plot_path(plot)
        try:
            import matplotlib  # noqa: F401  (checked before the solves, not after)
        except ImportError:
            raise UserError("--plot needs matplotlib: pip install 'recipe[plot]'") from None
    cols = []  # (profile, solution or None, why not)
    m = None
    for name in names:
        inputs = _inputs(model, seq, name, gpus, layers, "full", "fused", micro_batch_tokens, 1, None)
        try:
            m, prof, sol = solve_inputs(inputs)
            cols.append((prof, sol, None))
        except InfeasibleError:
            from .hw import load_profile

            prof = load_profile(name)
            cols.append((prof, None, _does_not_fit(inputs, gpus)))
    if fmt == "json":
        from .views import compare_data

        _write_json(compare_data(model, inputs.seq_len, [(p, s, why, technique_effects(m, p, s) if s else None)
                                                         for p, s, why in cols], m))
    else:
        from .report import compare_table, console, techniques_table

        out = console()
        out.print(compare_table(cols))
        fitting = [(p, technique_effects(m, p, s)) if s else (p, None) for p, s, _ in cols]
        out.print(techniques_table(fitting))
    if not any(s for _, s, _ in cols):
        _fail(f"{model} at {inputs.seq_len:,} tokens fits on none of {', '.join(names)}"
              + (f" with {gpus} GPUs" if gpus else ""), EXIT_INFEASIBLE)
    if plot is not None:
        from .compare import plot_memory

        drawn = [(p, s.world) for p, s, _ in cols if s]
        written = plot_memory(m, [p for p, _ in drawn], [w for _, w in drawn], plot, seq_len=inputs.seq_len)
        left = [p.name for p, s, _ in cols if not s]
        note = f" (left out, no layout fits: {', '.join(left)})" if left else ""
        if fmt == "json":
            sys.stderr.write(f"wrote {written}{note}\n")
        else:
            sys.stdout.write(f"wrote {written}{note}\n")


def _does_not_fit(inputs, gpus: int | None) -> str:
    """A compare column's "does not fit (needs N)": the count the solver needs for this profile, found the way
    `recipe solve` without --gpus finds it."""
    from .planfile import SolveInputs
    from .solver import MAX_WORLD, InfeasibleError

    nowhere = f"on no count up to {MAX_WORLD}"
    if gpus is None:
        return f"does not fit ({nowhere})"
    try:
        _, _, sol = solve_inputs(SolveInputs(**{**inputs.model_dump(), "gpus": None}))
    except InfeasibleError:
        return f"does not fit on {gpus} ({nowhere})"
    if sol.world > gpus:
        return f"does not fit on {gpus} (needs {sol.world})"
    return f"no layout for {gpus} GPUs ({sol.world} fit)"


@app.command("hw")
@friendly
def hw_cmd(
    show: Annotated[Optional[str], typer.Argument(help="a profile to print with its sources")] = None,
    fmt: TableFormat = "text",
):
    """List the hardware profiles (or show one with the source of every figure)."""
    from .hw import all_profiles, load_profile

    fmt = _table_format(fmt)
    profiles = [load_profile(show)] if show else all_profiles()
    if fmt == "json":
        from .views import hw_data

        _write_json(hw_data(profiles[0]) if show else [hw_data(p) for p in profiles])
        return
    from .report import console, hw_table

    out = console()
    out.print(hw_table(profiles))
    if show:
        for k, v in profiles[0].sources.items():
            out.print(f"  [bold]{k}[/]: ", end="")
            out.print(v, markup=False, soft_wrap=True)


@app.command()
@friendly
def models(
    model: Annotated[Optional[str], typer.Argument(help="a preset or config.json to break down by group")] = None,
    fmt: TableFormat = "text",
):
    """List the model presets with total and active parameters (or break one down by group)."""
    from .models import PRESETS, mtp_params, param_counts, resolve_model

    fmt = _table_format(fmt)
    shapes = [resolve_model(model)] if model is not None else list(PRESETS.values())
    if fmt == "json":
        from .views import model_data

        _write_json(model_data(shapes[0], groups=True) if model is not None else [model_data(m) for m in shapes])
        return
    from rich.table import Table

    from .report import console, models_table

    out = console()
    out.print(models_table(shapes))
    out.print("active: all but the routed experts a token is not sent to and the input embedding "
              "(a lookup, not a matmul; FLOPs leave it out too)", markup=False)
    if model is None:
        return
    m = shapes[0]
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

app.command("check")(friendly(_check))

from .launch_cli import launch as _launch  # noqa: E402

app.command("launch")(_launch)

