"""Throughput of the agentic path (group queue + env player), three ways in one run.

1. ``group_queue_inprocess_trajectories_per_s_{default,std}``: pre-encoded Trajectory events (the
   payload events, packed arrays; each event's offset is its index) through
   ``GroupQueueProcessor.handle`` over a MemoryStore (no Kafka), once with the
   default group filter (keeps every group) and once with ``EnvFailureStdGroupFilter`` (drops
   zero-std groups; each drop starts a replacement episode). Same events both times.
2. ``group_queue_kafka_trajectories_per_s``: the same events (std filter) through ONE
   group-queue worker subprocess, timed from the first decided group read back from
   ``groups.accepted``/``groups.rejected`` to the last; the trajectories counted are those
   handled in that span (``kafka_trajectories_timed``, known from the in-process run). The
   worker first handles the ``start`` GroupCommands on ``episodes.control`` and commits them
   (``kafka_prepare_s``; faust reads its two input topics round-robin, so trajectories sent
   with the start commands could be handled before them and dead-lettered as "never
   started"); then the trajectories are produced to the running worker, faster than it handles
   them, so it works through a backlog. ``kafka_startup_s``: first trajectory sent -> first
   decided group. (A worker started on a backlog right after another member of its group left
   was seen to skip an event during its first rebalances; that start-up path is not what this
   measures.)
3. ``env_player_*``: the real model (TransformersBackend on CPU) plays the same N EpisodeRequests
   (frozen_lake, is_slippery false) with ``EpisodePlayer(max_concurrent=1)`` (one
   trajectory at a time, batch 1) and ``max_concurrent=N`` (all waiting turns in one batched
   generate call), in the order batched, sequential, batched (the mean of the two batched runs
   is reported, with both runs). Sampling seeds depend on the request only, so both variants
   sample the same tokens: ``env_player_same_tokens`` counts the trajectories whose tokens match.

Workload of 1 and 2: ``--groups`` env group ids, ``--group-size`` (8) + 1 redundant run per
episode, two episodes open per group id (``max_traj_per_env``), ``--accepted-per-group``
accepted episodes per group id. Every fourth episode (shifted by group id) has all-zero rewards:
the std filter drops it and the workload carries the replacement episode too (the default filter,
which keeps it, then finds the group id complete early and counts those runs as late). A group
id's events come in a random order that respects which episodes are open (the queue's own rules),
the redundant run of each episode only after its group was decided (late); group ids are
interleaved at random. A trajectory has 3 turns: ``--prompt-tokens`` (300) first-turn prompt,
``--response-tokens`` (32) per turn, ``--env-tokens`` (60) per later environment answer.
What each filter must decide (accepted, rejected, late) follows from the workload and is checked
(``*correct``). The group queue keeps and emits TrajectorySummaries (decision plane) that name the
Trajectory by reference: ``trajectory_event_bytes`` is one payload event, ``summary_bytes`` what
the table holds per member, ``group_event_bytes_mean`` an emitted TrajectoryGroup (in process).
Never asserts on time: it prints JSON and writes it to ``--out``.

    .venv/bin/python benchmarks/agentic.py --out runs/bench/agentic.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from filter_stage import (  # noqa: E402
    _end_offsets,
    kafka_bootstrap,
    parse_args,
    process_cpu_s,
    produce_events,
    start_worker,
    stop_worker,
    versions,
    write_result,
)

from rollstream.config import parse_config  # noqa: E402
from rollstream.kafka.topics import Topics  # noqa: E402
from rollstream.schemas import encode  # noqa: E402

PARTITIONS = 4
REDUNDANCY = 1
OPEN_EPISODES = 2  # max_traj_per_env: episodes each group id keeps open at once
ZERO_STD_EVERY = 4  # episode e of group g has all-zero rewards when (e + g) % 4 == 3
TURNS = 3
TAG = "lake"
ENV_TYPE = "frozen_lake"
STD_FILTER = "rollstream.filtering.group_filters:EnvFailureStdGroupFilter"
DEFAULT_FILTER = "rollstream.filtering.group_filters:GroupFilter"
SAFETY_TIMEOUT_S = 300.0
STALL_TIMEOUT_S = 60.0  # no new decided group for this long after the first one: give up


# ---- workload -------------------------------------------------------------------------------


def config_dict(prefix: str, groups: int, group_size: int, accepted_per_group: int, filter_cls: str) -> dict:
    if accepted_per_group % OPEN_EPISODES:
        raise ValueError(f"accepted per group must be a multiple of {OPEN_EPISODES}")
    return {
        "name": "bench-agentic",
        "kafka": {"topic_prefix": prefix, "partitions": PARTITIONS},
        "rollout_batch_size": group_size,
        # accepted episodes per group id = max_traj_per_env * max_steps
        "max_steps": accepted_per_group // OPEN_EPISODES,
        "train_env_manager": {
            "num_env_groups": groups, "group_size": group_size, "group_size_redundancy": REDUNDANCY,
            "tags": [TAG], "max_traj_per_env": OPEN_EPISODES, "group_filter_cls": filter_cls,
            "group_filter_config": {"std_threshold": 0.0}, "max_replaced_episodes": 100_000,
            "episode_timeout_s": 3600.0,
        },
        "custom_envs": {TAG: {"env_type": ENV_TYPE, "env_config": {"is_slippery": False},
                              "max_actions_per_traj": TURNS, "max_tokens_per_step": 32}},
    }


def zero_std(group_id: int, episode_id: int) -> bool:
    return (group_id + episode_id) % ZERO_STD_EVERY == ZERO_STD_EVERY - 1


def template_trajectory(rng: random.Random, prompt_tokens: int, response_tokens: int, env_tokens: int) -> dict:
    """A Trajectory record with realistic sizes; identity and reward fields are set per event."""
    def ids(n: int) -> list[int]:
        return [rng.randrange(49_152) for _ in range(n)]

    turns = []
    for k in range(TURNS):
        turns.append({
            "prompt_token_ids": ids(prompt_tokens if k == 0 else env_tokens),
            "response_token_ids": ids(response_tokens),
            "infer_logprobs": [-rng.random() * 4.0 for _ in range(response_tokens)],
            "response_text": "I should walk down towards the goal and avoid the hole. [down]"[:response_tokens * 4],
            "action": "down", "invalid_move": False, "step_reward": 0.0, "finish_reason": "stop", "env_ms": 0.05,
        })
    mask = []
    for k, t in enumerate(turns):
        if k:
            mask += [0] * len(t["prompt_token_ids"])
        mask += [1] * len(t["response_token_ids"])
    return {
        "mode": "train", "group_id": 0, "episode_id": 0, "traj_index": 0, "tag": TAG, "env_type": ENV_TYPE,
        "seed": 0, "turns": turns, "response_mask": mask, "step_rewards": [0.0] * TURNS,
        "response_level_rewards": 0.0, "success": False, "stop_reason": "max_actions",
        "env_timeout": False, "env_failed": False, "drop_flag": False, "error": None,
        "policy_version": 0, "started_ms": 1_700_000_000_000, "finished_ms": 1_700_000_005_000,
        "worker": "bench-env-0",
    }


def make_workload(config, groups: int, group_size: int, accepted_per_group: int, prompt_tokens: int,
                  response_tokens: int, env_tokens: int, seed: int = 0) -> dict:
    """Start commands, trajectory events in topic order and what each filter must decide.

    The order of one group id's events is drawn step by step: any not yet sent member run (the
    first ``group_size`` of a random order of the episode's runs) of an episode open at that
    point, or the redundant run of an episode already decided (late). Which episodes are open
    follows the group queue's own rules (``rollstream.filtering.group_queue``, std filter), so
    every run arrives while its episode is open, as it would from real env workers. A
    non-zero-std episode rewards runs 0, 3, 6 (any 8 of the 9 have std > 0).
    """
    from rollstream.filtering import group_queue as gq

    rng = random.Random(seed)
    template = template_trajectory(rng, prompt_tokens, response_tokens, env_tokens)
    runs = group_size + REDUNDANCY
    params = gq.QueueParams.from_config(config.train_env_manager, config.episodes_per_group("train"))
    per_group: dict[int, list[tuple[bytes, bytes]]] = {}
    expected = {"default": {"accepted": 0, "rejected": 0, "late": 0},
                "std": {"accepted": 0, "rejected": 0, "late": 0}}
    for g in range(groups):
        # episodes the std filter needs: every zero-std one is dropped and replaced
        episodes, kept = 0, 0
        while kept < accepted_per_group:
            kept += not zero_std(g, episodes)
            episodes += 1
        extra = episodes - accepted_per_group
        expected["std"]["accepted"] += accepted_per_group
        expected["std"]["rejected"] += extra
        expected["std"]["late"] += episodes * REDUNDANCY
        # the default filter keeps the first accepted_per_group episodes; the rest arrive late
        expected["default"]["accepted"] += accepted_per_group
        expected["default"]["late"] += accepted_per_group * REDUNDANCY + extra * runs

        group_seed = config.group_seed("train", g)
        state, _ = gq.start("train", g, group_seed, params, 0)
        orders: dict[int, list[int]] = {}
        members: list[tuple[int, int]] = []  # runs of open episodes still to send
        late: list[tuple[int, int]] = []  # redundant runs of decided episodes

        def opened() -> None:
            for e in state.open:
                if e not in orders:
                    orders[e] = rng.sample(range(runs), runs)
                    members.extend((e, t) for t in orders[e][:group_size])

        def decide(e: int) -> gq.Verdict:
            return gq.Verdict(drop=zero_std(g, e), reason="zero_std")

        opened()
        key = str(g).encode()
        events: list[tuple[bytes, bytes]] = []
        while members or late:
            pool = members if members and (not late or rng.random() < 0.8) else late
            e, t = pool.pop(rng.randrange(len(pool)))
            events.append((key, _encode(template, g, e, t, group_seed)))
            _, effects = gq.on_trajectory(state, params, e, t, False, 0, 0)
            for need in [x for x in effects if isinstance(x, gq.NeedsDecision)]:
                effects += gq.on_verdict(state, params, need.episode_id, decide(need.episode_id), 0)[1]
            if any(isinstance(x, gq.GroupDecided) for x in effects):
                late.extend((e, r) for r in orders[e][group_size:])
                opened()
        if (state.accepted, state.rejected, len(orders)) != (accepted_per_group, extra, episodes):
            raise AssertionError(f"workload of group {g}: {state.accepted} accepted, {state.rejected} rejected "
                                 f"of {len(orders)} episodes; expected {accepted_per_group}, {extra} of {episodes}")
        per_group[g] = events
    # interleave group ids uniformly at random, each keeping its own order
    picks = [g for g, evs in per_group.items() for _ in evs]
    rng.shuffle(picks)
    cursors = dict.fromkeys(per_group, 0)
    ordered = []
    for g in picks:
        ordered.append(per_group[g][cursors[g]])
        cursors[g] += 1
    starts = [(str(g).encode(), encode({"command": "start", "mode": "train", "group_id": g,
                                        "created_ms": 1_700_000_000_000}, "GroupCommand"))
              for g in range(groups)]
    return {"starts": starts, "events": ordered, "expected": expected}


def _encode(template: dict, group_id: int, episode_id: int, traj_index: int, group_seed: int) -> bytes:
    reward = 0.0 if zero_std(group_id, episode_id) else float(traj_index % 3 == 0)
    rec = dict(template, group_id=group_id, episode_id=episode_id, traj_index=traj_index,
               seed=group_seed + episode_id, step_rewards=[0.0] * (TURNS - 1) + [reward],
               response_level_rewards=reward, success=reward > 0,
               stop_reason="done" if reward > 0 else "max_actions")
    return encode(rec, "Trajectory")


# ---- 1. in-process group queue ---------------------------------------------------------------


def bench_inprocess(config, workload: dict, expected: dict) -> dict:
    from rollstream.streams.group_queue_processor import GroupQueueProcessor
    from rollstream.streams.store import MemoryStore

    topics = Topics(config.kafka.topic_prefix)
    table = MemoryStore()
    proc = GroupQueueProcessor(config, table)
    errors = 0
    for offset, (_, value) in enumerate(workload["starts"]):
        errors += proc.handle(topics.episodes_control, 0, value, offset=offset).error is not None
    events = workload["events"]
    sends = {topics.groups_accepted: 0, topics.groups_rejected: 0}
    decided_at: list[int] = []  # index of each event that decided a group
    group_bytes = 0
    summary_bytes: list[int] = []
    t0, c0 = time.perf_counter(), time.process_time()
    for i, (_, value) in enumerate(events):
        handled = proc.handle(topics.trajectories, 0, value, offset=i)
        if handled.error is not None:
            errors += 1
        for s in handled.sends:
            if s.topic in sends:
                sends[s.topic] += 1
                decided_at.append(i)
                group_bytes += len(s.value)
        if not summary_bytes and i >= 1:  # one stored member, outside the hot loop's cost
            summary_bytes = [len(v) for k, v in table.items() if k.startswith(b"t:")][:1]
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    # the outcome, from the group queues' own counters
    got = {"accepted": 0, "rejected": 0, "late": 0}
    complete = 0
    for key, raw in table.items():
        if key.startswith(b"g:"):
            state = json.loads(raw)
            for k in got:
                got[k] += state[k]
            complete += state["status"] == "complete" and not state["open"]
    leftover = sum(1 for k in table if k.startswith(b"t:"))
    groups = config.train_env_manager.num_env_groups
    correct = (errors == 0 and got == expected and complete == groups and leftover == 0
               and sends[topics.groups_accepted] == expected["accepted"]
               and sends[topics.groups_rejected] == expected["rejected"])
    return {"trajectories_per_s": round(len(events) / elapsed, 1),
            "trajectories_per_cpu_s": round(len(events) / cpu, 1),
            "seconds": round(elapsed, 3),
            "us_per_trajectory": round(elapsed / len(events) * 1e6, 1),
            "groups_decided_per_s": round((got["accepted"] + got["rejected"]) / elapsed, 1),
            "accepted": got["accepted"], "rejected": got["rejected"], "late": got["late"],
            "groups_complete": complete, "errors": errors, "correct": correct,
            "summary_bytes": summary_bytes[0] if summary_bytes else None,
            "group_event_bytes_mean": round(group_bytes / max(len(decided_at), 1), 1),
            "first_decided_at": decided_at[0] if decided_at else None,
            "last_decided_at": decided_at[-1] if decided_at else None}


# ---- 2. Kafka: one group-queue worker subprocess --------------------------------------------------


def _committed(bootstrap: str, group_id: str, topic: str, partitions: list[int]) -> dict[int, int]:
    """Offsets ``group_id`` committed on ``topic`` (0 when none yet: an empty partition needs no
    commit to count as done); reads, never joins the group."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group_id, enable_auto_commit=False)
    try:
        offsets = {p: consumer.committed(TopicPartition(topic, p)) for p in partitions}
        return {p: 0 if off is None else off for p, off in offsets.items()}
    finally:
        consumer.close(autocommit=False)


