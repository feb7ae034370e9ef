"""Bench: the fused Gated DeltaNet elementwise kernels (kernels.gdn_fused) and the plain RMSNorm on the same kernels
(kernels.rms_norm) against the torch path, one GPU.

Ops (the shapes of qwen35-35b's layers):
  conv -- causal_conv1d_silu(x [T, C], weight [C, 4], positions [T]), C = 8192 (2 x 2048 keys + 4096 values);
  norm -- gated_rms_norm(x, gate [T*32, 128], weight [128]), 32 value heads of dim 128;
  rmsnorm -- rms_norm(x [T, 2048], weight [2048], offset 1), a layer's input norm (Qwen3.5's 1 + w), and
             rms_norm(x [T*32, 128], weight [128]), per-head q norms (Qwen3-MoE's w order).
Modes: fwd (inputs require grad, as in training: the torch path saves what its backward needs) and fwd+bwd
(backward of the output against a fixed random upstream gradient). Inputs are bf16, four packed documents.
Columns: median ms over --reps timed runs (CUDA events, after --warmup untimed runs that also compile the Triton
kernels); torch/triton ratio; the HBM floor (bytes the op must move at --bw TB/s: conv fwd reads x and writes y,
its backward reads x and dy and writes dx; norm fwd reads x, gate and writes y, its backward reads x, gate, dy and
writes dx, dgate; the plain norm reads x and writes y, then reads x, dy and writes dx); peak memory above the inputs during one fwd+bwd; relative error of the Triton outputs against
the torch path (a sanity check, not an accuracy figure: the torch path rounds its intermediates to bf16).
docs/training.md ("Fused conv and gated norm") predicts these numbers.

Usage: python bench/bench_gdn_fused.py [--tokens 32768 65536] [--channels 8192] [--heads 32] [--head-dim 128]
                                       [--hidden 2048] [--reps 20] [--warmup 3] [--bw 4.3] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rates_common import event_ms  # noqa: E402
from kernels.gdn_fused import causal_conv1d_silu, gated_rms_norm  # noqa: E402
from kernels.rms_norm import rms_norm  # noqa: E402

MIB = 2**20


def _peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / MIB


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_op(name, fn, inputs, args, dy, fwd_bytes, bwd_bytes, reps, warmup, bw):
    leaves = [x.detach().requires_grad_() for x in inputs]
    rows, outs = [], {}
    for backend in ("torch", "triton"):
        def fwd():
            return fn(*leaves, *args, backend=backend)

        def fwd_bwd():
            for x in leaves:
                x.grad = None
            fwd().backward(dy)

        t_fwd = event_ms(fwd, reps, warmup)
        t_all = event_ms(fwd_bwd, reps, warmup)
        peak = _peak_mib(fwd_bwd)
        outs[backend] = [fwd().detach()] + [x.grad.clone() for x in leaves]
        rows.append(dict(op=name, backend=backend, fwd_ms=t_fwd, fwd_bwd_ms=t_all, peak_mib=peak))
    errs = [_rel(a, b) for a, b in zip(outs["triton"], outs["torch"])]
    floor_fwd, floor_all = fwd_bytes / (bw * 1e9), (fwd_bytes + bwd_bytes) / (bw * 1e9)  # ms
    for r in rows:
        r.update(floor_fwd_ms=floor_fwd, floor_fwd_bwd_ms=floor_all, max_rel_err_vs_torch=max(errs))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536])
    ap.add_argument("--channels", type=int, default=8192)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048, help="the hidden-size norm's width")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--bw", type=float, default=4.3, help="achievable HBM bandwidth, TB/s (H200 copy: ~4.3)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gdn_fused: needs a CUDA/ROCm GPU")
    dev, bf16 = "cuda", torch.bfloat16
    results = []
    for T in a.tokens:
        g = torch.Generator(device=dev).manual_seed(T)
        lengths = [T // 2, T // 4, T // 8, T - T // 2 - T // 4 - T // 8]
        pos = torch.cat([torch.arange(n, device=dev) for n in lengths])
        C, W = a.channels, a.width
        x = torch.randn(T, C, device=dev, generator=g).to(bf16)
        w = (torch.randn(C, W, device=dev, generator=g) * 0.5).to(bf16)
        dy = torch.randn(T, C, device=dev, generator=g).to(bf16)
        e = T * C * 2
        results += bench_op(f"conv T={T} C={C}", causal_conv1d_silu, [x, w], (pos,), dy, 2 * e, 3 * e, a.reps,
                            a.warmup, a.bw)
        del x, dy
        R, D = T * a.heads, a.head_dim
        xn = (torch.randn(T, a.heads, D, device=dev, generator=g) * 2).to(bf16)
        gate = torch.randn(T, a.heads, D, device=dev, generator=g).to(bf16)
        wn = (1 + 0.2 * torch.randn(D, device=dev, generator=g)).to(bf16)
        dyn = torch.randn(T, a.heads, D, device=dev, generator=g).to(bf16)
        e = R * D * 2
        results += bench_op(f"norm R={R} D={D}", gated_rms_norm, [xn, gate, wn], (1e-6,), dyn, 3 * e, 5 * e,
                            a.reps, a.warmup, a.bw)
        del gate
        results += bench_op(f"rmsnorm R={R} D={D}", rms_norm, [xn, wn], (1e-6, 0.0), dyn, 2 * e, 3 * e, a.reps,
                            a.warmup, a.bw)
        del xn, dyn
        H = a.hidden
        xh = (torch.randn(T, H, device=dev, generator=g) * 2).to(bf16)
        wh = (0.2 * torch.randn(H, device=dev, generator=g)).to(bf16)
        dyh = torch.randn(T, H, device=dev, generator=g).to(bf16)
        e = T * H * 2
        results += bench_op(f"rmsnorm T={T} D={H} 1+w", rms_norm, [xh, wh], (1e-6, 1.0), dyh, 2 * e, 3 * e, a.reps,
                            a.warmup, a.bw)
        del xh, dyh
        torch.cuda.empty_cache()

    print(f"{torch.cuda.get_device_name()}, bf16, median of {a.reps}; floor = HBM bytes / {a.bw} TB/s")
    hdr = (f"{'op':<30}{'backend':<8}{'fwd ms':>9}{'x':>7}{'floor':>8}{'fwd+bwd ms':>12}{'x':>7}{'floor':>8}"
           f"{'peak MiB':>10}{'err':>10}")
    print(hdr)
    print("-" * len(hdr))
    for i in range(0, len(results), 2):
        base = results[i]
        for r in results[i:i + 2]:
            print(f"{r['op']:<30}{r['backend']:<8}{r['fwd_ms']:>9.3f}{base['fwd_ms'] / r['fwd_ms']:>7.2f}"
                  f"{r['floor_fwd_ms']:>8.3f}{r['fwd_bwd_ms']:>12.3f}{base['fwd_bwd_ms'] / r['fwd_bwd_ms']:>7.2f}"
                  f"{r['floor_fwd_bwd_ms']:>8.3f}{r['peak_mib']:>10.0f}{r['max_rel_err_vs_torch']:>10.1e}")
    print("x: speed-up over the torch path (torch ms / this row's ms)")
    if a.out:
        a.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), args=vars(a) | {"out": str(a.out)},
                                         results=results), indent=1))


if __name__ == "__main__":
    main()
