"""Test harness for the stream processors on the real broker: configs, stage processes, and a
synthetic rollout source that answers generation requests with scripted rewarded responses
(no model), so filtering behaviour is tested exactly."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

import yaml
from kafka import KafkaConsumer, TopicPartition

from rollstream.app.processes import StageProcesses
from rollstream.app.stages import Stage
from rollstream.kafka.clients import make_producer, reader_consumer, wait_for_partitions
from rollstream.kafka.payloads import PayloadWriter
from rollstream.kafka.topics import Topics
from rollstream.schemas import decode, encode
from rollstream.schemas.records import is_payload_ref, response_summary
from rollstream.tools.readback import read_values
from rollstream.trainer.loop import LoopResult
from rollstream.trainer.rollout_stream import RolloutStream

DOMAIN = "synth"

# (prompt_id, sample_index, round) -> (response_level_reward, finish_reason), or None: the sample
# is never answered (a lost response)
Script = Callable[[str, int, int], tuple[float, str] | None]


def commit_every_batch(bootstrap: str, topics: Topics, run_dir: Path, groups_per_batch: int, max_steps: int,
                       **settings) -> LoopResult:
    """The trainer's loop without a model: a RolloutStream of the run whose batches are committed
    as they come (``settings``: StreamSettings fields, or ``control``). Returns how it ended."""
    with RolloutStream(bootstrap, run_dir, groups_per_batch=groups_per_batch, max_steps=max_steps,
                       topic_prefix=topics.prefix, **settings) as stream:
        for batch in stream:
            batch.commit()
    return stream.result


def write_config(tmp_path: Path, topics: Topics, partitions: int, **overrides) -> Path:
    config = {
        "name": "it",
        "kafka": {"topic_prefix": topics.prefix, "partitions": partitions},
        "rollout_batch_size": 4,
        "num_return_sequences_in_group": 4,
        "max_running_prompts": 8,
        "max_prompts_per_batch": 64,
        "max_steps": 1,
        "rewards": {DOMAIN: {"reward_type": "gsm8k",
                             "query_filter_config": {"type": "std_filter", "filter_args": {"std_threshold": 0.0}}}},
        "datasets": [],
    }
    for key, value in overrides.items():
        config[key] = value
    path = tmp_path / f"config-{topics.prefix.strip('.')}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start_stages(config_path: Path, bootstrap: str, log_dir: Path, *stages: Stage) -> StageProcesses:
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = StageProcesses(config_path, bootstrap, log_dir)
    for stage in stages:
        procs.start(stage)
    return procs


def response_payload(prompt_id: str, sample_index: int, round_: int = 0, finish_reason: str = "stop",
                     tokens: int = 4, domain: str = DOMAIN, mode: str = "train", policy_version: int = 0) -> dict:
    """A Response record (the payload on ``responses``): 3 prompt tokens, ``tokens`` response
    tokens (10, 11, ...) with logprob -0.25 each, text ``answer`` (empty without tokens)."""
    return {
        "prompt_id": prompt_id, "domain": domain, "mode": mode, "prompt": f"question {prompt_id}",
        "ground_truth": "1", "round": round_, "sample_index": sample_index,
        "prompt_token_ids": [1, 2, 3], "response_token_ids": list(range(10, 10 + tokens)),
        "infer_logprobs": [-0.25] * tokens, "response_text": "answer" if tokens else "",
        "finish_reason": finish_reason, "error": None, "policy_version": policy_version,
        "generation_ms": 0.0, "created_ms": 0, "extras": {},
    }


def response(prompt_id: str, sample_index: int, round_: int = 0, reward: float = 0.0,
             finish_reason: str = "stop", tokens: int = 4, domain: str = DOMAIN, mode: str = "train",
             scores: dict | None = None, policy_version: int = 0, payload: dict | None = None) -> dict:
    """A RewardedResponse record shaped like the reward worker's: the Response's summary, the
    reward, ``meta.blank_text``, and ``payload``: the given PayloadRef, or (None) the Response of
    ``response_payload`` inline (nothing to fetch; ``PayloadPublisher`` writes it to ``responses``
    and swaps in its reference)."""
    body = response_payload(prompt_id, sample_index, round_, finish_reason, tokens, domain, mode, policy_version)
    return {
        "response": response_summary(body),
        "response_level_reward": reward,
        "scores": scores or {"acc": float(reward >= 1.0)},
        "meta": {"blank_text": "false" if body["response_text"].strip() else "true"},
        "reward_error": None, "reward_ms": 0.0,
        "payload": body if payload is None else payload,
    }


class PayloadPublisher:
    """Plays the generation worker's half of the payload plane: writes the inline Responses of
    RewardedResponse records to ``responses`` (PayloadWriter: waits for the acks) and returns the
    records naming them by PayloadRef, as the reward worker's events do."""

    def __init__(self, bootstrap: str, topics: Topics) -> None:
        self.topics = topics
        self.writer = PayloadWriter(make_producer(bootstrap))

    def refer(self, records: list[dict]) -> list[dict]:
        inline = [k for k, rec in enumerate(records) if not is_payload_ref(rec["payload"])]
        refs = self.writer.write([(self.topics.responses, records[k]["response"]["prompt_id"],
                                   encode(records[k]["payload"], "Response")) for k in inline])
        out = list(records)
        for k, ref in zip(inline, refs):
            out[k] = {**records[k], "payload": ref}
        return out

    def close(self) -> None:
        self.writer.producer.close()


