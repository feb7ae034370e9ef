"""Writing plans: the plan as plain data, YAML/JSON text, atomic writes, sizes. No pydantic here — the solve
path must start fast; recipe/plan.py holds the schema that validates plans read back from disk.

Pure Python: never imports torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from . import __version__
from ._data import Record, plain
from .hw import HwProfile
from .models import ModelShape

SCHEMA_VERSION = 1
MAX_INT = 1 << 40  # beyond any real token count or GPU count: rejects absurd values before arithmetic
# the largest value of a count among the inputs (every other count: MAX_INT); the CLI and the plan schema read them
INPUT_LIMITS = {"layers": 100_000, "micro_batches": 1_000_000, "ep_overlap_chunks": 4096}
MAX_SPEC_CHARS = 4096  # a model or hardware name or path


@dataclass(frozen=True, kw_only=True)
class SolveInputs(Record):
    """What a plan is solved from. The one definition of these fields: the plan schema's `inputs` block
    (recipe.plan.Inputs) is built from them, with the bounds of INPUT_LIMITS."""

    model: str
    seq_len: int
    hw: str
    gpus: int | None = None  # None: the smallest count that fits
    layers: int | None = None
    recompute: Literal["full", "none", "auto"] = "full"  # auto: the solver's choice (the plan's train.recompute)
    lm_head: Literal["fused", "lean", "naive"] = "fused"
    micro_batch_tokens: int | None = None  # None: seq_len
    micro_batches: int = 1
    ep_overlap_chunks: int | None = None  # None: chosen from the local sequence
    # degrees fixed by the user ({"ep": 2}; `recipe check` re-solves with the same pins); None or {}: all solved
    pins: dict[Literal["pp", "tp", "cp", "ep"], int] | None = None

    def __post_init__(self) -> None:
        for n in ("seq_len", "gpus", "layers", "micro_batch_tokens", "micro_batches", "ep_overlap_chunks"):
            v = getattr(self, n)
            if v is not None and (not isinstance(v, int) or not 0 < v <= INPUT_LIMITS.get(n, MAX_INT)):
                raise ValueError(f"{n} must be a positive integer up to {INPUT_LIMITS.get(n, MAX_INT)}, got {v!r}")
        if self.pins:
            from .solver import normalize_pins

            pins = normalize_pins(self.pins)
            big = [k for k, v in pins.items() if v > MAX_INT]
            if big:
                raise ValueError(f"--{big[0]} must be a positive integer up to {MAX_INT}, got {pins[big[0]]}")
            object.__setattr__(self, "pins", pins)  # layout order: pp, tp, cp, ep
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < self.seq_len:
            raise ValueError(f"--micro-batch-tokens {self.micro_batch_tokens:,} < --seq {self.seq_len:,}: a micro-batch "
                             f"holds whole (packed) sequences; CP splits a long sequence across GPUs, micro-batches "
                             f"never do")

def _relative(spec: str, base_dir: Path | None) -> str:
    """A path-like spec is looked up next to the plan first, then from the working directory."""
    if base_dir is not None and ("/" in spec or spec.endswith((".json", ".yaml", ".yml"))):
        cand = base_dir / spec
        if cand.exists():
            return str(cand)
    return spec


def fingerprint(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


# ---- sizes -----------------------------------------------------------------------------------------------------
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmM]?)\s*$", re.ASCII)


def parse_size(text: str) -> int:
    """'128k' → 131072, '1m' → 1048576, '4096' → 4096 (k and m are powers of two, as sequence lengths are). Exact
    arithmetic: '1.5k' is 1536, '0.1k' is not a whole number of tokens; at most MAX_INT."""
    mt = _SIZE.match(str(text))
    if not mt:
        raise ValueError(f"malformed size {_shown(text)}: expected a number with an optional k or m suffix, e.g. 128k")
    whole, _, frac = mt.group(1).partition(".")
    frac = frac.rstrip("0")
    if len(whole.lstrip("0")) > 15 or len(frac) > 15:
        raise ValueError(f"size {_shown(text)} is out of range: at most {MAX_INT:,} tokens")
    num = int(whole + frac) * {"": 1, "k": 1024, "m": 1024 * 1024}[mt.group(2).lower()]
    value, rest = divmod(num, 10 ** len(frac))
    if rest or value <= 0:
        raise ValueError(f"malformed size {_shown(text)}: must be a positive whole number of tokens")
    if value > MAX_INT:
        raise ValueError(f"size {_shown(text)} is out of range: at most {MAX_INT:,} tokens")
    return value


def _shown(text) -> str:
    s = repr(str(text))
    return s if len(s) <= 60 else s[:59] + "…"


def format_size(n: int) -> str:
    for unit, f in (("m", 1 << 20), ("k", 1 << 10)):
        if n % f == 0:
            return f"{n // f}{unit}"
    return str(n)


# ---- building, writing, loading -------------------------------------------------------------------------------
def launch_block(hw: HwProfile, world: int) -> dict:
    from .cost import gpus_per_node_used

    nproc = gpus_per_node_used(hw, world)
    env = {}
    if hw.vendor == "nvidia":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # less fragmentation at long sequences
    elif hw.vendor == "amd":
        env["PYTORCH_HIP_ALLOC_CONF"] = "expandable_segments:True"
    return {"nnodes": math.ceil(world / nproc), "nproc_per_node": nproc,
            "backend": "gloo" if hw.collective == "gloo" else "nccl", "env": env}


def _inputs_block(inputs) -> dict:
    """The inputs as plain data; `pins` only when some degree is pinned (plans without pins stay as they were)."""
    data = plain(inputs)
    if not data.get("pins"):
        data.pop("pins", None)
    return data


def plan_dict(inputs, m: ModelShape, hw: HwProfile, sol) -> dict:
    """The plan for a solution as plain data, in schema v1's key order."""
    e, d = sol.estimate, sol.decisions
    return {
        "schema": SCHEMA_VERSION,
        "solver": {"version": __version__, "hw_fingerprint": fingerprint(hw.fingerprint_dict()),
                   "model_fingerprint": fingerprint(m.fingerprint_dict())},
        "inputs": _inputs_block(inputs),
        "layout": dict(sol.degrees),
        "train": {"recompute": sol.opts.recompute,
                  **({"keep_layers": sol.opts.keep_layers} if sol.opts.keep_layers else {}),
                  **({"keep_selections": True} if sol.opts.keep_selections else {}),
                  "lm_head": sol.opts.lm_head,
                  "ep_overlap_chunks": sol.opts.ep_overlap_chunks, "micro_batch_tokens": sol.opts.micro_batch_tokens,
                  "micro_batches": sol.opts.micro_batches, **_pp_stages(m, hw, sol),
                  "optimizer": {"name": "adamw", "master_dtype": "fp32"}},
        "prediction": {"memory_gb": {k: round(v, 2) for k, v in e.memory_gb.items()},
                       "lm_head_unfused_gb": round(e.lm_head_unfused_gb, 2), "step_time_s": round(e.step_time_s, 4),
                       "tokens_per_s_per_gpu": round(e.tokens_per_s_per_gpu, 1),
                       "tflops_per_gpu": round(e.tflops_per_gpu, 1),
                       "mfu": {"hardware": round(e.mfu_hardware, 4), "model": round(e.mfu_model, 4)},
                       **_margin_block(e)},
        "reasons": {**{k: _decision_reason(d[k]) for k in ("tp", "ep", "cp", "pp")},
                    **({"gpus": _decision_reason(sol.count)} if getattr(sol, "count", None) is not None else {}),
                    **({"recompute": _decision_reason(sol.recompute)} if getattr(sol, "recompute", None) is not None
                       else {})},
        "launch": launch_block(hw, sol.world),
    }


