"""`launch.train` under real torchrun launches (gloo, CPU, tiny-moe): the same losses under any layout, resume equal to
an uninterrupted run, re-deploy across world sizes through DCP's resharding (a tp=2 run resumed on one process
among them), recovery from a SIGKILLed rank, and a checkpoint on SIGINT.

One uninterrupted 2-process run (plans/tiny-cpu.yaml: dp=2, ep=2, 2 EP chunks, FSDP2) is the reference; SFT on
synthetic rollouts, 8 rollouts a step (so each step's data differs), fp32. Tolerances: the same layout resumed
1e-6 relative; another layout (other micro-batching, other reduction order) 1e-5.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[1]
PLAN2 = ROOT / "plans" / "tiny-cpu.yaml"
TRAIN = ["--device", "cpu", "--objective", "sft", "--lr", "3e-3", "--rollouts-per-step", "8", "--seed", "0"]
SAME, OTHER = 1e-6, 1e-5


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def torchrun(nproc: int, plan: Path, out: Path, *args: str, restarts: int = 0, check: bool = True):
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--max-restarts", str(restarts), "-m", "launch.train", str(plan), "--out", str(out), *TRAIN, *args]
    r = subprocess.run(argv, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=240)
    if check:
        assert r.returncode == 0, f"stdout: {r.stdout[-1500:]}\nstderr: {r.stderr[-3000:]}"
    return r


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"each step once, in order: {steps}"
    return {r["step"]: r["loss"] for r in rows}


def close(a: dict, b: dict, steps, tol: float) -> None:
    for s in steps:
        assert abs(a[s] - b[s]) <= tol * abs(b[s]), f"step {s}: {a[s]!r} vs {b[s]!r} (tolerance {tol:g})"


@pytest.fixture(scope="module")
def plan1(tmp_path_factory) -> Path:
    """The same model on one CPU process (a world-1 layout of the same plan inputs)."""
    path = tmp_path_factory.mktemp("plan") / "tiny-1.yaml"
    r = subprocess.run(["recipe", "solve", "--model", "tiny-moe", "--seq", "4k", "--hw", "cpu", "--gpus", "1", "-o",
                        str(path)], env=_env(), cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("ref") / "run"
    torchrun(2, PLAN2, out, "--steps", "4", "--checkpoint-every", "2")
    assert (out / "checkpoints" / "step_2" / "COMPLETE").exists() and (out / "checkpoints" / "step_4").exists()
    return losses(out)


def test_resume_equals_the_uninterrupted_run(tmp_path, reference):
    out = tmp_path / "run"
    torchrun(2, PLAN2, out, "--steps", "2")
    r = torchrun(2, PLAN2, out, "--steps", "4", "--resume")
    assert "resumed from" in r.stdout
    got = losses(out)
    assert sorted(got) == [1, 2, 3, 4]
    close(got, reference, [1, 2, 3, 4], SAME)
    # (no "it learns" here: the synthetic rollouts are uniform random tokens, whose loss sits at ln(vocab) from the
    # first step; tests/test_train.py holds learning on a fixed batch)


def test_redeploy_from_two_processes_to_one(tmp_path, reference, plan1):
    """Resumed on one process under partial recompute (the plan's train.keep_layers: the last 2 of the 4 layers keep
    their activations): the checkpoint's names do not depend on which layers are recomputed, and the losses are the
    reference's."""
    out = tmp_path / "run"
    torchrun(2, PLAN2, out, "--steps", "2")
    text = plan1.read_text()
    assert "\ntrain:\n  recompute: full\n" in text and "keep_layers" not in text
    keep = tmp_path / "tiny-1-keep2.yaml"
    keep.write_text(text.replace("\ntrain:\n  recompute: full\n", "\ntrain:\n  recompute: full\n  keep_layers: 2\n"))
    r = torchrun(1, keep, out, "--steps", "4", "--resume")
    assert "saved at world size 2" in r.stdout
    close(losses(out), reference, [3, 4], OTHER)


