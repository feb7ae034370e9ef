"""What a training run reports, on rank 0: a live view or one line per step, `metrics.jsonl`, TensorBoard events,
and the measured figures beside the plan's prediction. Torch-free (TensorBoard's writer, when installed, is
imported only when a `Progress` opens it).

    progress = Progress.for_plan(out_dir, plan, total_steps=100, resume_step=None)
    with progress:
        for step in ...:
            progress.update({"step": step, "loss": loss, "tokens": tokens, "step_time_s": dt, "peak_mem_gb": mem})
    print(summary(progress.measured(), plan.prediction))

`tokens` is the step's tokens over all ranks; tokens/s per GPU divides by the plan's world size, TFLOP/s per GPU
multiplies that by the plan's hardware FLOPs per token (recompute included, the cost model's figure), and MFU divides
by the profile's dense bf16 peak, so the measured figures compare one to one with `plan.prediction`.

metrics.jsonl holds one JSON object per step: what the trainer passed (at least step, loss, tokens, step_time_s,
peak_mem_gb; on a GPU also peak_device_gb; each the largest over ranks, launch/job.py: peak_memory_gb) and the derived
tokens_per_s, tokens_per_s_per_gpu, tflops_per_gpu, mfu and elapsed_s; a NaN or infinite value is written as null
(strict JSON). A fresh run truncates the file. A resumed run (resume_step=S) keeps the lines of steps ≤ S, drops any
later ones (those steps ran after the checkpoint and are about to run again) and appends, so the file holds each step
once, in the order the surviving run took them.

Output piped into `head` ends quietly: once stdout is gone, the view stops printing and the run goes on (the metrics
file and TensorBoard keep being written).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Mapping

REQUIRED = ("step", "loss", "tokens", "step_time_s", "peak_mem_gb")
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class Progress:
    """The rank-0 reporter of one run. `total_steps`: the step the run ends at (for the ETA); `world_size`: GPUs
    (ranks) the tokens are spread over; `flops_per_token` and `peak_tflops` turn tokens/s into TFLOP/s and MFU
    (None: those columns stay empty); `resume_step`: the checkpoint step a resumed run starts after (None: a fresh
    run); `live`: the rich view (default: when `stream` is a terminal); `tensorboard`: write event files under
    `out_dir/tensorboard` when TensorBoard is installed."""

    def __init__(self, out_dir: str | Path, total_steps: int, *, world_size: int = 1,
                 flops_per_token: float | None = None, peak_tflops: float | None = None,
                 resume_step: int | None = None, stream=None, live: bool | None = None, tensorboard: bool = True):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / METRICS_FILE
        self.total_steps, self.world_size = int(total_steps), max(1, int(world_size))
        self.flops_per_token = flops_per_token or None
        self.peak_tflops = peak_tflops or None
        self.stream = stream if stream is not None else sys.stdout
        self.live = _isatty(self.stream) if live is None else live
        self.rows: list[dict] = []
        self._printing = True
        self._live_view = None
        self._start = time.monotonic()
        if self.path.is_dir():
            raise ValueError(f"{self.path} is a directory; the metrics file needs that name")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self._file = open(self.path, "w")
        else:
            _keep_until(self.path, int(resume_step))
            self._file = open(self.path, "a")
        self._tb = _tensorboard_writer(self.out_dir / TENSORBOARD_DIR, resume_step) if tensorboard else None

    @classmethod
    def for_plan(cls, out_dir: str | Path, plan, total_steps: int, *, base_dir: str | Path | None = None,
                 **kwargs) -> "Progress":
        """A Progress sized from a plan: its world size, the cost model's hardware FLOPs per token for its layout
        and options, and its profile's dense bf16 peak."""
        flops, peak = plan_rates(plan, base_dir)
        return cls(out_dir, total_steps, world_size=plan.layout.world, flops_per_token=flops, peak_tflops=peak,
                   **kwargs)

    # ---- per step ----
    def update(self, metrics: Mapping[str, Any]) -> dict:
        """Record one step: append its line to metrics.jsonl, log it to TensorBoard, show it. Returns the row
        written (the trainer's metrics and the derived rates)."""
        missing = [k for k in REQUIRED if k not in metrics]
        if missing:
            raise ValueError(f"step metrics lack {', '.join(missing)} (required: {', '.join(REQUIRED)})")
        row = {k: _jsonable(v) for k, v in metrics.items()}
        row["step"] = int(metrics["step"])
        dt, tokens = _num(metrics["step_time_s"]), _num(metrics["tokens"])
        tok_s = tokens / dt if tokens is not None and dt else None
        row["tokens_per_s"] = tok_s
        row["tokens_per_s_per_gpu"] = tok_s / self.world_size if tok_s is not None else None
        if "tflops_per_gpu" not in metrics:
            row["tflops_per_gpu"] = (row["tokens_per_s_per_gpu"] * self.flops_per_token / 1e12
                                     if row["tokens_per_s_per_gpu"] is not None and self.flops_per_token else None)
        if "mfu" not in metrics:
            tf = _num(row.get("tflops_per_gpu"))
            row["mfu"] = tf / self.peak_tflops if tf is not None and self.peak_tflops else None
        row["elapsed_s"] = round(time.monotonic() - self._start, 3)
        self.rows.append(row)
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"train/{k}", v, row["step"])
        self._show(row)
        return row

    def log(self, message: str) -> None:
        """A line of its own (a checkpoint saved, a warning), above the live view or between the step lines."""
        if not self._printing:
            return
        try:
            if self._live_view is not None:
                self._live_view.console.print(message, markup=False, highlight=False, soft_wrap=True)
            else:
                self.stream.write(message + "\n")
                self.stream.flush()
        except BrokenPipeError:
            self._gone()

    def eta_s(self) -> float | None:
        """Seconds left: the steps left times the median of the last 20 step times, leaving out this process's first
        step (kernel compilation and tuning) once a later one exists."""
        if not self.rows:
            return None
        recent = [r["step_time_s"] for r in self._warm_rows()[-20:] if isinstance(r.get("step_time_s"), (int, float))]
        if not recent:
            return None
        return max(0, self.total_steps - self.rows[-1]["step"]) * statistics.median(recent)

    def _warm_rows(self) -> list[dict]:
        """This process's steps after its first (kernel compilation and tuning), or the first alone."""
        return self.rows[1:] if len(self.rows) > 1 else self.rows

    def measured(self) -> dict[str, float | None]:
        """The run's figures for `summary`: the peak memories over all steps, and the medians of tokens/s/GPU,
        TFLOP/s/GPU and step time over the steps after the first (warm-up) when there are several."""
        rows = self._warm_rows()

        def median(key: str) -> float | None:
            vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
            return statistics.median(vals) if vals else None

        def peak(key: str) -> float | None:
            vals = [r[key] for r in self.rows if isinstance(r.get(key), (int, float))]
            return max(vals) if vals else None

        return {"peak_mem_gb": peak("peak_mem_gb"), "peak_device_gb": peak("peak_device_gb"),
                "tokens_per_s_per_gpu": median("tokens_per_s_per_gpu"),
                "tflops_per_gpu": median("tflops_per_gpu"), "step_time_s": median("step_time_s"),
                "warm_steps": max(len(self.rows) - 1, 0) if self.rows else None}

    # ---- closing ----
    def close(self) -> None:
        if self._live_view is not None:
            try:
                self._live_view.stop()
            except (BrokenPipeError, OSError):
                self._gone()
            self._live_view = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- display ----
    def _show(self, row: dict) -> None:
        if not self._printing:
            return
        try:
            if self.live:
                self._show_live(row)
            else:
                self.stream.write(step_line(row, self.total_steps, self.eta_s()) + "\n")
                self.stream.flush()
        except BrokenPipeError:
            self._gone()

    def _show_live(self, row: dict) -> None:
        if self._live_view is None:
            from rich.console import Console
            from rich.live import Live

            self._live_view = Live(console=Console(file=self.stream), auto_refresh=False, transient=False)
            self._live_view.start()
        self._live_view.update(live_table(row, self.total_steps, self.eta_s()), refresh=True)

    def _gone(self) -> None:
        """stdout was closed under us (`| head`): stop printing, and point the descriptor at /dev/null so that the
        interpreter's last flush at exit does not complain either."""
        self._printing = False
        try:
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, self.stream.fileno())
            os.close(fd)
        except (OSError, ValueError, AttributeError):
            pass


