"""Throughput of the filter stage (response aggregation + filters), three ways in one run.

1. ``avro_*_per_s``: single-object encode/decode of one RewardedResponse, the decision-plane
   event the aggregator reads (the response's summary and a PayloadRef: its size does not depend
   on ``--tokens``); ``avro_payload_*`` the same for the Response payload it names (``--tokens``
   response tokens and logprobs, a 64-token prompt, packed arrays), which the aggregator never
   reads. Best of 3 repeats.
2. ``inprocess_responses_per_s``: the pure core the aggregator agent runs, minus Kafka: decode,
   ``prompt_state.step``, for decided prompts the Group (the accepted RewardedResponse bytes
   spliced in) and PromptOutcome records, and per batch of ``--batch`` events one table value per
   changed prompt (as the agent writes them); best of 3 runs.
3. ``kafka_responses_per_s``: the same pre-encoded events, produced to ``responses.rewarded``
   before ONE aggregator worker subprocess starts; timed from the first prompt outcome to the
   last one. Startup (subprocess start -> first outcome) is reported as ``kafka_startup_s``.

Groups of ``--group-size`` alternate mixed rewards (std > 0: accepted) and all-zero rewards
(std == 0: rejected by ``std_filter`` with threshold 0), so the expected split is exact and
checked (``correct``). Never asserts on time: it prints JSON and writes it to ``--out``.

    .venv/bin/python benchmarks/filter_stage.py --responses 8000 --out runs/bench/filter_stage.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import yaml

from rollstream.config import parse_config
from rollstream.kafka.topics import Topics
from rollstream.schemas import decode, encode
from rollstream.schemas.records import payload_ref, response_summary
from rollstream.streams.aggregator_processor import AggregatorProcessor

DOMAIN = "bench"
PARTITIONS = 4
PROMPT_TOKENS = 64
PAYLOAD_TOPIC = "bench.responses"  # where the referenced payloads would be (the aggregator never reads them)
INTERLEAVE = 8  # prompts whose responses are interleaved on the topic, as concurrent generation does
SAFETY_TIMEOUT_S = 300.0


# ---- workload -------------------------------------------------------------------------------


def config_dict(prefix: str, group_size: int) -> dict:
    return {
        "name": "bench-filter-stage",
        "kafka": {"topic_prefix": prefix, "partitions": PARTITIONS},
        "rollout_batch_size": 4,
        "num_return_sequences_in_group": group_size,
        "max_prompts_per_batch": 64,
        "rewards": {DOMAIN: {"reward_type": "gsm8k",
                             "query_filter_config": {"type": "std_filter", "filter_args": {"std_threshold": 0.0}}}},
        "datasets": [],
    }


def make_payload(rng: random.Random, prompt_id: str, sample_index: int, tokens: int) -> dict:
    """A Response record (the payload on ``responses``) with realistic sizes."""
    return {
        "prompt_id": prompt_id, "domain": DOMAIN, "mode": "train",
        "prompt": f"Question {prompt_id}: " + "a natural language word problem " * 8,
        "ground_truth": "42", "round": 0, "sample_index": sample_index,
        "prompt_token_ids": [rng.randrange(150_000) for _ in range(PROMPT_TOKENS)],
        "response_token_ids": [rng.randrange(150_000) for _ in range(tokens)],
        "infer_logprobs": [-rng.random() * 4.0 for _ in range(tokens)],
        "response_text": "step " * tokens,  # ~5 characters a token
        "finish_reason": "stop", "error": None, "policy_version": 3, "generation_ms": 1234.5,
        "created_ms": 1_700_000_000_000, "extras": {},
    }


def make_response(rng: random.Random, prompt_id: str, sample_index: int, reward: float, tokens: int,
                  offset: int = 0) -> dict:
    """A RewardedResponse record as the reward worker writes it: the summary of a ``tokens``-token
    Response and a PayloadRef to it (at ``offset`` of ``responses``), never the arrays."""
    payload = make_payload(rng, prompt_id, sample_index, tokens)
    return {
        "response": response_summary(payload),
        "response_level_reward": reward,
        "scores": {"acc": float(reward >= 1.0), "format": 1.0},
        "meta": {"extracted_answer": "42", "invalid_format": "false", "blank_text": "false"},
        "reward_ms": 1.5,
        "payload": payload_ref(PAYLOAD_TOPIC, offset % PARTITIONS, offset, len(encode(payload, "Response"))),
    }


def make_workload(n_prompts: int, group_size: int, tokens: int, seed: int = 0) -> tuple[list[tuple[bytes, bytes]], int, int]:
    """Pre-encoded (key, value) events, in topic order, and the expected (accepted, rejected).

    Even prompts get one reward of 1.0 (std > 0: accepted), odd prompts all zeros (rejected).
    Responses of ``INTERLEAVE`` consecutive prompts are interleaved. Payloads are built once per
    sample index and only the identity fields vary, to keep the set-up fast.
    """
    rng = random.Random(seed)
    templates = [make_response(rng, "template", i, 0.0, tokens) for i in range(group_size)]
    events: list[tuple[bytes, bytes]] = []
    for start in range(0, n_prompts, INTERLEAVE):
        window = range(start, min(start + INTERLEAVE, n_prompts))
        for i in range(group_size):
            for p in window:
                pid = f"p{p:07d}"
                rec = dict(templates[i])
                rec["response"] = {**templates[i]["response"], "prompt_id": pid,
                                   "prompt": f"Question {pid}: " + "a natural language word problem " * 8}
                rec["response_level_reward"] = 1.0 if (p % 2 == 0 and i == p % group_size) else 0.0
                rec["scores"] = {"acc": rec["response_level_reward"], "format": 1.0}
                offset = len(events)
                rec["payload"] = {**templates[i]["payload"], "partition": offset % PARTITIONS, "offset": offset}
                events.append((pid.encode(), encode(rec, "RewardedResponse")))
    accepted = (n_prompts + 1) // 2 if group_size > 1 else n_prompts
    return events, accepted, n_prompts - accepted


# ---- 1. Avro ----------------------------------------------------------------------------------


def _best_of(record: dict, schema: str, iterations: int, repeats: int) -> tuple[dict, int]:
    data = encode(record, schema)
    best = {"encode": [float("inf")] * 2, "decode": [float("inf")] * 2}  # [wall, cpu]
    for _ in range(repeats):
        for name, fn in (("encode", lambda: encode(record, schema)), ("decode", lambda: decode(data))):
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(iterations):
                fn()
            best[name] = [min(best[name][0], time.perf_counter() - w0), min(best[name][1], time.process_time() - c0)]
    return best, len(data)


def bench_avro(tokens: int, iterations: int, repeats: int = 3) -> dict:
    rng = random.Random(1)
    record = make_response(rng, "p-avro", 0, 1.0, tokens)
    assert decode(encode(record, "RewardedResponse"))[1]["response"]["response_length"] == tokens
    payload = make_payload(rng, "p-avro", 0, tokens)
    assert decode(encode(payload, "Response"))[1]["response_token_ids"].tolist() == payload["response_token_ids"]
    best, size = _best_of(record, "RewardedResponse", iterations, repeats)
    best_payload, payload_size = _best_of(payload, "Response", iterations, repeats)
    return {"avro_encode_per_s": round(iterations / best["encode"][0], 1),
            "avro_decode_per_s": round(iterations / best["decode"][0], 1),
            "avro_encode_per_cpu_s": round(iterations / best["encode"][1], 1),
            "avro_decode_per_cpu_s": round(iterations / best["decode"][1], 1),
            "avro_event_bytes": size,
            "avro_payload_encode_per_s": round(iterations / best_payload["encode"][0], 1),
            "avro_payload_decode_per_s": round(iterations / best_payload["decode"][0], 1),
            "avro_payload_event_bytes": payload_size,
            "avro_iterations": iterations}


# ---- 2. in-process core -----------------------------------------------------------------------


def run_core(events: list[tuple[bytes, bytes]], config, timings: dict | None = None,
             batch: int = 100) -> tuple[int, int]:
    """What the aggregator agent does, minus Kafka (the same AggregatorProcessor over a
    MemoryStore): events of ``responses.rewarded`` handled in batches of ``batch``, then
    ``end_batch`` (each changed prompt's table value packed and written once). Returns
    (accepted, rejected), counted from the Groups sent. With ``timings`` (a dict), the time in
    ``handle`` (decode and apply) and in ``end_batch`` (pack and write) is accumulated."""
    processor = AggregatorProcessor(config)
    topics = processor.topics
    counted = {topics.decision_topic("train", True): [0], topics.decision_topic("train", False): [0]}
    clock = time.perf_counter
    for start in range(0, len(events), batch):
        t0 = clock()
        for offset, (_, value) in enumerate(events[start:start + batch], start):
            for send in processor.handle(topics.responses_rewarded, 0, value, offset=offset).sends:
                if send.topic in counted:
                    counted[send.topic][0] += 1
        t1 = clock()
        processor.end_batch()
        if timings is not None:
            timings["handle"] += t1 - t0
            timings["end_batch"] += clock() - t1
    return counted[topics.decision_topic("train", True)][0], counted[topics.decision_topic("train", False)][0]


def bench_inprocess(events, config, batch: int = 100, repeats: int = 3) -> dict:
    best = [float("inf"), float("inf")]  # [wall, cpu]
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        accepted, rejected = run_core(events, config, batch=batch)
        best = [min(best[0], time.perf_counter() - t0), min(best[1], time.process_time() - c0)]
    elapsed, cpu = best
    timings = {"handle": 0.0, "end_batch": 0.0}
    run_core(events, config, timings, batch=batch)
    n = len(events)
    return {
        "inprocess_responses_per_s": round(n / elapsed, 1),
        "inprocess_responses_per_cpu_s": round(n / cpu, 1),
        "inprocess_batch": batch,
        "inprocess_seconds": round(elapsed, 3),
        "inprocess_accepted": accepted, "inprocess_rejected": rejected,
        "inprocess_us_per_response": {k: round(v / n * 1e6, 2) for k, v in timings.items()},
    }


# ---- 3. Kafka: one aggregator worker subprocess -------------------------------------------------


def produce_events(bootstrap: str, topic: str, events) -> float:
    from rollstream.kafka.clients import make_producer

    t0 = time.perf_counter()
    producer = make_producer(bootstrap, batch_size=1 << 20)  # one bulk load, not a live source
    for key, value in events:
        producer.send(topic, key=key, value=value)
    producer.flush()
    producer.close()
    return time.perf_counter() - t0


def process_cpu_s(pid: int) -> tuple[float, float] | None:
    """(utime, stime) of a live process in seconds, from /proc (Linux); None elsewhere or once it
    is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def bench_kafka(bootstrap: str, events, group_size: int, expected: tuple[int, int], workdir: Path) -> dict:
    from kafka import KafkaConsumer, TopicPartition

    from rollstream.kafka import names
    from rollstream.kafka.admin import create_topics

    topics = Topics(f"bench-{uuid.uuid4().hex[:8]}.")
    create_topics(bootstrap, topics.all(PARTITIONS))
    config_path = workdir / "config.yaml"
    config_path.write_text(yaml.safe_dump(config_dict(topics.prefix, group_size)))
    produce_s = produce_events(bootstrap, topics.responses_rewarded, events)

    want = len(events) // group_size
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                             fetch_max_wait_ms=50)
    tp = TopicPartition(topics.prompt_outcomes, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)

    log_path = workdir / "aggregator.log"
    seen: set[str] = set()
    counts = {"commit": 0, "abort": 0}
    duplicates = 0
    first_at = last_at = None
    first_ts = last_ts = None
    first_cpu = last_cpu = None
    error = None
    started = time.monotonic()
    proc = start_worker("aggregator", config_path, bootstrap, log_path, workdir)
    try:
        while len(seen) < want:
            now = time.monotonic()
            if now - started > SAFETY_TIMEOUT_S:
                error = f"safety timeout: {len(seen)}/{want} outcomes after {SAFETY_TIMEOUT_S:.0f} s"
                break
            if proc.poll() is not None:
                error = f"aggregator exited with {proc.returncode}; see {log_path}"
                break
            for msgs in consumer.poll(timeout_ms=100).values():
                now = time.monotonic()
                for m in msgs:
                    _, outcome = decode(m.value)
                    if first_at is None:
                        first_at, first_ts, first_cpu = now, m.timestamp, process_cpu_s(proc.pid)
                    if outcome["prompt_id"] in seen:
                        duplicates += 1
                        continue
                    seen.add(outcome["prompt_id"])
                    counts[outcome["outcome"]] = counts.get(outcome["outcome"], 0) + 1
                    last_at, last_ts = now, m.timestamp
            if last_at is not None and len(seen) >= want:
                last_cpu = process_cpu_s(proc.pid)
    finally:
        consumer.close()
        stop_worker(proc)
    changelog = f"{names.app_id(topics, names.AGGREGATOR_APP)}-{names.PROMPT_STATE_TABLE}-changelog"
    groups = _end_offsets(bootstrap, [topics.groups_accepted, topics.groups_rejected, changelog])
    result = {
        "kafka_topic_prefix": topics.prefix,
        "kafka_produce_s": round(produce_s, 3),
        "kafka_startup_s": round(first_at - started, 3) if first_at is not None else None,
        "kafka_outcomes": len(seen),
        "kafka_duplicate_outcomes": duplicates,
        "kafka_accepted": counts["commit"],
        "kafka_rejected": counts["abort"],
        "kafka_groups_accepted_records": groups[topics.groups_accepted],
        "kafka_groups_rejected_records": groups[topics.groups_rejected],
        "kafka_changelog_records": groups[changelog],  # table writes: one per prompt and batch
        "kafka_error": error,
    }
    if first_at is not None and last_at is not None and len(seen) == want and last_at > first_at:
        elapsed = last_at - first_at
        result["kafka_seconds"] = round(elapsed, 3)
        result["kafka_responses_per_s"] = round(len(events) / elapsed, 1)
        if first_cpu is not None and last_cpu is not None and sum(last_cpu) > sum(first_cpu):
            user, system = last_cpu[0] - first_cpu[0], last_cpu[1] - first_cpu[1]
            result["kafka_aggregator_cpu_s"] = round(user + system, 2)
            result["kafka_aggregator_user_s"], result["kafka_aggregator_sys_s"] = round(user, 2), round(system, 2)
            result["kafka_responses_per_cpu_s"] = round(len(events) / (user + system), 1)
        # same span by the outcomes' broker timestamps (insensitive to this poller's latency)
        if last_ts and first_ts and last_ts > first_ts:
            result["kafka_responses_per_s_by_record_time"] = round(len(events) / ((last_ts - first_ts) / 1000), 1)
    else:
        result["kafka_seconds"] = None
        result["kafka_responses_per_s"] = None
    result["kafka_correct"] = (error is None and len(seen) == want and
                               (counts["commit"], counts["abort"]) == expected and
                               groups[topics.groups_accepted] == expected[0] and
                               groups[topics.groups_rejected] == expected[1])
    return result


