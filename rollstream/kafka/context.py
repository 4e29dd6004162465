"""What a stage process builds once from its config and hands to its worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.topics import Topics
from rollstream.observability.metrics import WorkerMetrics, process_metrics
from rollstream.runtime import PAYLOAD_MAX_MESSAGE_BYTES, worker_id

if TYPE_CHECKING:
    from rollstream.config.base import KafkaConfig


@dataclass(frozen=True)
class StageContext:
    """One stage process's place in the run: the cluster, the run's topics, which stage it is and
    which instance of ``instances`` (instance ``i`` owns the input partitions
    ``p % instances == i``), and the Kafka settings its clients need: ``max_message_bytes``
    (``kafka.max_message_bytes``: the largest event, which sizes every client) and
    ``compression_type`` (``kafka.compression_type``: the payload producers').

    Raises:
        ValueError: ``instance`` outside [0, ``instances``).
    """

    bootstrap: Bootstrap
    topics: Topics
    stage: str
    instance: int = 0
    instances: int = 1
    max_message_bytes: int = PAYLOAD_MAX_MESSAGE_BYTES
    compression_type: str = "none"

    def __post_init__(self) -> None:
        if not 0 <= self.instance < self.instances:
            raise ValueError(f"instance must be in [0, {self.instances}), got {self.instance}")

    @classmethod
    def of(cls, kafka: "KafkaConfig", bootstrap: Bootstrap, stage: str, instance: int = 0,
           instances: int = 1) -> "StageContext":
        """The context of ``stage`` in the run whose Kafka settings are ``kafka`` (its
        ``topic_prefix`` names the topics)."""
        return cls(bootstrap, Topics(kafka.topic_prefix), stage, instance, instances, kafka.max_message_bytes,
                   kafka.compression_type)

    @property
    def worker(self) -> str:
        """``<stage>-<host>-<pid>``: this process's name in its events, client ids and metrics."""
        return worker_id(self.stage)

    @property
    def metrics(self) -> WorkerMetrics:
        return process_metrics(self.worker)
