"""The episode core (EpisodePlayer) with the real SmolLM2 backend on CPU, no broker: token
layout, reward accounting, environment failures and timeouts."""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace

import numpy as np
import pytest

from rollstream.policy.model import chat_prompt_ids
from rollstream.schemas import decode, encode
from rollstream.schemas.packed import unpack_array
from rollstream.inference.engine import Sample, SamplingParams
from rollstream.inference.transformers_engine import TransformersBackend
from rollstream.schemas.records import FINISH_ERROR
from rollstream.workers.envs import GymFrozenLake
from rollstream.workers.episodes import (
    EpisodePlayer,
    identity_of,
    turn_seed,
)

from .fault_envs import SlowEnv

MAX_NEW = 8
FAULT = "tests.workers.fault_envs"


class RecordingBackend:
    """Delegates to the real backend and records each generate call's batch size."""

    def __init__(self, inner: TransformersBackend) -> None:
        self.inner = inner
        self.tokenizer = inner.tokenizer
        self.batches: list[int] = []

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def generate(self, prompt_token_ids, n, params):
        self.batches.append(len(prompt_token_ids))
        return self.inner.generate(prompt_token_ids, n, params)

    def load_weights(self, path, version):
        self.inner.load_weights(path, version)


class ExtrasBackend(RecordingBackend):
    """Adds a per-token ``routed_experts`` extra (uint8, (tokens, 2, 2), never 0) to every sample,
    as an MoE engine would; ``first_dim`` overrides its first dimension (a broken engine).
    Records the arrays it handed out, in order."""

    def __init__(self, inner: TransformersBackend, first_dim: int | None = None) -> None:
        super().__init__(inner)
        self.first_dim = first_dim
        self.handed: list[np.ndarray] = []

    def generate(self, prompt_token_ids, n, params):
        out = []
        for samples in super().generate(prompt_token_ids, n, params):
            with_extras = []
            for sample in samples:
                rows = len(sample.token_ids) if self.first_dim is None else self.first_dim
                experts = (np.arange(rows * 4, dtype=np.uint8).reshape(rows, 2, 2) % 250) + 1 + len(self.handed)
                self.handed.append(experts)
                with_extras.append(replace(sample, extras={"routed_experts": experts}))
            out.append(with_extras)
        return out


class ErrorBackend:
    """An engine that fails every request (finish_reason "error"), as the protocol reports it."""

    policy_version = 3

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def generate(self, prompt_token_ids, n, params):
        return [[Sample([], [], "", FINISH_ERROR, "CUDA out of memory (simulated)")] * k for k in n]

    def load_weights(self, path, version):
        raise NotImplementedError


@pytest.fixture(scope="module")
def backend() -> TransformersBackend:
    return TransformersBackend(max_num_seqs=16)


@pytest.fixture
def recording(backend) -> RecordingBackend:
    return RecordingBackend(backend)


def request(traj_index: int = 0, env_type: str = "frozen_lake", env_config: dict | str | None = None,
            **overrides) -> dict:
    config = {"is_slippery": False} if env_config is None else env_config
    rec = {
        "mode": "train", "group_id": 4, "episode_id": 1, "traj_index": traj_index, "tag": "lake",
        "env_type": env_type, "env_config": config if isinstance(config, str) else json.dumps(config),
        "seed": 123, "max_actions_per_traj": 2, "max_tokens_per_step": MAX_NEW,
        "env_step_timeout_s": 10.0, "format_penalty": -0.1, "cause": "start", "created_ms": 0,
    }
    rec.update(overrides)
    return rec


def player(backend, **kwargs) -> EpisodePlayer:
    kwargs.setdefault("temperature", 1.0)
    kwargs.setdefault("top_p", 1.0)
    return EpisodePlayer(backend, worker="test-worker", **kwargs)


