"""Client factories: every Kafka producer and consumer of the plain workers, the trainer and the
tools is made here, so sizes and security settings (rollstream.kafka.cluster) are set in one
place. Each takes a Cluster or a plain bootstrap string."""

from __future__ import annotations

import time

from kafka import KafkaConsumer, KafkaProducer
from kafka.errors import KafkaTimeoutError
from kafka.structs import OffsetAndMetadata, TopicPartition

from rollstream.kafka.cluster import Bootstrap, as_cluster
from rollstream.runtime import PAYLOAD_MAX_MESSAGE_BYTES


def make_producer(bootstrap: Bootstrap, *, max_request_size: int = PAYLOAD_MAX_MESSAGE_BYTES,
                  compression_type: str = "none", batch_size: int = 16384, **kwargs) -> KafkaProducer:
    """A producer that waits for every in-sync replica (``acks=all``), batches for 5 ms and sends
    records up to ``max_request_size`` bytes (``kafka.max_message_bytes``),
    compressed with ``compression_type`` (``lz4``, ``zstd``, ``gzip`` or ``none``: payload
    producers compress, decision-plane producers need not). ``batch_size``: bytes per partition
    batch (kafka-python's default 16 KiB; bulk loaders ask for more), capped at
    ``max_request_size``. ``kwargs`` (e.g. ``client_id``) go to KafkaProducer."""
    return KafkaProducer(
        **as_cluster(bootstrap).client_kwargs(),
        acks="all",
        linger_ms=5,
        max_request_size=max_request_size,
        # a batch of small records must never exceed the limit either (kafka-python's default
        # batch is 16 KiB; a record larger than the batch size travels alone)
        batch_size=min(batch_size, max_request_size),
        compression_type=None if compression_type == "none" else compression_type,
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


def assigned_consumer(bootstrap: Bootstrap, group_id: str, topic: str, client_id: str, max_poll_records: int,
                      instance: int = 0, instances: int = 1) -> tuple[KafkaConsumer, list[int]]:
    """A consumer owning the partitions ``p % instances == instance`` of ``topic`` by manual
    assignment (no group membership: ``group_id`` only stores committed offsets, which it resumes
    from); returns it with its partition ids."""
    consumer = KafkaConsumer(
        **as_cluster(bootstrap).client_kwargs(), group_id=group_id, enable_auto_commit=False,
        auto_offset_reset="earliest", max_poll_records=max_poll_records, client_id=client_id,
    )
    partitions = [p for p in wait_for_partitions(consumer, topic) if p % instances == instance]
    consumer.assign([TopicPartition(topic, p) for p in partitions])
    return consumer, partitions


def commit_offsets(consumer: KafkaConsumer, topic: str, offsets: dict[int, int]) -> None:
    """Commit ``offsets`` (partition -> next offset to read) of ``topic``; raises kafka-python's
    CommitFailedError when the broker refuses."""
    if offsets:
        consumer.commit({TopicPartition(topic, p): OffsetAndMetadata(o, "", -1) for p, o in offsets.items()})


def reader_consumer(bootstrap: Bootstrap, *topics: str, **kwargs) -> KafkaConsumer:
    """A consumer without a consumer group (nothing committed) that reads from the start: of
    ``topics`` when given (subscribed), else of whatever the caller assigns. For readers that must
    see every event: verdicts, policy versions, replay. ``kwargs`` (e.g. sizes) go to
    KafkaConsumer."""
    return KafkaConsumer(*topics, **as_cluster(bootstrap).client_kwargs(), group_id=None,
                         auto_offset_reset="earliest", enable_auto_commit=False, **kwargs)
