"""Hardware profiles: one YAML per accelerator under hw_profiles/ (shipped in the wheel), every figure with a source.

Units are in the names: `_gb` decimal gigabytes, `_gb_s` GB/s per GPU per direction, `_tflops` dense bf16.
Pure Python: never imports torch.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from dataclasses import dataclass
from ._data import Record, plain, validate

PosF = float  # > 0, checked in __post_init__ (which pydantic also runs when it validates untrusted data)


@dataclass(frozen=True, kw_only=True)
class Link(Record):
    kind: str  # nvlink4, xgmi, gloo-shm, ...
    bw_gb_s: PosF  # usable per-GPU, per-direction bandwidth for collectives
    topology: Literal["switch", "mesh", "ring", "host"]


@dataclass(frozen=True, kw_only=True)
class HwProfile(Record):
    name: str
    vendor: Literal["nvidia", "amd", "cpu"]
    description: str
    peak_bf16_tflops: PosF  # dense; never the 2:4-sparse figure
    hbm_gb: PosF
    hbm_bw_tb_s: PosF
    usable_memory_fraction: float  # in (0, 1]  # what the framework can allocate of hbm_gb
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

    def __post_init__(self) -> None:
        for n in ("peak_bf16_tflops", "hbm_gb", "hbm_bw_tb_s", "usable_memory_fraction", "gpus_per_node",
                  "inter_node_bw_gb_s", "smem_kb_per_sm", "num_sms", "compute_efficiency"):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{n} must be a positive number, got {v!r}")
        if isinstance(self.overhead_gb, bool) or not isinstance(self.overhead_gb, (int, float)) or self.overhead_gb < 0:
            raise ValueError(f"overhead_gb must be a non-negative number, got {self.overhead_gb!r}")
        if self.usable_memory_fraction > 1 or self.compute_efficiency > 1:
            raise ValueError("usable_memory_fraction and compute_efficiency must be at most 1")

    @property
    def usable_gb(self) -> float:
        return self.hbm_gb * self.usable_memory_fraction

    def fingerprint_dict(self) -> dict:
        return plain(self, exclude=frozenset({"sources", "description"}))


def _builtin_dir():
    return resources.files("hw_profiles")


def builtin_names() -> list[str]:
    return sorted(p.name[:-5] for p in _builtin_dir().iterdir() if p.name.endswith(".yaml"))


def _parse(text: str, origin: str, trusted: bool = False) -> HwProfile:
    try:
        data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as e:
        raise ValueError(f"{origin}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{origin}: expected a mapping of profile fields")
    if trusted:  # a profile shipped with recipe: checked by the test suite against the full schema
        return HwProfile(**{**data, "intra_node": Link(**data["intra_node"])})
    return validate(HwProfile, data, origin)


def load_profile(spec: str) -> HwProfile:
    """A built-in name (h100, mi300x, ...) or a path to the user's own profile YAML."""
    if spec in builtin_names():
        return _parse((_builtin_dir() / f"{spec}.yaml").read_text(), f"hw_profiles/{spec}.yaml", trusted=True)
    p = Path(spec)
    if p.suffix in (".yaml", ".yml") or p.exists():
        try:
            return _parse(p.read_text(), str(p))
        except FileNotFoundError:
            raise ValueError(f"hardware profile not found: {p}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read hardware profile {p}: {getattr(e, 'strerror', None) or e}") from None
    from difflib import get_close_matches

    names = builtin_names()
    close = get_close_matches(spec.lower(), names, n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ValueError(f"unknown hardware profile {spec!r}{hint} (built in: {', '.join(names)}; or a path to a YAML)")


def all_profiles() -> list[HwProfile]:
    return [load_profile(n) for n in builtin_names()]
