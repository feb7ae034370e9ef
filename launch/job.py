"""One training job on every rank: what `python -m launch.train PLAN …` runs, alone or under torchrun.

    layout check (WORLD_SIZE against the plan, and each degree against what it splits, before any process group)
    → process group and meshes → model,
    parallelize → resume from DIR/checkpoints (DCP, any earlier layout) → steps → checkpoints every N steps →
    Hugging Face export

The global batch of a step is a property of the run, not of the layout: every rank reads the same rollouts, packs the
step's rollouts into the same micro-batches, and runs its data-parallel share of them (launch/parallel.py; the cp
ranks of a data-parallel coordinate each run their zigzag shard of the same micro-batches), so with the same seed
and data each step sees the same tokens under any layout and GPU count.

A SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C) stops the job after the current step on every rank (the flag
is agreed by an all-reduce, so no rank waits in a collective the others left), writes a checkpoint when there is an
output folder, and exits 143 / 130 with one line naming the checkpoint.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from launch.data import make_batch, pack_rollouts, read_rollouts, synthetic_rollouts
from launch.model import build_model, materialize
from launch.optim import NonFiniteError
from launch.parallel import build_meshes, check_layout, check_plan_shape, init_distributed, parallelize


class Stop:
    """The first SIGTERM/SIGINT asks the loop to stop after the current step; the exit status names the signal."""

    def __init__(self):
        self.signum = 0
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signum = self.signum or signum


def peak_memory_gb(device: torch.device) -> dict[str, float]:
    """This rank's peak memory so far (the run reports the largest over ranks). `peak_mem_gb`: on a GPU the caching
    allocator's peak allocated bytes, what the cost model's memory terms predict (the plan's total less its
    overhead); on the CPU the process's peak resident set, all of it. `peak_device_gb` (GPU only): the allocator's
    peak reserved bytes plus what the device holds outside the allocator now (CUDA context, NCCL buffers and
    workspaces, constant once the first step has run; another process on the same GPU would count too), the figure
    the plan's total, overhead included, predicts."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        outside = max(0, total - free - torch.cuda.memory_reserved(device))
        return {"peak_mem_gb": torch.cuda.max_memory_allocated(device) / 1e9,
                "peak_device_gb": (torch.cuda.max_memory_reserved(device) + outside) / 1e9}
    return {"peak_mem_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}  # Linux: KiB


class StackLimit:
    """The CUDA context's per-thread stack size (the driver's `CU_LIMIT_STACK_SIZE`), read and restored through the
    driver API. The driver raises it on its own for a kernel that needs more local memory than it holds, and keeps
    it raised: it reserves that much for every thread the GPU can hold, for the rest of the process. Tuning
    flash-linear-attention's gated backward (`chunk_bwd_kernel_dqkwg`) on an H200 launches configurations that spill
    26 KB a thread: the limit goes from 1 KB to 26 KB, and 6.8 GB stay reserved outside the caching allocator,
    though the configuration it keeps needs no more than 1 KB (docs/BENCHMARKS.md, "Device memory outside the
    allocator"). Restoring the limit once tuning is over gives them back; a kernel that needs more raises it again.
    `lib` is libcuda (None where there is none: CPU, ROCm), so every method is a no-op there."""

    STACK_SIZE = 0  # CUlimit CU_LIMIT_STACK_SIZE

    def __init__(self, lib=None):
        self.lib = lib
        self.initial = self.get()

    @classmethod
    def of_this_process(cls) -> "StackLimit":
        try:
            return cls(ctypes.CDLL("libcuda.so.1"))
        except OSError:
            return cls(None)

    def get(self) -> int | None:
        if self.lib is None:
            return None
        v = ctypes.c_size_t(0)
        return v.value if self.lib.cuCtxGetLimit(ctypes.byref(v), self.STACK_SIZE) == 0 else None

    def restore(self) -> int:
        """Set the limit back to its value when this object was made, if it has grown since: returns the bytes a
        thread it grew by (0 when it had not, or there is nothing to restore)."""
        now = self.get()
        if now is None or self.initial is None or now <= self.initial:
            return 0
        ok = self.lib.cuCtxSetLimit(self.STACK_SIZE, ctypes.c_size_t(self.initial)) == 0
        return now - self.initial if ok else 0


def max_over_ranks(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Each value's largest over the process group's ranks (for memory: the rank that runs out first, the busiest
    expert rank under imbalance; for the stop flag: the signal any rank received); the values as they are without a
    process group or in a world of one. Every rank passes the same keys."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


def run(args, cfg, trainer_cls) -> int:
    from launch.checkpoint import TrainState, latest, load, save
    from recipe.plan import load_plan

    plan = load_plan(args.plan)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    check_layout(plan.layout, world)  # one line, before any process group starts
    shape = plan.model_shape(Path(args.plan).resolve().parent)
    check_plan_shape(plan, shape)  # cp splits the micro-batch into whole chunks (recipe check's rule), etc.
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible to this process")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype] if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    rollouts = (read_rollouts(args.data, vocab_size=shape.vocab_size) if args.data
                else synthetic_rollouts(8, 4, shape.vocab_size, seed=args.seed))
    per_step = args.rollouts_per_step or len(rollouts)
    if per_step > len(rollouts):
        raise ValueError(f"--rollouts-per-step {per_step} but the data holds {len(rollouts)} rollouts")
    stop = Stop()

    # the run folder first: a resume, or a refusal, before any process group or weight exists
    out = Path(args.out) if args.out else None
    resume = bool(out) and (args.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0)
    found = latest(out) if out is not None else None
    if args.resume and not found:
        raise ValueError(f"--resume: no complete checkpoint in {out / 'checkpoints'}")
    if found and not resume:
        raise ValueError(f"{out} holds another run's checkpoints (last: step {found[0]}): pass --resume to continue "
                         f"it, or choose another --out")
    if args.export and Path(args.export).exists():
        raise ValueError(f"--export {args.export} exists; choose a new folder")
    meshes = None
    if world > 1:
        init_distributed(device.type)
        meshes = build_meshes(plan.layout, device.type)
    torch.manual_seed(args.seed)
    model = build_parallel_model(shape, plan, meshes, device, dtype, args.seed)
    if args.hf_checkpoint and not found:  # a resumed run (or a torchrun restart) continues from its checkpoint
        from launch.hf_io import load_hf_checkpoint

        load_hf_checkpoint(model, args.hf_checkpoint)
    trainer = trainer_cls(model, cfg, recompute=plan.train.recompute, keep_layers=plan.train.keep_layers,
                          keep_selections=plan.train.keep_selections, lm_head=plan.train.lm_head,
                          dp_rank=meshes.dp_rank if meshes else 0, dp_size=meshes.dp_size if meshes else 1,
                          dp_group=meshes.dp_group if meshes else None,
                          metrics_group=meshes.data_group if meshes else None)

    train_state = TrainState()
    load_s = 0.0
    if found:
        t_load = time.perf_counter()
        load(found[1], {"optim": trainer.optimizer, "train": train_state})
        load_s = time.perf_counter() - t_load
        trainer.step_num = train_state.step
    progress = None
    if rank == 0 and out is not None:
        from launch.progress import Progress

        progress = Progress.for_plan(out, plan, args.steps, base_dir=Path(args.plan).resolve().parent,
                                     resume_step=train_state.step if found else None)
        if found:
            progress.log(f"resumed from {found[1]} (step {train_state.step}, saved at world size "
                         f"{_saved_world(found[1])}; loaded in {load_s:.2f} s)")

    def log(msg: str) -> None:
        if rank == 0:
            (progress.log if progress else print)(msg)

    last_saved = train_state.step
    step = train_state.step
    stack = StackLimit.of_this_process() if device.type == "cuda" else None  # CUDA is initialized by now
    if device.type == "cuda" and step < args.steps:
        cache = os.environ.get("TRITON_CACHE_DIR") or "~/.triton/cache"
        log(f"step {step + 1} compiles and tunes the Triton kernels: minutes where their cache ({cache}) is cold")
    try:
        while step < args.steps:
            step += 1
            start = ((step - 1) * per_step) % len(rollouts)
            chosen = (rollouts + rollouts)[start:start + per_step]
            groups = pack_rollouts(chosen, plan.train.micro_batch_tokens, trainer.dp_size)
            batches = [make_batch(g, device) for g in groups]
            t0 = time.perf_counter()
            try:
                metrics = trainer.step(batches)
            except NonFiniteError as e:
                log(f"error: {e}")
                return 2
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_s = time.perf_counter() - t0
            if stack is not None:  # the first step of this process tuned the Triton kernels: give back their stack
                grown = stack.restore()
                stack = None
                if grown:
                    log(f"gave back the CUDA stack the kernels' tuning grew by {grown / 1024:.1f} KB a thread (held "
                        f"for every thread the GPU can run, outside the caching allocator)")
            # one all-reduce a step: the stop flag (any rank's signal, so every rank leaves the loop together) and
            # the memory figures (the largest rank's)
            agreed = max_over_ranks({**peak_memory_gb(device), "signum": stop.signum}, device)
            signum = int(agreed.pop("signum"))
            metrics.update(step_time_s=step_s, tokens=sum(b.num_tokens for b in batches), **agreed)
            if progress:
                progress.update(metrics)
            elif rank == 0:
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()),
                      flush=True)
            due = args.checkpoint_every and step % args.checkpoint_every == 0
            if out is not None and not args.no_checkpoint and (due or signum or step == args.steps):
                t_save = time.perf_counter()
                train_state.step, train_state.data = step, {"rollout_position": (step * per_step) % len(rollouts)}
                path = save(out, step, {"optim": trainer.optimizer, "train": train_state},
                            keep_last=args.keep_last or None)
                last_saved = step
                log(f"checkpoint {path} ({time.perf_counter() - t_save:.2f} s)")
            if signum:
                where = ("no --out: not saved" if out is None else "--no-checkpoint: not saved" if args.no_checkpoint
                         else f"checkpoint at {out / 'checkpoints' / f'step_{last_saved}'}")
                if rank == 0:
                    print(f"stopped by {signal.Signals(signum).name} after step {step}; {where}", file=sys.stderr)
                return 128 + signum
        if progress:
            progress.close()
            from launch.progress import summary

            print(summary(progress.measured(), plan.prediction))
        if args.export:
            _export(model, args.export, rank, dtype)
            log(f"exported {args.export}")
    finally:
        if progress:
            progress.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _saved_world(path: Path) -> str:
    from launch.checkpoint_index import read_marker

    return str(read_marker(path).get("world_size", "?"))


