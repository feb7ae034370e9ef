"""Hardware profiles: one YAML per accelerator under hw_profiles/ (shipped in the wheel), every figure with a source.

Units are in the names: `_gib` binary gigabytes (2**30 bytes: the HBM capacity, as the device reports it), `_gb`
decimal gigabytes (1e9 bytes: every memory figure the cost model reports), `_gb_s` GB/s per GPU per direction,
`_tflops` dense bf16.
Pure Python: never imports torch.
"""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from dataclasses import dataclass
from ._data import Record, plain, validate

PosF = float  # > 0 and finite, checked in __post_init__ (which pydantic also runs when it validates untrusted data)
MAX_PROFILE_BYTES = 64 * 1024  # a profile is about 3 KB
GIB = 2**30


# The smallest figure a profile may give (in its own unit: TFLOP/s, GiB, TB/s, GB/s, KB, a fraction, ms). Below it
# the cost model's products underflow and its quotients overflow (a subnormal 5e-324 TFLOP/s makes every step time
# infinite, and their differences NaN), and no hardware comes near it.
MIN_FIGURE = 1e-6


def _check_positive(rec, names, *, integer: bool = False) -> None:
    for n in names:
        v = getattr(rec, n)
        if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
            raise ValueError(f"{n} must be a positive {'whole number' if integer else 'number'}, got {v!r}")
        if not (math.isfinite(v) and v >= MIN_FIGURE):
            raise ValueError(f"{n} must be a finite number of at least {MIN_FIGURE:g}, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class Link(Record):
    kind: str  # nvlink4, xgmi, gloo-shm, ...
    bw_gb_s: PosF  # usable per-GPU, per-direction bandwidth for collectives
    topology: Literal["switch", "mesh", "ring", "host"]

    def __post_init__(self) -> None:
        _check_positive(self, ("bw_gb_s",))


@dataclass(frozen=True, kw_only=True)
class Efficiency(Record):
    """Per-operation efficiencies of the step-time model (docs/cost_model.md, "Step time from its parts"), each
    measured on the profile's calibration grid: the GEMM-like parts as a fraction of the dense bf16 peak, the
    streaming parts as a fraction of the HBM bandwidth, and fixed times per decoder layer and pass and per MoE layer
    and pass of the expert-parallel path."""

    expert_gemm: float  # routed experts' grouped GEMMs: their FLOPs (with expert_rows and expert_weights below)
    dense_gemm: float  # every other matmul of a layer (projections, shared expert, router), with its norms and
    #                    elementwise work, which scale the same way and are fit together with it
    # full attention's quadratic term (QKᵀ and PV): one efficiency, or one per attention head width ({128: …,
    # 256: …}), the kernel's rate per FLOP differing with it (recipe/cost.py: attention_efficiency)
    attention: float | dict[int, float]
    delta_rule: float  # Gated DeltaNet's chunked rule
    lm_head: float  # the LM head's logits-sized GEMMs with the loss fused in
    optimizer: float  # AdamW's streaming update, of the HBM bandwidth
    ep_dispatch: float  # the expert-parallel path's row copies (exchanges, regroups, their gradients), of HBM bw
    layer_latency_ms: float  # fixed time per decoder layer and pass (launches, the router's host sync)
    ep_latency_ms: float  # fixed time per MoE layer and pass of the expert-parallel path (its route's count
    #                       exchange and host sync)
    ep_chunk_ms: float  # fixed time per MoE layer, pass and overlap chunk beyond the first of that path (the chunk
    #                     loop's launches and index work)
    # the routed experts' bytes, of the HBM bandwidth: each routed row's operands and results (2h + 3f values), and
    # each pass's read of the rank's experts' weights (recipe/cost.py: expert_pass_work). Absent (a profile written
    # before them): not charged apart, expert_gemm stands for the whole
    expert_rows: float | None = None
    expert_weights: float | None = None
    # the dense matmuls' rows (recipe/cost.py dense_row_bytes: every dense matmul's input and output row a token), of
    # the HBM bandwidth, with the norms and elementwise work around them; with it dense_gemm is the GEMMs' FLOP rate
    # alone (measured alone, bench/bench_dense_rates.py). Absent: dense_gemm stands for both
    dense_rows: float | None = None

    def __post_init__(self) -> None:
        names = ("expert_gemm", "dense_gemm", "delta_rule", "lm_head", "optimizer", "ep_dispatch")
        if isinstance(self.attention, dict):
            widths = self.attention
            if not widths or not all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in widths):
                raise ValueError(f"efficiency.attention by head width needs positive whole widths, got "
                                 f"{sorted(widths, key=str)!r}")
            for k, v in widths.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 1e-6 <= v <= 1):
                    raise ValueError(f"efficiency.attention[{k}] must be a number in [1e-06, 1], got {v!r}")
        else:
            names += ("attention",)
        _check_positive(self, names)
        for n in ("layer_latency_ms", "ep_latency_ms", "ep_chunk_ms"):
            # fixed times multiply a count (nothing divides by them): none at all is a valid measurement
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                raise ValueError(f"efficiency.{n} must be a finite number of milliseconds, at least 0, got {v!r}")
        given = [n for n in ("expert_rows", "expert_weights", "dense_rows") if getattr(self, n) is not None]
        _check_positive(self, given)
        for n in names + tuple(given):
            if getattr(self, n) > 1:
                raise ValueError(f"efficiency.{n} must be at most 1, got {getattr(self, n)!r}")


