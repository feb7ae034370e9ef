"""One-off probe: which token counts Liger's native FLSCE (bench/_liger_cute.py) runs at, per vocabulary, and its
fwd+bwd time. Run with the package tree on PYTHONPATH (see bench/_liger_cute.py)."""
import sys, torch, time
sys.path.insert(0, ".")
from bench._liger_cute import liger_cute_peers
fn = liger_cute_peers()["liger-cute 0.8.5"]
H = 2048
for V in (32768, 151936, 248320):
    for T in (4096, 8192, 16384, 32768, 65536):
        g = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn(T, H, device="cuda", generator=g).bfloat16().requires_grad_()
        w = (torch.randn(V, H, device="cuda", generator=g) * (2 / H ** 0.5)).bfloat16().requires_grad_()
        t = torch.randint(0, V, (T,), device="cuda", generator=g)
        try:
            fn(h, w, t).backward(); torch.cuda.synchronize()
            ts = []
            for _ in range(3):
                h.grad = w.grad = None
                s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
                s.record(); fn(h, w, t).backward(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
            ms = sorted(ts)[1]
            print(f"V={V} T={T}: ok {ms:.2f} ms, {6*T*V*H/ms/1e9:.0f} TF/s", flush=True)
        except Exception as ex:
            print(f"V={V} T={T}: {str(ex)[:300]}", flush=True)
        del h, w, t
        torch.cuda.empty_cache()
