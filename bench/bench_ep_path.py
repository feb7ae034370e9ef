"""The expert-parallel code path at world size 1: the same model and step with the local token dispatch and with
launch/expert_parallel.py's chunked dispatch (k = 1, 2, 4), its step time against the local path's as a ratio, and a
torch profiler trace of one step whose kernels are summed by stream: where the all-to-alls ran, where the expert GEMMs
ran, and how much of the all-to-all time overlaps compute.

At world size 1 each all-to-all is a copy to self (NCCL's send/recv kernel, or a memcpy), so the trace shows the
schedule — which stream, in which order, what waits on what — but not the cost of a real exchange over NVLink; the
multi-GPU runs measure that.

    python bench/bench_ep_path.py --seq 32768 --chunks 1,2,4 --trace ep_trace.json
    python bench/bench_ep_path.py --model tiny-moe --seq 512 --device cpu --steps 1   # smoke (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_train_step import _sync, _time  # noqa: E402

# the EP path against the local one on the same weights: bf16 rounding moves the gradient norm by ~1e-4
PARITY_TOL = 1e-3


def install(experts: list, dispatch) -> None:
    """Every MoE layer's token dispatch (None: the local one)."""
    for ex in experts:
        ex.token_dispatch = dispatch


def chunked_dispatchers(experts: list, chunks: list[int]) -> dict:
    """k -> an ExpertParallel dispatch with k chunks on the group and communication stream that parallelize gave
    the first layer (one dispatch object serves every layer: it holds no per-layer state)."""
    first = experts[0].token_dispatch
    return {k: type(first)(first.group, first.num_experts, k, first.comm_stream) for k in chunks}


def check_parity(trainer, batches: list, experts: list, variants: list, echo: bool = True) -> tuple[dict, list[str]]:
    """Loss and gradient norm of one forward and backward of the step `batches` (the same list on every rank) on
    the same weights for each (name, token dispatch) of `variants` (installed in `experts`), each against the
    first; prints a line each where `echo`. Returns ({name: (loss, grad norm)}, the names off the first by more
    than PARITY_TOL). Gradients are zeroed after."""
    parity = {}
    for name, dispatch in variants:
        install(experts, dispatch)
        trainer.optimizer.zero_grad()
        m = trainer.forward_backward(batches)
        parity[name] = (m["loss"], float(trainer.optimizer.grad_norm()))
    trainer.optimizer.zero_grad()
    off = []
    first = variants[0][0]
    loss0, gn0 = parity[first]
    for name, (loss, gn) in parity.items():
        rl, rg = abs(loss - loss0) / abs(loss0), abs(gn - gn0) / gn0
        if echo:
            print(f"parity {name}: loss {loss:.6f} grad norm {gn:.6f} (rel. to {first}: loss {rl:.2e}, grad norm "
                  f"{rg:.2e})", flush=True)
        if max(rl, rg) > PARITY_TOL:
            off.append(name)
    return parity, off