def _end_offsets(bootstrap: str, names: list[str]) -> dict[str, int]:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    try:
        out = {}
        for name in names:
            tps = [TopicPartition(name, p) for p in sorted(consumer.partitions_for_topic(name) or ())]
            out[name] = sum(consumer.end_offsets(tps).values()) if tps else 0
        return out
    finally:
        consumer.close()


# ---- main -------------------------------------------------------------------------------------


def start_worker(stage: str, config_path: Path, bootstrap: str, log_path: Path, workdir: Path) -> subprocess.Popen:
    """``rollstream worker <stage>`` as a subprocess, its output appended to ``log_path``; cwd is
    ``workdir`` so nothing it writes (faust's data dir) lands in the caller's directory."""
    cmd = [sys.executable, "-m", "rollstream", "worker", stage, "--config", str(config_path), "--bootstrap", bootstrap]
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True)


def stop_worker(proc: subprocess.Popen, wait_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after ``wait_s`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def versions() -> dict:
    import fastavro
    import faust
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "faust": faust.__version__,
            "fastavro": fastavro.__version__}


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None, smoke: dict) -> argparse.Namespace:
    """``parser``'s arguments plus ``--smoke``: with it, ``smoke`` (dest -> value) replaces the
    defaults, so the script runs every code path at a tiny size in seconds (what `make test`
    runs, checking the JSON's keys); flags given on the command line still win. The namespace
    has ``smoke`` (bool)."""
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes: every code path in seconds (the test suite runs this)")
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**smoke)
    return parser.parse_args(argv)


def write_result(result: dict, out: Path) -> None:
    """Print the figures as JSON and write them to ``out``."""
    text = json.dumps(result, indent=2)
    print(text)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")


@contextmanager
def kafka_bootstrap(requested: str | None, workdir: Path, result: dict) -> Iterator[str]:
    """``requested``, or an embedded broker under ``workdir`` for the block (its start time and
    kind go into ``result``)."""
    broker = None
    try:
        bootstrap = requested
        if bootstrap is None:
            from rollstream.kafka.broker import EmbeddedBroker

            broker = EmbeddedBroker(workdir / "kafka")
            t0 = time.perf_counter()
            bootstrap = broker.start()
            result["broker_start_s"] = round(time.perf_counter() - t0, 2)
        result["broker"] = "embedded" if broker else "external"
        yield bootstrap
    finally:
        if broker is not None:
            broker.stop()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/filter_stage.json"))
    parser.add_argument("--responses", type=int, default=20000)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--avro-iterations", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=100,
                        help="in-process: events per batch (the aggregator writes each changed prompt once per batch)")
    parser.add_argument("--bootstrap", default=None, help="existing broker; default: start an embedded one")
    parser.add_argument("--skip-kafka", action="store_true", help="only the Avro and in-process figures")
    args = parse_args(parser, argv, {"responses": 16, "tokens": 32, "avro_iterations": 20, "batch": 4})
    if args.group_size < 2:
        parser.error("--group-size must be >= 2 (std_filter needs two rewards to reject)")

    n_prompts = args.responses // args.group_size
    result: dict = {"benchmark": "filter_stage", "smoke": args.smoke, "responses": n_prompts * args.group_size,
                    "prompts": n_prompts, "group_size": args.group_size, "tokens": args.tokens,
                    "prompt_tokens": PROMPT_TOKENS, "partitions": PARTITIONS,
                    "cpu_count": os.cpu_count(), "loadavg_start": [round(x, 2) for x in os.getloadavg()],
                    **versions()}
    config = parse_config(config_dict("bench.", args.group_size))
    t0 = time.perf_counter()
    events, exp_acc, exp_rej = make_workload(n_prompts, args.group_size, args.tokens)
    result["workload_build_s"] = round(time.perf_counter() - t0, 2)
    result["expected_accepted"], result["expected_rejected"] = exp_acc, exp_rej

    result.update(bench_avro(args.tokens, args.avro_iterations))
    result.update(bench_inprocess(events, config, args.batch))
    inprocess_ok = (result["inprocess_accepted"], result["inprocess_rejected"]) == (exp_acc, exp_rej)

    kafka_ok = True
    if not args.skip_kafka:
        with tempfile.TemporaryDirectory(prefix="rollstream-bench-") as tmp:
            workdir = Path(tmp)
            with kafka_bootstrap(args.bootstrap, workdir, result) as bootstrap:
                result.update(bench_kafka(bootstrap, events, args.group_size, (exp_acc, exp_rej), workdir))
                kafka_ok = result["kafka_correct"]
                if not kafka_ok:
                    result["aggregator_log_tail"] = (workdir / "aggregator.log").read_text(errors="replace").splitlines()[-20:]
    result["correct"] = inprocess_ok and kafka_ok
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]

    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
