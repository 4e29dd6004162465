"""TrainSettings.from_config: the trainer builds its settings from the config's actor_train."""

from __future__ import annotations

import pytest

from rollstream.config import ActorTrainConfig
from rollstream.trainer.grpo import PolicyLossConfig
from rollstream.trainer.policy_trainer import TrainSettings


def test_defaults_match_the_trainer_defaults():
    assert TrainSettings.from_config(ActorTrainConfig()) == TrainSettings()


def test_every_figure_is_taken_from_actor_train():
    cfg = ActorTrainConfig(lr=3e-5, micro_batch_size=2, max_grad_norm=0.5, pg_clip_low=0.1, pg_clip_high=0.3,
                           loss_agg_mode="seq-mean-token-mean", enabled=False, keep_checkpoints=7)
    assert TrainSettings.from_config(cfg) == TrainSettings(
        lr=3e-5, micro_batch_size=2, max_grad_norm=0.5,
        loss=PolicyLossConfig(pg_clip_low=0.1, pg_clip_high=0.3, loss_agg_mode="seq-mean-token-mean"))


def test_the_config_has_no_settings_method_any_more():
    with pytest.raises(AttributeError, match="settings"):
        ActorTrainConfig().settings()
