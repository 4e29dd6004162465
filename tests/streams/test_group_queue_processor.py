"""The group queue processor over a plain dict table: real Avro events in and out, no broker."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest

from rollstream.config import parse_config
from rollstream.schemas import decode, encode
from rollstream.schemas.records import payload_ref
from rollstream.streams.group_queue_processor import GroupQueueProcessor
from rollstream.streams.store import HeldWrites, MemoryStore
from rollstream.workers.env_worker import too_large_stub

STD_FILTER = "rollstream.filtering.group_filters:EnvFailureStdGroupFilter"


def agentic_config(**manager) -> dict:
    return {
        "name": "gq", "kafka": {"topic_prefix": "gq.", "partitions": 1},
        "rollout_batch_size": manager.get("group_size", 2),
        "train_env_manager": {"num_env_groups": 8, "tags": ["lake"], **manager},
        "custom_envs": {"lake": {"env_type": "frozen_lake", "env_config": {"is_slippery": False},
                                 "max_actions_per_traj": 3}},
    }


def trajectory(group_id: int, episode_id: int, traj_index: int, reward: float, *, env_failed: bool = False,
               policy_version: int = 0) -> dict:
    return {
        "mode": "train", "group_id": group_id, "episode_id": episode_id, "traj_index": traj_index, "tag": "lake",
        "env_type": "frozen_lake", "seed": 0,
        "turns": [{"prompt_token_ids": [1, 2], "response_token_ids": [5, 6], "infer_logprobs": [-0.5, -0.25]}],
        "response_mask": [1, 1], "step_rewards": [reward], "response_level_rewards": reward,
        "success": reward > 0, "stop_reason": "env_failed" if env_failed else "done",
        "env_failed": env_failed, "drop_flag": env_failed, "error": "sandbox lost" if env_failed else None,
        "policy_version": policy_version, "finished_ms": 1000 + traj_index,
    }


class Run:
    """A processor fed as from a log: each input topic's partition 0 gets consecutive offsets."""

    def __init__(self, policy_version=lambda: None, max_staleness=None, table=None, **manager) -> None:
        self.config = parse_config({**agentic_config(**manager), "max_staleness": max_staleness})
        self.table = MemoryStore() if table is None else table
        self.proc = GroupQueueProcessor(self.config, self.table, policy_version)
        self.sent: list[tuple[str, str, str, dict]] = []  # (topic, key, schema, record)
        self.offsets: dict[str, int] = defaultdict(int)  # topic -> next offset
        self.sent_values: list[bytes] = []

    def feed(self, value: bytes, now: int = 0, topic: str = "gq.episodes.control"):
        offset = self.offsets[topic]
        self.offsets[topic] += 1
        handled = self.proc.handle(topic, 0, value, now=now, offset=offset)
        for s in handled.sends:
            schema, record = decode(s.value)
            self.sent.append((s.topic, s.key, schema, record))
            self.sent_values.append(s.value)
        return handled

    def start(self, group_id: int):
        return self.feed(encode({"command": "start", "mode": "train", "group_id": group_id}, "GroupCommand"))

    def arrive(self, record: dict, now: int = 0):
        return self.feed(encode(record, "Trajectory"), now, topic="gq.trajectories")

    def on(self, topic_suffix: str, schema: str | None = None) -> list[dict]:
        return [r for t, _, s, r in self.sent if t == f"gq.{topic_suffix}" and (schema is None or s == schema)]

    def metric_sum(self, name: str) -> float:
        return sum(m["value"] for m in self.on("metrics") if m["name"] == name)


def test_start_is_idempotent_and_requests_carry_the_env():
    run = Run(group_size=2, group_size_redundancy=1)
    run.start(3)
    run.start(3)
    requests = run.on("episodes.requests")
    assert [(r["group_id"], r["episode_id"], r["traj_index"], r["cause"]) for r in requests] == [
        (3, 0, 0, "start"), (3, 0, 1, "start"), (3, 0, 2, "start")]
    seed = run.config.group_seed("train", 3)
    assert {r["seed"] for r in requests} == {seed}
    assert requests[0]["env_type"] == "frozen_lake"
    assert json.loads(requests[0]["env_config"]) == {"is_slippery": False}
    assert requests[0]["max_actions_per_traj"] == 3


