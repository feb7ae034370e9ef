"""GPU paths against the torch references (skipped without CUDA): flash-linear-attention's chunked gated delta rule
(and KDA's) at the head dims we run (K = V = 128; on Hopper with Triton < 3.7.1 this is the case whose guard we lift, see
launch/gated_delta.py), grouped-GEMM experts against the per-expert loop, one bf16 training step, the fused
conv + SiLU / gated RMSNorm Triton kernels (kernels/gdn_fused.py) against their torch path at the real shape, and
context parallel's segment combine on fla's kernels against fla over the whole sequence."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("lengths", [[1024], [300, 1, 723]])
def test_fla_delta_rule_matches_torch_reference(lengths, kda):
    """Gated DeltaNet (one decay a head, GVA 2) and KDA (`chunk_kda`: a decay per key channel, as many value heads
    as key heads)."""
    from launch.gated_delta import chunk_gated_delta_rule_fla, chunk_gated_delta_rule_torch, fla_status
    from launch.model import Packing

    ok, why = fla_status(128, per_channel=kda)
    if not ok:
        pytest.skip(why)
    T, G, H, K, V = sum(lengths), 8 if kda else 4, 8, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(T, G, K, device="cuda", generator=gen)
    k = torch.randn(T, G, K, device="cuda", generator=gen)
    v = torch.randn(T, H, V, device="cuda", generator=gen)
    g = -torch.rand(T, H, *((K,) if kda else ()), device="cuda", generator=gen) * 0.3
    beta = torch.rand(T, H, device="cuda", generator=gen)
    do = torch.randn(T, H, V, device="cuda", generator=gen)
    packing = Packing.from_lengths(lengths, "cuda")
    leaves32 = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    ref = chunk_gated_delta_rule_torch(*leaves32, packing.positions, 64)
    (ref * do).sum().backward()
    leaves16 = [x.to(torch.bfloat16 if i != 3 else torch.float32).clone().requires_grad_()
                for i, x in enumerate((q, k, v, g, beta))]
    out = chunk_gated_delta_rule_fla(*leaves16, packing.cu_seqlens, 64)
    (out.float() * do).sum().backward()
    assert _rel(out, ref) < 2e-2, f"output rel err {_rel(out, ref):.2e}"
    for name, a, b in zip("q k v g beta".split(), leaves16, leaves32):
        err = _rel(a.grad, b.grad)
        assert err < 3e-2, f"grad {name}: rel err {err:.2e} ({why})"


def test_grouped_mm_experts_match_loop():
    """The routed experts in bf16 (torch._grouped_mm, the slot-gradient and SwiGLU kernels) against the same
    experts in fp32 (the per-expert loop, the torch backward), two experts idle."""
    from launch.moe import GroupedExperts

    torch.manual_seed(0)
    T, K, E = 96, 2, 8
    ex = GroupedExperts(E, 256, 128).cuda().to(torch.bfloat16)
    torch.nn.init.normal_(ex.gate_up_proj, std=0.05)
    torch.nn.init.normal_(ex.down_proj, std=0.05)
    e = torch.stack([torch.randperm(E - 2)[:K] for _ in range(T)]).cuda()
    x = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = ex(x, w, e)
    y.float().square().sum().backward()
    grads = [x.grad.clone(), w.grad.clone(), ex.gate_up_proj.grad.clone(), ex.down_proj.grad.clone()]
    ref_ex = GroupedExperts(E, 256, 128).cuda().float()
    ref_ex.load_state_dict({k: v.float() for k, v in ex.state_dict().items()})
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    y32 = ref_ex(x32, w32, e)  # fp32 takes the per-expert loop
    y32.square().sum().backward()
    assert _rel(y, y32) < 1e-2
    for a, b in zip(grads, [x32.grad, w32.grad, ref_ex.gate_up_proj.grad, ref_ex.down_proj.grad]):
        assert _rel(a, b) < 2e-2


def test_bf16_train_step_runs_and_learns():
    from launch.data import synthetic_rollouts, make_batch
    from launch.model import build_model
    from launch.train import TrainConfig, Trainer
    from recipe.models import PRESETS

    model = build_model(PRESETS["tiny-moe"], device="cuda", dtype=torch.bfloat16)
    trainer = Trainer(model, TrainConfig(lr=3e-3, objective="sft"), recompute="full", lm_head="fused")
    batch = make_batch(synthetic_rollouts(2, 2, 512, seed=0), "cuda")
    losses = [trainer.step(batch)["loss"] for _ in range(10)]
    assert losses[-1] < losses[0] - 0.5, losses



def _fused_vs_torch(fn, inputs, dy, args):
    """(ours bf16, torch path bf16, torch path fp32 from the same bf16 inputs): outputs and input gradients."""
    def run(backend, dtype):
        leaves = [x.detach().clone().to(dtype).requires_grad_() for x in inputs]  # fresh leaves: no shared .grad
        y = fn(*leaves, *args, backend=backend)
        y.backward(dy.to(dtype))
        return [y.detach()] + [x.grad for x in leaves]

    return run("triton", torch.bfloat16), run("torch", torch.bfloat16), run("torch", torch.float32)


@pytest.mark.parametrize("lengths", [[8192], [3000, 1, 2, 3, 5186]])
def test_fused_conv_silu_matches_torch_path(lengths):
    """kernels.gdn_fused.causal_conv1d_silu at the real shape (T = C = 8192, W = 4, bf16): the Triton kernels
    against the torch path; within bf16 rounding of the fp32 torch path and no worse than the bf16 torch path."""
    from kernels.gdn_fused import causal_conv1d_silu
    from launch.model import Packing

    T, C, W = 8192, 8192, 4
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, C, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(C, W, device="cuda", generator=gen) * 0.5).bfloat16()
    dy = torch.randn(T, C, device="cuda", generator=gen).bfloat16()
    pos = Packing.from_lengths(lengths, "cuda").positions
    ours, torch16, ref = _fused_vs_torch(causal_conv1d_silu, [x, w], dy, (pos,))
    for name, a, t, r in zip(("y", "dx", "dw"), ours, torch16, ref):
        assert a.dtype == torch.bfloat16 and torch.isfinite(a).all()
        assert _rel(a, r) < 5e-3 and _rel(a, r) <= max(1.25 * _rel(t, r), 4e-3), \
            f"{name}: ours {_rel(a, r):.2e}, torch bf16 {_rel(t, r):.2e} against fp32"
    # fp32 inputs: the kernels and the torch path agree to fp32 rounding
    x32, w32 = x.float().requires_grad_(), w.float().requires_grad_()
    y32 = causal_conv1d_silu(x32, w32, pos, backend="triton")
    y32.backward(dy.float())
    for a, r in zip((y32, x32.grad, w32.grad), ref):
        assert _rel(a, r) < 1e-5


@pytest.mark.parametrize("shape, offset", [((8192, 7168), 0.0), ((8192, 2048), 1.0), ((8192, 32, 128), 1.0),
                                           ((8192, 4, 128), 0.0)])
def test_fused_rms_norm_matches_torch_path(shape, offset):
    """kernels.rms_norm.rms_norm at the model's shapes (a hidden-size norm at DeepSeek-V3's and Qwen3.5's widths,
    per-head q/k norms), both orders, bf16: within bf16 rounding of the fp32 torch path, no worse than the bf16
    torch path, and its bf16 output equal to the torch path's."""
    from kernels.rms_norm import rms_norm

    gen = torch.Generator(device="cuda").manual_seed(2)
    x = (torch.randn(shape, device="cuda", generator=gen) * 2).bfloat16()
    w = ((0.0 if offset else 1.0) + 0.2 * torch.randn(shape[-1], device="cuda", generator=gen)).bfloat16()
    dy = torch.randn(shape, device="cuda", generator=gen).bfloat16()
    ours, torch16, ref = _fused_vs_torch(rms_norm, [x, w], dy, (1e-6, offset))
    assert (ours[0] == torch16[0]).float().mean() > 0.995  # same roundings in the same order
    for name, a, t, r in zip(("y", "dx", "dw"), ours, torch16, ref):
        assert a.dtype == torch.bfloat16 and torch.isfinite(a).all()
        assert _rel(a, r) < 5e-3 and _rel(a, r) <= max(1.25 * _rel(t, r), 4e-3), \
            f"{name}: ours {_rel(a, r):.2e}, torch bf16 {_rel(t, r):.2e} against fp32"


