"""`--format json`: what each table of the CLI shows, as plain data for scripts (`recipe hw -f json | jq`).

Keys are stable and spelled like the plan's (`memory_gb`, `step_time_s`, `tokens_per_s_per_gpu`); numbers are not
rounded for display. Pure Python: never imports torch or rich.
"""

from __future__ import annotations

from ._data import plain
from .hw import HwProfile
from .models import ModelShape, active_params, mtp_params, param_counts, total_params, trainable


def _estimate(e) -> dict:
    """An estimate as JSON; with its margin (`fits` then means peak + margin ≤ usable) when it carries one."""
    from .margin import margin_of

    out = {"memory_gb": dict(e.memory_gb), "fits": e.fits, "step_time_s": e.step_time_s,
           "tokens_per_s_per_gpu": e.tokens_per_s_per_gpu, "tflops_per_gpu": e.tflops_per_gpu,
           "mfu": {"hardware": e.mfu_hardware, "model": e.mfu_model}}
    mg = margin_of(e)
    if mg is not None:
        out["margin_gb"] = {**mg.parts_gb, "total": mg.total_gb}
        out["basis"], out["error"] = dict(mg.bands.basis), dict(mg.bands.error)
    return out


def sweep_data(m: ModelShape, hw: HwProfile, world: int, opts, points, sol, rank: int, n_fit: int, n_points: int,
               best: float, mine) -> dict:
    rows = []
    for i, p in enumerate(points, 1):
        e = p.estimate
        rows.append({"rank": i, "layout": p.layout.degrees(world), "solver": p.layout == sol.layout,
                     "peak_gb": e.total_gb, "margin_gb": getattr(getattr(e, "margin", None), "total_gb", None),
                     "fits": e.fits, "step_time_s": e.step_time_s,
                     "tokens_per_s_per_gpu": e.tokens_per_s_per_gpu,
                     "vs_best": p.seconds_per_token(world, opts) / best if e.fits else None})
    return {"model": m.name, "hw": hw.name, "gpus": world, "usable_gb": hw.usable_gb, "grid_points": n_points,
            "fitting_points": n_fit, "solver_rank": rank, "solver_layout": sol.degrees,
            "solver_vs_best": mine.seconds_per_token(world, opts) / best, "points": rows}


def compare_data(model: str, seq_len: int, cols, m: ModelShape | None) -> dict:
    """cols: (profile, solution or None, why it does not fit or None, technique effects or None)."""
    out = []
    for hw, sol, why, effects in cols:
        col = {"hw": hw.name, "usable_gb": hw.usable_gb, "fits": sol is not None}
        if sol is None:
            col["does_not_fit"] = why
        else:
            col.update(gpus=sol.world, layout=sol.degrees, **_estimate(sol.estimate), techniques=effects)
        out.append(col)
    return {"model": m.name if m is not None else model, "seq_len": seq_len, "profiles": out}


def hw_data(p: HwProfile) -> dict:
    data = plain(p)
    data["usable_gb"] = p.usable_gb
    return data


def model_data(m: ModelShape, groups: bool = False) -> dict:
    tot = total_params(m)
    counts = param_counts(m)
    data = {"name": m.name, "arch": m.arch, "layers": m.num_layers, "hidden_size": m.hidden_size,
            "experts": m.num_experts, "top_k": m.top_k, "vocab_size": m.vocab_size, "total_params": tot,
            "active_params": active_params(m), "routed_experts_share": counts["routed_experts"] / tot,
            "trained": trainable(m) is None, "source": m.source}
    if groups:
        data["params_by_group"] = counts
        data["mtp_params"] = mtp_params(m)
        data["shape"] = plain(m)
    return data


def check_data(results, fixed: list[str], code: int) -> dict:
    from .text import layout_str

    plans = []
    for r in results:
        plans.append({
            "file": r.file, "status": r.status,
            "layout": layout_str(r.plan.layout) if r.plan is not None else None,
            "peak_gb": r.peak_gb, "usable_gb": r.usable_gb,
            "problems": [{"field": p.field, "kind": p.kind, "committed": _jsonable(p.committed),
                          "solved": _jsonable(p.solved), "cause": p.cause} for p in r.problems],
        })
    counts = {k: sum(r.status == k for r in results) for k in ("ok", "drift", "misfit", "invalid")}
    return {"plans": plans, "fixed": fixed, "counts": counts, "exit_code": code}


def _jsonable(v):
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if v == v and v not in (float("inf"), float("-inf")) else str(v)
    return str(v)
