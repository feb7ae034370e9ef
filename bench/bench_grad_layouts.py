"""The fused head's two cuBLAS gradient GEMMs in their own layout and transposed, one group each (4096 x 248,320 x
2048, fp16 operands from uniform random data, fp32 output, 16 calls a row, median of 4 rounds):
dW: C[V, H] += dZ^T h (the head) against C^T[H, V] += h^T dZ; dH: out[T, H] = dZ W16 (the head) against
out^T[H, T] = W16^T dZ^T. Usage: PYTHONPATH=. python bench/bench_grad_layouts.py"""
import statistics

import torch

from kernels.lm_head.numerics import gemm_acc

dev = "cuda"
Tg, V, H, G = 4096, 248320, 2048, 16
dz = (torch.rand(Tg, V, device=dev) * 2 - 1).half()
h = torch.randn(Tg, H, device=dev).half()
w = torch.randn(V, H, device=dev).half()
C = torch.zeros(V, H, device=dev)
CT = torch.zeros(H, V, device=dev)
o = torch.empty(Tg, H, device=dev)
oT = torch.empty(H, Tg, device=dev)


def dw():
    for g in range(G):
        gemm_acc(C, dz.T, h, first=g == 0, alpha=0.5)


def dwT():
    for g in range(G):
        gemm_acc(CT, h.T, dz, first=g == 0, alpha=0.5)


def dh():
    for g in range(G):
        gemm_acc(o, dz, w, first=True, alpha=0.5)


def dhT():
    for g in range(G):
        gemm_acc(oT, w.T, dz.T, first=True, alpha=0.5)


fns = dict(dw=dw, dwT=dwT, dh=dh, dhT=dhT)
res = {k: [] for k in fns}
for f in fns.values():
    f()
for r in range(4):
    for k, f in fns.items():
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        f()
        e.record()
        torch.cuda.synchronize()
        res[k].append(s.elapsed_time(e))
fl = 2 * Tg * V * H * G
for k, v in res.items():
    m = statistics.median(v)
    print(f"{k}: {m:.2f} ms for {G} groups, {fl / m / 1e9:.0f} TF/s  {[round(x, 1) for x in v]}")
print("dwT vs dw", float((CT.T - C).norm() / C.norm()), "dhT vs dh", float((oT.T - o).norm() / o.norm()))
