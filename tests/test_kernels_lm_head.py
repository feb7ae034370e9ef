"""The LM head's front (kernels.linear_cross_entropy / linear_logprobs / linear_policy_loss) and its autograd path
(kernels/lm_head/token_stats.py: log-probs and per-token cross-entropy, the backward recomputing the logits) on
the torch backend, against the float64 reference; the package's layout (every module imports alone, no cycles).
The fused and lean paths: tests/test_kernels_lm_head_fused.py and _lean.py; the Triton kernels: _triton.py;
vocab-parallel and FSDP2: _dist.py.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from lm_head_checks import REPO, check_all_ignored, check_cross_entropy, check_logprobs, inputs, rel

SHAPES = [(37, 48, 301), (5, 16, 1000), (64, 33, 257)]
PACKAGE = REPO / "kernels" / "lm_head"


@pytest.mark.parametrize("T,H,V", SHAPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_torch(T, H, V, reduction):
    check_cross_entropy(T, H, V, backend="torch", tol=1e-5, reduction=reduction)


@pytest.mark.parametrize("kw", [
    dict(z_loss=1e-3), dict(temperature=0.6), dict(temperature=1.7, z_loss=1e-4),
    dict(logit_scale=100.0),  # |z| ~ 100: any tile that skips the running max overflows exp
    dict(chunk_tokens=8, chunk_vocab=50),  # many chunks, odd sizes: chunked equals unchunked
])
def test_per_token_cross_entropy_options_torch(kw):
    check_cross_entropy(37, 48, 301, backend="torch", tol=2e-5, reduction="none", **kw)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_bf16_inputs_fp16_scaled_gemms_torch(reduction):
    # 16-bit inputs: dZ and the backward GEMMs run in fp16 with power-of-two scales; the error is bf16 output
    # rounding (~1e-3), and the |z| ~ 100 case checks the scales keep fp16 in range.
    for scale in (3.0, 100.0):
        check_cross_entropy(37, 48, 301, backend="torch", tol=1e-5, grad_tol=3e-3, dtype=torch.bfloat16,
                            reduction=reduction, logit_scale=scale, chunk_tokens=16, chunk_vocab=128)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_logprobs_torch(with_entropy, temperature):
    check_logprobs(41, 40, 333, backend="torch", tol=1e-5, with_entropy=with_entropy, temperature=temperature,
                   chunk_tokens=16, chunk_vocab=100)


@pytest.mark.parametrize("softcap", [2.0, 5.0])
def test_softcap_autograd_path_torch(softcap):
    # logits c tanh(z / c) before the temperature (Gemma's final_logit_softcapping), z of std 3 against caps of 2 and 5
    # (the checks assert the capped and uncapped references differ by far more than their limits): per-token CE, and
    # log-probs with entropy at temperature 0.8, chunked; the backward recomputes z and applies 1 - tanh^2 to dZ
    check_cross_entropy(37, 48, 301, backend="torch", tol=2e-6, reduction="none", softcap=softcap, z_loss=1e-3,
                        chunk_tokens=16, chunk_vocab=128)
    check_logprobs(41, 40, 333, backend="torch", tol=2e-6, temperature=0.8, softcap=softcap, chunk_tokens=16,
                   chunk_vocab=100)
    # 16-bit inputs: the scaled fp16 dZ with the slope in it; |z| ~ 30 against a cap of 5 saturates most logits
    check_cross_entropy(37, 48, 301, backend="torch", tol=1e-5, grad_tol=3e-3, dtype=torch.bfloat16,
                        reduction="none", logit_scale=30.0, softcap=softcap, chunk_tokens=16, chunk_vocab=128)


def test_softcap_off_is_the_uncapped_head():
    # None and 0 take the uncapped code paths: bit for bit the same numbers; a negative cap is refused
    hidden, weight, target = inputs(19, 24, 90)
    h, w = hidden.detach(), weight.detach()
    plain = kernels.linear_logprobs(h, w, target, with_entropy=True, temperature=0.9)
    for off in (None, 0, 0.0):
        out = kernels.linear_logprobs(h, w, target, with_entropy=True, temperature=0.9, softcap=off)
        assert all(torch.equal(a, b) for a, b in zip(out, plain))
        assert torch.equal(kernels.linear_cross_entropy(h, w, target, softcap=off),
                           kernels.linear_cross_entropy(h, w, target))
    with pytest.raises(ValueError, match="softcap"):
        kernels.linear_cross_entropy(h, w, target, softcap=-30.0)
    with pytest.raises(ValueError, match="softcap"):
        kernels.linear_logprobs(h, w, target, softcap=float("inf"))


def test_logprobs_large_logits_torch():
    # fp32 logits of size ~300 carry ~3e-5 absolute error, which the entropy of a near one-hot softmax feels
    check_logprobs(23, 32, 211, backend="torch", tol=1e-3, grad_tol=1e-4, logit_scale=100.0)


def test_all_ignored_torch():
    check_all_ignored("torch")


def test_activation_checkpoint_non_reentrant():
    from torch.utils.checkpoint import checkpoint

    hidden, weight, target = inputs(29, 32, 150)
    scale = torch.randn(32)

    def head(h, w):
        return kernels.linear_logprobs(torch.tanh(h * scale), w, target, with_entropy=True)

    lp, ent = checkpoint(head, hidden, weight, use_reentrant=False)
    (lp.sum() + 0.3 * ent.sum()).backward()
    dh, dw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    lp2, ent2 = head(hidden, weight)
    (lp2.sum() + 0.3 * ent2.sum()).backward()
    assert torch.equal(lp, lp2) and torch.equal(ent, ent2)
    assert rel(dh, hidden.grad) < 1e-6 and rel(dw, weight.grad) < 1e-6


@pytest.mark.parametrize("mode", ["fused", "lean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_tokens_give_zero_loss_and_zero_gradients(mode, dtype):
    hidden, weight, _ = inputs(0, 8, 10, dtype=dtype)
    target = torch.zeros(0, dtype=torch.long)
    kernels.linear_cross_entropy(hidden, weight, target, mode=mode).backward()
    assert (weight.grad == 0).all() and hidden.grad.shape == (0, 8)
    weight.grad = None
    lp, ent = kernels.linear_logprobs(hidden, weight, target, with_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert (weight.grad == 0).all()


def test_policy_loss_that_ignores_the_head_has_no_gradient():
    hidden, weight, target = inputs(7, 8, 10)
    loss, logp, _ = kernels.linear_policy_loss(hidden, weight, target, lambda lp, ent, t0, t1: torch.ones(t1 - t0))
    loss.backward()
    assert loss.item() == 7.0 and (hidden.grad == 0).all() and (weight.grad == 0).all() and logp.shape == (7,)


def test_bad_arguments():
    hidden, weight, target = inputs(4, 8, 10)
    with pytest.raises(ValueError, match="reduction"):
        kernels.linear_cross_entropy(hidden, weight, target, reduction="avg")
    with pytest.raises(ValueError, match="temperature"):
        kernels.linear_logprobs(hidden, weight, target, temperature=0.0)
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        kernels.linear_logprobs(hidden, weight[:, :5], target)
    with pytest.raises(ValueError, match="needs the loss in the head"):
        kernels.linear_cross_entropy(hidden, weight, target, reduction="none", mode="lean")
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        kernels.linear_policy_loss(hidden, weight[:, :5], target, lambda lp, ent, a, b: lp)
    with pytest.raises(ValueError, match="mode must be 'fused', 'lean' or None"):
        kernels.linear_policy_loss(hidden, weight, target, lambda lp, ent, a, b: lp, mode="eager")
    with pytest.raises(ValueError, match="backend must be"):
        kernels.linear_logprobs(hidden, weight, target, backend="cuda")


def test_no_triton_import_on_cpu_path():
    code = ("import sys, torch, kernels; h = torch.randn(3, 4); w = torch.randn(5, 4); "
            "kernels.linear_cross_entropy(h, w, torch.tensor([0, 1, 2])); "
            "kernels.linear_logprobs(h, w, torch.tensor([0, 1, 2])); assert 'triton' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def _imports(path: Path) -> set[str]:
    """The kernels.lm_head modules a module imports at its top level (not inside functions)."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kernels.lm_head"):
            if node.module == "kernels.lm_head":
                out |= {f"kernels.lm_head.{a.name}" for a in node.names}
            else:
                out.add(node.module)
    return out


