"""Plan schema v1: the single source of truth that `recipe solve` writes, `recipe check` verifies and
`recipe launch` runs. Loading never raises anything but `PlanError` (one line, naming the file and field).

Pure Python: never imports torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from . import __version__
from ._data import plain
from .cost import TrainOptions
from .hw import HwProfile, load_profile
from .models import ModelShape, resolve_model

SCHEMA_VERSION = 1
MAX_INT = 1 << 40  # beyond any real token count or GPU count: rejects absurd values before arithmetic


class PlanError(ValueError):
    """A plan that cannot be used: malformed, wrong types, unknown keys, inconsistent."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True, allow_inf_nan=False)


class Inputs(_Strict):
    model: str = Field(min_length=1, max_length=4096)
    seq_len: int = Field(gt=0, le=MAX_INT)
    hw: str = Field(min_length=1, max_length=4096)
    gpus: int | None = Field(None, gt=0, le=MAX_INT)  # None: the smallest count that fits
    layers: int | None = Field(None, gt=0, le=100_000)
    recompute: Literal["full", "none"] = "full"
    lm_head: Literal["fused", "naive"] = "fused"
    micro_batch_tokens: int | None = Field(None, gt=0, le=MAX_INT)  # None: seq_len
    micro_batches: int = Field(1, gt=0, le=1_000_000)
    ep_overlap_chunks: int | None = Field(None, gt=0, le=4096)  # None: chosen from the local sequence


class SolverInfo(_Strict):
    version: str
    hw_fingerprint: str = Field(pattern=r"^[0-9a-f]{16}$")
    model_fingerprint: str = Field(pattern=r"^[0-9a-f]{16}$")


class LayoutSpec(_Strict):
    pp: int = Field(gt=0, le=MAX_INT)
    tp: int = Field(gt=0, le=MAX_INT)
    cp: int = Field(gt=0, le=MAX_INT)
    ep: int = Field(gt=0, le=MAX_INT)
    dp: int = Field(gt=0, le=MAX_INT)
    etp: int = Field(gt=0, le=MAX_INT)
    edp: int = Field(gt=0, le=MAX_INT)

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.cp * self.dp

    @model_validator(mode="after")
    def _products(self) -> "LayoutSpec":
        world = self.world
        if self.pp * self.ep * self.etp * self.edp != world:
            raise ValueError(f"pp·ep·etp·edp = {self.pp}·{self.ep}·{self.etp}·{self.edp} = "
                             f"{self.pp * self.ep * self.etp * self.edp} but pp·tp·cp·dp = {self.pp}·{self.tp}·"
                             f"{self.cp}·{self.dp} = {world}")
        return self


class Optimizer(_Strict):
    name: Literal["adamw"] = "adamw"
    master_dtype: Literal["fp32"] = "fp32"


class TrainSpec(_Strict):
    recompute: Literal["full", "none"]
    lm_head: Literal["fused", "naive"]
    ep_overlap_chunks: int = Field(gt=0, le=4096)
    micro_batch_tokens: int = Field(gt=0, le=MAX_INT)
    micro_batches: int = Field(gt=0, le=1_000_000)
    optimizer: Optimizer = Optimizer()


class MemoryGB(_Strict):
    weights: float
    grads: float
    master: float
    optimizer: float
    activations: float
    lm_head: float
    overhead: float
    total: float
    usable: float


class Mfu(_Strict):
    hardware: float
    model: float


class Prediction(_Strict):
    memory_gb: MemoryGB
    lm_head_unfused_gb: float
    step_time_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    mfu: Mfu


class Reasons(_Strict):
    tp: str
    ep: str
    cp: str
    pp: str


class LaunchSpec(_Strict):
    nnodes: int = Field(gt=0, le=MAX_INT)
    nproc_per_node: int = Field(gt=0, le=MAX_INT)
    backend: Literal["nccl", "gloo"]
    env: dict[str, str] = {}