@pytest.mark.parametrize("heads, dim, rotary, pairs", [(32, 128, 128, False), (16, 256, 64, False),
                                                      (128, 64, 64, True)])
def test_fused_rope_matches_torch_path(heads, dim, rotary, pairs):
    """kernels.rope.rope at the model's shapes (Qwen3-MoE's 32 query heads of 128, Qwen3.5's 16 of 256 with 64
    rotated, DeepSeek-V3's 128 MLA rope slices of 64 as pairs), 8192 tokens, bf16: within bf16 rounding of the fp32
    torch path and no worse than the bf16 torch path, the pass-through channels bit for bit."""
    from kernels.rope import rope
    from launch.model import rope_cos_sin
    from recipe.models import PRESETS

    T = 8192
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(T, heads, dim, device="cuda", generator=gen).bfloat16()
    dy = torch.randn(T, heads, dim, device="cuda", generator=gen).bfloat16()
    shape = PRESETS["qwen3-30b-a3b"].model_copy(update={"head_dim": rotary, "partial_rotary_factor": 1.0})
    cos, sin = rope_cos_sin(torch.arange(T, device="cuda"), shape, torch.bfloat16)
    ours, torch16, ref = _fused_vs_torch(lambda t, backend: rope(t, cos, sin, pairs=pairs, backend=backend), [x],
                                         dy, ())
    assert torch.equal(ours[0][..., rotary:], x[..., rotary:])
    for name, a, t, r in zip(("y", "dx"), ours, torch16, ref):
        assert a.dtype == torch.bfloat16 and torch.isfinite(a).all()
        assert _rel(a, r) < 4e-3 and _rel(a, r) <= 1.05 * _rel(t, r), \
            f"{name}: ours {_rel(a, r):.2e}, torch bf16 {_rel(t, r):.2e} against fp32"


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_fused_gated_norm_matches_torch_path(activation):
    """kernels.gdn_fused.gated_rms_norm at the real shape (8192 tokens x 32 value heads, head dim 128, bf16), with
    Gated DeltaNet's SiLU gate and KDA's sigmoid one."""
    from functools import partial

    from kernels.gdn_fused import gated_rms_norm as norm

    gated_rms_norm = partial(norm, activation=activation)

    shape = (8192, 32, 128)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(shape, device="cuda", generator=gen) * 2).bfloat16()
    gate = torch.randn(shape, device="cuda", generator=gen).bfloat16()
    w = (1 + 0.2 * torch.randn(128, device="cuda", generator=gen)).bfloat16()
    dy = torch.randn(shape, device="cuda", generator=gen).bfloat16()
    ours, torch16, ref = _fused_vs_torch(gated_rms_norm, [x, gate, w], dy, (1e-6,))
    assert (ours[0] == torch16[0]).float().mean() > 0.995  # same roundings in the same order
    for name, a, t, r in zip(("y", "dx", "dgate", "dw"), ours, torch16, ref):
        assert a.dtype == torch.bfloat16 and torch.isfinite(a).all()
        assert _rel(a, r) < 5e-3 and _rel(a, r) <= max(1.25 * _rel(t, r), 4e-3), \
            f"{name}: ours {_rel(a, r):.2e}, torch bf16 {_rel(t, r):.2e} against fp32"


