"""The routed experts' grouped GEMMs timed alone, over expert shapes and tokens per expert, against the step-time
model's expert term (recipe/cost.py expert_pass_work: their FLOPs at the profile's `expert_gemm` rate, each routed
row's bytes at its `expert_rows` rate and the experts' weights at its `expert_weights` rate; docs/cost_model.md, "The
routed experts"). The file --out writes is the form hw_profiles/calibration/<hw>_experts.json takes, from which
`bench/calibrate.py --fit` fits those three rates.

Each case builds a one-layer (or two-layer) model at full width, times the "routed experts (grouped GEMMs)"
component of bench_train_step.profile_components (forward, and forward + backward, under full recompute: the
gather, the two grouped GEMMs and the SwiGLU between them) and prints, per case, the measured FLOP rate, the model's
rate for the same work, and their ratio. The three models differ in hidden size, expert width and expert count,
and the lengths in rows per expert (tokens × top-k / experts), which sets how many FLOPs each read of an expert's
weights buys.

    python bench/bench_expert_rates.py --out h200_experts.json --commit $(git rev-parse --short HEAD)   # on the GPU
    python bench/bench_expert_rates.py --cases tiny-moe:2:512 --device cpu   # CPU smoke
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rates_common import rate_args, write_rates  # noqa: E402

K = 1024
CASES = ("qwen35-35b:1:8192,qwen35-35b:1:32768,qwen35-35b:1:131072,qwen3-30b-a3b:1:8192,qwen3-30b-a3b:1:32768,"
         "qwen3-30b-a3b:1:131072,qwen3-235b-a22b:1:8192,qwen3-235b-a22b:1:32768,qwen3-235b-a22b:1:65536")
PART = "routed experts (grouped GEMMs)"


def predicted(model: str, layers: int, seq: int, hw: str) -> dict:
    """The model's seconds for the part's work in one step: the expert terms of compute_times, full recompute."""
    from recipe.cost import EXPERT_TERMS, Layout, TrainOptions, compute_times, compute_work
    from recipe.hw import load_profile
    from recipe.models import resolve_model

    m = resolve_model(model).with_layers(layers)
    work = compute_work(m, Layout(), TrainOptions(micro_batch_tokens=seq))
    t = compute_times(work, load_profile(hw))
    return {"flops": work["expert_gemm"], "bytes": work["expert_rows"] + work["expert_weights"],
            "seconds": sum(t[k] for k in EXPERT_TERMS)}


def main() -> None:
    args = rate_args(__doc__, CASES, "model:layers:tokens", "expert rates")

    import torch

    from bench_train_step import profile_components
    from launch.data import synthetic_long_batch
    from launch.model import build_model
    from launch.train import TrainConfig, Trainer
    from recipe.models import resolve_model

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    print(f"{'model':16} {'L':>2} {'tokens':>7} {'rows/expert':>11} {'measured ms':>11} {'TF/s':>6} "
          f"{'model ms':>9} {'TF/s':>6} {'model/measured':>14}", flush=True)
    built = None
    for case in args.cases.split(","):
        name, layers, seq = case.split(":")
        layers, seq = int(layers), int(seq)
        shape = resolve_model(name).with_layers(layers)
        if built is None or built[0] != (name, layers):
            built = model = trainer = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            model = build_model(shape, device=device, dtype=dtype, seed=0)
            trainer = Trainer(model, TrainConfig(lr=1e-6), recompute="full", lm_head="fused")
            built = ((name, layers), model, trainer)
        _, model, trainer = built
        batch = synthetic_long_batch(seq, shape.vocab_size, device)
        part = profile_components(trainer, batch, device)[PART]
        pred = predicted(name, layers, seq, args.hw)
        row = {"model": name, "layers": layers, "tokens": seq, "rows_per_expert": seq * shape.top_k / shape.num_experts,
               "measured_s": part["in_step_s"], "predicted_s": pred["seconds"], "flops": pred["flops"],
               "bytes": pred["bytes"]}
        rows.append(row)
        print(f"{name:16} {layers:>2} {seq:>7} {row['rows_per_expert']:>11.0f} {part['in_step_s'] * 1e3:>11.2f} "
              f"{pred['flops'] / part['in_step_s'] / 1e12:>6.0f} {pred['seconds'] * 1e3:>9.2f} "
              f"{pred['flops'] / pred['seconds'] / 1e12:>6.0f} {pred['seconds'] / part['in_step_s']:>14.3f}",
              flush=True)
        del batch
    write_rates(args, "bench_expert_rates.py", "the routed experts' grouped GEMMs timed alone (the 'routed experts "
                "(grouped GEMMs)' component of bench/bench_train_step.py profile_components, full recompute) "
                "(bench/bench_expert_rates.py)", rows)

if __name__ == "__main__":
    main()
