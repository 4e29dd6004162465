"""Real RL sizes through the pipeline: payloads written once, decisions on small events.

One case per (group_size, response_tokens): ``--prompts`` prompts (default 64) of random int32
token ids and float32 logprobs; half of the prompts get mixed rewards (accepted by a
``std_filter`` with threshold 0), half all-zero rewards (rejected ``zero_std``). A synthetic source
writes each Response once to ``responses`` (lz4, ``PayloadWriter``) and a RewardedResponse with
its reference to ``responses.rewarded``; ONE aggregator worker subprocess decides; a
``BatchBuilder`` builds trainer batches of the accepted groups, fetching their payloads by
reference (no training step). Per case:

- ``completed``: every prompt decided, every accepted group in a built batch, no stage died;
- ``groups_accepted`` / ``groups_rejected``: decided groups on their topics;
- ``payload_mb``: encoded Response bytes written (MiB, before compression);
- ``bytes_written_per_payload_byte``: the ``.log`` segment bytes of every topic and changelog the
  case wrote (on the broker's disk, compressed where compression is on), over the payload bytes;
- ``aggregator_peak_rss_mb``: the aggregator process's peak RSS (``VmHWM``);
- ``trainer_fetch_mb_per_s``: payload bytes the trainer fetched over the seconds spent fetching;
- ``decision_event_max_bytes``: the largest event on any decision topic (responses.rewarded,
  groups.*, prompt.outcomes, batches); ``changelog_value_max_bytes`` for the aggregator's table.

``--rss-responses 100000,1000000``: instead, small responses (16 tokens, groups of 8) through one
aggregator, its RSS read after each count (flat: state is deleted on decision).

    .venv/bin/python benchmarks/real_sizes.py --out runs/bench/real_sizes.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from filter_stage import kafka_bootstrap, parse_args, start_worker, stop_worker, versions, write_result  # noqa: E402

from rollstream.config import KafkaConfig  # noqa: E402
from rollstream.kafka import names  # noqa: E402
from rollstream.kafka.admin import create_topics  # noqa: E402
from rollstream.kafka.clients import make_producer, reader_consumer  # noqa: E402
from rollstream.kafka.payloads import PayloadWriter  # noqa: E402
from rollstream.kafka.topics import Topics  # noqa: E402
from rollstream.schemas import encode  # noqa: E402
from rollstream.schemas.records import response_summary  # noqa: E402
from rollstream.trainer.batch_builder import BatchBuilder  # noqa: E402

DOMAIN = "bench"
PARTITIONS = 4
PROMPT_TOKENS = 512
GROUPS_PER_BATCH = 4
VOCAB = 151_000
CASES = ((16, 16384), (16, 32768), (8, 65536))
MIB = 1024 * 1024
TIMEOUT_S = 600.0


def config_dict(prefix: str, group_size: int, groups_per_batch: int = GROUPS_PER_BATCH) -> dict:
    return {
        "name": "bench-real-sizes",
        "kafka": {"topic_prefix": prefix, "partitions": PARTITIONS},
        "rollout_batch_size": groups_per_batch,
        "num_return_sequences_in_group": group_size,
        "max_prompts_per_batch": 1024,
        "rewards": {DOMAIN: {"reward_type": "gsm8k",
                             "query_filter_config": {"type": "std_filter", "filter_args": {"std_threshold": 0.0}}}},
        "datasets": [],
    }


def response(rng: np.random.Generator, prompt_id: str, prompt_ids: np.ndarray, sample_index: int, tokens: int) -> dict:
    return {
        "prompt_id": prompt_id, "domain": DOMAIN, "mode": "train", "prompt": f"Question {prompt_id}",
        "ground_truth": "42", "round": 0, "sample_index": sample_index, "prompt_token_ids": prompt_ids,
        "response_token_ids": rng.integers(0, VOCAB, tokens, dtype=np.int32),
        "infer_logprobs": (-4.0 * rng.random(tokens, dtype=np.float32)),
        "response_text": "", "finish_reason": "stop", "policy_version": 0, "generation_ms": 1.0,
        "created_ms": 1_700_000_000_000,
    }


class PeakRss(threading.Thread):
    """Reads a process's ``VmHWM`` (peak resident set, kB) until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak_kb, self.stop = pid, 0, threading.Event()

    def read(self) -> int:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith(("VmHWM:", "VmRSS:")):
                    self.peak_kb = max(self.peak_kb, int(line.split()[1]))
        except OSError:
            pass
        return self.peak_kb

    def current_kb(self) -> int:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def run(self) -> None:
        while not self.stop.wait(0.2):
            self.read()


