"""Attention's kernel timed alone (the training core's `causal_attention`: causal SDPA, GQA inside it where the
flash kernel takes the shapes; gpt-oss's layers as `sink_attention` runs them, the sinks merged in) over the head
shapes of the presets the training core builds and 8K to 128K tokens, against the step-time model's `attention`
term (its quadratic FLOPs, or the keys a windowed kernel scores, at the profile's `attention` rate). A case
`model:tokens` times a full layer; `model:tokens:window` a sliding layer of that window (WINDOW_CASES).

Each case times the forward, and forward + backward, of one layer's attention on random bf16 q, k, v of the model's
query heads, KV heads and head width, one document of the given length, and prints the FLOP rate it ran at (the
model's attention FLOPs for one layer under full recompute — forward, recomputed forward, backward — over the
measured forward plus forward + backward), the model's rate and their ratio. The projections around it are not
timed: they are the `dense_gemm` term's.

    python bench/bench_attention_rates.py --out attention.json     # on the GPU
    python bench/bench_attention_rates.py --cases WINDOW_CASES --out window.json
    python bench/bench_attention_rates.py --cases WIDTH_CASES --out width.json
    python bench/bench_attention_rates.py --cases SINK_CASES --out sinks.json
    python bench/bench_attention_rates.py --cases SINK_CASES --no-sinks --out plain.json   # gpt-oss without sinks
    python bench/bench_attention_rates.py --cases tiny-moe:512 --device cpu   # CPU smoke
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rates_common import rate_args, write_rates  # noqa: E402

CASES = ("qwen35-35b:8192,qwen35-35b:32768,qwen35-35b:131072,qwen3-30b-a3b:8192,qwen3-30b-a3b:32768,"
         "qwen3-30b-a3b:131072,qwen3-235b-a22b:8192,qwen3-235b-a22b:32768,qwen3-235b-a22b:131072")
# MLA (Moonlight's 16 heads, DeepSeek-V3's 128, at q·k width 192 with v padded to it, as MLAttention runs) and GLM-4.5-
# Air's 96 query heads over 8: `--cases` with V3_CASES
V3_CASES = ("moonlight-16b:8192,moonlight-16b:32768,moonlight-16b:65536,deepseek-v3:8192,deepseek-v3:32768,"
            "glm45-air:8192,glm45-air:32768,glm45-air:65536")
_LENGTHS = (8192, 16384, 32768, 65536, 131072)
# width 64 (Granite 3.0-3B-A800M's 24 heads over 8, no sinks) beside a width 128 the step fit has, 8K to 128K tokens
# (calibrate.py derives the profile's rate at 64 from them and SINK_CASES --no-sinks)
WIDTH_CASES = ",".join(f"{m}:{t}" for m in ("qwen3-30b-a3b", "bench/configs/granite-3.0-3b-a800m.json")
                       for t in _LENGTHS)
# gpt-oss-120b's full layers (64 heads over 8, width 64), run once with their sinks and once with --no-sinks: the
# plain rows join the width-64 rows above, the pairs' difference is the sink merge (cost.SINK_MERGE_BYTES)
SINK_CASES = ",".join(f"gpt-oss-120b:{t}" for t in _LENGTHS)
# gpt-oss's sliding layers: its window of 128 over 8K to 128K tokens, and wider windows at 32K (how a window's time
# splits into the keys it scores and the work every query row costs whatever its window: cost_model.WINDOW_ROW_KEYS)
WINDOW_CASES = ("gpt-oss-120b:8192:128,gpt-oss-120b:32768:128,gpt-oss-120b:131072:128,gpt-oss-120b:32768:256,"
                "gpt-oss-120b:32768:512,gpt-oss-120b:32768:1024,gpt-oss-120b:32768:4096")
NAMED = {"CASES": CASES, "V3_CASES": V3_CASES, "WIDTH_CASES": WIDTH_CASES, "SINK_CASES": SINK_CASES,
         "WINDOW_CASES": WINDOW_CASES}


def model_seconds(m, seq: int, hw: str, window: int | None = None, sinks: bool = False) -> tuple[float, float]:
    """(FLOPs, seconds) the cost model gives one attention layer of `m` in one step under full recompute: 4
    forward-equivalents of layer_work's attention term for a full layer, or, given a window, for a sliding layer of
    that window (the keys its kernel scores); a full layer with `sinks` adds their merge's bytes (SINK_MERGE_BYTES a
    value and pass, at the dense rows' rate)."""
    from recipe.cost import layer_work, rates, sink_merge_row_bytes
    from recipe.hw import load_profile

    kind = "full_attention" if window is None else "sliding_attention"
    if window is not None:
        m = m.model_copy(update={"sliding_window": window, "layer_types": (kind,) * m.num_layers})
    work = next(w for w, k in zip(layer_work(m, seq), m.layer_types) if k == kind)
    flops = 4 * seq * work["attention"]
    # at the rate for the kernel's head width (and, where MLA's v is padded, its extra work), as compute_work
    r = rates(load_profile(hw), m)
    merge = 4 * seq * sink_merge_row_bytes(m, kind) / r["dense_rows"] if sinks else 0.0
    return flops, flops / r["attention"] + merge