def test_redeploy_from_one_process_to_two_and_export(tmp_path, reference, plan1):
    import torch

    from launch.checkpoint import load
    from launch.hf_io import load_hf_checkpoint
    from launch.model import build_model
    from launch.optim import MasterAdamW
    from recipe.models import PRESETS

    out = tmp_path / "run"
    torchrun(1, plan1, out, "--steps", "2")
    close(losses(out), reference, [1, 2], OTHER)  # the same data under another layout
    torchrun(2, PLAN2, out, "--steps", "4", "--resume", "--export", str(tmp_path / "hf"))
    close(losses(out), reference, [3, 4], OTHER)
    # the export (gathered from FSDP2 and EP shards on rank 0) holds the final masters of the checkpoint
    exported = build_model(PRESETS["tiny-moe"], seed=7)
    load_hf_checkpoint(exported, tmp_path / "hf")
    saved = build_model(PRESETS["tiny-moe"], seed=8)
    opt = MasterAdamW(saved.named_parameters(), lr=1.0)
    load(out / "checkpoints" / "step_4", {"optim": opt})
    for (name, a), b in zip(exported.named_parameters(), saved.parameters()):
        assert torch.equal(a, b), name
    # and it starts a run under either layout: loaded into the shards of a model built on the meta device (two
    # processes, started by `recipe launch --hf-checkpoint`) or into the whole model (one), the first step's loss
    # is the same, and not the random init's
    r = subprocess.run([sys.executable, "-m", "recipe", "launch", str(PLAN2), "--out", str(tmp_path / "from_hf_2"),
                        *TRAIN, "--steps", "1", "--hf-checkpoint", str(tmp_path / "hf")],
                       env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"stdout: {r.stdout[-1500:]}\nstderr: {r.stderr[-3000:]}"
    assert "--hf-checkpoint" in r.stderr  # the command it ran, echoed
    torchrun(1, plan1, tmp_path / "from_hf_1", "--steps", "1", "--hf-checkpoint", str(tmp_path / "hf"))
    starts = {n: losses(tmp_path / f"from_hf_{n}") for n in (2, 1)}
    close(starts[2], starts[1], [1], OTHER)
    assert abs(starts[1][1] - reference[1]) > 1e-3


def _workers(parent: int) -> list[int]:
    """Live processes whose parent is `parent` (torchrun's workers)."""
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent and fields[0] != "Z":
                kids.append(int(d.name))
    return kids


def _wait_for_step(out: Path, step: int, proc, timeout: float = 120) -> None:
    end = time.time() + timeout
    while time.time() < end:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        path = out / "metrics.jsonl"
        if path.exists() and any(json.loads(x)["step"] >= step for x in path.read_text().splitlines() if x.strip()):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} never reached")


def test_a_sigkilled_rank_is_restarted_and_resumes_from_the_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
            "1", "-m", "launch.train", str(PLAN2), "--out", str(out), *TRAIN, "--steps", "24",
            "--checkpoint-every", "3"]
    proc = subprocess.Popen(argv, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(out, 5, proc)
    victims = _workers(proc.pid)
    assert victims, "no worker processes found"
    os.kill(victims[-1], signal.SIGKILL)  # a rank dies mid-run, without a word
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-3000:]
    assert "resumed from" in stdout
    resumed = int(stdout.split("resumed from")[1].split("step_")[1].split()[0])
    assert resumed % 3 == 0 and resumed >= 3  # the last complete checkpoint: at most the interval is redone
    assert sorted(losses(out)) == list(range(1, 25))


