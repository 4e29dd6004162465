"""Trainer side: batches of accepted groups, advantages, and the policy step.

Your own training loop: ``RolloutStream`` (rollstream.trainer.rollout_stream), an iterator of padded batches
as torch tensors with exactly-once commits, policy-version publishing and data-parallel shards.

Pure torch (no Kafka): ``batch`` (``build_batch``: decoded groups whose payloads are resolved ->
padded ``RolloutBatch`` with per-token advantages, ``group_advantages`` by ``adv_estimator``,
and per-token extras), ``logprobs`` (old_log_probs under the training model), ``corrections``
(the train-inference correction masks), ``grpo`` (clipped policy loss and step), ``policy`` (one
step per batch, tying them together), ``checkpoint`` (durable policy versions), ``distributed``
(data-parallel ranks: shards, summed gradients).

The Kafka side: ``batch_builder`` (``BatchBuilder`` consumes ``groups.accepted``, fetches the payloads
of the groups it batches by reference, and commits offsets only after the caller confirms a batch
was trained; what enters its buffer is checked, and fetched payloads decoded, in ``intake``;
committed batches are recorded in ``manifest``), ``verdicts`` (underfilled steps and the end of
data, read from their event topics), ``loop`` (the one batch loop and its verdict handling),
``rollout_stream`` (``RolloutStream`` over it) and ``driver`` (rollstream's own trainer on the stream, for
`rollstream run` and `rollstream worker trainer`).
"""

from rollstream.trainer.batch import (
    ADV_ESTIMATORS,
    RolloutBatch,
    build_batch,
    check_group,
    check_payloads,
    group_advantages,
    grpo_advantages,
)

__all__ = ["ADV_ESTIMATORS", "RolloutBatch", "RolloutStream", "StreamBatch", "StreamSettings", "build_batch",
           "check_group", "check_payloads", "group_advantages", "grpo_advantages"]


def __getattr__(name: str):
    # The stream needs Kafka clients; importing them only when asked keeps ``rollstream.trainer.batch``
    # and the other pure modules free of them.
    if name in ("RolloutStream", "StreamBatch", "StreamSettings"):
        from rollstream.trainer import rollout_stream

        return getattr(rollout_stream, name)
    raise AttributeError(f"module 'rollstream.trainer' has no attribute {name!r}")
