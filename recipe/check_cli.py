"""The `recipe check` command: renders what recipe/check.py returns. Registered in recipe/cli.py."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

STATUS_STYLE = {"ok": "bold green", "drift": "bold yellow", "misfit": "bold red", "invalid": "bold red"}


def check(
    paths: Annotated[list[Path], typer.Argument(help="plan files or folders (folders: every *.yaml, *.yml, *.json "
                                                     "inside, recursively)", show_default=False)],
    fix: Annotated[bool, typer.Option("--fix", help="rewrite drifted plans in place with today's solve "
                                                    "(malformed plans are never touched)")] = False,
    fmt: Annotated[str, typer.Option("--format", "-f", help="text | github (workflow annotations) | json")] = "text",
):
    """Check committed plans: schema, divisibility, fit, and drift from today's solver.

    Exit 0 when clean, 1 on drift or misfit, 2 on unusable input (a missing path, a malformed plan, a plan --fix
    cannot write)."""
    from . import check as chk
    from .report import console
    from .text import one_line

    if fmt not in ("text", "github", "json"):
        sys.stderr.write(f"error: --format must be 'text', 'github' or 'json', got {fmt!r}\n")
        raise typer.Exit(2)
    if len(paths) > 10_000:
        sys.stderr.write(f"error: {len(paths):,} paths given; check at most 10,000 at once (or give their folder)\n")
        raise typer.Exit(2)
    results = chk.check_paths(paths)
    out = console()
    fixed: list[str] = []
    unwritable = 0
    if fix:
        for r in results:
            try:
                if chk.fix(r):
                    fixed.append(r.file)
            except ValueError as e:  # refused by recipe/safeio.py: read-only, a symlink into a missing folder, ...
                unwritable += 1
                sys.stderr.write(f"error: {' '.join(str(e).split())}\n")
        if fixed:
            again = {f: chk.check_plan(f) for f in fixed}
            results = [again.get(r.file, r) for r in results]
            if fmt != "json":
                for f in fixed:
                    out.print(f"fixed {one_line(f)}", markup=False, highlight=False, soft_wrap=True)
    code = max(chk.exit_code(results), 2 if unwritable else 0)
    if fmt == "json":
        import json

        from .views import check_data

        sys.stdout.write(json.dumps(check_data(results, fixed, code), indent=2) + "\n")
        raise typer.Exit(code)
    if fmt == "github":
        for r in results:
            for p in r.problems:
                typer.echo(github_annotation(p))
    else:
        if any(r.plan is not None for r in results):
            out.print(results_table(results))
        for r in results:
            for p in r.problems:
                out.print(chk.problem_line(p), markup=False, highlight=False, soft_wrap=True,
                          style=STATUS_STYLE[p.kind])
    counts = {k: sum(r.status == k for r in results) for k in ("ok", "drift", "misfit", "invalid")}
    summary = f"{len(results)} plan{'s' if len(results) != 1 else ''} checked: " + ", ".join(
        f"{n} {k}" for k, n in counts.items() if n)
    if fmt == "github":
        typer.echo(summary)
    else:
        out.print(summary, markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def results_table(results):
    from rich.table import Table
    from rich.text import Text

    from .text import layout_str, one_line

    t = Table(show_header=True, header_style="bold")
    for c in ("file", "status", "layout", "peak / usable GB"):
        t.add_column(c, justify="right" if c.startswith("peak") else "left", overflow="fold")
    for r in results:
        lay = layout_str(r.plan.layout) if r.plan is not None else "—"
        mem = f"{r.peak_gb:.1f} / {r.usable_gb:.1f}" if r.peak_gb is not None else "—"
        t.add_row(Text(one_line(r.file)), Text(r.status, style=STATUS_STYLE[r.status]), lay, mem)
    return t


def _escape_data(s: str) -> str:
    return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(s: str) -> str:
    return _escape_data(s).replace(":", "%3A").replace(",", "%2C")


def github_annotation(p) -> str:
    """`::error file=F,line=N,title=T::message` (GitHub workflow command syntax, with its escaping)."""
    from .check import format_value

    props = [f"file={_escape_property(p.file)}"]
    line = _field_line(p.file, p.field) if p.kind != "invalid" else None
    if line is not None:
        props.append(f"line={line}")
    if p.kind == "invalid":
        title, msg = f"recipe check: invalid {'path' if p.field == 'path' else 'plan'}", p.cause
    else:
        title = f"recipe check: {p.kind} in {p.field}"
        msg = f"{p.field}: committed {format_value(p.committed)}, solved {format_value(p.solved)}"
        msg += f" — {p.cause}" if p.cause else ""
    props.append(f"title={_escape_property(title)}")
    return f"::error {','.join(props)}::{_escape_data(msg)}"


def _field_line(file: str, dotted: str) -> int | None:
    from .check import line_of

    try:
        return line_of(Path(file).read_text(encoding="utf-8"), dotted)
    except (OSError, UnicodeDecodeError):
        return None