def build_parallel_model(shape, plan, meshes, device: torch.device, dtype: torch.dtype, seed: int, **kw):
    """The model of `shape` with the plan's layout on this rank. One process (meshes None, or a world of one)
    keeps `dtype` parameters (with fp32 masters beside them, in the trainer); under FSDP2 the fp32 shards are the
    masters and `dtype` exists only while a layer is gathered. Distributed, the model is built on the meta device and
    parallelized before any weight exists, so no rank ever holds the whole model: each allocates and initializes
    (or loads) only its shards, and they equal the whole model's (launch.model.init_parameters). `kw` goes to
    parallelize (ep_dispatch)."""
    if meshes is None or meshes.world == 1:  # no FSDP2: nothing would cast the parameters for compute
        return parallelize(build_model(shape, device=device, dtype=dtype, seed=seed), plan, meshes,
                           param_dtype=dtype, **kw)
    model = parallelize(build_model(shape, device="meta"), plan, meshes, param_dtype=dtype, **kw)
    return materialize(model, device, seed=seed)


def _export(model, out_dir: str, rank: int, dtype: torch.dtype) -> None:
    """Hugging Face safetensors of the whole model, gathered to rank 0's host memory one parameter at a time (so a
    model whose fp32 weights fit in one host's memory: ~35B parameters on a 256 GB node)."""
    from launch.hf_io import export_hf_checkpoint

    state = None
    if getattr(model, "pipeline", None) is not None:  # each rank holds one stage: every stage's tensors to rank 0
        from launch.model import Transformer
        from launch.pipeline import gathered_state_dict

        state = gathered_state_dict(model)
        with torch.device("meta"):
            model = Transformer(model.shape)  # the whole model's module tree, for the names (no storage)
    elif dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        export_hf_checkpoint(model, out_dir, state_dict=state, dtype=dtype)
