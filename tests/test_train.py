"""The training core: tiny-moe learns, micro-batching does not change the step, the optimizer matches torch's
AdamW, non-finite losses and gradients stop the run with the step, and the CLI runs a plan end to end."""

import json
import math

import pytest
import torch

from launch.data import make_batch, synthetic_rollouts, write_jsonl
from launch.model import build_model
from launch.optim import MasterAdamW, NonFiniteError
from launch.rl import LossConfig
from launch.train import TrainConfig, Trainer
from recipe.models import PRESETS



TINY = PRESETS["tiny-moe"]


def _fixed_batch(seed=0, prompts=2, group=2):
    return make_batch(synthetic_rollouts(prompts, group, TINY.vocab_size, prompt_len=(8, 12),
                                         response_len=(16, 24), seed=seed))


def test_tiny_moe_learns_fixed_batch():
    torch.manual_seed(0)
    trainer = Trainer(build_model(TINY, seed=0), TrainConfig(lr=3e-3, objective="sft", weight_decay=0.0),
                      recompute="full", lm_head="fused")
    batch = _fixed_batch()
    losses = [trainer.step(batch)["loss"] for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0], [round(x, 3) for x in losses]
    assert all(math.isfinite(x) for x in losses)


def test_rl_step_moves_logprobs_with_the_advantage():
    model = build_model(TINY, seed=2)
    rollouts = synthetic_rollouts(1, 2, TINY.vocab_size, prompt_len=(6, 6), response_len=(12, 12), seed=3)
    rollouts[0].advantages = [1.0] * len(rollouts[0])
    rollouts[1].advantages = [-1.0] * len(rollouts[1])
    batch = make_batch(rollouts)
    trainer = Trainer(model, TrainConfig(lr=2e-3, weight_decay=0.0, loss=LossConfig(clip_high=10, clip_low=0.9)),
                      recompute="none", lm_head="naive")

    def mean_logp():
        with torch.no_grad():
            from launch.rl import token_logprobs

            lp = token_logprobs(model(batch.input_ids, batch.packing), model.lm_head.weight, batch.targets,
                                mode="naive")
        m = batch.loss_mask
        return [(lp * m * (batch.seq_id == i)).sum().item() / (m * (batch.seq_id == i)).sum().item()
                for i in range(2)]

    before = mean_logp()
    for _ in range(5):
        metrics = trainer.step(batch)
    after = mean_logp()
    assert after[0] > before[0] + 0.05 and after[1] < before[1] - 0.05, (before, after)
    for key in ("loss", "clip_frac", "approx_kl", "entropy", "grad_norm"):
        assert key in metrics


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_micro_batches_give_the_same_step(aggregation):
    rollouts = synthetic_rollouts(2, 2, TINY.vocab_size, response_len=(5, 30), seed=4)
    cfg = TrainConfig(lr=1e-3, loss=LossConfig(aggregation=aggregation))
    one = Trainer(build_model(TINY, seed=5), cfg, recompute="none", lm_head="naive")
    split = Trainer(build_model(TINY, seed=5), cfg, recompute="none", lm_head="naive")
    m1 = one.step(make_batch(rollouts))
    m2 = split.step([make_batch(rollouts[:1]), make_batch(rollouts[1:])])
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-4)
    for a, b in zip(one.model.parameters(), split.model.parameters()):
        if a.grad is not None:  # gradients (not Adam's sign-like updates, which amplify rounding on tiny grads)
            assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7)


def test_lean_head_gives_the_fused_step():
    # lm_head: lean (the loss handed to the lean head: four GEMMs, its scratch in the gradients' storage) against
    # the three-GEMM fused head: the same loss, gradients and metrics
    rollouts = synthetic_rollouts(2, 2, TINY.vocab_size, response_len=(5, 30), seed=4)
    cfg = TrainConfig(lr=1e-3)
    fused = Trainer(build_model(TINY, seed=5), cfg, recompute="full", lm_head="fused")
    lean = Trainer(build_model(TINY, seed=5), cfg, recompute="full", lm_head="lean")
    m1, m2 = fused.step(make_batch(rollouts)), lean.step(make_batch(rollouts))
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-4)
    for a, b in zip(fused.model.parameters(), lean.model.parameters()):
        if a.grad is not None:
            assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="lm_head must be fused, lean or naive"):
        Trainer(build_model(TINY, seed=5), cfg, lm_head="liger")


