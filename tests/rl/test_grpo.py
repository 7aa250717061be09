"""GRPO math against values worked out by hand (the arithmetic is in the comments)."""
import math

import pytest
import torch

from dsv4.rl.grpo import (DUAL_CLIP, LOG_RATIO_CLAMP, group_advantages, logprob_mismatch, policy_loss,
                          restricted_logprobs)

LN = math.log


def close(a, b, tol=1e-6):
    a, b = (x.detach() if hasattr(x, "detach") else x for x in (a, b))
    return abs(float(a) - float(b)) <= tol


# ------------------------------------------------------------------------------------------ advantages
def test_group_advantages_hand_values():
    # group 1 [1,0,0,1]: mean 0.5, sample std sqrt((4 * 0.25) / 3) = 0.5773503 -> +-0.5 / (0.5773503 + 1e-6)
    # group 2 [1,1,1,1]: no spread -> dead, advantage 0
    # group 3 [3,1,1,1]: mean 1.5, sample std sqrt((2.25 + 3 * 0.25) / 3) = 1 -> [1.5, -.5, -.5, -.5] / (1 + 1e-6)
    adv, live = group_advantages(torch.tensor([1., 0, 0, 1, 1, 1, 1, 1, 3, 1, 1, 1]), group_size=4)
    a = 0.8660239  # 0.5 / (sqrt(1/3) + 1e-6)
    expected = [a, -a, -a, a, 0, 0, 0, 0, 1.4999985, -0.4999995, -0.4999995, -0.4999995]
    assert adv.dtype == torch.float32 and torch.isfinite(adv).all()
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6), adv
    assert live.tolist() == [True] * 4 + [False] * 4 + [True] * 4


def test_group_advantages_without_std():
    adv, live = group_advantages([1.0, 0.0, 0.0, 1.0, 0.5, 0.5], group_size=2, std_normalize=False)
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0]
    assert live.tolist() == [True, True, True, True, False, False]


def test_group_advantages_equal_float_rewards_are_dead():
    # 0.1 three times in float64: torch's mean comes out 1.4e-17 off and (for a single group) its std
    # 1.7e-17, not 0; the group must still be dead with advantage exactly 0
    adv, live = group_advantages(torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64), group_size=3)
    assert adv.tolist() == [0.0] * 3 and not live.any()
    adv, live = group_advantages(torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7], dtype=torch.float64), group_size=3)
    assert adv.tolist() == [0.0] * 6 and not live.any()


def test_group_advantages_group_of_one_and_errors():
    adv, live = group_advantages([1.0, 0.0], group_size=1)
    assert adv.tolist() == [0.0, 0.0] and not live.any()
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages([1.0, 0.0, 1.0, 1.0], group_size=3)
    with pytest.raises(ValueError, match="reward 2 is nan"):
        group_advantages([1.0, 0.0, float("nan"), 1.0], group_size=2)


# ------------------------------------------------------------------------------------------- the loss
def one_token(ratio: float, adv: float, **kw):
    logp = torch.tensor([[LN(0.4 * ratio)]], requires_grad=True)
    old = torch.tensor([[LN(0.4)]])
    loss, stats = policy_loss(logp, old, torch.tensor([adv]), torch.tensor([[True]]), **kw)
    loss.backward()
    return loss.item(), stats, logp.grad.item()


# (ratio, A) -> (loss, clipped?, dloss/dlogp) with clip 0.2 / 0.28, i.e. ratio clipped to [0.8, 1.28]:
#   1.5, +2: min(3.0, 2.56) = 2.56 (clipped branch)     -> -2.56, clipped, grad 0
#   0.5, +2: min(1.0, 1.6)  = 1.0                       -> -1.0, grad -ratio*A = -1.0
#   1.5, -2: min(-3.0, -2.56) = -3.0                    -> +3.0, grad +3.0 (no upper clip for A < 0)
#   0.5, -2: min(-1.0, -1.6) = -1.6 (clipped branch)    -> +1.6, clipped, grad 0
#   1.1, +2: inside the clip range                      -> -2.2, grad -2.2
@pytest.mark.parametrize("ratio,adv,loss,clipped,grad", [
    (1.5, 2.0, -2.56, True, 0.0),
    (0.5, 2.0, -1.0, False, -1.0),
    (1.5, -2.0, 3.0, False, 3.0),
    (0.5, -2.0, 1.6, True, 0.0),
    (1.1, 2.0, -2.2, False, -2.2),
])
def test_clipped_loss_hand_values(ratio, adv, loss, clipped, grad):
    got, stats, g = one_token(ratio, adv)
    assert math.isfinite(got) and math.isfinite(g)
    assert close(got, loss, 1e-5), got
    assert stats["pg_clipfrac"] == (1.0 if clipped else 0.0)
    assert close(g, grad, 1e-5), g
    assert close(stats["ppo_kl"], -LN(ratio), 1e-6)  # mean(old - new)


