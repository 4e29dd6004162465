"""old_log_probs from the training model, aligned with what the inference engine reported:
the same fp32 weights must give the same per-token log-probabilities (up to float noise) for
RLVR responses and for multi-turn trajectories, whatever the padding."""

from __future__ import annotations

import json

import pytest
import torch

from rollstream.policy.model import chat_prompt_ids
from rollstream.trainer.batch import build_batch
from rollstream.trainer.logprobs import response_log_probs, sequence_log_probs
from rollstream.inference.engine import SamplingParams
from rollstream.inference.transformers_engine import TransformersBackend
from rollstream.workers.episodes import EpisodePlayer

from . import records

TOL = 2e-3  # same weights, different batch shapes: float32 reduction-order noise only


@pytest.fixture(scope="module")
def backend() -> TransformersBackend:
    return TransformersBackend(max_num_seqs=8)


def rlvr_group(key: str, prompt_ids: list[int], samples) -> dict:
    return records.rlvr_group(key, [
        records.rewarded(records.response_payload(key, i, prompt_ids, s.token_ids, s.logprobs), float(i % 2))
        for i, s in enumerate(samples)])


def test_rlvr_rows_match_the_engine_logprobs(backend):
    prompts = [chat_prompt_ids(backend.tokenizer, "What is 2 + 3?"),
               chat_prompt_ids(backend.tokenizer, "Name a colour that is often used for the sky on a clear day.")]
    params = [SamplingParams(temperature=1.0, max_new_tokens=12, seed=s) for s in (1, 2)]
    samples = backend.generate(prompts, [2, 2], params)
    batch = build_batch([rlvr_group("a", prompts[0], samples[0]), rlvr_group("b", prompts[1], samples[1])],
                        step=0, pad_token_id=backend.pad_id)
    old = response_log_probs(backend.model, batch, micro_batch_size=3)
    assert old.shape == batch.infer_logprobs.shape and old.dtype == torch.float32
    valid = batch.response_mask > 0
    assert valid.sum() > 10
    assert (old[valid] - batch.infer_logprobs[valid]).abs().max().item() < TOL
    assert torch.all(old[~valid] == 0)  # padding stays 0, never -inf or NaN


def test_one_sample_unpadded_matches_the_engine_and_bad_input_is_refused(backend):
    prompt = chat_prompt_ids(backend.tokenizer, "What is 2 + 3?")
    [[sample]] = backend.generate([prompt], [1], [SamplingParams(temperature=1.0, max_new_tokens=12, seed=3)])
    got = sequence_log_probs(backend.model, prompt, sample.token_ids)
    assert len(got) == len(sample.token_ids)
    assert max(abs(a - b) for a, b in zip(got, sample.logprobs)) < TOL
    with pytest.raises(ValueError, match="non-empty"):
        sequence_log_probs(backend.model, prompt, [])


def test_padding_does_not_change_a_rows_logprobs(backend):
    prompt = chat_prompt_ids(backend.tokenizer, "Say hi.")
    long_prompt = chat_prompt_ids(backend.tokenizer, "Write one long sentence about frozen lakes, holes and goals.")
    (short,), (long,) = backend.generate([prompt, long_prompt], [1, 1],
                                         [SamplingParams(temperature=1.0, max_new_tokens=6, seed=3),
                                          SamplingParams(temperature=1.0, max_new_tokens=16, seed=4)])
    alone = build_batch([rlvr_group("s", prompt, [short])], step=0, pad_token_id=backend.pad_id)
    padded = build_batch([rlvr_group("s", prompt, [short]), rlvr_group("l", long_prompt, [long])],
                         step=0, pad_token_id=backend.pad_id)
    n = len(short.token_ids)
    a = response_log_probs(backend.model, alone)[0, :n]
    b = response_log_probs(backend.model, padded)[0, :n]
    assert (a - b).abs().max().item() < TOL


def test_multi_turn_trajectory_rows_match_at_model_tokens(backend):
    """Environment tokens sit between the model's turns; the model tokens' log-probs still match
    the engine's, so the flattened layout and the response mask line up."""
    player = EpisodePlayer(backend, temperature=1.0, top_p=1.0, worker="test")
    request = {"mode": "train", "group_id": 0, "episode_id": 0, "traj_index": 0, "tag": "lake",
               "env_type": "frozen_lake", "env_config": json.dumps({"is_slippery": False}), "seed": 5,
               "max_actions_per_traj": 3, "max_tokens_per_step": 8, "env_step_timeout_s": 30.0,
               "format_penalty": -0.1, "cause": "start", "created_ms": 0}
    trajectories = player.play([request, {**request, "traj_index": 1}], timeout_s=300)
    assert all(len(t["turns"]) >= 2 for t in trajectories)  # 8 tokens rarely end a FrozenLake game in one move
    group = records.traj_group("train/0/0", [records.member(t) for t in trajectories])
    batch = build_batch([group], step=0, pad_token_id=backend.pad_id)
    old = response_log_probs(backend.model, batch)
    model_tokens = batch.response_mask > 0
    env_tokens = (batch.response_attention_mask > 0) & ~model_tokens
    assert env_tokens.sum() > 0
    assert (old[model_tokens] - batch.infer_logprobs[model_tokens]).abs().max().item() < TOL
