"""Cluster administration through the client: readiness, topic creation, co-partitioning.

Used by every stage that creates its topics and by the launcher that waits for its broker.
All timeouts are in seconds.
"""

from __future__ import annotations

import socket
import struct
import time

import kafka.errors as Errors
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

from rollstream.exceptions import BrokerUnreachableError, TopicPartitionsMismatch


def metadata_ready(bootstrap: str, timeout: float = 2.0) -> bool:
    """True when the broker at ``host:port`` answers a Metadata request listing a broker.

    A raw Metadata v4 request (no topics) over one socket: cheaper and more predictable than
    constructing a client on every poll, and v4 is accepted by Kafka 3.x and 4.x alike.
    An empty broker list means the node is up but not yet registered, so it is not ready.
    """
    host, _, port = bootstrap.rpartition(":")
    client_id = b"rollstream-ready"
    # header v1: api_key=3 (Metadata), api_version=4, correlation_id, client_id
    # body v4: topics=[] (int32 0 = none), allow_auto_topic_creation=false
    body = struct.pack(">hhih", 3, 4, 7, len(client_id)) + client_id + struct.pack(">ib", 0, 0)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(struct.pack(">i", len(body)) + body)
            size = struct.unpack(">i", _recv_exact(s, 4))[0]
            resp = _recv_exact(s, size)
    except (OSError, ValueError, struct.error):
        return False
    # response header v0: correlation_id; body v4: throttle_time_ms, brokers array length
    if len(resp) < 12:
        return False
    correlation_id, _throttle, n_brokers = struct.unpack(">iii", resp[:12])
    return correlation_id == 7 and n_brokers > 0


def wait_for_broker(bootstrap: str, timeout: float = 15.0) -> None:
    """Return once a server of the comma-separated ``bootstrap`` list answers Metadata; raise
    BrokerUnreachableError after ``timeout`` seconds."""
    servers = [s.strip() for s in bootstrap.split(",") if s.strip()]
    deadline = time.monotonic() + timeout
    while not any(metadata_ready(server) for server in servers):
        if time.monotonic() > deadline:
            raise BrokerUnreachableError(
                f"no Kafka broker answers at {bootstrap!r} (waited {timeout:.0f} s); start one with "
                "`rollstream broker start` or fix --bootstrap")
        time.sleep(0.5)


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ValueError("connection closed")
        buf += chunk
    return bytes(buf)



def _admin(bootstrap: str) -> KafkaAdminClient:
    return KafkaAdminClient(bootstrap_servers=bootstrap, client_id="rollstream-admin")


def create_topics(bootstrap: str, specs: dict[str, tuple[int, bool]], timeout: float = 30,
                  configs: dict[str, dict[str, str]] | None = None) -> None:
    """Create the missing topics of ``specs`` (full name -> (partitions, compacted)).

    Replication factor 1; ``cleanup.policy=compact`` for compacted topics; ``configs``: more
    topic configs by full name (e.g. the payload topics' ``max.message.bytes``,
    ``Topics.topic_configs``), set on creation and also on topics that already exist (an older
    run's data directory), incrementally. Partition counts of existing topics are left as they
    are (use check_copartitioned to verify them). Returns once every named topic has a leader for
    each partition, or raises KafkaTimeoutError after ``timeout`` s.
    """
    if not specs:
        return
    configs = configs or {}
    admin = _admin(bootstrap)
    try:
        existing = set(admin.list_topics())
        missing = set(specs) - existing
        if missing:
            request = {
                name: {"num_partitions": specs[name][0], "replication_factor": 1,
                       "configs": {**({"cleanup.policy": "compact"} if specs[name][1] else {}),
                                   **configs.get(name, {})}}
                for name in sorted(missing)
            }
            result = admin.create_topics(request, timeout_ms=int(timeout * 1000),
                                         raise_errors=False)
            for t in result["topics"]:
                err = Errors.for_code(t["error_code"])
                # Someone else created it between list and create: fine, that is idempotence.
                if err not in (Errors.NoError, Errors.TopicAlreadyExistsError):
                    raise err(f"creating topic {t['name']}: {t.get('error_message')}")
        update = [ConfigResource(ConfigResourceType.TOPIC, name, configs=dict(configs[name]))
                  for name in sorted(existing & set(specs)) if configs.get(name)]
        if update:
            admin.alter_configs(update, raise_on_unknown=False)
            _wait_for_configs(admin, {r.name: configs[r.name] for r in update}, timeout)
        admin.wait_for_topics(list(specs), timeout_ms=int(timeout * 1000))
    finally:
        admin.close()


def _wait_for_configs(admin: KafkaAdminClient, wanted: dict[str, dict[str, str]], timeout: float) -> None:
    """Until every topic reports ``wanted``'s values (an altered config reaches the brokers
    asynchronously); KafkaTimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        described = admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, name) for name in wanted])["topic"]
        if all(described.get(name, {}).get(key, {}).get("value") == value
               for name, configs in wanted.items() for key, value in configs.items()):
            return
        if time.monotonic() > deadline:
            raise Errors.KafkaTimeoutError(f"topic configs not applied after {timeout:.0f}s: {wanted}")
        time.sleep(0.2)


def topic_partitions(bootstrap: str, names: list[str]) -> dict[str, int]:
    """Partition count of each existing topic among ``names`` (missing topics are left out)."""
    admin = _admin(bootstrap)
    try:
        topics = admin.describe_topics(list(names))
    finally:
        admin.close()
    return {t["name"]: len(t["partitions"]) for t in topics
            if t.get("error_code", 0) == 0 and t.get("partitions")}


def check_copartitioned(bootstrap: str, names: list[str]) -> int:
    """Raise TopicPartitionsMismatch unless all ``names`` exist with one partition count.

    Returns that count. Co-partitioned topics keep one key's events in one partition number.
    """
    if not names:
        raise ValueError("check_copartitioned needs at least one topic name")
    counts = topic_partitions(bootstrap, names)
    missing = sorted(set(names) - set(counts))
    if missing or len(set(counts.values())) > 1:
        raise TopicPartitionsMismatch(
            f"topics are not co-partitioned: partitions {counts}"
            + (f"; missing {missing}" if missing else "")
        )
    return next(iter(counts.values()))