def test_clip_bounds_are_asymmetric():
    # ratio 1.25 sits inside the upper bound 1.28 but outside a symmetric 1.2
    assert close(one_token(1.25, 1.0)[0], -1.25, 1e-5)
    assert close(one_token(1.25, 1.0, clip_high=0.2)[0], -1.2, 1e-5)
    # ratio 0.75 with A < 0: clipped at 0.8 -> 0.8 * 1
    assert close(one_token(0.75, -1.0)[0], 0.8, 1e-5)


def test_batch_mean_and_clipfrac():
    # the four cases above in one batch: mean(-2.56, -1.0, 3.0, 1.6) = 0.26; two of four tokens clipped
    ratios = torch.tensor([1.5, 0.5, 1.5, 0.5])
    logp = (ratios * 0.3).log().unsqueeze(1)
    loss, stats = policy_loss(logp, torch.full((4, 1), LN(0.3)), torch.tensor([2.0, 2.0, -2.0, -2.0]),
                              torch.ones(4, 1, dtype=torch.bool))
    assert close(loss, 0.26, 1e-5) and stats["pg_clipfrac"] == 0.5
    assert stats["tokens"] == 4 and stats["samples"] == 4 and close(stats["pg_loss"], 0.26, 1e-5)


def test_aggregation_token_mean_per_sample_skips_empty():
    # ratio 1 everywhere, so each token's pg is -A.
    # sample 0: A=1 on 2 tokens -> mean -1;  sample 1: no token;  sample 2: A=-3 on 1 token -> 3
    # loss = (-1 + 3) / 2 = 1.0   (a token mean would be 1/3, counting the empty sample 2/3)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]], dtype=torch.bool)
    logp = torch.full((3, 3), LN(0.5))
    logp[~mask] = -math.inf  # padding may hold tokens outside the allowed set
    logp.requires_grad_(True)
    old = torch.where(mask, torch.full((3, 3), LN(0.5)), torch.full((3, 3), math.nan))
    loss, stats = policy_loss(logp, old, torch.tensor([1.0, 5.0, -3.0]), mask)
    loss.backward()
    assert close(loss, 1.0) and stats["samples"] == 2 and stats["tokens"] == 3
    assert torch.isfinite(logp.grad).all()
    assert (logp.grad[~mask] == 0).all()
    # d loss / d logp = -A * ratio / (tokens in sample) / (samples): -1/2/2, -1/2/2 and 3/1/2
    assert torch.allclose(logp.grad[mask], torch.tensor([-0.25, -0.25, 1.5]))


def test_all_empty_batch_is_zero_and_backpropagates():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, stats = policy_loss(logp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and stats["samples"] == 0 and stats["pg_clipfrac"] == 0.0
    assert (logp.grad == 0).all()


def test_tis_cap():
    # ratio 1, A = 1 -> pg = -1 per token; TIS weights exp(old - rollout) = 3 and 0.5, capped at 2:
    # [-2, -0.5] -> loss -1.25; raw mean (3 + 0.5) / 2 = 1.75; one of two weights clipped
    logp = torch.tensor([[LN(0.3), LN(0.6)]], requires_grad=True)
    old = logp.detach().clone()
    rollout = torch.tensor([[LN(0.1), LN(1.2)]])  # old - rollout = ln 3, ln 0.5
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = policy_loss(logp, old, torch.tensor([1.0]), mask, rollout_logp=rollout, tis_cap=2.0)
    loss.backward()
    assert close(loss, -1.25, 1e-5) and math.isfinite(stats["pg_loss"])
    assert close(stats["tis_mean"], 1.75, 1e-5) and stats["tis_clipfrac"] == 0.5
    # the weight is detached: grad = -A * ratio * w / 2 tokens = [-1, -0.25]
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -0.25]]), atol=1e-6)
    # rollout given without a cap: diagnostics only, the loss is untouched
    loss2, stats2 = policy_loss(logp, old, torch.tensor([1.0]), mask, rollout_logp=rollout)
    assert close(loss2, -1.0, 1e-6) and close(stats2["tis_mean"], 1.75, 1e-5)
    with pytest.raises(ValueError, match="rollout_logp"):
        policy_loss(logp, old, torch.tensor([1.0]), mask, tis_cap=2.0)


