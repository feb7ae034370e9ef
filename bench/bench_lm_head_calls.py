"""Call-to-call spread of the LM heads: N calls of each head's mean CE fwd+bwd in one process, each call timed
alone (CUDA events), with the caching allocator's placement moved between calls (a dummy allocation of i x SHIFT
MiB before call i, torch.cuda.empty_cache before every other call).

Why: the 3 timed repeats of one lean-head call agree within 1% while separate calls of the same work differ by up
to 20% (docs/BENCHMARKS.md: 630 against 715-757 ms at T = 65,536, V = 248,320); the fused head stays
within ~6%. This prints each call's time so a change can be checked for which regime it lands in.

Usage: python bench/bench_lm_head_calls.py [--tokens 65536] [--vocab 248320] [--hidden 2048] [--calls 7]
       [--shift-mib 37] [--heads fused lean]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
from bench._lm_head_common import add_shape_args, head_inputs  # noqa: E402

HEADS = {
    "fused": lambda h, w, t: kernels.linear_cross_entropy(h, w, t),  # three GEMMs
    "lean": lambda h, w, t: kernels.linear_cross_entropy(h, w, t, mode="lean"),  # four GEMMs
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_args(ap)
    ap.add_argument("--calls", type=int, default=7, help="timed calls per head, after one warm-up call")
    ap.add_argument("--shift-mib", type=float, default=37.0, help="dummy allocation before call i: i x this MiB")
    ap.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    args = ap.parse_args(argv)
    dev = "cuda"
    T, H, V = args.tokens, args.hidden, args.vocab
    h, w, t = head_inputs(T, V, H)
    print(f"# {torch.cuda.get_device_name()} | T={T} V={V} H={H} | mean CE fwd+bwd, one call at a time")
    print("| head | calls, ms | median | max / min |\n|---|---|---|---|")
    for name in args.heads:
        times = []
        for i in range(args.calls + 1):
            h.grad = w.grad = None
            if i % 2:
                torch.cuda.empty_cache()
            pad = torch.empty(int(i * args.shift_mib * 2**20) + 4096 * i, dtype=torch.uint8, device=dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            HEADS[name](h, w, t).backward()
            end.record()
            torch.cuda.synchronize()
            del pad
            if i:  # (call 0 warms up: compilation, cuBLAS workspaces)
                times.append(start.elapsed_time(end))
        print(f"| {name} | {', '.join(f'{x:.1f}' for x in times)} | {statistics.median(times):.1f} | "
              f"{max(times) / min(times):.3f} |", flush=True)


if __name__ == "__main__":
    main()
