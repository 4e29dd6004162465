"""The GRPO policy-gradient step: clipped surrogate loss over the final mask, optional
train-inference importance weight, one optimiser step.

Loss per valid token (PPO clipped surrogate, Schulman et al. 2017, eq. 7, with GRPO's
group-normalised advantages, Shao et al. 2024 section 4.1)::

    r_t  = exp(log_probs_t - old_log_probs_t)
    l_t  = max(-A_t * r_t, -A_t * clip(r_t, 1 - pg_clip_low, 1 + pg_clip_high)) * w_t

``w_t`` is the train-inference IS weight when enabled, else 1.
Aggregation (the reference's ``loss_agg_mode`` names):

- ``token-mean``: ``sum(l * m) / sum(m)`` over the whole batch;
- ``seq-mean-token-mean``: the token mean of each row with valid tokens, averaged over those rows.

``m`` is the FINAL mask (response mask times the correction filters), and the normaliser is
taken from it: a token the correction removed neither adds to the numerator nor to the count
(a deliberate difference from the reference). A final mask without any token is not trained on:
the step is skipped and reported (the reference runs a step that trains on nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Literal

import torch
from torch import Tensor

from rollstream.trainer.distributed import Ranks
from rollstream.trainer.logprobs import response_log_probs

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean")


@dataclass(frozen=True)
class PolicyLossConfig:
    """``pg_clip_low`` / ``pg_clip_high``: the clip range of the ratio (1 - low, 1 + high)."""

    pg_clip_low: float = 0.2
    pg_clip_high: float = 0.2
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"

    def __post_init__(self) -> None:
        """Raises ValueError for a negative clip or an unknown aggregation."""
        if not (self.pg_clip_low >= 0 and self.pg_clip_high >= 0):
            raise ValueError(f"pg_clip_low/high must be >= 0, got {self.pg_clip_low}, {self.pg_clip_high}")
        if self.pg_clip_low >= 1:
            raise ValueError(f"pg_clip_low must be < 1 (the lower bound 1 - low must stay positive), got {self.pg_clip_low}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode must be one of {list(LOSS_AGG_MODES)}, got {self.loss_agg_mode!r}")


def policy_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, final_mask: Tensor,
                config: PolicyLossConfig = PolicyLossConfig(), is_weight: Tensor | None = None,
                normaliser: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """The clipped GRPO surrogate over ``final_mask``.

    Args:
        log_probs: ``(B, T) float32`` current policy log p(token), with grad.
        old_log_probs: ``(B, T) float32`` log p(token) of the policy that is being updated, taken
            before the step (detached here).
        advantages: ``(B, T) float32`` per-token advantages (GRPO: the row's group-normalised reward).
        final_mask: ``(B, T)`` 0/1 (any dtype): tokens that are trained.
        config: clip range and aggregation.
        is_weight: ``(B, T)`` train-inference importance weight, or None; detached here.
        normaliser: the denominator of the aggregation when these rows are one micro-batch of a
            larger batch (token-mean: the batch's valid tokens; seq-mean-token-mean: its rows with
            valid tokens), so accumulated micro-batch gradients equal the full batch's.

    Returns:
        ``(loss, metrics)``: a scalar tensor (0.0 with no valid token, still differentiable) and
        ``pg_clipfrac`` (share of valid tokens whose ratio was clipped where it mattered),
        ``approx_kl`` (mean of old - new over valid tokens), ``ratio_mean``, ``valid_tokens``.

    Raises:
        ValueError: the four tensors differ in shape.
    """
    shapes = {tuple(t.shape) for t in (log_probs, old_log_probs, advantages, final_mask)}
    if is_weight is not None:
        shapes.add(tuple(is_weight.shape))
    if len(shapes) != 1:
        raise ValueError(f"policy_loss needs tensors of one shape, got {sorted(shapes)}")
    mask = final_mask.to(log_probs.dtype)
    valid = mask > 0
    # masked positions get log-ratio 0 before exp: padding values (even inf) never reach the loss
    log_ratio = torch.where(valid, log_probs - old_log_probs.detach(), torch.zeros_like(log_probs))
    ratio = torch.exp(log_ratio)
    adv = torch.where(valid, advantages, torch.zeros_like(advantages))
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - config.pg_clip_low, 1.0 + config.pg_clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if is_weight is not None:
        per_token = per_token * torch.where(valid, is_weight.detach(), torch.zeros_like(is_weight))
    per_token = per_token * mask
    n_valid = mask.sum()
    if config.loss_agg_mode == "token-mean":
        loss = per_token.sum() / (normaliser if normaliser is not None else n_valid.clamp(min=1.0))
    else:
        row_tokens = mask.sum(dim=1)
        rows = row_tokens > 0
        row_means = per_token.sum(dim=1) / row_tokens.clamp(min=1.0)
        loss = (row_means * rows).sum() / (normaliser if normaliser is not None else rows.sum().clamp(min=1))
    with torch.no_grad():
        count = max(float(n_valid), 1.0)
        metrics = {
            "pg_clipfrac": float(((clipped > unclipped) & valid).sum()) / count,
            "approx_kl": float((-log_ratio * mask).sum()) / count,
            "ratio_mean": float((ratio * mask).sum()) / count,
            "valid_tokens": float(n_valid),
        }
    return loss, metrics


@dataclass(frozen=True)
class StepReport:
    """What one ``train_step`` did. ``skipped`` is True when the final mask held no token (no
    optimiser step was taken)."""

    skipped: bool
    loss: float
    grad_norm: float
    metrics: dict[str, float]
    old_log_probs: Tensor | None = None  # (B, T) the step's own log-probs, detached, when it was asked for none


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch, old_log_probs: Tensor | None,
               final_mask: Tensor, config: PolicyLossConfig = PolicyLossConfig(),
               is_weight: Tensor | None = None, micro_batch_size: int = 8,
               max_grad_norm: float | None = 1.0, ranks: Ranks = Ranks()) -> StepReport:
    """One GRPO optimiser step over ``batch`` (a RolloutBatch) with gradient accumulation over
    micro-batches of ``micro_batch_size`` rows; the aggregation's normaliser is the whole batch's.

    ``old_log_probs``, ``final_mask`` and ``is_weight``: ``(B, T)`` as in ``policy_loss``, on any
    device (moved to the model's). ``old_log_probs`` None: this one optimiser step consumes the
    batch, so the old log-probs (the weights before the step, whichever version generated the
    rows) are the training forward's own, detached
    (ratio 1, the same loss and gradient as a separate no-grad pass gives, without that pass);
    the report then carries them (``old_log_probs``, zeros where no token is valid). Returns a
    StepReport; a final mask without any token skips the step (nothing is trained on nothing).
    Raises ValueError for mismatched shapes.

    Data-parallel (``ranks.distributed``): ``batch`` is this rank's shard (possibly empty) and
    every rank calls this with the same model and optimiser state. The normaliser is summed over
    the ranks, gradients are summed (not averaged) before clipping, so each rank applies the
    single-process step of the whole batch; the step is skipped on every rank or none. The
    report's loss and metrics are the whole batch's.
    """
    device = next(model.parameters()).device
    mask = final_mask.to(device=device, dtype=torch.float32)
    valid_tokens, valid_rows = ranks.sum([float(mask.sum()), float((mask.sum(dim=1) > 0).sum())], device)
    if valid_tokens == 0:
        return StepReport(skipped=True, loss=0.0, grad_norm=0.0, metrics={"valid_tokens": 0.0})
    normaliser = valid_tokens if config.loss_agg_mode == "token-mean" else valid_rows
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total, sums = 0.0, {"pg_clipfrac": 0.0, "approx_kl": 0.0, "ratio_mean": 0.0}
    own = torch.zeros_like(mask) if old_log_probs is None else None
    for start in range(0, batch.batch_size, micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        micro = _rows_of(batch, rows)
        if mask[rows].sum() == 0:
            continue
        log_probs = response_log_probs(model, micro, micro_batch_size=micro_batch_size, grad=True)
        if own is not None:
            own[rows] = log_probs.detach()
        old = own[rows] if own is not None else old_log_probs[rows].to(device)
        loss, metrics = policy_loss(
            log_probs, old, micro.advantages.to(device), mask[rows], config,
            None if is_weight is None else is_weight[rows].to(device), normaliser=normaliser)
        loss.backward()
        total += float(loss.detach())
        for key in sums:  # token-weighted, so the batch figure is the mean over valid tokens
            sums[key] += metrics[key] * metrics["valid_tokens"]
    if ranks.distributed:  # every rank the same parameters, in order: a missing grad is zeros there
        ranks.sum_gradients(p for p in model.parameters() if p.requires_grad)
        keys = list(sums)
        total, *summed = ranks.sum([total, *(sums[k] for k in keys)], device)
        sums = dict(zip(keys, summed))
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm else float("inf")))
    optimizer.step()
    model.eval()
    return StepReport(skipped=False, loss=total, grad_norm=grad_norm,
                      metrics={**{k: v / valid_tokens for k, v in sums.items()}, "valid_tokens": valid_tokens},
                      old_log_probs=own)


def _rows_of(batch, rows: slice):
    """The RolloutBatch of rows ``rows`` (tensors sliced, ``extras`` too; per-row lists too)."""
    per_row_lists = ("prompt_ids_str", "sample_index", "policy_versions")  # group_keys is per group
    sliced = {f.name: getattr(batch, f.name)[rows] for f in fields(batch)
              if isinstance(getattr(batch, f.name), Tensor) or f.name in per_row_lists}
    extras = getattr(batch, "extras", None)
    if extras:
        sliced["extras"] = {name: t[rows] for name, t in extras.items()}
    return replace(batch, **sliced)
