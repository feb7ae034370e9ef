"""The two gradient GEMMs with dZ formed in registers from the stored tile weights (the Triton kernels of commit
18e76f9, with a TRANSFORM switch that feeds the stored tile unchanged) against the same kernels without the transform
and against cuBLAS, one group (4096 x 248,320 x 2048). Usage: PYTHONPATH=. python bench/bench_grad_operands.py"""
import statistics, sys, torch, importlib.util
spec = importlib.util.spec_from_file_location("old_tb", __import__("pathlib").Path(__file__).with_name("_grad_operands_kernels.py")); ob = importlib.util.module_from_spec(spec); spec.loader.exec_module(ob)
from kernels.lm_head.numerics import gemm_acc
cuda = torch.cuda.is_available()
dev = "cuda" if cuda else "cpu"
Tg, V, H, G = (4096, 248320, 2048, 8) if cuda else (32, 512, 64, 2)
TILE = 256 if cuda else 64
gen = torch.Generator(device=dev).manual_seed(0)
e = (torch.rand(Tg, V, device=dev, generator=gen) * 2**14).half()
u = torch.rand(V // TILE, Tg, device=dev, generator=gen) * 2**-14
tgt = torch.randint(0, V, (Tg,), device=dev, generator=gen)
dzt = torch.randn(Tg, device=dev, generator=gen)
w16 = torch.randn(V, H, device=dev, generator=gen).half()
h16 = torch.randn(Tg, H, device=dev, generator=gen).half()
alpha = torch.tensor(0.5, device=dev)
out = torch.empty(Tg, H, device=dev); acc = torch.empty(V, H, device=dev)
cases = {
  "dH cuBLAS": lambda: [gemm_acc(out, e, w16, first=True, alpha=0.5) for _ in range(G)],
  "dH Triton, plain operand": lambda: [ob.dh_from_weights(e, u, TILE, tgt, dzt, w16, out, alpha, transform=False) for _ in range(G)],
  "dH Triton, dZ formed in registers": lambda: [ob.dh_from_weights(e, u, TILE, tgt, dzt, w16, out, alpha) for _ in range(G)],
  "dW cuBLAS": lambda: [gemm_acc(acc, e.T, h16, first=False, alpha=0.5) for _ in range(G)],
  "dW Triton, plain operand": lambda: [ob.dw_from_weights(e, u, TILE, tgt, dzt, h16, acc, alpha, False, transform=False) for _ in range(G)],
  "dW Triton, dZ formed in registers": lambda: [ob.dw_from_weights(e, u, TILE, tgt, dzt, h16, acc, alpha, False) for _ in range(G)],
}
fl = 2 * Tg * V * H * G
print(f"# {Tg}x{V}x{H}, {G} calls each, interleaved 3 rounds")
res = {k: [] for k in cases}
for r in range(3 if cuda else 1):
    for k, f in cases.items():
        f()
        if cuda:
            s, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); f(); en.record(); torch.cuda.synchronize(); res[k].append(s.elapsed_time(en) / G)
        else:
            res[k].append(1.0)
for k, v in res.items():
    m = statistics.median(v); print(f"| {k} | {m:.3f} ms a call | {fl / G / m / 1e9:.0f} TF/s |", flush=True)
