"""Bench: fused LM head (kernels.linear_cross_entropy / linear_logprobs) against its peers, one process, one GPU.

Peers: torch naive (bf16 logits + fp32 CE), torch.compile of the same, Liger-Kernel fused linear CE (Triton), its
CuTe-DSL Hopper kernels (`liger 0.8.5 cutedsl flce-sm90`, mean CE; `... scaled-ce`, all modes), Cut Cross-Entropy
(default settings), QuACK's linear CE (scaled-exp and base pipelines; mean CE only), and, only when named in
--methods, Liger's native CUTLASS + NVSHMEM kernels (`liger-cute 0.8.5`, bench/_liger_cute.py). Modes:
  ce  -- mean cross-entropy, forward + backward;
  rl  -- per-token log-probs, backward of sum(logp * advantage) with random per-token advantages (exact
         per-token gradients, what a PPO/GRPO loss needs). Ours hands that per-token loss to the head
         (kernels.linear_policy_loss, three GEMMs); "ours, autograd 4-GEMM" is linear_logprobs + autograd, as the
         peers run it (ce: reduction "none", then the mean); "ours, lean" the lean head (mode="lean", four GEMMs);
  fwd -- per-token log-probs, forward only under no_grad (rollout scoring).
Columns: median time over --reps timed runs (CUDA events, after a warm-up and a memory run); TF/s of model FLOPs
(2*T*V*H per logits-sized GEMM: 3 for fwd+bwd, 1 for fwd, whatever a method recomputes); peak memory above the
inputs (max_memory_allocated during one run minus what was allocated before it, grads included); relative
errors (L2 norm of the difference over the norm) against an fp32 reference from the same bf16 inputs
(materialized fp32 logits in token chunks, TF32 off), at the largest T only.

Usage: python bench/bench_lm_head.py [--tokens 65536 16384] [--vocab 248320 151936] [--hidden 2048] [--out f]
A tiny run on CPU (the torch backend; wall-clock times, no memory figures) checks the script itself:
    python bench/bench_lm_head.py --device cpu --tokens 64 --vocab 300 --hidden 32 --reps 1
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
import kernels.lm_head.fused  # noqa: E402
from bench._lm_head_common import liger_cutedsl_peers, quack_peers  # noqa: E402

GIB = 2**30


def fp32_reference(h, w, t, adv, chunk=8192):
    """CE (mean) and per-token log-probs with gradients, fp32 from the bf16 inputs, logits in token chunks."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    T = h.shape[0]
    w32 = w.float()
    dW_ce = torch.zeros_like(w32)
    dW_rl = torch.zeros_like(w32)
    dH_ce = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    dH_rl = torch.empty_like(dH_ce)
    logp = torch.empty(T, dtype=torch.float32, device=h.device)
    for t0 in range(0, T, chunk):
        h32 = h[t0:t0 + chunk].float()
        tc = t[t0:t0 + chunk]
        z = h32 @ w32.T
        lse = torch.logsumexp(z, 1)
        logp[t0:t0 + chunk] = z.gather(1, tc[:, None])[:, 0] - lse
        p = z.sub_(lse[:, None]).exp_()  # softmax in place
        p[torch.arange(len(tc), device=h.device), tc] -= 1.0  # p - onehot = dCE/dz per token
        dH_ce[t0:t0 + chunk] = (p @ w32) / T
        dW_ce.addmm_(p.T, h32, alpha=1.0 / T)
        p.mul_(-adv[t0:t0 + chunk, None])  # d(sum logp * adv)/dz = adv * (onehot - p)
        dH_rl[t0:t0 + chunk] = p @ w32
        dW_rl.addmm_(p.T, h32)
        del z, p
    torch.backends.cuda.matmul.allow_tf32 = prev
    loss = -logp.mean()
    return dict(ce=(loss, dH_ce, dW_ce), rl=(logp, dH_rl, dW_rl), fwd=(logp, None, None))


def _rel(x, ref):
    if x is None or ref is None:
        return float("nan")
    x, ref = x.float(), ref.float()
    return ((x - ref).norm() / ref.norm()).item()


