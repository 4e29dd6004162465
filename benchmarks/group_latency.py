"""Latency from a group's completion to its arrival in the trainer's batch builder, through Kafka.

A group is complete when its last response is on ``responses.rewarded`` (the broker acknowledged
it). One aggregator worker (``rollstream worker aggregator``, a subprocess as deployed) decides the
group and writes it to ``groups.accepted``; the trainer's ``BatchBuilder`` (in this process, with
its own consumer settings, started before the first group) consumes it, builds batches (fetching
the payloads) and commits them.
Per group, from the builder's manifest (``arrived_ms``, ``arrival_lag_ms``):

- ``latency_ms``: arrival in the builder - completion (this script's clock for both);
- ``decision_ms``: the Group event's ``created_ms`` (the aggregator decided) - completion;
- ``delivery_ms``: arrival - ``created_ms`` (the groups.accepted hop: producer linger, fetch).

Groups are produced at a steady ``--rate`` (each group's responses back to back, as one generation
request returns them), every one accepted (mixed rewards), after a warm-up group that is not
counted. Reports p50/p90/p99/max; never asserts on time.

    .venv/bin/python benchmarks/group_latency.py --groups 400 --out runs/bench/group_latency.json
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from filter_stage import (  # noqa: E402
    config_dict, kafka_bootstrap, make_payload, parse_args, start_worker, stop_worker, versions, write_result)

from rollstream.kafka.topics import Topics  # noqa: E402
from rollstream.runtime import now_ms  # noqa: E402
from rollstream.schemas import encode  # noqa: E402
from rollstream.schemas.records import payload_ref, response_summary  # noqa: E402
from rollstream.tools.stats import percentiles  # noqa: E402

SAFETY_TIMEOUT_S = 300.0
PARTITIONS = 4


def produce_groups(bootstrap: str, topics: Topics, prompt_ids: list[str], group_size: int, tokens: int,
                   rate: float, completed: dict[str, int]) -> None:
    """Each prompt's payloads on ``responses``, then its RewardedResponses (one reward 1.0, so the
    std filter accepts it); ``completed[prompt_id]``: when the broker acknowledged the last one
    (epoch ms). One group every ``1 / rate`` seconds."""
    from rollstream.kafka.clients import make_producer

    rng = random.Random(0)
    producer = make_producer(bootstrap)  # as the reward worker's: acks=all, 5 ms linger
    start = time.monotonic()
    try:
        for n, pid in enumerate(prompt_ids):
            time.sleep(max(0.0, start + n / rate - time.monotonic()))  # pacing, not a wait for a result
            refs = []
            for i in range(group_size):
                payload = make_payload(rng, pid, i, tokens)
                value = encode(payload, "Response")
                meta = producer.send(topics.responses, key=pid.encode(), value=value).get(timeout=30)
                refs.append((payload, payload_ref(topics.responses, meta.partition, meta.offset, len(value))))
            futures = []
            for i, (payload, ref) in enumerate(refs):
                reward = 1.0 if i == 0 else 0.0
                record = {"response": response_summary(payload), "response_level_reward": reward,
                          "scores": {"acc": reward}, "meta": {}, "reward_ms": 0.0, "payload": ref}
                futures.append(producer.send(topics.responses_rewarded, key=pid.encode(),
                                             value=encode(record, "RewardedResponse")))
            for future in futures:
                future.get(timeout=30)
            completed[pid] = now_ms()
    finally:
        producer.close()


def build_batches(builder, want: int, batch_groups: int) -> tuple[list[dict], str | None]:
    """Build and commit batches until ``want`` more groups are committed (``want`` a multiple of
    ``batch_groups``); the new manifest entries, and an error."""
    entries: list[dict] = []
    deadline = time.monotonic() + SAFETY_TIMEOUT_S
    while len(entries) * batch_groups < want:
        if time.monotonic() > deadline:
            return entries, f"safety timeout: {len(entries) * batch_groups}/{want} groups"
        batch = builder.next_batch(timeout_s=1.0)
        if batch is not None:
            entries.append(builder.commit(batch))
    return entries, None


def bench(bootstrap: str, workdir: Path, groups: int, group_size: int, tokens: int, rate: float,
          batch_groups: int) -> dict:
    from rollstream.kafka.admin import create_topics
    from rollstream.trainer.batch_builder import BatchBuilder

    topics = Topics(f"lat-{uuid.uuid4().hex[:8]}.")
    create_topics(bootstrap, topics.all(PARTITIONS))
    config_path = workdir / "config.yaml"
    config_path.write_text(yaml.safe_dump({**config_dict(topics.prefix, group_size),
                                           "rollout_batch_size": batch_groups}))
    log_path = workdir / "aggregator.log"
    worker = start_worker("aggregator", config_path, bootstrap, log_path, workdir)
    completed: dict[str, int] = {}
    builder = BatchBuilder(bootstrap, topics, batch_groups, group_id=f"{topics.prefix}trainer",
                           manifest_path=workdir / "manifest.jsonl")
    try:
        t0 = time.monotonic()  # the warm-up group: the worker is ready once it is decided
        produce_groups(bootstrap, topics, ["warmup"], group_size, tokens, rate, {})
        warmup = builder.take_partial(timeout_s=SAFETY_TIMEOUT_S, min_groups=1)
        ready_s = time.monotonic() - t0
        error = "the warm-up group was never decided" if warmup is None else None
        if error is None:
            builder.commit(warmup)
            pids = [f"g{n:06d}" for n in range(groups)]
            producer = threading.Thread(target=produce_groups, daemon=True,
                                        args=(bootstrap, topics, pids, group_size, tokens, rate, completed))
            producer.start()
            entries, error = build_batches(builder, groups, batch_groups)
            producer.join(timeout=SAFETY_TIMEOUT_S)
    finally:
        builder.close()
        stop_worker(worker)
    if error is not None:
        return {"error": error, "aggregator_log_tail": log_path.read_text(errors="replace").splitlines()[-20:]}
    latency, decision, delivery = [], [], []
    for entry in entries:
        for key, arrived, lag in zip(entry["group_keys"], entry["arrived_ms"], entry["arrival_lag_ms"]):
            latency.append(arrived - completed[key])
            delivery.append(lag)
            decision.append(arrived - lag - completed[key])
    return {"worker_ready_s": round(ready_s, 2), "groups_measured": len(latency),
            "groups_trained_once": sorted(k for e in entries for k in e["group_keys"]) == sorted(completed),
            "latency_ms": percentiles(latency), "decision_ms": percentiles(decision),
            "delivery_ms": percentiles(delivery), "batches": len(entries)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/group_latency.json"))
    parser.add_argument("--groups", type=int, default=400)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256, help="response tokens per payload")
    parser.add_argument("--rate", type=float, default=20.0, help="groups completed per second")
    parser.add_argument("--batch-groups", type=int, default=8, help="groups per trainer batch")
    parser.add_argument("--bootstrap", default=None, help="existing broker; default: start an embedded one")
    args = parse_args(parser, argv, {"groups": 8, "tokens": 16, "batch_groups": 4})
    if args.groups < 1 or args.groups % args.batch_groups:
        parser.error("--groups must be a positive multiple of --batch-groups")
    result: dict = {"benchmark": "group_latency", "smoke": args.smoke, "groups": args.groups,
                    "group_size": args.group_size, "tokens": args.tokens, "rate_groups_per_s": args.rate,
                    "batch_groups": args.batch_groups, "partitions": PARTITIONS, "cpu_count": os.cpu_count(),
                    "loadavg_start": [round(x, 2) for x in os.getloadavg()], **versions()}
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-") as tmp:
        with kafka_bootstrap(args.bootstrap, Path(tmp), result) as bootstrap:
            result.update(bench(bootstrap, Path(tmp), args.groups, args.group_size, args.tokens, args.rate,
                                args.batch_groups))
    result["correct"] = "error" not in result and result["groups_measured"] == args.groups \
        and result["groups_trained_once"]
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["correct"] else 1)