def test_one_lost_trajectory_is_refilled_not_the_group():
    """G = 8, group 7: trajectory 5 ends ENV_LOST (env_failed), the others' rewards are
    [1,0,1,0,0,1,0]. Exactly one refill with the same seed; the lost run goes to the rejected
    topic as infra_abort and is never trained; the refill (reward 1) completes the group, which
    passes the std filter with 8 valid trajectories."""
    run = Run(group_size=8, group_filter_cls=STD_FILTER, refill={"max_refills_per_group": 2})
    run.start(7)
    rewards = dict(zip([0, 1, 2, 3, 4, 6, 7], [1, 0, 1, 0, 0, 1, 0]))
    for t, r in rewards.items():
        run.arrive(trajectory(7, 0, t, r))
    run.arrive(trajectory(7, 0, 5, 0.0, env_failed=True))
    requests = run.on("episodes.requests")
    refills = [r for r in requests if r["cause"] == "refill"]
    assert [(r["episode_id"], r["traj_index"]) for r in refills] == [(0, 8)]
    assert refills[0]["seed"] == requests[0]["seed"]
    (aborted,) = run.on("groups.rejected")
    assert (aborted["group_key"], aborted["reason"], aborted["accepted"]) == ("train/7/0/5", "infra_abort", False)
    assert [t["traj_index"] for t in aborted["trajectories"]] == [5]
    assert run.on("groups.accepted") == []  # the group window stays open

    run.arrive(trajectory(7, 0, 8, 1.0))
    (group,) = run.on("groups.accepted")
    assert group["group_key"] == "train/7/0" and group["refills"] == 1
    assert [t["traj_index"] for t in group["trajectories"]] == [0, 1, 2, 3, 4, 6, 7, 8]
    assert all(not t["env_failed"] for t in group["trajectories"])
    assert run.metric_sum("group_queue/set_aside") == 1
    assert not any(k.startswith(b"t:") for k in run.table)  # members deleted once emitted


@pytest.mark.parametrize("min_valid, outcome", [(None, "refill_exhausted"), (7, "accepted")])
def test_both_refills_fail(min_valid, outcome):
    refill = {"max_refills_per_group": 2, **({"min_valid_group_size": min_valid} if min_valid else {})}
    run = Run(group_size=8, group_filter_cls=STD_FILTER, refill=refill)
    run.start(7)
    for t, r in zip([0, 1, 2, 3, 4, 6, 7], [1, 0, 1, 0, 0, 1, 0]):
        run.arrive(trajectory(7, 0, t, r))
    for t in (5, 8, 9):
        run.arrive(trajectory(7, 0, t, 0.0, env_failed=True))
    decided = run.on("groups.accepted") + [g for g in run.on("groups.rejected") if g["reason"] != "infra_abort"]
    (group,) = decided
    assert group["reason"] == outcome
    if outcome == "accepted":
        assert len(group["trajectories"]) == 7
    else:  # dropped: a replacement episode starts with a new seed
        replacement = [r for r in run.on("episodes.requests") if r["episode_id"] == 1]
        assert len(replacement) == 8 and replacement[0]["seed"] == run.config.group_seed("train", 7) + 1


def test_std_filter_drop_replaces_the_episode_and_counts():
    run = Run(group_size=2, group_filter_cls=STD_FILTER)
    run.start(0)
    run.arrive(trajectory(0, 0, 0, 0.0))
    run.arrive(trajectory(0, 0, 1, 0.0))
    (rejected,) = run.on("groups.rejected")
    assert (rejected["reason"], rejected["accepted"]) == ("zero_std", False)
    # everything needed to re-decide it travels with it
    assert json.loads(rejected["filter_config"])["group_filter_cls"] == STD_FILTER
    assert rejected["filter_config_hash"] == run.config.filter_config_hash("train") and rejected["policy_version"] == 0
    assert rejected["decision_values"]["std"] == 0.0 and len(rejected["trajectories"]) == 2
    assert [(r["episode_id"], r["traj_index"]) for r in run.on("episodes.requests")][-2:] == [(1, 0), (1, 1)]
    assert run.metric_sum("scheduler/group_filter_count") == 1
    assert run.metric_sum("group_queue/episodes_replaced") == 1
    run.arrive(trajectory(0, 0, 1, 0.0))  # redelivered run of the dropped episode
    assert run.metric_sum("group_queue/late_trajectories") == 1


