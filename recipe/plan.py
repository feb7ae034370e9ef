"""Plan schema v1: the single source of truth that `recipe solve` writes, `recipe check` verifies and
`recipe launch` runs. Loading never raises anything but `PlanError` (one line, naming the file and field).

Pure Python: never imports torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from ._data import plain
from .cost import TrainOptions
from .hw import HwProfile, load_profile
from .models import ModelShape, resolve_model

from .planfile import INPUT_LIMITS, MAX_INT, MAX_SPEC_CHARS, SCHEMA_VERSION, SolveInputs, _inputs_block, _relative, plan_dict
from .planfile import dumps, format_size, parse_size, write_atomic  # noqa: F401  (re-exported: plan I/O in one place)
from .text import one_line


MAX_PLAN_BYTES = 64 * 1024  # a plan is about 2 KB; anything this large is not one (and YAML parses it slowly)


class PlanError(ValueError):
    """A plan that cannot be used: malformed, wrong types, unknown keys, inconsistent."""


class _Strict(BaseModel):
    # strict: `seq_len: true` is not 1 and `4096.5` (or "4096") is not a count; floats accept whole numbers
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True, allow_inf_nan=False, strict=True)


class _InputsRules(_Strict):
    @model_validator(mode="after")
    def _whole_sequences(self) -> "_InputsRules":
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < self.seq_len:
            raise ValueError(f"micro_batch_tokens {self.micro_batch_tokens} < seq_len {self.seq_len}: a micro-batch "
                             f"holds whole sequences")
        return self


def _inputs_schema() -> type[_Strict]:
    """The `inputs` block: SolveInputs's fields, types and defaults, each count within (0, INPUT_LIMITS or MAX_INT]
    and each name or path 1..MAX_SPEC_CHARS characters; absent, null or {} pins: every degree solved."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(SolveInputs)
    fields = {}
    for f in dataclasses.fields(SolveInputs):
        tp, default = hints[f.name], (... if f.default is dataclasses.MISSING else f.default)
        if tp is str:
            fields[f.name] = (tp, Field(default, min_length=1, max_length=MAX_SPEC_CHARS))
        elif int in typing.get_args(tp) or tp is int:
            fields[f.name] = (tp, Field(default, gt=0, le=INPUT_LIMITS.get(f.name, MAX_INT)))
        elif f.name == "pins":
            key = typing.get_args(typing.get_args(tp)[0])[0]
            fields[f.name] = (dict[key, Annotated[int, Field(gt=0, le=MAX_INT)]] | None, default)
        else:
            fields[f.name] = (tp, default)
    return create_model("Inputs", __base__=_InputsRules, **fields)


Inputs = _inputs_schema()


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
    # under full recompute, the decoder layers at the end of each pipeline stage that keep their activations (the
    # solver's partial recompute, `--recompute auto`); written when not 0
    keep_layers: int = Field(0, ge=0, le=100_000)
    # DeepSeek sparse attention under full recompute: the recomputed layers keep their indexer's selection from the
    # forward instead of running the indexer again (the solver's choice where it fits); written when true
    keep_selections: bool = False
    lm_head: Literal["fused", "lean", "naive"]
    ep_overlap_chunks: int = Field(gt=0, le=4096)
    micro_batch_tokens: int = Field(gt=0, le=MAX_INT)
    micro_batches: int = Field(gt=0, le=1_000_000)
    # layers per pipeline stage, in order (recipe.cost.pipeline_split); written when pp > 1. pp entries: one stage a
    # rank (1F1B); v·pp entries: v virtual stages a rank (interleaved 1F1B, rank r holding stages r, r + pp, …)
    pp_stages: list[Annotated[int, Field(gt=0, le=100_000)]] | None = Field(None, min_length=1, max_length=100_000)
    optimizer: Optimizer = Optimizer()

    @model_validator(mode="after")
    def _keep_needs_recompute(self) -> "TrainSpec":
        if self.keep_layers and self.recompute != "full":
            raise ValueError(f"train.keep_layers = {self.keep_layers} needs train.recompute: full (it names the "
                             f"layers exempt from it)")
        if self.keep_selections and self.recompute != "full":
            raise ValueError("train.keep_selections needs train.recompute: full (it spares the recomputed forward's "
                             "indexer)")
        return self


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