class Plan(_Strict):
    schema_: Literal[1] = Field(SCHEMA_VERSION, alias="schema")
    solver: SolverInfo
    inputs: Inputs
    layout: LayoutSpec
    train: TrainSpec
    prediction: Prediction
    reasons: Reasons
    launch: LaunchSpec

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, defer_build=True)

    @model_validator(mode="after")
    def _launch_matches_layout(self) -> "Plan":
        if self.launch.nnodes * self.launch.nproc_per_node != self.layout.world:
            raise ValueError(f"launch nnodes·nproc_per_node = {self.launch.nnodes}·{self.launch.nproc_per_node} "
                             f"≠ world {self.layout.world} of the layout")
        if self.inputs.gpus is not None and self.inputs.gpus != self.layout.world:
            raise ValueError(f"inputs.gpus = {self.inputs.gpus} but the layout covers {self.layout.world} GPUs")
        return self

    # ---- what the plan was solved from ----
    def model_shape(self, base_dir: Path | None = None) -> ModelShape:
        m = resolve_model(_relative(self.inputs.model, base_dir))
        return m.with_layers(self.inputs.layers) if self.inputs.layers else m

    def hw_profile(self, base_dir: Path | None = None) -> HwProfile:
        return load_profile(_relative(self.inputs.hw, base_dir))

    def train_options(self) -> TrainOptions:
        return TrainOptions(recompute=self.train.recompute, lm_head=self.train.lm_head,
                            ep_overlap_chunks=self.train.ep_overlap_chunks,
                            micro_batch_tokens=self.train.micro_batch_tokens,
                            micro_batches=self.train.micro_batches)

    def to_dict(self) -> dict:
        return plain(self)



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
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_size(text: str) -> int:
    """'128k' → 131072, '1m' → 1048576, '4096' → 4096 (k and m are powers of two, as sequence lengths are)."""
    mt = _SIZE.match(str(text))
    if not mt:
        raise ValueError(f"malformed size {text!r}: expected a number with an optional k or m suffix, e.g. 128k")
    value = float(mt.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[mt.group(2).lower()]
    if value != int(value) or value <= 0:
        raise ValueError(f"malformed size {text!r}: must be a positive whole number of tokens")
    return int(value)


def format_size(n: int) -> str:
    for unit, f in (("m", 1 << 20), ("k", 1 << 10)):
        if n % f == 0:
            return f"{n // f}{unit}"
    return str(n)


# ---- building, writing, loading -------------------------------------------------------------------------------
def launch_block(hw: HwProfile, world: int) -> LaunchSpec:
    nproc = min(world, hw.gpus_per_node)
    if world % nproc:
        raise ValueError(f"{world} GPUs do not fill whole nodes of {hw.gpus_per_node}")
    env = {}
    if hw.vendor == "nvidia":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # less fragmentation at long sequences
    elif hw.vendor == "amd":
        env["PYTORCH_HIP_ALLOC_CONF"] = "expandable_segments:True"
    return LaunchSpec.model_construct(nnodes=math.ceil(world / nproc), nproc_per_node=nproc,
                                      backend="gloo" if hw.collective == "gloo" else "nccl", env=env)


def build_plan(inputs: Inputs, m: ModelShape, hw: HwProfile, sol) -> Plan:
    """The plan for a solution. Built from the solver's own values without re-validating them (validation is
    for plans read from disk; tests check that every built plan validates)."""
    e, d = sol.estimate, sol.decisions
    mem = {k: round(v, 2) for k, v in e.memory_gb.items()}

    def reason(k: str) -> str:
        dec = d[k]
        return f"{dec.constraint}: {dec.reason}" + (f" (rejected {dec.rejected})" if dec.rejected else "")

    C = BaseModel.model_construct.__func__  # noqa: N806
    return C(Plan, schema_=SCHEMA_VERSION,
             solver=C(SolverInfo, version=__version__, hw_fingerprint=fingerprint(hw.fingerprint_dict()),
                      model_fingerprint=fingerprint(m.fingerprint_dict())),
             inputs=inputs,
             layout=C(LayoutSpec, **sol.degrees),
             train=C(TrainSpec, recompute=sol.opts.recompute, lm_head=sol.opts.lm_head,
                     ep_overlap_chunks=sol.opts.ep_overlap_chunks, micro_batch_tokens=sol.opts.micro_batch_tokens,
                     micro_batches=sol.opts.micro_batches, optimizer=C(Optimizer, name="adamw", master_dtype="fp32")),
             prediction=C(Prediction, memory_gb=C(MemoryGB, **mem), lm_head_unfused_gb=round(e.lm_head_unfused_gb, 2),
                          step_time_s=round(e.step_time_s, 4),
                          tokens_per_s_per_gpu=round(e.tokens_per_s_per_gpu, 1),
                          tflops_per_gpu=round(e.tflops_per_gpu, 1),
                          mfu=C(Mfu, hardware=round(e.mfu_hardware, 4), model=round(e.mfu_model, 4))),
             reasons=C(Reasons, tp=reason("tp"), ep=reason("ep"), cp=reason("cp"), pp=reason("pp")),
             launch=launch_block(hw, sol.world))


def dumps(plan: Plan, fmt: Literal["yaml", "json"] = "yaml") -> str:
    data = plan.to_dict()
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    header = (f"# recipe plan: {plan.inputs.model} at {format_size(plan.inputs.seq_len)} tokens on "
              f"{plan.layout.world}x {plan.inputs.hw}. Written by `recipe solve`; check with `recipe check`.\n")
    return header + yaml.safe_dump(data, sort_keys=False, width=120, allow_unicode=True)


def write_atomic(path: Path, text: str) -> None:
    """Write next to the target and rename, so an interrupted write never leaves a half plan behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def parse_plan(text: str, origin: str = "<plan>") -> Plan:
    try:
        data = _decode(text)
    except (yaml.YAMLError, json.JSONDecodeError, ValueError, TypeError, OverflowError, RecursionError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PlanError(f"{origin}: not valid YAML/JSON ({_one_line(first)})") from None
    except Exception as e:  # the loader's contract: nothing but PlanError, whatever the text
        raise PlanError(f"{origin}: not valid YAML/JSON ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise PlanError(f"{origin}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return Plan.model_validate(data)
    except ValidationError as e:
        errs = e.errors()
        # unknown keys first: the most actionable line when a hand edit misspells a field
        err = min(errs, key=lambda x: x.get("type") != "extra_forbidden")
        loc = ".".join(_one_line(str(x), 60) for x in err.get("loc", ())) or "(top level)"
        msg = _one_line(err.get("msg", "invalid"))
        if err.get("type") == "extra_forbidden":
            msg = "unknown key"
        elif tuple(err.get("loc", ())) == ("schema",):
            msg = f"unsupported plan schema {_one_line(repr(err.get('input')), 40)}: this recipe reads schema " \
                  f"{SCHEMA_VERSION}"
        extra = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        raise PlanError(f"{origin}: field {loc}: {msg}{extra}") from None
    except (RecursionError, OverflowError, TypeError, ValueError) as e:
        raise PlanError(f"{origin}: unusable plan ({type(e).__name__})") from None


def _decode(text: str):
    """JSON when it looks like JSON and parses as JSON; YAML otherwise (a YAML flow mapping also starts with '{')."""
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return yaml.safe_load(text)


def _one_line(text: str, limit: int = 200) -> str:
    """Control characters escaped and length bounded, so that an error is always exactly one short line."""
    s = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def load_plan(path: str | Path) -> Plan:
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise PlanError(f"plan not found: {p}") from None
    except IsADirectoryError:
        raise PlanError(f"{p} is a directory, not a plan file") from None
    except OSError as e:
        raise PlanError(f"cannot read plan {p}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise PlanError(f"{p}: not UTF-8 text") from None
    return parse_plan(text, str(p))
