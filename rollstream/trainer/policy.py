"""The policy trainer: one GRPO step per rollout batch.

old_log_probs (training model, before the step) -> train-inference correction (masks and IS
weight, reference-behaviour.md (h)) -> final mask = response_mask x filter mask -> clipped GRPO
step over the final mask (rollstream.trainer.grpo). A step whose final mask is empty is skipped
and reported, never trained on nothing. Returns the figures the manifest and the run summary
report per batch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from rollstream.trainer.batch import RolloutBatch
from rollstream.trainer.corrections import (
    TrainInferCorrectionConfig, apply_correction_mask, compute_train_infer_correction, filter_metric_keys,
)
from rollstream.trainer.grpo import PolicyLossConfig, train_step
from rollstream.trainer.logprobs import response_log_probs

log = logging.getLogger(__name__)

FINAL_MASK_KEY = "actor/train_infer_final_mask_mean"


@dataclass(frozen=True)
class TrainSettings:
    """How the policy is optimised (from the config's ``actor_train``)."""

    lr: float = 1e-6
    micro_batch_size: int = 4
    max_grad_norm: float = 1.0
    loss: PolicyLossConfig = PolicyLossConfig()


class PolicyTrainer:
    """Holds the training model and its optimiser (AdamW); ``train(batch)`` takes one step.

    ``policy_version`` counts the optimiser steps taken (0 = the initial weights), so a batch's
    report says which weights it produced.
    """

    def __init__(self, settings: TrainSettings, correction: TrainInferCorrectionConfig,
                 model: torch.nn.Module | None = None, device: str | None = None) -> None:
        if model is None:
            from rollstream.workers.model import load_model

            _, model = load_model(device=device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = model
        self.model.eval()
        self.settings = settings
        self.correction = correction
        self.filter_keys = filter_metric_keys(correction)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.lr, weight_decay=0.0)
        self.policy_version = 0

    def train(self, batch: RolloutBatch) -> dict:
        """One step on ``batch``. Returns ``loss``, ``skipped``, ``policy_version``,
        ``final_mask_mean``, ``pass_rates`` (metric key -> share of valid tokens kept by that
        filter check), ``mask_collapse``, ``reward_mean``, ``grad_norm``, ``pg_clipfrac``,
        ``train_seconds``."""
        started = time.perf_counter()
        device = next(self.model.parameters()).device
        old = response_log_probs(self.model, batch, micro_batch_size=self.settings.micro_batch_size)
        mask = batch.response_mask.to(device)
        weight, filter_mask, metrics = compute_train_infer_correction(
            old, batch.infer_logprobs.to(device), mask, self.correction)
        final = apply_correction_mask(mask, filter_mask)
        report = train_step(
            self.model, self.optimizer, batch, old, final, self.settings.loss,
            is_weight=weight if self.correction.is_weight.enabled else None,
            micro_batch_size=self.settings.micro_batch_size, max_grad_norm=self.settings.max_grad_norm)
        if report.skipped:
            log.warning("step %d skipped: the correction masked every token", batch.step)
        else:
            self.policy_version += 1
        pass_rates = {key: round(metrics[key], 6) for keys in self.filter_keys
                      for check, key in keys.items() if check != "index"}
        return {
            "loss": round(report.loss, 6),
            "skipped": report.skipped,
            "policy_version": self.policy_version,
            "final_mask_mean": round(metrics.get(FINAL_MASK_KEY, 1.0), 6),
            "pass_rates": pass_rates,
            "mask_collapse": bool(metrics.get("actor/train_infer_mask_collapse", 0.0)),
            "reward_mean": round(float(batch.response_level_rewards.mean()), 6),
            "grad_norm": round(report.grad_norm, 6),
            "pg_clipfrac": round(report.metrics.get("pg_clipfrac", 0.0), 6),
            "train_seconds": round(time.perf_counter() - started, 2),
        }