def prepare_queues(bootstrap: str, topics: Topics, config_path: Path, workdir: Path, starts,
                   runs_opened: int) -> tuple[dict, subprocess.Popen]:
    """Start the group-queue worker and open every group queue: send the start commands, wait
    for the EpisodeRequests they cause and for the worker to commit its control offsets. The
    worker is returned running (the caller stops it)."""
    from rollstream.kafka import names

    t0 = time.perf_counter()
    produce_events(bootstrap, topics.episodes_control, starts)
    control_end = _end_offsets_by_partition(bootstrap, topics.episodes_control)
    proc = start_worker("group-queue", config_path, bootstrap, workdir / "group_queue.log", workdir)
    error = None
    deadline = time.monotonic() + SAFETY_TIMEOUT_S
    while True:
        requests = _end_offsets(bootstrap, [topics.episodes_requests])[topics.episodes_requests]
        committed = _committed(bootstrap, names.app_id(topics, names.GROUP_QUEUE_APP), topics.episodes_control,
                               list(control_end))
        if requests >= runs_opened and all(committed[p] >= end for p, end in control_end.items()):
            break
        if proc.poll() is not None:
            error = f"group-queue worker exited with {proc.returncode} while opening the queues"
            break
        if time.monotonic() > deadline:
            error = f"opening the queues: {requests}/{runs_opened} requests after {SAFETY_TIMEOUT_S:.0f} s"
            break
        time.sleep(0.5)
    return {"kafka_prepare_s": round(time.perf_counter() - t0, 2), "kafka_prepare_error": error}, proc


