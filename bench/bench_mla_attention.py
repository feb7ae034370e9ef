"""Multi-head latent attention's kernel, three ways, on one GPU: the training core's (SDPA's flash kernel, v zero-padded
to the q·k width, launch/model.py MLAttention) against SDPA's cuDNN and memory-efficient kernels, which take v at its
own width (128 against q·k 192). Forward and forward + backward of one layer's causal attention on random bf16
q, k, v of the model's heads and one document, as ms and as ratios to the padded flash path (lower is faster); a
kernel the platform refuses for the shapes prints its reason.

    python bench/bench_mla_attention.py --model deepseek-v3 --tokens 8192,32768        # on the GPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="deepseek-v3")
    p.add_argument("--tokens", default="8192,32768")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench_train_step import _time
    from recipe.models import resolve_model

    m = resolve_model(args.model)
    a = m.mla
    qk, vd, h = a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim, m.num_heads
    dev = torch.device("cuda")
    print(f"{'tokens':>7} {'path':28} {'fwd ms':>8} {'fwd+bwd ms':>10} {'vs padded flash':>15}", flush=True)
    for T in (int(t) for t in args.tokens.split(",")):
        g = torch.Generator(device=dev).manual_seed(0)
        q, k = (torch.randn(1, h, T, qk, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
        v = torch.randn(1, h, T, vd, device=dev, dtype=torch.bfloat16, generator=g)
        base = None
        for name, backend, pad in (("flash, v padded to q·k", SDPBackend.FLASH_ATTENTION, True),
                                   ("cuDNN, v at its width", SDPBackend.CUDNN_ATTENTION, False),
                                   ("mem-efficient, v at its width", SDPBackend.EFFICIENT_ATTENTION, False)):
            vv = F.pad(v, (0, qk - vd)) if pad else v

            def fwd():
                with torch.no_grad(), sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, k, vv, is_causal=True)

            def fwd_bwd():
                x, y, z = (t.detach().requires_grad_() for t in (q, k, vv))
                with sdpa_kernel(backend):
                    o = F.scaled_dot_product_attention(x, y, z, is_causal=True)
                (o[..., :vd] if pad else o).float().sum().backward()

            try:
                fwd(), fwd_bwd()
                t_f, t_fb = _time(fwd, dev, args.reps), _time(fwd_bwd, dev, args.reps)
            except RuntimeError as e:
                print(f"{T:>7} {name:28} refused: {str(e).splitlines()[0][:90]}", flush=True)
                continue
            base = base or (t_f + t_fb)
            print(f"{T:>7} {name:28} {t_f * 1e3:>8.2f} {t_fb * 1e3:>10.2f} {(t_f + t_fb) / base:>15.3f}", flush=True)


if __name__ == "__main__":
    main()