@pytest.mark.parametrize("loop", [False, True])
def test_ep_grouped_gemms_match_the_per_expert_loop(loop, monkeypatch):
    """The three grouped GEMMs in bf16 on CUDA, as one torch._grouped_mm and as cuBLAS one expert at a time (what
    few wide experts take: LOOP_MIN_WEIGHT lowered to these small ones), against the fp32 loop, with idle experts in
    the groups."""
    import launch.moe as moe
    from launch.moe import grouped_linear, grouped_linear_dx, grouped_weight_grad

    monkeypatch.setattr(moe, "LOOP_MIN_WEIGHT", 0 if loop else 2**62)
    counts = [5, 0, 17, 3, 0, 40, 1, 9]
    torch.manual_seed(0)
    M, D, O = sum(counts), 256, 128
    x = torch.randn(M, D, device="cuda")
    dy = torch.randn(M, O, device="cuda")
    w = torch.randn(len(counts), O, D, device="cuda") * 0.05
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    bf = lambda t: t.to(torch.bfloat16)  # noqa: E731
    pairs = [(grouped_linear(bf(x), bf(w), counts, offs), grouped_linear(x, w, counts, offs)),
             (grouped_linear_dx(bf(dy), bf(w), counts, offs), grouped_linear_dx(dy, w, counts, offs)),
             (grouped_weight_grad(bf(dy), bf(x), counts, offs), grouped_weight_grad(dy, x, counts, offs))]
    for fast, ref in pairs:
        assert fast.shape == ref.shape
        assert _rel(fast, ref) < 1e-2, f"rel err {_rel(fast, ref):.2e}"
    assert pairs[2][0][1].abs().max() == 0 and pairs[2][0][4].abs().max() == 0  # idle experts: zero gradient


def test_expert_grads_kernels_match_the_torch_path():
    """kernels/expert_grads.py's Triton kernels against their torch references at the rows of one layer's
    backward (M = tokens × top-k, D = 2048, I = 512, bf16), dout and w column slices of one [M, D + 8] row buffer as
    the EP backward passes them: g equal (the same product rounded once), dw within fp32 summation order, dh and a
    within a bf16 rounding of the reference on rare elements; the experts' bias add equal."""
    from kernels.expert_grads import add_expert_bias_, slot_grads, swiglu_backward

    torch.manual_seed(0)
    M, D, I = 65536 + 37, 2048, 512
    buf = torch.randn(M, D + 8, device="cuda").bfloat16()
    buf[:, D] = torch.rand(M, device="cuda").bfloat16()
    dout, w = buf[:, :D], buf[:, D:D + 1]
    y = torch.randn(M, D, device="cuda").bfloat16()
    (g, dw), (g_ref, dw_ref) = (slot_grads(dout, w, y, backend=b) for b in ("triton", "torch"))
    assert torch.equal(g, g_ref)
    assert _rel(dw, dw_ref) < 1e-6
    h = (torch.randn(M, 2 * I, device="cuda") * 3).bfloat16()
    da = torch.randn(M, I, device="cuda").bfloat16()
    for ours, ref in zip(swiglu_backward(h, da, backend="triton"), swiglu_backward(h, da, backend="torch")):
        assert _rel(ours, ref) < 1e-4
        assert ((ours.float() - ref.float()).abs() <= ref.float().abs() * 2.0 ** -7 + 1e-6).all()
    # the experts' bias add: bitwise torch's gather and add, 32 experts of uneven counts, three idle
    counts = torch.randint(0, 4096, (32,), device="cuda")
    counts[[3, 17, 31]] = 0
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = torch.randn(int(counts.sum()), 2 * I, device="cuda").bfloat16()
    bias = torch.randn(32, 2 * I, device="cuda").bfloat16()
    ours, ref = (add_expert_bias_(rows.clone(), bias, offs, backend=b) for b in ("triton", "torch"))
    assert torch.equal(ours, ref)