def _end_offsets_by_partition(bootstrap: str, topic: str) -> dict[int, int]:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        return {tp.partition: off for tp, off in consumer.end_offsets(tps).items()}
    finally:
        consumer.close()


def _wait_committed(bootstrap: str, topics: Topics, proc: subprocess.Popen) -> str | None:
    """Wait until the group-queue worker has committed every trajectory (its commits follow its
    sends); the error, or None."""
    from rollstream.kafka import names

    ends = _end_offsets_by_partition(bootstrap, topics.trajectories)
    deadline = time.monotonic() + STALL_TIMEOUT_S
    while time.monotonic() < deadline:
        committed = _committed(bootstrap, names.app_id(topics, names.GROUP_QUEUE_APP), topics.trajectories,
                               list(ends))
        if all(committed[p] >= end for p, end in ends.items()):
            return None
        if proc.poll() is not None:
            return f"group-queue worker exited with {proc.returncode} before committing every trajectory"
        time.sleep(0.5)
    return f"trajectories not all committed {STALL_TIMEOUT_S:.0f} s after the last decided group"


def _produce(bootstrap: str, topic: str, events, compression_type: str) -> float:
    from rollstream.kafka.clients import make_producer

    t0 = time.perf_counter()
    producer = make_producer(bootstrap, batch_size=1 << 20, compression_type=compression_type)
    for key, value in events:
        producer.send(topic, key=key, value=value)
    producer.flush()
    producer.close()
    return time.perf_counter() - t0


