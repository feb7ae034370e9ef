"""One layer's causal attention on one GPU, kernel by kernel: what SDPA picks by itself, its flash kernel, cuDNN's
and the memory-efficient kernel, for a model's attention shapes. GQA models take K/V at their own head count
(`enable_gqa`; a kernel that refuses it gets K/V repeated to the query heads, said in the row); multi-head latent
attention (DeepSeek-V3) and MiMo-V2-Flash have keys wider than their values, so the flash kernel takes v zero-padded to
the q·k width and the others take it at its own width. Forward and forward + backward ms on random bf16 [1, H, T, D] tensors and one
document, the ratio of each to the flash row (lower is faster), and
the largest difference from the flash row's output and query gradient. `--lower-right` also times the context-parallel
path's piece (queries the last 1/cp of the keys, lower-right causal mask). A kernel the platform refuses prints its
reason. The CP piece also runs as the training core runs it: its prefix keys and its own square as two
kernel calls merged by their log-sum-exps (launch/attention_parts.py). gpt-oss also runs the training core's
attention with its sink logits: merged in by log-sum-exp (cuDNN at the heads' size), as an extra key (one
lower-right call at the padded size) and, on the whole sequence, its sliding window as one windowed flash call with
the sink merged and as the masked blocks (their errors are against the flash row without sinks or window, so
only their times compare).

    python bench/bench_attention.py --model qwen35-35b deepseek-v3 --tokens 32768      # on the GPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def shapes(model: str) -> tuple[int, int, int, int]:
    """(query heads, key/value heads, q·k head size, v head size) of a model's softmax attention."""
    from recipe.models import resolve_model

    m = resolve_model(model)
    if m.mla is not None:
        a = m.mla
        return m.num_heads, m.num_heads, a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim
    return m.num_heads, m.num_kv_heads, m.head_dim, m.value_width


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["qwen35-35b"])
    p.add_argument("--tokens", default="32768")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--lower-right", type=int, default=0, metavar="CP",
                   help="also time a CP piece: queries = tokens / CP against all the keys, lower-right causal")
    args = p.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from bench_train_step import _time
    import launch.context_parallel as cpm
    import launch.sink_attention as sa
    from launch.attention_parts import kernel_for, merged_attention
    from launch.model import Packing
    from recipe.models import resolve_model

    dev = torch.device("cuda")
    names = {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.CUDNN_ATTENTION: "cuDNN",
             SDPBackend.EFFICIENT_ATTENTION: "mem-efficient"}
    print(f"{'model':14} {'tokens':>7} {'piece':>10} {'kernel':34} {'fwd ms':>8} {'fwd+bwd ms':>10} {'vs flash':>8}",
          flush=True)
    for model in args.model:
        hq, hkv, qk, vd = shapes(model)
        for T in (int(t) for t in args.tokens.split(",")):
            pieces = [("whole", T)] + ([(f"1/{args.lower_right}", T // args.lower_right)] if args.lower_right else [])
            for piece, Tq in pieces:
                g = torch.Generator(device=dev).manual_seed(0)
                q = torch.randn(1, hq, Tq, qk, device=dev, dtype=torch.bfloat16, generator=g)
                k = torch.randn(1, hkv, T, qk, device=dev, dtype=torch.bfloat16, generator=g)
                v = torch.randn(1, hkv, T, vd, device=dev, dtype=torch.bfloat16, generator=g)
                mask = None if Tq == T else causal_lower_right(Tq, T)
                w = torch.randn(1, hq, Tq, vd, device=dev, generator=torch.Generator(device=dev).manual_seed(1))
                state = {"base": None, "ref": None}

                def report(label, run):
                    """Time forward and forward + backward of `run`, print a row; the first row (flash) is the base."""
                    try:
                        out = run(False)[0], run(True)[1]
                        t_f, t_fb = _time(lambda: run(False), dev, args.reps), _time(lambda: run(True), dev, args.reps)
                    except RuntimeError as e:
                        print(f"{model:14} {T:>7} {piece:>10} {label:34} refused: {str(e).splitlines()[0][:80]}",
                              flush=True)
                        return
                    if state["base"] is None:
                        state["base"], state["ref"] = t_f + t_fb, out
                    ratio = (t_f + t_fb) / state["base"]
                    err = "  max|Δ| vs flash: o {:.1e}, dq {:.1e}".format(
                        *((a.float() - b.float()).abs().max().item() for a, b in zip(out, state["ref"])))
                    print(f"{model:14} {T:>7} {piece:>10} {label:34} {t_f * 1e3:>8.2f} {t_fb * 1e3:>10.2f} {ratio:>8.3f}"
                          + err, flush=True)

                for backend in (SDPBackend.FLASH_ATTENTION, None, SDPBackend.CUDNN_ATTENTION,
                                SDPBackend.EFFICIENT_ATTENTION) + (("split",) if mask is not None else ()):
                    if backend == "split":  # the CP path: prefix keys and own square, merged (attention_parts)
                        m = T - Tq
                        kernel = kernel_for(q, [(k[:, :, :m], v[:, :, :m], False), (k[:, :, m:], v[:, :, m:], True)])

                        def run(grad: bool):
                            x, y, z = (t.detach().requires_grad_(grad) for t in (q, k, v))
                            with torch.set_grad_enabled(grad):
                                o = merged_attention(x, [(y[:, :, :m], z[:, :, :m], False),
                                                         (y[:, :, m:], z[:, :, m:], True)], qk ** -0.5, kernel)
                            if grad:
                                (o.float() * w).sum().backward()
                            return o.detach(), (x.grad if grad else None)

                        label = f"prefix + square ({kernel}), merged"
                        if kernel is None:
                            print(f"{model:14} {T:>7} {piece:>10} {label:34} refused: no kernel takes both parts")
                            continue
                        report(label, run)
                        continue
                    pad = vd < qk and backend in (None, SDPBackend.FLASH_ATTENTION)
                    vv = F.pad(v, (0, qk - vd)) if pad else v
                    kk, gqa, how = k, hkv < hq, ""
                    params = torch.backends.cuda.SDPAParams(q, kk, vv, mask, 0.0, mask is None, gqa)
                    if gqa and backend is SDPBackend.CUDNN_ATTENTION and not \
                            torch.backends.cuda.can_use_cudnn_attention(params):
                        rep = hq // hkv
                        kk, vv = k.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
                        gqa, how = False, ", K/V repeated"
                    if backend is None and mask is not None:  # a CausalBias: no choice reported for it
                        label = "SDPA's choice"
                    elif backend is None:
                        choice = torch._fused_sdp_choice(q, kk, vv, mask, 0.0, mask is None, enable_gqa=gqa)
                        label = f"SDPA's choice ({SDPBackend(choice).name.split('_')[0].lower()})"
                    else:
                        label = names[backend] + how
                    label += ", v padded" if pad else ""
                    ctx = (lambda: sdpa_kernel(list(names))) if backend is None else (lambda b=backend: sdpa_kernel(b))

                    def run(grad: bool):
                        x, y, z = (t.detach().requires_grad_(grad) for t in (q, kk, vv))
                        with ctx(), torch.set_grad_enabled(grad):
                            o = F.scaled_dot_product_attention(x, y, z, attn_mask=mask, is_causal=mask is None,
                                                               enable_gqa=gqa)[..., :vd]
                        if grad:
                            (o.float() * w).sum().backward()
                        return o.detach(), (x.grad if grad else None)

                    report(label, run)
                shape = resolve_model(model)
                if shape.arch != "gpt_oss":
                    continue
                # gpt-oss: the training core's attention with its sink logits (launch/sink_attention.py), [T, H, D]
                sinks = torch.randn(hq, device=dev, generator=g)
                m = T - Tq
                variants = [("sink merged (cuDNN)", True, None), ("sink as a key, one call (C = 72)", False, None)]
                if Tq == T:
                    W = shape.sliding_window
                    variants += [(f"window {W}: flash windowed, merged", True, W),
                                 (f"window {W}: masked [W, 1 + 2W] blocks", False, W)]
                for label, merged, window in variants:
                    def run(grad: bool, merged=merged, window=window):
                        x, y, z = (t.detach()[0].transpose(0, 1).requires_grad_(grad) for t in (q, k, v))
                        xs = sinks.detach().requires_grad_(grad)
                        saved = sa.MERGED_SINK, cpm.SPLIT_PIECES
                        sa.MERGED_SINK = cpm.SPLIT_PIECES = merged
                        with torch.set_grad_enabled(grad):
                            if m:
                                o = cpm._sink_piece(x, y, z, xs, qk ** -0.5)
                            else:
                                o = sa.sink_attention(x, y, z, xs, Packing.from_lengths([T], device=dev), qk ** -0.5,
                                                      window)
                        sa.MERGED_SINK, cpm.SPLIT_PIECES = saved
                        o = o.transpose(0, 1)[None]
                        if grad:
                            (o.float() * w).sum().backward()
                        return o.detach(), (x.grad.transpose(0, 1)[None] if grad else None)

                    report(label, run)


if __name__ == "__main__":
    main()