def _extra(p) -> None:
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-sinks", action="store_true",
                   help="gpt-oss's layers without their sinks (plain causal attention, as a model of the same heads "
                        "without sinks runs): the sink merge's own cost is the difference")


def main() -> None:
    args = rate_args(__doc__, CASES, "model:tokens[:window] (or CASES, V3_CASES, WIDTH_CASES, SINK_CASES, WINDOW_CASES)",
                     "attention rate", extra=_extra)

    import torch

    from bench_train_step import _time
    from launch.data import synthetic_long_batch
    from launch.model import causal_attention
    from launch.sink_attention import sink_attention
    from recipe.models import resolve_model

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    print(f"{'model':16} {'heads':>9} {'dim':>4} {'tokens':>7} {'window':>6} {'fwd ms':>8} {'fwd+bwd ms':>10} "
          f"{'TF/s':>6} {'model TF/s':>10} {'model/measured':>14}", flush=True)
    for case in ",".join(NAMED.get(c, c) for c in args.cases.split(",")).split(","):
        name, seq, *rest = case.split(":")
        seq, window = int(seq), (int(rest[0]) if rest else None)
        m = resolve_model(name)
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(seq, m.num_heads, m.head_dim, device=device, dtype=dtype, generator=gen)
        k, v = (torch.randn(seq, m.num_kv_heads, m.head_dim, device=device, dtype=dtype, generator=gen)
                for _ in range(2))
        packing = synthetic_long_batch(seq, m.vocab_size, device).packing
        scale = m.head_dim ** -0.5
        with_sinks = m.has_sinks and not args.no_sinks
        sinks = torch.randn(m.num_heads, device=device, generator=gen) if with_sinks else None

        def attend(q_, k_, v_):  # a layer as the core runs it: gpt-oss with its sinks
            if sinks is None and window is None:
                return causal_attention(q_, k_, v_, packing, scale)
            return sink_attention(q_, k_, v_, sinks, packing, scale, window)

        def fwd():
            with torch.no_grad():
                attend(q, k, v)

        def fwd_bwd():
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            attend(qq, kk, vv).float().sum().backward()

        fwd(), fwd_bwd()  # warm-up
        t_f, t_fb = _time(fwd, device, args.reps), _time(fwd_bwd, device, args.reps)
        measured = t_f + t_fb  # the forward, recomputed in the backward pass under full recompute, then both
        flops, predicted = model_seconds(m, seq, args.hw, window, with_sinks)
        rows.append({"model": name, "heads": m.num_heads, "kv_heads": m.num_kv_heads, "head_dim": m.head_dim,
                     "tokens": seq, **({"window": window} if window else {}), "sinks": with_sinks,
                     "fwd_s": t_f, "fwd_bwd_s": t_fb,
                     "measured_s": measured, "flops": flops, "predicted_s": predicted})
        print(f"{name:16} {m.num_heads:>4}/{m.num_kv_heads:<4} {m.head_dim:>4} {seq:>7} {window or '':>6} "
              f"{t_f * 1e3:>8.2f} "
              f"{t_fb * 1e3:>10.2f} {flops / measured / 1e12:>6.0f} {flops / predicted / 1e12:>10.0f} "
              f"{predicted / measured:>14.3f}", flush=True)
    write_rates(args, "bench_attention_rates.py", "attention's kernel timed alone (launch.model.causal_attention; "
                "gpt-oss and windows launch.sink_attention.sink_attention), one document; "
                "bench/bench_attention_rates.py", rows)

if __name__ == "__main__":
    main()
