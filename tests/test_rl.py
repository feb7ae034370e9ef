"""RL losses against values worked out by hand."""

import math

import pytest
import torch

from launch.rl import LossConfig, aggregate, kl_penalty, policy_loss, token_logprobs



LN = math.log


def test_clipped_surrogate_by_hand():
    # ratios 1.5, 0.5, 1.1, 0.7 (log-prob differences), advantages +1, +1, −1, −1; ε_low 0.2, ε_high 0.28
    old = torch.zeros(4)
    logp = torch.tensor([LN(1.5), LN(0.5), LN(1.1), LN(0.7)], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    mask = torch.ones(4, dtype=torch.bool)
    loss, m = policy_loss(logp, adv, mask, LossConfig(clip_low=0.2, clip_high=0.28, tis_cap=None), old_logp_T=old)
    # token 0: min(1.5, 1.28)·1 = 1.28 (clipped high)   token 1: min(0.5, 0.8) = 0.5 (unclipped: pessimistic side)
    # token 2: min(−1.1, −1.1) = −1.1                    token 3: min(−0.7, −0.8) = −0.8 (clipped low)
    expected = -(1.28 + 0.5 - 1.1 - 0.8) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["clip_frac"].item() == pytest.approx(0.5)
    loss.backward()
    # clipped tokens carry no gradient; d(−ρA)/dlogp = −ρA / 4 for the others
    assert logp.grad.tolist() == pytest.approx([0.0, -0.5 / 4, 1.1 / 4, 0.0], abs=1e-6)


def test_token_mean_and_seq_mean():
    x = torch.tensor([1.0, 2.0, 3.0, 10.0, 0.0])
    mask = torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool)
    seq = torch.tensor([0, 0, 0, 1, 1])
    assert aggregate(x, mask, seq, "token_mean").item() == pytest.approx(16 / 4)
    # sequence 0: mean(1, 2, 3) = 2; sequence 1: mean(10) = 10 (the masked token does not count)
    assert aggregate(x, mask, seq, "seq_mean").item() == pytest.approx(6.0)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([LN(0.5)]), torch.tensor([LN(0.25)])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(LN(2))
    # k3 = r − log r − 1 with r = π_ref/π = 0.5 → 0.5 + ln 2 − 1
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 + LN(2) - 1)
    assert kl_penalty(ref, ref, "k3").item() == 0.0


def test_kl_and_entropy_terms_enter_the_loss():
    logp = torch.tensor([LN(0.5), LN(0.5)])
    ref = torch.tensor([LN(0.25), LN(0.5)])
    ent = torch.tensor([1.0, 3.0])
    adv = torch.zeros(2)
    mask = torch.ones(2, dtype=torch.bool)
    cfg = LossConfig(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01, tis_cap=None)
    loss, m = policy_loss(logp, adv, mask, cfg, ref_logp_T=ref, entropy_T=ent)
    assert loss.item() == pytest.approx((0.1 * LN(2) + 0.0) / 2 - 0.01 * 2.0)
    assert m["kl_ref"].item() == pytest.approx(LN(2) / 2)
    assert m["entropy"].item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="needs entropy_T"):
        policy_loss(logp, adv, mask, cfg, ref_logp_T=ref)


def test_truncated_importance_weights():
    # trainer's old log-probs vs the rollout engine's: weights exp(old − rollout) = 3 → capped at 2, and 0.5
    logp = torch.zeros(2, requires_grad=True)
    old = torch.zeros(2)
    rollout = torch.tensor([-LN(3), LN(2)])
    adv = torch.ones(2)
    mask = torch.ones(2, dtype=torch.bool)
    loss, m = policy_loss(logp, adv, mask, LossConfig(tis_cap=2.0), old_logp_T=old, rollout_logp_T=rollout)
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    assert m["tis_weight"].item() == pytest.approx(1.25)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1.0, -0.25])
    off, _ = policy_loss(logp, adv, mask, LossConfig(tis_cap=None), old_logp_T=old, rollout_logp_T=rollout)
    assert off.item() == pytest.approx(-1.0)


def test_on_policy_ratio_is_one_and_approx_kl_zero():
    logp = torch.randn(6, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, 0.0, -3.0])
    loss, m = policy_loss(logp, adv, torch.ones(6, dtype=torch.bool), LossConfig())
    assert loss.item() == pytest.approx(-adv.mean().item())
    assert m["approx_kl"].item() == 0.0 and m["clip_frac"].item() == 0.0
    loss.backward()
    assert torch.allclose(logp.grad, -adv / 6)


