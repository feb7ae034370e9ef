"""The `recipe launch` command: checks a plan and its inputs, then runs `launch.train` on every rank through
torchrun (or prints the command, or writes an sbatch script). Registered in recipe/cli.py; the work is done by the
plain functions of launch/launcher.py. Never imports torch."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

EXIT_INPUT = 2

Opt = typer.Option


def launch(
    plan: Annotated[Path, typer.Argument(help="plan file (recipe solve … -o plan.yaml)", show_default=False)],
    steps: Annotated[int, Opt("--steps", help="the run's total optimizer steps (--resume continues up to it)")] = 1,
    out: Annotated[Optional[Path], Opt("--out", help="output folder: checkpoints, metrics.jsonl, TensorBoard "
                                                     "[default: runs/<plan name>]", show_default=False)] = None,
    data: Annotated[Optional[Path], Opt("--data", help="rollouts (.jsonl or .parquet); default: synthetic")] = None,
    seed: Annotated[Optional[int], Opt("--seed", help="random seed")] = None,
    dtype: Annotated[Optional[str], Opt("--dtype", help="bf16 | fp32 (default: bf16 on GPU, fp32 on CPU)")] = None,
    device: Annotated[Optional[str], Opt("--device", help="cpu | cuda (default: cpu for the cpu profile, else "
                                                          "cuda; ROCm is cuda too)")] = None,
    resume: Annotated[bool, Opt("--resume", help="continue from the last complete checkpoint in --out")] = False,
    checkpoint_every: Annotated[Optional[int], Opt("--checkpoint-every", help="save a checkpoint every N steps")]
    = None,
    keep_last: Annotated[Optional[int], Opt("--keep-last", help="keep only the newest N checkpoints (default: "
                                                                "all)")] = None,
    no_checkpoint: Annotated[bool, Opt("--no-checkpoint", help="save no checkpoint (not at the end, not on a "
                                                               "stop signal)")] = False,
    nnodes: Annotated[Optional[int], Opt("--nnodes", help="nodes of a multi-node launch (the plan's)")] = None,
    node_rank: Annotated[Optional[int], Opt("--node-rank", help="this node's rank, 0 … nnodes-1")] = None,
    rdzv_endpoint: Annotated[Optional[str], Opt("--rdzv-endpoint", help="HOST:PORT of the rendezvous (the first "
                                                                        "node)")] = None,
    dry_run: Annotated[bool, Opt("--dry-run", help="print the environment and the command; run nothing")] = False,
    emit: Annotated[Optional[str], Opt("--emit", help="slurm: write an sbatch script to <out>/launch.sbatch "
                                                      "instead of running")] = None,
    hf_checkpoint: Annotated[Optional[Path], Opt("--hf-checkpoint", help="start from these weights: a Hugging Face "
                                                                         "safetensors folder (or file)")] = None,
    export: Annotated[Optional[Path], Opt("--export", help="write the trained weights as a Hugging Face "
                                                           "checkpoint here (a new folder)")] = None,
    max_restarts: Annotated[int, Opt("--max-restarts", help="torchrun restarts of failed workers")] = 0,
    lr: Annotated[Optional[float], Opt("--lr", help="learning rate")] = None,
    objective: Annotated[Optional[str], Opt("--objective", help="rl | sft")] = None,
    max_grad_norm: Annotated[Optional[float], Opt("--max-grad-norm", help="gradient clipping; 0 turns it off")]
    = None,
    weight_decay: Annotated[Optional[float], Opt("--weight-decay", help="AdamW decoupled weight decay")] = None,
    temperature: Annotated[Optional[float], Opt("--temperature", help="sampling temperature of the log-probs")]
    = None,
    clip_low: Annotated[Optional[float], Opt("--clip-low", help="PPO ratio clip below 1")] = None,
    clip_high: Annotated[Optional[float], Opt("--clip-high", help="PPO ratio clip above 1")] = None,
    kl_coef: Annotated[Optional[float], Opt("--kl-coef", help="KL-to-reference coefficient")] = None,
    kl_estimator: Annotated[Optional[str], Opt("--kl-estimator", help="k1 | k3")] = None,
    entropy_coef: Annotated[Optional[float], Opt("--entropy-coef", help="entropy bonus coefficient")] = None,
    aggregation: Annotated[Optional[str], Opt("--aggregation", help="token_mean | seq_mean")] = None,
    tis_cap: Annotated[Optional[float], Opt("--tis-cap", help="truncated IS cap; 0 turns it off")] = None,
    rollouts_per_step: Annotated[Optional[int], Opt("--rollouts-per-step", help="0: every rollout every step")]
    = None,
    on_nonfinite: Annotated[Optional[str], Opt("--on-nonfinite", help="raise | skip: a step whose loss or gradients "
                                                                      "are not finite stops the run, or is "
                                                                      "skipped")] = None,
):
    """Launch training from a plan: torchrun on this node (or on every node of a rendezvous, or through SLURM).

    Checks the plan, this host, --data, --hf-checkpoint, --out, --resume and --export first (one line, no worker).

    Exits with the training's status (130 on Ctrl-C). docs/launch.md has the details."""
    from launch.launcher import LaunchError, LaunchOptions

    opts = LaunchOptions(
        out=str(out if out is not None else Path("runs") / plan.stem), steps=steps,
        data=_s(data), seed=seed, dtype=dtype, device=device, resume=resume, checkpoint_every=checkpoint_every,
        keep_last=keep_last, no_checkpoint=no_checkpoint, hf_checkpoint=_s(hf_checkpoint), export=_s(export), lr=lr,
        objective=objective, max_grad_norm=max_grad_norm, weight_decay=weight_decay, temperature=temperature,
        clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef, kl_estimator=kl_estimator, entropy_coef=entropy_coef,
        aggregation=aggregation, tis_cap=tis_cap, rollouts_per_step=rollouts_per_step, on_nonfinite=on_nonfinite,
        max_restarts=max_restarts, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint)
    try:
        code = _launch(plan, opts, dry_run=dry_run, emit=emit)
    except LaunchError as e:
        _fail(str(e))
    except OSError as e:  # a folder or file the command could not write or read
        _fail(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e) or type(e).__name__)
    except ValueError as e:  # a plan or profile that does not load (PlanError and friends)
        _fail(str(e) or type(e).__name__)
    raise typer.Exit(code)