def test_ep_chunks_on_the_comm_stream_equal_one_chunk(monkeypatch):
    """The chunked dispatch on CUDA (its all-to-alls on a communication stream, an NCCL group of one rank) against
    one chunk, under activation recompute: the output and every gradient of k = 4 within bf16 rounding of k = 1. The
    compute stream is held back in every chunk (a spin kernel queued with each regroup) so that it lags the
    communication stream, as it does under real GEMMs: a receive buffer written before the compute stream is done
    with the memory it reuses then shows as errors of percents in the gradients (a dispatch pre-issued against an
    event recorded before the chunk loop did that in the recomputed forward, which issues no combine)."""
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint

    import launch.expert_parallel as ep_mod
    from launch.expert_parallel import ExpertParallel
    from launch.moe import GroupedExperts

    regroup_of = ep_mod.Route.regroup_of

    def lagging_regroup_of(*a, **kw):
        torch.cuda._sleep(2_000_000)  # ~1 ms of spinning on the compute stream, once a chunk and pass
        return regroup_of(*a, **kw)

    monkeypatch.setattr(ep_mod.Route, "regroup_of", staticmethod(lagging_regroup_of))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29531")

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        torch.manual_seed(0)
        T, D, E, K, I = 8192, 1024, 64, 8, 512
        experts = GroupedExperts(E, D, I).cuda().bfloat16()
        with torch.no_grad():
            experts.gate_up_proj.normal_(0, 0.03)
            experts.down_proj.normal_(0, 0.03)
        x0 = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        probs = torch.softmax(torch.randn(T, E, device="cuda"), -1)
        w0, e = torch.topk(probs, K, dim=-1)
        dout = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        stream = torch.cuda.Stream()
        got = {}
        for k in (1, 4):
            experts.token_dispatch = ExpertParallel(dist.group.WORLD, E, k, stream)
            experts.zero_grad()
            x, w = x0.clone().requires_grad_(), w0.to(torch.bfloat16).requires_grad_()
            # under recompute, as the model runs: the recomputed forward pre-issues every dispatch with no combine
            # between them, the schedule where a receive buffer can reuse an earlier chunk's memory
            out = checkpoint(experts, x, w, e, use_reentrant=False)
            out.backward(dout)
            torch.cuda.synchronize()
            got[k] = [out.detach(), x.grad, w.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()]
        for name, a, b in zip(["out", "dx", "dw_route", "d gate_up", "d down"], got[4], got[1]):
            assert _rel(a, b) < 1e-2, f"{name}: k = 4 off k = 1 by {_rel(a, b):.2e}"
    finally:
        if own:
            dist.destroy_process_group()


@pytest.fixture
def untuned_triton(monkeypatch):
    """Each autotuned Triton kernel takes its least demanding config (fewest stages, then warps, then the smallest
    block sizes) without benchmarking: autotuning fla's kernels in fp32 takes over six minutes on an H200, and a
    config changes the speed, not the result beyond rounding."""
    from triton.runtime.autotuner import Autotuner

    def smallest(self, kwargs, *rest, **kw):
        def need(c):
            blocks = 1
            for v in c.kwargs.values():
                blocks *= v if isinstance(v, int) else 1
            return (c.num_stages, c.num_warps, blocks)
        return [min(original(self, kwargs, *rest, **kw), key=need)]

    original = Autotuner.prune_configs
    monkeypatch.setattr(Autotuner, "prune_configs", smallest)


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_combine_on_fla_equals_fla_on_the_whole_sequence(cp, kda, untuned_triton):
    """The CP segment combine on flash-linear-attention's kernels (fla_segment_pass, then the fold and the
    completion), every rank simulated on one GPU, fp32 inputs, documents crossing segment edges and one starting on
    an edge: outputs and input gradients equal fla over the whole sequence to its own precision (Gated DeltaNet's
    kernel, and KDA's with a decay per key channel)."""
    from launch.context_parallel import delta_rule_on_one_device
    from launch.gated_delta import chunk_gated_delta_rule_fla, fla_status
    from launch.model import Packing

    ok, why = fla_status(128, per_channel=kda)
    if not ok:
        pytest.skip(why)
    T, G, H, K, V = 2 * cp * 256, 8 if kda else 4, 8, 128, 128
    L = T // (2 * cp)
    lengths = [L + 5, L - 5, T - 2 * L]  # a start inside segment 1, one exactly on segment 2's edge
    gen = torch.Generator(device="cuda").manual_seed(cp)
    xs = [torch.randn(T, G, K, device="cuda", generator=gen), torch.randn(T, G, K, device="cuda", generator=gen),
          torch.randn(T, H, V, device="cuda", generator=gen),
          -torch.nn.functional.softplus(torch.randn(T, H, *((K,) if kda else ()), device="cuda", generator=gen)
                                        + 2.0) * 0.2,
          torch.sigmoid(torch.randn(T, H, device="cuda", generator=gen))]
    w = torch.randn(T, H, V, device="cuda", generator=gen)
    whole = [x.clone().requires_grad_() for x in xs]
    ref = chunk_gated_delta_rule_fla(*whole, Packing.from_lengths(lengths, "cuda").cu_seqlens, 64)
    (ref * w).sum().backward()
    split = [x.clone().requires_grad_() for x in xs]
    got = delta_rule_on_one_device(split, lengths, cp, 64, backend="fla")
    (got * w).sum().backward()
    assert _rel(got, ref) < 1e-3, f"output rel err {_rel(got, ref):.2e}"
    for name, a, b in zip("q k v g beta".split(), split, whole):
        assert _rel(a.grad, b.grad) < 1e-2, f"grad {name}: rel err {_rel(a.grad, b.grad):.2e}"