def bench_kafka(bootstrap: str, config_dict_: dict, workload: dict, expected: dict, timed: int,
                workdir: Path) -> dict:
    """``timed``: trajectories handled after the event that decides the first group up to the one
    that decides the last (known from the in-process run of the same events): the span the
    read-back timing covers."""
    from rollstream.kafka.admin import create_topics

    topics = Topics(f"bench-{uuid.uuid4().hex[:8]}.")
    raw = {**config_dict_, "kafka": {"topic_prefix": topics.prefix, "partitions": PARTITIONS}}
    # the payload topics (trajectories) as a run creates them: max.message.bytes, compression
    create_topics(bootstrap, topics.all(PARTITIONS), configs=topics.topic_configs(parse_config(raw).kafka))
    config_path = workdir / "config.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    manager = config_dict_["train_env_manager"]
    runs_opened = manager["num_env_groups"] * OPEN_EPISODES * (manager["group_size"] + REDUNDANCY)
    result: dict = {"kafka_topic_prefix": topics.prefix}
    prepared, proc = prepare_queues(bootstrap, topics, config_path, workdir, workload["starts"], runs_opened)
    result.update(prepared)
    try:
        result.update(_timed_run(bootstrap, topics, raw, workload["events"], expected, timed, proc, workdir,
                                 error=result["kafka_prepare_error"]))
    finally:
        stop_worker(proc)
    return result


