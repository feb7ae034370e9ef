"""Which files hold a Hugging Face safetensors checkpoint (torch-free: `recipe launch` checks a checkpoint with it
before any worker starts, and launch/hf_io.py reads the files it names)."""

from __future__ import annotations

import json
from pathlib import Path

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: a directory holding a sharded `model.safetensors.index.json` (every
    shard it names must be there) or `model.safetensors`, or a .safetensors file itself. ValueError naming what is
    missing otherwise."""
    path = Path(path)
    if path.is_file():
        return [path]
    if (path / INDEX).exists():
        try:
            shards = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path / INDEX} is not a safetensors index (a JSON object with a weight_map of tensor "
                             f"name to file): {type(e).__name__}: {e}") from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ValueError(f"{path / INDEX} names {len(missing)} shard(s) missing from {path}: "
                             f"{', '.join(missing[:3])}{' …' if len(missing) > 3 else ''}")
        return [path / s for s in shards]
    if (path / SINGLE).exists():
        return [path / SINGLE]
    if not path.exists():
        raise ValueError(f"no such file or folder: {path}")
    found = sorted(p.name for p in path.glob("*")) if path.is_dir() else []
    raise ValueError(f"no safetensors checkpoint at {path} (expected {SINGLE} or {INDEX}; found {found[:10]})")