@dataclass(frozen=True, kw_only=True)
class HwProfile(Record):
    name: str
    vendor: Literal["nvidia", "amd", "cpu"]
    description: str
    peak_bf16_tflops: PosF  # dense; never the 2:4-sparse figure
    hbm_gib: PosF  # the capacity the device reports (an "80 GB" H100 has 80 GiB), in GiB
    hbm_bw_tb_s: PosF
    usable_memory_fraction: float  # in (0, 1]  # what the framework can allocate of the HBM
    gpus_per_node: int
    intra_node: Link
    inter_node_bw_gb_s: PosF  # per GPU, per direction (one NIC per GPU)
    warp_size: Literal[1, 32, 64]
    smem_kb_per_sm: PosF  # shared memory (NVIDIA) / LDS (AMD) per SM/CU
    num_sms: int  # SMs (NVIDIA) / CUs (AMD)
    collective: Literal["nccl", "rccl", "gloo"]
    # calibration: what fraction of peak the step's GEMMs reach, and the fixed overhead memory per GPU
    compute_efficiency: float  # in (0, 1]
    overhead_gb: float  # >= 0: runtime context, collective buffers, allocator slack
    sources: dict[str, str]
    # per-operation efficiencies measured on hw_profiles/calibration/<name>.json; None: every matmul at
    # compute_efficiency and the optimizer at 0.9 of the HBM bandwidth (an assumption, no measurement)
    efficiency: Efficiency | None = None
    # a built-in profile whose measured efficiencies this one takes, in place of its own `efficiency` (a part never
    # measured): the same shares of the HBM bandwidth and fixed times, the compute-bound ones scaled by this profile's
    # compute_efficiency over the reference's (`derived_efficiency`); `efficiency` then holds the derived figures
    efficiency_from: str | None = None

    def __post_init__(self) -> None:
        """Every figure finite and positive (the cost model divides by them): a profile with `bw_gb_s: 0` or
        `peak_bf16_tflops: .inf` is refused here, naming the field, never a ZeroDivisionError later."""
        _check_positive(self, ("peak_bf16_tflops", "hbm_gib", "hbm_bw_tb_s", "usable_memory_fraction",
                               "inter_node_bw_gb_s", "smem_kb_per_sm", "compute_efficiency"))
        _check_positive(self, ("gpus_per_node", "num_sms"), integer=True)
        v = self.overhead_gb
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
            raise ValueError(f"overhead_gb must be a finite non-negative number, got {v!r}")
        for n in ("usable_memory_fraction", "compute_efficiency"):
            if getattr(self, n) > 1:
                raise ValueError(f"{n} must be at most 1, got {getattr(self, n)!r}")
        if self.gpus_per_node > 4096:
            raise ValueError(f"gpus_per_node must be at most 4096, got {self.gpus_per_node}")
        if self.usable_gb <= self.overhead_gb:
            raise ValueError(f"overhead_gb {self.overhead_gb:g} leaves nothing of the usable "
                             f"{self.usable_gb:g} GB (hbm_gib × usable_memory_fraction, in decimal GB)")

    @property
    def hbm_gb(self) -> float:
        """The HBM capacity in decimal GB (1e9 bytes), the unit of every memory figure the cost model reports."""
        return self.hbm_gib * GIB / 1e9

    @property
    def usable_gb(self) -> float:
        """What the framework can allocate, in decimal GB: hbm_gib · 2**30 / 1e9 · usable_memory_fraction."""
        return self.hbm_gb * self.usable_memory_fraction

    def fingerprint_dict(self) -> dict:
        # a profile without per-operation efficiencies keeps the fingerprint it had before the field existed
        return plain(self, exclude=frozenset({"sources", "description"} | ({"efficiency"} if self.efficiency is None
                                                                            else set())))