def _timed_run(bootstrap: str, topics: Topics, raw: dict, events, expected: dict, timed: int,
               proc: subprocess.Popen, workdir: Path, error: str | None) -> dict:
    """Produce the trajectories to the running worker ``proc`` and time the decisions read back
    (see bench_kafka); ``error``: why the queues could not be opened (then nothing is sent)."""
    from kafka import KafkaConsumer, TopicPartition

    from rollstream.tools.readback import read_values

    result: dict = {}
    want = expected["accepted"] + expected["rejected"]
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                             fetch_max_wait_ms=50)
    tps = [TopicPartition(t, p) for t in (topics.groups_accepted, topics.groups_rejected) for p in range(PARTITIONS)]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)

    log_path = workdir / "group_queue.log"
    seen: set[bytes] = set()
    counts = {topics.groups_accepted: 0, topics.groups_rejected: 0}
    duplicates = 0
    first_at = last_at = first_ts = last_ts = first_cpu = last_cpu = None
    started = time.monotonic()
    produced: list[float] = []
    produce_failed: list[BaseException] = []

    def produce() -> None:
        try:
            produced.append(_produce(bootstrap, topics.trajectories, events, parse_config(raw).kafka.compression_type))
        except BaseException as exc:  # reported by the reading loop, which stops at once
            produce_failed.append(exc)

    # compressed as the env workers' payload producers do (kafka.compression_type); in a thread,
    # so decisions are read back while the producer is still sending
    producer = threading.Thread(target=produce, daemon=True)
    if error is None:
        producer.start()
    try:
        while error is None and len(seen) < want:
            if time.monotonic() - started > SAFETY_TIMEOUT_S:
                error = f"safety timeout: {len(seen)}/{want} groups after {SAFETY_TIMEOUT_S:.0f} s"
                break
            if last_at is not None and time.monotonic() - last_at > STALL_TIMEOUT_S:
                error = f"stalled: {len(seen)}/{want} groups, none for {STALL_TIMEOUT_S:.0f} s"
                break
            if proc.poll() is not None:
                error = f"group-queue worker exited with {proc.returncode}; see {log_path}"
                break
            if produce_failed:
                error = f"producing the trajectories failed: {produce_failed[0]!r}"
                break
            for msgs in consumer.poll(timeout_ms=100).values():
                now = time.monotonic()
                for m in msgs:
                    # a decided episode is keyed mode/group/episode; a set-aside run has /traj too
                    if m.key.count(b"/") != 2:
                        continue
                    if first_at is None:
                        first_at, first_ts, first_cpu = now, m.timestamp, process_cpu_s(proc.pid)
                    if m.key in seen:
                        duplicates += 1
                        continue
                    seen.add(m.key)
                    counts[m.topic] += 1
                    last_at, last_ts = now, m.timestamp
            if last_at is not None and len(seen) >= want:
                last_cpu = process_cpu_s(proc.pid)
        if error is None:
            # outside the timing: the late runs that follow the last decision in the log must be
            # handled (and their late metrics sent) before the worker stops
            error = _wait_committed(bootstrap, topics, proc)
    finally:
        consumer.close()
        if producer.is_alive():
            producer.join()
    result["kafka_produce_s"] = round(produced[0], 3) if produced else None
    late = sum(m["value"] for m in read_values(bootstrap, topics.metrics)
               if m["name"] == "group_queue/late_trajectories")
    dead = _end_offsets(bootstrap, [topics.dead_letter])[topics.dead_letter]
    result.update({
        "kafka_startup_s": round(first_at - started, 3) if first_at is not None else None,
        "kafka_groups_decided": len(seen), "kafka_duplicate_groups": duplicates,
        "kafka_accepted": counts[topics.groups_accepted], "kafka_rejected": counts[topics.groups_rejected],
        "kafka_late": int(late), "kafka_dead_letters": dead, "kafka_error": error, "kafka_trajectories_timed": timed,
        "kafka_seconds": None, "group_queue_kafka_trajectories_per_s": None,
    })
    # the first decided group needs at least its own 8 trajectories; the span covers the rest
    if first_at is not None and last_at is not None and len(seen) == want and last_at > first_at:
        elapsed = last_at - first_at
        result["kafka_seconds"] = round(elapsed, 3)
        result["group_queue_kafka_trajectories_per_s"] = round(timed / elapsed, 1)
        if first_cpu is not None and last_cpu is not None and sum(last_cpu) > sum(first_cpu):
            cpu = sum(last_cpu) - sum(first_cpu)  # process_cpu_s: (user, system) seconds
            result["kafka_worker_cpu_s"] = round(cpu, 2)
            result["kafka_worker_user_s"] = round(last_cpu[0] - first_cpu[0], 2)
            result["kafka_worker_sys_s"] = round(last_cpu[1] - first_cpu[1], 2)
            result["group_queue_kafka_trajectories_per_cpu_s"] = round(timed / cpu, 1)
        if first_ts and last_ts and last_ts > first_ts:
            result["group_queue_kafka_trajectories_per_s_by_record_time"] = round(
                timed / ((last_ts - first_ts) / 1000), 1)
    result["kafka_correct"] = (error is None and dead == 0 and duplicates == 0 and
                               (counts[topics.groups_accepted], counts[topics.groups_rejected], int(late)) ==
                               (expected["accepted"], expected["rejected"], expected["late"]))
    return result


