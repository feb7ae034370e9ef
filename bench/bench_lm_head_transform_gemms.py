"""Bench: one token group's gradient GEMMs of the fused head, as the head runs them (the in-place dZ pass, then
cuBLAS dH = dZ W16 and dW += dZᵀ h16) against dZ formed inside two GEMMs by an A-operand transform (QuACK 0.6.5's
CuTe-DSL GEMMs, `quack.operand_transform`), with the head's own fp16 tile weights and fp32 accumulation.

Why: the dZ pass is what QuACK's pipeline does not run (docs/kernels.md, "Against QuACK, kernel by kernel"), and a
Triton GEMM loses 17% when its operand is formed in registers. The transform form splits dZ's factor in two, so the
transform is a multiplication by a number ≤ 1 and the rest is exact fp32 (mean CE here, b = 0):

    dZ[t, v] = e'[t, v] · 2^(m2[j(v), t] − M_t) · r_t,   r_t = a_t · 2^(M_t − lse2_t − 14) / temperature
               + c_t / temperature at the target column

with e' the stored tile weights (2^14 · e, fp16), m2 the tile maxima and M_t = max_j m2 (log2 units). The strip
u = 2^(m2 − M) (fp16, per row and 64 vocab columns, ≤ 1) is the transform; r_t is the dH GEMM's per-row epilogue
factor and, for dW, folded into the hidden rows (xs = fp16(h · r · 2^k), the 2^k undone in the epilogue); the
target column's c term is a rank-1 correction in fp32 (a gather for dH, an index_add for dW).

Each path's dH and dW are checked against an fp32 reference of the same group (fp32 logits, softmax, TF32 off),
relative L2 errors after rounding to bf16 as the head returns them.

--emulate runs the transform path's arithmetic in torch (fp16(e'·u), then fp32 GEMMs): a check of the split on any
device, CPU included (small shapes), without QuACK.

Usage: python bench/bench_lm_head_transform_gemms.py [--vocab 248320] [--hidden 2048] [--group 4096] [--reps 5]
       [--emulate] [--parts]
CPU check: python bench/bench_lm_head_transform_gemms.py --device cpu --vocab 1024 --hidden 64 --group 128 --emulate
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rates_common import event_ms  # noqa: E402
from kernels.lm_head import torch_backend  # noqa: E402
from kernels.lm_head.numerics import E_LOG2, Coefficients, amax, dz_scale, gemm_acc, pow2_scale  # noqa: E402


def group_inputs(Tg: int, V: int, H: int, device, logit_std: float = 2.0, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(Tg, H, device=device, generator=g).bfloat16()
    w = (torch.randn(V, H, device=device, generator=g) * (logit_std / H ** 0.5)).bfloat16()
    y = torch.randint(0, V, (Tg,), device=device, generator=g)
    return h, w, y


def kmod(device):
    if device.type == "cuda":
        from kernels.lm_head import triton_backend
        return triton_backend
    return torch_backend


def reference(h, w, y):
    """Mean-CE dH and dW of the group in fp32 (TF32 off): dZ = (softmax − onehot) / Tg."""
    z = h.float() @ w.float().T
    dz = torch.softmax(z, -1)
    dz[torch.arange(len(y)), y] -= 1.0
    dz /= len(y)
    return dz @ w.float(), dz.T @ h.float()


def rel(a, b) -> float:
    return float((a.bfloat16().float() - b).norm() / b.norm())


class Group:
    """One group's operands as the fused head holds them after its logits GEMM: e' (fp16 [Tg, V]), tile maxima m2
    [N, Tg], lse2 [Tg], the fp16 copies W16 = w · w_scale and h16 = h · h_scale, and mean-CE coefficients."""

    def __init__(self, h, w, y):
        km = kmod(h.device)
        Tg, V = len(y), w.shape[0]
        self.h, self.w, self.y = h, w, y
        self.e0 = torch.empty(Tg, V, dtype=torch.float16, device=h.device)
        st = km.logits_tiles(h, w, y, 1.0, False, self.e0)
        self.a = torch.full((Tg,), 1.0 / Tg, device=h.device)
        self.coef = Coefficients(st.lse2 * 0.6931471805599453, self.a, None, -self.a)
        self.w_scale = float(pow2_scale(amax(w)))
        self.h_scale = float(pow2_scale(amax(h)))
        self.w16 = (w.float() * self.w_scale).half()
        self.h16 = (h.float() * self.h_scale).half()
        self.e = self.e0.clone()
        self.km, self.st = km, st

    # -- the head as it runs: the in-place dZ pass, then two cuBLAS GEMMs ------------------------------------------
    def dz_pass(self):
        """The in-place dZ pass over a fresh copy of the tile weights; its power-of-two scale."""
        self.e.copy_(self.e0)
        scale = dz_scale(self.coef, 1.0)
        self.km.dlogits_from_tiles(self.e, self.st, self.y, self.st.lse2, self.coef, 1.0, scale)
        return float(scale)

    def cublas_dh(self, dH, s):
        gemm_acc(dH, self.e, self.w16, first=True, alpha=1.0 / (s * self.w_scale))

    def cublas_dw(self, dW, s, first=True):
        gemm_acc(dW, self.e.T, self.h16, first=first, alpha=1.0 / (s * self.h_scale))

    def pass_and_cublas(self, dH, dW, first=True):
        s = self.dz_pass()
        self.cublas_dh(dH, s)
        self.cublas_dw(dW, s, first)

    # -- the split factors -------------------------------------------------------------------------------------------
    def split(self):
        """strip u [V/64, Tg] fp16 (≤ 1), the dH epilogue's per-row factor, the dW operand xs [Tg, H] fp16 and its
        power-of-two undo, and the target column's c / temperature [Tg]."""
        st = self.st
        M = st.m2.max(0).values
        u = torch.exp2(st.m2 - M).repeat_interleave(st.tile_v // 64, 0)[: -(-self.e0.shape[1] // 64)]
        r = self.a * torch.exp2(M - st.lse2 - E_LOG2)
        hr = self.h.float() * r[:, None]
        k = pow2_scale(amax(hr))
        return u.half().contiguous(), r / self.w_scale, (hr * k).half(), 1.0 / k, self.coef.c

    def corrections(self, dH, dW, c):
        """The target column's c term in fp32: dH[t] += c_t w[y_t]; dW[y_t] += c_t h[t]."""
        dH += c[:, None] * self.w[self.y].float()
        dW.index_add_(0, self.y, c[:, None] * self.h.float())

    def emulated(self, dH, dW):
        u, v, xs, undo, c = self.split()
        a = (self.e0.float() * u.float().repeat_interleave(64, 0)[: self.e0.shape[1]].T).half()  # fp16(e'·u)
        torch.mm(a.float(), self.w16.float(), out=dH)
        dH *= v[:, None]
        torch.mm(a.float().T, xs.float(), out=dW)
        dW *= undo
        self.corrections(dH, dW, c)


def quack_path():
    """QuACK's CuTe-DSL GEMMs: on the pass's dZ, and with dZ formed by the transform ({name: fn}), with the
    transform's pieces ({dh, dw, run}), or None with the reason printed."""
    from bench._lm_head_common import quack_peers

    if not quack_peers():  # (prints why; also gives loggers the fingerprint quack 0.6.5 needs)
        return None
    from quack.epilogue.frontend import gemm_epilogue
    from quack.operand_transform import a_transform
    from quack.operand_transform.host import transform_a_operand

    @a_transform(vec_size=8, args={"u": "colvec_ktile"})
    def dh_shift(x, u):
        return x * u

    @a_transform(vec_size=8, args={"u": "kvec_m64"})
    def dw_shift(x, u):
        return x * u

    @gemm_epilogue()
    def rows_scaled(acc, v):
        return {"D": acc * v}

    @gemm_epilogue()
    def scaled(acc, alpha):
        return {"D": acc * alpha}

    from quack.epilogue.library import identity_epi

    def plain(g: Group, dH, dW):
        """The pass, then QuACK's GEMMs on its dZ (no transform): QuACK's fp16 GEMM speed against cuBLAS's on the
        same operands."""
        g.e.copy_(g.e0)
        scale = dz_scale(g.coef, 1.0)
        g.km.dlogits_from_tiles(g.e, g.st, g.y, g.st.lse2, g.coef, 1.0, scale)
        identity_epi.gemm(g.e, g.w16.mT, dH, epi_args={}, tile_M=128, tile_N=256, tile_K=64, cluster_M=2,
                          cluster_N=1)
        identity_epi.gemm(g.e.t(), g.h16.mT, dW, epi_args={}, tile_M=128, tile_N=256, tile_K=64, cluster_M=1,
                          cluster_N=2)
        dH /= scale * g.w_scale
        dW /= scale * g.h_scale

    def t_dh(g: Group, dH, u, v):
        bundle = transform_a_operand(dh_shift, g.e0, {"u": u}, 128, 64)
        rows_scaled.gemm(bundle, g.w16.mT, dH, epi_args=dict(v=v.unsqueeze(0)), transform_a=dh_shift, tile_M=128,
                         tile_N=256, tile_K=64, cluster_M=2, cluster_N=1)

    def t_dw(g: Group, dW, u, xs, undo, add=False):
        bundle = transform_a_operand(dw_shift, g.e0.t(), {"u": u}, 128, 64)
        scaled.gemm(bundle, xs.mT, dW, epi_args=dict(alpha=undo.reshape(1)), transform_a=dw_shift, tile_M=128,
                    tile_N=256, tile_K=64, cluster_M=1, cluster_N=2, add_to_output=add)

    def run(g: Group, dH, dW, add=False):
        u, v, xs, undo, c = g.split()
        t_dh(g, dH, u, v)
        t_dw(g, dW, u, xs, undo, add)
        g.corrections(dH, dW, c)

    return {"dZ pass + QuACK GEMMs": plain, "transform, QuACK CuTe GEMMs": run}, dict(dh=t_dh, dw=t_dw, run=run)


def timed(fn, device, reps: int) -> float:
    if device.type == "cuda":
        return event_ms(fn, reps)
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def one_vocab(V: int, args, paths: dict, dev) -> None:
    g = Group(*group_inputs(args.group, V, args.hidden, dev))
    ref_dh, ref_dw = reference(g.h, g.w, g.y)
    for name, fn in paths.items():
        dH = torch.empty(args.group, args.hidden, device=dev)
        dW = torch.empty(V, args.hidden, device=dev)
        try:
            ms = timed(lambda: fn(g, dH, dW), dev, args.reps)
        except Exception as e:  # (an API or build failure of one path: say so, go on)
            print(f"| {V} | {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:150]} | | |", flush=True)
            continue
        print(f"| {V} | {name} | {ms:.3f} | {rel(dH, ref_dh):.2e} | {rel(dW, ref_dw):.2e} |", flush=True)


def parts(V: int, args, q: dict, dev) -> None:
    """Each piece of both forms alone (one group), and both with dW accumulated over groups as the head runs it
    (cuBLAS beta = 1 reading its fp32 C; QuACK's TMA reduce-add store)."""
    g = Group(*group_inputs(args.group, V, args.hidden, dev))
    dH = torch.empty(args.group, args.hidden, device=dev)
    dW = torch.zeros(V, args.hidden, device=dev)
    s = g.dz_pass()
    u, v, xs, undo, c = g.split()
    rows = {"dZ pass": g.dz_pass, "cuBLAS dH": lambda: g.cublas_dh(dH, s),
            "cuBLAS dW (store)": lambda: g.cublas_dw(dW, s, True),
            "cuBLAS dW (C += )": lambda: g.cublas_dw(dW, s, False),
            "pass + cuBLAS, dW accumulated": lambda: g.pass_and_cublas(dH, dW, False),
            "split (torch)": g.split, "corrections (torch)": lambda: g.corrections(dH, dW, c)}
    if q:
        rows.update({"QuACK transform dH": lambda: q["dh"](g, dH, u, v),
                     "QuACK transform dW (store)": lambda: q["dw"](g, dW, u, xs, undo),
                     "QuACK transform dW (reduce-add)": lambda: q["dw"](g, dW, u, xs, undo, True),
                     "transform, dW accumulated": lambda: q["run"](g, dH, dW, True)})
    for name, fn in rows.items():
        print(f"| {V} | part: {name} | {timed(fn, dev, args.reps):.3f} | | |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, nargs="+", default=[248320, 151936])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--group", type=int, default=4096, help="tokens in the group")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--emulate", action="store_true", help="also run the transform path's arithmetic in torch")
    ap.add_argument("--parts", action="store_true", help="also time each piece alone, and dW accumulated")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    paths = {"dZ pass + cuBLAS (the head)": lambda g, dH, dW: g.pass_and_cublas(dH, dW)}
    if args.emulate:
        paths["transform, emulated in torch"] = lambda g, dH, dW: g.emulated(dH, dW)
    q = {}
    if dev.type == "cuda":
        found = quack_path()
        if found:
            paths.update(found[0])
            q = found[1]
    print("| V | path | ms | dH err | dW err |\n|---|---|---|---|---|")
    for V in args.vocab:
        one_vocab(V, args, paths, dev)
        if args.parts:
            parts(V, args, q, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
