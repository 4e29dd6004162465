"""One rank of the two-rank data-parallel trainer test (tests/integration/test_own_trainer.py),
started by ``torchrun --standalone --nproc_per_node 2``: rollstream's own PolicyTrainer on a
RolloutStream, as ``rollstream worker trainer`` runs it.

Arguments: bootstrap, topic prefix, run dir, out dir, ``commit``, ``take`` (take the first
batch and leave without committing it) or ``announce_fails`` (commit, with rank 0's announcement
of the step failing after the commit). Writes ``rank<r>.json`` (what this rank received and,
with ``commit``, the manifest entry and report; the steps in its result and the error it raised)
and, with ``commit``, ``grads<r>.pt`` (the gradients of the step, summed over the ranks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from rollstream.trainer.rollout_stream import RolloutStream
from rollstream.trainer.checkpoint import CheckpointStore
from rollstream.trainer.corrections import TrainInferCorrectionConfig
from rollstream.trainer.distributed import process_group_from_env
from rollstream.trainer.policy_trainer import PolicyTrainer, TrainSettings
from rollstream.trainer.publisher import PolicyPublisher
from tests.tiny_models import tiny_model

GROUPS_PER_BATCH = 3
SETTINGS = TrainSettings(lr=1e-2, micro_batch_size=2, max_grad_norm=None)


def fail_announcing(entry: dict) -> None:
    raise OSError("the metrics topic is gone")


def main(bootstrap: str, prefix: str, run_dir: Path, out: Path, mode: str) -> None:
    if mode == "announce_fails":
        PolicyPublisher.publish_step = lambda self, entry: fail_announcing(entry)
    with process_group_from_env("cpu") as ranks:
        trainer = PolicyTrainer(SETTINGS, TrainInferCorrectionConfig(), model=tiny_model(seed=0),
                                checkpoints=CheckpointStore(run_dir / "checkpoints"), ranks=ranks)
        record: dict = {"rank": ranks.rank, "world_size": ranks.world_size}
        with RolloutStream(bootstrap, run_dir, groups_per_batch=GROUPS_PER_BATCH, max_steps=1, topic_prefix=prefix,
                           resume=trainer.resumed, ranks=ranks) as stream:
            record["consumes"] = stream.step is not None
            try:
                for batch in stream:
                    record.update(step=batch.step, group_keys=batch.group_keys,
                                  shard_group_keys=batch.shard_group_keys, response_ids=batch.response_ids.tolist(),
                                  rows=batch.num_rows)
                    if mode == "take":
                        break
                    report = trainer.train(batch.rollout, group_keys=batch.group_keys,
                                           policy_versions=batch.policy_versions)
                    record["entry"] = batch.commit(report=report)
                    torch.save({name: p.grad for name, p in trainer.model.named_parameters()},
                               out / f"grads{ranks.rank}.pt")
            except (OSError, RuntimeError) as exc:
                if mode != "announce_fails":
                    raise
                record["error"] = str(exc)
        record["outcome"] = stream.result.outcome
        last = stream.result.last
        record["result_steps"] = (stream.result.steps, last["step"] if last is not None else None)
        (out / f"rank{ranks.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), sys.argv[5])
