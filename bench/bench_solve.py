"""Solver speed: `recipe solve --model qwen35-35b --seq 128k --hw mi300x` end to end as a fresh process (what a user
waits for: interpreter start, imports, solve, render), the solve alone in process, and the full PP×TP×EP×CP grid for
the same inputs (the sweep the solver replaces); and `--recompute auto`, which solves again for no recompute and for
each kept-layer count it tries.

Wall times are medians over --runs runs after --warmup runs. Goal: the end-to-end solve under 300 ms on the 2-core
development machine. The 1-minute load average is printed before and after: other jobs on a 2-core machine inflate
every figure, so re-run when it is low. For the processes the median CPU time (user + sys of the child) is printed
too: it moves much less than wall time when other jobs share the cores.

    python bench/bench_solve.py                     # defaults: qwen35-35b, 128k, mi300x, 15 runs after 2 warm-ups
    python bench/bench_solve.py --hw h100 --runs 31
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipe.solving import solve_inputs  # noqa: E402
from recipe.plan import Inputs, parse_size  # noqa: E402
from recipe.sweep import grid, rank_of, ranked  # noqa: E402


def recipe_argv() -> list[str]:
    exe = shutil.which("recipe", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return [exe] if exe else [sys.executable, "-m", "recipe"]


CPU_MS: dict[int, list[float]] = {}  # id(wall list) → the same runs' CPU time (user + sys of the child)


def _child_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wall_ms(argv: list[str], runs: int, warmup: int, cwd: str, env: dict | None = None) -> list[float]:
    """Wall milliseconds per run; the child's CPU milliseconds go to CPU_MS (less sensitive to other jobs)."""
    times, cpu = [], []
    for i in range(warmup + runs):
        c0, t0 = _child_cpu_s(), time.perf_counter()
        p = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=env)
        dt, dc = (time.perf_counter() - t0) * 1e3, (_child_cpu_s() - c0) * 1e3
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
        if i >= warmup:
            times.append(dt)
            cpu.append(dc)
    CPU_MS[id(times)] = cpu
    return times


def in_process_ms(fn, runs: int, warmup: int) -> list[float]:
    times = []
    for i in range(warmup + runs):
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def fmt(ts: list[float]) -> tuple[str, str, str]:
    return f"{statistics.median(ts):.1f}", f"{min(ts):.1f}", f"{max(ts):.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen35-35b")
    ap.add_argument("--seq", default="128k")
    ap.add_argument("--hw", default="mi300x")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--sweep-runs", type=int, default=5, help="runs of the (slower) sweep process")
    args = ap.parse_args()

    load_before = os.getloadavg()
    inputs = Inputs(model=args.model, seq_len=parse_size(args.seq), hw=args.hw)
    m, hw, sol = solve_inputs(inputs)
    world = sol.world
    opts = sol.opts.model_copy(update={"ep_overlap_chunks": 1})

    solve_argv = recipe_argv() + ["solve", "--model", args.model, "--seq", args.seq, "--hw", args.hw]
    sweep_argv = recipe_argv() + ["sweep", "--model", args.model, "--seq", args.seq, "--hw", args.hw,
                                  "--gpus", str(world)]
    # Bytecode: with PYTHONDONTWRITEBYTECODE set (as on the development machines) and an editable install, every
    # process recompiles recipe/*.py from source. A wheel install byte-compiles at install time; the "bytecode
    # cached" row reproduces that with a throw-away cache directory, so nothing is written into the repository.
    no_pyc = os.environ.get("PYTHONDONTWRITEBYTECODE", "") != ""
    with tempfile.TemporaryDirectory() as cwd, tempfile.TemporaryDirectory() as pycache:  # cwd: not the repo
        cached_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        cached_env["PYTHONPYCACHEPREFIX"] = pycache
        python_start = wall_ms([sys.executable, "-c", "pass"], args.runs, args.warmup, cwd)
        solve_wall = wall_ms(solve_argv, args.runs, args.warmup, cwd)
        solve_cached = wall_ms(solve_argv, args.runs, args.warmup, cwd, cached_env)
        sweep_wall = wall_ms(sweep_argv, args.sweep_runs, 1, cwd)
        auto_wall = wall_ms(solve_argv + ["--recompute", "auto"], args.sweep_runs, 1, cwd)
    solve_in = in_process_ms(lambda: solve_inputs(inputs), args.runs, args.warmup)
    auto_inputs = Inputs(model=args.model, seq_len=parse_size(args.seq), hw=args.hw, recompute="auto")
    auto_in = in_process_ms(lambda: solve_inputs(auto_inputs), args.sweep_runs, 1)
    points: list = []
    grid_in = in_process_ms(lambda: points.__setitem__(slice(None), grid(m, hw, world, opts)), args.sweep_runs, 1)
    load_after = os.getloadavg()

    pts = ranked(points, world, opts)
    n_fit = sum(p.estimate.fits for p in pts)
    rank = rank_of(pts, sol.layout)
    deg = sol.degrees
    layout = " ".join(f"{k.upper()}={deg[k]}" for k in ("pp", "tp", "cp", "ep", "dp", "edp"))

    print(f"recipe solve --model {args.model} --seq {args.seq} --hw {args.hw}  →  {world} GPUs, {layout}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(f"full grid at {world} GPUs: {len(pts)} layouts, {n_fit} fit; the solver's layout ranks #{rank}\n")
    rows = [
        ("python -c pass (interpreter start)", "process", python_start),
        ("recipe solve (end to end)" + (", no bytecode cache" if no_pyc else ""), "process", solve_wall),
        ("recipe solve (end to end), bytecode cached", "process", solve_cached),
        (f"recipe sweep --gpus {world} (end to end)", "process", sweep_wall),
        ("recipe solve --recompute auto (end to end)", "process", auto_wall),
        ("solve (min GPU count search + plan)", "in process", solve_in),
        ("solve --recompute auto", "in process", auto_in),
        (f"grid: {len(pts)} layouts at {world} GPUs", "in process", grid_in),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"{'what':<{w}}  {'how':<10}  {'runs':>4}  {'median ms':>9}  {'min':>7}  {'max':>7}  {'CPU ms':>7}")
    for name, how, ts in rows:
        med, lo, hi = fmt(ts)
        cpu = CPU_MS.get(id(ts))
        cpu_s = f"{statistics.median(cpu):.1f}" if cpu else "—"
        print(f"{name:<{w}}  {how:<10}  {len(ts):>4}  {med:>9}  {lo:>7}  {hi:>7}  {cpu_s:>7}")
    s_med, g_med = statistics.median(solve_wall), statistics.median(sweep_wall)
    print(f"\nsweep / solve, end to end: {g_med / s_med:.1f}×; in process: "
          f"{statistics.median(grid_in) / statistics.median(solve_in):.1f}×")
    c_med = statistics.median(solve_cached)
    for label, med in (("as run", s_med), ("bytecode cached", c_med)):
        print(f"goal: recipe solve under 300 ms wall ({label}) — {'met' if med < 300 else 'NOT met'} ({med:.0f} ms)")


if __name__ == "__main__":
    main()