# ---- 3. env player: the real model, one trajectory at a time vs batched -------------------------


def player_requests(n: int, actions: int, tokens: int) -> list[dict]:
    return [{
        "mode": "train", "group_id": 0, "episode_id": i // 8, "traj_index": i % 8, "tag": TAG,
        "env_type": ENV_TYPE, "env_config": json.dumps({"is_slippery": False}), "seed": 1000 + i // 8,
        "max_actions_per_traj": actions, "max_tokens_per_step": tokens, "env_step_timeout_s": 60.0,
        "format_penalty": -0.1, "cause": "start", "created_ms": 0,
    } for i in range(n)]


def bench_player(n: int, actions: int, tokens: int) -> dict:
    from rollstream.inference.engine import SamplingParams
    from rollstream.inference.transformers_engine import TransformersBackend
    from rollstream.workers.episodes import EpisodePlayer

    t0 = time.perf_counter()
    backend = TransformersBackend(max_num_seqs=n)
    result: dict = {"env_player_model_load_s": round(time.perf_counter() - t0, 2)}
    # warm-up (first calls allocate), batch 1 and batch n, outside any timing
    warm = backend.tokenizer("Warm up the model", add_special_tokens=False)["input_ids"]
    for rows in (1, n):
        backend.generate([warm] * rows, [1] * rows, [SamplingParams(max_new_tokens=2, seed=1)] * rows)
    requests = player_requests(n, actions, tokens)
    played: dict[str, list[dict]] = {}
    timings: dict[str, list[tuple[float, float, float]]] = {"sequential": [], "batched": []}  # (wall, cpu, load)
    calls: dict[str, int] = {}
    # batched, sequential, batched: the slow sequential run sits between two batched ones, so a
    # change in the machine's other load shows up as a difference between the batched runs
    for name in ("batched", "sequential", "batched"):
        concurrent = n if name == "batched" else 1
        player = EpisodePlayer(backend, temperature=1.0, top_p=1.0, max_concurrent=concurrent, worker="bench")
        load = os.getloadavg()[0]
        t0, c0 = time.perf_counter(), time.process_time()
        trajs = player.play(requests, timeout_s=SAFETY_TIMEOUT_S)
        timings[name].append((time.perf_counter() - t0, time.process_time() - c0, load))
        if name in played and _tokens(played[name]) != _tokens(trajs):
            result["env_player_batched_runs_differ"] = True
        played[name] = trajs
        calls[name] = player.generate_calls
    for name, concurrent in (("sequential", 1), ("batched", n)):
        trajs = played[name]
        elapsed = sum(w for w, _, _ in timings[name]) / len(timings[name])
        cpu = sum(c for _, c, _ in timings[name]) / len(timings[name])
        turns = sum(len(t["turns"]) for t in trajs)
        generated = sum(len(turn["response_token_ids"]) for t in trajs for turn in t["turns"])
        prompt = sum(len(turn["prompt_token_ids"]) for t in trajs for turn in t["turns"])
        result[f"env_player_{name}"] = {
            "max_concurrent": concurrent, "trajectories": len(trajs), "runs": len(timings[name]),
            "seconds": round(elapsed, 2), "cpu_s": round(cpu, 2),
            "run_seconds": [round(w, 2) for w, _, _ in timings[name]],
            "run_loadavg_1m": [round(x, 2) for _, _, x in timings[name]],
            "trajectories_per_s": round(len(trajs) / elapsed, 3),
            "model_tokens_per_s": round(generated / elapsed, 1),
            "model_tokens_per_cpu_s": round(generated / cpu, 1),
            "generated_tokens": generated, "prompt_tokens": prompt, "turns": turns,
            "generate_calls": calls[name], "mean_batch": round(turns / max(calls[name], 1), 2),
            "stop_reasons": _counts(t["stop_reason"] for t in trajs),
            "successes": sum(t["success"] for t in trajs),
        }
    seq, bat = result["env_player_sequential"], result["env_player_batched"]
    result["env_player_sequential_trajectories_per_s"] = seq["trajectories_per_s"]
    result["env_player_batched_trajectories_per_s"] = bat["trajectories_per_s"]
    result["env_player_speedup"] = round(bat["trajectories_per_s"] / seq["trajectories_per_s"], 2)
    result["env_player_speedup_cpu"] = round(seq["cpu_s"] / bat["cpu_s"], 2)
    result["env_player_same_tokens"] = sum(
        a == b for a, b in zip(_tokens(played["sequential"]), _tokens(played["batched"])))
    result["env_player_correct"] = all(
        r["trajectories"] == n and not ({"env_failed", "env_timeout", "engine_error"} & set(r["stop_reasons"]))
        for r in (seq, bat))
    return result


