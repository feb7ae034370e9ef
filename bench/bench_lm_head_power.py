"""Bench: mean cross-entropy fwd+bwd, ours against Liger-Kernel, QuACK and a bare cuBLAS GEMM, each run back to
back for a few seconds (interleaved, twice), with the GPU's power draw, SM clock and clock-event reasons sampled by
nvidia-smi.

Why: at T = 65,536 the fused heads run at the board's power cap, so their times follow energy per step, not
scheduling; a sustained, interleaved A/B shows that (and measures the gap more steadily than 5-run medians).

An A/B of a kernel change: --baseline FILE names a copy of kernels/lm_head/triton_backend.py as it was (e.g.
`git show HEAD~1:kernels/lm_head/triton_backend.py > /tmp/old.py`); the row "ours, baseline" runs the same head with
that file's logits_tiles and dlogits_from_tiles, interleaved with the rest.

Usage: python bench/bench_lm_head_power.py [--tokens 65536] [--vocab 248320] [--hidden 2048] [--seconds 4]
       [--rounds 2] [--baseline FILE] [--group-tokens N ...] [--blocking-scale-read]

--group-tokens adds a row "ours, Tg=N" per N: the fused path with N tokens a group instead of the default
(kernels.lm_head.fused.GROUP_TOKENS, fewer where the group buffer would not fit SCRATCH_BYTES).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
from bench._lm_head_common import (REASONS, add_shape_args, head_inputs, load_module, quack_peers,  # noqa: E402
                                   sustained)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap)
    ap.add_argument("--seconds", type=float, default=4.0, help="how long each method runs back to back")
    ap.add_argument("--rounds", type=int, default=2, help="how many times the heads are interleaved")
    ap.add_argument("--baseline", default=None, help="an earlier kernels/lm_head/triton_backend.py to A/B against")
    ap.add_argument("--group-tokens", type=int, nargs="*", default=[], help="fused-path group sizes to A/B")
    ap.add_argument("--blocking-scale-read", action="store_true",
                    help="add the row 'ours, blocking scale read': each group's dZ scale read by a plain float(), "
                         "which drains the stream, instead of kernels.lm_head.fused.HostScalar's early copy")
    args = ap.parse_args(argv)
    dev = "cuda"
    T, H, V = args.tokens, args.hidden, args.vocab
    h, w, t = head_inputs(T, V, H)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def ours():
        h.grad = w.grad = None
        kernels.linear_cross_entropy(h, w, t).backward()

    methods = {"ours": ours}
    for n in args.group_tokens:
        def ours_tg(n=n):
            h.grad = w.grad = None
            kernels.linear_cross_entropy(h, w, t, chunk_tokens=n).backward()

        methods[f"ours, Tg={n}"] = ours_tg
    if args.blocking_scale_read:
        from kernels.lm_head import fused

        class Blocking(fused.HostScalar):
            def start(self, t):
                self.value = t

            def wait(self):
                return float(self.value)

        def ours_blocking():
            early, fused.HostScalar = fused.HostScalar, Blocking
            try:
                ours()
            finally:
                fused.HostScalar = early

        methods["ours, blocking scale read"] = ours_blocking
    if args.baseline:
        from kernels.lm_head import triton_backend as kt

        base = load_module(args.baseline)
        names = ("logits_tiles", "dlogits_from_tiles")

        def ours_baseline():
            mine = [getattr(kt, n) for n in names]
            for n in names:
                setattr(kt, n, getattr(base, n))
            try:
                ours()
            finally:
                for n, f in zip(names, mine):
                    setattr(kt, n, f)

        methods["ours, baseline"] = ours_baseline
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="mean")

        def lig():
            h.grad = w.grad = None
            liger(w, h, t).backward()

        methods["liger"] = lig
    except ImportError as e:
        print(f"liger-kernel not importable: {e}")
    for name, fn in quack_peers().items():
        def quack(fn=fn):
            h.grad = w.grad = None
            fn(h, w, t).backward()

        methods[name] = quack
    methods["cuBLAS 40 x 8192^3 bf16"] = lambda: [a @ a for _ in range(40)]
    heads = [m for m in methods if not m.startswith("cuBLAS")]
    order = list(methods) + heads * (args.rounds - 1)  # then the heads again, interleaved

    marks = sustained(methods, order, args.seconds)
    ours_ms = [m.ms for m in marks if m.name == "ours"]
    print(f"# {torch.cuda.get_device_name()} | T={T} V={V} H={H} | mean CE fwd+bwd, {args.seconds:.0f} s each")
    print("| method | ms / iter | ours / method time | power W (median, max) | SM MHz (median) | clock-event reasons |")
    print("|---|---|---|---|---|---|")
    for i, m in enumerate(marks):
        ref = ours_ms[0] if i < len(methods) else ours_ms[1 + (i - len(methods)) // len(heads)]
        ratio = "—" if m.name == "ours" or m.name.startswith("cuBLAS") else f"{ref / m.ms:.3f}"
        print(f"| {m.name} | {m.ms:.1f} | {ratio} | {m.power_cells()} |")
    for name in heads:
        runs = [m.ms for m in marks if m.name == name]
        print(f"# {name}: median {statistics.median(runs):.1f} ms over {len(runs)} rounds"
              + ("" if name == "ours" else f", ours / it {statistics.median(ours_ms) / statistics.median(runs):.3f}"))
    print(REASONS)


if __name__ == "__main__":
    main()