def test_sigint_stops_after_the_step_with_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    argv = ["recipe", "launch", str(PLAN2), "--out", str(out), "--steps", "500", "--objective", "sft", "--lr", "1e-3"]
    proc = subprocess.Popen(argv, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(out, 3, proc)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "Traceback" not in stderr and "Traceback" not in stdout
    line = [x for x in stderr.splitlines() if x.startswith("stopped by SIGINT")]
    assert len(line) == 1, stderr[-2000:]  # one line, from rank 0
    saved = int(line[0].split("step_")[-1])
    assert saved >= 3 and (out / "checkpoints" / f"step_{saved}" / "COMPLETE").exists()


def _two_steps_exported(tmp_path, reference, name: str, seq: str, *pins: str, gpus: int = 2):
    """Solve a `gpus`-process tiny-moe plan with `pins` and run two steps of it under torchrun with --export: both
    losses equal the reference's, and the export holds the step-2 checkpoint's masters. Returns (run folder, plan)."""
    import torch

    from launch.checkpoint import load
    from launch.hf_io import load_hf_checkpoint
    from launch.model import build_model
    from launch.optim import MasterAdamW
    from recipe.models import PRESETS

    plan = tmp_path / f"{name}.yaml"
    r = subprocess.run(["recipe", "solve", "--model", "tiny-moe", "--seq", seq, "--hw", "cpu", "--gpus", str(gpus),
                        *pins, "-o", str(plan)], env=_env(), cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "run"
    torchrun(gpus, plan, out, "--steps", "2", "--export", str(tmp_path / "hf"))
    close(losses(out), reference, [1, 2], OTHER)
    exported = build_model(PRESETS["tiny-moe"], seed=7)
    load_hf_checkpoint(exported, tmp_path / "hf")
    saved = build_model(PRESETS["tiny-moe"], seed=8)
    opt = MasterAdamW(saved.named_parameters(), lr=1.0)
    load(out / "checkpoints" / "step_2", {"optim": opt})
    for (param, a), b in zip(exported.named_parameters(), saved.parameters()):
        assert torch.equal(a, b), param
    return out, plan


def test_tensor_parallel_run_exports_and_resumes_at_tp1(tmp_path, reference, plan1):
    """tp=2 (with FSDP2 and its sequence-parallel experts) for two steps, exported; resumed on one process: every
    step's loss equals the reference's, and the export holds the checkpoint's masters (the tp DTensors and the
    head-grouped Gated DeltaNet rows gathered and written in Hugging Face's layout)."""
    out, _ = _two_steps_exported(tmp_path, reference, "tp2", "4k", "--tp", "2")
    r = torchrun(1, plan1, out, "--steps", "4", "--resume")
    assert "saved at world size 2" in r.stdout
    close(losses(out), reference, [3, 4], OTHER)


def test_pipeline_run_exports_resumes_and_redeploys(tmp_path, reference, plan1):
    """pp=2 (1F1B over 3 + 1 layers, 512-token micro-batches) for two steps, exported; resumed on one process for
    step 3 and at pp=2 again for step 4: every step's loss equals the reference's, and the export holds the
    checkpoint's masters (every stage's parameters under the whole model's names)."""
    out, plan = _two_steps_exported(tmp_path, reference, "pp2", "512", "--pp", "2")
    r = torchrun(1, plan1, out, "--steps", "3", "--resume")
    assert "saved at world size 2" in r.stdout
    r = torchrun(2, plan, out, "--steps", "4", "--resume")
    assert "resumed from" in r.stdout and "saved at world size 1" in r.stdout
    close(losses(out), reference, [3, 4], OTHER)


def test_pipeline_with_tensor_parallel_run_exports_and_resumes_at_tp1(tmp_path, reference, plan1):
    """pp=2 × tp=2 on 4 processes (3 + 1 layers, each stage's heads and vocabulary split over its 2 tp ranks) for
    two steps, exported; resumed on one process: every step's loss equals the reference's, and the export holds the
    checkpoint's masters (each stage's tp DTensors gathered, every tensor once)."""
    out, _ = _two_steps_exported(tmp_path, reference, "pp2_tp2", "512", "--pp", "2", "--tp", "2", gpus=4)
    r = torchrun(1, plan1, out, "--steps", "4", "--resume")
    assert "saved at world size 4" in r.stdout
    close(losses(out), reference, [3, 4], OTHER)
