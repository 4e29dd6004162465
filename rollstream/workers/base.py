"""The thin Kafka shell every plain worker shares.

consume a batch -> decode (undecodable -> dead-letter) -> handler -> produce outputs ->
flush -> commit. Offsets are committed only after every output of the batch is acknowledged, so
a killed worker re-processes (never loses) its last batch; downstream recognises redelivered
events by their deterministic identity.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from kafka import KafkaConsumer, KafkaProducer
from kafka.errors import CommitFailedError, KafkaTimeoutError
from kafka.structs import TopicPartition

from rollstream.exceptions import DecodeError, UnknownFingerprintError
from rollstream.metrics import process_metrics
from rollstream.schemas import decode, encode
from rollstream.topics import Topics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Output:
    """One event to produce: schema ``schema`` encoded on ``topic`` under ``key``."""

    topic: str
    key: str
    schema: str
    record: dict


@dataclass(frozen=True)
class Input:
    """A decoded input event and where it came from."""

    schema: str
    record: dict
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes


BatchHandler = Callable[[Sequence[Input]], Iterable[Output]]


def now_ms() -> int:
    return int(time.time() * 1000)


def worker_id(stage: str) -> str:
    return f"{stage}-{socket.gethostname()}-{os.getpid()}"


def make_producer(bootstrap: str, **kwargs) -> KafkaProducer:
    return KafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        linger_ms=5,
        max_request_size=16 * 1024 * 1024,
        **kwargs,
    )


def wait_for_partitions(consumer: KafkaConsumer, topic: str, timeout_s: float = 60.0) -> list[int]:
    """The topic's partition ids, polling metadata until it has some; KafkaTimeoutError after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (partitions := consumer.partitions_for_topic(topic)):
        if time.monotonic() > deadline:
            raise KafkaTimeoutError(f"topic {topic} has no partitions after {timeout_s:.0f}s")
        time.sleep(0.5)
    return sorted(partitions)


def assigned_consumer(bootstrap: str, group_id: str, topic: str, client_id: str, max_poll_records: int,
                      instance: int = 0, instances: int = 1) -> tuple[KafkaConsumer, list[int]]:
    """A consumer owning the partitions ``p % instances == instance`` of ``topic`` by manual
    assignment (no group membership: ``group_id`` only stores committed offsets, which it resumes
    from); returns it with its partition ids."""
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, group_id=group_id, enable_auto_commit=False,
        auto_offset_reset="earliest", max_poll_records=max_poll_records, client_id=client_id,
    )
    partitions = [p for p in wait_for_partitions(consumer, topic) if p % instances == instance]
    consumer.assign([TopicPartition(topic, p) for p in partitions])
    return consumer, partitions


def decode_expected(value: bytes | None, expected: Sequence[str], where: str = ""
                    ) -> tuple[str, dict, None] | tuple[None, None, tuple[str, str]]:
    """Decode an event that must be one of the ``expected`` schemas.

    Returns ``(schema, record, None)``, or ``(None, None, (reason, error))`` with the dead-letter
    reason every stage uses: ``unknown_schema`` (a fingerprint no schema here has),
    ``undecodable`` (not a single-object Avro event) or ``invalid_event`` (another schema;
    ``where`` is added to the message, e.g. " on <topic>").
    """
    try:
        schema, record = decode(value or b"")
    except UnknownFingerprintError as exc:
        return None, None, ("unknown_schema", str(exc))
    except DecodeError as exc:
        return None, None, ("undecodable", str(exc))
    if schema not in expected:
        return None, None, ("invalid_event", f"expected {' or '.join(expected)}{where}, got {schema}")
    return schema, record, None


def dead_letter(
    topics: Topics, *, topic: str, partition: int, offset: int, key: bytes | None,
    value: bytes | None, reason: str, error: str, worker: str,
) -> Output:
    """A dead-letter event that keeps the original bytes and says why."""
    return Output(
        topic=topics.dead_letter,
        key=topic,
        schema="DeadLetter",
        record={
            "source_topic": topic, "partition": partition, "offset": offset, "key": key,
            "payload": value or b"", "reason": reason, "error": error[:2000], "worker": worker,
            "created_ms": now_ms(),
        },
    )


class StoppableLoop:
    """A worker loop that ends when ``stop()`` sets ``stop_event`` (subclasses create it)."""

    stop_event: threading.Event

    def stop(self, *_: object) -> None:
        self.stop_event.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT stop the loop. Only the main thread may install handlers; a worker run
        in another thread is stopped by its caller via stop()."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)


