"""GRPO math for the RL stage: group advantages, the PPO-clip policy loss, the train/rollout mismatch
diagnostics, and scoring a response under the sampler's restriction and temperature. Torch only, no state.

The recipe is miles' (`miles/ray/rollout/train_data_conversion.py`, `loss_hub/losses.py`,
`loss_hub/corrections.py`) with the DSV4 flags: eps_clip 0.2 / eps_clip_high 0.28, KL coefficient 0,
optional vanilla TIS capped at 2. Shapes: B responses, T response tokens each (right-padded), `mask` true on
the tokens a response really has.

Where this departs from miles/verl, and why:
* Groups are consecutive runs of `group_size` samples, not looked up by `group_index`: our rollout
  emits each prompt's samples together, and a fixed layout is one thing less to get wrong.
* A group is "live" when its rewards are not all *exactly* equal (miles' `check_reward_nonzero_std`
  looks at the computed std): for three float64 rewards of 0.1 torch's mean is 1.4e-17 off and a
  one-row std 1.7e-17, so r - mean is not 0 and the std test can call the group live. Dead groups get
  advantage exactly 0.
* The log-ratio is clamped to ±20 before `exp` (`LOG_RATIO_CLAMP`, as verl and miles do; slime does
  not), and a negative advantage's loss is capped at `clip_c` (3) times |A| (verl's dual clip, on by default
  there; miles and slime have it behind `--eps-clip-c`, off). PPO's own clip bounds every other case; for
  A < 0 it leaves the loss at ratio * |A|, which a token the policy moved from p to p * e^29 makes ~1e12:
  finite in fp32, so the `finite_loss` gate let it through, and one such token then sets the step's whole
  gradient. The clamp alone would still leave e^20 ~ 5e8 there; the cap makes it 3 |A| with no gradient,
  and the clamp keeps `exp` finite (at a log-ratio past ~88, fp32's exp is inf and the gradient NaN).
  Moderate ratios (|log-ratio| <= 20, and ratio <= 3 where A < 0) give exactly the unbounded loss.
* Statistics are means over all valid tokens of the batch; miles reduces them per sample first, like
  the loss. They agree when responses have equal lengths (the echo task); the token mean is the plain
  reading of "fraction of tokens clipped".
* `logprob_mismatch` leaves its k3 KL unclamped (miles clamps k3 at 10): it is a diagnostic, and a
  clamp would hide the size of a real mismatch. The KL penalty inside the loss keeps miles' clamp.
* Masked-out positions are zeroed before any arithmetic (`torch.where`, not a multiply), so a padded
  position holding -inf (a token outside `allowed`, see `restricted_logprobs`) gives neither a NaN loss
  nor a NaN gradient.
"""
from __future__ import annotations

import math

import torch

# miles' low_var_kl clamp (`compute_approx_kl`), kept for the KL penalty that enters the loss.
KL_CLAMP = 10.0
# |log(p / p_old)| and |log(p_ref / p)| at most this before `exp`: verl's `compute_policy_loss_vanilla` and
# `kl_penalty`, miles' `_safe_clamp_log_ratio` (math_utils.py, miles#1363)
LOG_RATIO_CLAMP = 20.0
# the dual clip's bound on a negative advantage's ratio (verl's clip_ratio_c default; arXiv 1912.09729)
DUAL_CLIP = 3.0


