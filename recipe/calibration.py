"""Committed calibration measurements: which hardware profiles have their predictions checked against a measured
grid, and how far off the cost model is on it.

`hw_profiles/calibration/<name>.json` holds the grid measured on that accelerator (bench/calibrate.py writes it):
the environment it ran in and, for each point, the configuration, the measured peak memory and step time and the
cost model's prediction at the time. A profile with such a file has `measured` predictions; every other profile's
are `assumed`. Pure Python: never imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources


@dataclass(frozen=True)
class Calibration:
    hw: str
    memory_error: float  # worst |predicted − measured| / measured peak memory over the grid (a fraction)
    time_error: float  # the same for step time
    points: tuple[dict, ...]
    environment: dict
    # the worst errors split by role: {"all" | "fit" | "held_out": {"memory", "time", "points"}}; `fit` points fixed
    # the profile's per-operation efficiencies, `held_out` ones (deeper models) did not
    errors: dict = field(default_factory=dict)
    # the step's parts timed alone at one grid configuration each (bench_train_step.profile_components)
    components: tuple[dict, ...] = ()

    @property
    def basis(self) -> str:
        return "measured"


def _path(hw: str):
    return resources.files("hw_profiles").joinpath("calibration", f"{hw}.json")


def load(hw: str) -> Calibration | None:
    """The committed calibration of profile `hw`, None when it has none (its predictions are `assumed`)."""
    path = _path(hw)
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return Calibration(hw=hw, memory_error=float(data["memory_error"]), time_error=float(data["time_error"]),
                       points=tuple(data.get("points", ())), environment=dict(data.get("environment", {})),
                       errors=dict(data.get("errors", {})), components=tuple(data.get("components", ())))


def basis(hw: str) -> str:
    """`measured` when the profile has a committed calibration grid, `assumed` otherwise."""
    return "measured" if load(hw) is not None else "assumed"


def predict_point(point: dict, hw: str) -> dict:
    """The cost model's prediction for one grid point (its model at its depth, one GPU, one micro-batch of
    `seq` tokens, the last `keep_layers` layers kept under recompute, DeepSeek sparse attention's selections kept
    where `keep_selections`, the expert-parallel code path where `ep_path`): `allocated_gb` is the predicted peak less the profile's `overhead` (context, collective buffers,
    allocator slack: not allocated tensors), what torch.cuda.max_memory_allocated() measures; `total_gb` the whole
    prediction; `step_s` the step time and `time_s` its parts."""
    from .cost import Layout, TrainOptions, estimate
    from .hw import load_profile
    from .models import resolve_model

    m = resolve_model(point["model"]).with_layers(int(point["layers"]))
    prof = load_profile(hw)
    e = estimate(m, prof, 1, Layout(), TrainOptions(micro_batch_tokens=int(point["seq"]),
                                                    recompute=point["recompute"], lm_head=point["lm_head"],
                                                    keep_layers=int(point.get("keep_layers", 0)),
                                                    keep_selections=bool(point.get("keep_selections"))),
                 ep_path=bool(point.get("ep_path")))
    return {"allocated_gb": e.total_gb - e.memory_gb["overhead"], "total_gb": e.total_gb,
            "step_s": e.step_time_s, "time_s": dict(e.time_s)}


def point_errors(point: dict) -> tuple[float | None, float | None]:
    """(memory, time) relative error of a measured point's prediction: predicted / measured − 1 (None where the
    point has no such measurement: it did not run, or it ran where memory is not counted)."""
    if "error" in point or "step_s" not in point:
        return None, None
    p = point["predicted"]
    mem = point.get("peak_allocated_gb")
    return (p["allocated_gb"] / mem - 1 if mem else None), p["step_s"] / point["step_s"] - 1


def summarize(points) -> dict:
    """The grid's worst errors: `memory_error` and `time_error` over every measured point (fractions), and the
    same split into the points the efficiencies are fit on and the held-out ones (`errors`)."""
    out = {"errors": {}}
    for group in ("all", "fit", "held_out"):
        mem, tim = [], []
        for pt in points:
            if group != "all" and pt.get("role") != group:
                continue
            me, te = point_errors(pt)
            if me is not None:
                mem.append(abs(me))
            if te is not None:
                tim.append(abs(te))
        out["errors"][group] = {"memory": max(mem, default=0.0), "time": max(tim, default=0.0),
                                "points": len(tim)}
    out["memory_error"] = out["errors"]["all"]["memory"]
    out["time_error"] = out["errors"]["all"]["time"]
    return out
