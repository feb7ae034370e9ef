"""Where checkpoints live under a run's output folder, and which of them are complete. Torch-free, so that the
launcher's pre-flight checks can read it before any worker starts (launch/checkpoint.py writes and reads the
checkpoints themselves).

Layout:

    DIR/checkpoints/step_40/            a complete checkpoint: DCP's .metadata and __R_S.distcp files, and COMPLETE
    DIR/checkpoints/.step_50.tmp/       a save in progress, or one that crashed: ignored, removed by the next save

The commit is the rename of `.step_N.tmp` to `step_N`, done by one process after every rank has written its shards.
`COMPLETE` is written into the folder before the rename; a `step_N` without it (copied by hand, or from another
tool) is not treated as complete.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

CHECKPOINTS = "checkpoints"
MARKER = "COMPLETE"
_STEP = re.compile(r"^step_(\d+)$")
_TMP = re.compile(r"^\.step_(\d+)\.tmp$")


def checkpoints_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / CHECKPOINTS


def step_dir(out_dir: str | Path, step: int) -> Path:
    """The committed folder of step `step`."""
    return checkpoints_dir(out_dir) / f"step_{step}"


def tmp_dir(out_dir: str | Path, step: int) -> Path:
    """The folder a save of step `step` writes into before its commit."""
    return checkpoints_dir(out_dir) / f".step_{step}.tmp"


def step_dirs(out_dir: str | Path) -> list[tuple[int, Path]]:
    """Every `step_N` folder, complete or not, by step."""
    root = checkpoints_dir(out_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()]
    return sorted(found)


def partial_dirs(out_dir: str | Path) -> list[Path]:
    """Saves that never committed (`.step_N.tmp`): a crash mid-save, or a save in progress."""
    root = checkpoints_dir(out_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _TMP.match(p.name) and p.is_dir())


def is_complete(path: str | Path) -> bool:
    """A committed checkpoint folder: named `step_N`, holding its COMPLETE marker and DCP's metadata."""
    p = Path(path)
    return bool(_STEP.match(p.name)) and (p / MARKER).is_file() and (p / ".metadata").is_file()


def complete_steps(out_dir: str | Path) -> list[tuple[int, Path]]:
    """Every complete checkpoint, oldest first."""
    return [(s, p) for s, p in step_dirs(out_dir) if is_complete(p)]


def latest(out_dir: str | Path) -> tuple[int, Path] | None:
    """(step, path) of the last complete checkpoint under `out_dir`, or None."""
    done = complete_steps(out_dir)
    return done[-1] if done else None


def read_marker(path: str | Path) -> dict:
    """The small JSON record a committed checkpoint carries (step, world size, time); {} when unreadable."""
    try:
        data = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