# ---- rendering -----------------------------------------------------------------------------------------------------
def step_line(row: Mapping[str, Any], total_steps: int, eta_s: float | None = None) -> str:
    """One plain line per step: `step 3/100  loss 2.3456  tok/s/GPU 10,936  TFLOP/s/GPU 370.9  MFU 37.5%  mem 52.4 GB
    ETA 0:04:12` (a figure that is not known is shown as —)."""
    return "  ".join(f"{k} {v}" for k, v in _cells(row, total_steps, eta_s))


def live_table(row: Mapping[str, Any], total_steps: int, eta_s: float | None = None):
    """The rich live view of the latest step."""
    from rich.table import Table

    cells = _cells(row, total_steps, eta_s)
    t = Table(show_header=True, header_style="bold", box=None, padding=(0, 2))
    for k, _ in cells:
        t.add_column(k, justify="right")
    t.add_row(*(v for _, v in cells))
    return t


def _cells(row: Mapping[str, Any], total_steps: int, eta_s: float | None) -> list[tuple[str, str]]:
    return [
        ("step", f"{row.get('step')}/{total_steps}"),
        ("loss", _fmt(row.get("loss"), "{:.4f}")),
        ("tok/s/GPU", _fmt(row.get("tokens_per_s_per_gpu"), "{:,.0f}")),
        ("TFLOP/s/GPU", _fmt(row.get("tflops_per_gpu"), "{:.1f}")),
        ("MFU", _fmt(row.get("mfu"), "{:.1%}")),
        ("mem", _fmt(row.get("peak_mem_gb"), "{:.1f} GB")),
        ("ETA", _duration(eta_s)),
    ]


