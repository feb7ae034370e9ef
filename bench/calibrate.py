"""The calibration grid: training steps of reduced-depth, full-width models on one GPU, each point's measured peak
memory and step time next to the cost model's prediction for the same configuration. Writes the grid as JSON
(hw_profiles/calibration/<hw>.json is the committed copy; recipe/calibration.py reads it).

Grid (the default, `--grid full`): Qwen3.5-35B-A3B and Qwen3-30B-A3B at full width, 2, 4 and 8 decoder layers,
8K to 128K tokens in one packed sequence, full recompute and none (none where it fits), the fused, lean and naive
heads at a subset, and the expert-parallel code path at world size 1 (parallelize(..., ep_dispatch=True) under a
one-process group) at 8K to 64K tokens, so its fixed cost and its per-token cost separate. The 2- and 4-layer points
are the ones the per-operation efficiencies are fit on; the 8-layer points are held out. Points that do not fit
are recorded with their error, not dropped. `--grid holdout`: Qwen3-235B-A22B at 1 and 2 layers (another width),
Qwen3-Next-80B-A3B at 2 layers (512 experts, top 10) and Mixtral-8x7B at 2 (8 wide experts), every point held out
(merged into the committed grid beside the others). `--grid v3`: Moonlight-16B-A3B and GLM-4.5-Air at 2 layers and
DeepSeek-V3 at 3 (multi-head latent attention, sigmoid routing), every point held out. `--grid families`: OLMoE,
Qwen1.5-MoE, ERNIE-4.5 and gpt-oss-20b at 2 layers and MiniMax-M2 at 1, every point held out. `--grid partial`: partial
recompute (the last `keep_layers` layers keep their activations) beside none and full on the same model and length,
every partial point held out.

Every (model, depth) group builds its model once and runs its points in order (recompute none first, then partial,
then full: recompute wraps the layers for good); each point empties the allocator's cache, runs one warm-up step,
then times `--steps` steps (the median is the step time) with the peak statistics reset after the warm-up, and the
CUDA stack limit set back after it as `recipe launch` does (kernel tuning raises it). Per group at one length it also
times the step's components alone (bench_train_step.profile_components). A table is printed as it goes and the JSON
rewritten after every point, so a partial run is still a usable grid.

    python bench/calibrate.py --out h200.json --commit $(git rev-parse --short HEAD)         # on the GPU
    python bench/calibrate.py --grid smoke --device cpu --out /tmp/cal.json                  # CPU smoke (tiny-moe)
    python bench/calibrate.py --refresh hw_profiles/calibration/h200.json                    # re-predict (CPU)

After a change that moves memory and not time (the optimizer's transient copies, say), `--memory-only` runs the
same points with one step after the warm-up each, for the peak alone, and `--merge-peaks` takes those peaks into the
committed grid, each point recording the commit its peak was measured at (`peak_commit`):

    python bench/calibrate.py --grid families --memory-only --out families_peaks.json                 # on the GPU
    python bench/calibrate.py --merge-peaks hw_profiles/calibration/h200.json full_peaks.json families_peaks.json

`--refresh` recomputes every point's prediction and the grid's errors with the cost model as it is now (no torch,
no GPU): run it after a cost-model change, then commit the file (tests/test_calibration.py checks both).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from recipe.calibration import predict_point, summarize  # noqa: E402

K = 1024


def _pts(rc_head_seqs, ep_seqs=()):
    """[(recompute, lm_head, seq, ep_path, keep_layers)] from {(recompute, head[, keep_layers[, ep_path]]): [seqs]}
    and the EP-path lengths (full recompute). A group's points run in order and a trainer only adds recompute
    wrappers: none first, then partial recompute by growing recompute (fewer kept layers), then full; the EP path,
    once applied, stays, so its points come last and a group has them in one recompute setting."""
    out = []
    for key, seqs in rc_head_seqs:
        rc, head = key[:2]
        keep, ep = (key[2] if len(key) > 2 else 0), (key[3] if len(key) > 3 else False)
        out += [(rc, head, s, ep, keep) for s in seqs]
    return out + [("full", "fused", s, True, 0) for s in ep_seqs]


# (model, layers, points, component-profile length or 0). Order: each model's 4 layers and its held-out 8, then the
# 2-layer groups, so a run cut short by its time budget still has fitted and held-out points of both models.
GRIDS = {
    "full": [
        ("qwen35-35b", 4, _pts([(("none", "fused"), [8 * K, 32 * K]),
                                (("full", "fused"), [8 * K, 32 * K, 64 * K, 128 * K]),
                                (("full", "lean"), [64 * K]), (("full", "naive"), [32 * K])], [32 * K, 64 * K]), 32 * K),
        ("qwen35-35b", 8, _pts([(("none", "fused"), [8 * K]),
                                (("full", "fused"), [8 * K, 32 * K, 64 * K])]), 0),
        ("qwen3-30b-a3b", 4, _pts([(("none", "fused"), [8 * K, 32 * K]),
                                   (("full", "fused"), [8 * K, 32 * K, 64 * K]),
                                   (("full", "lean"), [32 * K])], [8 * K]), 32 * K),
        ("qwen3-30b-a3b", 8, _pts([(("none", "fused"), [8 * K]),
                                   (("full", "fused"), [8 * K, 32 * K, 64 * K])]), 0),
        ("qwen35-35b", 2, _pts([(("none", "fused"), [8 * K, 32 * K, 128 * K]),
                                (("full", "fused"), [8 * K, 32 * K, 64 * K, 128 * K]),
                                (("full", "lean"), [32 * K]), (("full", "naive"), [32 * K])], [32 * K]), 0),
        ("qwen3-30b-a3b", 2, _pts([(("none", "fused"), [8 * K, 32 * K]),
                                   (("full", "fused"), [8 * K, 32 * K, 64 * K, 128 * K]),
                                   (("full", "naive"), [8 * K])], [32 * K]), 0),
    ],
    # models outside the fit, at another width: Qwen3-235B-A22B (hidden 4096, 64 query heads over 4 KV heads,
    # 128 experts of width 1536, top 8), every point held out; `--grid holdout`, merged into the committed grid
    "holdout": [
        ("qwen3-235b-a22b", 1, _pts([(("none", "fused"), [32 * K]),
                                     (("full", "fused"), [8 * K, 32 * K, 64 * K])]), 0),
        ("qwen3-235b-a22b", 2, _pts([(("none", "fused"), [8 * K, 32 * K]),
                                     (("full", "fused"), [8 * K, 32 * K, 64 * K])]), 32 * K),
        # Qwen3-Next-80B-A3B's first two layers (Gated DeltaNet): 512 experts, top 10, the expert weights' term
        # largest of the presets the core trains
        ("qwen3-next-80b", 2, _pts([(("none", "fused"), [8 * K]),
                                    (("full", "fused"), [8 * K, 32 * K, 64 * K, 128 * K])]), 0),
        # Mixtral-8x7B's first two layers: 8 wide experts (14,336) of which 2 a token, hidden 4096, no q/k norms
        ("mixtral-8x7b", 2, _pts([(("none", "fused"), [8 * K, 32 * K]), (("full", "fused", 1), [32 * K]),
                                  (("full", "fused"), [8 * K, 32 * K, 64 * K])]), 32 * K),
    ],
    # partial recompute (the last keep_layers layers keep their activations) between none and full, every point
    # held out: `--grid partial`, merged into the committed grid
    "partial": [
        ("qwen35-35b", 4, _pts([(("none", "fused"), [32 * K]), (("full", "fused", 3), [32 * K]),
                                (("full", "fused", 2), [32 * K, 64 * K]), (("full", "fused", 1), [32 * K]),
                                (("full", "fused"), [32 * K])]), 0),
        ("qwen35-35b", 8, _pts([(("full", "fused", 2), [32 * K]), (("full", "fused"), [32 * K])]), 0),
        ("qwen3-30b-a3b", 4, _pts([(("none", "fused"), [32 * K]), (("full", "fused", 2), [32 * K]),
                                   (("full", "fused"), [32 * K])]), 0),
        # the expert-parallel code path (world size 1) with layers kept and with none recomputed: its kept layers
        # hold what the local path's do
        ("qwen35-35b", 4, _pts([(("full", "fused", 2, True), [32 * K])]), 0),
        ("qwen35-35b", 4, _pts([(("none", "fused", 0, True), [32 * K])]), 0),
    ],
    # DeepSeek-V3's family, every point held out: Moonlight-16B-A3B's first two layers (MLA without the q LoRA, a
    # dense layer, then 64 sigmoid-routed experts of width 1,408, top 6, two shared), DeepSeek-V3's first three (its
    # dense layers: MLA with 128 heads and the q LoRA at hidden 7168, FFN 18,432) and GLM-4.5-Air's first two (96
    # query heads over 8, half-rotary, q/k/v biases; 128 sigmoid-routed experts, top 8); `--grid v3`, merged
    "v3": [
        ("moonlight-16b", 2, _pts([(("none", "fused"), [8 * K, 32 * K]),
                                   (("full", "fused"), [8 * K, 32 * K, 64 * K])]), 0),
        ("glm45-air", 2, _pts([(("none", "fused"), [8 * K]), (("full", "fused"), [8 * K, 32 * K, 64 * K])]), 32 * K),
        ("deepseek-v3", 3, _pts([(("none", "fused"), [8 * K]), (("full", "fused"), [8 * K, 32 * K])]), 8 * K),
    ],
    # the families trained beside Qwen3 and DeepSeek-V3, every point held out: OLMoE-1B-7B (q/k norms over all heads,
    # 64 experts, top 8), Qwen1.5-MoE-A2.7B (q/k/v biases, 60 experts of width 1,408, top 4, a gated shared
    # expert), ERNIE-4.5-21B-A3B (a dense first layer, then 64 experts, top 6, two shared; softmax scores with a
    # correction bias) and gpt-oss-20b (sliding and full attention with sinks, 32 biased experts, top 4), each at its
    # first two layers, and MiniMax-M2 at its first (q/k norms over all heads, 48 query heads over 8, 256
    # sigmoid-routed experts, top 8: two layers' fp32 state would not fit one GPU); `--grid families`, merged into the
    # committed grid
    "families": [
        # Llama 4 Scout's first two layers (chunked attention in runs of 8192 positions, 40 query heads over 8;
        # 16 experts of width 8,192, top 1 by a sigmoid weighting its input, a shared expert)
        ("llama4-scout", 2, _pts([(("none", "fused"), [8 * K]), (("full", "fused"), [8 * K, 32 * K, 64 * K])]), 32 * K),
        ("olmoe-1b-7b", 2, _pts([(("none", "fused"), [8 * K]), (("full", "fused"), [8 * K, 32 * K, 64 * K])]), 0),
        ("qwen15-moe-a27b", 2, _pts([(("none", "fused"), [8 * K]),
                                     (("full", "fused"), [8 * K, 32 * K, 64 * K])]), 0),
        ("ernie45-21b-a3b", 2, _pts([(("none", "fused"), [8 * K]),
                                     (("full", "fused"), [8 * K, 32 * K, 64 * K])]), 0),
        ("gpt-oss-20b", 2, _pts([(("none", "fused"), [8 * K]), (("full", "fused"), [8 * K, 32 * K, 64 * K])]), 0),
        ("minimax-m2", 1, _pts([(("none", "fused"), [8 * K]), (("full", "fused"), [8 * K, 32 * K, 64 * K])]), 32 * K),
    ],
    "smoke": [
        ("tiny-moe", 2, _pts([(("none", "fused"), [256]), (("full", "fused"), [256, 512]),
                              (("full", "lean"), [256]), (("full", "naive"), [256])], [256]), 256),
        ("tiny-moe", 4, _pts([(("full", "fused", 2), [512]), (("full", "fused"), [512])]), 0),
    ],
}


FIT_MODELS = ("qwen35-35b", "qwen3-30b-a3b", "tiny-moe")  # the efficiencies are fit on their 2- and 4-layer points


# every point of these is held out, whatever its model and depth
HELD_OUT_GRIDS = ("holdout", "partial", "v3", "families")


def role(model: str, layers: int, grid: str = "full") -> str:
    return "held_out" if layers >= 8 or model not in FIT_MODELS or grid in HELD_OUT_GRIDS else "fit"


def _grid_keys(grid: str, keep: int) -> dict:
    """A point's `grid` (where not the default one: a held-out grid's points are held out whatever their model) and
    `keep_layers` (where some are kept)."""
    return {**({"grid": grid} if grid != "full" else {}), **({"keep_layers": keep} if keep else {})}


def environment(args) -> dict:
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
           "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "commit": args.commit or _git_commit(),
           "device": args.device}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if args.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_bytes=p.total_memory, sms=p.multi_processor_count, cuda=torch.version.cuda)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    env["cpu"] = _cpu_name()
    env["host_launch_us"] = _host_launch_us(torch, args.device)
    try:
        from launch.gated_delta import fla_status

        env["delta_rule"] = fla_status(128)[1]
    except Exception as e:  # noqa: BLE001 - informational only
        env["delta_rule"] = f"unknown ({type(e).__name__})"
    return env


def _cpu_name() -> str | None:
    """The host CPU's model name (Linux), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _host_launch_us(torch, device: str, n: int = 400) -> float:
    """Host microseconds to queue one small kernel: the launch rate that bounds the short points (8K tokens) and the
    lean head's many chunk iterations, so a grid's step times can be read against the host they ran on. The
    median of five rounds of n launches (n below the launch queue's depth, so the host never waits on the GPU)."""
    x = torch.zeros(256, device=device)
    rounds = []
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            x.add_(1.0)
        rounds.append((time.perf_counter() - t) / n * 1e6)
    if device == "cuda":
        torch.cuda.synchronize()
    return round(statistics.median(rounds), 2)


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1], timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _cfg(r: dict) -> str:
    seq = f"{r['seq'] // K}K" if r["seq"] % K == 0 else str(r["seq"])
    rc = f"k{r['keep_layers']}" if r.get("keep_layers") else r["recompute"]
    return f"{r['model']:<14} {r['layers']:>2} {seq:>5} {rc:<4} {r['lm_head']:<5} {'ep' if r['ep_path'] else 'local':<5}"


