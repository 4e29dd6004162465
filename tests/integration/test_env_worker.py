"""The env worker on the real broker with the real model: requests in, trajectories out (packed
payload events), dead letters, committed offsets, replay of requests a stopped worker left
unfinished, and the stub that replaces a trajectory above kafka.max_message_bytes."""

from __future__ import annotations

import json
import re
import threading
import time

import numpy as np
import pytest
import torch

from rollstream.kafka.context import StageContext
from rollstream.kafka.clients import make_producer
from rollstream.schemas import encode
from rollstream.tools.readback import read_topic, read_values
from rollstream.inference.transformers_engine import TransformersBackend
from rollstream.workers.env_worker import EnvSampling, EnvWorker

from ..workers.fault_envs import SlowEnv
from .harness import committed, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def backend() -> TransformersBackend:
    return TransformersBackend(max_num_seqs=16)


def episode_request(traj_index: int, group_id: int = 5, env_type: str = "frozen_lake",
                    env_config: dict | None = None, **overrides) -> dict:
    rec = {
        "mode": "train", "group_id": group_id, "episode_id": 0, "traj_index": traj_index, "tag": "lake",
        "env_type": env_type, "env_config": json.dumps({"is_slippery": False} if env_config is None else env_config),
        "seed": 77, "max_actions_per_traj": 2, "max_tokens_per_step": 8, "env_step_timeout_s": 10.0,
        "format_penalty": -0.1, "cause": "start", "created_ms": 1,
    }
    rec.update(overrides)
    return rec


def send(bootstrap: str, topic: str, items: list[tuple[bytes, bytes]]) -> None:
    producer = make_producer(bootstrap)
    for key, value in items:
        producer.send(topic, key=key, value=value)
    producer.flush()
    producer.close()


def start(worker: EnvWorker, max_idle_s: float | None = None) -> threading.Thread:
    thread = threading.Thread(target=worker.run, kwargs={"max_idle_s": max_idle_s}, daemon=True)
    thread.start()
    return thread


def test_requests_become_trajectories_and_offsets_are_committed(kafka_broker, topic_factory, backend):
    topics = topic_factory(["episodes.requests", "trajectories", "dead-letter"])
    source = topics.episodes_requests
    send(kafka_broker, source, [
        (b"5", encode(episode_request(0), "EpisodeRequest")),
        (b"5", b"\x00not an event"),
        (b"5", encode(episode_request(1), "EpisodeRequest")),
        (b"5", encode(episode_request(1), "EpisodeRequest")),  # a duplicate while #1 plays
    ])
    group = f"{topics.prefix}env"
    worker = EnvWorker(StageContext(kafka_broker, topics, "env"), backend=backend,
                       sampling=EnvSampling.of(None, max_concurrent_episodes=4), group_id=group)
    thread = start(worker, max_idle_s=3.0)
    thread.join(180)
    assert not thread.is_alive()

    records = list(read_topic(kafka_broker, topics.trajectories))
    assert [r.schema for r in records] == ["Trajectory", "Trajectory"]
    assert all(r.key == b"5" for r in records)
    trajs = sorted((r.value for r in records), key=lambda t: t["traj_index"])
    assert [(t["mode"], t["group_id"], t["episode_id"], t["traj_index"]) for t in trajs] == [
        ("train", 5, 0, 0), ("train", 5, 0, 1)]
    for t in trajs:
        assert t["stop_reason"] in ("done", "max_actions") and not t["drop_flag"]
        assert t["worker"] == worker.worker and t["seed"] == 77 and t["tag"] == "lake"
        assert len(t["response_mask"]) == sum(len(x["response_token_ids"]) for x in t["turns"]) + sum(
            len(x["prompt_token_ids"]) for x in t["turns"][1:])
        # packed arrays: numpy views of the event's bytes, one model token per logprob
        assert t["response_mask"].dtype == np.uint8 and int(t["response_mask"].sum()) == sum(
            len(x["infer_logprobs"]) for x in t["turns"])
        assert all(x["response_token_ids"].dtype == np.int32 and x["infer_logprobs"].dtype == np.float32
                   for x in t["turns"])
        assert t["extras"] == {}
    [dead] = read_values(kafka_broker, topics.dead_letter)
    assert (dead["reason"], dead["payload"], dead["offset"]) == ("undecodable", b"\x00not an event", 1)
    assert (worker.emitted, worker.dead_lettered, worker.duplicates_skipped) == (2, 1, 1)
    assert committed(kafka_broker, group, source) == 4

    # a second worker of the same group finds nothing left to do
    again = EnvWorker(StageContext(kafka_broker, topics, "env"), backend=backend, group_id=group)
    thread = start(again, max_idle_s=2.0)
    thread.join(60)
    assert (again.emitted, again.dead_lettered, again.duplicates_skipped) == (0, 0, 0)
    assert len(read_values(kafka_broker, topics.trajectories)) == 2