def publish_rewarded(bootstrap: str, topics: Topics, records: list[dict]) -> list[dict]:
    """Write each record's Response to ``responses``, then the RewardedResponses naming them by
    PayloadRef to ``responses.rewarded`` (in order); returns the records as published."""
    publisher = PayloadPublisher(bootstrap, topics)
    try:
        published = publisher.refer(records)
    finally:
        publisher.close()
    produce(bootstrap, topics.responses_rewarded, "RewardedResponse", published)
    return published


def prompt(prompt_id: str, mode: str = "train", text: str | None = None) -> dict:
    return {"prompt_id": prompt_id, "domain": DOMAIN, "mode": mode,
            "prompt": text or f"What is {len(prompt_id)} + 1?", "ground_truth": "1"}


def produce(bootstrap: str, topic: str, schema: str, records: list[dict], key_field: str = "prompt_id") -> None:
    """Send ``records`` to ``topic`` and wait until the broker has every one (a failed send
    raises here, not as a missing event later)."""
    producer = make_producer(bootstrap)
    try:
        sent = []
        for rec in records:
            key = rec["response"][key_field] if schema == "RewardedResponse" else rec[key_field]
            sent.append(producer.send(topic, key=key.encode(), value=encode(rec, schema)))
        producer.flush()
        for future in sent:
            future.get(timeout=60)
    finally:
        producer.close()


class Responder(threading.Thread):
    """Answers every event of ``topic`` (read from the start) with ``answer(record, key)``: a list
    of (topic, key, schema, record) to produce. Records every request it saw."""

    def __init__(self, bootstrap: str, topic: str, answer: Callable[[dict, bytes], list[tuple]]) -> None:
        super().__init__(daemon=True)
        self.bootstrap, self.topic, self.answer = bootstrap, topic, answer
        self.requests: list[dict] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        consumer = reader_consumer(self.bootstrap)
        consumer.assign([TopicPartition(self.topic, p) for p in wait_for_partitions(consumer, self.topic)])
        producer = make_producer(self.bootstrap)
        try:
            while not self.stop_event.is_set():
                for msgs in consumer.poll(timeout_ms=200).values():
                    for m in msgs:
                        _, req = decode(m.value)
                        self.requests.append(req)
                        for topic, key, schema, record in self.answer(req, m.key):
                            producer.send(topic, key=key, value=encode(record, schema))
                producer.flush()
        finally:
            consumer.close()
            producer.close()

    def stop(self) -> None:
        self.stop_event.set()
        self.join(10)


class SyntheticRollout(Responder):
    """Plays generation + reward: each GenerationRequest becomes num_return_sequences scripted
    Response payloads on ``responses`` and then their RewardedResponse events (naming them by
    PayloadRef) on ``responses.rewarded``, the shapes the real workers write."""

    def __init__(self, bootstrap: str, topics: Topics, script: Script,
                 policy_version: Callable[[], int] | None = None) -> None:
        """``policy_version``: the version to stamp each request's responses with (read once per
        request, before the script runs); 0 without it."""
        self.publisher = PayloadPublisher(bootstrap, topics)

        def answer(req: dict, key: bytes) -> list[tuple]:
            records = []
            version = policy_version() if policy_version is not None else 0
            for i in range(req["num_return_sequences"]):
                index = req["sample_offset"] + i
                scripted = script(req["prompt_id"], index, req["round"])
                if scripted is not None:
                    reward, finish = scripted
                    records.append(response(req["prompt_id"], index, req["round"], reward, finish, mode=req["mode"],
                                            policy_version=version))
            return [(topics.responses_rewarded, key, "RewardedResponse", rec) for rec in self.publisher.refer(records)]

        super().__init__(bootstrap, topics.generation_requests, answer)

    def stop(self) -> None:
        super().stop()
        self.publisher.close()


