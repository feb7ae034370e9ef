"""Hardware profiles: one YAML per accelerator under hw_profiles/ (shipped in the wheel), every figure with a source.

Units are in the names: `_gb` decimal gigabytes, `_gb_s` GB/s per GPU per direction, `_tflops` dense bf16.
Pure Python: never imports torch.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from ._data import plain
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class Link(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)
    kind: str  # nvlink4, xgmi, gloo-shm, ...
    bw_gb_s: float = Field(gt=0)  # usable per-GPU, per-direction bandwidth for collectives
    topology: Literal["switch", "mesh", "ring", "host"]


class HwProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)

    name: str
    vendor: Literal["nvidia", "amd", "cpu"]
    description: str
    peak_bf16_tflops: float = Field(gt=0)  # dense; never the 2:4-sparse figure
    hbm_gb: float = Field(gt=0)
    hbm_bw_tb_s: float = Field(gt=0)
    usable_memory_fraction: float = Field(gt=0, le=1)  # what the framework can allocate of hbm_gb
    gpus_per_node: int = Field(gt=0)
    intra_node: Link
    inter_node_bw_gb_s: float = Field(gt=0)  # per GPU, per direction (one NIC per GPU)
    warp_size: Literal[1, 32, 64]
    smem_kb_per_sm: float = Field(gt=0)  # shared memory (NVIDIA) / LDS (AMD) per SM/CU
    num_sms: int = Field(gt=0)  # SMs (NVIDIA) / CUs (AMD)
    collective: Literal["nccl", "rccl", "gloo"]
    # calibration: what fraction of peak the step's GEMMs reach, and the fixed overhead memory per GPU
    compute_efficiency: float = Field(gt=0, le=1)
    overhead_gb: float = Field(ge=0)  # runtime context, collective buffers, allocator slack
    sources: dict[str, str]

    @property
    def usable_gb(self) -> float:
        return self.hbm_gb * self.usable_memory_fraction

    def fingerprint_dict(self) -> dict:
        return plain(self, exclude=frozenset({"sources", "description"}))


def _builtin_dir():
    return resources.files("hw_profiles")


def builtin_names() -> list[str]:
    return sorted(p.name[:-5] for p in _builtin_dir().iterdir() if p.name.endswith(".yaml"))


def _parse(text: str, origin: str) -> HwProfile:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{origin}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{origin}: expected a mapping of profile fields")
    try:
        return HwProfile(**data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise ValueError(f"{origin}: field {loc!r}: {err['msg']}") from None


def load_profile(spec: str) -> HwProfile:
    """A built-in name (h100, mi300x, ...) or a path to the user's own profile YAML."""
    if spec in builtin_names():
        return _parse((_builtin_dir() / f"{spec}.yaml").read_text(), f"hw_profiles/{spec}.yaml")
    p = Path(spec)
    if p.suffix in (".yaml", ".yml") or p.exists():
        try:
            return _parse(p.read_text(), str(p))
        except FileNotFoundError:
            raise ValueError(f"hardware profile not found: {p}") from None
        except OSError as e:
            raise ValueError(f"cannot read hardware profile {p}: {e.strerror}") from None
    from difflib import get_close_matches

    names = builtin_names()
    close = get_close_matches(spec.lower(), names, n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ValueError(f"unknown hardware profile {spec!r}{hint} (built in: {', '.join(names)}; or a path to a YAML)")


def all_profiles() -> list[HwProfile]:
    return [load_profile(n) for n in builtin_names()]
