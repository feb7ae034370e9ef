"""The dense matmuls of each model's layers timed alone: every distinct (in, out) width of recipe/cost.py
`dense_matmuls` (attention or Gated DeltaNet projections, MLA's LoRA pieces, the router, the shared expert, a dense
FFN) as one bf16 linear layer's forward and backward (y = x Wᵀ; dx = dy W; dW = dyᵀ x) at a number of tokens. Prints
each one's TF/s, and the non-negative least-squares fit the profile's dense_gemm comes from (bench/calibrate.py
dense_fit): FLOPs at a fraction of the dense bf16 peak, the activations each GEMM reads and writes (tokens · (in + out)
bf16 values for each of the three GEMMs) at a fraction of the HBM bandwidth and a fixed time per GEMM call, with its
worst errors.

    python bench/bench_dense_rates.py --out $OUT/h200_dense.json --commit $(git rev-parse --short HEAD)   # on the GPU
    python bench/bench_dense_rates.py --models tiny-moe --tokens 256 --device cpu                          # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODELS = "qwen35-35b,qwen3-30b-a3b,qwen3-235b-a22b,glm45-air,deepseek-v3,moonlight-16b,mixtral-8x7b,gpt-oss-120b"


def shapes(model: str) -> list[tuple[int, int, str]]:
    """Distinct (in, out, where) of a model's dense matmuls over its layer kinds."""
    from recipe.cost import dense_matmuls
    from recipe.models import resolve_model

    m = resolve_model(model)
    seen: dict[tuple[int, int], str] = {}
    for i, kind in enumerate(m.layer_types):
        for k, n in dense_matmuls(m, kind, not m.is_dense_layer(i)):
            seen.setdefault((k, n), f"{kind}{' (dense FFN layer)' if m.is_dense_layer(i) else ''}")
    return [(k, n, w) for (k, n), w in seen.items()]


def fit(rows: list[dict], peak: float, hbm: float) -> dict:
    """calibrate.py's `dense_fit` (what the profile's dense_gemm is) in the profile's terms: the FLOP rate of the
    dense peak, the row bytes' of the HBM bandwidth, µs a GEMM call, and the worst error over the matmuls at least
    512 wide each way and over all."""
    from calibrate import dense_fit

    inv, err = dense_fit(rows)
    wide = [abs(e) for r, e in zip(rows, err) if min(r["in"], r["out"]) >= 512]
    return {"dense_gemm": round(float(1 / (inv[0] * peak)), 3) if inv[0] else None,
            "dense_rows": round(float(1 / (inv[1] * hbm)), 3) if inv[1] else None,
            "us_per_gemm": round(float(inv[2]) * 1e6, 1),
            "worst_error_512_wide": round(float(max(wide, default=0.0)), 3),
            "worst_error": round(float(abs(err).max()), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=MODELS)
    p.add_argument("--tokens", default="8192,32768")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--hw", default="h200")
    p.add_argument("--commit", default="")
    p.add_argument("--out")
    args = p.parse_args()

    import torch

    from recipe.hw import load_profile

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    hw = load_profile(args.hw)
    peak, hbm = hw.peak_bf16_tflops * 1e12, hw.hbm_bw_tb_s * 1e12

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    rows = []
    print(f"{'model':16} {'where':34} {'in':>6} {'out':>6} {'tokens':>7} {'fwd+bwd ms':>10} {'TF/s':>6}", flush=True)
    for model in args.models.split(","):
        for k, n, where in shapes(model):
            for T in (int(t) for t in args.tokens.split(",")):
                g = torch.Generator(device=dev).manual_seed(0)
                x = torch.randn(T, k, device=dev, dtype=dtype, generator=g)
                w = torch.randn(n, k, device=dev, dtype=dtype, generator=g) * k ** -0.5
                dy = torch.randn(T, n, device=dev, dtype=dtype, generator=g)

                def step():
                    torch.mm(x, w.t())  # forward
                    torch.mm(dy, w)  # dx
                    torch.mm(dy.t(), x)  # dW

                step()
                times = []
                for _ in range(args.reps):
                    sync()
                    t0 = time.perf_counter()
                    step()
                    sync()
                    times.append(time.perf_counter() - t0)
                s = statistics.median(times)
                flops = 3 * 2 * T * k * n
                row = {"model": model, "where": where, "in": k, "out": n, "tokens": T, "measured_s": s,
                       "flops": flops, "bytes": 3 * T * (k + n) * 2}
                rows.append(row)
                print(f"{model:16} {where:34} {k:>6} {n:>6} {T:>7} {s * 1e3:>10.3f} {flops / s / 1e12:>6.0f}",
                      flush=True)
    result = fit(rows, peak, hbm)
    print(json.dumps(result))
    if args.out:
        env = {"torch": torch.__version__, "device": str(dev), "commit": args.commit,
               "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               "command": " ".join(["bench_dense_rates.py"] + sys.argv[1:])}
        Path(args.out).write_text(json.dumps({"hw": args.hw, "environment": env, "rows": rows, "fit": result},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