def test_k3_kl_to_reference():
    # p = 0.5, ref = 0.25: d = ref - logp = -ln 2; k3 = e^d - d - 1 = 0.5 + ln 2 - 1 = 0.1931472
    # A = 0 removes the pg term: loss = 0.1 * 0.1931472; d k3 / d logp = 1 - e^d = 0.5 -> grad 0.05
    logp = torch.tensor([[LN(0.5)]], requires_grad=True)
    loss, stats = policy_loss(logp, logp.detach(), torch.tensor([0.0]), torch.tensor([[True]]),
                              ref_logp=torch.tensor([[LN(0.25)]]), kl_coef=0.1)
    loss.backward()
    assert close(stats["kl"], 0.1931472) and close(loss, 0.01931472)
    assert close(logp.grad.item(), 0.05)
    assert "kl" not in policy_loss(logp, logp.detach(), torch.tensor([0.0]), torch.tensor([[True]]))[1]
    # far from the reference the penalty is clamped at 10 (miles' low_var_kl clamp): e^5 - 6 = 142 -> 10
    _, far = policy_loss(logp, logp.detach(), torch.tensor([0.0]), torch.tensor([[True]]),
                         ref_logp=torch.tensor([[LN(0.5) + 5]]), kl_coef=1.0)
    assert far["kl"] == 10.0


# ------------------------------------------------------------------------------ extreme log-ratios
def unbounded_pg(logp, old, adv, clip_low=0.2, clip_high=0.28):
    """Per-token PPO-clip loss with neither the log-ratio clamp nor the dual clip, in float64."""
    ratio = torch.exp(logp.double() - old.double())
    a = adv.double().unsqueeze(1)
    return -torch.minimum(ratio * a, ratio.clamp(1 - clip_low, 1 + clip_high) * a)


# One sample of three tokens: a planted log(p / p_old) of +-29 at token 0 (p_old 1e-13 -> p 0.4, or the reverse),
# two moderate tokens at ratios 1.1 and 0.9. Per-token loss of the planted token, A = +-2:
#   +29, A = -2: unbounded e^29 * 2 = 7.9e12; the clamp makes it e^20 * 2, the dual clip 3 * 2 = 6
#   +29, A = +2: PPO's upper clip, 1.28 * -2 = -2.56
#   -29, A = +2: -e^-20 * 2 = -4.1e-9 (unbounded -e^-29 * 2)
#   -29, A = -2: PPO's lower clip, 0.8 * 2 = 1.6
# and in each case the planted token passes no gradient (its log-ratio is past the clamp).
@pytest.mark.parametrize("log_ratio,adv,planted", [
    (29.0, -2.0, DUAL_CLIP * 2.0),
    (29.0, 2.0, -1.28 * 2.0),
    (-29.0, 2.0, -math.exp(-LOG_RATIO_CLAMP) * 2.0),
    (-29.0, -2.0, 0.8 * 2.0),
])
def test_extreme_log_ratio_is_bounded(log_ratio, adv, planted):
    old = torch.tensor([[LN(0.4) - log_ratio, LN(0.3), LN(0.5)]])
    logp = torch.tensor([[LN(0.4), LN(0.3 * 1.1), LN(0.5 * 0.9)]], requires_grad=True)
    a, mask = torch.tensor([adv]), torch.ones(1, 3, dtype=torch.bool)
    loss, stats = policy_loss(logp, old, a, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    moderate = unbounded_pg(logp.detach(), old, a)[0, 1:]
    assert close(loss, (planted + float(moderate.sum())) / 3, 1e-5), loss
    assert abs(loss.item()) <= DUAL_CLIP * abs(adv)
    assert logp.grad[0, 0] == 0
    # the moderate tokens keep the unbounded loss's gradient, -A * ratio / 3 inside PPO's clip range
    ratios = torch.tensor([1.1, 0.9])
    assert torch.allclose(logp.grad[0, 1:], -adv * ratios / 3, atol=1e-6), logp.grad
    assert close(stats["pg_clipfrac_lower"], 1 / 3 if (log_ratio > 0 and adv < 0) else 0.0)
    assert close(stats["ppo_kl"], -log_ratio / 3 - (LN(1.1) + LN(0.9)) / 3, 1e-5)   # unclamped: shows the size


def test_log_ratio_past_fp32_exp_is_finite():
    # a log-ratio of 100: fp32's exp is inf (past ~88.7); unclamped, A = +1 gave a finite loss with a NaN gradient
    # and A = -1 an infinite loss. Both directions, and a reference 100 nats away in the k3 KL (NaN gradient before)
    old = torch.tensor([[LN(0.4) - 100, LN(0.4) + 100]])
    logp = torch.full((2, 2), LN(0.4)).requires_grad_(True)
    for adv in (1.0, -1.0):
        logp.grad = None
        loss, stats = policy_loss(logp, old.expand(2, 2), torch.tensor([adv, -adv]), torch.ones(2, 2, dtype=torch.bool),
                                  ref_logp=old.expand(2, 2), kl_coef=0.1)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), (loss, logp.grad)
        assert abs(loss.item()) <= DUAL_CLIP + 0.1 * 10 and stats["kl"] == 10.0


