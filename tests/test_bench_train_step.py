"""bench/bench_train_step.py's prediction beside each of our measured steps: the profile a GPU's name gives, and the
cost model's figures for the step the bench runs (one GPU, full recompute, the fused head)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_train_step import device_profile, predicted  # noqa: E402


@pytest.mark.parametrize("name, hw", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                      ("NVIDIA H100 PCIe", "h100"), ("AMD Instinct MI300X", "mi300x"),
                                      ("AMD Instinct MI355X", "mi355x"), ("NVIDIA B200", "b200"),
                                      ("NVIDIA A100-SXM4-80GB", None), ("cpu", None)])
def test_a_gpu_name_gives_its_profile(name, hw):
    assert device_profile(name) == hw


def test_the_prediction_is_the_cost_models_for_the_benched_step():
    from recipe.cost import Layout, TrainOptions, estimate
    from recipe.hw import load_profile
    from recipe.models import resolve_model

    m = resolve_model("kimi-linear-48b").with_layers(4)
    e = estimate(m, load_profile("h200"), 1, Layout(), TrainOptions(micro_batch_tokens=32768))
    p = predicted("kimi-linear-48b", 4, 32768, "h200", keep_selections=False)
    assert p["hw"] == "h200" and p["step_s"] == pytest.approx(e.step_time_s)
    assert p["allocated_gb"] == pytest.approx(e.total_gb - e.memory_gb["overhead"])
    # DeepSeek sparse attention's kept selections are part of the point
    kept = predicted("glm5", 2, 32768, "h200", keep_selections=True)["allocated_gb"]
    assert kept > predicted("glm5", 2, 32768, "h200", keep_selections=False)["allocated_gb"]


def test_the_bench_prints_and_writes_the_prediction_beside_our_step(tmp_path):
    """The whole bench on the CPU (tiny-moe, 2 layers, 256 tokens, one step) with a profile named: the table's row
    for ours carries the predicted step and peak and the error against the measured step, and --out's JSON holds
    the same prediction; transformers' row (none asked for here) would carry none."""
    import json
    import subprocess

    out = tmp_path / "b.json"
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, str(root / "bench" / "bench_train_step.py"), "--model", "tiny-moe",
                        "--layers", "2", "--seqs", "256", "--hf-seqs", "", "--profile-seq", "0", "--steps", "1",
                        "--device", "cpu", "--hw", "h200", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    (ours,) = json.loads(out.read_text())["results"]
    want = predicted("tiny-moe", 2, 256, "h200", keep_selections=False)
    assert ours["predicted"] == pytest.approx(want)
    row = next(ln for ln in p.stdout.splitlines() if ln.startswith("ours"))
    assert f"{want['step_s']:.3f} (" in row and "[h200]" in row
    assert f"{want['allocated_gb']:.2f}" in row
