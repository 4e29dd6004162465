"""Policy versions on the compacted ``policy.versions`` topic (key ``"policy"``).

The trainer publishes one ``PolicyVersion`` per consumed batch once that step's checkpoint is
durable (rollstream.trainer.publisher). Generation and env workers follow it (``PolicyFollower``: load the newest weights before
serving new requests); the admission and the filter stages read the newest version number to
bound staleness (``max_staleness``).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Protocol

from kafka import TopicPartition

from rollstream.exceptions import RollstreamError
from rollstream.kafka.clients import reader_consumer
from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.topics import Topics
from rollstream.schemas import decode

log = logging.getLogger(__name__)

POLICY_KEY = b"policy"
STALENESS_VERSION_MAX_AGE_S = 0.2
"""A stream processor's staleness check may use a policy version this old: one broker round-trip
per 0.2 s instead of one per event."""


class PolicyVersionWatcher:
    """Reads ``policy.versions`` without a consumer group; ``latest()`` returns the newest
    PolicyVersion published so far (or None).

    ``latest()`` reads up to the topic's end offset *at the time of the call*, so any version
    published before an event was produced is seen when that event is handled (the admission
    sees v1, admits a prompt; the generation worker serving it is then sure to see v1 too).
    ``max_age_s`` lets hot paths reuse a recent answer instead of asking the broker again.
    Versions only grow: a lower version than one already seen is ignored. Undecodable records
    are skipped with a warning.
    """

    def __init__(self, bootstrap: Bootstrap, topics: Topics, sync_timeout_s: float = 5.0) -> None:
        self.topic = topics.policy_versions
        self.consumer = reader_consumer(bootstrap)
        self.sync_timeout_s = sync_timeout_s
        self._partitions: list[TopicPartition] = []
        self._latest: dict | None = None
        self._synced_at = -math.inf

    def latest(self, max_age_s: float = 0.0) -> dict | None:
        now = time.monotonic()
        if now - self._synced_at < max_age_s:
            return self._latest
        if not self._partitions:
            partitions = self.consumer.partitions_for_topic(self.topic)
            if not partitions:  # not created yet: nothing published
                return self._latest
            self._partitions = [TopicPartition(self.topic, p) for p in sorted(partitions)]
            self.consumer.assign(self._partitions)
        end = self.consumer.end_offsets(self._partitions)
        deadline = now + self.sync_timeout_s
        while any(self.consumer.position(tp) < end[tp] for tp in self._partitions):
            if time.monotonic() > deadline:
                log.warning("policy versions: not caught up with %s after %.1f s", self.topic, self.sync_timeout_s)
                break
            for records in self.consumer.poll(timeout_ms=100).values():
                for msg in records:
                    self._read(msg)
        self._synced_at = now
        return self._latest

    def _read(self, msg) -> None:
        try:
            name, record = decode(msg.value)
        except RollstreamError as exc:
            log.warning("skipping undecodable %s@%d: %s", self.topic, msg.offset, exc)
            return
        if name == "PolicyVersion" and (self._latest is None or record["version"] > self._latest["version"]):
            self._latest = record

    def latest_version(self, max_age_s: float = 0.0) -> int | None:
        record = self.latest(max_age_s)
        return None if record is None else int(record["version"])

    def close(self) -> None:
        self.consumer.close()


class WeightsLoader(Protocol):
    policy_version: int

    def load_weights(self, path: str, version: int) -> None: ...


class PolicyFollower:
    """Keeps a generation backend on the newest published policy version.

    ``refresh()`` (called before serving new requests) loads the newest checkpoint when its
    version is above the backend's; a record naming the weights already loaded (a skipped step,
    or training off: ``checkpoint`` "" = the initial weights) only moves the version number. A checkpoint that fails to load is logged and not retried; the backend
    keeps its weights and version, so the responses it stamps stay truthful.
    """

    def __init__(self, watcher: PolicyVersionWatcher, backend: WeightsLoader) -> None:
        self.watcher = watcher
        self.backend = backend
        self.loaded = 0  # weight loads done
        self.checkpoint = ""  # where the backend's weights came from ("" = the initial weights)
        self._failed: set[int] = set()

    def refresh(self, max_age_s: float = 0.0) -> int:
        """Returns the backend's policy version after the refresh; ``max_age_s`` as in
        ``PolicyVersionWatcher.latest``."""
        record = self.watcher.latest(max_age_s)
        if record is None or record["version"] <= self.backend.policy_version or record["version"] in self._failed:
            return self.backend.policy_version
        version, path = int(record["version"]), record["checkpoint"]
        if path == self.checkpoint:
            self.backend.policy_version = version
            return version
        try:
            self.backend.load_weights(path, version)
        except Exception as exc:  # a vanished or corrupt checkpoint must not stop the worker
            log.error("cannot load policy version %d from %s: %s", version, path, exc)
            self._failed.add(version)
            return self.backend.policy_version
        self.loaded += 1
        self.checkpoint = path
        log.info("loaded policy version %d from %s", version, path)
        return version

    def close(self) -> None:
        self.watcher.close()