@pytest.mark.parametrize("lm_head", ["fused", "naive"])
def test_the_loss_divides_granites_logits_by_its_scaling(lm_head):
    """A Granite model's logits are divided by its `logits` scaling before the softmax: the trainer folds it into
    the head's temperature, so its SFT loss at sampling temperature 2 equals the mean negative log-probability of the
    logits divided by 2 × 2.5, computed here from the hidden states by hand."""
    from recipe.models import GraniteScales

    shape = PRESETS["mixtral-8x7b"].model_copy(update=dict(
        name="tiny-granite", arch="granitemoe", hidden_size=32, num_layers=2, vocab_size=96,
        layer_types=("full_attention",) * 2, num_heads=4, num_kv_heads=2, head_dim=8, num_experts=4, top_k=2,
        expert_ffn=16, granite=GraniteScales(embedding=3.0, attention=0.3, residual=0.5, logits=2.5)))
    trainer = Trainer(build_model(shape, seed=1), TrainConfig(objective="sft", temperature=2.0), recompute="none",
                      lm_head=lm_head)
    batch = make_batch(synthetic_rollouts(1, 2, shape.vocab_size, prompt_len=(4, 6), response_len=(5, 8), seed=3))
    loss, _ = trainer.loss_terms(batch)
    with torch.no_grad():
        h = trainer.model(batch.input_ids, batch.packing)
        logp = torch.log_softmax(h @ trainer.model.lm_head.weight.T / 5.0, dim=-1)
        keep = batch.targets >= 0
        want = -(logp[keep].gather(1, batch.targets[keep, None])[:, 0] * batch.loss_mask[keep]).sum()
        want = want / batch.loss_mask.sum()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)


def test_master_adamw_matches_torch_adamw():
    torch.manual_seed(0)
    w = [torch.randn(5, 3, requires_grad=True), torch.randn(4, requires_grad=True)]
    ref = [p.detach().clone().requires_grad_() for p in w]
    ours = MasterAdamW([("a", w[0]), ("b", w[1])], lr=0.01, weight_decay=0.1, max_grad_norm=None)
    # torch applies decay to every parameter; ours skips 1-d ones, so give torch two groups
    torch_opt = torch.optim.AdamW([{"params": [ref[0]], "weight_decay": 0.1}, {"params": [ref[1]], "weight_decay": 0}],
                                  lr=0.01)
    for m in ours.masters:  # the moments exist before the first step (zeros), and the steps still match torch's
        st = ours.opt.state[m]
        assert st["exp_avg"].shape == m.shape and not st["exp_avg"].any() and not st["exp_avg_sq"].any()
    for step in range(3):
        g = [torch.randn_like(p) for p in w]
        for p, q, gi in zip(w, ref, g):
            p.grad, q.grad = gi.clone(), gi.clone()
        ours.step()
        torch_opt.step()
        for p, q in zip(w, ref):
            assert torch.allclose(p, q, atol=1e-6), step


def test_bf16_params_keep_fp32_masters_and_clip():
    p = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16))
    opt = MasterAdamW([("w", p)], lr=1e-4, max_grad_norm=1.0)
    assert opt.masters[0].dtype == torch.float32 and opt.masters[0] is not p.data
    p.grad = torch.full_like(p, 10.0)
    assert opt.step() == pytest.approx(40.0)  # pre-clip norm of sixteen 10s
    # 1e-4 steps are below bf16 resolution at 1.0, but the fp32 master moves
    assert torch.equal(p.detach(), torch.ones(4, 4, dtype=torch.bfloat16))
    assert torch.allclose(opt.masters[0], torch.full((4, 4), 1 - 1e-4), atol=1e-7)