class MarginGB(_Strict):
    """The memory the solver held back beyond the predicted peak, by term (recipe/margin.py, docs/solver.md)."""
    error: float = Field(ge=0)
    root_unit: float = Field(ge=0)
    fsdp_in_flight: float = Field(ge=0)
    all_to_all: float = Field(ge=0)
    imbalance: float = Field(ge=0)
    total: float = Field(ge=0)


class Basis(_Strict):
    """Where each figure comes from: `measured` (the profile has a committed calibration grid) or `assumed`."""
    memory: Literal["measured", "assumed"]
    step_time: Literal["measured", "assumed"]  # and the figures derived from it: tokens/s, TFLOP/s, MFU


class ErrorBand(_Strict):
    """The worst relative error of each figure on its basis (fractions): the grid's, or the assumed band."""
    memory: float = Field(ge=0, lt=1)
    step_time: float = Field(ge=0)


class Prediction(_Strict):
    memory_gb: MemoryGB
    lm_head_unfused_gb: float
    step_time_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    mfu: Mfu
    # absent in plans written before margins: such plans still load (and `recipe check` names the drift)
    headroom_gb: float | None = None  # usable − predicted peak
    margin_gb: MarginGB | None = None
    basis: Basis | None = None
    error: ErrorBand | None = None

    @model_validator(mode="after")
    def _within_margin(self) -> "Prediction":
        m = self.memory_gb
        if self.margin_gb is not None and m.total + self.margin_gb.total > m.usable + 0.02:  # 2-decimal rounding
            raise ValueError(f"predicted peak {m.total} GB + margin {self.margin_gb.total} GB exceeds the "
                             f"{m.usable} GB usable: no plan is written like that")
        return self


class Reasons(_Strict):
    tp: str
    ep: str
    cp: str
    pp: str
    gpus: str | None = None  # why this GPU count, when the solver chose it (no --gpus)
    recompute: str | None = None  # why this recompute mode, when the solver chose it (--recompute auto)


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

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, defer_build=True, strict=True)

    @field_validator("schema_", mode="before")
    @classmethod
    def _schema_is_an_integer(cls, v):
        if isinstance(v, bool) or not isinstance(v, int):  # Literal[1] alone would take `true` and `1.0`
            raise ValueError(f"unsupported plan schema {_shown(v)}: this recipe reads schema "
                             f"{SCHEMA_VERSION}")
        return v

    @model_validator(mode="after")
    def _launch_matches_layout(self) -> "Plan":
        if self.launch.nnodes * self.launch.nproc_per_node != self.layout.world:
            raise ValueError(f"launch nnodes·nproc_per_node = {self.launch.nnodes}·{self.launch.nproc_per_node} "
                             f"≠ world {self.layout.world} of the layout")
        if self.inputs.gpus is not None and self.inputs.gpus != self.layout.world:
            raise ValueError(f"inputs.gpus = {self.inputs.gpus} but the layout covers {self.layout.world} GPUs")
        stages = self.train.pp_stages
        if stages is not None and len(stages) % self.layout.pp:
            raise ValueError(f"train.pp_stages lists {len(stages)} stages, not a multiple of pp={self.layout.pp} "
                             f"(pp stages, or v·pp for v virtual stages a rank)")
        return self

    # ---- what the plan was solved from ----
    def model_shape(self, base_dir: Path | None = None) -> ModelShape:
        m = resolve_model(_relative(self.inputs.model, base_dir))
        return m.with_layers(self.inputs.layers) if self.inputs.layers else m

    def hw_profile(self, base_dir: Path | None = None) -> HwProfile:
        return load_profile(_relative(self.inputs.hw, base_dir))

    def train_options(self) -> TrainOptions:
        return TrainOptions(recompute=self.train.recompute, keep_layers=self.train.keep_layers,
                            keep_selections=self.train.keep_selections, lm_head=self.train.lm_head,
                            ep_overlap_chunks=self.train.ep_overlap_chunks,
                            micro_batch_tokens=self.train.micro_batch_tokens,
                            micro_batches=self.train.micro_batches)

    def to_dict(self) -> dict:
        data = plain(self)
        if data["train"].get("pp_stages") is None:  # no pipeline: no field (plans stay as they were)
            data["train"].pop("pp_stages", None)
        if not data["train"].get("keep_layers"):  # every layer recomputed, or none: no field
            data["train"].pop("keep_layers", None)
        if not data["train"].get("keep_selections"):
            data["train"].pop("keep_selections", None)
        data["inputs"] = _inputs_block(self.inputs)  # `pins` only when some degree is pinned
        for block in ("prediction", "reasons"):  # optional fields a plan does not carry stay out of it
            data[block] = {k: v for k, v in data[block].items() if v is not None}
        return data