def test_a_stale_episode_is_dropped_as_stale_and_replaced_before_the_filter_runs():
    """max_staleness 1, newest version 3: an episode whose oldest run came from v1 (lag 2) is
    rejected 'stale' with its values and replaced; the next episode (v3) is accepted."""
    current = [3]
    run = Run(group_size=2, policy_version=lambda: current[0], max_staleness=1)
    run.start(0)
    run.arrive(trajectory(0, 0, 0, 1.0, policy_version=3))
    run.arrive(trajectory(0, 0, 1, 0.0, policy_version=1))
    (rejected,) = run.on("groups.rejected")
    assert (rejected["reason"], rejected["policy_version"]) == ("stale", 1)
    assert {k: rejected["decision_values"][k] for k in ("policy_version", "current_version", "max_staleness", "lag")} == {
        "policy_version": 1.0, "current_version": 3.0, "max_staleness": 1.0, "lag": 2.0}
    assert [(r["episode_id"], r["traj_index"]) for r in run.on("episodes.requests")][-2:] == [(1, 0), (1, 1)]
    run.arrive(trajectory(0, 1, 0, 1.0, policy_version=3))
    run.arrive(trajectory(0, 1, 1, 0.0, policy_version=2))  # lag 1: within the bound
    (accepted,) = run.on("groups.accepted")
    assert (accepted["episode_id"], accepted["policy_version"]) == (1, 2)


def test_bad_events_come_back_as_errors():
    run = Run(group_size=2)
    assert run.feed(b"\x00garbage").error[0] == "undecodable"
    assert run.arrive(trajectory(5, 0, 0, 1.0)).error[0] == "invalid_event"  # group never started
    assert run.start(99).error[0] == "invalid_event"  # outside num_env_groups
    assert run.feed(encode({"command": "explode"}, "GroupCommand")).error[0] == "invalid_event"
    prompt = encode({"prompt_id": "p", "domain": "d", "prompt": "x"}, "Prompt")
    assert run.feed(prompt).error == ("invalid_event", "expected GroupCommand on gq.episodes.control, got Prompt")
    # each input topic carries its own schema: a command on trajectories does not open a group
    start = encode({"command": "start", "mode": "train", "group_id": 0}, "GroupCommand")
    assert run.feed(start, topic="gq.trajectories").error == (
        "invalid_event", "expected Trajectory on gq.trajectories, got GroupCommand")
    assert run.on("episodes.requests") == []


def test_tick_reissues_in_the_partitions_it_is_given_only_and_sends_them_elsewhere():
    config = agentic_config(group_size=2, episode_timeout_s=1.0, max_reissues_per_episode=2)
    config["kafka"]["partitions"] = 3
    store = MemoryStore()
    proc = GroupQueueProcessor(parse_config(config), store)
    control, trajectories = "gq.episodes.control", "gq.trajectories"
    start = encode({"command": "start", "mode": "train", "group_id": 0}, "GroupCommand")
    proc.handle(control, 2, start, now=0, offset=0)
    proc.handle(trajectories, 2, encode(trajectory(0, 0, 0, 1.0), "Trajectory"), now=0, offset=0)
    assert proc.tick({0, 1}, now=10**13).sends == []  # the group lives on partition 2
    first = [s for s in proc.tick({1, 2}, now=10**13).sends if s.topic == "gq.episodes.requests"]
    second = [s for s in proc.tick({2}, now=2 * 10**13).sends if s.topic == "gq.episodes.requests"]
    assert [(decode(s.value)[1]["traj_index"], decode(s.value)[1]["cause"], s.partition) for s in first + second] == [
        (2, "reissue", 0), (3, "reissue", 1)]
    assert [proc.tick({2}, now=3 * 10**13).sends[0].topic] == ["gq.groups.rejected"]  # no reissue left
    assert json.loads(store[b"g:train/0"])["partition"] == 2


def test_a_tick_command_on_the_topic_is_read_and_ignored():
    """Earlier versions sent their timer's ticks through ``episodes.control``; a topic that still
    holds them replays without errors, and the deadlines stay the timer's."""
    proc = GroupQueueProcessor(parse_config(agentic_config(group_size=2, episode_timeout_s=1.0)), MemoryStore())
    control = "gq.episodes.control"
    proc.handle(control, 0, encode({"command": "start", "mode": "train", "group_id": 0}, "GroupCommand"),
                now=0, offset=0)
    handled = proc.handle(control, 0, encode({"command": "tick"}, "GroupCommand"), now=10**13, offset=1)
    assert (handled.error, handled.sends) == (None, [])
    assert [s.topic for s in proc.tick({0}, now=10**13).sends].count("gq.episodes.requests") == 2


