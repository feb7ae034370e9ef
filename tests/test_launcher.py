"""`recipe launch`: the torchrun command and environment, the sbatch script, every pre-flight refusal (one line,
non-zero exit, nothing written), running and interrupting the command; checkpoints (atomic commit, crash mid-save,
resharding from an FSDP2 world of 2 to one process); the progress reporter and metrics.jsonl."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from launch import launcher as L
from launch.checkpoint_index import latest
from recipe.cli import app

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "plans"
CPU_PLAN = PLANS / "tiny-cpu.yaml"
H100_PLAN = PLANS / "qwen35-35b_h100_32k.yaml"  # 2 nodes x 8 GPUs
PY = sys.executable
HW_VARS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_DEBUG", "HSA_NO_SCRATCH_RECLAIM", "HIP_FORCE_DEV_KERNARG",
           "NCCL_MIN_NCHANNELS", "OMP_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
runner = CliRunner()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """The caller's environment wins over launch_env's values: keep it out of the exact comparisons; 8 cores."""
    for k in HW_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(L, "host_cpu_count", lambda: 8)


@pytest.fixture
def no_launch(monkeypatch):
    """Any attempt to start a process fails the test."""

    def run(*a, **k):
        raise AssertionError(f"the command was run: {a} {k}")

    monkeypatch.setattr(L, "run", run)


def launch(*args: str):
    return runner.invoke(app, ["launch", *args])


def one_line_error(result, *needles: str, code: int | None = None) -> str:
    assert result.exit_code != 0, result.output
    if code is not None:
        assert result.exit_code == code, (result.exit_code, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    err = result.stderr.strip()
    assert "Traceback" not in result.output and "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: "), err
    for n in needles:
        assert n in err, err
    return err


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def fake_checkpoint(out: Path, step: int, complete: bool = True) -> Path:
    """A checkpoint folder as launch.checkpoint commits it (no torch needed to make one for the launcher's checks)."""
    d = out / "checkpoints" / (f"step_{step}" if complete else f".step_{step}.tmp")
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"meta")
    (d / "__0_0.distcp").write_bytes(b"shard")
    if complete:
        (d / "COMPLETE").write_text(json.dumps({"step": step}))
    return d


@pytest.fixture
def h100_one_node(tmp_path) -> Path:
    """tiny-moe on 4 H100s: one node of 4 GPUs."""
    path = tmp_path / "tiny-h100.yaml"
    r = runner.invoke(app, ["solve", "--model", "tiny-moe", "--seq", "4k", "--hw", "h100", "--gpus", "4", "-o",
                            str(path)])
    assert r.exit_code == 0, r.output
    return path


# ---- the command and the environment ---------------------------------------------------------------------------------
def test_dry_run_one_node_cpu_plan(tmp_path, no_launch):
    out = tmp_path / "run"
    r = launch(str(CPU_PLAN), "--dry-run", "--out", str(out), "--steps", "5", "--seed", "3", "--lr", "3e-3",
               "--objective", "sft", "--max-grad-norm", "0")
    assert r.exit_code == 0, r.output
    assert r.stdout == (
        "OMP_NUM_THREADS=4\n"  # 8 cores, two processes
        f"{PY} -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 0 -m launch.train "
        f"{CPU_PLAN} --out {out} --steps 5 --seed 3 --device cpu --lr 0.003 --objective sft --max-grad-norm 0.0\n")
    assert not out.exists()  # a dry run writes nothing


def test_torchrun_argv_one_node_cpu_plan_exact():
    from recipe.plan import load_plan

    plan = load_plan(CPU_PLAN)
    opts = L.LaunchOptions(out="runs/x", steps=10, data="r.jsonl", dtype="fp32", resume=True, checkpoint_every=5,
                           hf_checkpoint="base", export="hf", kl_estimator="k1", aggregation="seq_mean", tis_cap=0.0,
                           rollouts_per_step=4, on_nonfinite="skip", max_restarts=2)
    assert L.build_torchrun_argv("p.yaml", plan, opts) == [
        PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
        "-m", "launch.train", "p.yaml", "--out", "runs/x", "--steps", "10", "--data", "r.jsonl", "--dtype", "fp32",
        "--device", "cpu", "--resume", "--checkpoint-every", "5", "--hf-checkpoint", "base", "--export", "hf",
        "--kl-estimator", "k1", "--aggregation", "seq_mean", "--tis-cap", "0.0", "--rollouts-per-step", "4",
        "--on-nonfinite", "skip"]
    assert L.launch_env(plan, plan.hw_profile(), cpu_count=8) == {"OMP_NUM_THREADS": "4"}


def test_dry_run_two_process_cpu_plan_splits_the_cores(tmp_path, no_launch):
    plan = tmp_path / "tiny2.yaml"
    r = runner.invoke(app, ["solve", "--model", "tiny-moe", "--seq", "4k", "--hw", "cpu", "--gpus", "2", "-o",
                            str(plan)])
    assert r.exit_code == 0, r.output
    r = launch(str(plan), "--dry-run", "--out", str(tmp_path / "o"))
    assert r.exit_code == 0, r.output
    env, cmd = r.stdout.splitlines()
    assert env == "OMP_NUM_THREADS=4"
    assert " --standalone --nproc-per-node 2 " in cmd


def test_dry_run_multi_node_h100_plan(tmp_path, no_launch):
    from recipe.plan import load_plan

    plan = load_plan(H100_PLAN)
    assert (plan.launch.nnodes, plan.launch.nproc_per_node) == (2, 8)  # what the lists below are written for
    out = tmp_path / "run"
    r = launch(str(H100_PLAN), "--dry-run", "--out", str(out), "--steps", "100", "--nnodes", "2", "--node-rank",
               "1", "--rdzv-endpoint", "node0:29500", "--dtype", "bf16")
    assert r.exit_code == 0, r.output
    rdzv_id = L.rdzv_id(H100_PLAN, str(out))
    assert rdzv_id.startswith("qwen35-35b_h100_32k-")
    assert r.stdout.splitlines() == [
        "TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        "NCCL_DEBUG=WARN",
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",  # the plan's launch.env
        f"{PY} -m torch.distributed.run --nnodes 2 --node-rank 1 --rdzv-backend c10d --rdzv-endpoint node0:29500 "
        f"--rdzv-id {rdzv_id} --nproc-per-node 8 --max-restarts 0 -m launch.train {H100_PLAN} --out {out} "
        f"--steps 100 --dtype bf16 --device cuda"]
    # the same command on node 0 but for the node rank: one rendezvous id for the job
    r0 = launch(str(H100_PLAN), "--dry-run", "--out", str(out), "--steps", "100", "--nnodes", "2", "--node-rank",
                "0", "--rdzv-endpoint", "node0:29500", "--dtype", "bf16")
    assert r0.stdout.replace("--node-rank 0", "--node-rank 1") == r.stdout