def summary(measured: Mapping[str, Any], prediction) -> str:
    """The measured peak memory and throughput beside the plan's prediction (`plan.prediction`, or its dict), with
    the error of the prediction in percent of the prediction ((measured − predicted) / predicted). Memory is compared
    like with like: with `peak_device_gb` (a GPU run) the allocator's peak allocated against the plan's total less
    its overhead (the CUDA context, NCCL buffers and allocator slack, which the allocated bytes leave out), and the
    device's peak against the whole total; without it (the CPU's resident set, which holds everything) the one peak
    against the total. A run of one step (`warm_steps` 0) has only its first step's throughput, compilation and
    autotuning included: shown, not compared."""
    cold = measured.get("warm_steps") == 0
    total, overhead = _num(_get(prediction, "memory_gb", "total")), _num(_get(prediction, "memory_gb", "overhead"))
    if measured.get("peak_device_gb") is not None:
        memory = [("peak allocated (GB)", measured.get("peak_mem_gb"),
                   total - (overhead or 0.0) if total is not None else None, "{:.2f}"),
                  ("peak on device (GB)", measured.get("peak_device_gb"), total, "{:.2f}")]
    else:
        memory = [("peak memory (GB)", measured.get("peak_mem_gb"), total, "{:.2f}")]
    rows = memory + [
        ("tokens/s per GPU", measured.get("tokens_per_s_per_gpu"), _get(prediction, "tokens_per_s_per_gpu"),
         "{:,.0f}"),
        ("TFLOP/s per GPU", measured.get("tflops_per_gpu"), _get(prediction, "tflops_per_gpu"), "{:.1f}")]
    table = [("", "measured", "predicted", "error")]
    for name, m, p, fmt in rows:
        m, p = _num(m), _num(p)
        err = f"{(m - p) / p:+.1%}" if m is not None and p and not (cold and "(GB)" not in name) else "—"
        table.append((name, _fmt(m, fmt), _fmt(p, fmt), err))
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    text = "\n".join(r[0].ljust(widths[0]) + "".join("  " + c.rjust(w) for c, w in zip(r[1:], widths[1:]))
                     for r in table)
    if cold:
        text += "\n(one step: its throughput includes compilation and autotuning, so it is not compared; run 2+ steps)"
    return text


def plan_rates(plan, base_dir: str | Path | None = None) -> tuple[float | None, float | None]:
    """(hardware FLOPs per token, dense bf16 peak TFLOP/s per GPU) of a plan: the cost model's figure for the plan's
    layout and options, and its profile's peak. (None, None) when the model or profile cannot be resolved."""
    from recipe.cost import Layout, estimate

    base = Path(base_dir) if base_dir is not None else None
    try:
        m, hw, lay = plan.model_shape(base), plan.hw_profile(base), plan.layout
        est = estimate(m, hw, lay.world, Layout(pp=lay.pp, tp=lay.tp, cp=lay.cp, ep=lay.ep, etp=lay.etp),
                       plan.train_options())
    except (ValueError, ArithmeticError):
        return None, None
    return est.flops_per_token["hardware"], hw.peak_bf16_tflops


# ---- helpers -------------------------------------------------------------------------------------------------------
def _keep_until(path: Path, step: int) -> None:
    """Rewrite `path` (atomically) with only its well-formed lines of steps ≤ `step`."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return
    kept = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
            kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


def _tensorboard_writer(log_dir: Path, resume_step: int | None):
    """TensorBoard's SummaryWriter when the tensorboard package is installed, else None (silently). On resume,
    events of the steps after the checkpoint are purged, as metrics.jsonl drops their lines."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # torch absent, or a tensorboard install torch cannot use: no event files, no noise
        return None
    purge = resume_step + 1 if resume_step is not None else None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge)


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    try:
        f = float(v)  # numpy / torch scalars
    except (TypeError, ValueError):
        return str(v)
    return f if math.isfinite(f) else None


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _get(obj, *keys):
    for k in keys:
        if obj is None:
            return None
        obj = obj.get(k) if isinstance(obj, Mapping) else getattr(obj, k, None)
    return obj


def _fmt(v: Any, fmt: str) -> str:
    n = _num(v)
    return fmt.format(n) if n is not None else "—"


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "—"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
