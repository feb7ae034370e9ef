"""From what a user asks to a solved layout: inputs → (model, hardware, solution).

The one path every command takes (`recipe solve`, `sweep`, `compare`, `check`, and gen_plans for plans/): resolve the
model and the hardware profile (relative to a plan's folder when the inputs come from one), build the training
options, and solve for the given GPU count or the smallest that fits (and, with `--recompute auto`, choose
recompute at that count). Pure Python: never imports torch.
"""

from __future__ import annotations

from pathlib import Path


def solve_inputs(inputs, base_dir: Path | None = None):
    """Inputs (a SolveInputs or a plan's `inputs` block) → (model, hw, solution)."""
    from .cost import TrainOptions
    from .hw import load_profile
    from .models import resolve_model
    from .planfile import _relative
    from .solver import solve, solve_min_gpus, solve_recompute

    m = resolve_model(_relative(inputs.model, base_dir))
    if inputs.layers:
        m = m.with_layers(inputs.layers)
    hw = load_profile(_relative(inputs.hw, base_dir))
    opts = TrainOptions(recompute="full" if inputs.recompute == "auto" else inputs.recompute, lm_head=inputs.lm_head,
                        ep_overlap_chunks=inputs.ep_overlap_chunks or 1,
                        micro_batch_tokens=inputs.micro_batch_tokens or inputs.seq_len,
                        micro_batches=inputs.micro_batches)
    auto = inputs.ep_overlap_chunks is None
    pins = getattr(inputs, "pins", None)
    sol = solve(m, hw, inputs.gpus, opts, auto, pins=pins) if inputs.gpus else solve_min_gpus(m, hw, opts, auto, pins)
    if inputs.recompute == "auto":  # the count and layout under full recompute, then none at that count if faster
        sol = solve_recompute(m, hw, sol, auto, pins)
    return m, hw, sol