@pytest.mark.parametrize("refill", [True, False])
def test_nan_reward_is_set_aside_as_invalid_reward_never_a_member(refill):
    """A NaN return is never passed on (the trainer could not use it) and never decided by a
    filter that might keep it: it is set aside with reason invalid_reward, refilled when refills
    are on, whatever the group filter (here the default, which keeps everything)."""
    run = Run(group_size=2, refill={"enabled": refill})
    run.start(0)
    run.arrive(trajectory(0, 0, 0, 1.0))
    run.arrive(trajectory(0, 0, 1, float("nan")))
    (aside,) = [g for g in run.on("groups.rejected") if g["group_key"] == "train/0/0/1"]
    assert aside["reason"] == "invalid_reward"
    refills = [(r["traj_index"], r["cause"]) for r in run.on("episodes.requests") if r["cause"] == "refill"]
    if refill:
        assert refills == [(2, "refill")]
        run.arrive(trajectory(0, 0, 2, 0.0))
        (group,) = run.on("groups.accepted")
        assert [t["response_level_rewards"] for t in group["trajectories"]] == [1.0, 0.0]
    else:  # no refill: the episode cannot reach group_size and is dropped, then replaced
        assert refills == []
        (dropped,) = [g for g in run.on("groups.rejected") if g["group_key"] == "train/0/0"]
        assert dropped["reason"] == "refill_exhausted"
    assert run.metric_sum("group_queue/set_aside") == 1


def test_drop_flag_ratio_guard_state_survives_a_restart():
    """The guard's counters live in the table, so a restarted processor (changelog restored)
    continues the reference's cumulative sequence (k D k | D k D) instead of starting over
    (which would keep call 4)."""
    manager = {"group_size": 1, "group_filter_cls": "rollstream.filtering.group_filters:DropFlagGroupFilter",
               "max_replaced_episodes": 0}
    run = Run(**manager)
    flagged = lambda gid: {**trajectory(gid, 0, 0, 1.0), "drop_flag": True}  # noqa: E731
    for gid in range(3):
        run.start(gid)
        run.arrive(flagged(gid))
    restarted = GroupQueueProcessor(run.config, run.table)  # same table: what the changelog restores
    run.proc = restarted
    for gid in range(3, 6):
        run.start(gid)
        run.arrive(flagged(gid))
    decided = sorted(run.on("groups.accepted") + run.on("groups.rejected"), key=lambda g: g["group_id"])
    assert ["k" if g["accepted"] else "D" for g in decided] == ["k", "D", "k", "D", "k", "D"]
    assert {g["reason"] for g in decided if not g["accepted"]} == {"drop_flag"}
    assert json.loads(run.table[b"f:train/0"])["guard"]["total"] == 6


def test_a_redelivered_run_never_overwrites_the_stored_member():
    """Run 0 arrives, then a different trajectory under the same identity (an env worker that
    replayed the request after a crash): the group ships the first one, the one its decision
    saw."""
    run = Run(group_size=2)
    run.start(0)
    run.arrive(trajectory(0, 0, 0, 1.0))
    run.arrive({**trajectory(0, 0, 0, 5.0), "policy_version": 9})
    run.arrive(trajectory(0, 0, 1, 0.0))
    (group,) = run.on("groups.accepted")
    assert [(t["traj_index"], t["response_level_rewards"]) for t in group["trajectories"]] == [(0, 1.0), (1, 0.0)]


def test_inconsistent_token_arrays_are_set_aside_before_a_filter_can_keep_them():
    """The trainer would refuse a group holding this trajectory (a lost accepted group); the
    group queue sets it aside as invalid_trajectory and refills the run instead."""
    run = Run(group_size=2)
    run.start(0)
    run.arrive(trajectory(0, 0, 0, 1.0))
    run.arrive({**trajectory(0, 0, 1, 0.0), "response_mask": [1, 1, 1]})  # 2 response tokens
    (aside,) = run.on("groups.rejected")
    assert (aside["group_key"], aside["reason"]) == ("train/0/0/1", "invalid_trajectory")
    assert [(r["traj_index"], r["cause"]) for r in run.on("episodes.requests")][-1] == (2, "refill")
    run.arrive(trajectory(0, 0, 2, 0.0))
    (group,) = run.on("groups.accepted")
    assert [t["traj_index"] for t in group["trajectories"]] == [0, 2]


