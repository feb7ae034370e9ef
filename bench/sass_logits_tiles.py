"""Static count: compile the fused path's logits GEMM (kernels/lm_head/triton_backend.py, the persistent TMA kernel)
for sm_90a on any machine, no GPU needed, and print its SASS instruction histogram, registers and spills.

Why: the kernel's K is only H (32 MMA steps a tile at H = 2048), so every instruction a logit in its epilogue costs
~256 cycles a 128 x 256 tile against ~32,768 of MMAs (docs/kernels.md, "The epilogue, counted in instructions");
the count is what moved the kernel from 609 to 649 TF/s. --baseline FILE counts an earlier copy of the module
beside it (e.g. `git show HEAD~1:kernels/lm_head/triton_backend.py > /tmp/old.py`, or bench/_logits_tiles_variants.py).

Uses Triton's own ptxas and cuobjdump (triton/backends/nvidia/bin). Numbers differ a little between Triton
versions: docs/kernels.md's 4,576 -> 2,384 were read with Triton 3.8.

Usage: python bench/sass_logits_tiles.py [--entropy] [--baseline FILE]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._lm_head_common import load_module  # noqa: E402

PTRS = ("e_ptr", "m2_ptr", "lse2_ptr", "ent_ptr", "tgt_ptr", "tz_ptr")


def compile_sass(fn, entropy: bool, block=(128, 256, 64), warps=8, stages=3):
    """(SASS text, ptxas report) of fn (a _logits_tiles_tma_kernel) for sm_90a, 16-bit operands."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bt, bv, bk = block
    names = list(fn.arg_names)
    types = {"h_desc": f"tensordesc<bf16[{bt}, {bk}]>", "w_desc": f"tensordesc<bf16[{bv}, {bk}]>",
             "e_ptr": "*fp16", "tgt_ptr": "*i64"}
    const = dict(WRITE_E=True, E_TMA=False, WITH_ENTROPY=entropy, SOFTCAP=False, SUBTILE=True, WARP_SPECIALIZE=False,
                 BLOCK_T=bt, BLOCK_V=bv, BLOCK_K=bk)
    const = {k: v for k, v in const.items() if k in names}  # (E_TMA, WARP_SPECIALIZE: the variants' copy only)
    sig = {}
    for n in names:
        if n in const:
            sig[n] = "constexpr"
        elif n in types:
            sig[n] = types[n]
        elif n.endswith("_ptr"):
            sig[n] = "*fp32"
        elif n in ("inv_temp", "k2", "cap_k"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    aligned = [n for n in names if n in PTRS or n in ("V", "H", "stride_e")]
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as d:
        cubin, ptx = os.path.join(d, "k.cubin"), os.path.join(d, "k.ptx")
        Path(cubin).write_bytes(k.asm["cubin"])
        Path(ptx).write_text(k.asm["ptx"])
        sass = subprocess.run([str(bin_dir / "cuobjdump"), "--dump-sass", cubin], capture_output=True, text=True).stdout
        report = subprocess.run([str(bin_dir / "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", os.devnull],
                                capture_output=True, text=True).stderr
    return sass, report


def histogram(sass: str) -> collections.Counter:
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z0-9_]+)", sass, flags=re.M)
    return collections.Counter(ops)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entropy", action="store_true", help="the epilogue with the entropy sums")
    ap.add_argument("--baseline", default=None, help="an earlier kernels/lm_head/triton_backend.py to count beside")
    args = ap.parse_args(argv)
    from kernels.lm_head import triton_backend as kt

    kernels_ = {"current": kt._logits_tiles_tma_kernel}
    if args.baseline:
        kernels_["baseline"] = load_module(args.baseline)._logits_tiles_tma_kernel
    rows = {}
    for name, fn in kernels_.items():
        sass, report = compile_sass(fn, args.entropy)
        regs = re.search(r"Used (\d+) registers", report)
        spills = re.search(r"(\d+) bytes spill stores", report)
        rows[name] = (histogram(sass), regs.group(1) if regs else "?", spills.group(1) if spills else "?")
    ops = sorted({op for h, _, _ in rows.values() for op in h}, key=lambda op: -max(h[op] for h, _, _ in rows.values()))
    print(f"# _logits_tiles_tma_kernel, sm_90a, 128x256x64, 8 warps, 3 stages, entropy={args.entropy}")
    print("| | " + " | ".join(rows) + " |\n|---|" + "---|" * len(rows))
    print("| instructions | " + " | ".join(str(sum(h.values())) for h, _, _ in rows.values()) + " |")
    print("| registers, spill bytes | " + " | ".join(f"{r}, {s}" for _, r, s in rows.values()) + " |")
    for op in ops[:16]:
        print(f"| {op} | " + " | ".join(str(h[op]) for h, _, _ in rows.values()) + " |")


if __name__ == "__main__":
    main()
