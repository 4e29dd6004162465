"""The policy trainer: one GRPO step per rollout batch.

old_log_probs (training model, before the step) -> train-inference correction (masks and IS
weight) -> final mask = response_mask x filter mask -> clipped GRPO
step over the final mask (rollstream.trainer.grpo) -> checkpoint.

The separate old_log_probs pass is skipped when it cannot change anything: the one optimiser
step consumes the batch, no correction filter or IS weight needs the old log-probs before the
step, and the model has no dropout (train and eval forwards agree). Then the training
forward's own log-probs, detached, are the old ones (ratio 1), and the correction's ratio/diff
figures are computed from them after the step (``old_log_probs_pass``: ``fused``; else
``separate``). Which version generated the rows does not matter: old_log_probs are the
trainer's weights before the step either way (a lagged batch's distance to its generator is
the train-inference correction's business, measured against ``infer_logprobs``). On 2 CPU
cores that is one forward of three per step. A step whose final mask is empty is skipped and
reported, never trained on nothing. Returns the figures the manifest and
the run summary report per batch.

Policy version v = the weights after v consumed batches (0 = the initial weights); a skipped
step still makes a version (same weights), so versions and steps stay in lockstep and the
admission's staleness bound never waits for a version that cannot come. With a
CheckpointStore, every version is saved before ``train`` returns, and a new PolicyTrainer
resumes from the newest one (weights, AdamW state, version). ``train(batch, defer_save=True)``
only copies the version off the model (rollstream.trainer.checkpoint.snapshot); ``save_deferred``
then writes the copy on a thread of its own while the caller goes on to the next step, and
returns a Future of the folder (the caller commits the batch once it is durable).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from rollstream.config import ActorTrainConfig, PipelineConfig
from rollstream.policy.model import load_model, resolve_device
from rollstream.runtime import now_ms
from rollstream.trainer.batch import RolloutBatch
from rollstream.trainer.checkpoint import CheckpointStore, CheckpointWriter, Snapshot, snapshot
from rollstream.trainer.corrections import (
    AGG_TYPES,
    METRIC_PREFIX,
    TrainInferCorrectionConfig,
    apply_correction_mask,
    compute_train_infer_correction,
    filter_metric_keys,
)
from rollstream.trainer.distributed import Ranks
from rollstream.trainer.grpo import PolicyLossConfig, train_step
from rollstream.trainer.logprobs import response_log_probs

log = logging.getLogger(__name__)

FINAL_MASK_KEY = f"{METRIC_PREFIX}final_mask_mean"


@dataclass(frozen=True)
class TrainSettings:
    """How the policy is optimised (from the config's ``actor_train``)."""

    lr: float = 1e-6
    micro_batch_size: int = 4
    max_grad_norm: float = 1.0
    loss: PolicyLossConfig = PolicyLossConfig()

    @classmethod
    def from_config(cls, actor_train: ActorTrainConfig) -> "TrainSettings":
        """The settings of the config's ``actor_train`` (the trainer builds them: config never
        imports the trainer)."""
        return cls(lr=actor_train.lr, micro_batch_size=actor_train.micro_batch_size,
                   max_grad_norm=actor_train.max_grad_norm,
                   loss=PolicyLossConfig(actor_train.pg_clip_low, actor_train.pg_clip_high, actor_train.loss_agg_mode))


class PolicyTrainer:
    """Holds the training model and its optimiser (AdamW); ``train(batch)`` takes one step.

    ``policy_version`` counts the batches consumed (see module doc), so a batch's report says
    which weights it produced. ``resumed`` is the trainer state of the checkpoint it resumed
    from (``step``, ``group_keys``, ``report``, ``version``), or None for a fresh start.
    ``ranks`` (default: the default process group's) makes it one of several data-parallel
    replicas (see ``train``); every rank resumes from the same checkpoint.
    """

    def __init__(self, settings: TrainSettings, correction: TrainInferCorrectionConfig,
                 model: torch.nn.Module | None = None, device: str | None = None,
                 checkpoints: CheckpointStore | None = None, tokenizer=None, ranks: Ranks | None = None) -> None:
        if model is None:
            tokenizer, model = load_model(device=resolve_device(device or "auto"))
        self.model = model
        self.model.eval()
        self.ranks = ranks or Ranks.current()
        self.tokenizer = tokenizer
        self.settings = settings
        self.correction = correction
        self.filter_keys = filter_metric_keys(correction)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.lr, weight_decay=0.0)
        self.policy_version = 0
        self.checkpoint = ""  # folder of the current weights ("" = the initial weights)
        self.checkpoints = checkpoints
        self._unsaved: Snapshot | None = None  # copied by train(defer_save=True), not yet written
        self._writer: CheckpointWriter | None = None
        self.resumed: dict | None = None
        latest = checkpoints.latest() if checkpoints is not None else None
        if latest is not None:
            path, _ = latest
            self.resumed = checkpoints.restore(path, self.model, self.optimizer)
            self.policy_version = int(self.resumed["version"])
            self.checkpoint = str(path)
            log.info("resumed from %s (policy version %d, step %d)", path, self.policy_version,
                     self.resumed["step"])

    def _fusable(self) -> bool:
        """Whether the old_log_probs pass can be the training forward's own (module doc)."""
        correction = self.correction
        needs_old = correction.is_weight.enabled or any(f.enabled for f in correction.filters)
        return not needs_old and not _has_dropout(self.model)

    def _step(self, batch: RolloutBatch, old, final, weight):
        return train_step(self.model, self.optimizer, batch, old, final, self.settings.loss, is_weight=weight,
                          micro_batch_size=self.settings.micro_batch_size, max_grad_norm=self.settings.max_grad_norm,
                          ranks=self.ranks)

    @classmethod
    def from_config(cls, config: PipelineConfig, checkpoints: CheckpointStore | None = None) -> "PolicyTrainer":
        """The trainer of ``config``: its ``actor_train`` settings, the training model
        (``config.train_model_path``; None = the bundled one) in ``actor_train.dtype`` on
        ``actor_train.device``, resuming from the newest checkpoint of ``checkpoints``. Raises
        ConfigError for a missing or incomplete model folder or an unusable device."""
        train = config.actor_train
        tokenizer, model = load_model(dtype=getattr(torch, train.dtype), device=resolve_device(train.device),
                                      model_dir=config.train_model_path)
        return cls(TrainSettings.from_config(train), config.train_infer_correction, model=model,
                   checkpoints=checkpoints, tokenizer=tokenizer)

    def train(self, batch: RolloutBatch, *, group_keys: list[str] | None = None,
              policy_versions: list[int] | None = None, defer_save: bool = False) -> dict:
        """One step on ``batch``, then its checkpoint (when a store is set; with ``defer_save``
        only its copy in memory: write it with ``save_deferred``). Returns ``loss``,
        ``skipped``, ``policy_version``, ``checkpoint``, ``final_mask_mean``, ``pass_rates``
        (metric key -> share of valid tokens kept by that filter check), ``ratio_means`` and
        ``diff_means`` (agg type -> the train/infer ratio or logprob difference averaged over
        valid tokens, seq-mean-token-mean), ``mask_collapse``, ``reward_mean``, ``grad_norm``,
        ``pg_clipfrac``, ``tokens_valid`` / ``tokens_kept`` (response tokens before and after the
        correction masks), ``policy_lag_max`` (the trained version minus the oldest generating
        version in the batch), ``generator_versions`` (the versions that generated the batch),
        ``train_seconds``, ``trained_ms`` (epoch ms when the new weights existed, before any write).

        Data-parallel (``ranks.distributed``; rollstream.trainer.distributed): every rank calls
        this at once with its shard of the step's batch (possibly empty), ``group_keys`` and
        ``policy_versions`` of the whole batch (default: ``batch``'s own); the step equals the
        single-process step on the whole batch, every figure of the report is the whole
        batch's, and rank 0 alone writes the checkpoint."""
        started = time.perf_counter()
        ranks = self.ranks
        group_keys = list(batch.group_keys if group_keys is None else group_keys)
        policy_versions = list(batch.policy_versions if policy_versions is None else policy_versions)
        device = next(self.model.parameters()).device
        mask = batch.response_mask.to(device)
        rewards = batch.response_level_rewards
        valid, valid_rows, reward_sum, rows = ranks.sum(
            [float(mask.sum()), float((mask.sum(dim=1) > 0).sum()), float(rewards.sum()), len(rewards)], device)
        fused = valid > 0 and self._fusable()

        def correction(old):
            return compute_train_infer_correction(old, batch.infer_logprobs.to(device), mask, self.correction,
                                                  global_valid_samples=int(valid_rows), global_valid_tokens=int(valid))

        if fused:  # the mask does not depend on old_log_probs (see _fusable): the step's own are the old ones
            report = self._step(batch, None, mask, None)
            weight, filter_mask, metrics = correction(report.old_log_probs)
            final = mask
        else:
            old = response_log_probs(self.model, batch, micro_batch_size=self.settings.micro_batch_size)
            weight, filter_mask, metrics = correction(old)
            final = apply_correction_mask(mask, filter_mask)
        kept = float(final.sum())
        if ranks.distributed:  # the @sum metrics were divided by the global counts: sum them
            keys = [key for key in metrics if key.endswith("@sum")]
            kept, *values = ranks.sum([kept, *(metrics[key] for key in keys)], device)
            metrics.update(zip(keys, values))
            metrics[FINAL_MASK_KEY] = kept / (valid + 1e-8)
            metrics[f"{METRIC_PREFIX}mask_collapse"] = float(
                (valid - kept) / max(valid, 1.0) > self.correction.mask_collapse_threshold)
        if not fused:
            report = self._step(batch, old, final, weight if self.correction.is_weight.enabled else None)
        if report.skipped:
            log.warning("step %d skipped: the correction masked every token", batch.step)
        lag = self.policy_version - min(policy_versions, default=self.policy_version)
        self.policy_version += 1
        pass_rates = {key: round(metrics[key], 6) for keys in self.filter_keys
                      for check, key in keys.items() if check != "index"}
        out = {
            "loss": round(report.loss, 6),
            "skipped": report.skipped,
            "policy_version": self.policy_version,
            "final_mask_mean": round(metrics.get(FINAL_MASK_KEY, 1.0), 6),
            "pass_rates": pass_rates,
            "ratio_means": {agg: round(metrics[f"{METRIC_PREFIX}ratio_{agg}_mean@sum"], 6) for agg in AGG_TYPES},
            "diff_means": {agg: round(metrics[f"{METRIC_PREFIX}diff_{agg}_mean@sum"], 6) for agg in AGG_TYPES},
            "policy_lag_max": lag,
            "tokens_valid": int(valid),
            "tokens_kept": int(kept),
            "generator_versions": sorted(set(policy_versions)),
            "mask_collapse": bool(metrics.get(f"{METRIC_PREFIX}mask_collapse", 0.0)),
            "reward_mean": round(reward_sum / max(rows, 1.0), 6),
            "grad_norm": round(report.grad_norm, 6),
            "pg_clipfrac": round(report.metrics.get("pg_clipfrac", 0.0), 6),
            "old_log_probs_pass": "fused" if fused else "separate",
        }
        trained_ms = now_ms()
        state = {"step": batch.step, "group_keys": group_keys, "report": out}
        if self.checkpoints is not None and ranks.is_main and defer_save:
            if ranks.distributed:
                raise ValueError("defer_save is for a single training process: under torchrun every rank "
                                 "waits for rank 0's checkpoint")
            self._unsaved = snapshot(self.policy_version, self.model, self.optimizer, state)
            self.checkpoint = str(self.checkpoints.path_of(self.policy_version))
        elif self.checkpoints is not None and ranks.is_main:
            path = self.checkpoints.save(self.policy_version, self.model, self.optimizer, state,
                                         tokenizer=self.tokenizer)
            self.checkpoint = str(path)
        elif self.checkpoints is not None:  # rank 0's folder; the other ranks only name it
            self.checkpoint = str(self.checkpoints.path_of(self.policy_version))
        out["checkpoint"] = self.checkpoint
        out["train_seconds"] = round(time.perf_counter() - started, 2)
        out["trained_ms"] = trained_ms
        return out

    def save_deferred(self) -> Future:
        """Write the version ``train(..., defer_save=True)`` copied, on the writer's thread;
        returns a Future of its folder (``result()`` raises what ``CheckpointStore.save`` does).
        Raises ValueError when no copy waits."""
        if self._unsaved is None or self.checkpoints is None:
            raise ValueError("no deferred checkpoint: call train(batch, defer_save=True) first")
        if self._writer is None:
            self._writer = CheckpointWriter(self.checkpoints)
        snap, self._unsaved = self._unsaved, None
        return self._writer.submit(snap, self.model, self.tokenizer)

    def close(self) -> None:
        """Wait for the checkpoints being written."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _has_dropout(model: torch.nn.Module) -> bool:
    """Whether training-mode forwards of ``model`` are random: a Dropout module with p > 0, or a
    Hugging Face config with a dropout probability > 0 (attention dropout is functional)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    values = config.to_dict() if hasattr(config, "to_dict") else {}
    return any("dropout" in k and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
               for k, v in values.items())
