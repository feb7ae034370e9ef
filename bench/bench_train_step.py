"""One training step (forward + backward + AdamW), ours against Hugging Face transformers' own implementation of the
same family (Qwen3_5MoeForCausalLM for the default: 4 layers of Qwen3.5-35B-A3B, full width; the model's
`hf_config` picks it), one GPU.

Ours: bf16 compute, fp32 master AdamW, full recompute, the GRPO loss fused into the LM head
(kernels.linear_policy_loss: three logits-sized GEMMs), fused Gated DeltaNet conv and norm (kernels.gdn_fused).
Transformers: bf16 parameters and bf16 AdamW (torch, foreach), gradient checkpointing, SDPA, grouped_mm experts,
flash-linear-attention for the delta rule when installed; its own causal-LM loss.

Each implementation and sequence length runs in a fresh subprocess (so one's memory never counts against the other).
Prints a table, ours beside the cost model's prediction for the same step (`--hw`: the profile, by default the one
the GPU's name gives; none on CPU) and its error; --out writes every figure as JSON.

    python bench/bench_train_step.py --seqs 32768,65536,131072 --hf-seqs 32768 --out bench.json
    python bench/bench_train_step.py --model tiny-moe --layers 4 --seqs 256 --hf-seqs 256 --device cpu  # smoke

A/B axes for ours, each run in its own subprocess: `--norm-backends auto,torch`, `--rope-backends auto,torch`, and
`--value-widths own,padded` (values narrower than q·k, MLA's and MiMo-V2-Flash's, at their own width in cuDNN
against zero-padded to the q·k width).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from recipe.models import active_matmul_params, resolve_model, total_params  # noqa: E402

H200_DENSE_BF16_TFLOPS = 989.0
# the hardware profile a GPU's name (torch.cuda.get_device_name) gives, first match
PROFILE_BY_DEVICE = (("H200", "h200"), ("H100", "h100"), ("B200", "b200"), ("MI355X", "mi355x"), ("MI325X", "mi325x"),
                     ("MI300X", "mi300x"))


def device_profile(name: str) -> str | None:
    """The profile of a GPU by its name ('NVIDIA H200' → 'h200'); None for a device no profile describes."""
    return next((hw for key, hw in PROFILE_BY_DEVICE if key in name.upper()), None)


def predicted(model: str, layers: int, tokens: int, hw: str, keep_selections: bool) -> dict:
    """The cost model's step time and allocated peak (GB) for ours at this point: one GPU, full recompute, the
    fused head (recipe.calibration.predict_point)."""
    from recipe.calibration import predict_point

    p = predict_point({"model": model, "layers": layers, "seq": tokens, "recompute": "full", "lm_head": "fused",
                       "keep_selections": keep_selections}, hw)
    return {"hw": hw, "step_s": p["step_s"], "allocated_gb": p["allocated_gb"]}


def flops_per_step(shape, T: int) -> dict[str, float]:
    """Model FLOPs = 3 × forward (6N); hardware FLOPs with full recompute = 4 × forward, the head's once. The
    forward is the cost model's (recipe.cost.forward_flops_per_token over T tokens of one sequence): 2·N_active a
    token through the matmuls and the head (the embedding's rows where they are tied), attention's QKᵀ and PV over
    the keys each query sees (half the square causal, the window on sliding layers, each layer at its own heads),
    the delta rule and the indexer."""
    from recipe.cost import forward_flops_per_token

    parts = forward_flops_per_token(shape, T)
    fwd = T * sum(parts.values())
    head_fwd = T * parts["head"]
    return {"model": 3 * fwd, "hardware": 3 * fwd + (fwd - head_fwd),  # recompute re-runs the layers, not the head
            "head_model": 3 * head_fwd, "layers_model": 3 * (fwd - head_fwd), "layers_hardware": 4 * (fwd - head_fwd)}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _times(fn, device, reps: int) -> list[float]:
    """Wall seconds of each of `reps` calls, the device synchronized around each."""
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _time(fn, device, reps: int) -> float:
    return statistics.median(_times(fn, device, reps))


def run_ours(shape, T: int, device, steps: int, profile: bool, norm_backend: str = "auto",
             rope_backend: str = "auto", keep_selections: bool = False, value_width: str = "own") -> dict:
    import launch.model
    from launch.data import synthetic_long_batch
    from launch.model import ATTENTION_MIXERS, HeadsRMSNorm, RMSNorm, build_model
    from launch.train import TrainConfig, Trainer

    launch.model.VALUES_AT_OWN_WIDTH = value_width == "own"

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(shape, device=device, dtype=dtype, seed=0)
    for m in model.modules():  # the RMSNorms' and RoPE's path: auto (fused kernels on GPU) or torch
        if isinstance(m, (RMSNorm, HeadsRMSNorm)):
            m.backend = norm_backend
        if isinstance(m, ATTENTION_MIXERS):
            m.rope_backend = rope_backend
            m.norm_backend = norm_backend  # Llama 4's unit-RMS q/k norm (unused elsewhere)
    trainer = Trainer(model, TrainConfig(lr=1e-6), recompute="full", keep_selections=keep_selections,
                      lm_head="fused")
    batch = synthetic_long_batch(T, shape.vocab_size, device)
    trainer.step(batch)  # warm-up: Triton compilation and autotuning, allocator growth
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    last = {}
    times = _times(lambda: last.update(trainer.step(batch)), device, steps)
    metrics = last
    torch_paths = [f"{b} {what}" for b, what in ((norm_backend, "norms"), (rope_backend, "RoPE")) if b != "auto"]
    kept = ["selections kept"] if keep_selections else []
    padded = ["v padded"] if value_width == "padded" else []
    out = {"impl": ", ".join(["ours", *torch_paths, *kept, *padded]), "tokens": T,
           "step_s": statistics.median(times), "step_s_all": times,
           "loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}
    if device.type == "cuda":
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    if profile:
        out["profile"] = profile_components(trainer, batch, device)
    return out


def profile_components(trainer, batch, device, reps: int = 3) -> dict:
    """Each component timed alone at the step's token count (CUDA-synchronized medians): forward, and forward +
    backward. Under full recompute a layer's forward runs twice, so its share of a step ≈ fwd + (fwd + bwd)."""
    from launch.rl import fused_policy_loss, token_logprobs

    model = trainer.model
    layers = [getattr(m, "_checkpoint_wrapped_module", m) for m in model.layers]
    T, D = batch.num_tokens, model.shape.hidden_size
    dtype = next(model.parameters()).dtype
    x = torch.randn(T, D, device=device, dtype=dtype) * 0.5
    from launch.model import layer_ropes

    ropes = layer_ropes(batch.packing.positions, model.shape, dtype)
    rope = ropes["main"]
    results = {}

    def measure(name, fn, count):
        def fwd():
            with torch.no_grad():
                fn()

        def fwd_bwd():
            xin = x.detach().requires_grad_()
            out = fn(xin)
            out.float().sum().backward()
        t_f = _time(fwd, device, reps)
        t_fb = _time(fwd_bwd, device, reps)
        results[name] = {"fwd_s": t_f, "fwd_bwd_s": t_fb, "count": count, "in_step_s": count * (t_f + t_fb)}
        model.zero_grad(set_to_none=True)

    def wrap(f):
        return lambda xin=None: f(x if xin is None else xin)

    for kind, name in (("full_attention", "attention (block)"), ("sliding_attention", "sliding attention (block)"),
                       ("chunked_attention", "chunked attention (block)")):
        attn = [layer for layer in layers if layer.layer_type == kind]
        if attn:
            measure(name, wrap(lambda xin, a=attn[0], r=ropes.get(kind, rope): a.self_attn(xin, r, batch.packing)),
                    len(attn))
    lin = [layer for layer in layers if layer.layer_type == "linear_attention"]
    if lin:
        gdn = lin[0].mixer
        kda = model.shape.linear_attn.kind == "kda"
        measure("kda (block)" if kda else "gated deltanet (block)", wrap(lambda xin: gdn(xin, rope, batch.packing)),
                len(lin))
        from launch.gated_delta import gated_delta_rule

        H, G = gdn.num_v_heads, gdn.num_k_heads
        qk = torch.randn(T, 2, G, gdn.head_k_dim, device=device, dtype=dtype)
        v = torch.randn(T, H, gdn.head_v_dim, device=device, dtype=dtype)
        decay = -torch.rand(T, H, *((gdn.head_k_dim,) if kda else ()), device=device) * 0.1  # KDA: per channel
        beta = torch.rand(T, H, device=device, dtype=dtype)

        def delta(xin):
            scale = xin[:1, :1].float().mean() * 0 + 1  # ties the kernel into the autograd graph of x
            return gated_delta_rule(qk[:, 0] * scale.to(dtype), qk[:, 1], v, decay, beta, batch.packing.positions,
                                    batch.packing.cu_seqlens, gdn.chunk_size, gdn.backend)
        measure("delta rule (kernel only)", wrap(delta), len(lin))
    from launch.moe import MoE

    moe_layers = [layer for layer in layers if isinstance(layer.mlp, MoE)]
    dense = [layer for layer in layers if not isinstance(layer.mlp, MoE)]  # the dense layers (a SwiGLU MLP)
    if dense:
        mlp = dense[0].mlp
        measure("dense mlp (SwiGLU)", wrap(lambda xin: mlp(xin)), len(dense))
    moe = moe_layers[0].mlp if moe_layers else None
    if moe is not None:
        measure("moe (router+experts+shared)", wrap(lambda xin: moe(xin)), len(moe_layers))

    def experts_only(xin):
        # the two grouped GEMMs and the activation between them, under autograd (the same GEMMs the experts'
        # backward runs), without the routing's gathers and the weighted sum
        from launch.moe import expert_ffn, permute

        _, _, top_e = moe.gate(xin)
        order, token, counts = permute(top_e, moe.num_experts)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return expert_ffn(xin[token], moe.experts.gate_up_proj, moe.experts.down_proj, counts.tolist(), offs,
                          moe.experts.activation)[1]
    if moe is not None:
        measure("routed experts (grouped GEMMs)", wrap(experts_only), len(moe_layers))
    w, cap = model.lm_head.weight, model.shape.final_logit_softcap

    def head(xin):
        return fused_policy_loss(xin, w, batch.targets, batch.advantages, batch.loss_mask, trainer.cfg.loss,
                                 softcap=cap, seq_id_T=batch.seq_id)[0]
    t_f = _time(lambda: token_logprobs(x, w, batch.targets, mode="fused", softcap=cap, with_entropy=True), device,
                reps)
    t_fb = _time(lambda: head(x.detach().requires_grad_()).backward(), device, reps)
    results["lm head (fused policy loss; fwd: no-grad log-probs)"] = {"fwd_s": t_f, "fwd_bwd_s": t_fb, "count": 1,
                                                                      "in_step_s": t_fb}
    model.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    t_opt = _time(trainer.optimizer.step, device, reps)
    results["optimizer (AdamW, fp32 master)"] = {"fwd_s": 0.0, "fwd_bwd_s": 0.0, "count": 1, "in_step_s": t_opt}
    model.zero_grad(set_to_none=True)
    return results


def run_hf(shape, T: int, device, steps: int) -> dict:
    import transformers

    from launch.hf_io import hf_config

    cfg_dict = {k: v for k, v in hf_config(shape).items() if k != "architectures"}
    model_type = cfg_dict.pop("model_type")
    if model_type == "step3p5":  # Step-3.7: transformers' only class with its head is the multimodal one, whose
        # vision tower is cut to one layer of width 16 here (text input never reaches it)
        from transformers.models.step3p7.configuration_step3p7 import Step3p7Config

        config = Step3p7Config(text_config=cfg_dict, vision_config=dict(width=16, layers=1, heads=1, image_size=28))
    else:
        config = transformers.AutoConfig.for_model(model_type, **cfg_dict)  # the shape's own family
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # built directly in the compute dtype: an fp32 build then cast leaves ~17 GiB of freed fp32 blocks in the
    # caching allocator, which was enough to push transformers' 32K step (≈117 GiB peak) out of memory
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = (transformers.Step3p7ForConditionalGeneration(config) if model_type == "step3p5"
                     else transformers.AutoModelForCausalLM.from_config(config))
    finally:
        torch.set_default_dtype(default)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    experts = "default"
    if device.type == "cuda" and shape.num_experts > 1:
        try:  # transformers' grouped-GEMM experts where the family takes them (Llama 4's bmm experts do not)
            model.set_experts_implementation("grouped_mm")
            experts = "grouped_mm"
        except ValueError:
            pass
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
    ids = torch.randint(0, shape.vocab_size, (1, T), device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = _times(step, device, steps)
    out = {"impl": "transformers", "tokens": T, "step_s": statistics.median(times), "step_s_all": times,
           "experts": experts}
    if device.type == "cuda":
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return out


def child(args) -> None:
    shape = resolve_model(args.model).with_layers(args.layers)
    device = torch.device(args.device)
    if device.type == "cuda":
        from launch.gated_delta import fla_status

        la = shape.linear_attn
        print("delta rule:", fla_status(la.head_k_dim, la.kind == "kda")[1] if la else "-", file=sys.stderr)
    try:
        if args.child == "ours":
            res = run_ours(shape, args.child_seq, device, args.steps, args.profile, args.norm_backend,
                           args.rope_backend, args.keep_selections, args.value_width)
        else:
            res = run_hf(shape, args.child_seq, device, args.steps)
    except torch.OutOfMemoryError as e:
        res = {"impl": args.child, "tokens": args.child_seq, "error": f"OOM: {str(e).splitlines()[0][:160]}"}
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen35-35b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seqs", default="32768,65536,131072", help="ours: tokens per step (one sequence)")
    p.add_argument("--hf-seqs", default="32768", help="transformers: tokens per step; empty to skip")
    p.add_argument("--profile-seq", type=int, default=65536, help="component profile at this length (0: none)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="write all results as JSON here")
    p.add_argument("--child", choices=["ours", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--child-seq", type=int, help=argparse.SUPPRESS)
    p.add_argument("--norm-backends", default="auto",
                   help="ours: the RMSNorms' path for each run, comma-separated: auto (the fused kernels on GPU) "
                        "and/or torch (the torch ops), e.g. auto,torch for an A/B")
    p.add_argument("--norm-backend", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--rope-backends", default="auto",
                   help="ours: RoPE's path for each run, comma-separated: auto (the fused kernel on GPU) and/or torch")
    p.add_argument("--rope-backend", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--keep-selections", action="store_true",
                   help="ours: DeepSeek sparse attention's recomputed forward reuses the forward's index selections "
                        "(the plan's train.keep_selections)")
    p.add_argument("--value-widths", default="own",
                   help="ours: values narrower than q·k (MLA's, MiMo-V2-Flash's) for each run, comma-separated: own "
                        "(cuDNN takes them at their width where it can) and/or padded (zero-padded to the q·k width, "
                        "the path off NVIDIA GPUs), e.g. own,padded for an A/B")
    p.add_argument("--value-width", default="own", help=argparse.SUPPRESS)
    p.add_argument("--hw", help="the hardware profile ours is predicted on (default: the GPU's, by its name; "
                                "'none': no prediction)")
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    shape = resolve_model(args.model).with_layers(args.layers)
    hw = args.hw if args.hw is not None else (device_profile(torch.cuda.get_device_name())
                                             if args.device == "cuda" else None)
    hw = None if hw == "none" else hw
    runs = [("hf", int(s), "auto", "auto", "own") for s in args.hf_seqs.split(",") if s] + \
        [("ours", int(s), nb, rb, vw) for s in args.seqs.split(",") for nb in args.norm_backends.split(",")
         for rb in args.rope_backends.split(",") for vw in args.value_widths.split(",")]
    results = []
    for impl, T, norms, ropes, values in runs:
        cmd = [sys.executable, __file__, "--child", impl, "--child-seq", str(T), "--model", args.model,
               "--layers", str(args.layers), "--steps", str(args.steps), "--device", args.device,
               "--norm-backend", norms, "--rope-backend", ropes, "--value-width", values]
        if args.keep_selections:
            cmd.append("--keep-selections")
        if impl == "ours" and T == args.profile_seq and norms == ropes == "auto" and values == "own":
            cmd.append("--profile")
        env = os.environ.copy()
        if impl == "hf":
            # transformers' 32K step peaks at ~117 GiB with a 30 GiB fp32-logits allocation; without expandable
            # segments the caching allocator's fragmentation leaves no 30 GiB block on a 140 GiB H200 (measured:
            # OOM with 11.7 GiB free). Ours runs under the default allocator.
            env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            res = {"impl": impl, "tokens": T, "error": (proc.stderr or proc.stdout)[-1500:]}
        else:
            res = json.loads(line[len("RESULT "):])
        fl = flops_per_step(shape, T)
        if "step_s" in res:
            res["model_tflops"] = fl["model"] / res["step_s"] / 1e12
            res["hardware_tflops"] = (fl["hardware"] if impl == "ours" else fl["model"] + fl["layers_model"] / 3) \
                / res["step_s"] / 1e12
        res["flops"] = fl
        if impl == "ours" and hw and (norms, ropes, values) == ("auto", "auto", "own"):
            res["predicted"] = predicted(args.model, args.layers, T, hw, args.keep_selections)
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if k not in ("profile", "flops")}), flush=True)
        if proc.returncode and "error" not in res:
            res["stderr"] = proc.stderr[-800:]
        if args.out:
            Path(args.out).write_text(json.dumps({"shape": shape.name, "total_params": total_params(shape),
                                                  "active_matmul_params": active_matmul_params(shape),
                                                  "device": torch.cuda.get_device_name() if args.device == "cuda"
                                                  else "cpu", "torch": torch.__version__, "results": results},
                                                 indent=1))
    print_table(shape, results)


def print_table(shape, results) -> None:
    print(f"\n{shape.name}: {total_params(shape) / 1e9:.2f}B params, {active_matmul_params(shape) / 1e6:.0f}M active "
          f"matmul params/token")
    print(f"{'impl':18} {'tokens':>7} {'step s':>8} {'peak GiB':>9} {'model TF/s':>11} {'hw TF/s':>8}  "
          f"{'predicted s':>18} {'predicted GB (GiB)':>27}")
    for r in results:
        if "error" in r:
            print(f"{r['impl']:18} {r['tokens']:>7} {r['error'][:100]}")
            continue
        line = (f"{r['impl']:18} {r['tokens']:>7} {r['step_s']:>8.3f} {r.get('peak_allocated_gib', 0):>9.1f} "
                f"{r['model_tflops']:>11.0f} {r['hardware_tflops']:>8.0f}")
        p = r.get("predicted")
        if p:
            gb, measured_gb = p["allocated_gb"], r.get("peak_allocated_gib", 0) * 2**30 / 1e9
            mem = f"{gb:.2f} ({gb * 1e9 / 2**30:.1f}, {gb / measured_gb - 1:+.1%})" if measured_gb else f"{gb:.2f}"
            line += f"  {p['step_s']:>8.3f} ({p['step_s'] / r['step_s'] - 1:+.1%}) {mem:>27}  [{p['hw']}]"
        print(line)
    for r in results:
        if "profile" in r:
            print(f"\nprofile, ours at {r['tokens']} tokens (step {r['step_s']:.3f} s)")
            for name, v in r["profile"].items():
                print(f"  {name:32} fwd {v['fwd_s'] * 1e3:8.1f} ms  fwd+bwd {v['fwd_bwd_s'] * 1e3:8.1f} ms  "
                      f"×{v['count']}  ≈ {v['in_step_s'] * 1e3:8.1f} ms/step")


if __name__ == "__main__":
    main()
