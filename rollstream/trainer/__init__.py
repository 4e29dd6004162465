"""Trainer side: batches of accepted groups, advantages, and (later) the policy step.

``batch`` is pure torch (no Kafka): ``build_batch`` turns decoded ``Group`` records into a padded
``RolloutBatch`` and ``grpo_advantages`` computes group-normalised advantages. ``consumer`` is the
thin Kafka shell: ``BatchBuilder`` consumes ``groups.accepted`` and commits offsets only after the
caller confirms a batch was trained.
"""

from rollstream.trainer.batch import RolloutBatch, build_batch, check_group, grpo_advantages

__all__ = ["RolloutBatch", "build_batch", "check_group", "grpo_advantages"]
