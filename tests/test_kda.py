"""Kimi Delta Attention (per-channel decays in the gated delta rule): the chunked rule against the token-by-token
recurrence and against transformers' own KDA (tests/test_context_parallel.py holds the context-parallel state combine
with KDA's decays, tests/test_hf_parity.py the whole model against transformers' Kimi-Linear)."""

from __future__ import annotations

import pytest
import torch

from launch.gated_delta import chunk_gated_delta_rule_torch, recurrent_gated_delta_rule_ref
from launch.model import Packing


def _kda_inputs(T, H, K, V, seed, dtype=torch.float32, strong=False):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, H, K, generator=g, dtype=dtype), torch.randn(T, H, K, generator=g, dtype=dtype)
    v = torch.randn(T, H, V, generator=g, dtype=dtype)
    # per-channel log decays: most channels mild, some strong (a chunk's decay past fp32's exp range when strong)
    decay = -torch.rand(T, H, K, generator=g, dtype=dtype) * (40.0 if strong else 0.7)
    beta = torch.rand(T, H, generator=g, dtype=dtype)
    return q, k, v, decay, beta


@pytest.mark.parametrize("lengths,H,K,V,C,strong", [
    ([37], 2, 8, 6, 8, False),  # odd length: padding
    ([13, 5, 19, 1], 2, 16, 8, 4, False),  # packed, a 1-token document, boundaries mid-chunk and on chunk edges
    ([70], 3, 8, 8, 64, True),  # decays summing to thousands inside a chunk: no overflow, no nan
])
def test_chunked_kda_matches_the_recurrence(lengths, H, K, V, C, strong):
    T = sum(lengths)
    inputs = _kda_inputs(T, H, K, V, seed=T, strong=strong)
    pos = Packing.from_lengths(lengths).positions
    ref = recurrent_gated_delta_rule_ref(*inputs, pos)
    out = chunk_gated_delta_rule_torch(*inputs, pos, C)
    assert torch.isfinite(out).all()
    err = (out - ref).abs().max().item()
    assert err < 1e-5, f"max err {err:.2e}"


def test_per_channel_decays_are_not_one_per_head():
    """The same decay on every channel is Gated DeltaNet's rule; channels decaying apart give another output (the
    per-channel path is used, not a head mean)."""
    q, k, v, decay, beta = _kda_inputs(24, 2, 8, 4, seed=1)
    pos = Packing.from_lengths([24]).positions
    per_head = decay[..., 0]
    same = chunk_gated_delta_rule_torch(q, k, v, per_head[..., None].expand_as(decay), beta, pos, 8)
    assert (same - chunk_gated_delta_rule_torch(q, k, v, per_head, beta, pos, 8)).abs().max() < 1e-5
    assert (chunk_gated_delta_rule_torch(q, k, v, decay, beta, pos, 8) - same).abs().max() > 1e-2


def test_chunked_kda_gradients_match_the_recurrence(monkeypatch):
    """fp64 gradients of q, k, v, the per-channel g and β; the pairwise decays formed a chunk at a time (and
    recomputed in the backward) give the same."""
    import launch.gated_delta as gd

    inputs = [x.double().requires_grad_() for x in _kda_inputs(23, 2, 4, 4, seed=3)]
    pos = Packing.from_lengths([9, 14]).positions
    cot = torch.randn(23, 2, 4, dtype=torch.float64)
    (recurrent_gated_delta_rule_ref(*inputs, pos) * cot).sum().backward()
    ref = [x.grad.clone() for x in inputs]
    for elements in (1 << 24, 1):  # all chunks at once; one chunk per block
        monkeypatch.setattr(gd, "DECAYED_PRODUCT_ELEMENTS", elements)
        for x in inputs:
            x.grad = None
        (chunk_gated_delta_rule_torch(*inputs, pos, 4) * cot).sum().backward()
        for name, r, x in zip("q k v g beta".split(), ref, inputs):
            assert (r - x.grad).abs().max() < 1e-10, (name, elements)


def test_chunked_kda_equals_transformers_kda():
    """transformers' Kimi-Linear KDA (its torch path: one sequence, q/k L2-normalized inside) on the same inputs."""
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    q, k, v, decay, beta = _kda_inputs(50, 2, 8, 8, seed=7)
    theirs, _ = chunk_kimi_delta_attention(q[None], k[None], v[None], decay[None], beta[None], chunk_size=16,
                                           use_qk_l2norm_in_kernel=True)
    ours = chunk_gated_delta_rule_torch(q, k, v, decay, beta, Packing.from_lengths([50]).positions, 16)
    assert (ours - theirs[0]).abs().max() < 1e-5
