"""`whatif` over recorded events, no broker: determinism with the same config, exact changes
with another threshold, and replacements the recording does or does not hold."""

from __future__ import annotations

import numpy as np

from rollstream.config import parse_config
from rollstream.filtering.prompt_state import Decided, Replacement, step
from rollstream.schemas.records import payload_ref, response_summary, trajectory_summary
from rollstream.streams.event_builders import decided_group
from rollstream.tools.whatif import whatif_rlvr

DOMAIN = "synth"


def config(std_threshold: float = 0.0, reject_truncated: bool = True, **extra):
    return parse_config({
        "name": "w", "rollout_batch_size": 2, "num_return_sequences_in_group": 4, "max_prompts_per_batch": 64,
        "rewards": {DOMAIN: {"reward_type": "gsm8k",
                             "query_filter_config": {"type": "std_filter", "filter_args": {"std_threshold": std_threshold}},
                             "response_filter_config": {"type": "default",
                                                        "filter_args": {"reject_truncated": reject_truncated}}}},
        "datasets": [], **extra})


def rewarded(pid: str, index: int, reward: float, finish: str = "stop") -> dict:
    """A RewardedResponse as the reward worker writes it: the Response's summary (2 prompt and
    2 response tokens) and a reference to the Response on ``responses`` (never fetched here)."""
    response = {"prompt_id": pid, "domain": DOMAIN, "mode": "train", "prompt": "q", "sample_index": index,
                "round": 0, "prompt_token_ids": [1, 2], "response_token_ids": [5, 6],
                "infer_logprobs": [-0.1, -0.2], "response_text": "x", "finish_reason": finish,
                "policy_version": 0}
    return {"response": response_summary(response), "response_level_reward": reward, "scores": {},
            "meta": {"blank_text": "false"}, "payload": payload_ref("responses", 0, index, 64)}


def record_run(cfg, scripts: dict[str, list[tuple[float, str]]]):
    """Play the aggregator over scripted responses (sample i answers scripts[pid][i]); returns the
    recorded responses.rewarded stream and the decided Group records."""
    filters = cfg.domain_filters()[DOMAIN]
    stream, groups = [], []
    for pid, script in scripts.items():
        pending, state = list(range(filters.first_round("train"))), None
        while pending:
            index = pending.pop(0)
            record = rewarded(pid, index, *script[index])
            stream.append(record)
            state, effects = step(state, record, filters)
            for effect in effects:
                if isinstance(effect, Replacement):
                    pending += range(effect.sample_offset, effect.sample_offset + effect.num_return_sequences)
                if isinstance(effect, Decided):
                    groups.append(decided_group(record["response"], effect, [], "{}", ""))
    return stream, groups


SCRIPTS = {
    "spread": [(1.0, "stop"), (0.0, "stop"), (0.0, "stop"), (0.0, "stop")],          # std 0.5
    "narrow": [(0.2, "stop"), (0.1, "stop"), (0.1, "stop"), (0.1, "stop")],          # std 0.05
    "flat": [(0.0, "stop")] * 4,                                                     # std 0
    "cut": [(1.0, "length"), (0.0, "stop"), (0.0, "stop"), (1.0, "stop"), (0.0, "stop")],  # 1 truncated
}


def test_the_same_config_decides_every_recorded_group_the_same_way():
    cfg = config()
    stream, groups = record_run(cfg, SCRIPTS)
    result = whatif_rlvr(cfg, stream, groups).report(2)
    assert result["changed"] == [] and result["needs_generation"] == [] and result["saved_generations"] == 0
    assert result["actual"] == result["alternative"]
    assert result["actual"]["reasons"] == {"accepted": 3, "zero_std": 1}
    assert result["actual"]["responses_generated"] == 17 and result["actual"]["wasted_generations"] == 17 - 12