def _fmt_row(r: dict) -> str:
    cfg = _cfg(r)
    if "error" in r:
        return f"{cfg} {r['error'][:90]}"
    p = r["predicted"]
    mem = r.get("peak_allocated_gb")
    mem_s = f"{mem:7.1f} {p['allocated_gb']:7.1f} {100 * (p['allocated_gb'] / mem - 1):+6.1f}%" if mem else \
        f"{'-':>7} {p['allocated_gb']:7.1f} {'':>7}"
    res = r.get("peak_reserved_gb")
    if "step_s" not in r:  # a memory-only point
        return f"{cfg} {mem_s} {res if res else float('nan'):7.1f} {'-':>7} {p['step_s']:7.3f}"
    return (f"{cfg} {mem_s} {res if res else float('nan'):7.1f} {r['step_s']:7.3f} {p['step_s']:7.3f} "
            f"{100 * (p['step_s'] / r['step_s'] - 1):+6.1f}%")


HEADER = (f"{'model':<14} {'L':>2} {'seq':>5} {'rc':<4} {'head':<5} {'path':<5} {'alloc':>7} {'pred':>7} "
          f"{'err':>7} {'resv':>7} {'step s':>7} {'pred':>7} {'err':>7}")


def run_grid(args) -> None:
    import torch

    from bench_train_step import _times, profile_components
    from launch.data import synthetic_long_batch
    from launch.job import peak_memory_gb
    from launch.model import build_model
    from launch.train import TrainConfig, Trainer
    from recipe.models import resolve_model

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    grid = GRIDS[args.grid]
    only = set(args.only.split(",")) if args.only else None
    data = {"hw": args.hw, "environment": environment(args), "points": [], "components": []}
    t_start = time.monotonic()
    out = Path(args.out)

    def save():
        data.update(summarize(data["points"]))
        data["environment"]["wall_s"] = round(time.monotonic() - t_start, 1)
        out.write_text(json.dumps(data, indent=1) + "\n")

    ep_meshes = None
    if any(p[3] for g in grid for p in g[2]):
        import torch.distributed as dist

        from _world_one import world_of_one

        ep_meshes = world_of_one(device.type, 29531)
    from launch.job import StackLimit

    stack = None  # read once a CUDA context exists (the first model built), before any kernel is tuned
    print(HEADER, flush=True)
    for model_name, layers, points, profile_seq in grid:
        if only and f"{model_name}:{layers}" not in only:
            continue
        shape = resolve_model(model_name).with_layers(layers)
        elapsed = time.monotonic() - t_start
        print(f"# group {model_name} × {layers} layers ({elapsed:.0f} s elapsed)", flush=True)
        model = trainer = None
        try:
            model = build_model(shape, device=device, dtype=dtype, seed=0)
        except torch.OutOfMemoryError as e:
            for rc, head, seq, ep, keep in points:
                r = {"model": model_name, "layers": layers, "seq": seq, "recompute": rc, "lm_head": head,
                     "ep_path": ep, **_grid_keys(args.grid, keep),
                     "role": role(model_name, layers, args.grid),
                     "error": f"OOM building the model: {str(e)[:120]}"}
                data["points"].append(r)
                print(_fmt_row(r), flush=True)
            save()
            continue
        if device.type == "cuda":
            torch.cuda.empty_cache()
            if stack is None:
                stack = StackLimit.of_this_process()
        current = None  # (recompute, ep_path, keep_layers) of the live trainer
        batches = {}

        def profile():
            """The step's components timed alone, once per group, on the local dispatch (before any EP point)."""
            nonlocal profile_seq
            if not (profile_seq and not args.memory_only and trainer is not None and current == ("full", False, 0)
                    and time.monotonic() - t_start < args.budget_s - 30):
                return
            try:
                if trainer.lm_head != "fused":
                    trainer.lm_head = "fused"
                batch = synthetic_long_batch(profile_seq, shape.vocab_size, device)
                model.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                comp = profile_components(trainer, batch, device)
                data["components"].append({"model": model_name, "layers": layers, "seq": profile_seq,
                                           "parts": comp})
                for name, v in comp.items():
                    print(f"  component {name:48} fwd {v['fwd_s'] * 1e3:8.2f} ms  fwd+bwd "
                          f"{v['fwd_bwd_s'] * 1e3:8.2f} ms ×{v['count']}  ≈ {v['in_step_s'] * 1e3:8.2f} ms/step",
                          flush=True)
            except (torch.OutOfMemoryError, RuntimeError) as e:
                data["components"].append({"model": model_name, "layers": layers, "seq": profile_seq,
                                           "error": str(e).splitlines()[0][:160]})
            save()
            profile_seq = 0
        for rc, head, seq, ep, keep in points:
            r = {"model": model_name, "layers": layers, "seq": seq, "recompute": rc, "lm_head": head, "ep_path": ep,
                 **_grid_keys(args.grid, keep), "role": role(model_name, layers, args.grid)}
            r["predicted"] = predict_point(r, args.hw)
            budget_left = args.budget_s - (time.monotonic() - t_start)
            if budget_left < (args.steps + 1) * r["predicted"]["step_s"] * 1.5 + 5:
                r["error"] = "skipped: out of the run's time budget"
                data["points"].append(r)
                print(_fmt_row(r), flush=True)
                save()
                continue
            if ep:
                profile()
            try:
                if current != (rc, ep, keep):
                    trainer = None
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    if ep and ep_meshes is not None:
                        from _world_one import plan_of_one

                        from launch.parallel import parallelize

                        model = parallelize(model, plan_of_one(ep_meshes[0], rc, keep), ep_meshes[1], ep_dispatch=True)
                    trainer = Trainer(model, TrainConfig(lr=1e-6), recompute=rc, keep_layers=keep, lm_head=head)
                    current = (rc, ep, keep)
                trainer.lm_head = head
                if seq not in batches:
                    batches = {seq: synthetic_long_batch(seq, shape.vocab_size, device)}
                batch = batches[seq]
                model.zero_grad(set_to_none=True)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                t0 = time.monotonic()
                trainer.step(batch)  # warm-up: compilation, autotuning, the optimizer's moments, allocator growth
                warm = time.monotonic() - t0
                if stack is not None:
                    stack.restore()  # as `recipe launch` does after its first step: tuning's stack reservation
                if warm > 10 * r["predicted"]["step_s"] + 5:
                    # the warm-up tuned kernels: one more step, so the timed ones do not start from its aftermath
                    # (a Qwen3-Next-80B-A3B point timed right after its 128 s tuning ran 10% slow, steadily)
                    trainer.step(batch)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                if args.memory_only:  # one step after the warm-up, for its peak: no time recorded
                    trainer.step(batch)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    r["warmup_s"] = round(warm, 2)
                else:
                    times = _times(lambda: trainer.step(batch), device, args.steps)
                    r.update(step_s=statistics.median(times), step_s_all=[round(t, 4) for t in times],
                             warmup_s=round(warm, 2))
                if device.type == "cuda":
                    mem = peak_memory_gb(device)  # what `recipe launch` reports: allocated, and on the device
                    r["peak_allocated_gb"] = mem["peak_mem_gb"]
                    r["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
                    r["peak_device_gb"] = mem["peak_device_gb"]
            except torch.OutOfMemoryError as e:
                # the step failed before the optimizer ran: the trainer (its masters and moments) stays
                r["error"] = "OOM: " + str(e).splitlines()[0][:160]
                if trainer is None:  # it ran out building the trainer itself
                    current = None
                model.zero_grad(set_to_none=True)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            data["points"].append(r)
            print(_fmt_row(r), flush=True)
            save()
        profile()
        trainer = model = batches = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    save()
    print(f"\nwrote {out} ({len(data['points'])} points, {time.monotonic() - t_start:.0f} s); "
          f"memory error {data['memory_error']:.3f}, time error {data['time_error']:.3f}", flush=True)
    if ep_meshes is not None:
        dist.destroy_process_group()


PEAK_KEYS = ("peak_allocated_gb", "peak_reserved_gb", "peak_device_gb")


def _point_key(r: dict) -> tuple:
    return (r["model"], r["layers"], r["seq"], r["recompute"], r["lm_head"], bool(r["ep_path"]),
            r.get("keep_layers", 0), r.get("grid", "full"))


def merge_peaks(into: str, sources: list[str]) -> None:
    """Take the peaks of `--memory-only` runs (the same points, measured again after a change that moves memory
    and not time) into a committed grid: each matching point's measured peaks are replaced and it records the
    commit they were measured at (`peak_commit`); its step time stays. Points a source did not measure (an error,
    another grid) keep theirs. The predictions and errors are then refreshed."""
    p = Path(into)
    data = json.loads(p.read_text())
    by_key = {_point_key(r): r for r in data["points"]}
    measured = []
    for src in sources:
        run = json.loads(Path(src).read_text())
        commit = run["environment"].get("commit")
        for r in run["points"]:
            q = by_key.get(_point_key(r))
            if q is None or "error" in r or not r.get("peak_allocated_gb") or "error" in q:
                continue
            measured.append((q, q.get("peak_allocated_gb"), r["peak_allocated_gb"]))
            q.update({k: r[k] for k in PEAK_KEYS if k in r}, peak_commit=commit)
        record = {"command": run["environment"].get("command"), "commit": commit,
                  "wall_s": run["environment"].get("wall_s")}
        if record not in data["environment"].setdefault("peaks", []):  # (merging the same run again)
            data["environment"]["peaks"].append(record)
    if not measured:
        raise SystemExit(f"no point of {', '.join(sources)} matches a measured point of {into}")
    for q, old, new in measured:
        print(f"{_cfg(q)}  peak {old:7.2f} -> {new:7.2f} GB ({new - old:+.2f})")
    p.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{len(measured)} of {len(data['points'])} points took new peaks; re-predicting")
    refresh(into, data.get("hw"))


def refresh(path: str, hw: str | None) -> None:
    """Recompute every point's prediction and the grid's errors with today's cost model."""
    p = Path(path)
    data = json.loads(p.read_text())
    hw = hw or data.get("hw") or p.stem
    for r in data["points"]:
        r["predicted"] = predict_point(r, hw)
    data.update(summarize(data["points"]))
    p.write_text(json.dumps(data, indent=1) + "\n")
    print(HEADER)
    for r in data["points"]:
        print(_fmt_row(r))
    print(f"memory error {data['memory_error']:.3f} (fit {data['errors']['fit']['memory']:.3f}, held out "
          f"{data['errors']['held_out']['memory']:.3f}); time error {data['time_error']:.3f} (fit "
          f"{data['errors']['fit']['time']:.3f}, held out {data['errors']['held_out']['time']:.3f})")


FIT_TERMS = ("expert_gemm", "expert_rows", "expert_weights", "dense_gemm", "dense_rows", "attention", "delta_rule",
             "lm_head", "ep_dispatch", "ep_passes", "layer_passes", "optimizer")
# efficiencies of the HBM bandwidth
HBM_TERMS = ("expert_rows", "expert_weights", "dense_rows", "optimizer", "ep_dispatch")
# The operations the grid's components time alone (bench_train_step.profile_components), by component name: their
# rates are measured directly, not fitted. Every part of the step scales with tokens × layers, so over two models
# the step times alone cannot tell the routed experts' rate from the delta rule's and the other matmuls' (a free fit
# of all of them lands on a free delta rule and experts above the peak).
ANCHORS = {"expert_gemm": "routed experts (grouped GEMMs)", "delta_rule": "delta rule (kernel only)"}


def expert_rates(path: Path) -> dict[str, float] | None:
    """The routed experts' three rates (recipe/cost.py EXPERT_TERMS: FLOP/s, and bytes/s for their rows and their
    weights) from a file of bench/bench_expert_rates.py runs: the non-negative least-squares fit of each run's
    measured seconds to its work in the three terms, each row relative to its measurement (rows marked held_out
    left out). None without the file (the experts are then anchored on the grid's components, at one FLOP rate)."""
    import numpy as np

    from recipe.cost import EXPERT_TERMS, Layout, TrainOptions, compute_work
    from recipe.models import resolve_model

    if not path.exists():
        return None
    rows = [r for r in json.loads(path.read_text())["rows"] if r.get("role") != "held_out"]
    a = np.array([[compute_work(resolve_model(r["model"]).with_layers(int(r["layers"])), Layout(),
                                TrainOptions(micro_batch_tokens=int(r["tokens"])))[k] for k in EXPERT_TERMS]
                  for r in rows])
    y = np.array([r["measured_s"] for r in rows])
    inv = _nnls(a / y[:, None], np.ones(len(y)))
    return {k: (1 / v if v else float("inf")) for k, v in zip(EXPERT_TERMS, inv)}


def _nnls(lhs, rhs):
    """Non-negative least squares (scipy's), or the unconstrained solution where scipy is missing and it is positive."""
    import numpy as np

    try:
        from scipy.optimize import nnls

        return nnls(lhs, rhs)[0]
    except ImportError:  # without scipy: the unconstrained fit, which is the non-negative one when all are > 0
        inv = np.linalg.lstsq(lhs, rhs, rcond=None)[0]
        if (inv <= 0).any():
            raise SystemExit("the unconstrained fit has a non-positive rate: install scipy for the NNLS fit")
        return inv


def _work_rows(data: dict) -> tuple[list[dict], list[dict]]:
    """(each measured point's work by operation, with the optimizer's bytes; the points themselves)."""
    from recipe.cost import (ADAM_BYTES_MOVED, Layout, TrainOptions, attention_kernel_work, compute_work,
                             kernel_width, local_param_count)
    from recipe.hw import load_profile
    from recipe.models import resolve_model

    vendor = load_profile(data.get("hw", "h200")).vendor
    rows, points = [], []
    for r in data["points"]:
        if "step_s" not in r:
            continue
        m = resolve_model(r["model"]).with_layers(int(r["layers"]))
        opts = TrainOptions(micro_batch_tokens=int(r["seq"]), recompute=r["recompute"], lm_head=r["lm_head"],
                            keep_layers=int(r.get("keep_layers", 0)))
        work = compute_work(m, Layout(), opts, ep_path=bool(r["ep_path"]))
        work["optimizer"] = local_param_count(m, 1, Layout()) * ADAM_BYTES_MOVED
        # the attention kernel's work (MLA's padded v where the platform pads it), at its head width's efficiency
        work["attention"] *= attention_kernel_work(m, vendor)
        work["attention_width"] = kernel_width(m, vendor)
        rows.append(work)
        points.append(r)
    return rows, points


def anchored_rates(data: dict) -> dict[str, float]:
    """FLOP/s of each ANCHORS operation: its work in a component's step over the time the component took in it
    (forward, recomputed forward and backward), averaged over the grid's component profiles."""
    from recipe.cost import Layout, TrainOptions, compute_work
    from recipe.models import resolve_model

    found: dict[str, list[float]] = {}
    for c in data.get("components", []):
        m = resolve_model(c["model"]).with_layers(int(c["layers"]))
        work = compute_work(m, Layout(), TrainOptions(micro_batch_tokens=int(c["seq"]), recompute="full",
                                                      lm_head="fused"))
        for op, part in ANCHORS.items():
            if part in c["parts"] and work[op]:
                found.setdefault(op, []).append(work[op] / c["parts"][part]["in_step_s"])
    return {op: sum(v) / len(v) for op, v in found.items()}


def dense_fit(rows: list[dict]):
    """The non-negative least-squares fit of each dense matmul's measured seconds (bench/bench_dense_rates.py rows,
    each relative to its measurement) to its FLOPs, its rows' bytes and a fixed time per GEMM call (three a
    matmul): (inverse rates [s/FLOP, s/byte, s/call], each row's predicted / measured − 1)."""
    import numpy as np

    a = np.array([[r["flops"], r["bytes"], 3.0] for r in rows]) / np.array([r["measured_s"] for r in rows])[:, None]
    inv = _nnls(a, np.ones(len(rows)))
    return inv, a @ inv - 1


def dense_rate(path: Path) -> float | None:
    """FLOP/s of the dense matmuls' GEMMs from bench/bench_dense_rates.py's file: `dense_fit`'s FLOP term, the GEMMs'
    own rate (the bytes and the calls the step fit's dense_rows and layer_passes carry there). None without the
    file."""
    if not path.exists():
        return None
    inv, _ = dense_fit(json.loads(path.read_text())["rows"])
    return 1 / inv[0] if inv[0] else None


def derived_widths(fitted: dict[int, float], path: Path) -> dict[int, float]:
    """Attention efficiencies at head widths no fitted point has (64: gpt-oss's and Granite's), from the full-
    attention kernels timed alone (bench/bench_attention_rates.py, `path`) without sinks: the nearest fitted width's
    efficiency times the median, over the rows at the width, of a row's FLOP rate over the nearest width's at its
    token count (rows of several models at one width each count)."""
    if not fitted or not path.exists():
        return {}
    plain = [r for r in json.loads(path.read_text())["rows"] if not r.get("sinks") and not r.get("window")]
    rate: dict[int, dict[int, float]] = {}
    for r in plain:
        rate.setdefault(r["head_dim"], {})[r["tokens"]] = r["flops"] / r["measured_s"]
    out = {}
    for width in sorted(set(rate) - set(fitted)):
        near = min(fitted, key=lambda w: (abs(w - width), w))
        ratios = [r["flops"] / r["measured_s"] / rate[near][r["tokens"]] for r in plain
                  if r["head_dim"] == width and r["tokens"] in rate.get(near, {})]
        if ratios:
            out[width] = round(fitted[near] * statistics.median(ratios), 3)
    return out


def sink_merge_bytes(path: Path, hw: str = "h200") -> dict | None:
    """SINK_MERGE_BYTES (recipe/cost.py) from full-attention layers timed alone with and without their sinks at the
    same token counts (bench/bench_attention_rates.py with and without --no-sinks, `path`): the difference of each
    pair in bytes at the profile's dense-row rate, per value of the output (query heads × head width) and pass (4 a
    layer-step, as full recompute runs it), the median over the pairs. None without such pairs."""
    from recipe.cost import rates
    from recipe.hw import load_profile

    if not path.exists():
        return None
    rows = [r for r in json.loads(path.read_text())["rows"] if not r.get("window")]
    plain = {(r["model"], r["tokens"]): r for r in rows if r.get("sinks") is False}
    rate = rates(load_profile(hw))["dense_rows"]
    per_value = [(r["measured_s"] - plain[k]["measured_s"]) * rate / (4 * r["tokens"] * r["heads"] * r["head_dim"])
                 for r in rows if r.get("sinks") and (k := (r["model"], r["tokens"])) in plain]
    if not per_value:
        return None
    return {"SINK_MERGE_BYTES": int(round(statistics.median(per_value))),
            "sink_fit_range": [round(min(per_value), 1), round(max(per_value), 1)], "sink_fit_pairs": len(per_value)}


# rows of the windowed kernels timed alone below this many tokens are left out of the window fit: at 8K the calls'
# fixed launch time (~0.9 ms a layer-step, which the step's per-layer latency carries) is a quarter of the row
WINDOW_FIT_MIN_TOKENS = 32768


def window_costs(path: Path, hw: str = "h200") -> dict | None:
    """WINDOW_KEY_COST and WINDOW_ROW_KEYS (recipe/cost.py) from the sliding layers timed alone (the window cases of
    bench/bench_attention_rates.py, `path`): each row's time in keys of the full-attention kernel at its head width
    (its measured seconds over those a key a query costs at the profile's attention rate: 4 passes of
    2·heads·(d_qk + d_v) FLOPs a token) is fitted as cost · window_keys(window) + row, by least squares of the
    relative error over the rows of at least WINDOW_FIT_MIN_TOKENS tokens. None without the file."""
    import numpy as np

    from recipe.cost import rates, window_keys
    from recipe.hw import load_profile
    from recipe.models import resolve_model

    if not path.exists():
        return None
    profile = load_profile(hw)
    xs, ys = [], []
    for r in json.loads(path.read_text())["rows"]:
        if not r.get("window") or r["tokens"] < WINDOW_FIT_MIN_TOKENS:
            continue
        m = resolve_model(r["model"])
        per_key = 4 * r["tokens"] * 2 * r["heads"] * 2 * r["head_dim"] / rates(profile, m)["attention"]
        xs.append(window_keys(r["window"]))
        ys.append(r["measured_s"] / per_key)
    if len(xs) < 2:
        return None
    y = np.array(ys)
    (cost, row), *_ = np.linalg.lstsq(np.array([[x, 1.0] for x in xs]) / y[:, None], np.ones_like(y), rcond=None)
    err = (cost * np.array(xs) + row) / y - 1
    return {"WINDOW_KEY_COST": round(float(cost), 2), "WINDOW_ROW_KEYS": int(round(row, -1)),
            "window_fit_error": round(float(np.abs(err).max()), 3), "window_fit_rows": len(xs)}


def _width(text: str) -> int | float:
    """A head width from its column name ("128", "128.0", "160.5": `kernel_width` may average two widths)."""
    w = float(text)
    return int(w) if w.is_integer() else w


def fit(path: str) -> dict:
    """The per-operation efficiencies that best reproduce the measured step times of the grid's `fit` points
    (the held-out points are left out). The operations its components time alone take their measured rates
    (anchored_rates); the step at world size 1 is linear in the other inverse rates,
    step = Σ work_op / rate_op + passes · latency + optimizer bytes / rate_opt, so a non-negative least-squares fit
    of them to the relative step times (each row divided by its measurement, less the anchored operations' share)
    finds them. Attention has one term per head width among the fitted points (the kernel's rate per FLOP differs
    with it). Prints the efficiencies in the profile's terms (fractions of the dense bf16 peak or of the HBM
    bandwidth, ms per pass) and the fitted and held-out errors they give."""
    import numpy as np

    from recipe.cost import attention_efficiency
    from recipe.hw import load_profile

    data = json.loads(Path(path).read_text())
    name = data.get("hw") or Path(path).stem
    hw = load_profile(name)
    peak, hbm = hw.peak_bf16_tflops * 1e12, hw.hbm_bw_tb_s * 1e12
    anchored = anchored_rates(data)
    experts = expert_rates(Path(path).with_name(f"{name}_experts.json"))
    dense = dense_rate(Path(path).with_name(f"{name}_dense.json"))
    if dense is not None:
        anchored["dense_gemm"] = dense
    else:  # one FLOP rate stands for the dense matmuls and what runs around them
        anchored["dense_rows"] = float("inf")
    if experts is not None:
        anchored.update(experts)
    else:  # one FLOP rate stands for the experts' whole time, their bytes not charged apart
        anchored.update(expert_rows=float("inf"), expert_weights=float("inf"))
    rows, points = _work_rows(data)
    # attention: one term per head width among the fitted points, each point's attention work in its width's column
    widths = sorted({r["attention_width"] for r, p in zip(rows, points) if p.get("role", "fit") == "fit"
                     and r["attention"]})
    for r in rows:
        r.update({f"attention@{d}": r["attention"] if r["attention_width"] == d else 0.0 for d in widths})
    free = [t for k in FIT_TERMS if k not in anchored
            for t in ([f"attention@{d}" for d in widths] if k == "attention" else [k])]
    y = np.array([r["step_s"] for r in points])
    known = np.array([sum(w[k] / rate for k, rate in anchored.items() if w[k]) for w in rows])
    a = np.array([[w[k] for k in free] for w in rows])
    fit_rows = np.array([r.get("role", "fit") == "fit" for r in points])
    lhs, rhs = a[fit_rows] / y[fit_rows, None], 1 - known[fit_rows] / y[fit_rows]
    inv = _nnls(lhs, rhs)
    eff = {k: round(min(1.0, rate / (hbm if k in HBM_TERMS else peak)), 3) for k, rate in anchored.items()
           if rate != float("inf")}
    for k, v in zip(free, inv):
        if k.endswith("_passes"):
            eff[k.replace("passes", "latency_ms")] = round(v * 1e3, 3)
        else:
            eff[k] = round(min(1.0, 1 / (v * (hbm if k in HBM_TERMS else peak))), 3) if v else 1.0
    by_width = {_width(k.split("@")[1]): eff.pop(k) for k in list(eff) if k.startswith("attention@")}
    by_width.update(derived_widths(by_width, Path(path).with_name(f"{name}_attention.json")))
    if by_width:
        eff["attention"] = by_width if len(by_width) > 1 else next(iter(by_width.values()))
    # a point whose head width has no fitted term (a held-out MLA point's mean width 160) at the efficiency the
    # profile gives that width (recipe.cost.attention_efficiency: between the two nearest), as a prediction would
    unfitted = np.array([0.0 if r["attention_width"] in widths or not r["attention"] else
                         r["attention"] / (peak * attention_efficiency(by_width, r["attention_width"])) for r in rows])
    err = (a @ inv + known + unfitted) / y - 1
    out = {"efficiency": eff, "anchored": sorted(anchored), "fit_error": float(np.abs(err[fit_rows]).max()),
           "held_out_error": float(np.abs(err[~fit_rows]).max()) if (~fit_rows).any() else None,
           "fit_points": int(fit_rows.sum()), "held_out_points": int((~fit_rows).sum()),
           "window": window_costs(Path(path).with_name(f"{name}_window.json"), name),
           "sinks": sink_merge_bytes(Path(path).with_name(f"{name}_attention.json"), name)}
    print(json.dumps(out, indent=1))
    return out


def ep_chunk_rows(path: Path) -> float | None:
    """EP_CHUNK_ROWS from a file of bench/bench_ep_path.py runs: each count above one's peak above the same run's
    one-chunk peak, in rows of h + 8 bf16 values a routed copy (tokens × top-k of Qwen3.5-35B-A3B, the bench's
    model), averaged over the counts and runs. None without the file."""
    from recipe.models import resolve_model

    if not path.exists():
        return None
    m = resolve_model("qwen35-35b")
    extra = []
    for run in json.loads(path.read_text())["runs"]:
        peaks = {r["variant"]: r["peak_allocated_gib"] * 2**30 for r in run["steps"]}
        row = run["tokens"] * m.top_k * (m.hidden_size + 8) * 2
        extra += [(v - peaks["EP path, k=1"]) / row for k, v in peaks.items()
                  if k.startswith("EP path, k=") and k != "EP path, k=1"]
    return round(sum(extra) / len(extra), 2) if extra else None


def fit_memory(path: str) -> dict:
    """The memory constants the grid measures (recipe/cost.py), printed beside the efficiencies:
    - the local points' peak-allocated error under today's model (every point but the naive head's and the EP
      path's, whose peaks the named tensors of docs/cost_model.md section 1 set, with no fitted factor);
    - `EP_HELD_ROWS`: each EP point's peak less its local twin's, in rows of h + 8 bf16 values a routed copy,
      averaged over each model's points and then over the models (the grid's EP points run one chunk);
    - `EP_CHUNK_ROWS`, where the grid has a `<hw>_ep_memory.json` beside it (bench/bench_ep_path.py runs): each
      count above one's peak less the same run's one-chunk peak, in the same rows, averaged;
    - what the device holds beyond the allocated peak (`peak_device_gb` less `peak_allocated_gb`, on grids that
      record it), least and most over the points, to read beside the profile's `overhead_gb`: an upper bound on what
      a run needs there, as with memory to spare the allocator keeps freed blocks cached (the reserved peak runs
      up to 16 GB above the allocated one on the H200 grid)."""
    from recipe.models import resolve_model

    data = json.loads(Path(path).read_text())
    hw = data.get("hw") or Path(path).stem
    pts = [r for r in data["points"] if r.get("peak_allocated_gb") and "error" not in r]
    local = [r for r in pts if r["lm_head"] != "naive" and not r["ep_path"]]
    errs = [predict_point(r, hw)["allocated_gb"] / r["peak_allocated_gb"] - 1 for r in local]
    twins = {(r["model"], r["layers"], r["seq"]): r for r in local
             if r["recompute"] == "full" and r["lm_head"] == "fused" and not r.get("grid")}
    rows: dict[str, list[float]] = {}
    for r in pts:
        q = twins.get((r["model"], r["layers"], r["seq"]))
        if not r["ep_path"] or r.get("grid") or q is None or r["peak_allocated_gb"] <= q["peak_allocated_gb"]:
            # an EP point whose peak the MoE backward does not set (short sequences) measures nothing, and a held-out
            # grid's (other recompute settings) has no full-recompute twin in its own run
            continue
        m = resolve_model(r["model"])
        row = r["seq"] * m.top_k * (m.hidden_size + 8) * 2 / 1e9
        rows.setdefault(r["model"], []).append((r["peak_allocated_gb"] - q["peak_allocated_gb"]) / row)
    means = [sum(v) / len(v) for v in rows.values()]
    outside = [r["peak_device_gb"] - r["peak_allocated_gb"] for r in pts if r.get("peak_device_gb")]
    out = {"local_error": [round(min(errs), 4), round(max(errs), 4)],
           "ep_rows_at_one_chunk": {k: [round(x, 2) for x in v] for k, v in rows.items()},
           "EP_HELD_ROWS": round(sum(means) / len(means), 2) if means else None,
           "EP_CHUNK_ROWS": ep_chunk_rows(Path(path).with_name(f"{hw}_ep_memory.json")),
           # beside the profile's overhead_gb: an upper bound on what a run needs beyond its allocated peak
           "device_beyond_allocated_gb": [round(min(outside), 2), round(max(outside), 2)] if outside else None}
    print(json.dumps(out, indent=1))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", choices=sorted(GRIDS), default="full")
    p.add_argument("--only", help="comma-separated model:layers groups to run (default: all)")
    p.add_argument("--hw", help="the hardware profile the predictions are made for (default: h200, or the grid's)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per point after one warm-up")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip points that would end past this many seconds")
    p.add_argument("--device", default=None)
    p.add_argument("--commit", help="the commit measured (default: git rev-parse of this checkout)")
    p.add_argument("--out", default="calibration.json")
    p.add_argument("--refresh", metavar="JSON", help="re-predict a committed grid with today's cost model (CPU)")
    p.add_argument("--fit", metavar="JSON", help="fit the per-operation efficiencies to a grid's fit points (CPU)")
    p.add_argument("--memory-only", action="store_true",
                   help="one step after the warm-up per point, for its peak memory only (no step time)")
    p.add_argument("--merge-peaks", nargs="+", metavar="JSON",
                   help="GRID RUN...: take the peaks of --memory-only runs into a committed grid (CPU)")
    args = p.parse_args()
    if args.merge_peaks:
        if len(args.merge_peaks) < 2:
            p.error("--merge-peaks takes the committed grid, then one or more --memory-only runs")
        return merge_peaks(args.merge_peaks[0], args.merge_peaks[1:])
    if args.fit:
        fit(args.fit)
        fit_memory(args.fit)
        return
    if args.refresh:
        return refresh(args.refresh, args.hw)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.hw = args.hw or "h200"
    run_grid(args)


if __name__ == "__main__":
    main()
