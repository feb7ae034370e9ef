"""Atomic distributed checkpoints with torch.distributed.checkpoint (DCP).

    save(out_dir, step, {"optim": optimizer, "train": TrainState(step, {"position": p})})
    found = latest(out_dir)                      # (step, path) of the last complete checkpoint, or None
    load(found[1], {"optim": optimizer, "train": train_state})

Every rank writes only its own shards (a DTensor / FSDP2 parameter saves its local piece), so a checkpoint saved at
one world size loads at another, including one process without a process group: DCP reshards on load.

The commit. All ranks write into `DIR/checkpoints/.step_N.tmp`; after DCP has written every rank's shards and its
`.metadata` (DCP's save returns only then, on every rank), rank 0 writes a small `COMPLETE` record into the folder,
fsyncs it, and renames the folder to `DIR/checkpoints/step_N`. The rename is the commit: a crash before it leaves
only the `.tmp` folder, which `latest` never returns and the next save removes; a crash after it leaves a complete
checkpoint. The last good checkpoint is never written to. Every rank returns from `save` only after the commit.
On several nodes `DIR` must be one shared filesystem (every rank writes into the same folder).

What is saved is what the caller passes: any Stateful — the trainer's optimizer, `launch.optim.MasterAdamW`, whose
state (fp32 masters, moments, step) is keyed by parameter name only, so FSDP2-sharded state is saved shard by shard
and loads into any sharding or none — `TrainState` (the step, a small JSON-able record such as the data position, and
each rank's RNG streams), or any dict of tensors.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from launch.checkpoint_index import (MARKER, checkpoints_dir, complete_steps, is_complete, latest, read_marker,
                                     step_dir, tmp_dir)

__all__ = ["CheckpointError", "TrainState", "latest", "load", "save"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read; one line naming the folder and the cause."""


