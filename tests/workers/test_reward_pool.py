"""User reward functions by import path: result normalisation, the process pool (timeouts, crashes,
exceptions) and the reward worker's per-response reasons, without a broker."""

from __future__ import annotations

import math

import pytest

from rollstream.config.reward_functions import INFO_KEYS, info_keys
from rollstream.exceptions import ConfigError
from rollstream.filtering import decide_response
from rollstream.filtering.prompt_state import DomainFilters, step
from rollstream.kafka.events import Input
from rollstream.kafka.topics import Topics
from rollstream.observability.metrics import WorkerMetrics
from rollstream.streams.aggregator_processor import count_effects
from rollstream.schemas import decode, encode
from rollstream.tools.stats import figures, latest
from rollstream.tools.summary import reward_failures
from rollstream.workers import reward_pool
from rollstream.workers.reward_pool import Job, RewardPool, Scored, normalise
from rollstream.extensions import REWARDS
from rollstream.workers.rewards import RewardSpec, RewardWorker
from tests.workers import user_rewards

USER = "tests.workers.user_rewards"
TIMEOUT_S = 1.0


@pytest.mark.parametrize("value, expected", [
    (0.5, Scored(0.5, {"score": 0.5})),
    (2, Scored(2.0, {"score": 2.0})),
    (True, Scored(1.0, {"score": 1.0})),
    ({"score": 1, "acc": True, "pred": "x", "n": None}, Scored(1.0, {"score": 1.0, "acc": 1.0}, {"pred": "x", "n": "None"})),
    (math.nan, Scored(math.nan, kind="invalid", error="returned score nan")),
    (-math.inf, Scored(math.nan, kind="invalid", error="returned score -inf")),
    ({"score": math.inf}, Scored(math.nan, kind="invalid", error="returned score inf")),
    ("1.0", Scored(math.nan, kind="invalid", error="returned str, not a number or a dict with 'score'")),
    (None, Scored(math.nan, kind="invalid", error="returned NoneType, not a number or a dict with 'score'")),
    ([1.0], Scored(math.nan, kind="invalid", error="returned list, not a number or a dict with 'score'")),
    ({"acc": 1.0}, Scored(math.nan, kind="invalid", error="returned a dict without 'score' (keys ['acc'])")),
    ({"score": "high"}, Scored(math.nan, kind="invalid", error="returned score of type str, not a number")),
])
def test_normalise(value, expected):
    got = normalise(value)
    assert (got.kind, got.error, got.scores, got.meta) == (expected.kind, expected.error, expected.scores, expected.meta)
    assert got.reward == expected.reward or (math.isnan(got.reward) and math.isnan(expected.reward))


def test_call_one_runs_in_process_too():
    assert reward_pool.call_one(user_rewards.raises, "x", "y", {}).error == "ValueError: cannot score 'x'"
    assert reward_pool.call_one(user_rewards.returns, "0.25", "", {}).reward == 0.25


def test_builtin_names_match_the_config():
    assert tuple(REWARDS) == ("gsm8k", "math", "reasoning_gym")


def test_info_keys_follow_the_signature():
    assert info_keys(user_rewards.exact_match) is None  # **info: everything
    assert info_keys(user_rewards.named_only) == ("prompt_id",)
    assert info_keys(user_rewards.two_args) == ()


def test_pool_outcomes_per_job_and_the_pool_survives():
    info = {"sample_index": 0}
    with RewardPool(2, preload=[USER]) as pool:
        fns = [user_rewards.exact_match, user_rewards.sleeps, user_rewards.raises, user_rewards.returns_nan,
               user_rewards.exits, user_rewards.segfaults, user_rewards.raises_weird, user_rewards.exact_match]
        out = pool.score([Job(fn, ["a"], ["a"], [info], TIMEOUT_S) for fn in fns])
        assert [(s.kind, s.error) for [s] in out] == [
            ("ok", None),
            ("timeout", "no result within reward_timeout_s=1"),
            ("raised", "ValueError: cannot score 'a'"),
            ("invalid", "returned score nan"),
            ("died", "reward process died (exit code 3)"),
            ("died", "reward process died (signal 11)"),
            ("raised", "Weird: 1/2"),  # an exception that does not unpickle reaches us as text
            ("ok", None),
        ]
        assert out[0][0].scores == {"score": 1.0, "acc": 1.0, "sample_index": 0.0}
        # the killed and the dead processes were replaced: the pool still scores
        [[again]] = pool.score([Job(user_rewards.exact_match, ["a"], ["b"], [info], TIMEOUT_S)])
        assert (again.kind, again.reward) == ("ok", 0.0)