def make_methods(modes_wanted, names=None):
    """name -> {mode: fn(h, w, t, adv) -> (out, needs_backward_scalar)}. `names`: the methods asked for (None: all
    but those that must be named, Liger's native kernels)."""
    methods = {}

    def ours_ce(h, w, t, adv):
        return kernels.linear_cross_entropy(h, w, t)

    def ours_rl(h, w, t, adv):
        # the fused policy loss: the per-token loss (here logp * advantage) is handed to the head, which then
        # needs three logits-sized GEMMs instead of four
        loss, lp, _ = kernels.linear_policy_loss(h, w, t, lambda lp, ent, t0, t1: lp * adv[t0:t1])
        return lp, loss

    def generic_rl(h, w, t, adv):
        lp = kernels.linear_logprobs(h, w, t)
        return lp, (lp * adv).sum()

    methods["ours"] = {"ce": ours_ce, "rl": ours_rl, "fwd": lambda h, w, t, adv: kernels.linear_logprobs(h, w, t)}
    methods["ours, autograd 4-GEMM"] = {  # (the bench's targets are never ignored: the mean is over all T)
        "ce": lambda h, w, t, adv: kernels.linear_cross_entropy(h, w, t, reduction="none").mean(), "rl": generic_rl}

    def lean_rl(h, w, t, adv):
        loss, lp, _ = kernels.linear_policy_loss(h, w, t, lambda lp, ent, t0, t1: lp * adv[t0:t1], mode="lean")
        return lp, loss

    # the lean head: nothing beside dH and dW but a few MiB (kernels/lm_head/lean.py), four logits-sized GEMMs
    methods["ours, lean"] = {"ce": lambda h, w, t, adv: kernels.linear_cross_entropy(h, w, t, mode="lean"),
                             "rl": lean_rl}

    def naive_ce(h, w, t):
        return F.cross_entropy((h @ w.T).float(), t)

    methods["torch naive"] = {"ce": lambda h, w, t, adv: naive_ce(h, w, t)}
    comp_ce = torch.compile(naive_ce)
    methods["torch.compile"] = {"ce": lambda h, w, t, adv: comp_ce(h, w, t)}
    if not torch.cuda.is_available():
        return methods

    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger_mean = LigerFusedLinearCrossEntropyLoss(reduction="mean")
        liger_none = LigerFusedLinearCrossEntropyLoss(reduction="none")

        def liger_rl(h, w, t, adv):
            lp = -liger_none(w, h, t)
            return lp, (lp * adv).sum()

        methods["liger 0.8.5"] = {"ce": lambda h, w, t, adv: liger_mean(w, h, t), "rl": liger_rl,
                                  "fwd": lambda h, w, t, adv: -liger_none(w, h, t)}
    except ImportError as e:
        print(f"liger-kernel not importable: {e}", flush=True)
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        def cce_rl(h, w, t, adv):
            lp = -cce(h, w, t, reduction="none")
            return lp, (lp * adv).sum()

        methods["cce 25.1.1"] = {"ce": lambda h, w, t, adv: cce(h, w, t), "rl": cce_rl,
                                 "fwd": lambda h, w, t, adv: -cce(h, w, t, reduction="none")}
    except ImportError as e:
        print(f"cut-cross-entropy not importable: {e}", flush=True)
    for name, fn in quack_peers().items():  # mean CE only: QuACK has no per-token log-prob output
        methods[name] = {"ce": lambda h, w, t, adv, fn=fn: fn(h, w, t)}
    methods.update(liger_cutedsl_peers())
    if any(n.startswith("liger-cute") for n in names or ()):  # only when named: its setup reserves ~2.6 GiB
        from bench._liger_cute import liger_cute_peers

        for name, fn in liger_cute_peers().items():
            methods[name] = {"ce": lambda h, w, t, adv, fn=fn: fn(h, w, t)}
    return {name: {m: f for m, f in fns.items() if m in modes_wanted} for name, fns in methods.items()}


def run_once(fn, h, w, t, adv, mode):
    h.grad = w.grad = None
    if mode == "fwd":
        with torch.no_grad():
            return fn(h.detach(), w.detach(), t, adv), None, None
    out = fn(h, w, t, adv)
    if isinstance(out, tuple):
        out, scalar = out
    else:
        scalar = out
    scalar.backward()
    return out.detach(), h.grad, w.grad


def measure(fn, h, w, t, adv, mode, reps):
    run_once(fn, h, w, t, adv, mode)  # warm-up: compilation, autotuning, cuBLAS handles
    h.grad = w.grad = None
    if not h.is_cuda:  # the CPU check of the script: wall-clock times, no memory figure
        out, dh, dw = run_once(fn, h, w, t, adv, mode)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run_once(fn, h, w, t, adv, mode)
            times.append(1e3 * (time.perf_counter() - t0))
        return out, dh, dw, float("nan"), times
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, dh, dw = run_once(fn, h, w, t, adv, mode)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / GIB
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        h.grad = w.grad = None
        start.record()
        run_once(fn, h, w, t, adv, mode)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return out, dh, dw, peak, times