def log_bytes(data_dir: Path, topic_names: list[str]) -> int:
    """Bytes of the ``.log`` segments of ``topic_names`` under the broker's log directory."""
    total = 0
    for name in topic_names:
        for part in data_dir.glob(f"kraft/{name}-*"):
            if part.name.rsplit("-", 1)[0] == name:
                total += sum(f.stat().st_size for f in part.glob("*.log"))
    return total


def max_event_bytes(bootstrap: str, topic_names: list[str]) -> dict[str, int]:
    """The largest record value on each topic (read from the start)."""
    from kafka import TopicPartition

    consumer = reader_consumer(bootstrap)
    try:
        tps = [TopicPartition(t, p) for t in topic_names for p in sorted(consumer.partitions_for_topic(t) or ())]
        ends = consumer.end_offsets(tps)
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        out = {t: 0 for t in topic_names}
        deadline = time.monotonic() + 120
        while any(consumer.position(tp) < ends[tp] for tp in tps) and time.monotonic() < deadline:
            for tp, records in consumer.poll(timeout_ms=500).items():
                for r in records:
                    out[tp.topic] = max(out[tp.topic], len(r.value or b""))
        return out
    finally:
        consumer.close()


def groups_per_batch(n_prompts: int) -> int:
    """Accepted groups per trainer batch: GROUPS_PER_BATCH, or all of them when fewer (half the
    prompts, rounded up, are accepted). ValueError unless the batches come out whole: a batch
    short of groups would wait for ever."""
    accepted = (n_prompts + 1) // 2
    size = min(GROUPS_PER_BATCH, accepted)
    if size < 1 or accepted % size:
        raise ValueError(f"--prompts {n_prompts}: {accepted} accepted groups do not fill whole batches of {size}")
    return size