def test_moderate_ratios_equal_the_unbounded_loss():
    # ratios in [e^-1, e^1]: under the dual clip's 3 and far inside the clamp, so the loss and its gradient are
    # the plain PPO-clip ones
    torch.manual_seed(3)
    old = torch.rand(6, 5).mul(0.9).add(0.05).log()
    logp = (old + torch.empty(6, 5).uniform_(-1, 1)).requires_grad_(True)
    adv = torch.randn(6)
    mask = torch.rand(6, 5) > 0.2
    mask[:, 0] = True
    loss, stats = policy_loss(logp, old, adv, mask)
    loss.backward()
    ref_logp = logp.detach().double().requires_grad_(True)
    pg = torch.where(mask, unbounded_pg(ref_logp, old, adv), torch.zeros((), dtype=torch.float64))
    want = (pg.sum(1) / mask.sum(1)).mean()
    want.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert close(loss, want, 1e-6) and stats["pg_clipfrac_lower"] == 0.0
    assert torch.allclose(logp.grad.double(), ref_logp.grad, atol=1e-7)
    assert stats["pg_clipfrac"] > 0                          # PPO's own clip is exercised, not only the middle


def test_dual_clip_can_be_turned_off_and_is_checked():
    # without the cap only the clamp bounds A < 0: e^20 * |A| for a log-ratio of 29 (one token, A = -1)
    logp, old = torch.tensor([[LN(0.4)]]), torch.tensor([[LN(0.4) - 29]])
    loss, _ = policy_loss(logp, old, torch.tensor([-1.0]), torch.tensor([[True]]), clip_c=None)
    assert torch.isfinite(loss) and close(loss / math.exp(LOG_RATIO_CLAMP), 1.0, 1e-5)
    with pytest.raises(ValueError, match="clip_c"):
        policy_loss(logp, old, torch.tensor([-1.0]), torch.tensor([[True]]), clip_c=1.0)


def test_shape_errors():
    with pytest.raises(ValueError, match="adv must be"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="old_logp has shape"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3, dtype=torch.bool))


# ------------------------------------------------------------------------------------------ mismatch
def test_logprob_mismatch_hand_values():
    # train p [.5, .25, .2], rollout p [.5, .2, .1]; the masked 4th column is garbage and must not count.
    # x = train - rollout = [0, ln 1.25, ln 2]: mean |x| = (0.2231436 + 0.6931472) / 3 = 0.3054302, max ln 2
    # k3 = e^x - x - 1 = [0, 1.25 - ln 1.25 - 1, 2 - ln 2 - 1] = [0, .0268564, .3068528] -> mean 0.1112364
    #   (the reversed direction, e^-x + x - 1, would give 0.0720969)
    # Pearson of the probabilities, in 1/3600ths: cov 240, var 186 and 312 -> 240 / sqrt(186 * 312) = 0.9962710
    train = torch.tensor([[LN(.5), LN(.25), LN(.2), -math.inf]])
    rollout = torch.tensor([[LN(.5), LN(.2), LN(.1), 3.0]])
    mask = torch.tensor([[True, True, True, False]])
    d = logprob_mismatch(train, rollout, mask)
    assert all(math.isfinite(v) for v in d.values())
    assert close(d["train_rollout_logprob_abs_diff"], 0.3054302)
    assert close(d["train_rollout_logprob_abs_diff_max"], 0.6931472)
    assert close(d["train_rollout_kl"], 0.1112364)
    assert close(d["train_rollout_prob_pearson"], 0.9962710)
    assert d["tokens"] == 3


