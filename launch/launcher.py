"""`recipe launch`'s machinery, as plain functions: the torchrun command line for a plan, the environment its hardware
asks for, an sbatch script, the checks that run before any worker starts, and running the command.

Never imports torch (the `recipe` CLI stays fast and torch-free): GPUs are counted with the vendor's tool
(`nvidia-smi -L`, `rocm-smi`) or the driver's files, checkpoints are found by launch.checkpoint_index.

Every check raises `LaunchError`, one line; none writes anything. The command is an argv list, never a shell
string; the sbatch script is the one place where it is rendered for a shell, with shlex quoting.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from launch.checkpoint_index import latest, partial_dirs, step_dirs
from launch.hf_files import safetensors_files
from recipe.models import total_params

TRAIN_MODULE = "launch.train"
DEFAULT_PORT = 29500  # torchrun's own default rendezvous port
DATA_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
DATA_CHECK_RECORDS = 1000  # records of a JSONL file read before launch; the trainer validates the whole file
REQUIRED_FIELDS = ("input_ids", "loss_mask", "advantages")
SLURM_SCRIPT = "launch.sbatch"
# AMD parts that share the MI300X chip (CDNA3, gfx942, 304 CUs, 8-GPU xGMI mesh): the RCCL channel count below
CDNA3_OAM = frozenset({"mi300x", "mi325x"})


class LaunchError(ValueError):
    """A launch that would fail or damage something: one line naming what and why; raised before any worker."""


@dataclass(frozen=True)
class LaunchOptions:
    """What `recipe launch` passes on: where, how long, the rendezvous, and the training options.
    A training option left None is not passed (the trainer's default applies); `device` None means `cpu` for a
    gloo plan and `cuda` otherwise."""

    out: str
    steps: int = 1
    data: str | None = None
    seed: int | None = None
    dtype: str | None = None
    device: str | None = None
    resume: bool = False
    checkpoint_every: int | None = None
    keep_last: int | None = None
    no_checkpoint: bool = False
    export: str | None = None
    hf_checkpoint: str | None = None
    lr: float | None = None
    objective: str | None = None
    max_grad_norm: float | None = None
    weight_decay: float | None = None
    temperature: float | None = None
    clip_low: float | None = None
    clip_high: float | None = None
    kl_coef: float | None = None
    kl_estimator: str | None = None
    entropy_coef: float | None = None
    aggregation: str | None = None
    tis_cap: float | None = None
    rollouts_per_step: int | None = None
    on_nonfinite: str | None = None
    # torchrun
    max_restarts: int = 0
    nnodes: int | None = None
    node_rank: int | str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None  # None: derived from the plan and --out (the same on every node)

    @property
    def rendezvous(self) -> bool:
        return self.rdzv_endpoint is not None


# the training options after --out and --steps, in the order they are passed; --device is always passed
_TRAIN_FLAGS = ("data", "seed", "dtype", "device", "resume", "checkpoint_every", "keep_last", "no_checkpoint",
                "hf_checkpoint", "export", "lr", "objective", "max_grad_norm", "weight_decay", "temperature",
                "clip_low", "clip_high", "kl_coef", "kl_estimator", "entropy_coef", "aggregation", "tis_cap",
                "rollouts_per_step", "on_nonfinite")
CHOICES = {"dtype": ("bf16", "fp32"), "device": ("cpu", "cuda"), "objective": ("rl", "sft"),
           "kl_estimator": ("k1", "k3"), "aggregation": ("token_mean", "seq_mean"), "on_nonfinite": ("raise", "skip")}


# ---- the command ---------------------------------------------------------------------------------------------------
def device_for(plan, opts: LaunchOptions) -> str:
    """The device the workers train on: --device, else cpu for a gloo plan (the cpu profile), else cuda."""
    return opts.device or ("cpu" if plan.launch.backend == "gloo" else "cuda")


def train_argv(plan_path: str | Path, plan, opts: LaunchOptions) -> list[str]:
    """`launch.train`'s own arguments: the plan, --out, --steps, --device, then each option that was given."""
    argv = [str(plan_path), "--out", str(opts.out), "--steps", str(opts.steps)]
    for name in _TRAIN_FLAGS:
        value = device_for(plan, opts) if name == "device" else getattr(opts, name)
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        argv += [flag] if value is True else [flag, _arg(value)]
    return argv


def build_torchrun_argv(plan_path: str | Path, plan, opts: LaunchOptions) -> list[str]:
    """The torchrun command line (an argv list) that runs `launch.train` on this node.

    One node (no rendezvous given): `--standalone --nproc-per-node N`; a gloo plan (the cpu profile) runs all its
    ranks here as processes, however many nodes the plan was solved for. Across nodes: `--nnodes --node-rank
    --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID --nproc-per-node N`, the same on every node but
    for the node rank."""
    argv = [sys.executable, "-m", "torch.distributed.run"]
    if not opts.rendezvous:
        argv += ["--standalone", "--nproc-per-node", str(local_processes(plan, rendezvous=False))]
    else:
        nnodes = opts.nnodes if opts.nnodes is not None else plan.launch.nnodes
        argv += ["--nnodes", str(nnodes), "--node-rank", str(opts.node_rank), "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", opts.rdzv_endpoint, "--rdzv-id", opts.rdzv_id or rdzv_id(plan_path, opts.out),
                 "--nproc-per-node", str(plan.launch.nproc_per_node)]
    argv += ["--max-restarts", str(opts.max_restarts), "-m", TRAIN_MODULE]
    return argv + train_argv(plan_path, plan, opts)


def rdzv_id(plan_path: str | Path, out: str | Path) -> str:
    """A job id every node derives alike from the same command: the plan's name and a hash of (plan, --out)."""
    stem = re.sub(r"[^A-Za-z0-9_-]+", "-", Path(plan_path).stem).strip("-") or "plan"
    digest = hashlib.sha256(f"{Path(plan_path).name}\0{out}".encode()).hexdigest()[:10]
    return f"{stem[:40]}-{digest}"


def local_processes(plan, *, rendezvous: bool) -> int:
    """The ranks torchrun starts on this host: a node's share across nodes; without a rendezvous, the whole world for
    a gloo plan (processes on one host) and one node's GPUs otherwise."""
    if rendezvous or plan.launch.backend != "gloo":
        return plan.launch.nproc_per_node
    return plan.layout.world


def _arg(value) -> str:
    return repr(value) if isinstance(value, float) else str(value)


# ---- the environment -----------------------------------------------------------------------------------------------
def launch_env(plan, hw_profile, *, cpu_count: int | None = None, local_procs: int | None = None) -> dict[str, str]:
    """The environment variables the hardware asks for, then the plan's own `launch.env` (which wins).

    The vendor is the profile's `vendor` field (nvidia, amd or cpu; recipe/hw.py). Each variable is here for a
    reason given beside it; docs/launch.md has the table. `cpu_count` (default: this host's usable cores) and
    `local_procs` (default: the processes a one-node launch of the plan runs here) size OMP_NUM_THREADS on CPU."""
    env: dict[str, str] = {}
    if hw_profile.vendor in ("nvidia", "amd"):  # NCCL on NVIDIA, RCCL (the same API and variables) on AMD
        # A collective that fails or times out tears the process down (and torchrun with it) instead of leaving the
        # other ranks waiting forever. torchrun's agent also sets 1 when the variable is unset; it is here so that
        # the value is explicit and shown by --dry-run and in the sbatch script.
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
        # NCCL/RCCL print the reason of an init or transport failure ("unhandled system error" alone otherwise);
        # WARN is silent while nothing goes wrong.
        env["NCCL_DEBUG"] = "WARN"
    if hw_profile.vendor == "amd":
        # ROCR reclaims scratch memory above HSA_SCRATCH_SINGLE_LIMIT after each dispatch ("scratch-use-once"), so a
        # kernel that needs much scratch reallocates it every step; 1 keeps it assigned to its queue (ROCR runtime
        # environment-variable reference).
        env["HSA_NO_SCRATCH_RECLAIM"] = "1"
        # Kernel arguments go straight to device memory: a few microseconds less per kernel launch, which adds up
        # over the many small kernels of a MoE step (AMD's MI300X workload-optimization guide).
        env["HIP_FORCE_DEV_KERNARG"] = "1"
        if hw_profile.name in CDNA3_OAM:
            # RCCL's default channel count leaves the 7 xGMI links of an MI300X node under-used; the MI300X
            # workload-optimization guide sets 112. Not set for other parts: no published figure.
            env["NCCL_MIN_NCHANNELS"] = "112"
    if hw_profile.vendor == "cpu":
        # gloo ranks compute on CPU threads: divide the cores among the processes of this host instead of letting
        # each take them all (torchrun would set 1 when it is unset).
        procs = local_procs if local_procs is not None else local_processes(plan, rendezvous=False)
        cores = cpu_count if cpu_count is not None else host_cpu_count()
        env["OMP_NUM_THREADS"] = str(max(1, cores // max(1, procs)))
    env.update(plan.launch.env)
    return env


def effective_env(wanted: dict[str, str], environ: dict[str, str] | None = None) -> dict[str, str]:
    """What the workers will see for each of `wanted`'s variables: a value already set in the caller's environment
    wins (so `NCCL_DEBUG=INFO recipe launch …` works)."""
    environ = os.environ if environ is None else environ
    return {k: environ.get(k, v) for k, v in wanted.items()}


def host_cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# ---- counting GPUs without torch -----------------------------------------------------------------------------------
def count_gpus(vendor: str, environ: dict[str, str] | None = None, run=None, root: str = "/") -> int:
    """GPUs of `vendor` ("nvidia" or "amd") a process on this host may use: the devices the vendor's tool (or the
    driver's files) lists, narrowed by the visibility variables. 0 when none is found."""
    environ = os.environ if environ is None else environ
    run = run or _run_tool
    if vendor == "nvidia":
        found = _nvidia_devices(run, Path(root))
        masks = ("CUDA_VISIBLE_DEVICES",)
    elif vendor == "amd":
        found = _amd_devices(run, Path(root))
        masks = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
    else:
        return 0
    for name in masks:
        if name in environ:
            found = min(found, _visible(environ[name]))
    return found


def _visible(mask: str) -> int:
    """Devices a CUDA/HIP visibility list names: entries up to the first invalid one (as the runtimes read it)."""
    n = 0
    for entry in mask.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        n += 1
    return n


def _run_tool(argv: list[str]) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _nvidia_devices(run, root: Path) -> int:
    out = run(["nvidia-smi", "-L"])
    if out is not None:
        return sum(1 for line in out.splitlines() if line.startswith("GPU "))
    gpus = root / "proc/driver/nvidia/gpus"  # the driver's own list, when nvidia-smi is not installed
    return sum(1 for _ in gpus.iterdir()) if gpus.is_dir() else 0


def _amd_devices(run, root: Path) -> int:
    out = run(["rocm-smi", "--showid"])
    if out is not None:
        return len(set(re.findall(r"^GPU\[(\d+)\]", out, flags=re.M)))
    out = run(["amd-smi", "list"])
    if out is not None:
        return len(set(re.findall(r"^GPU:\s*(\d+)", out, flags=re.M)))
    nodes = root / "sys/class/kfd/kfd/topology/nodes"  # the kernel driver's topology: GPU nodes have SIMDs
    n = 0
    if nodes.is_dir():
        for props in nodes.glob("*/properties"):
            try:
                text = props.read_text()
            except OSError:
                continue
            m = re.search(r"^simd_count\s+(\d+)", text, flags=re.M)
            n += bool(m and int(m.group(1)) > 0)
    return n


def host_gpus(vendor: str) -> int:
    """GPUs on this host for a plan of `vendor`; for the cpu profile, whichever GPUs the host has."""
    if vendor in ("nvidia", "amd"):
        return count_gpus(vendor)
    return max(count_gpus("nvidia"), count_gpus("amd"))


# ---- pre-flight ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Preflight:
    """What the checks found: the validated plan, its hardware profile, one-line warnings, and the step a --resume
    continues from."""

    plan: object
    hw: object
    warnings: tuple[str, ...] = ()
    resume_step: int | None = None


def preflight(plan_path: str | Path, opts: LaunchOptions, *, check_host: bool = True, gpus: int | None = None,
              slurm: bool = False) -> Preflight:
    """Every check that can fail before a worker starts, in order; the first failure raises LaunchError. Nothing is
    written. `check_host`: also check this host (its GPUs for the plan's ranks, --device cuda); off for --dry-run
    and --emit slurm, which may run on a login node. `gpus`: this host's GPU count (default: counted). `slurm`: the
    command goes into an sbatch script, which brings its own rendezvous."""
    check_options(opts)
    plan, hw, warnings = check_plan_file(plan_path)
    check_trainable(plan, plan_path)
    if not slurm:
        check_rendezvous(plan, opts)
    if check_host:
        check_host_gpus(plan, hw, opts, gpus)
    if opts.data is not None:
        shape = _model_shape(plan, plan_path)
        check_data(opts.data, vocab_size=shape.vocab_size if shape else None)
    if opts.hf_checkpoint is not None:
        check_hf_checkpoint(opts.hf_checkpoint)
    resume_step = check_out_dir(opts)
    if opts.export is not None and Path(opts.export).exists():
        raise LaunchError(f"--export {opts.export} already exists; give a new folder (nothing is overwritten)")
    if check_host and not opts.no_checkpoint:
        warnings = [*warnings, *check_checkpoint_room(plan, plan_path, opts, start=resume_step or 0)]
    return Preflight(plan, hw, tuple(warnings), resume_step)


CHECKPOINT_BYTES_PER_PARAM = 12  # what a checkpoint holds a parameter: the fp32 master and Adam's two fp32 moments


def checkpoint_bytes(plan, plan_path) -> int | None:
    """The size of one of the run's checkpoints (all ranks' shards together), or None for a model it cannot read."""
    shape = _model_shape(plan, plan_path)
    return total_params(shape) * CHECKPOINT_BYTES_PER_PARAM if shape else None


def check_checkpoint_room(plan, plan_path, opts: LaunchOptions, free: int | None = None, start: int = 0) -> list[str]:
    """Room for the checkpoints on --out's disk: the run saves every --checkpoint-every steps and after the last
    (from step `start`), each checkpoint total parameters x 12 bytes, and keeps them all, or the newest --keep-last
    (a save is written beside them before the oldest goes: K + 1 at once). Refuses a run whose first save cannot
    fit (it would fail after its first steps' work, with nothing saved); warns when a later one cannot, and on a
    multi-node plan (where --out may be each node's own disk, holding its ranks' shards). Returns the warnings.
    `free`: the free bytes (default: measured)."""
    need = checkpoint_bytes(plan, plan_path)
    if not need:
        return []
    if free is None:
        free = shutil.disk_usage(nearest_existing(Path(opts.out))).free
    every = opts.checkpoint_every
    # the multiples of --checkpoint-every in (start, steps], and the last step when it is not one of them
    saves = (opts.steps // every - start // every + (opts.steps % every != 0)) if every else 1
    at_once = min(saves, opts.keep_last + 1) if opts.keep_last else saves
    room = f"a checkpoint of this model takes {need / 1e9:.1f} GB and {opts.out}'s disk has {free / 1e9:.1f} GB free"
    fix = "free space, give another --out, or pass --no-checkpoint"
    if free < need:
        if plan.launch.nnodes > 1:
            return [f"{room} (on this node: a shared --out holds every node's shards); {fix}"]
        raise LaunchError(f"{room}: the run would fail at its first save; {fix}")
    if free < at_once * need:
        held = f"holds {at_once} checkpoints at once" if opts.keep_last else f"keeps its {saves} checkpoints"
        return [f"{room}: the run {held} and only {free // need} fit; {fix}, a larger --checkpoint-every or a "
                f"smaller --keep-last"]
    return []


def check_hf_checkpoint(path: str | Path) -> None:
    """The starting weights are there: a safetensors file, or a folder with model.safetensors or an index whose every
    shard is present. (Names and shapes are checked against the model where the weights are read, on every rank.)"""
    try:
        safetensors_files(path)
    except (ValueError, OSError) as e:
        raise LaunchError(f"--hf-checkpoint: {e}") from None


def check_options(opts: LaunchOptions) -> None:
    """Option values the trainer would reject (or that would make a run that does nothing)."""
    if opts.steps <= 0:
        raise LaunchError(f"--steps must be positive, got {opts.steps}")
    for name, allowed in CHOICES.items():
        v = getattr(opts, name)
        if v is not None and v not in allowed:
            raise LaunchError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, got {v!r}")
    positive = {"lr": opts.lr, "temperature": opts.temperature}
    non_negative = {"max_grad_norm": opts.max_grad_norm, "weight_decay": opts.weight_decay,
                    "clip_low": opts.clip_low, "clip_high": opts.clip_high, "kl_coef": opts.kl_coef,
                    "entropy_coef": opts.entropy_coef, "tis_cap": opts.tis_cap}
    for name, v in positive.items():
        if v is not None and not (v > 0 and v != float("inf")):
            raise LaunchError(f"--{name.replace('_', '-')} must be a positive number, got {v}")
    for name, v in non_negative.items():
        if v is not None and not (v >= 0 and v != float("inf")):
            what = " (0 turns clipping off)" if name == "max_grad_norm" else ""
            raise LaunchError(f"--{name.replace('_', '-')} must be zero or positive{what}, got {v}")
    if opts.clip_low is not None and opts.clip_low >= 1:
        raise LaunchError(f"--clip-low must be below 1 (the ratio is clipped at 1 - clip_low), got {opts.clip_low}")
    if opts.checkpoint_every is not None and opts.checkpoint_every <= 0:
        raise LaunchError(f"--checkpoint-every must be positive, got {opts.checkpoint_every}")
    if opts.keep_last is not None and opts.keep_last <= 0:
        raise LaunchError(f"--keep-last must be positive, got {opts.keep_last}")
    for name in ("checkpoint_every", "keep_last"):
        if opts.no_checkpoint and getattr(opts, name) is not None:
            raise LaunchError(f"--no-checkpoint and --{name.replace('_', '-')} are alternatives; give one")
    if opts.rollouts_per_step is not None and opts.rollouts_per_step < 0:
        raise LaunchError(f"--rollouts-per-step must be zero (every rollout) or positive, got {opts.rollouts_per_step}")
    if opts.seed is not None and not 0 <= opts.seed < 2 ** 63:
        raise LaunchError(f"--seed must be in [0, 2^63), got {opts.seed}")
    if opts.max_restarts < 0:
        raise LaunchError(f"--max-restarts must be zero or positive, got {opts.max_restarts}")


def check_plan_file(plan_path: str | Path):
    """The plan through `recipe check`'s checks: unusable or not fitting (today's cost model, divisibility) raises;
    drift from today's solver is one warning line (the plan still runs as committed). Returns (plan, hw, warnings)."""
    from recipe.check import check_plan, format_value, problem_line

    p = Path(plan_path)
    if not p.exists():
        raise LaunchError(f"plan not found: {p}")
    if p.is_dir():
        raise LaunchError(f"{p} is a directory, not a plan file")
    result = check_plan(p)
    for p in result.problems:
        if p.kind == "invalid":
            where = f" {p.field}:" if p.field not in ("plan", "path") else ""
            cause = p.cause if p.cause.startswith(str(plan_path)) else f"{p.file}:{where} {p.cause}"
            raise LaunchError(cause)
    for p in result.problems:
        if p.kind == "misfit":
            raise LaunchError(problem_line(p))
    warnings = []
    drifted = [p for p in result.problems if p.kind == "drift"]
    if drifted:
        p = drifted[0]
        more = f" and {len(drifted) - 1} more field(s)" if len(drifted) > 1 else ""
        warnings.append(f"{p.file} has drifted from today's solver ({p.field}: committed {format_value(p.committed)}, "
                        f"solved {format_value(p.solved)}{more}); it runs as committed, `recipe check --fix "
                        f"{p.file}` rewrites it")
    plan = result.plan
    return plan, plan.hw_profile(Path(plan_path).parent), warnings


def check_rendezvous(plan, opts: LaunchOptions) -> None:
    """Either no rendezvous (one node) or all three of --nnodes, --node-rank and --rdzv-endpoint, matching the plan."""
    given = {"--nnodes": opts.nnodes, "--node-rank": opts.node_rank, "--rdzv-endpoint": opts.rdzv_endpoint}
    if any(v is not None for v in given.values()):
        absent = [k for k, v in given.items() if v is None]
        if absent:
            raise LaunchError(f"a multi-node launch needs --nnodes, --node-rank and --rdzv-endpoint together; "
                              f"missing {', '.join(absent)}")
        if opts.nnodes != plan.launch.nnodes:
            raise LaunchError(f"--nnodes {opts.nnodes} but the plan runs on {plan.launch.nnodes} node(s) of "
                              f"{plan.launch.nproc_per_node} GPU(s)")
        if isinstance(opts.node_rank, int) and not 0 <= opts.node_rank < opts.nnodes:
            raise LaunchError(f"--node-rank must be in [0, {opts.nnodes}), got {opts.node_rank}")
        parse_endpoint(opts.rdzv_endpoint)
        return
    if plan.launch.nnodes > 1 and plan.launch.backend != "gloo":
        raise LaunchError(f"the plan spans {plan.launch.nnodes} nodes of {plan.launch.nproc_per_node} GPUs "
                          f"({plan.layout.world} in all); on each node give --nnodes {plan.launch.nnodes} "
                          f"--node-rank R --rdzv-endpoint HOST:PORT, or write a SLURM script with --emit slurm")


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) → (host, port)."""
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})", endpoint or "")
    if not m or not 0 < int(m.group(2)) < 65536:
        raise LaunchError(f"--rdzv-endpoint must be HOST:PORT with a port in 1-65535, got {endpoint!r}")
    return m.group(1), int(m.group(2))


def check_host_gpus(plan, hw, opts: LaunchOptions, gpus: int | None = None) -> None:
    """This host has the GPUs its ranks need (none needed on --device cpu: the cpu profile runs processes)."""
    if device_for(plan, opts) != "cuda":
        return
    have = host_gpus(hw.vendor) if gpus is None else gpus
    local = local_processes(plan, rendezvous=opts.rendezvous)
    if have == 0:
        tool = {"nvidia": "nvidia-smi", "amd": "rocm-smi"}.get(hw.vendor, "nvidia-smi or rocm-smi")
        raise LaunchError(f"--device cuda but this machine has no GPU ({tool} lists none, or the visibility "
                          f"variables hide them); use --device cpu or a GPU host")
    if have < local:
        where = "on this node" if opts.rendezvous else "and no rendezvous was given, so all run on this host"
        raise LaunchError(f"the plan needs {local} GPUs {where}; this host has {have}")


def check_data(path: str | Path, vocab_size: int | None = None) -> None:
    """The rollout file exists and looks like the format (docs/training.md): .jsonl — the first
    DATA_CHECK_RECORDS records are JSON objects with the required fields and in-vocabulary token ids; .parquet —
    the required columns (when pyarrow is installed). The trainer validates every record when it reads the file."""
    p = Path(path)
    kind = DATA_SUFFIXES.get(p.suffix.lower())
    if kind is None:
        raise LaunchError(f"--data {p}: unknown rollout file type {p.suffix or '(none)'!r} (use .jsonl or .parquet)")
    if not p.exists():
        raise LaunchError(f"--data {p}: no such file")
    if not p.is_file():
        raise LaunchError(f"--data {p}: not a file")
    if kind == "parquet":
        _check_parquet(p)
        return
    seen = 0
    try:
        with open(p, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                _check_record(line, f"{p}:{i}", vocab_size)
                seen += 1
                if seen >= DATA_CHECK_RECORDS:
                    break
    except UnicodeDecodeError:
        raise LaunchError(f"--data {p}: not UTF-8 text") from None
    except OSError as e:
        raise LaunchError(f"--data {p}: cannot read ({e.strerror})") from None
    if seen == 0:
        raise LaunchError(f"--data {p}: no rollouts (the file is empty)")


def _check_record(line: str, where: str, vocab_size: int | None) -> None:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise LaunchError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rec, dict):
        raise LaunchError(f"{where}: expected an object with fields {', '.join(REQUIRED_FIELDS)}")
    missing = [k for k in REQUIRED_FIELDS if rec.get(k) is None]
    if missing:
        raise LaunchError(f"{where}: missing required field(s) {', '.join(map(repr, missing))}")
    ids = rec["input_ids"]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise LaunchError(f"{where}: field 'input_ids' must be a list of integers")
    if len(ids) < 2:
        raise LaunchError(f"{where}: field 'input_ids' has {len(ids)} token(s); a rollout needs at least 2")
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise LaunchError(f"{where}: field 'input_ids' holds token {bad[0]} outside [0, {vocab_size})")
    mask = rec["loss_mask"]
    if not isinstance(mask, list) or len(mask) != len(ids):
        n = len(mask) if isinstance(mask, list) else "no list of"
        raise LaunchError(f"{where}: field 'loss_mask' has {n} entries but input_ids has {len(ids)}")


def _check_parquet(p: Path) -> None:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        return  # the trainer's reader says what it needs
    try:
        names = pq.read_schema(p).names
    except Exception as e:  # pyarrow raises several types for unreadable files
        raise LaunchError(f"--data {p}: not a readable Parquet file ({' '.join(str(e).split())[:200]})") from None
    missing = [c for c in REQUIRED_FIELDS if c not in names]
    if missing:
        raise LaunchError(f"--data {p}: missing column(s) {missing} (columns: {names})")


def check_out_dir(opts: LaunchOptions) -> int | None:
    """The output folder: not another run's (its checkpoints are never overwritten without --resume); with
    --resume, a complete checkpoint to continue from, before --steps; metrics.jsonl a file. Returns the resume step."""
    out = Path(opts.out)
    if out.exists() and not out.is_dir():
        raise LaunchError(f"--out {out} is a file; the run needs a folder")
    where = nearest_existing(out)
    if not _writable(where):
        what = "is not writable" if where == out.absolute() else f"cannot be created: {where} is not writable"
        raise LaunchError(f"--out {out} {what}; give another --out")
    metrics = out / "metrics.jsonl"
    if metrics.is_dir():
        raise LaunchError(f"{metrics} is a directory; the run writes its metrics file there")
    found = step_dirs(out)
    if not opts.resume:
        if found:
            steps = ", ".join(p.name for _, p in found[-3:])
            raise LaunchError(f"--out {out} holds another run's checkpoints ({steps}); pass --resume to continue it "
                              f"or give a new --out")
        return None
    last = latest(out)
    if last is None:
        partial = " (only incomplete ones)" if found or partial_dirs(out) else ""
        raise LaunchError(f"--resume: no complete checkpoint under {out / 'checkpoints'}{partial}")
    step, _ = last
    if step >= opts.steps:
        raise LaunchError(f"--resume: the last checkpoint is at step {step} and --steps is {opts.steps}: nothing "
                          f"left to run (--steps is the run's total)")
    return step


def nearest_existing(path: Path) -> Path:
    """`path` made absolute, or its nearest ancestor that exists (the folder a run would be created in)."""
    where = path.absolute()
    while not where.exists():
        where = where.parent
    return where


def _writable(folder: Path) -> bool:
    """Whether this process may create entries in `folder`: its permission bits allow it and its filesystem is not
    mounted read-only (root passes the first test everywhere)."""
    try:
        return os.access(folder, os.W_OK | os.X_OK) and not os.statvfs(folder).f_flag & os.ST_RDONLY
    except OSError:
        return False


def check_trainable(plan, plan_path) -> None:
    """The training core builds the plan's model (recipe.models.trainable), said before any worker starts."""
    from recipe.models import trainable

    shape = _model_shape(plan, plan_path)
    why = trainable(shape) if shape is not None else None
    if why:
        raise LaunchError(why)


def _model_shape(plan, plan_path):
    """The plan's model shape, or None for a model it cannot read (the plan check has said so already)."""
    try:
        return plan.model_shape(Path(plan_path).parent)
    except ValueError:
        return None


# ---- SLURM ---------------------------------------------------------------------------------------------------------
_NODE_RANK, _RDZV_HOST, _JOB_ID = "@RECIPE_SLURM_NODEID@", "@RECIPE_RDZV_HOST@", "@RECIPE_SLURM_JOB_ID@"
_EXPAND = {_NODE_RANK: "${SLURM_NODEID}", _RDZV_HOST: "${RDZV_HOST}", _JOB_ID: "${SLURM_JOB_ID}"}


def slurm_script(plan_path: str | Path, plan, opts: LaunchOptions, env: dict[str, str], *,
                 workdir: str | Path | None = None, port: int = DEFAULT_PORT, job_name: str | None = None) -> str:
    """An sbatch script that runs the same torchrun command on every node of the allocation: one srun task per
    node, rendezvous (c10d) on the allocation's first node (`scontrol show hostnames`), the node rank from
    SLURM_NODEID and the job id as rendezvous id. `env` is exported before srun (srun passes it on); `workdir`
    (default: the current folder) is the job's working folder, so relative paths mean what they meant here."""
    nnodes, nproc = plan.launch.nnodes, plan.launch.nproc_per_node
    node_opts = replace(opts, nnodes=nnodes, node_rank=_NODE_RANK, rdzv_endpoint=f"{_RDZV_HOST}:{port}",
                        rdzv_id=_JOB_ID)
    inner = "exec " + shlex.join(build_torchrun_argv(plan_path, plan, node_opts))
    for sentinel, expansion in _EXPAND.items():
        inner = inner.replace(sentinel, expansion)
    workdir = Path(workdir) if workdir is not None else Path.cwd()
    name = job_name or rdzv_id(plan_path, opts.out).rsplit("-", 1)[0]
    gpu_line = (f"#SBATCH --gpus-per-node={nproc}\n" if plan.launch.backend != "gloo"
                else f"# (cpu profile: {nproc} processes per node, no GPUs requested)\n")
    lines = [
        "#!/bin/bash",
        f"# recipe launch: {Path(plan_path).name} on {nnodes} node(s), {nproc} "
        f"{'GPUs' if plan.launch.backend != 'gloo' else 'processes'} each; written by `recipe launch --emit slurm`",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={nnodes}",
        "#SBATCH --ntasks-per-node=1",
        gpu_line.rstrip("\n"),
        f"#SBATCH --chdir={workdir}",
        f"#SBATCH --output={Path(opts.out) / 'slurm-%j.out'}",
        "set -euo pipefail",
        "",
        "# the environment the hardware asks for (docs/launch.md says why each)",
        *(f"export {k}={shlex.quote(v)}" for k, v in env.items()),
        "",
        "# rendezvous on the first node of the allocation",
        'RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export RDZV_HOST",
        "",
        "# one task per node; each runs torchrun, which starts this node's ranks",
        f"srun --nodes={nnodes} --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c {shlex.quote(inner)}",
        "",
    ]
    return "\n".join(lines)


# ---- running -------------------------------------------------------------------------------------------------------
def display(env: dict[str, str], argv: list[str]) -> str:
    """The command for reading (and pasting): one KEY=VALUE per line, then the argv shell-quoted."""
    return "".join(f"{k}={shlex.quote(v)}\n" for k, v in env.items()) + shlex.join(argv) + "\n"


EXIT_INTERRUPTED = 130


def run(argv: list[str], env: dict[str, str]) -> int:
    """Run the command with `env` merged over this process's environment; its stdout streams through (inherited, so
    the workers see the terminal), its stderr through a filter. Returns its exit status (128 + N when a signal N
    ended it).

    The command runs in its own session, so a Ctrl-C reaches only this process, which forwards it to torchrun once
    (torchrun stops its workers, which checkpoint and say where) and returns 130 once the command has exited;
    SIGTERM is forwarded likewise (143). torchrun answers the signal it was sent with a Python traceback of its own;
    once a signal has been forwarded, tracebacks are dropped from the stream (the workers' one-line messages pass)."""
    received: list[int] = []
    proc: subprocess.Popen | None = None

    def forward(signum, _frame):
        first = signum not in received
        received.append(signum)
        if first and proc is not None and proc.poll() is None:
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass

    def relay() -> None:
        in_traceback = False
        for line in proc.stderr:
            if received and line.startswith("Traceback (most recent call last)"):
                in_traceback = True
                continue
            if in_traceback:
                in_traceback = line[:1].isspace()  # a traceback ends with its unindented exception line
                continue
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (BrokenPipeError, ValueError):
                pass

    # The handlers go in before the command starts: a signal in between would otherwise end this process with a
    # KeyboardInterrupt and leave the command running in its own session.
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            proc = subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True,
                                    stderr=subprocess.PIPE, text=True, errors="replace")
        except OSError as e:
            raise LaunchError(f"cannot start {argv[0]}: {e.strerror or e}") from None
        for signum in dict.fromkeys(received):  # arrived while it was starting
            proc.send_signal(signum)
        # The relay thread starts with the two signals blocked (it inherits the mask), so the kernel delivers them to
        # this thread: a signal taken by the relay thread would leave this one blocked in wait() until the command
        # exits on its own, with the signal never forwarded.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))
        try:
            relay_thread = threading.Thread(target=relay, daemon=True)
            relay_thread.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    relay_thread.join(timeout=5)
    if received:
        return 128 + received[0]
    return 128 - code if code < 0 else code