def test_naive_fused_and_lean_heads_agree():
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(9, 16, generator=g), torch.randn(40, 16, generator=g)
    tgt = torch.tensor([3, 0, 39, 7, -1, 12, 5, 5, 1])
    up_lp, up_ent = torch.randn(9, generator=g), torch.randn(9, generator=g)
    by_case = {}
    # softcap 3: the logits (std 4 here) capped to 3 tanh(z / 3) before the temperature, Gemma 4's head
    for temperature, softcap in ((1.0, None), (0.7, None), (0.7, 3.0)):
        grads = {}
        for mode in ("naive", "fused", "lean"):
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            lp, ent = token_logprobs(hh, ww, tgt, mode=mode, temperature=temperature, softcap=softcap,
                                     with_entropy=True)
            ((lp * up_lp).sum() + (ent * up_ent).sum()).backward()
            grads[mode] = (lp.detach(), ent.detach(), hh.grad, ww.grad)
        a = by_case[temperature, softcap] = grads["naive"]
        for mode in ("fused", "lean"):
            b = grads[mode]
            assert torch.allclose(a[0], b[0], atol=1e-5) and torch.allclose(a[1], b[1], atol=1e-4), mode
            assert torch.allclose(a[2], b[2], atol=1e-4) and torch.allclose(a[3], b[3], atol=1e-4), mode
        assert a[0][4] == 0
    # the cap moves every output and gradient by far more than the tolerances above
    capped, plain = by_case[0.7, 3.0], by_case[0.7, None]
    assert all((c - p).abs().max() > 0.05 for c, p in zip(capped, plain))
    ref = torch.log_softmax(h @ w.T, -1)[torch.arange(9), tgt.clamp(min=0)]
    assert torch.allclose(token_logprobs(h, w, tgt, mode="naive")[:4], ref[:4], atol=1e-6)
    with pytest.raises(ValueError, match="lm_head must be"):
        token_logprobs(h, w, tgt, mode="liger")


def test_loss_config_validation():
    with pytest.raises(ValueError, match="clip_low"):
        LossConfig(clip_low=1.2)
    with pytest.raises(ValueError, match="aggregation"):
        LossConfig(aggregation="batch_mean")


@pytest.mark.parametrize("impl,softcap", [(None, None), ("lean", None), (None, 1.0), ("lean", 1.0)])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_fused_policy_loss_equals_unfused(aggregation, impl, softcap):
    # the loss handed to the head (three GEMMs, gradients formed in the forward; lean: four, in the gradients' own
    # storage) against token_logprobs (naive, materialized logits) + policy_loss: same loss, metrics and gradients,
    # with every optional term on; softcap 1.0 caps logits of std 1.2 (token_logprobs' naive cap against the head's)
    from launch.rl import fused_nll_loss, fused_policy_loss

    g = torch.Generator().manual_seed(11)
    T, H, V = 53, 24, 97
    h = torch.randn(T, H, generator=g, requires_grad=True)
    w = (torch.randn(V, H, generator=g) * 0.3).requires_grad_()
    tgt = torch.randint(0, V, (T,), generator=g)
    tgt[:3] = -100
    mask = torch.rand(T, generator=g) > 0.3
    mask[:3] = False
    seq = torch.cat([torch.zeros(20), torch.ones(13), torch.full((20,), 2)]).long()
    adv = torch.randn(T, generator=g)
    old, ref, roll = (torch.randn(T, generator=g) * 0.3 - 5.0 for _ in range(3))
    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01, aggregation=aggregation, tis_cap=2.0)
    kw = dict(old_logp_T=old, ref_logp_T=ref, rollout_logp_T=roll, seq_id_T=seq)

    lp, ent = token_logprobs(h, w, tgt, mode="naive", temperature=0.8, softcap=softcap, with_entropy=True)
    loss_ref, m_ref = policy_loss(lp, adv, mask, cfg, entropy_T=ent, **kw)
    loss_ref.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    loss, m = fused_policy_loss(h, w, tgt, adv, mask, cfg, temperature=0.8, softcap=softcap, impl=impl, **kw)
    loss.backward()
    assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-5)
    assert torch.allclose(h.grad, gh, rtol=1e-4, atol=1e-7) and torch.allclose(w.grad, gw, rtol=1e-4, atol=1e-7)
    assert m.keys() == m_ref.keys()
    for k in m:
        assert m[k].item() == pytest.approx(m_ref[k].item(), rel=1e-5, abs=1e-7), k

    h.grad = w.grad = None
    nll, _ = fused_nll_loss(h, w, tgt, mask, impl=impl, softcap=softcap)
    nll.backward()
    lp = token_logprobs(h.detach(), w.detach(), tgt, mode="naive", softcap=softcap)
    assert nll.item() == pytest.approx((-(lp * mask).sum() / mask.sum()).item(), rel=1e-5)