def test_a_stopped_worker_leaves_unfinished_requests_for_the_next(kafka_broker, topic_factory, backend):
    topics = topic_factory(["episodes.requests", "trajectories", "dead-letter"])
    source = topics.episodes_requests
    SlowEnv.reset_count()  # the first SlowEnv built in this process hangs in reset, later ones do not
    stuck = episode_request(0, env_type="tests.workers.fault_envs:SlowEnv",
                            env_config={"delay_s": 300.0, "slow_on": "reset"}, env_step_timeout_s=600.0)
    send(kafka_broker, source, [
        (b"5", encode(stuck, "EpisodeRequest")),
        (b"5", encode(episode_request(1), "EpisodeRequest")),
    ])
    group = f"{topics.prefix}env"
    first = EnvWorker(StageContext(kafka_broker, topics, "env"), backend=backend, group_id=group)
    thread = start(first)
    wait_for(lambda: first.emitted == 1, timeout=120, what="the fast trajectory")
    time.sleep(0.5)  # a few more loop turns: the stuck one must still hold the offset back
    first.stop()
    thread.join(30)
    assert not thread.is_alive()  # the hanging reset thread did not block the shutdown
    assert committed(kafka_broker, group, source) == 0  # offset 0 is still unfinished

    second = EnvWorker(StageContext(kafka_broker, topics, "env"), backend=backend, group_id=group)
    thread = start(second, max_idle_s=3.0)
    thread.join(120)
    assert not thread.is_alive()
    # the replay plays request 0 (its env is not slow now) and re-emits 1 (downstream dedups)
    assert second.emitted == 2
    trajs = read_values(kafka_broker, topics.trajectories)
    assert sorted(t["traj_index"] for t in trajs) == [0, 1, 1]
    replayed = [t for t in trajs if t["traj_index"] == 0]
    assert replayed[0]["stop_reason"] == "done" and replayed[0]["env_type"].endswith(":SlowEnv")
    assert committed(kafka_broker, group, source) == 2


def agentic_config(topics, env_type: str):
    from rollstream.config import parse_config

    return parse_config({
        "kafka": {"topic_prefix": topics.prefix, "partitions": 1},
        "rollout_batch_size": 2,
        "max_concurrent_episodes": 3,
        "actor_infer": {"generating_args": {"temperature": 0.0, "top_p": 1.0}},
        "train_env_manager": {"num_env_groups": 1, "group_size": 2, "tags": ["count"]},
        "custom_envs": {"count": {"env_type": env_type, "env_config": {"episode_len": 1}}},
    })