def test_logprob_mismatch_constant_and_empty():
    one = torch.tensor([[LN(0.3)]])
    yes = torch.tensor([[True]])
    same = logprob_mismatch(one, one.clone(), yes)
    assert same["train_rollout_prob_pearson"] == 1.0 and same["train_rollout_kl"] == 0.0
    off = logprob_mismatch(one, torch.tensor([[LN(0.6)]]), yes)
    assert off["train_rollout_prob_pearson"] == 0.0 and close(off["train_rollout_logprob_abs_diff_max"], LN(2))
    # a collapsed policy (constant probabilities) on one side only: correlation 0, not NaN
    flat = logprob_mismatch(torch.full((1, 3), LN(0.5)), torch.tensor([[LN(.5), LN(.4), LN(.6)]]),
                            torch.ones(1, 3, dtype=torch.bool))
    assert flat["train_rollout_prob_pearson"] == 0.0
    empty = logprob_mismatch(one, one, torch.tensor([[False]]))
    assert empty["tokens"] == 0 and all(math.isfinite(v) for v in empty.values())


# ------------------------------------------------------------------------------------------- scoring
def test_restricted_logprobs_normalised_over_allowed():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 16) * 3
    allowed = [7, 1, 5]
    per_token = [restricted_logprobs(logits, torch.full((2, 3), t), allowed, temperature=0.7) for t in allowed]
    total = torch.stack(per_token).exp().sum(0)
    assert torch.allclose(total, torch.ones(2, 3), atol=1e-6)
    outside = restricted_logprobs(logits, torch.full((2, 3), 2), allowed)
    assert torch.isneginf(outside).all()
    # without a restriction it is the plain log-softmax
    tokens = torch.randint(0, 16, (2, 3))
    want = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert torch.allclose(restricted_logprobs(logits, tokens), want, atol=1e-6)


def test_restricted_logprobs_temperature():
    # logits [0, 1, 2, 3], allowed {1, 3}, token 3:
    #   T = 0.5 -> scaled [2, 6]: log(1 / (1 + e^-4)) = -0.0181499
    #   T = 1   -> [1, 3]:        log(1 / (1 + e^-2)) = -0.1269280; T = 0 (greedy) is scored as T = 1
    logits, tok = torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor(3)
    assert close(restricted_logprobs(logits, tok, [1, 3], temperature=0.5), -0.0181499)
    assert close(restricted_logprobs(logits, tok, [1, 3], temperature=1.0), -0.1269280)
    assert close(restricted_logprobs(logits, tok, [1, 3], temperature=0.0), -0.1269280)
    with pytest.raises(ValueError, match="temperature"):
        restricted_logprobs(logits, tok, [1, 3], temperature=-1.0)
    with pytest.raises(ValueError, match="allowed ids"):
        restricted_logprobs(logits, tok, [1, 4])


def test_restricted_scores_through_the_loss_stay_finite():
    # a padded position holding a token outside the allowed set scores -inf; masked, it must not
    # turn the loss or the logits' gradient into NaN
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 12, requires_grad=True)
    tokens = torch.tensor([[3, 4, 0], [4, 0, 0]])  # 0 is padding, not allowed
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    logp = restricted_logprobs(logits, tokens, [3, 4, 5])
    assert torch.isneginf(logp[~mask]).all()
    loss, stats = policy_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()
    assert logits.grad[0, 2].abs().sum() == 0 and logits.grad[0, 0].abs().sum() > 0
    # only allowed columns receive gradient
    assert logits.grad[..., [0, 1, 2, 6, 7, 8, 9, 10, 11]].abs().sum() == 0