class EventWorker(StoppableLoop):
    """Run ``handler`` over ``input_topic`` until stopped.

    ``expected_schema`` names the only schema the handler accepts; anything else is
    dead-lettered with reason ``invalid_event``. A handler exception dead-letters the whole batch
    with reason ``handler_error`` (bytes kept), and the worker goes on.

    Partitions are assigned statically: instance ``i`` of ``n`` owns the partitions ``p`` with
    ``p % n == i`` (scale out by starting instances 0..n-1). The group id only stores committed
    offsets. kafka-python 3.0's group membership proved unreliable here: a leader that rejoins
    right after its first assignment could stall in the second rebalance for good, assigned
    nothing, and then die on a refused commit.
    """

    def __init__(
        self,
        *,
        bootstrap: str,
        topics: Topics,
        input_topic: str,
        group_id: str,
        expected_schema: str,
        handler: BatchHandler,
        stage: str,
        max_batch: int = 16,
        poll_timeout_ms: int = 200,
        instance: int = 0,
        instances: int = 1,
    ) -> None:
        if not 0 <= instance < instances:
            raise ValueError(f"instance must be in [0, {instances}), got {instance}")
        self.topics = topics
        self.input_topic = input_topic
        self.expected_schema = expected_schema
        self.handler = handler
        self.stage = stage
        self.worker = worker_id(stage)
        self.max_batch = max_batch
        self.poll_timeout_ms = poll_timeout_ms
        self.stop_event = threading.Event()
        self.processed = 0
        self.dead_lettered = 0
        self.consumer, self.partitions = assigned_consumer(
            bootstrap, group_id, input_topic, self.worker, max_batch, instance, instances)
        self.producer = make_producer(bootstrap, client_id=self.worker)

    def _decode(self, msg) -> tuple[Input | None, Output | None]:
        schema, record, problem = decode_expected(msg.value, (self.expected_schema,))
        if problem is None:
            return Input(schema, record, msg.topic, msg.partition, msg.offset, msg.key, msg.value), None
        return None, dead_letter(
            self.topics, topic=msg.topic, partition=msg.partition, offset=msg.offset,
            key=msg.key, value=msg.value, reason=problem[0], error=problem[1], worker=self.worker,
        )

    def process(self, messages: Sequence) -> list[Output]:
        """Decode and handle one batch of raw messages; returns every output to produce."""
        inputs: list[Input] = []
        outputs: list[Output] = []
        for msg in messages:
            inp, dl = self._decode(msg)
            if dl is not None:
                outputs.append(dl)
            else:
                inputs.append(inp)
        if inputs:
            process_metrics().events.labels(self.stage).inc(len(inputs))
            try:
                outputs.extend(self.handler(inputs))
            except Exception as exc:  # one bad batch never kills the worker
                log.exception("handler failed on %s[%d]@%d", inputs[0].topic, inputs[0].partition, inputs[0].offset)
                outputs.extend(
                    dead_letter(
                        self.topics, topic=i.topic, partition=i.partition, offset=i.offset,
                        key=i.key, value=i.value, reason="handler_error",
                        error=f"{type(exc).__name__}: {exc}", worker=self.worker,
                    )
                    for i in inputs
                )
        self.processed += len(inputs)
        self.dead_lettered += sum(1 for o in outputs if o.topic == self.topics.dead_letter)
        return outputs

    def produce(self, outputs: Iterable[Output]) -> None:
        for out in outputs:
            self.producer.send(out.topic, key=out.key.encode(), value=encode(out.record, out.schema))
        self.producer.flush()

    def run(self, max_idle_s: float | None = None) -> None:
        """Loop until stop() (or SIGTERM), or until ``max_idle_s`` pass with no input."""
        idle_since = time.monotonic()
        try:
            while not self.stop_event.is_set():
                polled = self.consumer.poll(timeout_ms=self.poll_timeout_ms, max_records=self.max_batch)
                messages = [m for batch in polled.values() for m in batch]
                if not messages:
                    if max_idle_s is not None and time.monotonic() - idle_since > max_idle_s:
                        break
                    continue
                idle_since = time.monotonic()
                self.produce(self.process(messages))
                self.commit()
        finally:
            self.close()

    def commit(self) -> None:
        """Commit what was polled, only after every output is acknowledged. A refused commit is
        not fatal: the batch is redelivered after a restart and downstream ignores the duplicates
        by their identity."""
        try:
            self.consumer.commit()
        except CommitFailedError as exc:
            log.warning("offset commit refused (%s); the batch may be redelivered", exc)

    def close(self) -> None:
        try:
            self.producer.flush()
            self.producer.close()
        finally:
            self.consumer.close()
