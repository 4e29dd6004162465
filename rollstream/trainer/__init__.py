"""Trainer side: batches of accepted groups, advantages, and the policy step.

Pure torch (no Kafka): ``batch`` (``build_batch``: decoded groups -> padded ``RolloutBatch`` with
GRPO advantages), ``logprobs`` (old_log_probs under the training model), ``corrections`` (the
train-inference correction masks), ``grpo`` (clipped policy loss and step), ``policy`` (one step
per batch, tying them together). ``consumer`` is the thin Kafka shell: ``BatchBuilder`` consumes
``groups.accepted`` and commits offsets only after the caller confirms a batch was trained.
"""

from rollstream.trainer.batch import RolloutBatch, build_batch, check_group, grpo_advantages

__all__ = ["RolloutBatch", "build_batch", "check_group", "grpo_advantages"]
