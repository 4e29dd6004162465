"""The learning curve from decision-plane records (rollstream.tools.learning)."""

from __future__ import annotations

import pytest

from rollstream.tools.learning import difficulty, final_round_done, first_reaching, learning_curve, screening


def member(pid: str, i: int, reward: float, version: int, mode: str = "train", acc: float | None = None) -> dict:
    return {"response": {"prompt_id": pid, "mode": mode, "sample_index": i, "policy_version": version,
                         "response_length": 3},
            "response_level_reward": reward, "scores": {} if acc is None else {"acc": acc}}


def group(pid: str, rewards, version: int, mode: str = "train", accepted: bool = True, reason: str = "accepted",
          generated: int | None = None, domain: str = "math") -> dict:
    responses = [member(pid, i, r, version, mode) for i, r in enumerate(rewards)]
    return {"prompt_id": pid, "domain": domain, "mode": mode, "accepted": accepted, "reason": reason,
            "policy_version": version, "responses": responses,
            "responses_generated": len(rewards) if generated is None else generated}


def test_the_curve_joins_validation_training_and_filtering_by_version():
    validation = [group("v0", [0, 0, 0, 1], 0, "val"), group("v1", [0, 0, 0, 0], 0, "val", domain="gsm8k"),
                  group("v0#v2", [1, 1, 0, 1], 2, "val"), group("v1#v2", [1, 0, 0, 0], 3, "val", domain="gsm8k")]
    decided = [group("p0", [1, 0, 0, 0], 0), group("p1", [0, 0, 0, 0], 0, accepted=False, reason="zero_std", generated=8),
               group("p2", [1, 1, 0, 0], 2), group("p3", [], 2, accepted=False, reason="skipped_by_history", generated=0)]
    rewarded = [m for g in decided + validation for m in g["responses"]] + [member("p9", 0, 1.0, 2)]
    out = learning_curve(validation, rewarded, decided, group_size=4)
    v0, v2 = out["validation"]["0"], out["validation"]["2"]
    assert (v0["groups"], v0["responses"], v0["accuracy"], v0["pass@1"], v0["pass@4"]) == (2, 8, 0.125, 0.125, 0.5)
    assert (v2["accuracy"], v2["pass@4"], v2["generated_by"], v2["decided_ms"]) == (0.5, 1.0, [2, 3], 0)
    assert v2["domains"] == {"gsm8k": {"groups": 1, "accuracy": 0.25, "pass@1": 0.25, "pass@4": 1.0},
                             "math": {"groups": 1, "accuracy": 0.75, "pass@1": 0.75, "pass@4": 1.0}}
    # training: every generated train response by its version (val members left out)
    assert out["train"] == {"0": {"responses": 8, "tokens": 24, "reward_mean": 0.125, "accuracy": 0.125},
                            "2": {"responses": 5, "tokens": 15, "reward_mean": 0.6, "accuracy": 0.6}}
    # filtering: 12 responses for 1 accepted group of 4 at v0; the skipped prompt is not a decision
    assert out["filtering"]["0"] == {"groups_decided": 2, "groups_accepted": 1, "responses_generated": 12,
                                     "prompts_skipped": 0, "retention": 0.5, "responses_per_accepted_response": 3.0}
    assert out["filtering"]["2"]["prompts_skipped"] == 1 and out["filtering"]["2"]["retention"] == 1.0
    assert out["curve"] == [
        {"policy_version": 0, "val_accuracy": 0.125, "val_pass@1": 0.125, "val_pass@4": 0.5, "train_reward": 0.125,
         "train_accuracy": 0.125, "retention": 0.5, "responses_per_accepted_response": 3.0, "prompts_skipped": 0},
        {"policy_version": 2, "val_accuracy": 0.5, "val_pass@1": 0.5, "val_pass@4": 1.0, "train_reward": 0.6,
         "train_accuracy": 0.6, "retention": 1.0, "responses_per_accepted_response": 1.0, "prompts_skipped": 1}]
    assert first_reaching(out["curve"], "val_accuracy", 0.5)["policy_version"] == 2
    assert first_reaching(out["curve"], "val_accuracy", 0.9) is None


def test_the_acc_score_decides_correctness_when_there_is_one():
    validation = [{**group("v0", [0.2, 0.2], 0, "val"),
                   "responses": [member("v0", 0, 0.2, 0, "val", acc=1.0), member("v0", 1, 0.2, 0, "val", acc=0.0)]}]
    assert learning_curve(validation, [], [], 2)["validation"]["0"]["accuracy"] == 0.5


@pytest.mark.parametrize("rounds, last, done", [
    ({0: 2}, 1, True),              # the last version is in the first block: nothing to wait for
    ({0: 2, 2: 2}, 3, True),
    ({0: 2, 2: 1}, 3, False),       # the round is still being generated
    ({0: 2, 2: 2}, 4, False),       # version 4's round has not started
    ({0: 2, 2: 2, 5: 2}, 4, True),  # admission saw 5 first: its round covers the block of 4
])
def test_final_round_done(rounds, last, done):
    validation = [group(f"v{i}" + (f"#v{v}" if v else ""), [1.0], v, "val") for v, n in rounds.items() for i in range(n)]
    assert final_round_done(validation, 2, last) is done


def test_the_printed_learning_table_fits_80_columns_without_cutting_a_word():
    from rich.console import Console

    from rollstream.app.render import learning_table

    curve = [{"policy_version": 0, "val_accuracy": 0.265625, "val_pass@1": 0.265625, "train_reward": 0.2431,
              "train_accuracy": 0.2361, "retention": 0.8889, "responses_per_accepted_response": 1.125,
              "prompts_skipped": 0},
             {"policy_version": 12, "val_accuracy": 0.9375, "val_pass@1": 0.9375}]
    console = Console(width=80, record=True)
    console.print(learning_table(curve))
    text = console.export_text()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    for word in ("version", "pass@1", "reward", "retention", "accepted", "skipped"):
        assert word in text
    assert "0.266" in text and "1.12" in text and "v12" in text


def test_difficulty_counts_zero_variance_groups_and_the_tokens_spent_on_them():
    decided = [group("mixed", [1, 0, 0, 0], 0), group("wrong", [0, 0, 0, 0], 0, accepted=False, reason="mean_too_low"),
               group("screened", [1, 1], 1, accepted=False, reason="screened_out"),
               group("skipped", [], 1, accepted=False, reason="skipped_by_history", generated=0)]
    # every response has 3 tokens; "wrong" had one more response that its response filter rejected
    rewarded = [m for g in decided for m in g["responses"]] + [member("wrong", 4, 0.0, 0)]
    assert difficulty(rewarded, decided) == {
        "groups_generated": 3, "zero_variance_share": round(2 / 3, 4), "tokens_generated": 33,
        "zero_variance_tokens": 21, "tokens_trained_on": 12, "share_of_tokens_trained_on": round(12 / 33, 4)}
    assert difficulty([], [])["zero_variance_share"] is None


def test_screening_counts_screened_groups_and_the_false_rejections_a_diagnosis_found():
    screened = [{**group(f"s{i}", [0, 0], 0, accepted=False, reason="screened_out"),
                 "decision_values": {"screening_samples": 2.0, **({"full_group_kept": kept} if kept is not None else {})}}
                for i, kept in enumerate([1.0, 0.0, 0.0, 0.0, None])]
    decided = screened + [group("z", [0, 0, 0, 0], 0, accepted=False, reason="mean_too_low")]
    assert screening(decided) == {"screened_out": 5, "checked_in_full": 4, "false_rejection_rate": 0.25}
    assert screening([])["false_rejection_rate"] is None