def test_package_import_graph_has_no_cycles():
    mods = {f"kernels.lm_head.{p.stem}": p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    graph = {m: _imports(p) & set(mods) for m, p in mods.items()}
    done, stack = set(), []

    def visit(m):
        assert m not in stack, f"import cycle: {' -> '.join(stack[stack.index(m):] + [m])}"
        if m in done:
            return
        stack.append(m)
        for n in graph[m]:
            visit(n)
        stack.pop()
        done.add(m)

    for m in graph:
        visit(m)
    # the layers: numerics and the tables import nothing of the package; the backends only numerics and tables
    assert graph["kernels.lm_head.numerics"] == set() and graph["kernels.lm_head.tiles"] == set()
    assert graph["kernels.lm_head.torch_backend"] == {"kernels.lm_head.numerics"}
    assert graph["kernels.lm_head.triton_backend"] == {"kernels.lm_head.numerics", "kernels.lm_head.tiles"}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(p.stem for p in PACKAGE.glob("*.py")
                                        if p.stem not in ("__init__", "triton_backend")))
def test_each_module_imports_alone(name):
    code = f"import importlib; importlib.import_module('kernels.lm_head.{name}')"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_the_cost_model_holds_what_the_fused_head_holds():
    """recipe/cost.py (never importing torch) copies the fused head's group size and buffer budget: its lm_head_bytes
    must be the kernel's group of fp16 tile weights, fp32 dW accumulator + fp16 W, and fp32 dH, at any vocab."""
    from kernels.lm_head import fused
    from recipe import cost
    from recipe.models import resolve_model

    assert (cost.FUSED_HEAD_GROUP_TOKENS, cost.FUSED_HEAD_BUDGET_B) == (fused.GROUP_TOKENS, fused.SCRATCH_BYTES)
    m = resolve_model("qwen35-35b")
    for vocab in (32_000, 151_936, 248_320, 600_000):  # the last: groups shrink below 4096 to fit the budget
        shape = m.model_copy(update={"vocab_size": vocab})
        for s, tp in ((1000, 1), (65_536, 1), (65_536, 2)):
            v, h = vocab // tp, shape.hidden_size
            held = fused.group_size(s, v, None, 2) * v * 2 + v * h * (4 + 2) + s * h * 4
            assert cost.lm_head_bytes(shape, s, tp, "fused") == held, (vocab, s, tp)