def test_the_callers_environment_wins(tmp_path, monkeypatch, no_launch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    r = launch(str(H100_PLAN), "--dry-run", "--out", str(tmp_path / "o"), "--nnodes", "2", "--node-rank", "0",
               "--rdzv-endpoint", "h:1")
    assert "NCCL_DEBUG=INFO" in r.stdout.splitlines()


def test_amd_environment():
    from recipe.plan import load_plan

    plan = load_plan(PLANS / "qwen35-35b_mi300x_32k.yaml")
    assert L.launch_env(plan, plan.hw_profile()) == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_DEBUG": "WARN", "HSA_NO_SCRATCH_RECLAIM": "1",
        "HIP_FORCE_DEV_KERNARG": "1", "NCCL_MIN_NCHANNELS": "112",
        "PYTORCH_HIP_ALLOC_CONF": "expandable_segments:True"}
    mi355 = load_plan(PLANS / "qwen35-35b_mi355x_32k.yaml")
    assert "NCCL_MIN_NCHANNELS" not in L.launch_env(mi355, mi355.hw_profile())  # the figure is MI300X's


def test_counting_gpus_without_torch(tmp_path):
    smi = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-2)\n"
    tools = {"nvidia-smi": smi, "rocm-smi": "GPU[0]\t\t: Device Name: x\nGPU[0]\t\t: Device ID: y\nGPU[1]\t\t: a\n"}

    def run(argv):
        return tools.get(argv[0])

    assert L.count_gpus("nvidia", {}, run) == 2
    assert L.count_gpus("nvidia", {"CUDA_VISIBLE_DEVICES": "1"}, run) == 1
    assert L.count_gpus("nvidia", {"CUDA_VISIBLE_DEVICES": ""}, run) == 0
    assert L.count_gpus("nvidia", {"CUDA_VISIBLE_DEVICES": "0,-1,1"}, run) == 1
    assert L.count_gpus("amd", {}, run) == 2
    assert L.count_gpus("amd", {"HIP_VISIBLE_DEVICES": "0"}, run) == 1
    # no tools: the drivers' own files
    (tmp_path / "proc/driver/nvidia/gpus/0000:01:00.0").mkdir(parents=True)
    for node, simds in (("0", 0), ("1", 304), ("2", 304)):
        d = tmp_path / "sys/class/kfd/kfd/topology/nodes" / node
        d.mkdir(parents=True)
        (d / "properties").write_text(f"cpu_cores_count 0\nsimd_count {simds}\n")
    assert L.count_gpus("nvidia", {}, lambda a: None, root=str(tmp_path)) == 1
    assert L.count_gpus("amd", {}, lambda a: None, root=str(tmp_path)) == 2
    assert L.count_gpus("nvidia", {}, lambda a: None, root=str(tmp_path / "none")) == 0


# ---- SLURM -----------------------------------------------------------------------------------------------------------
def test_emit_slurm_writes_a_script_once(tmp_path, monkeypatch, no_launch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    r = launch(str(H100_PLAN), "--emit", "slurm", "--out", str(out), "--steps", "50", "--seed", "1")
    assert r.exit_code == 0, r.output
    script = out / "launch.sbatch"
    assert r.stdout == f"wrote {script} (submit with: sbatch {script})\n"
    text = script.read_text()
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 f"#SBATCH --chdir={tmp_path}", f"#SBATCH --output={out}/slurm-%j.out", "set -euo pipefail",
                 "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1", "export NCCL_DEBUG=WARN",
                 "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                 'RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)', "export RDZV_HOST"):
        assert line in lines, line
    srun = next(line for line in lines if line.startswith("srun "))
    assert srun == (
        "srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "
        f"'exec {PY} -m torch.distributed.run --nnodes 2 --node-rank ${{SLURM_NODEID}} --rdzv-backend c10d "
        f"--rdzv-endpoint ${{RDZV_HOST}}:29500 --rdzv-id ${{SLURM_JOB_ID}} --nproc-per-node 8 --max-restarts 0 "
        f"-m launch.train {H100_PLAN} --out {out} --steps 50 --seed 1 --device cuda'")
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    # never overwritten
    before = script.read_bytes()
    r = launch(str(H100_PLAN), "--emit", "slurm", "--out", str(out), "--steps", "50")
    one_line_error(r, "already exists", code=2)
    assert script.read_bytes() == before


def test_slurm_script_runs_the_command_on_each_node(tmp_path, monkeypatch):
    """With stand-ins for scontrol, srun and python: each node's task sees its node rank, the first node's host and
    the job id, and a path with a space survives the two levels of quoting."""
    from recipe.plan import load_plan

    plan = load_plan(H100_PLAN)
    monkeypatch.setattr(L.sys, "executable", "echo")
    opts = L.LaunchOptions(out=str(tmp_path / "my run"), steps=3)
    text = L.slurm_script(H100_PLAN, plan, opts, {"NCCL_DEBUG": "WARN"}, workdir=tmp_path)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-a\\ngpu-b\\n'\n")
    (bin_ / "srun").write_text(textwrap.dedent("""\
        #!/bin/bash
        while [[ $1 == --* ]]; do shift; done
        for n in 0 1; do SLURM_NODEID=$n "$@"; done
        """))
    for f in bin_.iterdir():
        f.chmod(0o755)
    script = tmp_path / "s.sbatch"
    script.write_text(text)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-[a-b]",
           "SLURM_JOB_ID": "4242"}
    res = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    out = res.stdout.splitlines()
    assert len(out) == 2
    for rank, line in enumerate(out):
        assert f"--node-rank {rank} --rdzv-backend c10d --rdzv-endpoint gpu-a:29500 --rdzv-id 4242 " in line
        assert line.endswith(f"--out {tmp_path / 'my run'} --steps 3 --device cuda")