def test_run_env_worker_takes_its_settings_from_an_agentic_config(kafka_broker, topic_factory, backend):
    from rollstream.exceptions import ConfigError
    from rollstream.workers.env_worker import run_env_worker

    topics = topic_factory(["episodes.requests", "trajectories", "dead-letter"])
    with pytest.raises(ConfigError, match="cannot import env_type 'gym:Nope-v0'"):
        run_env_worker(StageContext(kafka_broker, topics, "env"), agentic_config(topics, "gym:Nope-v0"), backend=backend)
    config = agentic_config(topics, "tests.workers.fault_envs:CountingEnv")
    env = config.custom_envs["count"]
    reqs = [episode_request(i, env_type=env.env_type, env_config=env.env_config,
                            max_tokens_per_step=env.max_tokens_per_step // 4) for i in (0, 1)]
    send(kafka_broker, topics.episodes_requests, [(b"5", encode(r, "EpisodeRequest")) for r in reqs])
    done: list = []
    context = StageContext.of(config.kafka, kafka_broker, "env")  # as `rollstream worker env` builds it
    thread = threading.Thread(target=lambda: done.append(run_env_worker(
        context, config, backend=backend, group_id=f"{topics.prefix}env", max_idle_s=3.0)))
    thread.start()
    thread.join(120)
    [worker] = done
    assert worker.player.max_concurrent == 3 and worker.player.temperature == 0.0
    # the payload producer is sized and compressed as config.kafka says
    assert worker.max_message_bytes == config.kafka.max_message_bytes == 16 * 1024 * 1024
    assert worker.producer.config["max_request_size"] == config.kafka.max_message_bytes
    assert worker.producer.config["compression_type"] == config.kafka.compression_type == "lz4"
    assert worker.emitted == 2 and dict(worker.stop_reasons) == {"done": 2}
    trajs = sorted(read_values(kafka_broker, topics.trajectories), key=lambda t: t["traj_index"])
    # greedy (temperature 0 from the config): both runs say the same thing
    assert trajs[0]["turns"][0]["response_token_ids"].tolist() == trajs[1]["turns"][0]["response_token_ids"].tolist()
    assert [t["response_level_rewards"] for t in trajs] == [0.5, 0.5]


def test_the_env_worker_loads_the_published_policy_before_new_requests_and_stamps_it(kafka_broker, topic_factory,
                                                                                        tmp_path):
    """A checkpoint published as version 1 (weights visibly moved) is loaded before the request
    that follows it is played; the trajectory says version 1."""
    from rollstream.policy.model import load_model
    from rollstream.trainer.checkpoint import CheckpointStore
    from rollstream.trainer.publisher import PolicyPublisher

    topics = topic_factory(["episodes.requests", "trajectories", "dead-letter", "policy.versions"])
    _, trained = load_model()
    with torch.no_grad():
        trained.model.embed_tokens.weight.add_(0.01)
    path = CheckpointStore(tmp_path).save(1, trained, None, {"step": 0, "group_keys": []})
    publisher = PolicyPublisher(kafka_broker, topics)
    publisher.publish(1, 0, str(path), True)
    publisher.close()
    send(kafka_broker, topics.episodes_requests, [(b"5", encode(episode_request(0), "EpisodeRequest"))])
    fresh = TransformersBackend(max_num_seqs=4)
    worker = EnvWorker(StageContext(kafka_broker, topics, "env"), backend=fresh, group_id=f"{topics.prefix}env")
    thread = start(worker, max_idle_s=3.0)
    thread.join(180)
    assert not thread.is_alive()
    [trajectory] = read_values(kafka_broker, topics.trajectories)
    assert trajectory["policy_version"] == 1 and fresh.policy_version == 1
    assert torch.equal(fresh.model.model.embed_tokens.weight, trained.model.embed_tokens.weight)


def test_a_trajectory_above_max_message_bytes_goes_out_as_a_stub_and_a_dead_letter(kafka_broker, topic_factory,
                                                                                   backend):
    """max_message_bytes 1024: every played trajectory is larger (its first prompt alone is
    hundreds of int32 ids). Each request still gets a Trajectory of its identity (no turns,
    env_failed, drop_flag, error naming the limit), so its episode never waits, plus a too_large
    dead letter; the worker keeps running and commits."""
    topics = topic_factory(["episodes.requests", "trajectories", "dead-letter"])
    send(kafka_broker, topics.episodes_requests, [(b"5", encode(episode_request(i), "EpisodeRequest")) for i in (0, 1)])
    group = f"{topics.prefix}env"
    worker = EnvWorker(StageContext(kafka_broker, topics, "env", max_message_bytes=1024, compression_type="lz4"),
                       backend=backend, group_id=group)
    thread = start(worker, max_idle_s=3.0)
    thread.join(180)
    assert not thread.is_alive()
    assert (worker.emitted, worker.too_large, worker.dead_lettered) == (2, 2, 2)
    stubs = sorted(read_values(kafka_broker, topics.trajectories), key=lambda t: t["traj_index"])
    assert [(t["group_id"], t["episode_id"], t["traj_index"], t["seed"]) for t in stubs] == [
        (5, 0, 0, 77), (5, 0, 1, 77)]
    for t in stubs:
        assert (t["stop_reason"], t["env_failed"], t["drop_flag"], t["env_timeout"], t["success"]) == (
            "env_failed", True, True, False, False)
        assert (t["turns"], t["response_mask"].tolist(), t["extras"]) == ([], [], {})
        match = re.fullmatch(r"too_large: Trajectory is (\d+) bytes, above kafka\.max_message_bytes = 1024 "
                             r"\((\d) turns, (\d+) response tokens; played as (done|max_actions)\); "
                             r"raise kafka\.max_message_bytes to carry it", t["error"])
        assert match is not None, t["error"]
        assert int(match[1]) > 1024 and 1 <= int(match[2]) <= 2 and int(match[3]) >= 1
    dead = read_values(kafka_broker, topics.dead_letter)
    assert [(d["reason"], d["source_topic"], d["key"], d["offset"]) for d in dead] == [
        ("too_large", topics.trajectories, b"5", -1)] * 2
    assert all("kafka.max_message_bytes = 1024" in d["error"] for d in dead)
    assert committed(kafka_broker, group, topics.episodes_requests) == 2
