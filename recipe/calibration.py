"""Committed calibration measurements: which hardware profiles have their predictions checked against a measured
grid, and how far off the cost model is on it.

`hw_profiles/calibration/<name>.json` holds the grid measured on that accelerator (bench/calibrate.py writes it):
the environment it ran in and, for each point, the configuration, the measured peak memory and step time and the
cost model's prediction at the time. A profile with such a file has `measured` predictions; every other profile's
are `assumed`. Pure Python: never imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources


@dataclass(frozen=True)
class Calibration:
    hw: str
    memory_error: float  # worst |predicted − measured| / measured peak memory over the grid (a fraction)
    time_error: float  # the same for step time
    points: tuple[dict, ...]
    environment: dict

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
                       points=tuple(data.get("points", ())), environment=dict(data.get("environment", {})))


def basis(hw: str) -> str:
    """`measured` when the profile has a committed calibration grid, `assumed` otherwise."""
    return "measured" if load(hw) is not None else "assumed"