def test_cpu_plan_slurm_asks_for_no_gpus(tmp_path):
    from recipe.plan import load_plan

    plan = load_plan(CPU_PLAN)
    text = L.slurm_script(CPU_PLAN, plan, L.LaunchOptions(out="o"), {"OMP_NUM_THREADS": "8"}, workdir=tmp_path)
    assert "--gpus-per-node" not in text and "#SBATCH --nodes=1" in text


# ---- pre-flight refusals -----------------------------------------------------------------------------------------
def test_a_plan_that_fails_validation(tmp_path, no_launch):
    bad = tmp_path / "bad.yaml"
    bad.write_text(CPU_PLAN.read_text().replace("layout:\n", "layout:\n  pq: 1\n"))
    one_line_error(launch(str(bad), "--dry-run"), "bad.yaml", "layout.pq", "unknown key", code=2)
    bad.write_text("schema: 1\nlayout: [\n")
    one_line_error(launch(str(bad), "--dry-run"), "bad.yaml", "not valid YAML", code=2)
    one_line_error(launch(str(tmp_path / "absent.yaml"), "--dry-run"), "plan not found", code=2)
    one_line_error(launch(str(tmp_path), "--dry-run"), "is a directory", code=2)


def test_a_plan_of_a_model_the_core_does_not_train_is_refused_before_any_worker(tmp_path, no_launch):
    """Qwen2-MoE with `mlp_only_layers` (a softmax-routed MoE of arch "moe") is planned, not trained: the launch says
    so in one line (recipe.models.trainable) and starts nothing; gpt-oss's plan at cp = 2 (attention sinks and sliding
    windows under context parallelism) and DeepSeek-V3's pass that check (and stop at the rendezvous they need)."""
    import json

    config = tmp_path / "qwen2moe" / "config.json"
    config.parent.mkdir()
    cfg = json.loads((ROOT / "tests/fixtures/configs/qwen1.5-moe-a2.7b.json").read_text())
    config.write_text(json.dumps(cfg | {"mlp_only_layers": [0]}))
    plan = tmp_path / "planned.yaml"
    solved = runner.invoke(app, ["solve", "--model", str(config), "--seq", "8k", "--hw", "h100", "--output", str(plan)])
    assert solved.exit_code == 0, solved.output
    one_line_error(launch(str(plan), "--dry-run"), "arch 'moe' is planned by `recipe solve` but not trained", code=2)
    for name in ("gpt-oss-120b_h100_32k.yaml", "deepseek-v3_h100_32k.yaml"):
        r = launch(str(CPU_PLAN.parent / name), "--dry-run")
        assert "not trained" not in r.output and "--rdzv-endpoint" in r.output, r.output


def test_a_drifted_plan_warns_in_one_line_and_still_launches(tmp_path, no_launch):
    drifted = tmp_path / "drifted.yaml"
    drifted.write_text(CPU_PLAN.read_text().replace("step_time_s: ", "step_time_s: 1"))
    r = launch(str(drifted), "--dry-run", "--out", str(tmp_path / "o"))
    assert r.exit_code == 0, r.output
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("warning: ") and "drifted" in err
    assert "prediction.step_time_s" in err and "recipe check --fix" in err
    assert "launch.train" in r.stdout


def test_multi_node_plan_needs_a_rendezvous(tmp_path, no_launch):
    one_line_error(launch(str(H100_PLAN), "--dry-run"), "spans 2 nodes", "--rdzv-endpoint", "--emit slurm")
    one_line_error(launch(str(H100_PLAN), "--dry-run", "--nnodes", "2"), "missing --node-rank, --rdzv-endpoint")
    one_line_error(launch(str(H100_PLAN), "--dry-run", "--nnodes", "3", "--node-rank", "0", "--rdzv-endpoint",
                          "h:1"), "--nnodes 3", "2 node(s)")
    one_line_error(launch(str(H100_PLAN), "--dry-run", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint",
                          "h:1"), "--node-rank must be in [0, 2)")
    one_line_error(launch(str(H100_PLAN), "--dry-run", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint",
                          "h"), "HOST:PORT")
    one_line_error(launch(str(H100_PLAN), "--emit", "slurm", "--nnodes", "2", "--node-rank", "0",
                          "--rdzv-endpoint", "h:1"), "writes its own rendezvous")
    one_line_error(launch(str(H100_PLAN), "--emit", "pbs"), "--emit must be 'slurm'")


def test_more_ranks_than_gpus_on_this_host(tmp_path, h100_one_node, monkeypatch, no_launch):
    monkeypatch.setattr(L, "host_gpus", lambda vendor: 2)
    one_line_error(launch(str(h100_one_node), "--out", str(tmp_path / "o")), "needs 4 GPUs", "this host has 2")
    # the check is about this host: --dry-run (maybe on a login node) shows the command all the same
    assert launch(str(h100_one_node), "--dry-run", "--out", str(tmp_path / "o")).exit_code == 0
    # across nodes, a node needs its own share only
    monkeypatch.setattr(L, "host_gpus", lambda vendor: 8)
    r = launch(str(H100_PLAN), "--dry-run", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "h:1")
    assert r.exit_code == 0


def test_cuda_without_a_gpu(tmp_path, h100_one_node, monkeypatch, no_launch):
    monkeypatch.setattr(L, "host_gpus", lambda vendor: 0)
    one_line_error(launch(str(h100_one_node), "--out", str(tmp_path / "o")), "--device cuda", "no GPU")
    one_line_error(launch(str(CPU_PLAN), "--device", "cuda", "--out", str(tmp_path / "o")), "no GPU")


def test_cpu_profile_runs_any_count_of_processes(tmp_path, monkeypatch):
    """A gloo plan needs no GPU, and its ranks all run on this host whatever the plan's node count."""
    from recipe.plan import load_plan

    monkeypatch.setattr(L, "host_gpus", lambda vendor: 0)
    plan = load_plan(CPU_PLAN)
    big = plan.model_copy(update={"launch": plan.launch.model_copy(update={"nnodes": 2, "nproc_per_node": 8}),
                                  "layout": plan.layout.model_copy(update={"dp": 16, "edp": 16})})
    opts = L.LaunchOptions(out="o")
    L.check_rendezvous(big, opts)
    L.check_host_gpus(big, plan.hw_profile(), opts)
    assert L.build_torchrun_argv("p.yaml", big, opts)[3:6] == ["--standalone", "--nproc-per-node", "16"]
    assert L.launch_env(big, plan.hw_profile(), cpu_count=32, local_procs=16) == {"OMP_NUM_THREADS": "2"}