def run_case(bootstrap: str, data_dir: Path, workdir: Path, group_size: int, tokens: int, n_prompts: int,
             seed: int = 0) -> dict:
    topics = Topics(f"rs-{uuid.uuid4().hex[:8]}.")
    kafka = KafkaConfig()
    create_topics(bootstrap, topics.all(PARTITIONS), configs=topics.topic_configs(kafka))
    changelogs = names.changelog_topics(topics, PARTITIONS)
    create_topics(bootstrap, changelogs)
    config_path = workdir / f"config-{group_size}x{tokens}.yaml"
    config_path.write_text(yaml.safe_dump(config_dict(topics.prefix, group_size, groups_per_batch(n_prompts))))
    proc = start_worker("aggregator", config_path, bootstrap, workdir / f"aggregator-{config_path.stem}.log", workdir)
    rss = PeakRss(proc.pid)
    rss.start()
    rng = np.random.default_rng(seed)
    producer = make_producer(bootstrap, compression_type=kafka.compression_type, client_id="bench-source")
    writer = PayloadWriter(producer)
    payload_bytes = 0
    expected_accepted = 0
    t0 = time.perf_counter()
    for i in range(n_prompts):
        pid = f"p{i:04d}"
        prompt_ids = rng.integers(0, VOCAB, PROMPT_TOKENS, dtype=np.int32)
        payloads = [response(rng, pid, prompt_ids, s, tokens) for s in range(group_size)]
        values = [encode(r, "Response") for r in payloads]
        payload_bytes += sum(map(len, values))
        refs = writer.write([(topics.responses, pid, v) for v in values])
        mixed = i % 2 == 0
        expected_accepted += mixed
        for s, (payload, ref) in enumerate(zip(payloads, refs)):
            reward = float(s % 2) if mixed else 0.0
            rewarded = {"response": response_summary(payload), "response_level_reward": reward,
                        "scores": {"acc": reward}, "meta": {}, "reward_error": None, "reward_ms": 0.1, "payload": ref}
            producer.send(topics.responses_rewarded, key=pid.encode(), value=encode(rewarded, "RewardedResponse"))
    producer.flush()
    producer.close()
    source_s = time.perf_counter() - t0

    builder = BatchBuilder(bootstrap, topics, groups_per_batch(n_prompts), group_id=f"{topics.prefix}trainer",
                           max_message_bytes=kafka.max_message_bytes)
    batched, error, rows_checked = 0, None, 0
    t1 = time.perf_counter()
    try:
        while batched < expected_accepted:
            if time.perf_counter() - t1 > TIMEOUT_S:
                error = f"timeout: {batched}/{expected_accepted} accepted groups batched"
                break
            if proc.poll() is not None:
                error = f"aggregator exited with {proc.returncode}"
                break
            batch = builder.next_batch(timeout_s=5.0)
            if batch is None:
                continue
            # the rows carry the generated tokens: spot-check the lengths
            rows_checked += int((batch.response_lengths == tokens).sum())
            builder.commit(batch)
            batched += batch.num_groups
        fetch = builder.metrics()
    finally:
        builder.close()
    batch_s = time.perf_counter() - t1
    deadline = time.monotonic() + 120  # the rejected groups may be decided after the last batch
    while (decided := _counts(bootstrap, [topics.prompt_outcomes])[topics.prompt_outcomes]) < n_prompts:
        if time.monotonic() > deadline or proc.poll() is not None:
            error = error or f"{decided}/{n_prompts} prompts decided"
            break
        time.sleep(0.5)
    stop_worker(proc)
    rss.stop.set()
    rss.read()

    decision_topics = [topics.responses_rewarded, topics.groups_accepted, topics.groups_rejected,
                       topics.groups_validation, topics.prompt_outcomes, topics.batches]
    sizes = max_event_bytes(bootstrap, decision_topics + list(changelogs))
    groups = {t: n for t, n in _counts(bootstrap, [topics.groups_accepted, topics.groups_rejected]).items()}
    written = log_bytes(data_dir, list(topics.all(PARTITIONS)) + list(changelogs))
    fetched_mb = fetch["trainer/batch/payload_bytes_fetched"] / MIB
    fetch_s = fetch["trainer/batch/payload_fetch_seconds"]
    accepted, rejected = groups[topics.groups_accepted], groups[topics.groups_rejected]
    return {
        "group_size": group_size, "response_tokens": tokens, "prompts": n_prompts,
        "completed": error is None and batched == expected_accepted and accepted + rejected == n_prompts
                     and rows_checked == expected_accepted * group_size,
        "error": error,
        "groups_accepted": accepted, "groups_rejected": rejected, "groups_batched": batched,
        "payload_mb": round(payload_bytes / MIB, 1),
        "bytes_written_mb": round(written / MIB, 1),
        "bytes_written_per_payload_byte": round(written / payload_bytes, 3),
        "aggregator_peak_rss_mb": round(rss.peak_kb / 1024, 1),
        "trainer_fetch_mb": round(fetched_mb, 1),
        "trainer_fetch_s": round(fetch_s, 2),
        "trainer_fetch_mb_per_s": round(fetched_mb / fetch_s, 1) if fetch_s else None,
        "trainer_payload_records_fetched": fetch["trainer/batch/payload_records_fetched"],
        "trainer_payload_records_expected": expected_accepted * group_size,
        "decision_event_max_bytes": max(sizes[t] for t in decision_topics),
        "decision_event_max_bytes_by_topic": {t.removeprefix(topics.prefix): sizes[t] for t in decision_topics},
        "changelog_value_max_bytes": max(sizes[t] for t in changelogs),
        "source_s": round(source_s, 1), "batching_s": round(batch_s, 1),
    }


def _counts(bootstrap: str, topic_names: list[str]) -> dict[str, int]:
    from kafka import TopicPartition

    consumer = reader_consumer(bootstrap)
    try:
        out = {}
        for t in topic_names:
            tps = [TopicPartition(t, p) for p in sorted(consumer.partitions_for_topic(t) or ())]
            out[t] = sum(consumer.end_offsets(tps).values())
        return out
    finally:
        consumer.close()