def _pp_stages(m: ModelShape, hw, sol) -> dict:
    """`pp_stages` (layers per pipeline stage, balanced in time by the cost model on the plan's hardware) when the
    layout pipelines; nothing at pp = 1 (plans without a pipeline stay as they were)."""
    if sol.layout.pp == 1:
        return {}
    from .cost import pipeline_split

    return {"pp_stages": pipeline_split(m, sol.layout.pp, sol.opts, hw)}


def _margin_block(e) -> dict:
    """headroom_gb, margin_gb (by term), basis and error of the prediction (recipe/margin.py); nothing for an
    estimate made without a margin."""
    from .margin import margin_of

    mg = margin_of(e)
    if mg is None:
        return {}
    parts = {k: round(v, 2) for k, v in mg.parts_gb.items()}
    return {"headroom_gb": round(e.headroom_gb, 2), "margin_gb": {**parts, "total": round(mg.total_gb, 2)},
            "basis": dict(mg.bands.basis), "error": {k: round(v, 4) for k, v in mg.bands.error.items()}}


def _decision_reason(dec) -> str:
    """'constraint: reason (rejected …)', the plan's `reasons` entry for a decision."""
    return f"{dec.constraint}: {dec.reason}" + (f" (rejected {dec.rejected})" if dec.rejected else "")


def dumps(plan, fmt: Literal["yaml", "json"] = "yaml") -> str:
    """A plan (schema object or plain dict) as YAML with a one-line header, or as JSON."""
    import yaml

    data = plan if isinstance(plan, dict) else plan.to_dict()
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    inp, lay = data["inputs"], data["layout"]
    world = lay["pp"] * lay["tp"] * lay["cp"] * lay["dp"]
    header = (f"# recipe plan: {inp['model']} at {format_size(inp['seq_len'])} tokens on {world}x {inp['hw']}. "
              f"Written by `recipe solve`; check with `recipe check`.\n")
    return header + yaml.safe_dump(data, sort_keys=False, width=120, allow_unicode=True)


def write_atomic(path: Path, text: str, *, flag: str = "-o", inputs: dict | None = None) -> Path:
    """Write next to the target and rename, so an interrupted write never leaves a half plan behind; symlinks are
    followed and the mode kept, devices, directories and the command's own inputs refused (recipe/safeio.py)."""
    from .safeio import write_atomic as _write

    return _write(path, text, flag=flag, inputs=inputs)