def build_plan(inputs, m: ModelShape, hw: HwProfile, sol) -> Plan:
    """The validated plan for a solution (the solve path writes `plan_dict` directly, without pydantic)."""
    return Plan.model_validate(plan_dict(inputs, m, hw, sol))


def parse_plan(text: str, origin: str = "<plan>") -> Plan:
    if len(text) > MAX_PLAN_BYTES:
        raise PlanError(f"{origin}: {len(text):,} characters, more than a plan can be ({MAX_PLAN_BYTES:,} at most)")
    try:
        data = _decode(text)
    except (yaml.YAMLError, json.JSONDecodeError, ValueError, TypeError, OverflowError, RecursionError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PlanError(f"{origin}: not valid YAML/JSON ({one_line(first, 200)})") from None
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
        loc = ".".join(one_line(x, 60) for x in err.get("loc", ())) or "(top level)"
        msg = one_line(err.get("msg", "invalid"), 200)
        if err.get("type") == "extra_forbidden":
            msg = "unknown key"
        elif tuple(err.get("loc", ())) == ("schema",):
            msg = f"unsupported plan schema {_shown(err.get('input'))}: this recipe reads schema " \
                  f"{SCHEMA_VERSION}"
        elif err.get("type") in _TYPE_ERRORS:  # strict types: say what was there ("got true", "got 4096.5")
            msg = f"{msg}, got {_shown(err.get('input'))}"
        extra = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        raise PlanError(f"{origin}: field {loc}: {msg}{extra}") from None
    except (RecursionError, OverflowError, TypeError, ValueError) as e:
        raise PlanError(f"{origin}: unusable plan ({type(e).__name__})") from None


_TYPE_ERRORS = ("int_type", "int_from_float", "int_parsing", "float_type", "float_parsing", "bool_type",
                "string_type", "dict_type", "model_type", "literal_error")


def _shown(v) -> str:
    if v is None or isinstance(v, bool):
        return {True: "true", False: "false", None: "null"}[v]
    return one_line(repr(v), 40)


def _decode(text: str):
    """JSON when it looks like JSON and parses as JSON; YAML otherwise (a YAML flow mapping also starts with '{')."""
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return yaml.safe_load(text)


def load_plan(path: str | Path) -> Plan:
    """A plan file: a regular file of at most MAX_PLAN_BYTES (a device, FIFO or directory is refused unread)."""
    from .safeio import read_limited

    p = Path(path)
    try:
        raw = read_limited(p, "plan file", MAX_PLAN_BYTES)
    except ValueError as e:
        raise PlanError(one_line(e, 400)) from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise PlanError(f"{p}: not UTF-8 text") from None
    return parse_plan(text, str(p))