def committed(bootstrap: str, group_id: str, topic: str, partition: int = 0) -> int | None:
    """The offset consumer group ``group_id`` committed on ``topic``/``partition`` (None: none)."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group_id, enable_auto_commit=False)
    try:
        return consumer.committed(TopicPartition(topic, partition))
    finally:
        consumer.close()


def wait_for(predicate: Callable[[], bool], timeout: float = 180.0, interval: float = 0.5, what: str = "",
             stages: StageProcesses | None = None) -> None:
    """Poll ``predicate``; fail at once (with the log tail) if one of ``stages`` died, and with
    every stage's log tail on a timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if stages is not None:
            stages.check()
        time.sleep(interval)
    tails = "".join(f"\n---- {name}:\n{stages.tail(name)}" for name in stages.procs) if stages is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}{tails}")


def wait_for_group(bootstrap: str, group_id: str, members: int, stages: StageProcesses | None = None,
                   timeout: float = 120.0) -> None:
    """Wait until the consumer group ``group_id`` is Stable with ``members`` members: every
    process started has joined and holds its share of the partitions, so no rebalance moves a
    partition while the events that follow are handled."""
    from kafka.admin import KafkaAdminClient
    from kafka.errors import KafkaError

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        def stable() -> bool:
            try:
                group = admin.describe_groups([group_id])[group_id]
            except KafkaError as exc:  # e.g. no coordinator yet, before the first member joins
                if exc.retriable:
                    return False
                raise
            return group["group_state"] == "Stable" and len(group["members"]) == members

        wait_for(stable, timeout=timeout, what=f"group {group_id} stable with {members} members", stages=stages)
    finally:
        admin.close()


def count(bootstrap: str, topic: str) -> int:
    return len(read_values(bootstrap, topic))


# -- agentic -----------------------------------------------------------------------------------

# (EpisodeRequest) -> trajectory fields to override, or None to never answer (a stuck run)
EnvScript = Callable[[dict], dict | None]


def write_agentic_config(tmp_path: Path, topics: Topics, partitions: int, manager: dict | None = None,
                         env: dict | None = None, **overrides) -> Path:
    """An agentic config on ``topics``: one env tag ``lake`` (gymnasium FrozenLake unless ``env``
    says otherwise), ``manager`` merged into train_env_manager."""
    config = {
        "name": "it-agentic",
        "kafka": {"topic_prefix": topics.prefix, "partitions": partitions},
        "rollout_batch_size": 2,
        "max_concurrent_episodes": 8,
        "train_env_manager": {"num_env_groups": 1, "group_size": 2, "tags": ["lake"], **(manager or {})},
        "custom_envs": {"lake": {"env_type": "frozen_lake", "env_config": {"is_slippery": False},
                                 "max_actions_per_traj": 1, "max_tokens_per_step": 4, **(env or {})}},
        "actor_infer": {"generating_args": {"temperature": 1.0}},
        **overrides,
    }
    path = tmp_path / f"agentic-{topics.prefix.strip('.')}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def synthetic_trajectory(request: dict, reward: float = 0.0, **fields) -> dict:
    """A Trajectory answering ``request`` (no model, no environment)."""
    record = {
        "mode": request["mode"], "group_id": request["group_id"], "episode_id": request["episode_id"],
        "traj_index": request["traj_index"], "tag": request["tag"], "env_type": request["env_type"],
        "seed": request["seed"],
        "turns": [{"prompt_token_ids": [1, 2, 3], "response_token_ids": [7, 8], "infer_logprobs": [-0.5, -0.5],
                   "response_text": "[down]", "action": "down", "step_reward": reward}],
        "response_mask": [1, 1], "step_rewards": [reward], "response_level_rewards": reward,
        "success": reward > 0, "stop_reason": "done", "finished_ms": int(time.time() * 1000),
    }
    record.update(fields)
    return record


class SyntheticEnvs(Responder):
    """Plays the env workers: each EpisodeRequest gets the trajectory ``script`` describes, or
    none."""

    def __init__(self, bootstrap: str, topics: Topics, script: EnvScript) -> None:
        def answer(req: dict, key: bytes) -> list[tuple]:
            fields = script(req)
            if fields is None:
                return []
            return [(topics.trajectories, str(req["group_id"]).encode(), "Trajectory",
                     synthetic_trajectory(req, **fields))]

        super().__init__(bootstrap, topics.episodes_requests, answer)