def test_batched_jobs():
    infos = [{"sample_index": 0}, {"sample_index": 1}]
    with RewardPool(1) as pool:
        good, short, broken = pool.score([
            Job(user_rewards.batched, ["a", "b"], ["a", "a"], infos, TIMEOUT_S, batched=True),
            Job(user_rewards.batched_short, ["a", "b"], ["a", "a"], infos, TIMEOUT_S, batched=True),
            Job(user_rewards.raises_batch, ["a", "b"], ["a", "a"], infos, TIMEOUT_S, batched=True),
        ])
    assert [s.reward for s in good] == [1.0, 0.5]
    assert [(s.kind, s.error) for s in short] == [("invalid", "batched reward returned 1 results for 2 responses")] * 2
    assert [(s.kind, s.error) for s in broken] == [("raised", "RuntimeError: batch of 2")] * 2


# -- the reward worker -------------------------------------------------------------------------

def _response(domain: str, text: str, index: int, truth: str = "a", prompt_id: str = "p1") -> dict:
    return {
        "prompt_id": prompt_id, "domain": domain, "mode": "train", "prompt": "Q?", "ground_truth": truth,
        "round": 0, "sample_index": index, "prompt_token_ids": [1, 2, 3], "response_token_ids": [4, 5],
        "infer_logprobs": [-0.5, -0.25], "response_text": text, "finish_reason": "stop", "error": None,
        "policy_version": 3, "generation_ms": 1.0, "created_ms": 0,
    }


def _inputs(records):
    out = []
    for i, rec in enumerate(records):
        value = encode(rec, "Response")
        schema, decoded = decode(value)
        out.append(Input(schema, decoded, "t.responses", 0, i, rec["prompt_id"].encode(), value))
    return out


@pytest.fixture(scope="module")
def worker():
    specs = {
        "user": RewardSpec(f"{USER}:by_text", timeout_s=TIMEOUT_S),
        "returns": RewardSpec(f"{USER}:returns", timeout_s=TIMEOUT_S),
        "named": RewardSpec(f"{USER}:named_only", timeout_s=TIMEOUT_S),
        "batch": RewardSpec(f"{USER}:batched", timeout_s=TIMEOUT_S, batched=True),
        "gsm8k": "gsm8k",
    }
    w = RewardWorker(Topics("t."), specs, concurrency=2)
    yield w
    w.close()


# (domain, response text) -> (reward, meta reward_failure, reward_error, response filter reason)
CASES = [
    (("user", "a"), (1.0, None, None, "accepted")),
    (("user", "b"), (0.0, None, None, "accepted")),
    (("user", "sleep"), (math.nan, "reward_timeout", "no result within reward_timeout_s=1", "reward_timeout")),
    (("user", "raise"), (math.nan, "reward_error", "ValueError: cannot score 'raise'", "reward_error")),
    (("user", "nan"), (math.nan, "invalid_reward", "returned score nan", "invalid_reward")),
    (("user", "exit"), (math.nan, "reward_error", "reward process died (exit code 3)", "reward_error")),
    (("returns", "0.5"), (0.5, None, None, "accepted")),
    (("returns", "inf"), (math.nan, "invalid_reward", "returned score inf", "invalid_reward")),
    (("returns", "'text'"), (math.nan, "invalid_reward", "returned str, not a number or a dict with 'score'",
                             "invalid_reward")),
    (("returns", "None"), (math.nan, "invalid_reward", "returned NoneType, not a number or a dict with 'score'",
                           "invalid_reward")),
    (("returns", "{'score': 2, 'acc': True, 'pred': 'x'}"), (2.0, None, None, "accepted")),
    (("named", "a"), (1.0, None, None, "accepted")),  # prompt_id p1 ends with 1
    (("gsm8k", "#### 18"), (1.0, None, None, "accepted")),
    (("gsm8k", "18"), (math.nan, "reward_error", "ValueError: gsm8k ground truth is not a number: 'a'",
                       "reward_error")),
]


def test_every_response_gets_its_own_outcome_in_one_batch(worker):
    records = [_response(domain, text, i, truth="18" if text == "#### 18" else "a")
               for i, ((domain, text), _) in enumerate(CASES)]
    outputs = worker(_inputs(records))
    assert len(outputs) == len(CASES)
    for out, ((domain, text), (reward, failure, error, reason)) in zip(outputs, CASES):
        _, rec = decode(encode(out.record, out.schema))
        got = rec["response_level_reward"]
        assert got == reward or (math.isnan(got) and math.isnan(reward)), (domain, text, got)
        assert (rec["meta"].get("reward_failure"), rec["reward_error"]) == (failure, error), (domain, text)
        assert decide_response(rec, {"type": "default"}).reason == reason, (domain, text)
    by_text = {(r["domain"], r["response_text"]): o.record for r, o in zip(records, outputs)}
    exact = by_text["user", "a"]
    assert exact["scores"] == {"score": 1.0, "acc": 1.0, "sample_index": 0.0}
    assert exact["meta"]["seen"] == ",".join(sorted(INFO_KEYS))  # **info gets every key
    assert by_text["returns", "{'score': 2, 'acc': True, 'pred': 'x'}"]["scores"] == {"score": 2.0, "acc": 1.0}
    assert by_text["returns", "{'score': 2, 'acc': True, 'pred': 'x'}"]["meta"]["pred"] == "x"
    assert by_text["returns", "0.5"]["scores"] == {"score": 0.5}
    assert by_text["user", "sleep"]["reward_ms"] == TIMEOUT_S * 1000.0