def _time_ms(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def profile_ours(h, w, t):
    """Where our time goes: each step of the fused path (three GEMMs) timed alone on one group and scaled to the
    whole T; and the autograd path's forward (forward-only log-probs)."""
    from kernels.lm_head import fused, triton_backend as kt
    from kernels.lm_head.numerics import Coefficients, gemm_acc
    from kernels.lm_head.tiles import logits_tile_config

    T, H = h.shape
    V = w.shape[0]
    a = torch.randn(8192, 8192, device=h.device, dtype=torch.bfloat16)
    ceiling = 2 * 8192**3 / _time_ms(lambda: a @ a) / 1e9
    del a
    tgt = t.long()
    hd, wd = h.detach(), w.detach()
    gemm = 2 * T * V * H / 1e9
    line = f"# profile T={T} V={V}: cuBLAS 8192^3 bf16 {ceiling:.0f} TF/s"
    with torch.no_grad():
        ms = _time_ms(lambda: kernels.linear_logprobs(hd, wd, tgt), reps=3)
        line += f" | autograd path's forward {ms:.1f} ms ({gemm / ms:.0f} TF/s)"
        Tg = fused.group_size(T, V, None, 2)
        ng = T / Tg
        f32 = dict(device=h.device, dtype=torch.float32)
        e = torch.empty(Tg, V, device=h.device, dtype=torch.float16)
        ms_z = _time_ms(lambda: kt.logits_tiles(hd[:Tg], wd, tgt[:Tg], 1.0, False, e)) * ng
        tiles = kt.logits_tiles(hd[:Tg], wd, tgt[:Tg], 1.0, False, e)
        a = torch.full((Tg,), 1.0 / T, **f32)
        coef = Coefficients(tiles.lse2, a, None, -a)
        one = torch.ones((), **f32)
        # in place, repeated: after the first run e holds dlogits, so later runs read small values (same bytes)
        ms_dz = _time_ms(lambda: kt.dlogits_from_tiles(e, tiles, tgt[:Tg], tiles.lse2, coef, 1.0, one)) * ng
        e.normal_()
        w16, h16 = wd.half(), hd[:Tg].half()
        out = torch.zeros(Tg, H, **f32)
        ms_dh = _time_ms(lambda: gemm_acc(out, e, w16, first=False)) * ng
        acc = torch.zeros(V, H, **f32)
        ms_dw = _time_ms(lambda: gemm_acc(acc, e.T, h16, first=False, alpha=0.5)) * ng
        del e, w16, acc
        total = ms_z + ms_dz + ms_dh + ms_dw
        line += (f" | fused [Tg={Tg}]: logits GEMM + tile stats {ms_z:.1f} ms ({gemm / ms_z:.0f} TF/s), dz stream "
                 f"{ms_dz:.1f} ms ({T * V * 4 / ms_dz / 1e9:.2f} TB/s), dH GEMM {ms_dh:.1f} ms ({gemm / ms_dh:.0f} "
                 f"TF/s), dW GEMM {ms_dw:.1f} ms ({gemm / ms_dw:.0f} TF/s); sum {total:.1f} ms")
    line += f" | tiles {logits_tile_config(kt._VENDOR, 2)}"
    print(line, flush=True)


def trace_method(name, ce, h, w, t, adv, chrome_path=None):
    """torch.profiler's table of one mean-CE forward + backward of a method (after a warm-up): every kernel's total
    time; and the GPU's idle time between kernels, the largest gaps with the kernels around them (chrome trace to
    chrome_path when given)."""
    from torch.profiler import ProfilerActivity, profile

    def sync():
        if h.is_cuda:
            torch.cuda.synchronize()

    def once():
        h.grad = w.grad = None
        ce(h, w, t, adv).backward()

    once()
    sync()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * h.is_cuda) as prof:
        once()
        sync()
    print(f"# trace {name} T={h.shape[0]} V={w.shape[0]}", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60), flush=True)
    kern = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA)
    if kern:
        busy, gaps, end = 0.0, [], kern[0][0]
        prev = ""
        for s0, s1, name in kern:
            if s0 > end:
                gaps.append((s0 - end, prev[:50], name[:50]))
            busy += max(0.0, s1 - max(s0, end))
            end = max(end, s1)
            prev = name
        span = end - kern[0][0]
        print(f"# GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle {(span - busy) / 1e3:.1f} ms in "
              f"{len(gaps)} gaps; largest:", flush=True)
        for g, a, b in sorted(gaps, reverse=True)[:12]:
            print(f"#   {g / 1e3:.2f} ms after {a} before {b}", flush=True)
    if chrome_path:
        prof.export_chrome_trace(chrome_path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[65536, 16384])
    ap.add_argument("--vocab", type=int, nargs="+", default=[248320, 151936])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--modes", nargs="+", default=["ce", "rl", "fwd"])
    ap.add_argument("--methods", nargs="+", default=None, help="subset of method names (default: all)")
    ap.add_argument("--logit-std", type=float, default=2.0, help="std of the logits the random weights give")
    ap.add_argument("--out", type=str, default=None, help="append one JSON line per measurement here")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-step breakdown of our time")
    ap.add_argument("--scratch-gib", type=float, default=None,
                    help="the fused path's group buffer (kernels.lm_head.fused.SCRATCH_BYTES), GiB")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a tiny check of the script itself")
    ap.add_argument("--trace", action="store_true",
                    help="only print torch.profiler's kernel table and GPU idle gaps for one mean-CE run of each method "
                         "(--methods, default ours) per shape")
    ap.add_argument("--chrome-trace", type=str, default=None, help="with --trace: write the chrome trace here")
    args = ap.parse_args(argv)

    if args.scratch_gib:
        kernels.lm_head.fused.SCRATCH_BYTES = int(args.scratch_gib * 2**30)
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"# {name} | torch {torch.__version__} | triton {__import__('triton').__version__}", flush=True)
    methods = make_methods(set(args.modes), args.methods)
    if args.methods:
        methods = {k: v for k, v in methods.items() if k in args.methods}
    rows = []
    H = args.hidden
    for T in sorted(args.tokens, reverse=True):  # the largest T first: a cut-short run still has it
        for V in args.vocab:
            g = torch.Generator(device=dev).manual_seed(T * 7 + V)
            h = torch.randn(T, H, device=dev, generator=g).bfloat16().requires_grad_()
            w = (torch.randn(V, H, device=dev, generator=g) * (args.logit_std / math.sqrt(H))).bfloat16()
            w.requires_grad_()
            t = torch.randint(0, V, (T,), device=dev, generator=g)
            adv = torch.randn(T, device=dev, generator=g)
            ref = None
            if args.trace:
                for name in (args.methods or ["ours"]):
                    if "ce" in methods.get(name, {}):
                        path = args.chrome_trace and f"{args.chrome_trace}.{T}.{V}.{name.replace(' ', '_')}.json"
                        trace_method(name, methods[name]["ce"], h, w, t, adv, path)
                continue
            if "ours" in methods and not args.no_profile and dev.type == "cuda":
                profile_ours(h, w, t)
            if T == max(args.tokens):
                t0 = time.time()
                ref = fp32_reference(h.detach(), w.detach(), t, adv)
                print(f"# fp32 reference T={T} V={V}: {time.time() - t0:.1f} s", flush=True)
            for mode in args.modes:
                flops = 2 * T * V * H * (1 if mode == "fwd" else 3)
                for name, fns in methods.items():
                    if mode not in fns:
                        continue
                    if name in ("torch naive", "torch.compile") and T != max(args.tokens):
                        continue  # materialized-logits peers: the first (largest) T only (each new shape recompiles)
                    row = dict(T=T, V=V, H=H, mode=mode, method=name)
                    try:
                        out, dh, dw, peak, times = measure(fns[mode], h, w, t, adv, mode, args.reps)
                        ms = statistics.median(times)
                        row |= dict(ms=ms, ms_mean=statistics.mean(times), ms_min=min(times), tflops=flops / ms / 1e9,
                                    peak_gib=peak)
                        if ref is not None:
                            r_out, r_dh, r_dw = ref[mode]
                            row |= dict(err_out=_rel(out, r_out), err_dh=_rel(dh, r_dh), err_dw=_rel(dw, r_dw))
                        del out, dh, dw
                    except torch.OutOfMemoryError:
                        row |= dict(ms=None, note="OOM")
                    except Exception as e:  # a peer failing must not stop the table
                        row |= dict(ms=None, note=f"{type(e).__name__}: {str(e)[:120]}")
                    h.grad = w.grad = None
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps(row) + "\n")
            del h, w, t, adv, ref
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    print_table(rows)


def print_table(rows):
    ours = {(r["T"], r["V"], r["mode"]): r.get("ms") for r in rows if r["method"] == "ours"}
    print("# ours = the defaults: ce and rl the fused three-GEMM path (rl: the fused policy loss), fwd the autograd "
          "path's forward")
    hdr = (f"| T | V | mode | method | ms | TF/s | peak GiB | err loss/logp | err dH | err dW | peer/ours time |\n"
           f"|---|---|---|---|---|---|---|---|---|---|---|")
    print(hdr)
    for r in rows:
        def f(k, fmt):
            v = r.get(k)
            return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)
        o = ours.get((r["T"], r["V"], r["mode"]))
        ratio = "—" if (r.get("ms") is None or not o or r["method"].startswith("ours")) else f"{r['ms'] / o:.2f}"
        ms = f(("ms"), ".1f") if r.get("ms") is not None else r.get("note", "—")
        print(f"| {r['T']} | {r['V']} | {r['mode']} | {r['method']} | {ms} | {f('tflops', '.0f')} | "
              f"{f('peak_gib', '.2f')} | {f('err_out', '.1e')} | {f('err_dh', '.1e')} | {f('err_dw', '.1e')} | "
              f"{ratio} |")


if __name__ == "__main__":
    main()