def test_a_group_id_that_stops_publishes_its_outcome_event():
    """QueueDone -> one GroupQueueOutcome on episodes.outcomes (keyed by group_id) with the
    group id's final counts; the group_queue/done metric stays, for display."""
    run = Run(group_size=2, group_filter_cls=STD_FILTER, max_replaced_episodes=1)
    run.start(0)
    for eid, rewards in ((0, (0.0, 0.0)), (1, (0.0, 1.0))):  # zero_std, replaced, then accepted
        for t, r in enumerate(rewards):
            run.arrive(trajectory(0, eid, t, r))
    run.start(1)
    for eid in (0, 1):  # zero_std twice: the one replacement is spent
        for t in (0, 1):
            run.arrive(trajectory(1, eid, t, 0.0))
    outcomes = [(k, r) for t, k, s, r in run.sent if t == "gq.episodes.outcomes"]
    assert [(k, s) for t, k, s, _ in run.sent if t == "gq.episodes.outcomes"] == [
        ("0", "GroupQueueOutcome"), ("1", "GroupQueueOutcome")]
    assert [{k: v for k, v in r.items() if k != "created_ms"} for _, r in outcomes] == [
        {"mode": "train", "group_id": 0, "status": "complete", "accepted": 1, "rejected": 1,
         "rejected_by_reason": {"zero_std": 1}, "episodes_decided": 2, "replaced": 1},
        {"mode": "train", "group_id": 1, "status": "exhausted", "accepted": 0, "rejected": 2,
         "rejected_by_reason": {"zero_std": 2}, "episodes_decided": 2, "replaced": 1},
    ]
    done = [m for m in run.on("metrics") if m["name"] == "group_queue/done"]
    assert [(m["labels"]["group_id"], m["labels"]["status"], m["value"]) for m in done] == [
        ("0", "complete", 1.0), ("1", "exhausted", 0.0)]


def test_set_aside_trajectories_say_so_and_are_not_counted_as_episodes():
    run = Run(group_size=2, refill={"max_refills_per_group": 1})
    run.start(0)
    run.arrive(trajectory(0, 0, 0, 1.0))
    run.arrive(trajectory(0, 0, 1, 0.0, env_failed=True))
    run.arrive(trajectory(0, 0, 2, 0.0))
    assert [(g["group_key"], g["unit"]) for g in run.on("groups.rejected")] == [("train/0/0/1", "trajectory")]
    assert [(g["group_key"], g["unit"]) for g in run.on("groups.accepted")] == [("train/0/0", "episode")]
    (outcome,) = run.on("episodes.outcomes")
    assert (outcome["accepted"], outcome["rejected"], outcome["episodes_decided"]) == (1, 0, 1)


def test_a_queue_state_stored_before_rejected_by_reason_existed_keeps_running():
    """A table value written by the previous group queue (no rejected_by_reason) is read as is;
    the outcome then counts the rejections seen since."""
    run = Run(group_size=2, group_filter_cls=STD_FILTER, max_replaced_episodes=1)
    run.start(0)
    key = b"g:train/0"
    stored = json.loads(run.table[key])
    del stored["rejected_by_reason"]
    run.table[key] = json.dumps(stored).encode()
    for eid in (0, 1):
        for t in (0, 1):
            run.arrive(trajectory(0, eid, t, 0.0))
    (outcome,) = run.on("episodes.outcomes")
    assert (outcome["status"], outcome["rejected"], outcome["rejected_by_reason"]) == (
        "exhausted", 2, {"zero_std": 2})


# -- payload plane vs decision plane -----------------------------------------------------------------


