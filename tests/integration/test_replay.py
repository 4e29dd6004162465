"""`rollstream replay` on the real broker: selection by predicate, offsets, time and key;
JSON lines; --follow; --to-topic re-injects the exact bytes; --payloads resolves the token
payloads that decision events reference (and nothing is fetched without it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from rollstream.kafka.clients import make_producer, reader_consumer
from rollstream.kafka.payloads import PayloadFetcher, PayloadWriter
from rollstream.schemas import encode
from rollstream.schemas.records import payload_ref, response_summary
from rollstream.tools.readback import read_topic
from rollstream.tools.replay import Payload, Selection, replay

pytestmark = pytest.mark.integration

# record times an hour ago, whole seconds: a fixed date falls behind the broker's retention
# (7 days by default) one day and the broker deletes the records under the test
BASE_MS = (int(time.time()) - 3600) * 1000


def response_payload(key: str, index: int, text: str, tokens: int) -> dict:
    """A Response (the payload on ``responses``): 3 prompt tokens, ``tokens`` response tokens."""
    return {"prompt_id": key, "domain": "math", "mode": "train", "prompt": "1+1=", "ground_truth": "2", "round": 0,
            "sample_index": index, "prompt_token_ids": [1, 2, 3], "response_token_ids": list(range(100, 100 + tokens)),
            "infer_logprobs": [-0.5] * tokens, "response_text": text, "finish_reason": "stop", "error": None,
            "policy_version": 0, "generation_ms": 0.0, "created_ms": 0}


def group(key: str, refs: list[dict], *, accepted: bool = False, reason: str = "all_equal", domain: str = "math",
          texts: tuple[str, ...] = ("2", "2")) -> dict:
    """A Group whose member i names its Response by ``refs[i]`` (and has reward i % 2)."""
    members = [{"response": response_summary(response_payload(key, i, texts[i % len(texts)], 2 + i)),
                "response_level_reward": float(i % 2), "scores": {}, "meta": {}, "reward_error": None,
                "reward_ms": 0.0, "payload": ref} for i, ref in enumerate(refs)]
    return {"group_key": key, "kind": "rlvr", "prompt_id": key, "domain": domain, "mode": "train",
            "accepted": accepted, "reason": reason, "decision_values": {}, "filter_config": "{}",
            "filter_config_hash": "", "policy_version": 0, "rounds": 1, "responses_generated": len(refs),
            "prompt": "1+1=", "ground_truth": "2", "responses": members, "created_ms": 0}


def rejected(key: str, reason: str, domain: str) -> dict:
    # references to Responses never written: replay without --payloads does not look at them
    record = group(key, [payload_ref("nowhere.responses", 0, 2 * i, 64) for i in range(2)], reason=reason,
                   domain=domain)
    record.update(decision_values={"std": 0.0})
    return record


def produce_rejections(bootstrap: str, topic: str) -> None:
    producer = make_producer(bootstrap)
    events = [(b"p0", encode(rejected("p0", "zero_std", "gsm8k"), "Group")),
              (b"p1", encode(rejected("p1", "mean_too_low", "gsm8k"), "Group")),
              (b"junk", b"not avro"),
              (b"p3", encode(rejected("p3", "zero_std", "arithmetic"), "Group")),
              (b"p4", encode(rejected("p4", "zero_std", "gsm8k"), "Group"))]
    for i, (key, value) in enumerate(events):
        producer.send(topic, key=key, value=value, partition=0, timestamp_ms=BASE_MS + 1000 * i)
    producer.flush()
    producer.close()


def cli(*args: str, timeout: float = 60) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "rollstream", "replay", *args], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def test_replay_selects_what_was_filtered_and_why(kafka_broker, topic_factory):
    topics = topic_factory(["groups.rejected", "groups.accepted"])
    produce_rejections(kafka_broker, topics.groups_rejected)
    common = ("-b", kafka_broker, "--prefix", topics.prefix)

    rows = cli("groups.rejected", *common, "-w", "reason=zero_std", "-w", "domain=gsm8k")
    assert [(r["offset"], r["key"], r["value"]["group_key"]) for r in rows] == [(0, "p0", "p0"), (4, "p4", "p4")]
    assert rows[0]["schema"] == "Group" and rows[0]["timestamp_ms"] == BASE_MS
    assert rows[0]["value"]["decision_values"] == {"std": 0.0}

    everything = cli(topics.groups_rejected, "-b", kafka_broker)  # a full topic name works too
    assert [r["offset"] for r in everything] == [0, 1, 2, 3, 4]
    assert everything[2]["schema"] is None and everything[2]["raw_b64"] == "bm90IGF2cm8="
    assert [r["offset"] for r in cli("groups.rejected", *common, "--from-offset", "1", "--to-offset", "4")] == [1, 2, 3]
    assert [r["offset"] for r in cli("groups.rejected", *common, "--since", str(BASE_MS + 1000),
                                     "--until", str(BASE_MS + 3000))] == [1, 2]
    assert [r["key"] for r in cli("groups.rejected", *common, "--key", "p3")] == ["p3"]

    # --to-topic: the selected records, same keys and bytes, into a sandbox topic
    cli("groups.rejected", *common, "-w", "reason=zero_std", "--to-topic", topics.groups_accepted)
    copied = list(read_topic(kafka_broker, topics.groups_accepted))
    originals = {r.offset: r for r in read_topic(kafka_broker, topics.groups_rejected)}
    assert [(c.key, c.raw) for c in copied] == [(originals[o].key, originals[o].raw) for o in (0, 3, 4)]


def test_replay_follow_reads_new_events_live(kafka_broker, topic_factory):
    topics = topic_factory(["groups.rejected"])
    proc = subprocess.Popen([sys.executable, "-m", "rollstream", "replay", "groups.rejected", "-b", kafka_broker,
                             "--prefix", topics.prefix, "--follow", "--limit", "2", "-w", "reason=zero_std"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        produce_rejections(kafka_broker, topics.groups_rejected)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert [json.loads(line)["key"] for line in out.splitlines()] == ["p0", "p3"]


def test_replay_rejects_bad_input_with_a_clear_error(kafka_broker, topic_factory):
    topic_factory(["groups.rejected"])  # under the t-... prefix; the default prefix's topic is created here:
    from rollstream.kafka.admin import create_topics
    from rollstream.kafka.topics import Topics

    create_topics(kafka_broker, {Topics().groups_rejected: (1, False)})
    for args, message in ((("groups.rejected", "-w", "reason"), "bad predicate"),
                          (("no.such.topic",), "does not exist"),
                          (("groups.rejected", "--since", "yesterday"), "ISO 8601"),
                          (("groups.rejected", "-f", "xml"), "jsonl or table"),
                          (("groups.rejected", "--limit", "0"), "--limit must be >= 1"),
                          (("groups.rejected", "-p", "9"), "has no partition [9]")):
        out = subprocess.run([sys.executable, "-m", "rollstream", "replay", *args, "-b", kafka_broker],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and message in " ".join(out.stderr.split()), out.stderr
    # a field no event has: zero records, and a hint why
    out = subprocess.run([sys.executable, "-m", "rollstream", "replay", "groups.rejected", "-b", kafka_broker,
                          "-w", "reasn=zero_std"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "0 records" in out.stderr


def write_payload_run(bootstrap: str, topics) -> list[dict]:
    """Responses on ``responses`` and the Groups naming them on ``groups.rejected``: p0 (two
    responses), p1 (one, plus a reference past the log end), p2 (one). Returns the references."""
    writer = PayloadWriter(make_producer(bootstrap))
    try:
        refs = writer.write([(topics.responses, key, encode(response_payload(key, i, text, n), "Response"))
                             for key, i, text, n in (("p0", 0, "two", 2), ("p0", 1, "three", 3),
                                                     ("p1", 0, "[four] tokens", 4), ("p2", 0, "five", 5))])
    finally:
        writer.producer.close()
    past_end = payload_ref(topics.responses, refs[3]["partition"], refs[3]["offset"] + 10, 64)
    producer = make_producer(bootstrap)
    for g in (group("p0", refs[:2]), group("p1", [refs[2], past_end]), group("p2", refs[3:])):
        producer.send(topics.groups_rejected, key=g["group_key"].encode(), value=encode(g, "Group"), partition=0)
    producer.flush()
    producer.close()
    return refs


def test_replay_payloads_resolves_the_referenced_responses(kafka_broker, topic_factory):
    topics = topic_factory(["groups.rejected", "responses"])
    refs = write_payload_run(kafka_broker, topics)
    common = ("groups.rejected", "-b", kafka_broker, "--prefix", topics.prefix)

    # without --payloads: the references, nothing else
    plain = cli(*common)
    assert [r["key"] for r in plain] == ["p0", "p1", "p2"]
    assert [m["payload"] for m in plain[0]["value"]["responses"]] == refs[:2]
    assert all("response_text" not in m and "payload_tokens" not in m for r in plain for m in r["value"]["responses"])

    shown = cli(*common, "--payloads")
    p0, p1, p2 = (r["value"]["responses"] for r in shown)
    assert [(m["response_text"], m["payload_tokens"]) for m in p0] == [
        ("two", {"prompt": 3, "response": 2}), ("three", {"prompt": 3, "response": 3})]
    assert [m["payload_ref"] for m in p0] == refs[:2]
    assert p0[1]["payload"]["response_token_ids"] == [100, 101, 102]  # the full Response record
    assert p0[1]["payload"]["infer_logprobs"] == [-0.5] * 3 and p0[1]["payload"]["sample_index"] == 1
    assert p0[1]["response"]["response_length"] == 3 and p0[1]["response_level_reward"] == 1.0  # the summary stays
    assert p1[0]["response_text"] == "[four] tokens" and p1[0]["payload_tokens"] == {"prompt": 3, "response": 4}
    assert "is at or after the log end offset" in p1[1]["payload_error"] and p1[1]["payload"]["offset"] == refs[3]["offset"] + 10
    assert p2[0]["response_text"] == "five" and p2[0]["payload_tokens"]["response"] == 5
    # a selection and a limit: only the shown records' payloads
    (only,) = cli(*common, "--payloads", "--key", "p2")
    assert only["value"]["responses"][0]["payload"]["response_text"] == "five"

    # the table view: one line per member with its token counts and text
    out = subprocess.run([sys.executable, "-m", "rollstream", "replay", *common, "--payloads", "-f", "table"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "400"})
    assert out.returncode == 0, out.stderr
    for line in ("#0 prompt=3 response=2 'two'", "#1 prompt=3 response=3 'three'",
                 "#0 prompt=3 response=4 '[four] tokens'", "#0 prompt=3 response=5 'five'"):
        assert line in out.stdout, out.stdout
    assert "payload unavailable" in out.stdout


def test_replay_fetches_once_per_page_and_never_without_payloads(kafka_broker, topic_factory, monkeypatch):
    topics = topic_factory(["groups.rejected", "responses"])
    write_payload_run(kafka_broker, topics)
    calls: list[int] = []
    real_fetch = PayloadFetcher.fetch

    def counting_fetch(self, refs, timeout_s: float = 60.0):  # the real fetch, counted
        refs = list(refs)
        calls.append(len(refs))
        return real_fetch(self, refs, timeout_s)

    monkeypatch.setattr(PayloadFetcher, "fetch", counting_fetch)
    plain = list(replay(kafka_broker, topics.groups_rejected, Selection()))
    assert len(plain) == 3 and calls == [] and all(item.payloads is None for item in plain)
    resolved = list(replay(kafka_broker, topics.groups_rejected, Selection(), payloads=True))
    assert calls == [5]  # one fetch for the page: every reference of the three groups
    assert [len(item.payloads) for item in resolved] == [2, 2, 1]
    assert sum(p.value is not None for item in resolved for p in item.payloads.values()) == 4
    calls.clear()
    limited = list(replay(kafka_broker, topics.groups_rejected, Selection(), payloads=True, limit=1))
    assert len(limited) == 1 and calls == [2]  # only the shown record's references

    # a reference to a topic that does not exist is reported, and the topic is not auto-created
    gone = f"{topics.prefix}gone.responses"
    producer = make_producer(kafka_broker)
    producer.send(topics.groups_rejected, key=b"p9", value=encode(group("p9", [payload_ref(gone, 0, 0, 64)]), "Group"))
    producer.flush()
    producer.close()
    calls.clear()
    (item,) = replay(kafka_broker, topics.groups_rejected, Selection(key="p9"), payloads=True)
    assert item.payloads == {(gone, 0, 0): Payload(None, None, f"{gone}[0] does not exist")} and calls == []
    assert item.shown_value()["responses"][0]["payload_error"] == f"{gone}[0] does not exist"
    consumer = reader_consumer(kafka_broker)
    try:
        assert gone not in consumer.topics()
    finally:
        consumer.close()