def _launch(plan_path: Path, opts, *, dry_run: bool, emit: str | None) -> int:
    from launch import launcher as L

    if dry_run and emit is not None:
        raise L.LaunchError("--dry-run and --emit are alternatives; give one")
    if emit is not None and emit != "slurm":
        raise L.LaunchError(f"--emit must be 'slurm', got {emit!r}")
    if emit is not None and (opts.rendezvous or opts.nnodes is not None or opts.node_rank is not None):
        raise L.LaunchError("--emit slurm writes its own rendezvous (the allocation's first node); drop --nnodes, "
                            "--node-rank and --rdzv-endpoint")
    pre = L.preflight(plan_path, opts, check_host=not (dry_run or emit), slurm=emit is not None)
    for w in pre.warnings:
        _err(f"warning: {w}")
    plan, hw = pre.plan, pre.hw
    if emit == "slurm":
        return _emit_slurm(plan_path, plan, hw, opts)
    procs = L.local_processes(plan, rendezvous=opts.rendezvous)
    env = L.effective_env(L.launch_env(plan, hw, local_procs=procs))
    argv = L.build_torchrun_argv(plan_path, plan, opts)
    if dry_run:
        _out(L.display(env, argv))
        return 0
    _err("+ " + L.display({}, argv).rstrip("\n"))
    code = L.run(argv, env)
    if code == L.EXIT_INTERRUPTED:
        return code
    if code != 0:
        _fail(f"training exited with status {code} (the output above names the failing rank)", code)
    return 0


def _emit_slurm(plan_path: Path, plan, hw, opts) -> int:
    from launch import launcher as L

    target = Path(opts.out) / L.SLURM_SCRIPT
    if os.path.lexists(target):  # a dangling symlink too: the script is created, never written through a link
        raise L.LaunchError(f"{target} already exists; remove it or give another --out (nothing is overwritten)")
    text = L.slurm_script(plan_path, plan, opts, L.launch_env(plan, hw, local_procs=plan.launch.nproc_per_node))
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "x") as f:  # exclusive: never replaces a file that appeared meanwhile
        f.write(text)
    os.chmod(target, 0o755)
    _out(f"wrote {target} (submit with: sbatch {target})\n")
    return 0


def _s(p: Path | None) -> str | None:
    return None if p is None else str(p)


def _out(text: str) -> None:
    """stdout that ends quietly when its reader has gone (`recipe launch … --dry-run | head -1`)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        try:
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, sys.stdout.fileno())
            os.close(fd)
        except (OSError, ValueError):
            pass


def _err(line: str) -> None:
    sys.stderr.write(" ".join(line.split()) + "\n")
    sys.stderr.flush()


def _fail(msg: str, code: int = EXIT_INPUT) -> None:
    _err(f"error: {msg}")
    raise typer.Exit(code)