def test_grouped_step_holds_one_groups_fp32_gradients():
    """Each grouped update sees exactly its own group's fp32 gradients live, clipped or not: no earlier group's
    cast lingers, and the clip scales the cast instead of making a second copy. Counted at every inner AdamW step
    over the live fp32 tensors that are neither masters nor moments."""
    import gc

    sizes = [(8, 4), (6, 4), (16,), (5, 4)]  # groups of at most 32 elements: [a], [b], [c], [d]
    params = [torch.nn.Parameter(torch.randn(*s).to(torch.bfloat16)) for s in sizes]
    opt = MasterAdamW([(f"p{i}", p) for i, p in enumerate(params)], lr=1e-3, max_grad_norm=1.0, group_numel=32)
    assert opt.groups == [[0], [1], [2], [3]]
    seen, before = [], set()
    inner = opt.opt.step

    def fp32_tensors() -> list:
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dtype == torch.float32
                and o.numel() > 1]

    def counting_step():  # the fp32 tensors made since the update began (masters and moments were there before)
        seen.append(sorted(t.numel() for t in fp32_tensors() if id(t) not in before))
        return inner()

    opt.opt.step = counting_step
    for scale in (100.0, 1e-3):  # clipped (norm far above 1), then not
        seen.clear()
        for p in params:
            p.grad = torch.full_like(p, scale)
        before = {id(t) for t in fp32_tensors()}
        opt.step()
        assert seen == [[32], [24], [16], [20]], (scale, seen)
        assert all(bool((p.grad == scale).all()) for p in params)  # the clip scaled the copies, not the grads
        if scale == 100.0:  # the first moment after one step: (1 − β1) · the clipped gradient
            clipped = 100.0 / (100.0 * 92**0.5 + 1e-6)
            assert all(torch.allclose(opt.opt.state[m]["exp_avg"], torch.full_like(m, 0.1 * clipped))
                       for m in opt.masters)


def test_grad_norm_over_mixed_dtypes_by_hand():
    """The global norm over bf16 and fp32 gradients (multi-tensor norms by dtype) is √(Σ g²) by hand: 3·4² over a
    bf16 [3] and 2·1.5² + 6² over an fp32 [3] with one element 6 → √(48 + 4.5 + 36) = √88.5; parameters without a
    gradient are left out."""
    ps = [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(3)),
          torch.nn.Parameter(torch.zeros(2))]
    opt = MasterAdamW([(f"p{i}", p) for i, p in enumerate(ps)], lr=1e-3)
    ps[0].grad = torch.full((3,), 4.0, dtype=torch.bfloat16)
    ps[1].grad = torch.tensor([1.5, -1.5, 6.0])
    assert opt.grad_norm().item() == pytest.approx(88.5 ** 0.5, rel=1e-7)