def test_peak_memory_gb_counts_the_allocator_and_what_lies_outside_it():
    """launch.job.peak_memory_gb, what `recipe launch` reports: the allocated peak sees a 1 GiB tensor freed since,
    and the device figure is the reserved peak plus what the device holds outside the allocator (a CUDA context is
    over 100 MB)."""
    from launch.job import peak_memory_gb

    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    x = torch.empty(2**30, dtype=torch.uint8, device=dev)
    del x
    m = peak_memory_gb(dev)
    assert m["peak_mem_gb"] >= (base + 2**30) / 1e9
    assert m["peak_device_gb"] >= torch.cuda.max_memory_reserved(dev) / 1e9 + 0.1


@pytest.mark.parametrize("head_dim", [128, 256])
def test_gqa_runs_inside_flash_attention_and_equals_repeated_heads(head_dim):
    """In bf16 SDPA's flash kernel takes K/V at the KV heads' count (`sdpa_kv` passes them as they are), for one
    document (causal flag) and for a CP piece (lower-right causal: queries at the end of longer keys). Against fp32
    attention with repeated heads, the output and gradients are as close as bf16 attention with K/V repeated to the
    query heads. In fp32 (no flash kernel) K/V are repeated, so the memory-efficient kernel runs rather than the math
    path."""
    from torch.nn.attention.bias import causal_lower_right

    from launch.model import sdpa_kv

    def rel(a, b):
        a, b = a.detach().float(), b.detach()
        return float((a - b).norm() / b.norm())

    g = torch.Generator(device="cuda").manual_seed(0)
    Hq, Hkv, Tk = 16, 2, 1536
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for Tq, mask in ((Tk, None), (512, causal_lower_right(512, Tk))):
        q = torch.randn(1, Hq, Tq, head_dim, device="cuda", generator=g)
        k, v = (torch.randn(1, Hkv, Tk, head_dim, device="cuda", generator=g) for _ in range(2))
        dy = torch.randn(1, Hq, Tq, head_dim, device="cuda", generator=g)
        kw = dict(attn_mask=mask, is_causal=mask is None)

        def run(dtype, repeat):
            qq, kk, vv = (x.to(dtype).requires_grad_() for x in (q, k, v))
            if repeat:
                out = sdpa(qq, kk.repeat_interleave(Hq // Hkv, 1), vv.repeat_interleave(Hq // Hkv, 1), **kw)
            else:
                k_in, v_in, gqa = sdpa_kv(qq, kk, vv)
                assert gqa and k_in is kk and v_in is vv
                out = sdpa(qq, k_in, v_in, enable_gqa=True, **kw)
            return [out, *torch.autograd.grad(out, (qq, kk, vv), dy.to(dtype))]

        ref = [t.float() for t in run(torch.float32, True)]
        for a, b, r in zip(run(torch.bfloat16, False), run(torch.bfloat16, True), ref):
            assert rel(a, r) <= 1.5 * rel(b, r) + 1e-3 and rel(a, r) < 2e-2, (rel(a, r), rel(b, r))
    q32, k32 = torch.randn(1, Hq, 64, 64, device="cuda"), torch.randn(1, Hkv, 64, 64, device="cuda")
    kk, _, gqa = sdpa_kv(q32, k32, k32)
    assert not gqa and kk.shape[1] == Hq and torch.equal(kk[:, 1], k32[:, 0])


def _fp32_and_bf16(shape, backend: str = "auto"):
    """The model of `shape` on the GPU in fp32 and in bf16 (the same seed) over two packed documents: per dtype its
    hidden states and every parameter's gradient against a fixed random direction (h² would be about constant after
    the final norm); and the bf16 model. `backend`: the RMSNorms' and RoPE's (auto: the fused kernels; torch)."""
    from launch.model import ATTENTION_MIXERS, HeadsRMSNorm, Packing, RMSNorm, build_model

    ids = torch.randint(0, 512, (2048,), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    packing = Packing.from_lengths([700, 1348], device="cuda")
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(shape, device="cuda", dtype=dtype, seed=1)
        for m in model.modules():
            if isinstance(m, (RMSNorm, HeadsRMSNorm)):
                m.backend = backend
            if isinstance(m, ATTENTION_MIXERS):
                m.rope_backend = backend
        h = model(ids, packing)
        r = torch.randn(h.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        (h.float() * r).sum().backward()
        out[dtype] = h.detach(), {n: p.grad for n, p in model.named_parameters()}
    return out, model


def test_mla_in_bf16_runs_in_flash_attention_and_matches_fp32():
    """DeepSeek-V3's attention at its head sizes is what SDPA's cuDNN kernel takes with v at its width (128), and the
    flash kernel with v zero-padded to 192 (where cuDNN does not run); the tiny DeepSeek-V3-style model
    (tests/dist_cases.py: MLA, YaRN, sigmoid group-limited routing) in bf16
    on the GPU (cuDNN's kernel) follows fp32 (padded, no cuDNN) in its hidden states, and with every layer dense (no
    routing choice to flip between the dtypes) in every parameter's gradient too."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import dist_cases
    from launch.model import cudnn_takes

    q, k, v = (torch.randn(1, 128, 1024, 192, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert torch.backends.cuda.can_use_flash_attention(torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, False))
    # the whole-sequence path's kernel: cuDNN with v at its own width (128)
    assert cudnn_takes(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0, :, :, :128].transpose(0, 1))
    moe = dist_cases.tiny_mla()
    for shape in (moe, moe.model_copy(update={"first_dense_layers": moe.num_layers})):
        out, model = _fp32_and_bf16(shape)
        (h32, g32), (h16, g16) = out[torch.float32], out[torch.bfloat16]
        g32 = {n: g for n, g in g32.items() if g is not None}
        assert _rel(h16, h32) < 2e-2
        if shape is moe:
            assert model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
        else:
            worst = max((_rel(g16[n], g), n) for n, g in g32.items() if g.norm() > 0)
            assert worst[0] < 3e-2, worst


@pytest.mark.parametrize("heads, kv_heads, dim, v_dim", [(16, 2, 256, 256), (32, 4, 128, 128), (16, 16, 192, 128)])
def test_context_parallel_piece_runs_on_cudnn_as_prefix_plus_square(heads, kv_heads, dim, v_dim):
    """A CP piece (queries at the end of their keys) runs as cuDNN's prefix and square parts merged by their
    log-sum-exps (launch/attention_parts.py) for Qwen3.5's, Qwen3's and MLA's head shapes (GQA natively, v at its
    width), and equals the same attention in fp32 (a lower-right causal mask) as closely as the one-call bf16
    kernel does, in the output and in every input gradient."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from launch.attention_parts import kernel_for, merged_attention

    n, m = 1536, 2560
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(1, heads, n, dim, device="cuda", generator=g)
    k = torch.randn(1, kv_heads, m + n, dim, device="cuda", generator=g)
    v = torch.randn(1, kv_heads, m + n, v_dim, device="cuda", generator=g)
    w = torch.randn(1, heads, n, v_dim, device="cuda", generator=g)
    scale = dim ** -0.5

    def run(fn, dtype):
        xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        (fn(*xs).float() * w).sum().backward()
        return [fn(*xs).detach().float()] + [x.grad.float() for x in xs]

    def lower_right(q_, k_, v_):
        kk, vv = (t.repeat_interleave(heads // kv_heads, 1) for t in (k_, v_))
        return F.scaled_dot_product_attention(q_, kk, vv, attn_mask=causal_lower_right(n, m + n), scale=scale)

    def split(q_, k_, v_):
        parts = [(k_[:, :, :m], v_[:, :, :m], False), (k_[:, :, m:], v_[:, :, m:], True)]
        kernel = kernel_for(q_, parts)
        assert kernel == "cudnn"
        return merged_attention(q_, parts, scale, kernel)

    ref = run(lower_right, torch.float32)
    one_call = run(lower_right, torch.bfloat16)
    ours = run(split, torch.bfloat16)
    for name, r, a, b in zip(("o", "dq", "dk", "dv"), ref, one_call, ours):
        err_one, err_ours = (((x - r).norm() / r.norm()).item() for x in (a, b))
        assert err_ours < max(1.5 * err_one, 1e-2), (name, err_ours, err_one)


def test_gpt_oss_in_bf16_runs_on_the_gpu_and_follows_fp32():
    """A tiny gpt-oss (attention sinks, 128-token sliding windows on every other layer, biased router and experts,
    the clamped GLU, YaRN) over two packed documents longer than the window: bf16 on the GPU (the sliding blocks'
    batched masked call, the full layers' sink prefix and causal square on cuDNN, grouped expert GEMMs with their
    biases) follows fp32 in its hidden states and in every layer parameter's gradient, sinks included (the head is
    not run). Every token takes all four experts (top-4 of 4), so no routing choice can flip between the dtypes; the
    router's softmax weights still differ per token."""
    from recipe.models import GPT_OSS_ROPE_SCALING, ModelShape

    shape = ModelShape(name="tiny-gpt-oss", arch="gpt_oss", hidden_size=256, num_layers=4, vocab_size=512,
                       layer_types=("sliding_attention", "full_attention") * 2, num_heads=8, num_kv_heads=2,
                       head_dim=64, qk_norm=False, attn_bias=True, sliding_window=128, rope_theta=150000.0,
                       rope_scaling=GPT_OSS_ROPE_SCALING, num_experts=4, top_k=4, expert_ffn=128, router_bias=True,
                       rms_norm_eps=1e-5, max_position=131072)
    import launch.sink_attention as sa

    out, _ = _fp32_and_bf16(shape)
    (h32, g32), (h16, g16) = out[torch.float32], out[torch.bfloat16]
    assert _rel(h16, h32) < 2e-2
    missing = [n for n, g in g16.items() if n != "lm_head.weight" and (g is None or not torch.isfinite(g).all())]
    assert not missing, missing
    # k_proj's bias moves every score of a query by the same q·b, which the softmax cancels but for the sink: its
    # gradient is a nearly cancelling sum, whose relative bf16 error is as large on the sink-key paths (fp32's)
    saved, sa.MERGED_SINK = sa.MERGED_SINK, False
    try:
        _, g_key = _fp32_and_bf16(shape)[0][torch.bfloat16]
    finally:
        sa.MERGED_SINK = saved
    for n, g in g32.items():
        if g is not None and g.norm() > 0:
            err, err_key = _rel(g16[n], g), _rel(g_key[n], g)
            assert err < max(3e-2, 1.5 * err_key), (n, err, err_key)
    assert any("sinks" in n for n in g16)


def test_llama4_in_bf16_runs_on_the_gpu_and_follows_fp32():
    """A tiny Llama 4 (chunked attention in runs of 256 positions over two packed documents of 700 and 1348 tokens,
    a RoPE-free global layer with query temperature changing every 128 positions, q/k at unit RMS, MoE every
    second layer with top-4 of 4 sigmoid weights on the experts' input, so no routing choice can flip between the
    dtypes) in bf16 on the GPU (every chunk a cuDNN call, fused RoPE on channel pairs, grouped expert GEMMs) follows
    fp32 in its hidden states and in every parameter's gradient (the head is not run)."""
    from recipe.models import Llama4Attention, ModelShape

    shape = ModelShape(name="tiny-llama4", arch="llama4", hidden_size=256, num_layers=4, vocab_size=512,
                       layer_types=("chunked_attention", "full_attention") * 2, num_heads=8, num_kv_heads=2,
                       head_dim=64, qk_norm=False, attention_chunk=256,
                       llama4=Llama4Attention(floor_scale=128, attn_scale=0.25), num_experts=4, top_k=4,
                       expert_ffn=128, shared_expert_ffn=128, moe_layer_step=2, dense_ffn=192, norm_topk_prob=False,
                       rope_theta=500000.0, rms_norm_eps=1e-5)
    out, _ = _fp32_and_bf16(shape)
    (h32, g32), (h16, g16) = out[torch.float32], out[torch.bfloat16]
    assert _rel(h16, h32) < 2e-2
    for n, g in g32.items():
        if n != "lm_head.weight":
            assert g16[n] is not None and torch.isfinite(g16[n]).all() and g.norm() > 0, n
            assert _rel(g16[n], g) < 3e-2, (n, _rel(g16[n], g))


@pytest.mark.parametrize("before, window", [(0, None), (1536, None), (0, 128)])
def test_gpt_oss_attention_runs_on_cudnn_with_its_sink_merged(before, window):
    """gpt-oss's attention with its sink logits: a whole document (launch/sink_attention.py's merged path), a CP
    piece after 1536 earlier keys (launch/context_parallel.py `_sink_piece`), both in cuDNN, and a 128-token sliding
    window (the flash kernel's windowed variable-length form) run at the heads' own size (64), the sink merged in by
    its log-sum-exp, and follow the fp32 softmax-with-sink as closely as the sink-key paths at the padded size (72: one
    lower-right flash call; the masked blocks) do, in the output and the q, k, v and sink gradients."""
    import launch.context_parallel as cpm
    import launch.sink_attention as sa
    from launch.attention_parts import flash_window_takes, kernel_for
    from launch.model import Packing

    n, m, hq, hkv, d = 1024, before, 64, 8, 64
    g = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(n, hq, d, device="cuda", generator=g)
    k, v = (torch.randn(m + n, hkv, d, device="cuda", generator=g) for _ in range(2))
    sinks = torch.randn(hq, device="cuda", generator=g)
    w = torch.randn(n, hq, d, device="cuda", generator=g)
    scale = d ** -0.5
    qb, kb, vb = (x.bfloat16().transpose(0, 1)[None] for x in (q, k, v))
    parts = ([(kb[:, :, :m], vb[:, :, :m], False)] if m else []) + [(kb[:, :, m:], vb[:, :, m:], True)]
    assert kernel_for(qb, parts) == "cudnn"
    if window:
        assert flash_window_takes(q.bfloat16(), k.bfloat16(), v.bfloat16())

    def reference(q_, k_, v_, s_):
        kk, vv = (t.repeat_interleave(hq // hkv, 1) for t in (k_, v_))
        logits = torch.einsum("qhd,khd->hqk", q_, kk) * scale
        pos_q = torch.arange(m, m + n, device="cuda")[:, None]
        pos_k = torch.arange(m + n, device="cuda")[None, :]
        logits = logits.masked_fill((pos_k > pos_q) | ((pos_q - pos_k >= window) if window else False), float("-inf"))
        full = torch.cat([logits, s_[:, None, None].expand(hq, n, 1)], dim=-1).softmax(-1)[..., :-1]
        return torch.einsum("hqk,khd->qhd", full, vv)

    def ours(q_, k_, v_, s_):
        if m:
            return cpm._sink_piece(q_, k_, v_, s_, scale)
        return sa.sink_attention(q_, k_, v_, s_, Packing.from_lengths([n], device="cuda"), scale, window)

    def run(fn, dtype, merged=True):
        xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)] + [sinks.detach().clone().requires_grad_()]
        saved = cpm.SPLIT_PIECES, sa.MERGED_SINK
        cpm.SPLIT_PIECES = sa.MERGED_SINK = merged
        o = fn(*xs)
        cpm.SPLIT_PIECES, sa.MERGED_SINK = saved
        (o.float() * w).sum().backward()
        return [o.detach().float()] + [x.grad.float() for x in xs]

    ref = run(reference, torch.float32)
    one_call = run(ours, torch.bfloat16, merged=False)
    merged = run(ours, torch.bfloat16)
    for name, r, a, b in zip(("o", "dq", "dk", "dv", "dsinks"), ref, one_call, merged):
        err_one, err_ours = (((x - r).norm() / r.norm()).item() for x in (a, b))
        assert err_ours < max(1.5 * err_one, 1e-2), (name, err_ours, err_one)


def _gpu_family_shape(family: str):
    """The tiny models of the per-family GPU check (see the test below)."""
    from recipe.models import LinearAttnShape, MLAShape, ModelShape, SigmoidRouter, SoftmaxRouter

    common = dict(hidden_size=256, num_layers=4, vocab_size=512, num_experts=4, top_k=4, expert_ffn=128,
                  router_bias=True, sigmoid_router=SigmoidRouter(groups=1, topk_groups=1, scaling=1.0),
                  first_dense_layers=1, dense_ffn=192, rms_norm_eps=1e-5, arch="glm4_moe", qk_norm=False)
    mla = MLAShape(q_lora_rank=64, kv_lora_rank=128, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    if family == "mimo":
        return ModelShape(name="tiny-mimo", hf_model_type="mimo_v2_flash",
                          layer_types=("full_attention",) + ("sliding_attention",) * 2 + ("full_attention",),
                          num_heads=8, num_kv_heads=2, sliding_kv_heads=4, head_dim=192, v_head_dim=128,
                          value_scale=0.707, sinks="sliding", sliding_window=128, partial_rotary_factor=0.334,
                          rope_theta=5e6, sliding_rope_theta=1e4, **common)
    if family == "afmoe":
        return ModelShape(name="tiny-afmoe", hf_model_type="afmoe",
                          layer_types=("sliding_attention", "full_attention") * 2, num_heads=8, num_kv_heads=2,
                          head_dim=64, sliding_window=128, attn_output_gate=True, nope_full_layers=True,
                          norm_placement="sandwich", embedding_scale=16.0, shared_expert_ffn=128,
                          **{**common, "qk_norm": True})
    if family == "laguna":
        return ModelShape(name="tiny-laguna", hf_model_type="laguna",
                          layer_types=("full_attention",) + ("sliding_attention",) * 3, num_heads=4, sliding_heads=6,
                          num_kv_heads=2, head_dim=64, head_gate=True, head_gate_activation="softplus",
                          partial_rotary_factor=0.5, sliding_rotary_factor=1.0, rope_theta=5e5,
                          sliding_rope_theta=1e4, sliding_window=128, shared_expert_ffn=128,
                          **{**common, "qk_norm": True})
    if family == "kimi":  # KDA at its head size (fla's chunk_kda in both dtypes) around a RoPE-free MLA layer
        return ModelShape(name="tiny-kimi", hf_model_type="kimi_linear",
                          layer_types=("linear_attention",) * 2 + ("full_attention", "linear_attention"),
                          num_heads=4, num_kv_heads=4, head_dim=192, mla=mla, nope_full_layers=True,
                          linear_attn=LinearAttnShape(kind="kda", num_k_heads=2, num_v_heads=2, head_k_dim=128,
                                                      head_v_dim=128),
                          shared_expert_ffn=128, **{**common, "arch": "deepseek_v3"})
    return ModelShape(name="tiny-mistral4", hf_model_type="mistral4", layer_types=("full_attention",) * 4,
                      num_heads=4, num_kv_heads=4, head_dim=192, mla=mla, query_scale_period=256,
                      query_scale_beta=0.1, shared_expert_ffn=128,
                      **{**common, "arch": "deepseek_v3", "router_bias": False, "sigmoid_router": None,
                         "softmax_router": SoftmaxRouter(scaling=1.5)})


@pytest.mark.parametrize("family", ["mimo", "afmoe", "laguna", "kimi", "mistral4"])
def test_per_layer_attention_families_in_bf16_run_on_the_gpu_and_follow_fp32(family):
    """The attention forms the CPU checks hold to transformers, on the GPU's kernels: MiMo-V2-Flash's (sliding layers
    with twice the KV heads, sinks and their own RoPE base; q·k heads of 192 with values of 128: zero-padded on the
    windowed flash path, at their own width in cuDNN on the full layers, padded again in fp32), AFMoE's (norms
    before and after each sublayer, the output gate, the full layers without RoPE), Laguna's (heads by layer kind, a
    softplus gate per head), Kimi-Linear's (KDA on fla's chunk_kda, its sigmoid-gated norm in the fused kernel, MLA
    without RoPE) and Mistral 4's (MLA with the query scale by position). bf16 follows fp32 in the hidden states and in
    every parameter's gradient; top-4 of 4 experts, so no routing choice can flip between the dtypes. A gradient
    may miss fp32 by more than 3% where the same model on the torch ops (norms, RoPE) misses it by nearly as much in
    bf16: AFMoE's q/k norm weights, whose gradients sum over every token of every head (3.0-3.1% on both paths)."""
    shape = _gpu_family_shape(family)
    out, _ = _fp32_and_bf16(shape)
    (h32, g32), (h16, g16) = out[torch.float32], out[torch.bfloat16]
    _, g_ops = _fp32_and_bf16(shape, backend="torch")[0][torch.bfloat16]
    assert _rel(h16, h32) < 2e-2
    for n, g in g32.items():
        if n != "lm_head.weight" and g is not None and g.norm() > 0:
            assert g16[n] is not None and torch.isfinite(g16[n]).all(), n
            err, err_ops = _rel(g16[n], g), _rel(g_ops[n], g)
            assert err < max(3e-2, 1.25 * err_ops), (n, err, err_ops)