def test_a_higher_std_threshold_changes_exactly_the_groups_a_brute_force_recomputation_finds():
    stream, groups = record_run(config(), SCRIPTS)
    result = whatif_rlvr(config(std_threshold=0.1), stream, groups).report(2)
    expected = []
    for g in groups:  # brute force: unbiased float32 std of the kept rewards vs the new threshold
        rewards = np.array([r["response_level_reward"] for r in stream if r["response"]["prompt_id"] == g["prompt_id"]
                            and r["response"]["finish_reason"] == "stop"][:4], dtype=np.float32)
        keep = float(rewards.std(ddof=1)) > 0.1
        if keep != g["accepted"]:
            expected.append({"group_key": g["prompt_id"], "actual": g["reason"],
                             "alternative": "accepted" if keep else "zero_std"})
    assert result["changed"] == expected == [{"group_key": "narrow", "actual": "accepted", "alternative": "zero_std"}]
    assert result["alternative"]["retention_rate"] == 0.5 and result["alternative"]["prompts_per_batch"] == 4.0


def test_replacements_the_recording_holds_or_lacks():
    stream, groups = record_run(config(), SCRIPTS)
    # keeping truncated responses: "cut" is decided in round 0; its replacement was never needed
    lenient = whatif_rlvr(config(reject_truncated=False), stream, groups).report(2)
    assert lenient["saved_generations"] == 1 and lenient["changed"] == [] and lenient["needs_generation"] == []
    # the other way round: a recording made without the truncation rule lacks the replacement
    stream, groups = record_run(config(reject_truncated=False), SCRIPTS)
    strict = whatif_rlvr(config(reject_truncated=True), stream, groups).report(2)
    assert strict["needs_generation"] == ["cut"] and strict["alternative"]["groups_decided"] == 3


def screening(k: int = 2, **extra):
    cfg = config(**extra).model_dump()
    cfg["rewards"][DOMAIN]["screening"] = {"samples": k}
    return parse_config(cfg)


def test_screening_replayed_and_replayed_against():
    """A screened recording re-decides the same under its own config; without screening its
    screened-out group lacks the rest of its samples; a recording without screening, replayed
    under screening, screens out the zero-variance group and saves the samples after its first 2."""
    stream, groups = record_run(screening(), SCRIPTS)
    assert {g["prompt_id"]: g["reason"] for g in groups}["flat"] == "screened_out"
    assert sum(r["response"]["prompt_id"] == "flat" for r in stream) == 2
    same = whatif_rlvr(screening(), stream, groups).report(2)
    assert same["changed"] == [] and same["needs_generation"] == [] and same["saved_generations"] == 0
    assert same["actual"]["reasons"] == {"accepted": 3, "screened_out": 1}
    assert whatif_rlvr(config(), stream, groups).report(2)["needs_generation"] == ["flat"]
    stream, groups = record_run(config(), SCRIPTS)
    screened = whatif_rlvr(screening(), stream, groups).report(2)
    assert screened["changed"] == [{"group_key": "flat", "actual": "zero_std", "alternative": "screened_out"}]
    assert screened["saved_generations"] == 2 and screened["needs_generation"] == []
    # spread and narrow take a second round; cut took one (its truncated sample) either way
    assert screened["alternative"]["rounds"] == screened["actual"]["rounds"] + 2


def test_rounds_are_reported_per_side():
    stream, groups = record_run(config(), SCRIPTS)
    result = whatif_rlvr(config(reject_truncated=False), stream, groups).report(2)
    assert (result["actual"]["rounds"], result["alternative"]["rounds"]) == (5, 4)  # "cut" needed 2 rounds