def _category(name: str) -> str:
    n = name.lower()
    if "nccl" in n or "sendrecv" in n:
        return "all-to-all"
    if any(k in n for k in ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas")):
        return "gemm"
    if any(k in n for k in ("sdpa", "flash", "fmha")):
        return "attention"
    if any(k in n for k in ("index", "gather", "scatter")):
        return "index/gather"
    if any(k in n for k in ("copy", "cat")):
        return "copy/cat"
    if "triton" in n or n.startswith("_"):
        return "triton"
    if "elementwise" in n or "reduce" in n or "multi_tensor" in n:
        return "elementwise/reduce"
    return "other"


def stream_summary(prof) -> dict:
    """Kernel time per stream, the all-to-all kernels' streams, and the share of all-to-all time during which a
    kernel on another stream runs."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_category: dict[str, float] = {}
    for e in kernels:
        by_category[_category(e.name)] = by_category.get(_category(e.name), 0.0) + e.device_time / 1e3
    by_stream: dict[str, dict] = {}
    comm, compute = [], []
    for e in kernels:
        stream = getattr(e, "device_resource_id", None)
        s = by_stream.setdefault(str(stream), {"kernels": 0, "time_ms": 0.0, "comm_ms": 0.0, "gemm_ms": 0.0})
        dur = e.device_time / 1e3
        start = e.time_range.start
        s["kernels"] += 1
        s["time_ms"] += dur
        name = e.name.lower()
        if "nccl" in name or "sendrecv" in name:
            s["comm_ms"] += dur
            comm.append((start, start + dur * 1e3, stream))
        else:
            if "gemm" in name or "grouped" in name or "cutlass" in name or "sm90" in name:
                s["gemm_ms"] += dur
            compute.append((start, start + dur * 1e3, stream))
    overlapped = 0.0
    total = sum(b - a for a, b, _ in comm)
    compute.sort()
    for a, b, st in comm:
        covered, cursor = 0.0, a
        for c0, c1, cs in compute:
            if c1 <= cursor or cs == st:
                continue
            if c0 >= b:
                break
            lo, hi = max(c0, cursor), min(c1, b)
            if hi > lo:
                covered += hi - lo
                cursor = hi
        overlapped += covered
    return {"streams": by_stream, "kernel_ms_by_category": {k: round(v, 2) for k, v in sorted(by_category.items())},
            "all_to_all_ms": total / 1e3,
            "all_to_all_overlapped_share": overlapped / total if total else None}


def chunk_cost_ms(results: list[dict], chunks: list[int], moe_layers: int, passes: int) -> float | None:
    """The EP path's fixed time per MoE layer, pass and chunk beyond the first: the least-squares slope of the step
    time over the chunk count (results[1:] are the EP rows, in `chunks` order), over the layer-passes. None with
    fewer than two counts."""
    if len(set(chunks)) < 2:
        return None
    ts = [r["step_s"] for r in results[1:]]
    mk, mt = sum(chunks) / len(chunks), sum(ts) / len(ts)
    slope = sum((k - mk) * (t - mt) for k, t in zip(chunks, ts)) / sum((k - mk) ** 2 for k in chunks)
    return slope * 1e3 / (moe_layers * passes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen35-35b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--chunks", default="1,2,4")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--trace", help="write the profiler traces of one local step and one EP step (largest k) here "
                                   "(FILE: FILE.local.json and FILE.ep.json)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()

    from launch.data import synthetic_long_batch
    from launch.job import build_parallel_model
    from launch.parallel import build_meshes, init_distributed, moe_layers
    from launch.train import TrainConfig, Trainer
    from recipe.models import resolve_model

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    init_distributed(device.type)
    shape = resolve_model(args.model).with_layers(args.layers)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    chunks = [int(c) for c in args.chunks.split(",")]
    import types

    layout = types.SimpleNamespace(pp=1, tp=1, cp=1, ep=1, dp=1, etp=1, edp=1, world=1)
    plan = types.SimpleNamespace(layout=layout, train=types.SimpleNamespace(recompute="full",
                                                                            ep_overlap_chunks=chunks[0]))
    model = build_parallel_model(shape, plan, build_meshes(layout, device.type), device, dtype, seed=0,
                                 ep_dispatch=True)
    experts = moe_layers(model)
    dispatchers = chunked_dispatchers(experts, chunks)
    trainer = Trainer(model, TrainConfig(lr=1e-6), recompute="full", lm_head="fused")
    batch = synthetic_long_batch(args.seq, shape.vocab_size, device)

    # parity first, on the same weights: loss and gradient norm of the local path against each k
    parity, off = check_parity(trainer, [batch], experts,
                               [("local", None)] + [(f"k={k}", dispatchers[k]) for k in chunks])
    results = []
    variants = [("local dispatch", None)] + [(f"EP path, k={k}", dispatchers[k]) for k in chunks]
    for name, dispatch in variants:
        install(experts, dispatch)
        trainer.step(batch)  # warm-up
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = _time(lambda: trainer.step(batch), device, args.steps)
        row = {"variant": name, "tokens": args.seq, "step_s": t}
        if device.type == "cuda":
            row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        results.append(row)
        print(json.dumps(row), flush=True)
    base = results[0]["step_s"]
    print(f"\n{shape.name} ({args.layers} layers), {args.seq:,} tokens, {device.type}")
    print(f"{'variant':<18} {'step (s)':>9} {'÷ local':>8} {'peak GiB':>9}")
    for r in results:
        print(f"{r['variant']:<18} {r['step_s']:>9.3f} {r['step_s'] / base:>8.3f} "
              f"{r.get('peak_allocated_gib', float('nan')):>9.1f}")
    per_chunk = chunk_cost_ms(results, chunks, len(experts), passes=3)
    if per_chunk is not None:
        print(f"each chunk beyond the first: {per_chunk:.3f} ms a MoE layer and pass (least-squares slope of the step "
              f"over k, {len(experts)} MoE layers, 3 passes: forward, recomputed forward, backward)")
    summary = {}
    if args.trace and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        for tag, dispatch in (("local", None), ("ep", dispatchers[chunks[-1]])):
            install(experts, dispatch)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                trainer.step(batch)
                _sync(device)
            prof.export_chrome_trace(f"{args.trace}.{tag}.json")
            summary[tag] = stream_summary(prof)
        print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"results": results, "parity": parity, "trace_summary": summary,
                                              "chunk_ms": per_chunk, "moe_layers": len(experts),
                                              "device": torch.cuda.get_device_name() if device.type == "cuda"
                                              else "cpu", "torch": torch.__version__}, indent=1))
    dist.destroy_process_group()
    if off:
        raise SystemExit(f"parity FAILED: {', '.join(off)} off the local path by more than {PARITY_TOL:g} "
                         f"(loss or gradient norm); the timings above are of a wrong computation")


if __name__ == "__main__":
    main()