@pytest.mark.parametrize("content, needles", [
    ('{"input_ids": [1, 2], "loss_mask": [0, 1], "advantages": 1.0}\n{"input_ids": [1, 2]\n',
     [":2:", "not valid JSON"]),
    ('{"input_ids": [1, 2], "loss_mask": [0, 1]}\n', [":1:", "missing required field(s) 'advantages'"]),
    ('{"input_ids": [1, 999999], "loss_mask": [0, 1], "advantages": 1.0}\n', [":1:", "token 999999 outside"]),
    ('{"input_ids": [1, 2, 3], "loss_mask": [0, 1], "advantages": 1.0}\n', ["'loss_mask' has 2 entries"]),
    ("[1, 2]\n", ["expected an object"]),
    ("\n\n", ["no rollouts"]),
])
def test_malformed_data(tmp_path, content, needles, no_launch):
    data = tmp_path / "r.jsonl"
    data.write_text(content)
    one_line_error(launch(str(CPU_PLAN), "--dry-run", "--out", str(tmp_path / "o"), "--data", str(data)),
                   str(data), *needles, code=2)


def test_missing_or_unknown_data(tmp_path, no_launch):
    base = ["--dry-run", "--out", str(tmp_path / "o"), "--data"]
    one_line_error(launch(str(CPU_PLAN), *base, str(tmp_path / "absent.jsonl")), "no such file")
    (tmp_path / "r.csv").write_text("a,b\n")
    one_line_error(launch(str(CPU_PLAN), *base, str(tmp_path / "r.csv")), "unknown rollout file type '.csv'")
    (tmp_path / "d.jsonl").mkdir()
    one_line_error(launch(str(CPU_PLAN), *base, str(tmp_path / "d.jsonl")), "not a file")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input_ids": [[1, 2]], "loss_mask": [[0, 1]]}), tmp_path / "r.parquet")
    one_line_error(launch(str(CPU_PLAN), *base, str(tmp_path / "r.parquet")), "missing column(s) ['advantages']")
    (tmp_path / "x.parquet").write_text("not parquet")
    one_line_error(launch(str(CPU_PLAN), *base, str(tmp_path / "x.parquet")), "not a readable Parquet file")


def test_good_data_passes(tmp_path, no_launch):
    data = tmp_path / "r.jsonl"
    data.write_text('{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "advantages": 0.5}\n')
    r = launch(str(CPU_PLAN), "--dry-run", "--out", str(tmp_path / "o"), "--data", str(data))
    assert r.exit_code == 0, r.output
    assert f"--data {data}" in r.stdout