# the efficiencies that are fractions of the dense peak (the rest are fractions of the HBM bandwidth, or fixed times)
COMPUTE_EFFICIENCIES = ("expert_gemm", "dense_gemm", "attention", "delta_rule", "lm_head")


def derived_efficiency(ref: HwProfile, compute_efficiency: float) -> Efficiency:
    """`ref`'s measured efficiencies carried to a part that has none of its own: the shares of the HBM bandwidth and
    the fixed times as they are, each fraction of the dense peak times compute_efficiency / ref.compute_efficiency
    (the part's one assumed GEMM efficiency against the one the reference's step was first fit with), at most 1.
    `ref` has efficiencies of its own (`_resolve_efficiency_from` checks it)."""
    scale = compute_efficiency / ref.compute_efficiency
    e = ref.efficiency
    changes = {}
    for n in COMPUTE_EFFICIENCIES:
        v = getattr(e, n)
        changes[n] = {k: min(1.0, x * scale) for k, x in v.items()} if isinstance(v, dict) else min(1.0, v * scale)
    return e.model_copy(update=changes)


def _resolve_efficiency_from(data: dict, origin: str) -> dict:
    """A profile's `efficiency_from: <built-in name>` replaced by the efficiencies it derives (`derived_efficiency`),
    the name kept beside them."""
    ref_name = data.get("efficiency_from")
    if ref_name is None:
        return data
    if data.get("efficiency") is not None:
        raise ValueError(f"{origin}: efficiency_from and efficiency are both given: a profile takes its own measured "
                         f"efficiencies or another's, not both")
    names = builtin_names()
    if not isinstance(ref_name, str) or ref_name not in names:
        raise ValueError(f"{origin}: efficiency_from: {ref_name!r} is not a built-in profile ({', '.join(names)})")
    ref = load_profile(ref_name)
    if ref.efficiency_from is not None or ref.efficiency is None:
        raise ValueError(f"{origin}: efficiency_from: {ref_name} has no efficiencies measured on its own grid")
    ce = data.get("compute_efficiency")
    if isinstance(ce, bool) or not isinstance(ce, (int, float)) or not (math.isfinite(ce) and 0 < ce <= 1):
        raise ValueError(f"{origin}: compute_efficiency must be a number in (0, 1], got {ce!r}")
    return {**data, "efficiency": plain(derived_efficiency(ref, float(ce)))}


def _builtin_dir():
    return resources.files("hw_profiles")


def builtin_names() -> list[str]:
    return sorted(p.name[:-5] for p in _builtin_dir().iterdir() if p.name.endswith(".yaml"))


def _parse(text: str, origin: str, trusted: bool = False) -> HwProfile:
    try:
        data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (yaml.YAMLError, RecursionError, ValueError, TypeError, OverflowError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{origin}: not valid YAML ({first})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{origin}: expected a mapping of profile fields")
    if not all(isinstance(k, str) for k in data):
        raise ValueError(f"{origin}: field {next(k for k in data if not isinstance(k, str))!r}: unknown field")
    data = _resolve_efficiency_from(data, origin)
    if trusted:  # a profile shipped with recipe: checked by the test suite against the full schema
        eff = data.get("efficiency")
        return HwProfile(**{**data, "intra_node": Link(**data["intra_node"]),
                            "efficiency": Efficiency(**eff) if eff is not None else None})
    return validate(HwProfile, data, origin)


def load_profile(spec: str) -> HwProfile:
    """A built-in name (h100, mi300x, ...) or a path to the user's own profile YAML (a regular file of at most
    MAX_PROFILE_BYTES)."""
    from .safeio import read_text_limited

    if spec in builtin_names():
        return _parse((_builtin_dir() / f"{spec}.yaml").read_text(), f"hw_profiles/{spec}.yaml", trusted=True)
    p = Path(spec)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return _parse(read_text_limited(p, "hardware profile", MAX_PROFILE_BYTES), str(p))
    from difflib import get_close_matches

    names = builtin_names()
    close = get_close_matches(spec.lower(), names, n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ValueError(f"unknown hardware profile {spec!r}{hint} (built in: {', '.join(names)}; or a path to a YAML)")


def all_profiles() -> list[HwProfile]:
    return [load_profile(n) for n in builtin_names()]