def _tokens(trajs: list[dict]) -> list[list[list[int]]]:
    return [[turn["response_token_ids"] for turn in t["turns"]] for t in trajs]


def _counts(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


# ---- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/agentic.json"))
    parser.add_argument("--groups", type=int, default=128, help="env group ids")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--accepted-per-group", type=int, default=8, help="accepted episodes per group id (even)")
    parser.add_argument("--prompt-tokens", type=int, default=300, help="first-turn prompt tokens")
    parser.add_argument("--response-tokens", type=int, default=32, help="model tokens per turn")
    parser.add_argument("--env-tokens", type=int, default=60, help="tokens of each later environment answer")
    parser.add_argument("--trajectories", type=int, default=16, help="env player: EpisodeRequests played")
    parser.add_argument("--max-actions", type=int, default=2, help="env player: max_actions_per_traj")
    parser.add_argument("--max-tokens", type=int, default=16, help="env player: max_tokens_per_step")
    parser.add_argument("--bootstrap", default=None, help="existing broker; default: start an embedded one")
    parser.add_argument("--skip-kafka", action="store_true")
    parser.add_argument("--skip-player", action="store_true")
    args = parse_args(parser, argv, {"groups": 2, "group_size": 2, "accepted_per_group": OPEN_EPISODES,
                                     "prompt_tokens": 16, "response_tokens": 4, "env_tokens": 4, "trajectories": 2,
                                     "max_actions": 1, "max_tokens": 4})
    if args.group_size < 2:
        parser.error("--group-size must be >= 2 (the std filter needs two rewards)")
    if args.accepted_per_group < OPEN_EPISODES or args.accepted_per_group % OPEN_EPISODES:
        parser.error(f"--accepted-per-group must be a positive multiple of {OPEN_EPISODES}")

    wall0 = time.perf_counter()
    result: dict = {"benchmark": "agentic", "smoke": args.smoke, "groups": args.groups, "group_size": args.group_size,
                    "group_size_redundancy": REDUNDANCY, "max_traj_per_env": OPEN_EPISODES,
                    "accepted_per_group": args.accepted_per_group, "turns": TURNS,
                    "prompt_tokens": args.prompt_tokens, "response_tokens": args.response_tokens,
                    "env_tokens": args.env_tokens, "partitions": PARTITIONS, "cpu_count": os.cpu_count(),
                    "loadavg_start": [round(x, 2) for x in os.getloadavg()], **versions()}
    configs = {name: config_dict("bench.", args.groups, args.group_size, args.accepted_per_group, cls)
               for name, cls in (("default", DEFAULT_FILTER), ("std", STD_FILTER))}
    parsed = {name: parse_config(c) for name, c in configs.items()}
    t0 = time.perf_counter()
    workload = make_workload(parsed["std"], args.groups, args.group_size, args.accepted_per_group,
                             args.prompt_tokens, args.response_tokens, args.env_tokens)
    expected = workload["expected"]
    result["workload_build_s"] = round(time.perf_counter() - t0, 2)
    result["trajectories"] = len(workload["events"])
    result["trajectory_event_bytes"] = len(workload["events"][0][1])
    result["expected"] = expected

    for name in ("default", "std"):
        r = bench_inprocess(parsed[name], workload, expected[name])
        result[f"group_queue_inprocess_{name}"] = r
        result[f"group_queue_inprocess_trajectories_per_s_{name}"] = r["trajectories_per_s"]
    ok = all(result[f"group_queue_inprocess_{n}"]["correct"] for n in ("default", "std"))

    if not args.skip_kafka:
        with tempfile.TemporaryDirectory(prefix="rollstream-bench-") as tmp:
            workdir = Path(tmp)
            with kafka_bootstrap(args.bootstrap, workdir, result) as bootstrap:
                result["kafka_filter"] = "std"
                std = result["group_queue_inprocess_std"]
                timed = (std["last_decided_at"] - std["first_decided_at"] if std["first_decided_at"] is not None
                         else len(workload["events"]))
                result.update(bench_kafka(bootstrap, configs["std"], workload, expected["std"], timed, workdir))
                ok = ok and result["kafka_correct"]
                if not result["kafka_correct"] and (workdir / "group_queue.log").exists():
                    result["group_queue_log_tail"] = (
                        (workdir / "group_queue.log").read_text(errors="replace").splitlines()[-20:])
    del workload

    if not args.skip_player:
        result["env_player_env"] = f"{ENV_TYPE} is_slippery=false"
        result["env_player_max_actions_per_traj"] = args.max_actions
        result["env_player_max_tokens_per_step"] = args.max_tokens
        result.update(bench_player(args.trajectories, args.max_actions, args.max_tokens))
        ok = ok and result["env_player_correct"]

    result["correct"] = ok
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["wall_s"] = round(time.perf_counter() - wall0, 1)
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
