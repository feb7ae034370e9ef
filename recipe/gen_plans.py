"""Regenerate the committed plans: `python -m recipe.gen_plans plans/` (the Makefile's `make plans`).

Each model preset (but tiny-moe) × {h100, mi300x, mi355x} × {32k, 128k} at the default GPU count (`recipe solve`
without --gpus), plus tiny-cpu.yaml (tiny-moe on 2 CPU processes at 4k tokens, the plan the CPU tests and CI can
launch). The same code path as `recipe solve`: `solve_inputs` → `build_plan` → `dumps`. A combination that fits on
no GPU count is skipped with a note. Pure Python: never imports torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .solving import solve_inputs
from .models import PRESETS
from .plan import Inputs, build_plan, dumps, format_size, write_atomic
from .solver import InfeasibleError

PROFILES = ("h100", "mi300x", "mi355x")
SEQ_LENS = (32 * 1024, 128 * 1024)
SKIP = ("tiny-moe",)  # only as tiny-cpu
TINY = ("tiny-cpu.yaml", Inputs(model="tiny-moe", seq_len=4096, hw="cpu", gpus=2, pins={"ep": 2}))  # 2 processes, dp=2 ep=2


def targets() -> list[tuple[str, Inputs]]:
    out = [(f"{model}_{hw}_{format_size(seq)}.yaml", Inputs(model=model, seq_len=seq, hw=hw))
           for model in PRESETS if model not in SKIP for hw in PROFILES for seq in SEQ_LENS]
    return out + [TINY]


def generate(folder: Path) -> tuple[list[Path], list[str]]:
    """Write every plan into `folder`; returns (written paths, notes on skipped combinations)."""
    folder.mkdir(parents=True, exist_ok=True)
    written, skipped = [], []
    for name, inputs in targets():
        try:
            m, hw, sol = solve_inputs(inputs)
        except InfeasibleError as e:
            skipped.append(f"skipped {name}: {str(e).splitlines()[0]}")
            continue
        path = folder / name
        write_atomic(path, dumps(build_plan(inputs, m, hw, sol)))
        written.append(path)
    return written, skipped


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m recipe.gen_plans FOLDER  (regenerates the committed plans into FOLDER)",
              file=sys.stderr)
        return 0 if args in (["-h"], ["--help"]) else 2
    written, skipped = generate(Path(args[0]))
    for note in skipped:
        print(note)
    print(f"wrote {len(written)} plans to {args[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