def test_the_summary_counts_the_functions_failures_by_kind_with_an_example(worker):
    records = [_response(domain, text, i, truth="18" if text == "#### 18" else "a")
               for i, ((domain, text), _) in enumerate(CASES)]
    rewarded = [decode(encode(o.record, o.schema))[1] for o in worker(_inputs(records))]
    engine = worker(_inputs([{**_response("user", "", 99), "finish_reason": "error", "error": "CUDA OOM"}]))
    rewarded += [o.record for o in engine]  # the engine's failure, not the function's: not counted
    assert reward_failures(rewarded) == [
        {"failure": "invalid_reward", "kind": "invalid_reward", "count": 4, "example": "returned score nan"},
        {"failure": "reward_error", "kind": "ValueError", "count": 2, "example": "ValueError: cannot score 'raise'"},
        {"failure": "reward_error", "kind": "reward_error", "count": 1, "example": "reward process died (exit code 3)"},
        {"failure": "reward_timeout", "kind": "reward_timeout", "count": 1,
         "example": "no result within reward_timeout_s=1"},
    ]


def test_a_metric_the_function_does_not_return_is_named_at_its_first_scored_response():
    typo = RewardWorker(Topics("t."), {"user": RewardSpec(f"{USER}:by_text", TIMEOUT_S, metric="accuracy")}, 1)
    right = RewardWorker(Topics("t."), {"user": RewardSpec(f"{USER}:by_text", TIMEOUT_S, metric="acc")}, 1)
    try:
        # a response the function failed on says nothing of its scores: no check yet
        [failed] = typo.rewards([_response("user", "raise", 0)])
        assert failed.failure == "reward_error"
        with pytest.raises(ConfigError, match=r"rewards\.user\.query_filter_config\.metric 'accuracy' is not among the "
                                              r"scores .*:by_text returned: \['acc', 'sample_index', 'score'\]"):
            typo.rewards([_response("user", "a", 1)])
        assert [r.response_level_reward for r in right.rewards([_response("user", "a", 1)])] == [1.0]
    finally:
        typo.close()
        right.close()


def test_batched_domain_is_one_call_per_poll(worker):
    outputs = worker(_inputs([_response("batch", "a", 0), _response("gsm8k", "#### 1", 1, truth="1"),
                              _response("batch", "b", 2)]))
    assert [o.record["response_level_reward"] for o in outputs] == [1.0, 1.0, 1.0]  # b: 0 + 0.5 * 2


def test_engine_errors_skip_the_function(worker):
    rec = {**_response("user", "", 0), "finish_reason": "error", "error": "CUDA OOM"}
    [out] = worker(_inputs([rec]))
    assert (out.record["reward_error"], out.record["meta"]["reward_failure"]) == ("engine_error", "engine_error")


def test_rejections_are_counted_by_reason():
    filters = DomainFilters(num_return_sequences=4, max_response_rounds=1)
    metrics = WorkerMetrics("w")
    state = None
    for i, failure in enumerate(["reward_timeout", "reward_error", "invalid_reward", None]):
        rec = {"response": {"prompt_id": "p", "domain": "d", "mode": "train", "sample_index": i,
                            "finish_reason": "stop", "response_length": 1, "policy_version": 0},
               "response_level_reward": 1.0 if failure is None else math.nan, "scores": {},
               "meta": {} if failure is None else {"reward_failure": failure}}
        state, effects = step(state, rec, filters)
        count_effects(metrics, effects, "train")
    view = figures(latest(metrics.snapshot(now_ms=5)))
    assert view["units"]["response"]["reasons"] == {"reward_timeout": 1.0, "reward_error": 1.0, "invalid_reward": 1.0}
    assert view["units"]["query"]["reasons"] == {"response_retries_exhausted": 1.0}


@pytest.mark.parametrize("reward, meta, reason", [
    (math.nan, {"reward_failure": "reward_timeout"}, "reward_timeout"),
    (math.nan, {"reward_failure": "reward_error"}, "reward_error"),
    (math.inf, {"reward_failure": "invalid_reward"}, "invalid_reward"),
    (math.nan, {"reward_failure": "bogus"}, "invalid_reward"),
    (math.nan, {}, "invalid_reward"),  # events written before reward_failure
    (0.5, {"reward_failure": "reward_error"}, "accepted"),  # only a missing reward is rejected
])
def test_response_filter_names_the_reward_failure(reward, meta, reason):
    rec = {"response": {"finish_reason": "stop", "response_length": 2}, "response_level_reward": reward,
           "meta": {"blank_text": "false", **meta}}
    assert decide_response(rec, {"type": "default"}).reason == reason