# ---- state -------------------------------------------------------------------------------------------------------
class TrainState(Stateful):
    """The trainer's own state: `step`, a small JSON-able `data` record (data position, epoch, anything small) and
    this rank's RNG streams (python `random`, torch CPU, and the current CUDA device's when CUDA is available).

    `step` and `data` are global: rank 0's copy is saved and every rank loads it. The RNG streams are per rank
    (saved under `rng.rank<R>`); `load` restores a rank's streams when the checkpoint holds that rank's, i.e. when
    the world size has not grown, and leaves them as they are otherwise (`rng_restored` is then False: a new world
    size cannot replay the old streams anyway)."""

    def __init__(self, step: int = 0, data: dict | None = None, *, rng: bool = True):
        self.step = int(step)
        self.data = dict(data or {})
        self.rng = rng
        self.rng_restored: bool | None = None  # set by load
        self._available: frozenset[str] | None = None  # the checkpoint's keys under this entry, set by load

    def state_dict(self) -> dict:
        rank = _global_rank()
        out: dict = {}
        loading = self._available is not None
        if rank == 0 or loading:  # one authoritative copy of the global record: rank 0's
            out["json"] = json.dumps({"step": self.step, "data": self.data}, sort_keys=True)
        if self.rng:
            mine = f"rank{rank}"
            rng = {"python": json.dumps(random.getstate()), "torch": torch.get_rng_state()}
            if torch.cuda.is_available():
                rng["cuda"] = torch.cuda.get_rng_state()
            if loading:  # ask only for what the checkpoint holds
                rng = {k: v for k, v in rng.items() if f"rng.{mine}.{k}" in self._available}
            if rng:
                out["rng"] = {mine: rng}
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        try:
            record = json.loads(state_dict["json"])
            self.step, self.data = int(record["step"]), dict(record["data"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"the checkpoint's train state is unreadable ({type(e).__name__})") from None
        rng = state_dict.get("rng", {}).get(f"rank{_global_rank()}", {})
        if "python" in rng:
            version, internal, gauss = json.loads(rng["python"])
            random.setstate((version, tuple(internal), gauss))
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        self.rng_restored = "python" in rng and "torch" in rng
        self._available = None

    def __repr__(self) -> str:
        return f"TrainState(step={self.step}, data={self.data!r})"


# ---- save --------------------------------------------------------------------------------------------------------
def save(out_dir: str | Path, step: int, state: dict, *, process_group=None, keep_last: int | None = None) -> Path:
    """Save `state` (name → Stateful or dict of tensors) as checkpoint `step` under `out_dir`; every rank of
    `process_group` (default: the world, or one process without a process group) calls it. Returns the committed
    folder `out_dir/checkpoints/step_<step>`. `keep_last`: afterwards delete all but the newest N complete
    checkpoints. A save of a step that already has a checkpoint replaces it (the old one stays until the commit)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"checkpoint step must be a non-negative integer, got {step!r}")
    if keep_last is not None and keep_last < 1:
        raise CheckpointError(f"keep_last must be at least 1, got {keep_last}")
    tmp, final = tmp_dir(out_dir, step), step_dir(out_dir, step)
    distributed = _distributed()
    world = dist.get_world_size(process_group) if distributed else 1

    def prepare() -> None:
        root = checkpoints_dir(out_dir)
        root.mkdir(parents=True, exist_ok=True)
        for stale in _uncommitted(root):  # earlier crashed saves (and this step's own, if it crashed before)
            _remove(stale)
        tmp.mkdir()

    _on_rank0(prepare, process_group, f"cannot prepare {tmp}")
    try:
        with warnings.catch_warnings():  # DCP warns when it runs without a process group; that is intended here
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, checkpoint_id=str(tmp), process_group=process_group, no_dist=not distributed)
    except (Exception, CheckpointException) as e:  # DCP raises (a BaseException) on every rank when any rank failed
        raise CheckpointError(f"cannot save checkpoint {final}: {_first_line(e)}") from e

    def commit() -> None:
        record = {"step": step, "world_size": world, "time": time.time(), "torch": torch.__version__}
        _write_synced(tmp / MARKER, json.dumps(record) + "\n")
        old = final.parent / f".{final.name}.replaced"
        if final.exists():
            os.replace(final, old)  # the previous checkpoint of this step goes only once the new one is whole
        os.replace(tmp, final)  # the commit
        _fsync_dir(final.parent)
        if old.exists():
            _remove(old)
        if keep_last is not None:
            for _, path in complete_steps(out_dir)[:-keep_last]:
                _remove(path)

    _on_rank0(commit, process_group, f"cannot commit {final}")
    return final


# ---- load --------------------------------------------------------------------------------------------------------
def load(path: str | Path, state: dict, *, process_group=None) -> dict:
    """Load checkpoint `path` (a complete `step_N` folder) into `state`: Stateful entries are loaded in place, dicts
    of tensors are filled in place. Works at any world size, and in one process without a process group. Returns the
    checkpoint's COMPLETE record (step, world_size, time)."""
    path = Path(path)
    if not is_complete(path):
        why = "no such folder" if not path.exists() else "not a complete checkpoint (no COMPLETE or .metadata)"
        raise CheckpointError(f"cannot load {path}: {why}")
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = frozenset(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    except Exception as e:
        raise CheckpointError(f"cannot read {path}/.metadata: {_first_line(e)}") from e
    for name, value in state.items():
        if isinstance(value, TrainState):
            value._available = frozenset(k[len(name) + 1:] for k in keys if k.startswith(name + "."))
    missing = sorted(name for name in state if not any(k == name or k.startswith(name + ".") for k in keys))
    if missing:
        raise CheckpointError(f"cannot load {path}: it holds no {', '.join(map(repr, missing))} "
                              f"(it holds {', '.join(sorted({k.split('.')[0] for k in keys}))})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(path), process_group=process_group, no_dist=not _distributed())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"cannot load {path}: {_first_line(e)}") from e
    finally:
        for value in state.values():
            if isinstance(value, TrainState):
                value._available = None
    return read_marker(path)


# ---- helpers -----------------------------------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _global_rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _on_rank0(fn, group, what: str) -> None:
    """Run `fn` on the group's rank 0; every rank waits for it and raises the same CheckpointError if it failed
    (so no rank is left waiting at a barrier for a rank that gave up)."""
    error = None
    if not _distributed() or dist.get_rank(group) == 0:
        try:
            fn()
        except OSError as e:
            error = f"{what}: {e.strerror or e}"
        except Exception as e:  # anything else: still one line on every rank, never a rank left waiting
            error = f"{what}: {_first_line(e)}"
    if _distributed():
        box = [error]
        dist.broadcast_object_list(box, group=group, group_src=0)
        error = box[0]
    if error is not None:
        raise CheckpointError(error)


def _uncommitted(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if p.name.startswith(".step_")]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (POSIX); a filesystem that cannot fsync a folder is left to its own guarantees."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _first_line(e: BaseException) -> str:
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        rank, wrapped = min(failures.items(), key=lambda kv: kv[0])
        cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {_first_line(cause)}"
    text = " ".join(str(e).split())
    text = text or type(e).__name__
    return text if len(text) <= 300 else text[:299] + "…"
