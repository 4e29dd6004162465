"""rollstream audit's invariants on hand-made runs: each check passes on a clean run and fails,
naming the offender, on the fault it exists for."""

from __future__ import annotations

from rollstream.tools.audit import audit_agentic, audit_rlvr


def request(pid, round_=0):
    return {"prompt_id": pid, "round": round_}


def outcome(pid, commit=True, reason=None):
    return {"prompt_id": pid, "outcome": "commit" if commit else "abort", "reason": reason or ("accepted" if commit else "zero_std")}


def group(pid, accepted=True, reason=None, mode="train"):
    return {"group_key": pid, "prompt_id": pid, "mode": mode, "accepted": accepted,
            "reason": reason or ("accepted" if accepted else "zero_std")}


def batch(step, keys, status="complete"):
    return {"step": step, "status": status, "group_keys": keys}


def clean_run():
    return dict(requests=[request("p0"), request("p1"), request("p2"), request("p1", 1), request("v0")],
                outcomes=[outcome("p0"), outcome("p1"), outcome("p2", False), outcome("v0")],
                accepted=[group("p0"), group("p1")], rejected=[group("p2", False)],
                validation=[group("v0", mode="val")], batches=[batch(0, ["p0", "p1"])])


def failed(report):
    return {c.name: c.offending for c in report.failed}


def test_a_clean_run_passes_every_check_with_its_counts():
    report = audit_rlvr(**clean_run(), manifest_keys=["p0", "p1"])
    assert report.ok, report.to_json()
    assert report.counts == {"prompts_admitted": 4, "prompts_decided": 4, "prompts_pending": 0, "duplicate_outcomes": 0,
                             "groups_accepted": 2, "groups_trained": 2, "groups_pending_training": 0,
                             "groups_rejected_by_trainer": 0, "duplicate_group_events": 0}


def test_a_redelivered_decision_is_counted_not_failed_but_a_conflicting_one_fails():
    run = clean_run()
    run["outcomes"].append(outcome("p0"))
    run["accepted"].append(group("p0"))
    report = audit_rlvr(**run)
    assert report.ok and report.counts["duplicate_outcomes"] == 1 and report.counts["duplicate_group_events"] == 1
    run["outcomes"].append(outcome("p0", False))
    assert failed(audit_rlvr(**run)) == {"one_outcome_per_prompt": ["p0"]}


def test_pending_prompts_are_allowed_until_the_data_ended():
    run = clean_run()
    run["requests"].append(request("p3"))
    report = audit_rlvr(**run)
    assert report.ok and report.counts["prompts_pending"] == 1
    run["batches"].append(batch(1, [], status="end_of_data"))
    assert failed(audit_rlvr(**run)) == {"no_prompt_left_undecided": ["p3"]}


def test_an_outcome_without_its_group_or_of_a_prompt_never_admitted_fails():
    run = clean_run()
    run["accepted"] = [group("p0")]  # p1's commit has no accepted group (a lost decision event)
    run["batches"] = [batch(0, ["p0"])]
    run["outcomes"].append(outcome("ghost"))
    assert failed(audit_rlvr(**run)) == {"outcomes_of_admitted_prompts": ["ghost"],
                                         "outcome_matches_group": ["ghost", "p1"]}


def test_training_twice_or_training_a_group_never_accepted_fails():
    run = clean_run()
    assert failed(audit_rlvr(**run, manifest_keys=["p0", "p1", "p0"])) == {"trained_at_most_once": ["p0"]}
    run["batches"].append(batch(0, ["p0", "p1"], status="recovered"))  # the same step recorded again: once
    assert audit_rlvr(**run).ok
    run["batches"].append(batch(1, ["p2"]))
    assert failed(audit_rlvr(**run)) == {"only_accepted_groups_trained": ["p2"]}


def test_the_trainers_stale_rejections_are_allowed_a_filters_double_decision_is_not():
    run = clean_run()
    run["batches"] = [batch(0, ["p0"])]
    run["rejected"].append(group("p1", False, "stale"))  # the trainer: accepted, then too old to train
    report = audit_rlvr(**run)
    assert report.ok and report.counts["groups_rejected_by_trainer"] == 1 and report.counts["groups_pending_training"] == 0
    run["rejected"].append(group("p0", False, "mean_too_high"))
    assert failed(audit_rlvr(**run)) == {"accepted_xor_rejected": ["p0"], "outcome_matches_group": ["p0"]}


def test_dead_letters_are_listed_and_fail_only_on_request():
    dead = [{"reason": "undecodable"}, {"reason": "undecodable"}, {"reason": "too_large"}]
    report = audit_rlvr(**clean_run(), dead_letters=dead)
    assert report.ok and report.dead_letters == {"too_large": 1, "undecodable": 2}
    assert failed(audit_rlvr(**clean_run(), dead_letters=dead, fail_on_dead_letters=True)) == {
        "no_dead_letters": ["too_large=1", "undecodable=2"]}


def episode(gid, eid, accepted=True, reason=None, unit="episode", mode="train"):
    return {"group_key": f"{gid}/{eid}", "mode": mode, "group_id": gid, "episode_id": eid, "unit": unit,
            "accepted": accepted, "reason": reason or ("accepted" if accepted else "zero_std")}


def test_agentic_episodes_have_one_decision_and_set_asides_are_not_decisions():
    requests = [{"mode": "train", "group_id": 0, "episode_id": e} for e in (0, 1)] + [
        {"mode": "train", "group_id": 1, "episode_id": 0}]
    accepted = [episode(0, 1)]
    rejected = [episode(0, 0, False), episode(0, 1, False, "infra_abort", unit="trajectory")]
    report = audit_agentic(requests, accepted, rejected, [], [batch(0, ["0/1"])])
    assert report.ok and report.counts["episodes_pending"] == 1 and report.counts["groups_trained"] == 1
    rejected.append(episode(0, 1, False, "zero_std"))
    rejected.append(episode(5, 0, False))
    assert failed(audit_agentic(requests, accepted, rejected, [], [batch(0, ["0/1"])])) == {
        "one_decision_per_episode": ["train/0/1"], "decisions_of_started_episodes": ["train/5/0"],
        "accepted_xor_rejected": ["0/1"]}
