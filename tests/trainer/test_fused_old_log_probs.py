"""The old_log_probs pass is fused into the training forward only when that cannot change the
step (rollstream.trainer.policy_trainer): no correction needing the old log-probs before the step, no
dropout; on-policy or lagged rows alike. Then the step and every figure equal the separate
pass's."""

from __future__ import annotations

import copy

import pytest
import torch

from rollstream.trainer.batch import build_batch
from rollstream.trainer.corrections import TrainInferCorrectionConfig
from rollstream.trainer.policy_trainer import PolicyTrainer, TrainSettings

from . import records
from tests.tiny_models import tiny_model

SETTINGS = TrainSettings(lr=1e-2, micro_batch_size=2, max_grad_norm=None)
FIGURES = ("loss", "grad_norm", "pg_clipfrac", "final_mask_mean", "tokens_valid", "tokens_kept", "reward_mean")


def batch(version: int = 0, groups: int = 2):
    out = []
    for g in range(groups):
        responses = [records.rewarded(records.response_payload(f"g{g}", i, [1, 2], [10 + g, 20 + i, 30], [-0.5, -1.0, -2.0],
                                                               version=version), float(i % 2)) for i in range(4)]
        out.append(records.rlvr_group(f"g{g}", responses))
    return build_batch(out, step=0, pad_token_id=0)


def pair(correction: TrainInferCorrectionConfig = TrainInferCorrectionConfig()):
    model = tiny_model(seed=0)
    return (PolicyTrainer(SETTINGS, correction, model=model),
            PolicyTrainer(SETTINGS, correction, model=copy.deepcopy(model)))


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_the_fused_step_equals_the_separate_pass_on_policy_or_lagged(monkeypatch, lag):
    fused, separate = pair()
    monkeypatch.setattr(separate, "_fusable", lambda: False)
    for trainer in (fused, separate):  # lag versions trained on the same warm-up batch
        for _ in range(lag):
            trainer.train(batch(version=trainer.policy_version))
    a, b = fused.train(batch(version=0)), separate.train(batch(version=0))
    assert a["policy_lag_max"] == b["policy_lag_max"] == lag
    assert (a["old_log_probs_pass"], b["old_log_probs_pass"]) == ("fused", "separate")
    for key in FIGURES:
        assert a[key] == pytest.approx(b[key], abs=1e-5), key
    for agg in a["ratio_means"]:
        assert a["ratio_means"][agg] == pytest.approx(b["ratio_means"][agg], abs=1e-5)
        assert a["diff_means"][agg] == pytest.approx(b["diff_means"][agg], abs=1e-5)
    for (name, p), q in zip(fused.model.named_parameters(), separate.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_the_separate_pass_stays_when_a_correction_or_dropout_needs_it():
    token_filter = TrainInferCorrectionConfig.model_validate(
        {"filters": [{"enabled": True, "agg_type": "token", "ratio_low": 0.5, "ratio_high": 2.0}]})
    filtered = PolicyTrainer(SETTINGS, token_filter, model=tiny_model(seed=0))
    assert filtered.train(batch())["old_log_probs_pass"] == "separate"
    is_weight = TrainInferCorrectionConfig.model_validate({"is_weight": {"enabled": True}})
    assert PolicyTrainer(SETTINGS, is_weight, model=tiny_model(seed=0)).train(batch())["old_log_probs_pass"] \
        == "separate"
    dropout = tiny_model(seed=0)
    dropout.config.attention_dropout = 0.1
    assert PolicyTrainer(SETTINGS, TrainInferCorrectionConfig(), model=dropout).train(batch())["old_log_probs_pass"] \
        == "separate"