def run_rss(bootstrap: str, workdir: Path, checkpoints: list[int], group_size: int = 8, tokens: int = 16) -> dict:
    """Small responses through one aggregator; its RSS after each checkpoint count."""
    topics = Topics(f"rss-{uuid.uuid4().hex[:8]}.")
    create_topics(bootstrap, topics.all(PARTITIONS), configs=topics.topic_configs(KafkaConfig()))
    create_topics(bootstrap, names.changelog_topics(topics, PARTITIONS))
    config_path = workdir / "config-rss.yaml"
    config_path.write_text(yaml.safe_dump(config_dict(topics.prefix, group_size)))
    proc = start_worker("aggregator", config_path, bootstrap, workdir / f"aggregator-{config_path.stem}.log", workdir)
    rss = PeakRss(proc.pid)
    producer = make_producer(bootstrap, client_id="bench-rss")
    rng = np.random.default_rng(1)
    template = response(rng, "p", rng.integers(0, VOCAB, 16, dtype=np.int32), 0, tokens)
    summary = response_summary(template)
    ref = {"topic": topics.responses, "partition": 0, "offset": 0, "size_bytes": 200}
    out, sent, consumer = {"rss_group_size": group_size, "rss_mb_after": {}}, 0, reader_consumer(bootstrap)
    from kafka import TopicPartition

    tp = TopicPartition(topics.prompt_outcomes, 0)
    consumer.assign([tp])
    try:
        for target in sorted(checkpoints):
            while sent < target:
                pid = f"p{sent // group_size:07d}"
                for s in range(group_size):
                    rec = {"response": {**summary, "prompt_id": pid, "sample_index": s}, "response_level_reward": float(s % 2),
                           "scores": {}, "meta": {}, "reward_error": None, "reward_ms": 0.0, "payload": ref}
                    producer.send(topics.responses_rewarded, key=pid.encode(), value=encode(rec, "RewardedResponse"))
                sent += group_size
            producer.flush()
            deadline = time.monotonic() + TIMEOUT_S * 2
            while consumer.end_offsets([tp])[tp] < target // group_size and time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"aggregator exited with {proc.returncode}")
                time.sleep(1.0)
            out["rss_mb_after"][str(target)] = round(rss.current_kb() / 1024, 1)
    finally:
        consumer.close()
        producer.close()
        stop_worker(proc)
    return out


def import_rss_mb() -> float:
    """Peak RSS of a process that only imports the aggregator stage (torch comes with the query
    filters' float32 statistics): the floor under ``aggregator_peak_rss_mb``."""
    code = ("import resource, rollstream.streams.aggregator_agent; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return round(int(out.stdout.strip()) / 1024, 1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/real_sizes.json"))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--cases", default=",".join(f"{g}x{t}" for g, t in CASES),
                        help="comma-separated GROUPxTOKENS, e.g. 16x16384,8x65536")
    parser.add_argument("--rss-responses", default=None, help="e.g. 100000,1000000: the RSS-flatness run instead")
    args = parse_args(parser, argv, {"prompts": 2, "cases": "2x64"})
    try:
        groups_per_batch(args.prompts)
    except ValueError as exc:
        parser.error(str(exc))
    result: dict = {"benchmark": "real_sizes", "smoke": args.smoke, "cpu_count": os.cpu_count(), **versions(),
                    "loadavg_start": [round(x, 2) for x in os.getloadavg()],
                    "aggregator_import_rss_mb": import_rss_mb()}
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-") as tmp:
        workdir = Path(tmp)
        with kafka_bootstrap(None, workdir, result) as bootstrap:
            data_dir = workdir / "kafka"
            if args.rss_responses:
                result.update(run_rss(bootstrap, workdir, [int(x) for x in args.rss_responses.split(",")]))
            else:
                result["cases"] = []
                for case in args.cases.split(","):
                    g, t = (int(x) for x in case.lower().split("x"))
                    result["cases"].append(run_case(bootstrap, data_dir, workdir, g, t, args.prompts))
                    print(result["cases"][-1], file=sys.stderr, flush=True)
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