def test_both_backends_offer_the_same_functions():
    """The interface kernels/lm_head/backends.py names, with the same parameters in torch and Triton (read from the
    source: importing the Triton module would import triton)."""
    def public(path: Path) -> dict[str, list[str]]:
        tree = ast.parse(path.read_text())
        return {f.name: [a.arg for a in f.args.args + f.args.kwonlyargs] for f in tree.body
                if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}

    interface = {"tile_vocab", "logits_tiles", "merge_tiles", "target_logits", "dlogits_from_tiles",
                 "dlogits_from_logits", "dw_acc"}
    torch_fns, triton_fns = public(PACKAGE / "torch_backend.py"), public(PACKAGE / "triton_backend.py")
    assert interface <= set(torch_fns) and interface <= set(triton_fns)
    assert {n: torch_fns[n] for n in interface} == {n: triton_fns[n] for n in interface}


def test_backward_vocab_chunks_split_the_unaligned_tail():
    # the autograd path's backward cuts the last vocabulary chunk where its rows stop being a multiple of
    # GEMM_ALIGN (64): V = 128,167 in chunks of 8192 ends in 5,248 and 39 rows; aligned or small vocabularies and
    # chunk widths that are not multiples of 64 are left as they are
    from kernels.lm_head.token_stats import vocab_chunks

    assert vocab_chunks(128167, 8192)[-3:] == [(114688, 122880), (122880, 128128), (128128, 128167)]
    assert len(vocab_chunks(128167, 8192)) == 17 and vocab_chunks(128192, 8192)[-1] == (122880, 128192)
    assert vocab_chunks(301, 192) == [(0, 192), (192, 256), (256, 301)]
    assert vocab_chunks(301, 128) == [(0, 128), (128, 256), (256, 301)]  # a tail of 45 < 64: as it is
    assert vocab_chunks(301, 50)[-1] == (300, 301) and vocab_chunks(301, 301) == [(0, 301)]
    # and the split chunks give the unsplit gradients (bf16: fp16 dZ, scaled GEMMs)
    check_cross_entropy(37, 48, 301, backend="torch", tol=1e-5, grad_tol=3e-3, dtype=torch.bfloat16,
                        reduction="none", chunk_tokens=16, chunk_vocab=192)
