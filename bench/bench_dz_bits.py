"""Bench: the fused head's two gradient GEMMs (dH = dZ · W16 and dW32 += dZᵀ · h16, cuBLAS, fp32 accumulation) on
one group's dZ rounded to k significant bits, sustained and interleaved at the H200's power cap, with power and SM
clock sampled by nvidia-smi.

Why: at T = 65,536 the head runs at the board's 700 W cap, so a GEMM's time follows the energy of its operands'
bit patterns as well as its FLOPs. The head's dZ is the one operand with a full fp16 significand (11 bits): W16
and h16 are bf16 values times a power of two (8 significant bits). A dZ rounded to fewer bits toggles fewer
partial products in the tensor cores. This measures what that is worth, k = 11 (the head today) down to 8 (bf16's
precision in fp16's range), beside bf16 operands throughout (QuACK's gradient GEMMs).

The dZ is a group's softmax of logits of std 2 (the bench heads' inputs), with p − 1 at a random target token of
each row, times the power of two that puts its largest magnitude at 2^14, as the head scales it.

Usage: python bench/bench_dz_bits.py [--vocab 248320] [--group 4096] [--bits 11 10 9 8] [--seconds 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._lm_head_common import REASONS, sustained  # noqa: E402
from kernels.lm_head.numerics import gemm_acc  # noqa: E402


def round_bits(x32: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 -> fp16 with the significand rounded to `bits` bits (ties to even) first: exact in fp16 for normal
    values; bits = 11 is a plain conversion."""
    if bits >= 11:
        return x32.half()
    d = 24 - bits
    u = x32.view(torch.int32)
    u = (u + ((1 << (d - 1)) - 1) + ((u >> d) & 1)) & ~((1 << d) - 1)
    return u.view(torch.float32).half()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--group", type=int, default=4096, help="tokens in the group")
    ap.add_argument("--bits", type=int, nargs="+", default=[11, 10, 9, 8])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    dev = "cuda"
    Tg, V, H = args.group, args.vocab, args.hidden
    g = torch.Generator(device=dev).manual_seed(1)
    h = torch.randn(Tg, H, device=dev, generator=g).bfloat16()
    w = (torch.randn(V, H, device=dev, generator=g) * (2.0 / H ** 0.5)).bfloat16()
    z = torch.randn(Tg, V, device=dev, generator=g) * 2.0
    p = torch.softmax(z, dim=1)
    del z
    p[torch.arange(Tg, device=dev), torch.randint(0, V, (Tg,), device=dev, generator=g)] -= 1.0
    p *= 2.0 ** (14 - torch.floor(torch.log2(p.abs().amax())))
    w16, h16 = w.half(), h.half()  # exact: bf16 values in fp16's range
    dH = torch.empty(Tg, H, device=dev)
    dW = torch.zeros(V, H, device=dev)
    ref_h = p.double() @ w.double()

    methods, errors = {}, {}
    for k in args.bits:
        dz = round_bits(p, k)
        errors[f"dZ fp16, {k} bits"] = (dz.double() - p.double()).norm().item() / p.double().norm().item()

        def run(dz=dz):
            gemm_acc(dH, dz, w16, first=True)
            gemm_acc(dW, dz.T, h16, first=False)

        methods[f"dZ fp16, {k} bits"] = run
    dzb = p.bfloat16()
    errors["bf16 operands"] = (dzb.double() - p.double()).norm().item() / p.double().norm().item()

    def run_bf16():
        gemm_acc(dH, dzb, w, first=True)
        gemm_acc(dW, dzb.T, h, first=False)

    methods["bf16 operands"] = run_bf16
    dH_err = {}
    for name, fn in methods.items():
        fn()
        dH_err[name] = (dH.double() - ref_h).norm().item() / ref_h.norm().item()
    del p, ref_h
    order = list(methods) * args.rounds
    marks = sustained(methods, order, args.seconds)
    base = statistics.median(m.ms for m in marks if m.name == order[0])
    print(f"# {torch.cuda.get_device_name()} | group {Tg} x V {V} x H {H} | dH + dW GEMMs, {args.seconds:.0f} s each")
    print("| dZ operand | ms / call | / first row | dZ rounding (rel.) | dH error (rel., fp64 ref) "
          "| power W (median, max) | SM MHz (median) | clock-event reasons |")
    print("|---|---|---|---|---|---|---|---|")
    for m in marks:
        print(f"| {m.name} | {m.ms:.3f} | {m.ms / base:.3f} | {errors[m.name]:.1e} | {dH_err[m.name]:.1e} | "
              f"{m.power_cells()} |")
    for name in methods:
        runs = [m.ms for m in marks if m.name == name]
        print(f"# {name}: median {statistics.median(runs):.3f} ms over {len(runs)} rounds, "
              f"{statistics.median(runs) / base:.3f} of the first row")
    print(REASONS)


if __name__ == "__main__":
    main()