def check_layout(traj: dict, tokenizer, max_new: int = MAX_NEW) -> None:
    """The trajectory.avsc token layout and bookkeeping invariants."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turns = traj["turns"]
    resp_total = sum(len(t["response_token_ids"]) for t in turns)
    later_prompts = sum(len(t["prompt_token_ids"]) for t in turns[1:])
    assert len(traj["response_mask"]) == resp_total + later_prompts
    assert sum(traj["response_mask"]) == resp_total
    flat_mask = []
    for k, t in enumerate(turns):
        if k:
            flat_mask += [0] * len(t["prompt_token_ids"])
        flat_mask += [1] * len(t["response_token_ids"])
    assert traj["response_mask"] == flat_mask
    for k, t in enumerate(turns):
        resp = t["response_token_ids"]
        assert 1 <= len(resp) <= max_new
        assert len(t["infer_logprobs"]) == len(resp)
        assert all(math.isfinite(x) and x <= 0.0 for x in t["infer_logprobs"])
        assert (t["finish_reason"] == "stop") == (resp[-1] == im_end)
        assert t["finish_reason"] in ("stop", "length")
        if k:
            prompt = t["prompt_token_ids"]
            # a non-model im_end opens the prompt exactly when the previous turn lacked one
            ended = turns[k - 1]["response_token_ids"][-1] == im_end
            assert (prompt[0] == im_end) == (not ended)
            text = tokenizer.decode(prompt[0 if ended else 1:])
            assert text.startswith("\n<|im_start|>user\n")
            assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert traj["step_rewards"] == [t["step_reward"] for t in turns]
    invalid = sum(t["invalid_move"] for t in turns)
    penalty = -0.1
    assert traj["response_level_rewards"] == pytest.approx(sum(traj["step_rewards"]) + penalty * invalid)
    assert traj["started_ms"] <= traj["finished_ms"]
    assert traj["worker"] == "test-worker"
    # the record fits the schema; its arrays come back packed, with the same values
    _, back = decode(encode(traj, "Trajectory"))
    assert back["response_mask"].dtype == np.uint8 and back["response_mask"].tolist() == traj["response_mask"]
    for got, want in zip(back["turns"], turns):
        assert got["prompt_token_ids"].tolist() == want["prompt_token_ids"]
        assert got["response_token_ids"].tolist() == want["response_token_ids"]
        assert got["infer_logprobs"].tolist() == pytest.approx(want["infer_logprobs"], abs=1e-6)  # float32
    assert set(back["extras"]) == set(traj["extras"])


def test_frozenlake_trajectories_follow_the_token_layout(recording):
    tok = recording.tokenizer
    p = player(recording)
    trajs = p.play([request(0), request(1), request(2, "sokoban", {})], timeout_s=300)
    assert [identity_of(t) for t in trajs] == [("train", 4, 1, 0), ("train", 4, 1, 1), ("train", 4, 1, 2)]
    first_obs = GymFrozenLake(is_slippery=False).reset(123)
    for traj in trajs:
        check_layout(traj, tok)
        assert traj["stop_reason"] in ("done", "max_actions")
        assert 1 <= len(traj["turns"]) <= 2
        assert (traj["env_timeout"], traj["env_failed"], traj["drop_flag"], traj["error"]) == (False, False, False, None)
        assert (traj["tag"], traj["seed"], traj["policy_version"]) == ("lake", 123, 0)
    for traj in trajs[:2]:
        assert traj["turns"][0]["prompt_token_ids"] == chat_prompt_ids(tok, first_obs)
        assert traj["env_type"] == "frozen_lake"
    # the two lake runs' first turns shared one backend call (Sokoban builds its room slower
    # than the gather window, so it may join later); every turn was generated exactly once
    assert recording.batches[0] >= 2
    assert sum(recording.batches) == sum(len(t["turns"]) for t in trajs)
    assert p.active == 0


def test_same_seed_gives_the_same_trajectory(backend):
    first = player(backend).play([request(0)])[0]
    again = player(backend).play([request(0)])[0]
    other = player(backend).play([request(5)])[0]

    def tokens(t):
        return [(x["prompt_token_ids"], x["response_token_ids"], x["action"], x["step_reward"]) for x in t["turns"]]

    assert tokens(first) == tokens(again)
    for a, b in zip(first["turns"], again["turns"]):
        assert a["infer_logprobs"] == pytest.approx(b["infer_logprobs"], abs=1e-4)
    assert first["response_level_rewards"] == again["response_level_rewards"]
    assert first["stop_reason"] == again["stop_reason"]
    # another run of the episode: same first prompt, other sampling seed
    assert turn_seed(123, 0, 0) != turn_seed(123, 5, 0)
    assert other["turns"][0]["prompt_token_ids"] == first["turns"][0]["prompt_token_ids"]
    assert other["turns"][0]["response_token_ids"] != first["turns"][0]["response_token_ids"]


def test_observation_ids_match_the_chat_template(backend):
    tok = backend.tokenizer
    p = player(backend)
    answer = tok("[down]<|im_end|>", add_special_tokens=False)["input_ids"]
    built = chat_prompt_ids(tok, "first") + answer + p.observation_ids("second")
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "first"}, {"role": "assistant", "content": "[down]"},
         {"role": "user", "content": "second"}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert built == [int(i) for i in ids]


@pytest.mark.parametrize("fail_on, turns", [("reset", 0), ("step", 1)])
def test_env_exception_ends_the_trajectory_as_env_failed(backend, fail_on, turns):
    [traj] = player(backend).play([request(0, f"{FAULT}:FailingEnv", {"fail_on": fail_on})])
    assert traj["stop_reason"] == "env_failed"
    assert (traj["env_failed"], traj["drop_flag"], traj["env_timeout"], traj["success"]) == (True, True, False, False)
    assert traj["error"] == f"env {fail_on}: RuntimeError: {fail_on} exploded on purpose"
    assert len(traj["turns"]) == turns
    check_layout(traj, backend.tokenizer)


def test_bad_env_type_or_config_is_env_failed_not_a_crash(backend):
    p = player(backend)
    trajs = p.play([
        request(0, "gym:NoSuchGame-v0", {}),
        request(1, env_config="{not json"),
        request(2, env_config={"no_such_arg": 1}),
    ])
    assert [t["stop_reason"] for t in trajs] == ["env_failed"] * 3
    assert trajs[0]["error"].startswith("env make: ConfigError: cannot import env_type 'gym:NoSuchGame-v0'")
    assert trajs[1]["error"].startswith("env make: JSONDecodeError")
    assert trajs[2]["error"].startswith("env make: TypeError")
    assert all(t["turns"] == [] and t["response_mask"] == [] and t["drop_flag"] for t in trajs)


def test_slow_env_times_out_while_the_other_trajectory_completes(recording):
    SlowEnv.reset_count()
    # generous margins: a loaded 2-core machine must not turn the fast env's steps into timeouts
    slow = {"delay_s": 600.0, "slow_instances": 1, "episode_len": 2, "reward": 0.5}
    reqs = [request(i, f"{FAULT}:SlowEnv", slow, env_step_timeout_s=2.0) for i in (0, 1)]
    started = time.monotonic()
    trajs = player(recording).play(reqs, timeout_s=300)
    took = time.monotonic() - started
    assert took < 300  # nobody waited for the 600 s step
    by_reason = {t["stop_reason"]: t for t in trajs}
    assert sorted(by_reason) == ["done", "env_timeout"]
    stuck, ok = by_reason["env_timeout"], by_reason["done"]
    assert (stuck["env_timeout"], stuck["drop_flag"], stuck["env_failed"]) == (True, True, False)
    assert stuck["error"] == "env step exceeded 2s (still running)"
    assert len(stuck["turns"]) == 1 and stuck["step_rewards"] == [0.0]
    assert (ok["success"], ok["drop_flag"], ok["error"]) == (True, False, None)
    assert ok["step_rewards"] == [0.5, 0.5] and ok["response_level_rewards"] == 1.0
    assert all(t["env_ms"] < 2000 for t in ok["turns"])
    assert recording.batches[0] == 2  # both first turns in one batch
    for t in trajs:
        check_layout(t, recording.tokenizer)


def test_slow_reset_times_out_with_no_turns(backend):
    SlowEnv.reset_count()
    cfg = {"delay_s": 30.0, "slow_instances": 1, "slow_on": "reset"}
    [traj] = player(backend).play([request(0, f"{FAULT}:SlowEnv", cfg, env_step_timeout_s=0.3)], timeout_s=60)
    assert (traj["stop_reason"], traj["env_timeout"], traj["turns"]) == ("env_timeout", True, [])
    assert traj["error"].startswith("env reset exceeded 0.3s")


def test_format_penalty_counts_every_invalid_move(backend):
    [traj] = player(backend).play([
        request(0, f"{FAULT}:RefusingEnv", {"reward": 0.25}, max_actions_per_traj=3, format_penalty=-0.5)])
    assert traj["stop_reason"] == "max_actions"
    assert [t["invalid_move"] for t in traj["turns"]] == [True, True, True]
    assert traj["step_rewards"] == [0.25, 0.25, 0.25]
    assert traj["response_level_rewards"] == pytest.approx(0.75 - 1.5)
    assert traj["success"] is False


def test_context_limit_stops_with_max_length(backend):
    tok = backend.tokenizer
    first = chat_prompt_ids(tok, GymFrozenLake(is_slippery=False).reset(123))
    # room for the first turn, not for a second prompt
    roomy = player(backend, max_context_tokens=len(first) + MAX_NEW + 10)
    [traj] = roomy.play([request(0, max_actions_per_traj=4)])
    assert traj["stop_reason"] == "max_length" and len(traj["turns"]) == 1
    assert traj["drop_flag"] is False
    check_layout(traj, tok)
    tight = player(backend, max_context_tokens=len(first) + MAX_NEW - 1)
    [empty] = tight.play([request(0)])
    assert (empty["stop_reason"], empty["turns"], empty["response_mask"]) == ("max_length", [], [])


def test_engine_error_drops_without_blaming_the_env(backend):
    p = EpisodePlayer(ErrorBackend(backend.tokenizer), worker="w")
    [traj] = p.play([request(0)])
    assert traj["stop_reason"] == "engine_error"
    assert (traj["drop_flag"], traj["env_failed"], traj["env_timeout"]) == (True, False, False)
    assert traj["error"] == "engine: CUDA out of memory (simulated)"
    assert traj["turns"] == [] and traj["policy_version"] == 3


def test_duplicate_identity_is_not_played_twice(backend):
    p = player(backend, max_concurrent=2)
    assert p.submit(request(0), tag="a") is True
    assert p.submit(request(0), tag="b") is False
    assert p.submit(request(1), tag="c") is True
    with pytest.raises(RuntimeError, match="slots are busy"):
        p.submit(request(2))
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        p.submit(request(3, max_tokens_per_step=0))
    assert sorted(p.abandon_all()) == ["a", "c"] and p.active == 0


def test_sampling_seed_is_stable_and_spread():
    assert turn_seed(123, 0, 0) == 6899103541895384515  # sha256 of "123/0/0": the same in every process
    seeds = {turn_seed(s, i, k) for s in (1, 2) for i in range(4) for k in range(3)}
    assert len(seeds) == 24 and all(0 <= x < 2**63 for x in seeds)
    SamplingParams(seed=turn_seed(2**40, 7, 9))  # a valid SamplingParams seed


def test_engine_extras_travel_over_the_flattened_response(backend):
    """Per-token extras of every turn's sample (routed_experts) become one PackedArray over the
    flattened response: each turn's values at its model tokens, zeros at environment tokens."""
    engine = ExtrasBackend(backend)
    [traj] = player(engine).play([request(0, f"{FAULT}:RefusingEnv", {}, max_actions_per_traj=3)])
    assert traj["stop_reason"] == "max_actions" and len(traj["turns"]) == 3
    check_layout(traj, backend.tokenizer)
    experts = unpack_array(decode(encode(traj, "Trajectory"))[1]["extras"]["routed_experts"])
    mask = np.asarray(traj["response_mask"])
    assert experts.dtype == np.uint8 and experts.shape == (len(mask), 2, 2)
    assert (experts[mask == 0] == 0).all() and (experts[mask == 1] > 0).all()
    assert experts[mask == 1].tolist() == np.concatenate(engine.handed).tolist()


def test_engine_extras_that_do_not_fit_the_tokens_end_the_run_as_engine_error(backend):
    [traj] = player(ExtrasBackend(backend, first_dim=99)).play([request(0)])
    assert (traj["stop_reason"], traj["drop_flag"], traj["env_failed"], traj["turns"]) == (
        "engine_error", True, False, [])
    assert traj["error"].startswith("engine: extras: extras['routed_experts'] has shape (99, 2, 2)")
    assert traj["extras"] == {}