def test_members_are_summaries_that_name_their_trajectory_by_reference():
    """The table keeps each member's TrajectorySummary (never its token arrays), and the group
    ships those summaries: lengths computed from the payload, and a PayloadRef to the exact
    record of ``trajectories`` the trajectory was read at."""
    run = Run(group_size=2)
    run.start(0)
    values = [encode(trajectory(0, 0, t, float(t)), "Trajectory") for t in (0, 1)]
    run.feed(values[0], topic="gq.trajectories")
    schema, stored = decode(run.table[b"t:train/0/0/0"])
    assert schema == "TrajectorySummary" and "turns" not in stored and "response_mask" not in stored
    assert stored["payload"] == payload_ref("gq.trajectories", 0, 0, len(values[0]))
    assert (stored["num_turns"], stored["prompt_length"], stored["response_length"], stored["model_tokens"]) == (
        1, 2, 2, 2)
    run.feed(values[1], topic="gq.trajectories")
    (group,) = run.on("groups.accepted")
    assert [(t["traj_index"], t["response_level_rewards"], t["payload"]) for t in group["trajectories"]] == [
        (0, 0.0, payload_ref("gq.trajectories", 0, 0, len(values[0]))),
        (1, 1.0, payload_ref("gq.trajectories", 0, 1, len(values[1])))]
    assert all("turns" not in t for t in group["trajectories"])
    assert not any(k.startswith(b"t:") for k in run.table)


def _varint_len(n: int) -> int:
    z, size = (n << 1) ^ (n >> 63), 1
    while z >= 0x80:
        z >>= 7
        size += 1
    return size


def _long_trajectory(t: int, response_tokens: int) -> dict:
    """One turn: 16 prompt tokens, ``response_tokens`` model tokens (numpy, as decoded)."""
    record = trajectory(0, 0, t, float(t % 2))
    record["turns"] = [{"prompt_token_ids": np.arange(16, dtype=np.int32),
                        "response_token_ids": np.arange(response_tokens, dtype=np.int32) % 49152,
                        "infer_logprobs": np.full(response_tokens, -0.5, dtype=np.float32)}]
    record["response_mask"] = np.ones(response_tokens, dtype=np.uint8)
    return record


def test_table_values_and_trajectory_groups_do_not_grow_with_trajectory_length():
    """8 trajectories of 64k tokens vs 8 of 16 tokens: the table values and the emitted
    TrajectoryGroup have the same size, up to the varint widths of the four numbers that say how
    long a trajectory is (response_length, model_tokens, the payload's size_bytes; prompt_length
    and the offsets are equal). The payload events themselves are ~0.5 MiB each."""
    sizes = {}
    for tokens in (16, 65536):
        run = Run(group_size=8)
        run.start(0)
        values = [encode(_long_trajectory(t, tokens), "Trajectory") for t in range(8)]
        stored = []
        for t, value in enumerate(values):
            run.feed(value, topic="gq.trajectories")
            if t < 7:  # the 8th decides the episode, and its members leave the table
                stored.append(run.table[f"t:train/0/0/{t}".encode()])
        (group,) = [v for (topic, *_), v in zip(run.sent, run.sent_values) if topic == "gq.groups.accepted"]
        assert [t["response_length"] for t in decode(group)[1]["trajectories"]] == [tokens] * 8
        sizes[tokens] = {"values": values, "stored": stored, "group": group}
    small, big = sizes[16], sizes[65536]
    assert min(len(v) for v in big["values"]) > 65536 * 8  # ids + logprobs: the payload does grow

    def width(tokens: int, value: bytes) -> int:  # the varints that depend on the length
        return 2 * _varint_len(tokens) + _varint_len(len(value))

    for t in range(7):
        assert len(big["stored"][t]) - len(small["stored"][t]) == (
            width(65536, big["values"][t]) - width(16, small["values"][t]))
    assert len(big["group"]) - len(small["group"]) == sum(
        width(65536, b) - width(16, s) for b, s in zip(big["values"], small["values"]))
    assert len(big["group"]) < 2048


def test_a_member_stored_as_trajectory_bytes_by_the_previous_version_still_ships():
    """A changelog written before summaries holds the member's Trajectory bytes: the group still
    ships it, as a summary with the Trajectory inline as its payload (nothing to fetch)."""
    run = Run(group_size=2)
    run.start(0)
    run.arrive(trajectory(0, 0, 0, 1.0))
    run.table[b"t:train/0/0/0"] = encode(trajectory(0, 0, 0, 1.0), "Trajectory")  # the old table value
    run.arrive(trajectory(0, 0, 1, 0.0))
    (group,) = run.on("groups.accepted")
    old, new = group["trajectories"]
    assert (old["traj_index"], old["response_level_rewards"], old["num_turns"], old["response_length"]) == (
        0, 1.0, 1, 2)
    assert old["payload"]["turns"][0]["response_token_ids"].tolist() == [5, 6]
    assert old["payload"]["response_mask"].tolist() == [1, 1]
    assert (new["traj_index"], new["payload"]["offset"]) == (1, 1)