def test_fused_step_takes_the_clip_inside_and_equals_the_foreach_step():
    """The fused AdamW path (the GPU's, forced here on CPU) takes the clip as its kernel's gradient scale instead of a
    pass over the gradients; over clipped and unclipped steps, for bf16 parameters (grouped casts) and fp32 ones (their
    own masters), it equals the foreach path's masters and moments to fp32 rounding."""
    torch.manual_seed(0)
    init = [torch.randn(6, 5), torch.randn(7)]
    runs = {}
    for fused in (False, True):
        params = [torch.nn.Parameter(init[0].to(torch.bfloat16)), torch.nn.Parameter(init[1].clone())]
        opt = MasterAdamW([("w", params[0]), ("b", params[1])], lr=1e-2, weight_decay=0.1, max_grad_norm=1.0,
                          fused=fused)
        assert opt.fused == fused and opt.opt.defaults["fused"] == (fused or None)
        norms = []
        for step, scale in enumerate((30.0, 0.01, 5.0)):  # clipped, not, clipped
            gen = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)
            norms.append(opt.step())
            assert getattr(opt.opt, "grad_scale", None) is None  # nothing left for a later step
        runs[fused] = (norms, [m.detach().clone() for m in opt.masters],
                       [opt.opt.state[m][k].clone() for m in opt.masters for k in ("exp_avg", "exp_avg_sq")])
    assert runs[True][0] == runs[False][0] and runs[False][0][0] > 1 > runs[False][0][1]
    for a, b in zip(runs[True][1] + runs[True][2], runs[False][1] + runs[False][2]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_fused_step_on_fsdp_shards_equals_the_foreach_step(monkeypatch):
    """FSDP2's shards (fp32 DTensors, their own masters) take the fused kernel and its gradient scale as plain
    tensors do: over a clipped and an unclipped step in a one-rank gloo world, the fused path's shards and moments
    equal the foreach path's to fp32 rounding, and the reported norms are equal."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29547")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        init = [torch.randn(6, 4), torch.randn(5)]
        runs = {}
        for fused in (False, True):
            params = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in init]
            opt = MasterAdamW([("w", params[0]), ("b", params[1])], lr=1e-2, weight_decay=0.1, max_grad_norm=1.0,
                              fused=fused)
            assert opt.distributed and all(m is p for m, p in zip(opt.masters, params))
            norms = []
            for step, scale in enumerate((20.0, 0.01)):
                gen = torch.Generator().manual_seed(step)
                for p, t in zip(params, init):
                    p.grad = distribute_tensor(torch.randn(t.shape, generator=gen) * scale, mesh, [Shard(0)])
                norms.append(opt.step())
            runs[fused] = (norms, [p.to_local().clone() for p in params],
                           [opt.opt.state[p][k].to_local().clone() for p in params for k in ("exp_avg", "exp_avg_sq")])
        assert runs[True][0] == runs[False][0] and runs[False][0][0] > 1 > runs[False][0][1]
        for a, b in zip(runs[True][1] + runs[True][2], runs[False][1] + runs[False][2]):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
        dist.barrier()  # neither rank tears gloo's pairs down while the other still uses them
    finally:
        dist.destroy_process_group()


def test_nonfinite_loss_and_gradient_are_reported_with_the_step():
    trainer = Trainer(build_model(TINY, seed=0), TrainConfig(lr=1e-3), recompute="full", lm_head="fused")
    batch = _fixed_batch()
    trainer.step(batch)
    bad = make_batch(synthetic_rollouts(1, 2, TINY.vocab_size, seed=0))
    masked_out = int((~bad.loss_mask.bool()).nonzero()[0])
    bad.advantages[masked_out] = float("nan")  # a NaN where the loss mask is 0 (a prompt token) is ignored ...
    trainer.step(bad)
    trainer.step_num = 1
    bad.advantages[int(bad.loss_mask.bool().nonzero()[0])] = float("nan")  # ... one on a trained token is not
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(NonFiniteError, match="step 2: loss is nan"):
        trainer.step(bad)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))  # no update
    # a gradient that is not finite, with a finite loss: named with the parameter
    p = torch.nn.Parameter(torch.ones(3))
    opt = MasterAdamW([("layers.0.mlp.gate.weight", p)], lr=1.0)
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    with pytest.raises(NonFiniteError, match=r"step 1: gradient norm is inf; .*layers.0.mlp.gate.weight"):
        opt.step()
    skip = Trainer(build_model(TINY, seed=0), TrainConfig(lr=1e-3, on_nonfinite="skip"), recompute="none")
    metrics = skip.step(bad)
    assert metrics["skipped"] == 1.0 and "step 1" in metrics["error"]


def test_cli_runs_a_plan(tmp_path, capsys):
    plan_mod = pytest.importorskip("recipe.plan")
    from launch.train import main

    plan_path = tmp_path / "plan.yaml"
    plan = _tiny_plan(plan_mod)
    plan_path.write_text(plan)
    data = tmp_path / "rollouts.jsonl"
    write_jsonl(synthetic_rollouts(2, 2, TINY.vocab_size, seed=0), data)
    rc = main([str(plan_path), "--data", str(data), "--steps", "2", "--lr", "1e-3", "--device", "cpu",
               "--out", str(tmp_path / "run"), "--export", str(tmp_path / "hf")])
    assert rc == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    assert all(k in lines[0] for k in ("loss", "tokens", "step_time_s", "peak_mem_gb", "grad_norm"))
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "COMPLETE").exists()  # the last step is always saved
    assert (tmp_path / "hf" / "model.safetensors").exists()
    assert "step 2/2" in capsys.readouterr().out
    # the same folder again without --resume: refused, nothing touched
    assert main([str(plan_path), "--data", str(data), "--steps", "3", "--device", "cpu",
                 "--out", str(tmp_path / "run")]) == 2
    assert "holds another run's checkpoints" in capsys.readouterr().err
    assert main([str(plan_path), "--data", str(tmp_path / "missing.jsonl"), "--device", "cpu"]) == 2
    assert "error: cannot read rollouts" in capsys.readouterr().err
    # a resumed run continues from its checkpoint and does not read --hf-checkpoint (here a folder that is not there)
    assert main([str(plan_path), "--data", str(data), "--steps", "3", "--device", "cpu", "--resume",
                 "--out", str(tmp_path / "run"), "--hf-checkpoint", str(tmp_path / "absent")]) == 0
    assert (tmp_path / "run" / "checkpoints" / "step_3" / "COMPLETE").exists()
    # --keep-last 1 with a checkpoint every step: only the newest is left
    assert main([str(plan_path), "--data", str(data), "--steps", "3", "--device", "cpu", "--checkpoint-every", "1",
                 "--keep-last", "1", "--out", str(tmp_path / "kept")]) == 0
    assert sorted(p.name for p in (tmp_path / "kept" / "checkpoints").iterdir()) == ["step_3"]
    # --no-checkpoint: the metrics, no checkpoint at all
    assert main([str(plan_path), "--data", str(data), "--steps", "1", "--device", "cpu", "--no-checkpoint",
                 "--out", str(tmp_path / "bare")]) == 0
    assert (tmp_path / "bare" / "metrics.jsonl").exists() and not (tmp_path / "bare" / "checkpoints").exists()
    with pytest.raises(SystemExit):
        main([str(plan_path), "--no-checkpoint", "--checkpoint-every", "2"])
    assert "alternatives" in capsys.readouterr().err


def _tiny_plan(plan_mod) -> str:
    """A one-GPU plan for tiny-moe, made by the solver the way `recipe solve` makes it."""
    from recipe.cli import _inputs
    from recipe.solving import solve_inputs
    from recipe.planfile import dumps, plan_dict

    inputs = _inputs("tiny-moe", "256", "h200", 1, None, "full", "fused", None, 1, None)
    model, hw, solution = solve_inputs(inputs)
    text = dumps(plan_dict(inputs, model, hw, solution), "yaml")
    assert plan_mod.parse_plan(text).layout.world == 1
    return text


def test_cli_refuses_a_layout_it_cannot_run_before_any_work(tmp_path, capsys, monkeypatch):
    """A plan for 2 processes started as one, and a tp=3 plan (a hand edit of a tp=2 one: 3 does not divide the 4
    attention heads) started right: one line each, exit 2, no group."""
    from recipe.cli import app
    from typer.testing import CliRunner

    from launch.train import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["plans/tiny-cpu.yaml", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: the plan's layout needs pp·tp·cp·dp = 1·1·1·2 = 2 processes but this run has "
                   "WORLD_SIZE=1: start it with --nproc-per-node 2 or re-solve with --gpus 1")
    tp2 = tmp_path / "tp2.yaml"
    r = CliRunner().invoke(app, ["solve", "--model", "tiny-moe", "--seq", "4k", "--hw", "cpu", "--gpus", "2", "--tp",
                                 "2", "-o", str(tp2)])
    assert r.exit_code == 0, r.output
    tp3 = tmp_path / "tp3.yaml"
    three = ("tp: 2", "edp: 2", "gpus: 2", "nproc_per_node: 2")  # the layout, the pin, the world and the launch
    tp3.write_text("".join(line.replace(": 2", ": 3") if line.strip() in three else line
                           for line in tp2.read_text().splitlines(keepends=True)))
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main([str(tp3), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: tp=3: 4 attention heads of tiny-moe are not divisible by tp=3"
    import torch.distributed as dist

    assert not dist.is_initialized()


class _FakeDriver:
    """libcuda's two limit calls, on a stack limit that a kernel's launch can raise (the driver's behaviour)."""

    def __init__(self, stack: int):
        self.stack, self.sets = stack, []

    def cuCtxGetLimit(self, out, which):
        assert which == 0  # CU_LIMIT_STACK_SIZE
        out._obj.value = self.stack
        return 0

    def cuCtxSetLimit(self, which, value):
        assert which == 0
        self.stack = value.value
        self.sets.append(value.value)
        return 0


def test_stack_limit_is_restored_once_tuning_has_grown_it():
    """The trainer reads the CUDA stack limit before its first step and sets it back after it if the step raised
    it (the driver grows it for a spilling kernel and keeps it, reserved for every thread of the GPU): the bytes a
    thread it grew by come back; an unchanged limit is left alone; with no driver library (CPU, ROCm) nothing is
    read or set."""
    from launch.job import StackLimit

    lib = _FakeDriver(1024)
    limit = StackLimit(lib)
    assert limit.initial == 1024 and limit.restore() == 0 and lib.sets == []
    lib.stack = 26_256  # what tuning flash-linear-attention's gated backward does on an H200
    assert limit.restore() == 26_256 - 1024 and lib.stack == 1024 and lib.sets == [1024]
    none = StackLimit(None)
    assert none.initial is None and none.get() is None and none.restore() == 0
