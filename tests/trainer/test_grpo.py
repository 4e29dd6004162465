"""The GRPO loss and step: hand-computed values, the normaliser taken after the final mask,
skipped empty steps, and a real optimiser step that moves the model the right way."""

from __future__ import annotations

import math

import pytest
import torch

from rollstream.policy.model import chat_prompt_ids, load_model
from rollstream.trainer.batch import build_batch
from rollstream.trainer.grpo import PolicyLossConfig, policy_loss, train_step
from rollstream.trainer.logprobs import response_log_probs
from rollstream.inference.engine import SamplingParams

from . import records


def tensors(ratios, advantages, mask):
    old = torch.zeros(1, len(ratios))
    new = torch.log(torch.tensor([ratios])).requires_grad_(True)
    return new, old, torch.tensor([advantages]), torch.tensor([mask], dtype=torch.float32)


def test_clipped_surrogate_by_hand():
    """ratios [1, 1.5, 0.5], A [1, 1, -1], clip 0.2: per-token losses -1, -1.2 (clipped), 0.8
    (clipped): token-mean -1.4/3; the clipped tokens get no gradient."""
    new, old, adv, mask = tensors([1.0, 1.5, 0.5], [1.0, 1.0, -1.0], [1, 1, 1])
    loss, metrics = policy_loss(new, old, adv, mask)
    assert loss.item() == pytest.approx(-1.4 / 3, abs=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 3)
    assert metrics["valid_tokens"] == 3
    loss.backward()
    assert new.grad[0].tolist() == pytest.approx([-1 / 3, 0.0, 0.0], abs=1e-6)


def test_normaliser_is_taken_after_the_final_mask():
    new, old, adv, _ = tensors([1.0, 1.5, 0.5], [1.0, 1.0, -1.0], [1, 1, 1])
    loss, _ = policy_loss(new, old, adv, torch.tensor([[1.0, 1.0, 0.0]]))
    assert loss.item() == pytest.approx((-1.0 - 1.2) / 2, abs=1e-6)  # not / 3


def test_is_weight_multiplies_and_is_detached():
    new, old, adv, mask = tensors([1.0, 1.5, 0.5], [1.0, 1.0, -1.0], [1, 1, 1])
    weight = torch.tensor([[2.0, 1.0, 1.0]], requires_grad=True)
    loss, _ = policy_loss(new, old, adv, mask, is_weight=weight)
    assert loss.item() == pytest.approx((-2.0 - 1.2 + 0.8) / 3, abs=1e-6)
    loss.backward()
    assert weight.grad is None


def test_seq_mean_token_mean_averages_rows_with_tokens():
    new = torch.zeros(3, 2, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [2.0, 0.0], [5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])  # row 3 has nothing to train
    loss, _ = policy_loss(new, torch.zeros(3, 2), adv, mask, PolicyLossConfig(loss_agg_mode="seq-mean-token-mean"))
    assert loss.item() == pytest.approx((-1.0 + -2.0) / 2)


def test_non_finite_values_at_masked_positions_never_reach_the_loss():
    new = torch.tensor([[-0.5, float("-inf")]], requires_grad=True)
    old = torch.tensor([[-0.5, float("nan")]])
    loss, metrics = policy_loss(new, old, torch.tensor([[1.0, float("inf")]]), torch.tensor([[1.0, 0.0]]))
    assert loss.item() == pytest.approx(-1.0) and math.isfinite(metrics["approx_kl"])
    loss.backward()
    assert torch.isfinite(new.grad).all()


def test_bad_config_and_shapes_raise():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        PolicyLossConfig(loss_agg_mode="sum")
    with pytest.raises(ValueError, match="pg_clip_low must be < 1"):
        PolicyLossConfig(pg_clip_low=1.0)
    with pytest.raises(ValueError, match="one shape"):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 2))


@pytest.fixture(scope="module")
def model_and_batch():
    tokenizer, model = load_model()
    from rollstream.inference.transformers_engine import TransformersBackend

    backend = TransformersBackend()
    prompt = chat_prompt_ids(tokenizer, "Pick a number from 1 to 9.")
    (samples,) = backend.generate([prompt], [2], [SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)])
    group = records.rlvr_group("p", [
        records.rewarded(records.response_payload("p", i, prompt, s.token_ids, s.logprobs), float(i == 0))
        for i, s in enumerate(samples)])
    return model, build_batch([group], step=0, pad_token_id=tokenizer.pad_token_id)


def test_a_real_step_raises_the_rewarded_response_and_lowers_the_other(model_and_batch):
    model, batch = model_and_batch
    old = response_log_probs(model, batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    report = train_step(model, optimizer, batch, old, batch.response_mask, micro_batch_size=1)
    assert not report.skipped and report.metrics["valid_tokens"] == batch.response_mask.sum().item()
    assert math.isfinite(report.loss) and report.grad_norm > 0
    new = response_log_probs(model, batch)
    delta = ((new - old) * batch.response_mask).sum(dim=1)
    assert delta[0] > 0 > delta[1]  # advantage +1 for sample 0, -1 for sample 1


def test_a_fully_masked_step_is_skipped(model_and_batch):
    model, batch = model_and_batch
    before = [p.detach().clone() for p in list(model.parameters())[:3]]
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    report = train_step(model, optimizer, batch, torch.zeros_like(batch.response_mask),
                        torch.zeros_like(batch.response_mask))
    assert report.skipped and report.metrics["valid_tokens"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, list(model.parameters())[:3]))
