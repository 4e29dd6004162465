"""Trainer side: batches of accepted groups, advantages, and the policy step.

Pure torch (no Kafka): ``batch`` (``build_batch``: decoded groups whose payloads are resolved ->
padded ``RolloutBatch`` with GRPO advantages and per-token extras), ``logprobs`` (old_log_probs
under the training model), ``corrections`` (the train-inference correction masks), ``grpo``
(clipped policy loss and step), ``policy`` (one step per batch, tying them together),
``checkpoint`` (durable policy versions).

The Kafka side: ``consumer`` (``BatchBuilder`` consumes ``groups.accepted``, fetches the payloads
of the groups it batches by reference, and commits offsets only after the caller confirms a batch
was trained; what enters its buffer is checked, and fetched payloads decoded, in ``intake``;
committed batches are recorded in ``manifest``), ``verdicts`` (underfilled steps, read from their
event topics) and ``driver`` (the one trainer loop of `rollstream run` and
`rollstream worker trainer`).
"""

from rollstream.trainer.batch import RolloutBatch, build_batch, check_group, check_payloads, grpo_advantages

__all__ = ["RolloutBatch", "build_batch", "check_group", "check_payloads", "grpo_advantages"]
