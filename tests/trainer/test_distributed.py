"""Sharding a batch over data-parallel ranks: whole groups, even sizes, empty shards; and two gloo
ranks (spawned processes) training on the shards of one batch."""

from __future__ import annotations

import pytest
import torch

from rollstream.trainer.batch import build_batch
from rollstream.trainer.corrections import TrainInferCorrectionConfig
from rollstream.trainer.distributed import Ranks, group_shard, shard_batch, shard_ranges
from rollstream.trainer.policy_trainer import PolicyTrainer, TrainSettings

from . import records
from tests.tiny_models import tiny_model

SETTINGS = TrainSettings(lr=1e-2, micro_batch_size=2, max_grad_norm=None)


@pytest.mark.parametrize("groups, world, expected", [
    (4, 2, [(0, 2), (2, 4)]),
    (5, 2, [(0, 3), (3, 5)]),
    (5, 3, [(0, 2), (2, 4), (4, 5)]),
    (1, 3, [(0, 1), (1, 1), (1, 1)]),
    (0, 2, [(0, 0), (0, 0)]),
])
def test_shard_ranges_are_contiguous_and_even(groups, world, expected):
    assert shard_ranges(groups, world) == expected


def test_shard_ranges_refuse_nonsense():
    with pytest.raises(ValueError, match="world_size >= 1, got 3, 0"):
        shard_ranges(3, 0)


def batch_of(sizes: list[int]):
    """A batch of groups g0, g1, ... with ``sizes[g]`` responses; response i of group g has the
    single token 10 * g + i and reward i % 2."""
    groups = []
    for g, n in enumerate(sizes):
        responses = [records.rewarded(records.response_payload(f"g{g}", i, [1], [10 * g + i], [-0.5], version=g),
                                      float(i % 2)) for i in range(n)]
        groups.append(records.rlvr_group(f"g{g}", responses))
    return build_batch(groups, step=4, pad_token_id=0)


def test_shards_hold_whole_groups_and_every_row_once():
    batch = batch_of([2, 3, 1])
    first, second = shard_batch(batch, 2)  # groups 0, 1 | 2
    assert (first.group_keys, second.group_keys) == (["g0", "g1"], ["g2"])
    assert first.response_ids[:, 0].tolist() == [0, 1, 10, 11, 12]
    assert second.response_ids[:, 0].tolist() == [20]
    assert (first.group_index.tolist(), second.group_index.tolist()) == ([0, 0, 1, 1, 1], [0])
    assert second.policy_versions == [2] and second.sample_index == [0] and second.prompt_ids_str == ["g2"]
    assert (first.step, second.step) == (4, 4)
    for name in ("prompt_ids", "response_ids", "response_mask", "advantages", "infer_logprobs"):
        torch.testing.assert_close(torch.cat([getattr(first, name), getattr(second, name)]), getattr(batch, name))


def test_a_rank_without_groups_gets_an_empty_shard_of_the_same_widths():
    batch = batch_of([2])
    full, empty = shard_batch(batch, 2)
    assert full.batch_size == 2 and full.group_keys == ["g0"]
    assert empty.batch_size == 0 and empty.group_keys == [] and empty.prompt_ids_str == []
    assert tuple(empty.response_ids.shape) == (0, batch.response_ids.shape[1])
    assert tuple(empty.prompt_ids.shape) == (0, batch.prompt_ids.shape[1])
    with pytest.raises(ValueError, match="not inside"):
        group_shard(batch, 0, 2)


def test_a_single_process_is_rank_0_of_1_and_its_collectives_are_identities():
    ranks = Ranks.current()
    assert (ranks.rank, ranks.world_size, ranks.is_main, ranks.distributed) == (0, 1, True, False)
    assert ranks.sum([1.5, 2]) == [1.5, 2.0]
    assert ranks.scatter(["mine"]) == "mine" and ranks.broadcast({"a": 1}) == {"a": 1}


def _train_rank(rank: int, init_file: str, out: str) -> None:
    """One of two gloo ranks training on its shard of a one-group batch (rank 1's is empty)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        batch = batch_of([3])
        trainer = PolicyTrainer(SETTINGS, TrainInferCorrectionConfig(), model=tiny_model(seed=0))
        report = trainer.train(shard_batch(batch, 2)[rank], group_keys=batch.group_keys,
                               policy_versions=batch.policy_versions)
        torch.save({"report": report, "grads": {n: p.grad for n, p in trainer.model.named_parameters()}},
                   f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_rank_with_an_empty_shard_joins_the_step_and_the_gradient_is_the_whole_batch(tmp_path):
    torch.multiprocessing.spawn(_train_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    single = PolicyTrainer(SETTINGS, TrainInferCorrectionConfig(), model=tiny_model(seed=0))
    expected = single.train(batch_of([3]))
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        report = saved["report"]
        assert (report["tokens_valid"], report["skipped"], report["policy_version"]) == (3, False, 1)
        assert report["loss"] == pytest.approx(expected["loss"], abs=1e-6)
        assert report["reward_mean"] == pytest.approx(expected["reward_mean"])
        for name, param in single.model.named_parameters():
            torch.testing.assert_close(saved["grads"][name], param.grad, rtol=1e-5, atol=1e-7)