def test_starting_weights_are_checked_before_any_worker(tmp_path, no_launch):
    """--hf-checkpoint: a missing folder, a folder without safetensors, an index that is not one or names a shard
    that is not there: one line each, exit 2; a folder with model.safetensors, or an index whose shards are all
    there, passes and reaches launch.train."""
    base = ["--dry-run", "--out", str(tmp_path / "o"), "--hf-checkpoint"]
    one_line_error(launch(str(CPU_PLAN), *base, str(tmp_path / "absent")), "--hf-checkpoint", "no such file or folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    one_line_error(launch(str(CPU_PLAN), *base, str(empty)), "no safetensors checkpoint", "config.json")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "model.safetensors.index.json").write_text("[1, 2]")
    one_line_error(launch(str(CPU_PLAN), *base, str(sharded)), "is not a safetensors index")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    (sharded / "model-00001-of-00002.safetensors").write_bytes(b"x")
    one_line_error(launch(str(CPU_PLAN), *base, str(sharded)), "names 1 shard(s) missing",
                   "model-00002-of-00002.safetensors")
    (sharded / "model-00002-of-00002.safetensors").write_bytes(b"x")
    single = tmp_path / "single"
    single.mkdir()
    (single / "model.safetensors").write_bytes(b"x")
    for good in (sharded, single, single / "model.safetensors"):
        r = launch(str(CPU_PLAN), *base, str(good))
        assert r.exit_code == 0, r.output
        assert f"--hf-checkpoint {good}" in r.stdout


def test_room_for_checkpoints_on_the_out_disk(tmp_path):
    """One checkpoint is total parameters x 12 bytes (fp32 master and two Adam moments): qwen35-35b at 4 layers
    takes 52.6 GB, and a run keeps every one it saves. A run whose first save cannot fit is refused; one whose
    later saves cannot warns (steps 5 and 10 of 10 are two saves; resumed from step 5, one); a multi-node plan only
    warns."""
    from recipe.plan import load_plan

    path = tmp_path / "q4.yaml"
    r = runner.invoke(app, ["solve", "--model", "qwen35-35b", "--layers", "4", "--seq", "32k", "--hw", "h200",
                            "--gpus", "1", "-o", str(path)])
    assert r.exit_code == 0, r.output
    plan = load_plan(path)
    need = L.checkpoint_bytes(plan, path)
    assert need == 4_381_469_760 * 12
    opts = L.LaunchOptions(out=str(tmp_path / "run"), steps=10)
    with pytest.raises(L.LaunchError, match=r"takes 52.6 GB .* has 52.6 GB free: the run would fail at its first "
                                            r"save; free space, give another --out, or pass --no-checkpoint"):
        L.check_checkpoint_room(plan, path, opts, free=need - 1)
    assert L.check_checkpoint_room(plan, path, opts, free=need) == []  # one save, at the end
    every = L.LaunchOptions(out=str(tmp_path / "run"), steps=10, checkpoint_every=5)
    (warning,) = L.check_checkpoint_room(plan, path, every, free=2 * need - 1)
    assert "the run keeps its 2 checkpoints and only 1 fit" in warning
    assert L.check_checkpoint_room(plan, path, every, free=2 * need) == []
    (warning,) = L.check_checkpoint_room(plan, path, L.LaunchOptions(out="o", steps=11, checkpoint_every=5),
                                         free=2 * need)  # steps 5, 10 and the last, 11
    assert "keeps its 3 checkpoints and only 2 fit" in warning
    assert L.check_checkpoint_room(plan, path, every, free=need, start=5) == []
    # --keep-last 1: at most two at once (the new one beside the last), however many saves
    hourly = L.LaunchOptions(out="o", steps=100, checkpoint_every=10, keep_last=1)
    assert L.check_checkpoint_room(plan, path, hourly, free=2 * need) == []
    (warning,) = L.check_checkpoint_room(plan, path, hourly, free=2 * need - 1)
    assert "the run holds 2 checkpoints at once and only 1 fit" in warning
    multi = tmp_path / "q16.yaml"
    r = runner.invoke(app, ["solve", "--model", "qwen35-35b", "--layers", "4", "--seq", "32k", "--hw", "h100",
                            "--gpus", "16", "-o", str(multi)])
    assert r.exit_code == 0, r.output
    (warning,) = L.check_checkpoint_room(load_plan(multi), multi, opts, free=0)
    assert "on this node" in warning
    # measured when not given: this disk has room for a tiny model's checkpoint
    assert L.check_checkpoint_room(load_plan(CPU_PLAN), CPU_PLAN, opts) == []


def test_no_checkpoint_is_passed_on_and_excludes_checkpoint_every(tmp_path, no_launch):
    r = launch(str(CPU_PLAN), "--dry-run", "--out", str(tmp_path / "o"), "--no-checkpoint")
    assert r.exit_code == 0, r.output
    assert r.stdout.rstrip().endswith("--device cpu --no-checkpoint")
    one_line_error(launch(str(CPU_PLAN), "--dry-run", "--out", str(tmp_path / "o"), "--no-checkpoint",
                          "--checkpoint-every", "5"), "--no-checkpoint and --checkpoint-every are alternatives")
    one_line_error(launch(str(CPU_PLAN), "--dry-run", "--out", str(tmp_path / "o"), "--no-checkpoint",
                          "--keep-last", "2"), "--no-checkpoint and --keep-last are alternatives")
    r = launch(str(CPU_PLAN), "--dry-run", "--out", str(tmp_path / "o"), "--checkpoint-every", "5", "--keep-last", "2")
    assert r.exit_code == 0, r.output
    assert r.stdout.rstrip().endswith("--device cpu --checkpoint-every 5 --keep-last 2")


def test_another_runs_checkpoints_are_never_overwritten(tmp_path, no_launch):
    out = tmp_path / "run"
    fake_checkpoint(out, 40)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    before = snapshot(out)
    for extra in ((), ("--dry-run",), ("--emit", "slurm")):
        one_line_error(launch(str(CPU_PLAN), "--out", str(out), "--steps", "100", *extra),
                       "holds another run's checkpoints (step_40)", "--resume", code=2)
    assert snapshot(out) == before


def test_resume_needs_a_complete_checkpoint(tmp_path, no_launch):
    out = tmp_path / "run"
    one_line_error(launch(str(CPU_PLAN), "--out", str(out), "--resume", "--steps", "9"), "no complete checkpoint")
    fake_checkpoint(out, 5, complete=False)
    one_line_error(launch(str(CPU_PLAN), "--out", str(out), "--resume", "--steps", "9"), "only incomplete ones")
    fake_checkpoint(out, 3)
    r = launch(str(CPU_PLAN), "--out", str(out), "--resume", "--steps", "9", "--dry-run")
    assert r.exit_code == 0, r.output
    assert r.stdout.rstrip().endswith("--device cpu --resume")
    one_line_error(launch(str(CPU_PLAN), "--out", str(out), "--resume", "--steps", "3", "--dry-run"),
                   "step 3", "nothing left to run")


def test_existing_export_metrics_dir_and_out_file(tmp_path, no_launch):
    (tmp_path / "hf").mkdir()
    one_line_error(launch(str(CPU_PLAN), "--dry-run", "--out", str(tmp_path / "o"), "--export", str(tmp_path / "hf")),
                   "--export", "already exists")
    (tmp_path / "o2" / "metrics.jsonl").mkdir(parents=True)
    one_line_error(launch(str(CPU_PLAN), "--dry-run", "--out", str(tmp_path / "o2")), "metrics.jsonl is a directory")
    (tmp_path / "f").write_text("x")
    one_line_error(launch(str(CPU_PLAN), "--dry-run", "--out", str(tmp_path / "f")), "is a file")


def test_an_out_folder_that_cannot_be_written(tmp_path, monkeypatch, no_launch):
    """--out in a folder this process may not write (its permission bits here; a read-only mount alike): refused in
    one line before anything starts, whether --out exists or would be created in it."""
    import launch.launcher as launcher

    ro = tmp_path / "ro"
    (ro / "old").mkdir(parents=True)
    real = os.access
    monkeypatch.setattr(launcher.os, "access",
                        lambda p, mode: False if Path(p) in (ro, ro / "old") and mode & os.W_OK else real(p, mode))
    one_line_error(launch(str(CPU_PLAN), "--dry-run", "--out", str(ro / "new" / "run")),
                   f"--out {ro / 'new' / 'run'} cannot be created: {ro} is not writable")
    one_line_error(launch(str(CPU_PLAN), "--dry-run", "--out", str(ro / "old")), f"--out {ro / 'old'} is not writable")
    assert sorted(p.name for p in ro.iterdir()) == ["old"]  # nothing created
    assert launch(str(CPU_PLAN), "--dry-run", "--out", str(tmp_path / "fine")).exit_code == 0


@pytest.mark.parametrize("args, needle", [
    (("--steps", "0"), "--steps must be positive, got 0"),
    (("--steps", "-3"), "--steps must be positive, got -3"),
    (("--lr", "0"), "--lr must be a positive number"),
    (("--lr", "-1e-5"), "--lr must be a positive number"),
    (("--max-grad-norm", "-1"), "--max-grad-norm must be zero or positive"),
    (("--temperature", "0"), "--temperature must be a positive number"),
    (("--dtype", "fp16"), "--dtype must be one of bf16, fp32"),
    (("--device", "tpu"), "--device must be one of cpu, cuda"),
    (("--objective", "dpo"), "--objective must be one of rl, sft"),
    (("--checkpoint-every", "0"), "--checkpoint-every must be positive"),
    (("--clip-low", "1.5"), "--clip-low must be below 1"),
    (("--max-restarts", "-1"), "--max-restarts must be zero or positive"),
    (("--on-nonfinite", "ignore"), "--on-nonfinite must be one of raise, skip"),
    (("--keep-last", "0"), "--keep-last must be positive, got 0"),
    (("--dry-run", "--emit", "slurm"), "alternatives"),
])
def test_bad_option_values(tmp_path, args, needle, no_launch):
    one_line_error(launch(str(CPU_PLAN), "--dry-run", "--out", str(tmp_path / "o"), *args), needle, code=2)


# ---- running -------------------------------------------------------------------------------------------------------
class FakePopen:
    calls: list = []
    code = 0

    def __init__(self, argv, env=None, start_new_session=False, **kw):
        FakePopen.calls.append((argv, env, start_new_session))
        self.stderr = iter(())

    def wait(self):
        return FakePopen.code

    def poll(self):
        return FakePopen.code


def test_launch_runs_torchrun_with_the_merged_environment(tmp_path, monkeypatch):
    FakePopen.calls, FakePopen.code = [], 0
    monkeypatch.setattr(L.subprocess, "Popen", FakePopen)
    monkeypatch.setenv("RECIPE_TEST_MARK", "1")
    out = tmp_path / "run"
    r = launch(str(CPU_PLAN), "--out", str(out), "--steps", "2")
    assert r.exit_code == 0, r.output
    (argv, env, new_session), = FakePopen.calls
    assert argv == [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
                    "0", "-m", "launch.train", str(CPU_PLAN), "--out", str(out), "--steps", "2", "--device", "cpu"]
    assert env["OMP_NUM_THREADS"] == "4" and env["RECIPE_TEST_MARK"] == "1" and new_session
    assert r.stderr.startswith("+ ") and "launch.train" in r.stderr  # the command, echoed once


def test_a_failed_training_exits_with_its_status_in_one_line(tmp_path, monkeypatch):
    FakePopen.calls, FakePopen.code = [], 3
    monkeypatch.setattr(L.subprocess, "Popen", FakePopen)
    r = launch(str(CPU_PLAN), "--out", str(tmp_path / "run"))
    assert r.exit_code == 3
    err = r.stderr.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("+ ") and err[1] == (
        "error: training exited with status 3 (the output above names the failing rank)")
    FakePopen.code = -9  # killed by a signal: 128 + 9
    assert launch(str(CPU_PLAN), "--out", str(tmp_path / "run")).exit_code == 137


def test_ctrl_c_is_forwarded_and_exits_130_quietly(tmp_path):
    """The command waits far longer than the test does: only the forwarded SIGINT ends it in time. The wait is
    generous (a loaded CI machine has stalled a process for tens of seconds); if it runs out, the launcher process
    is killed and the command, seeing its parent gone, exits."""
    child = ("import os, signal, sys, time\n"
             "signal.signal(signal.SIGINT, lambda *a: (print('child got SIGINT', flush=True), sys.exit(7)))\n"
             "print('ready', flush=True)\n"
             "parent = os.getppid()\n"
             "for _ in range(6000):\n"
             "    if os.getppid() != parent:\n"
             "        break\n"
             "    time.sleep(0.1)\n")
    parent = (f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom launch.launcher import run\n"
              f"print('code', run([sys.executable, '-c', {child!r}], {{}}), flush=True)\n")
    proc = subprocess.Popen([PY, "-c", parent], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert out.splitlines() == ["child got SIGINT", "code 130"]
    assert err == ""


def test_ctrl_c_while_the_command_starts_still_reaches_it():
    """A Ctrl-C between run() being called and the command existing is held and forwarded once the command starts
    (not a KeyboardInterrupt here that leaves the command running in its own session)."""
    child = "import time\ntime.sleep(30)\n"
    parent = (f"import os, signal, subprocess, sys\nsys.path.insert(0, {str(ROOT)!r})\n"
              "from launch.launcher import run\nreal = subprocess.Popen\n"
              "def starting(*a, **k):\n    os.kill(os.getpid(), signal.SIGINT)\n    return real(*a, **k)\n"
              "subprocess.Popen = starting\n"
              f"print('code', run([sys.executable, '-c', {child!r}], {{}}), flush=True)\n")
    proc = subprocess.run([PY, "-c", parent], capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["code 130"]


def test_import_path_stays_torch_free():
    code = ("import sys\nimport recipe.cli, recipe.launch_cli, launch.launcher, launch.progress, "
            "launch.checkpoint_index, launch.hf_files\nassert 'torch' not in sys.modules, 'torch was imported'\n")
    res = subprocess.run([PY, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


# ---- checkpoints ---------------------------------------------------------------------------------------------------
def _tiny_model_and_optim(seed: int = 0):
    import torch

    from launch.optim import MasterAdamW

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    return model, MasterAdamW(model.named_parameters(), lr=1e-2)  # the trainer's optimizer, a DCP Stateful


def _train_a_step(model, opt, seed: int = 1):
    import torch

    g = torch.Generator().manual_seed(seed)
    model(torch.randn(5, 6, generator=g)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _optim_state(model, opt) -> dict:
    """Full tensors by parameter name: master, exp_avg, exp_avg_sq."""
    sd = opt.state_dict()
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    return {n: {k: full(sd[k][n]) for k in ("master", "exp_avg", "exp_avg_sq")} for n in sd["master"]}


def test_checkpoint_round_trip_at_world_1(tmp_path):
    import random

    import torch

    from launch.checkpoint import TrainState, load, save

    model, opt = _tiny_model_and_optim()
    _train_a_step(model, opt)
    random.seed(5)
    torch.manual_seed(5)
    path = save(tmp_path, 7, {"optim": opt, "train": TrainState(7, {"position": 123})})
    assert path == tmp_path / "checkpoints" / "step_7" and latest(tmp_path) == (7, path)
    assert json.loads((path / "COMPLETE").read_text())["step"] == 7
    expect_py, expect_torch = random.random(), torch.rand(3)

    fresh, fresh_opt = _tiny_model_and_optim(seed=99)
    train = TrainState()
    random.seed(0)
    torch.manual_seed(0)
    record = load(path, {"optim": fresh_opt, "train": train})
    assert record["step"] == 7 and record["world_size"] == 1
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), n
    sa, sb = _optim_state(model, opt), _optim_state(fresh, fresh_opt)
    assert sa.keys() == sb.keys()
    for k in sa:
        for kk in sa[k]:
            assert torch.equal(sa[k][kk], sb[k][kk]), (k, kk)
    assert (train.step, train.data, train.rng_restored) == (7, {"position": 123}, True)
    assert random.random() == expect_py and torch.equal(torch.rand(3), expect_torch)
    # the same optimizer keeps stepping identically after the load
    _train_a_step(model, opt, seed=2)
    _train_a_step(fresh, fresh_opt, seed=2)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_a_crash_mid_save_leaves_the_last_checkpoint_whole(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    from launch import checkpoint as ck

    model, opt = _tiny_model_and_optim()
    first = ck.save(tmp_path, 1, {"optim": opt})
    before = snapshot(first)
    _train_a_step(model, opt)

    def crash(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "finish", crash)  # the shards are written, the metadata never is
    with pytest.raises(ck.CheckpointError) as e:
        ck.save(tmp_path, 2, {"optim": opt})
    assert "step_2" in str(e.value) and "No space left" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.undo()
    assert (tmp_path / "checkpoints" / ".step_2.tmp").is_dir()  # the partial save, never returned by latest
    assert latest(tmp_path) == (1, first) and snapshot(first) == before

    monkeypatch.setattr(ck, "_write_synced", crash)  # a crash in the commit itself, before the rename
    with pytest.raises(ck.CheckpointError, match="cannot commit"):
        ck.save(tmp_path, 2, {"optim": opt})
    monkeypatch.undo()
    assert latest(tmp_path) == (1, first) and snapshot(first) == before

    third = ck.save(tmp_path, 3, {"optim": opt})  # cleans the partial saves
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1", "step_3"]
    assert latest(tmp_path) == (3, third)
    fresh, fresh_opt = _tiny_model_and_optim(seed=9)
    ck.load(first, {"optim": fresh_opt})  # the first is still loadable


def test_checkpoint_replace_keep_last_and_load_errors(tmp_path):
    import torch

    from launch import checkpoint as ck

    w = {"w": torch.arange(4.0)}
    for step in (1, 2, 3):
        ck.save(tmp_path, step, {"t": w}, keep_last=2)
    assert [p.name for p in sorted((tmp_path / "checkpoints").iterdir())] == ["step_2", "step_3"]
    w["w"] += 10
    ck.save(tmp_path, 3, {"t": w})  # the same step again: replaced whole
    got = {"w": torch.zeros(4)}
    ck.load(tmp_path / "checkpoints" / "step_3", {"t": got})
    assert torch.equal(got["w"], torch.arange(4.0) + 10)
    with pytest.raises(ck.CheckpointError, match="no such folder"):
        ck.load(tmp_path / "checkpoints" / "step_9", {"t": got})
    with pytest.raises(ck.CheckpointError, match="holds no 'app'"):
        ck.load(tmp_path / "checkpoints" / "step_3", {"app": got})
    with pytest.raises(ck.CheckpointError, match="non-negative"):
        ck.save(tmp_path, -1, {"t": w})


def _fsdp_worker(rank: int, port: int, out: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from launch.checkpoint import TrainState, save

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        model, _ = _tiny_model_and_optim()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        from launch.optim import MasterAdamW

        opt = MasterAdamW(model.named_parameters(), lr=1e-2)
        _train_a_step(model, opt, seed=1 + rank)  # each rank its own data: the shards hold the averaged step
        assert type(model[0].weight).__name__ == "DTensor"
        save(out, 4, {"optim": opt, "train": TrainState(4, {"position": 8})})
        full = ({k: v.full_tensor() for k, v in model.state_dict().items()}, _optim_state(model, opt))
        if rank == 0:
            torch.save(full, os.path.join(out, "reference.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fsdp2_checkpoint_of_world_2_loads_into_one_unsharded_process(tmp_path):
    import socket

    import torch
    import torch.multiprocessing as mp

    from launch.checkpoint import TrainState, load

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_fsdp_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    step, path = latest(tmp_path)
    assert step == 4 and json.loads((path / "COMPLETE").read_text())["world_size"] == 2

    model, opt = _tiny_model_and_optim(seed=123)
    train = TrainState()
    load(path, {"optim": opt, "train": train})
    ref_model, ref_optim = torch.load(tmp_path / "reference.pt", weights_only=False)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref_model[k]), k
    mine = _optim_state(model, opt)
    for k, states in ref_optim.items():
        for kk, v in states.items():
            assert torch.equal(mine[k][kk], v), (k, kk)
    assert (train.step, train.data, train.rng_restored) == (4, {"position": 8}, True)  # rank 0's streams


def test_train_state_on_a_larger_world_keeps_its_rng(tmp_path, monkeypatch):
    import random

    from launch import checkpoint as ck

    path = ck.save(tmp_path, 1, {"train": ck.TrainState(1, {"k": "v"})})
    monkeypatch.setattr(ck, "_global_rank", lambda: 3)  # a rank the saving world did not have
    random.seed(11)
    expect = random.getstate()
    train = ck.TrainState()
    ck.load(path, {"train": train})
    assert (train.step, train.data, train.rng_restored) == (1, {"k": "v"}, False)
    assert random.getstate() == expect


# ---- progress --------------------------------------------------------------------------------------------------------
def _row(step: int, loss: float = 2.0, **kw) -> dict:
    return {"step": step, "loss": loss, "tokens": 4096, "step_time_s": 0.5, "peak_mem_gb": 1.25, **kw}


def test_eta_leaves_out_the_first_step_once_a_later_one_exists(tmp_path):
    from launch.progress import Progress

    stream = io.StringIO()
    with Progress(tmp_path, 10, stream=stream, tensorboard=False) as p:
        p.update(_row(1, step_time_s=60.0))  # kernel compilation and tuning
        assert p.eta_s() == 9 * 60.0  # nothing else known yet
        p.update(_row(2))
        assert p.eta_s() == 8 * 0.5
    assert stream.getvalue().splitlines()[1].endswith("ETA 0:00:04")


def test_progress_lines_and_metrics_file(tmp_path):
    from launch.progress import Progress

    (tmp_path / "metrics.jsonl").write_text('{"step": 99, "loss": 1}\n')  # another run's: truncated
    stream = io.StringIO()
    with Progress(tmp_path, 4, world_size=2, flops_per_token=3e9, peak_tflops=10.0, stream=stream) as p:
        p.update(_row(1))
        p.update(_row(2, loss=float("nan"), grad_norm=0.5))
        with pytest.raises(ValueError, match="lack peak_mem_gb"):
            p.update({"step": 3, "loss": 1.0, "tokens": 1, "step_time_s": 1.0})
    lines = stream.getvalue().splitlines()
    assert lines[0] == ("step 1/4  loss 2.0000  tok/s/GPU 4,096  TFLOP/s/GPU 12.3  MFU 122.9%  mem 1.2 GB  "
                        "ETA 0:00:02")
    assert lines[1].startswith("step 2/4  loss —  ")
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    r1 = rows[0]
    assert r1["tokens_per_s"] == 8192 and r1["tokens_per_s_per_gpu"] == 4096
    assert r1["tflops_per_gpu"] == pytest.approx(4096 * 3e9 / 1e12) and r1["mfu"] == pytest.approx(1.2288)
    assert rows[1]["loss"] is None and rows[1]["grad_norm"] == 0.5  # strict JSON: NaN → null
    if importlib.util.find_spec("tensorboard") is None:
        assert not (tmp_path / "tensorboard").exists()  # no TensorBoard: skipped, silently


def test_progress_resume_keeps_the_steps_up_to_the_checkpoint(tmp_path):
    from launch.progress import Progress

    old = "".join(json.dumps(_row(s)) + "\n" for s in (1, 2, 3, 4, 5)) + '{"step": 6, "lo'  # a line cut by a crash
    (tmp_path / "metrics.jsonl").write_text(old)
    with Progress(tmp_path, 8, resume_step=3, stream=io.StringIO()) as p:
        p.update(_row(4, loss=1.0))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 2.0), (2, 2.0), (3, 2.0), (4, 1.0)]


def test_progress_live_view_tensorboard_and_for_plan(tmp_path, monkeypatch):
    from launch import progress as P
    from recipe.plan import load_plan

    scalars = []

    class Writer:
        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

        def close(self):
            scalars.append("closed")

    monkeypatch.setattr(P, "_tensorboard_writer", lambda log_dir, resume_step: Writer())
    plan = load_plan(CPU_PLAN)
    stream = io.StringIO()
    with P.Progress.for_plan(tmp_path, plan, 2, stream=stream, live=True) as p:
        p.update(_row(1, loss=3.25))
        p.log("saved checkpoint step_1")
    text = stream.getvalue()
    assert "3.2500" in text and "1/2" in text and "saved checkpoint step_1" in text
    assert ("train/loss", 3.25, 1) in scalars and scalars[-1] == "closed"
    flops, peak = P.plan_rates(plan)
    assert flops > 0 and peak == plan.hw_profile().peak_bf16_tflops
    assert p.rows[0]["tflops_per_gpu"] == pytest.approx(4096 / 0.5 / plan.layout.world * flops / 1e12)  # per GPU


def test_progress_survives_a_closed_pipe(tmp_path):
    from launch.progress import Progress

    r, w = os.pipe()
    os.close(r)  # the reader (`head`) has gone
    stream = os.fdopen(w, "w")
    with Progress(tmp_path, 3, stream=stream) as p:
        for s in (1, 2, 3):
            p.update(_row(s))
        p.log("done")
    stream.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_summary_against_the_prediction():
    from launch.progress import summary
    from recipe.plan import load_plan

    plan = load_plan(H100_PLAN)
    pred = plan.prediction
    text = summary({"peak_mem_gb": pred.memory_gb.total * 1.1, "tokens_per_s_per_gpu": 10000.0,
                    "tflops_per_gpu": None}, pred)
    lines = text.splitlines()
    assert lines[0].split() == ["measured", "predicted", "error"]
    assert lines[1].startswith("peak memory (GB)") and lines[1].endswith("+10.0%")
    err = (10000 - pred.tokens_per_s_per_gpu) / pred.tokens_per_s_per_gpu
    assert lines[2].startswith("tokens/s per GPU") and lines[2].endswith(f"{err:+.1%}")
    assert lines[3].startswith("TFLOP/s per GPU") and lines[3].split()[3] == "—" and lines[3].endswith("—")
    assert summary({"peak_mem_gb": 1.0}, plan.prediction.model_dump()).splitlines()[1].split()[-1].endswith("%")


def test_summary_of_a_gpu_run_compares_memory_like_with_like():
    """On a GPU the allocator's peak allocated leaves out the CUDA context, NCCL buffers and allocator slack that the
    plan's overhead term holds: it is compared with the total less the overhead, and the device's peak (reserved
    plus what lies outside the allocator) with the whole total."""
    from launch.progress import summary
    from recipe.plan import load_plan

    pred = load_plan(H100_PLAN).prediction
    total, overhead = pred.memory_gb.total, pred.memory_gb.overhead
    assert overhead > 0
    lines = summary({"peak_mem_gb": (total - overhead) * 0.95, "peak_device_gb": total * 1.02,
                     "tokens_per_s_per_gpu": 1.0, "tflops_per_gpu": 1.0, "warm_steps": 0}, pred).splitlines()
    assert lines[1].startswith("peak allocated (GB)") and lines[1].endswith("-5.0%")
    assert f"{total - overhead:.2f}" in lines[1].split()
    assert lines[2].startswith("peak on device (GB)") and lines[2].endswith("+2.0%")
    assert lines[3].startswith("tokens/s per GPU") and lines[3].endswith("—")  # one step: not compared


def test_summary_of_one_step_compares_memory_only():
    """One step has only the cold first step's throughput (compilation, autotuning): shown, never compared."""
    from launch.progress import Progress, summary
    from recipe.plan import load_plan

    pred = load_plan(H100_PLAN).prediction
    measured = {"peak_mem_gb": pred.memory_gb.total, "tokens_per_s_per_gpu": 100.0, "tflops_per_gpu": 1.0,
                "warm_steps": 0}
    lines = summary(measured, pred).splitlines()
    assert lines[1].endswith("+0.0%")
    assert lines[2].split()[-1] == "—" and "100" in lines[2]
    assert lines[3].split()[-1] == "—"
    assert lines[4].startswith("(one step:")
    two = summary({**measured, "warm_steps": 1}, pred).splitlines()
    assert len(two) == 4 and two[2].endswith("%")
    # Progress.measured counts the warm steps after the first
    p = Progress.__new__(Progress)
    p.rows = [{"tokens_per_s_per_gpu": 5.0}]
    assert p.measured()["warm_steps"] == 0 and p.measured()["tokens_per_s_per_gpu"] == 5.0
    p.rows = [{"tokens_per_s_per_gpu": 5.0}, {"tokens_per_s_per_gpu": 50.0}, {"tokens_per_s_per_gpu": 70.0}]
    assert p.measured()["warm_steps"] == 2 and p.measured()["tokens_per_s_per_gpu"] == 60.0
    p.rows = []  # no step ran (a resumed run already at --steps): nothing to call cold
    assert p.measured()["warm_steps"] is None and "(one step" not in summary(p.measured(), pred)