def test_agentic_group_filter_what_if():
    from rollstream.tools.whatif import whatif_agentic

    def group(key: str, rewards: list[float], accepted: bool, reason: str) -> dict:
        # the group events' members: TrajectorySummary records naming their Trajectory by reference
        trajs = [trajectory_summary({"group_id": 0, "episode_id": 0, "traj_index": i, "response_level_rewards": r,
                                     "drop_flag": False, "env_failed": False, "env_timeout": False,
                                     "stop_reason": "done", "turns": [], "response_mask": []},
                                    payload_ref("trajectories", 0, i, 64)) for i, r in enumerate(rewards)]
        return {"group_key": key, "mode": "train", "group_id": 0, "episode_id": int(key[-1]), "accepted": accepted,
                "reason": reason, "trajectories": trajs, "trajectories_arrived": len(trajs)}

    cfg = parse_config({
        "name": "a", "rollout_batch_size": 2,
        "train_env_manager": {"num_env_groups": 1, "group_size": 2, "tags": ["lake"],
                              "group_filter_cls": "rollstream.filtering.group_filters:EnvFailureStdGroupFilter"},
        "custom_envs": {"lake": {"env_type": "frozen_lake"}}})
    recorded = [group("g/0", [1.0, 0.0], True, "accepted"), group("g/1", [0.0, 0.0], True, "accepted"),
                group("g/2", [1.0, 1.0], True, "accepted"), group("g/3", [0.0], False, "infra_abort")]
    result = whatif_agentic(cfg, recorded).report(2)
    assert result["changed"] == [{"group_key": "g/1", "actual": "accepted", "alternative": "zero_std"},
                                 {"group_key": "g/2", "actual": "accepted", "alternative": "zero_std"}]
    assert result["actual"]["groups_decided"] == 3  # infra_abort never reached the group filter


def test_prompt_too_long_is_re_decided_from_the_recorded_prompt_tokens():
    # admission's Group carries no tokens: the prompt's length is its decision value
    too_long = {"group_key": "long", "prompt_id": "long", "domain": DOMAIN, "mode": "train", "accepted": False,
                "reason": "prompt_too_long", "decision_values": {"prompt_tokens": 40.0, "prompt_length": 32.0},
                "responses": [], "rounds": 0, "responses_generated": 0}
    same = whatif_rlvr(config(prompt_length=32), [], [too_long]).report(2)
    assert same["changed"] == [] and same["needs_generation"] == [] and same["actual"] == same["alternative"]
    assert same["alternative"]["reasons"] == {"prompt_too_long": 1}
    shorter = whatif_rlvr(config(prompt_length=39), [], [too_long]).report(2)
    assert shorter["changed"] == [] and shorter["alternative"]["reasons"] == {"prompt_too_long": 1}
    # a longer limit admits it: its responses were never generated, so it cannot be decided offline
    longer = whatif_rlvr(config(prompt_length=40), [], [too_long]).report(2)
    assert longer["needs_generation"] == ["long"] and longer["alternative"]["groups_decided"] == 0


def test_a_group_without_recorded_responses_takes_its_prompt_length_from_the_response_summaries():
    stream, groups = record_run(config(), {"spread": SCRIPTS["spread"]})
    (group,) = groups
    group = {**group, "responses": stream[:4]}  # summaries with prompt_length 2, but no rewarded stream
    result = whatif_rlvr(config(prompt_length=1), [], [group]).report(2)
    assert result["changed"] == [{"group_key": "spread", "actual": "accepted", "alternative": "prompt_too_long"}]
    assert whatif_rlvr(config(prompt_length=2), [], [group]).report(2)["needs_generation"] == ["spread"]


def test_a_prompt_skipped_by_history_stays_skipped_only_under_the_same_history_filter():
    from rollstream.filtering.admission import history_filter_config

    on = {"enable": True, "explore_init": 0.4}
    recorded = config(num_epochs=2, history_filter=on)
    skipped = {"group_key": "p#e1", "prompt_id": "p#e1", "domain": DOMAIN, "mode": "train", "accepted": False,
               "reason": "skipped_by_history", "decision_values": {"skip_probability": 0.6}, "responses": [],
               "rounds": 0, "responses_generated": 0,
               "filter_config_hash": history_filter_config(recorded.history_filter.model_dump())[1]}
    same = whatif_rlvr(recorded, [], [skipped]).report(2)
    assert same["changed"] == [] and same["needs_generation"] == []
    assert same["alternative"]["reasons"] == {"skipped_by_history": 1}
    for other in (config(), config(num_epochs=2, history_filter={**on, "explore_init": 0.5})):
        assert whatif_rlvr(other, [], [skipped]).report(2)["needs_generation"] == ["p#e1"]