# ============================================================================================ advantages
def group_advantages(rewards, group_size: int, std_normalize: bool = True,
                     eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards [N] (N = groups x group_size, each prompt's samples consecutive) -> (adv [N] fp32, live [N] bool).

    adv = r - mean(group), divided by (std(group) + eps) when std_normalize. live marks samples of groups
    whose rewards differ; a dead group has adv exactly 0 and carries no signal (the trainer may drop it).

    std is the sample std (Bessel's correction, unbiased=True), because that is what miles and verl
    compute (`torch.Tensor.std()` with its default) and matching them keeps the effective step size and
    any logged advantage comparable with their runs. For group size 8 it is sqrt(8/7) ~ 1.07 times the
    population std, i.e. advantages ~7 % smaller; a group of one has no std and is dead.
    """
    r = torch.as_tensor(rewards).detach()
    if r.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(r.shape)}")
    if group_size < 1 or r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards do not split into groups of {group_size}")
    bad = (~torch.isfinite(r.double())).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"reward {i} is {r[i].item()} (non-finite); {bad.numel()} of {r.numel()} rewards are")
    g = r.double().view(-1, group_size)
    # compared exactly: see the module docstring (a float std of equal rewards need not be 0)
    live = (g != g[:, :1]).any(dim=1, keepdim=True)
    adv = g - g.mean(dim=1, keepdim=True)
    if std_normalize and group_size > 1:
        adv = adv / (g.std(dim=1, keepdim=True, unbiased=True) + eps)
    adv = torch.where(live, adv, torch.zeros_like(adv))
    return adv.flatten().float(), live.expand_as(g).flatten()


# ================================================================================================ loss
def _check_shapes(ref: torch.Tensor, **named) -> None:
    for name, t in named.items():
        if t is not None and tuple(t.shape) != tuple(ref.shape):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logp has {tuple(ref.shape)}")


def _token_mean(x: torch.Tensor, m: torch.Tensor) -> float:
    n = int(m.sum())
    return float(torch.where(m, x, torch.zeros_like(x)).sum() / n) if n else 0.0


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.28,
                rollout_logp: torch.Tensor | None = None, tis_cap: float | None = None,
                ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                clip_c: float | None = DUAL_CLIP) -> tuple[torch.Tensor, dict]:
    """PPO-clip GRPO loss. logp [B,T] (with grad), old_logp [B,T], adv [B], mask [B,T] -> (loss, stats).

    Per token: ratio = exp(clamp(logp - old_logp, ±20)); pg = -min(ratio*A, clip(ratio, 1-clip_low,
    1+clip_high)*A), and where A < 0 at most clip_c * |A| (dual clip; clip_c None: no cap).
    With `tis_cap`: pg *= clamp(exp(old_logp - rollout_logp), 0, tis_cap), detached (vanilla TIS).
    With `ref_logp`: + kl_coef * k3, k3 = exp(d) - d - 1 with d = ref - logp clamped to ±20, k3 clamped at
    10 (as miles).
    Aggregation: token mean per sample, then mean over samples that have at least one token; a batch
    without tokens gives a zero loss that still backpropagates (to zeros).

    stats (python floats): pg_loss, pg_clipfrac (valid tokens where the clipped branch is the one taken),
    pg_clipfrac_lower (valid tokens held at the dual clip's cap), ppo_kl (mean old - new, unclamped),
    tokens, samples; kl when ref_logp is given; tis_mean (mean raw, unclamped weight, which shows the
    mismatch) and tis_clipfrac when rollout_logp is given.
    """
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    _check_shapes(logp, old_logp=old_logp, mask=mask, rollout_logp=rollout_logp, ref_logp=ref_logp)
    if tuple(adv.shape) != (logp.shape[0],):
        raise ValueError(f"adv must be [B] = [{logp.shape[0]}], got shape {tuple(adv.shape)}")
    if tis_cap is not None and rollout_logp is None:
        raise ValueError("tis_cap needs rollout_logp (the engine's logprobs of the same tokens)")
    if not 0 <= clip_low < 1 or clip_high < 0:
        raise ValueError(f"clip_low must be in [0, 1) and clip_high >= 0, got {clip_low}, {clip_high}")
    if clip_c is not None and not clip_c > 1:
        raise ValueError(f"clip_c (the dual clip's bound on the ratio where A < 0) must be > 1, got {clip_c}")

    m = mask.bool()

    def valid(x: torch.Tensor) -> torch.Tensor:
        return torch.where(m, x.float(), torch.zeros((), dtype=torch.float32, device=x.device))

    lp, old = valid(logp), valid(old_logp.detach())
    a = adv.detach().float().unsqueeze(1)
    ratio = torch.exp((lp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    surr = ratio * a
    surr_clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * a
    pg = -torch.minimum(surr, surr_clipped)
    clipped = (surr_clipped < surr) & m
    lower = torch.zeros_like(m)
    if clip_c is not None:
        cap = -clip_c * a                  # > 0 where A < 0
        lower = (a < 0) & (pg > cap) & m
        pg = torch.where(a < 0, torch.minimum(pg, cap), pg)

    stats: dict[str, float] = {}
    if rollout_logp is not None:
        raw = torch.exp(old - valid(rollout_logp.detach()))
        stats["tis_mean"] = _token_mean(raw, m)
        if tis_cap is not None:
            w = raw.clamp(0, tis_cap)
            stats["tis_clipfrac"] = _token_mean((w != raw).float(), m)
            pg = pg * w
        else:
            stats["tis_clipfrac"] = 0.0
    per_token = pg
    if ref_logp is not None:
        d = (valid(ref_logp.detach()) - lp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k3 = (torch.exp(d) - d - 1).clamp(max=KL_CLAMP)
        stats["kl"] = _token_mean(k3.detach(), m)
        per_token = per_token + kl_coef * k3

    counts = m.sum(dim=1)
    has = counts > 0
    denom = counts.clamp(min=1).float()

    def aggregate(x: torch.Tensor) -> torch.Tensor:
        per_sample = torch.where(m, x, torch.zeros_like(x)).sum(dim=1) / denom
        n = int(has.sum())
        # no token at all: per_sample is all zeros but still on the graph, so backward() gives zero gradients
        return per_sample[has].sum() / n if n else per_sample.sum()

    loss = aggregate(per_token)
    stats.update(
        pg_loss=float(aggregate(pg.detach())),
        pg_clipfrac=_token_mean(clipped.float(), m),
        pg_clipfrac_lower=_token_mean(lower.float(), m),
        ppo_kl=_token_mean((old - lp).detach(), m),
        tokens=float(m.sum()),
        samples=float(has.sum()),
    )
    return loss, stats


# ========================================================================================= diagnostics
def logprob_mismatch(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict:
    """How far the trainer's logprobs of the sampled tokens are from the engine's, over the valid tokens.

    train_rollout_logprob_abs_diff / _max: mean and max |train - rollout|.
    train_rollout_kl: KL(rollout || train) by k3 on the rollout's own samples, with
      x = train - rollout: mean of exp(x) - x - 1 (>= 0, and 0 only when they agree); unclamped.
    train_rollout_prob_pearson: Pearson correlation of exp(train) and exp(rollout). When either side is
      constant (one token, or a collapsed policy) correlation is undefined; it is then 1.0 if the two
      agree to 1e-6 in probability and 0.0 otherwise, never NaN.
    tokens: how many tokens the numbers cover (0 means the others say nothing).
    """
    _check_shapes(train_logp, rollout_logp=rollout_logp, mask=mask)
    m = mask.bool()
    t = train_logp.detach().double()[m]
    r = rollout_logp.detach().double()[m].to(t.device)
    n = t.numel()
    if n == 0:
        return {"train_rollout_logprob_abs_diff": 0.0, "train_rollout_logprob_abs_diff_max": 0.0,
                "train_rollout_kl": 0.0, "train_rollout_prob_pearson": 1.0, "tokens": 0}
    x = t - r
    # two -inf logprobs are the same (impossible) token on both sides: no difference, not NaN
    x = torch.where(torch.isneginf(t) & torch.isneginf(r), torch.zeros_like(x), x)
    pt, pr = t.exp(), r.exp()
    st, sr = pt.std(unbiased=False), pr.std(unbiased=False)
    if n < 2 or st == 0 or sr == 0 or not (torch.isfinite(st) and torch.isfinite(sr)):
        corr = 1.0 if bool(torch.allclose(pt, pr, rtol=0, atol=1e-6)) else 0.0
    else:
        corr = float(((pt - pt.mean()) * (pr - pr.mean())).mean() / (st * sr))
        corr = max(-1.0, min(1.0, corr))
    return {
        "train_rollout_logprob_abs_diff": float(x.abs().mean()),
        "train_rollout_logprob_abs_diff_max": float(x.abs().max()),
        "train_rollout_kl": float((torch.exp(x) - x - 1).mean()),
        "train_rollout_prob_pearson": corr,
        "tokens": n,
    }


# ============================================================================================= scoring
def restricted_logprobs(logits: torch.Tensor, tokens: torch.Tensor, allowed: list[int] | None = None,
                        temperature: float = 1.0) -> torch.Tensor:
    """logits [..., V], tokens [...] -> fp32 logprob of each token under the sampler's distribution.

    The sampler divides the logits by the temperature, then takes the softmax over `allowed` only (all of
    V when None); this computes the same, so trainer and rollout logprobs are comparable. A token outside
    `allowed` gets -inf (padding may hold one: mask it, the loss does). temperature 0 means greedy
    decoding, which has no distribution to score; it is scored at temperature 1, as SGLang does (its
    SamplingParams turns temperature 0 into temperature 1 with top_k 1). top_p/top_k/min_p truncation is
    not reproduced: tasks that need exact scores must not sample with them.
    """
    if temperature < 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be >= 0 and finite (0 = greedy), got {temperature}")
    if tuple(tokens.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"tokens {tuple(tokens.shape)} must match logits {tuple(logits.shape)} without the last dim")
    x = logits.float() / (1.0 if temperature == 0 else float(temperature))
    idx = tokens.long().unsqueeze(-1)
    vocab = x.shape[-1]
    if allowed is not None:
        ids = sorted(set(int(i) for i in allowed))
        if not ids:
            raise ValueError("allowed must name at least one token (or be None for the whole vocabulary)")
        if ids[0] < 0 or ids[-1] >= vocab:
            raise ValueError(f"allowed ids must be in [0, {vocab}), got {ids[0]}..{ids[-1]}")
        keep = torch.zeros(vocab, dtype=torch.bool, device=x.device)
        keep[torch.tensor(ids, dtype=torch.long, device=x.device)] = True
        # the engine's own formula (mask to -inf, then log_softmax), so that identical logits give
        # bit-identical logprobs; a logsumexp over the allowed columns only differs by ~1e-6
        x = x.masked_fill(~keep, -math.inf)
    return torch.log_softmax(x, dim=-1).gather(-1, idx).squeeze(-1)