def test_a_too_large_trajectory_stub_is_set_aside_and_refilled():
    """What an env worker sends for a trajectory above kafka.max_message_bytes (a stub of the same
    identity, env_failed) is set aside as infra_abort and refilled: the episode never waits."""
    run = Run(group_size=2, refill={"max_refills_per_group": 1})
    run.start(0)
    run.arrive(trajectory(0, 0, 0, 1.0))
    stub = too_large_stub(trajectory(0, 0, 1, 0.0), 20_000_000, 16 * 1024 * 1024)
    assert stub["error"].startswith("too_large: Trajectory is 20000000 bytes, above kafka.max_message_bytes = 16777216")
    run.arrive(stub)
    (aside,) = run.on("groups.rejected")
    assert (aside["group_key"], aside["reason"], aside["unit"]) == ("train/0/0/1", "infra_abort", "trajectory")
    (member,) = aside["trajectories"]
    assert (member["stop_reason"], member["env_failed"], member["drop_flag"], member["num_turns"]) == (
        "env_failed", True, True, 0)
    assert member["error"].startswith("too_large:")
    assert [(r["traj_index"], r["cause"]) for r in run.on("episodes.requests")][-1] == (2, "refill")
    run.arrive(trajectory(0, 0, 2, 0.0))
    (group,) = run.on("groups.accepted")
    assert [t["traj_index"] for t in group["trajectories"]] == [0, 2]


class CountingStore(MemoryStore):
    """A MemoryStore that counts the writes it receives (as a table counts changelog records)."""

    puts = 0

    def put(self, partition: int, key: bytes, value: bytes | None) -> None:
        self.puts += 1
        super().put(partition, key, value)


def test_writes_held_over_batches_decide_and_store_exactly_what_direct_writes_do():
    """The faust agent handles events in batches over HeldWrites. Four groups (accepted, zero-std
    rejected and replaced, an env failure refilled) fed event by event to a processor writing
    straight to its table, and in batches of 3 to one writing through HeldWrites: the same events
    sent, the same table in the end, fewer table writes."""
    direct, store = Run(group_size=4, group_filter_cls=STD_FILTER, refill={"max_refills_per_group": 1}), CountingStore()
    held = HeldWrites(store)
    batched = Run(group_size=4, group_filter_cls=STD_FILTER, refill={"max_refills_per_group": 1}, table=held)
    events = [("gq.episodes.control", encode({"command": "start", "mode": "train", "group_id": g}, "GroupCommand"))
              for g in range(4)]
    arrivals = [(0, 0, t, float(t % 2)) for t in range(4)]  # mixed: accepted
    arrivals += [(1, 0, t, 0.0) for t in range(4)] + [(1, 1, t, float(t == 0)) for t in range(4)]  # zero std, replaced
    arrivals += [(2, 0, t, float(t < 2)) for t in (0, 1, 3)] + [(2, 0, 2, -1.0), (2, 0, 4, 0.0)]  # t2 failed, refilled
    arrivals += [(3, 0, t, 1.0) for t in range(3)]  # still open at the end
    events += [("gq.trajectories", encode(trajectory(g, e, t, r, env_failed=r < 0), "Trajectory"))
               for g, e, t, r in arrivals]
    for topic, value in events:
        direct.feed(value, topic=topic)
    for n, (topic, value) in enumerate(events):
        batched.feed(value, topic=topic)
        if n % 3 == 2:
            held.flush()
    held.flush()
    def sent(run: Run) -> list:  # a group's created_ms is the wall clock's, taken when it is decided
        return [(t, k, schema, {**r, "created_ms": None} if "created_ms" in r else r) for t, k, schema, r in run.sent]

    assert sent(batched) == sent(direct) and len(direct.sent) == 39
    assert [r["reason"] for r in direct.on("groups.rejected")] == ["zero_std", "infra_abort"]
    assert [g["group_key"] for g in direct.on("groups.accepted")] == ["train/0/0", "train/1/1", "train/2/0"]
    assert dict(store) == dict(direct.table)
    direct_puts = CountingStore()
    replay = Run(group_size=4, group_filter_cls=STD_FILTER, refill={"max_refills_per_group": 1}, table=direct_puts)
    for topic, value in events:
        replay.feed(value, topic=topic)
    assert store.puts < direct_puts.puts
