"""Cluster administration through the client: readiness, topic creation, co-partitioning.

Used by every stage that creates its topics and by the launcher that waits for its broker.
All timeouts are in seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import aiokafka.errors
import kafka.errors as Errors
from aiokafka.conn import AIOKafkaConnection, create_conn
from aiokafka.protocol.admin import DescribeConfigsRequest
from aiokafka.protocol.metadata import MetadataRequest
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

from rollstream.exceptions import (BrokerAuthenticationError, BrokerUnreachableError, ConfigError,
                                   TopicPartitionsMismatch)
from rollstream.kafka import names
from rollstream.kafka.cluster import Bootstrap, Cluster, as_cluster
from rollstream.kafka.topics import Topics

if TYPE_CHECKING:
    from rollstream.config.base import KafkaConfig

T = TypeVar("T")


def cluster_brokers(bootstrap: Bootstrap, timeout: float = 5.0) -> int:
    """The number of brokers the cluster at ``bootstrap`` reports (a Metadata request through
    kafka-python's admin client, so TLS and SASL apply). Raises KafkaTimeoutError when no server
    answers within ``timeout`` s and BrokerAuthenticationError when the cluster refuses the
    credentials."""
    admin = _admin(bootstrap, timeout)
    try:
        return len(admin.describe_cluster()["brokers"])
    except AUTH_ERRORS as exc:
        raise authentication_error(bootstrap, exc) from exc
    finally:
        admin.close()


def metadata_ready(bootstrap: Bootstrap, timeout: float = 2.0) -> bool:
    """True when the cluster at ``bootstrap`` answers Metadata listing a broker (a node that is
    up but not yet registered is not ready). An authentication failure is raised
    (BrokerAuthenticationError), never read as "not ready yet"."""
    try:
        return cluster_brokers(bootstrap, timeout) > 0
    except (Errors.KafkaError, OSError, ValueError):
        return False


def wait_for_broker(bootstrap: Bootstrap, timeout: float = 15.0) -> None:
    """Return once the cluster at ``bootstrap`` answers Metadata; raise BrokerUnreachableError
    after ``timeout`` seconds, BrokerAuthenticationError as soon as it refuses the
    credentials."""
    deadline = time.monotonic() + timeout
    while not metadata_ready(bootstrap, timeout=min(5.0, max(1.0, timeout))):
        check_credentials(bootstrap)
        if time.monotonic() > deadline:
            raise BrokerUnreachableError(
                f"no Kafka broker answers at {str(bootstrap)!r} (waited {timeout:.0f} s); start one with "
                "`rollstream broker start`, or fix the address (the config's kafka.bootstrap_servers, "
                "or --bootstrap where a command takes it)")
        time.sleep(0.5)


AUTH_ERRORS = (Errors.SaslAuthenticationFailedError, Errors.IllegalSaslStateError,
               Errors.UnsupportedSaslMechanismError)
AUTH_ERRORS_AIO = (aiokafka.errors.SaslAuthenticationFailed, aiokafka.errors.UnsupportedSaslMechanismError,
                   aiokafka.errors.IllegalSaslStateError)


def authentication_error(bootstrap: Bootstrap, exc: BaseException) -> BrokerAuthenticationError:
    """The clear error for a cluster that refused ``bootstrap``'s credentials (no password in it)."""
    cluster = as_cluster(bootstrap)
    how = " ".join(p for p in (cluster.security_protocol, cluster.sasl_mechanism) if p)
    return BrokerAuthenticationError(
        f"the Kafka cluster at {cluster.bootstrap} refused the credentials ({how}, user "
        f"{cluster.sasl_username!r}): {type(exc).__name__}; check the user and password in the environment "
        "variables that kafka.sasl_username_env / kafka.sasl_password_env name")


def check_credentials(bootstrap: Bootstrap, timeout: float = 5.0) -> None:
    """Raise BrokerAuthenticationError when a server of ``bootstrap`` refuses the SASL
    credentials; return otherwise (also when none answers: that is not an authentication error).

    kafka-python's bootstrap only logs a refused SASL handshake and retries until its timeout, so
    one connection per server is opened with aiokafka, which raises the broker's error."""
    cluster = as_cluster(bootstrap)
    if cluster.sasl_mechanism is None:
        return

    async def probe() -> BaseException | None:
        for server in cluster.servers:
            try:
                conn = await _connect(cluster, server, timeout)
            except AUTH_ERRORS_AIO as exc:
                return exc
            except (aiokafka.errors.KafkaError, OSError, asyncio.TimeoutError):
                continue
            conn.close()
        return None

    problem = _run(lambda: asyncio.wait_for(probe(), timeout * max(1, len(cluster.servers)) + 1))
    if problem is not None:
        raise authentication_error(bootstrap, problem) from problem


def _run(make: Callable[[], Awaitable[T]]) -> T:
    """``asyncio.run(make())``, also for a caller whose thread already runs an event loop (a
    notebook, an async application), where asyncio.run refuses: there in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


async def _connect(cluster: Cluster, server: str, timeout: float) -> AIOKafkaConnection:
    """An aiokafka connection to the one broker at ``server`` (``host:port``), with the
    cluster's TLS and SASL settings: how a request reaches a broker of our choosing."""
    host, _, port = server.rpartition(":")
    return await asyncio.wait_for(
        create_conn(host, int(port), client_id="rollstream-admin", request_timeout_ms=int(timeout * 1000),
                    ssl_context=cluster.ssl_context(), security_protocol=cluster.security_protocol,
                    sasl_mechanism=cluster.sasl_mechanism, sasl_plain_username=cluster.sasl_username,
                    sasl_plain_password=cluster.sasl_password),
        timeout)


def _admin(bootstrap: Bootstrap, timeout: float = 30.0) -> KafkaAdminClient:
    try:
        return KafkaAdminClient(**as_cluster(bootstrap).client_kwargs(), client_id="rollstream-admin",
                                bootstrap_timeout_ms=int(timeout * 1000))
    except AUTH_ERRORS as exc:
        raise authentication_error(bootstrap, exc) from exc


def replication_factor(bootstrap: Bootstrap, configured: int | None) -> int:
    """``configured``, or (None) the smaller of 3 and the number of brokers the cluster reports.
    Raises ConfigError when ``configured`` exceeds the brokers there are."""
    brokers = cluster_brokers(bootstrap)
    if configured is None:
        return min(3, brokers)
    if configured > brokers:
        raise ConfigError(f"kafka.replication_factor is {configured} but the cluster at {str(bootstrap)} "
                          f"reports {brokers} broker(s)")
    return configured


def create_topics(bootstrap: Bootstrap, specs: dict[str, tuple[int, bool]], timeout: float = 30,
                  configs: dict[str, dict[str, str]] | None = None, replicas: int | None = None) -> None:
    """Create the missing topics of ``specs`` (full name -> (partitions, compacted)).

    ``replicas``: the replication factor (None: the smaller of 3 and the cluster's brokers,
    see replication_factor; 3 is asked for first, since the controller knows every broker it
    has unfenced while the metadata replication_factor read may lag one that just joined);
    ``cleanup.policy=compact`` for compacted topics; ``configs``: more topic configs by full
    name (e.g. the payload topics' ``max.message.bytes``, ``Topics.topic_configs``), set on
    creation and also on topics that already exist (an older run's data directory),
    incrementally. Partition counts of existing topics are left as they are (use
    check_copartitioned to verify them). Returns once every broker of the cluster reports every
    named topic with a leader for each partition (a topic created here: with its partitions and
    replicas) and the configs it was given, so a client may ask any broker next; raises
    KafkaTimeoutError after ``timeout`` s per wait.
    """
    if not specs:
        return
    configs = configs or {}
    unset = replicas is None
    replicas = replication_factor(bootstrap, replicas)
    for name, topic_configs in configs.items():
        if int(topic_configs.get("min.insync.replicas", 1)) > replicas:
            raise ConfigError(f"{name}: min.insync.replicas {topic_configs['min.insync.replicas']} > replication "
                              f"factor {replicas}: no write could ever succeed")
    admin = _admin(bootstrap)
    try:
        existing = set(admin.list_topics())
        missing = set(specs) - existing
        wanted = {name: TopicWanted() for name in specs}  # what every broker must report
        attempts = [3, replicas] if unset and replicas < 3 else [replicas]
        for attempt, factor in enumerate(attempts, 1):
            if not missing:
                break
            request = {
                name: {"num_partitions": specs[name][0], "replication_factor": factor,
                       "configs": {**({"cleanup.policy": "compact"} if specs[name][1] else {}),
                                   **configs.get(name, {})}}
                for name in sorted(missing)
            }
            result = admin.create_topics(request, timeout_ms=int(timeout * 1000),
                                         raise_errors=False)
            missing = set()
            for t in result["topics"]:
                err = Errors.for_code(t["error_code"])
                if err is Errors.InvalidReplicationFactorError and attempt < len(attempts):  # fewer brokers
                    missing.add(t["name"])
                elif err is Errors.NoError:
                    wanted[t["name"]] = TopicWanted(specs[t["name"]][0], factor)
                # Someone else created it between list and create: fine, that is idempotence.
                elif err is not Errors.TopicAlreadyExistsError:
                    raise err(f"creating topic {t['name']}: {t.get('error_message')}")
        update = [ConfigResource(ConfigResourceType.TOPIC, name, configs=dict(configs[name]))
                  for name in sorted(existing & set(specs)) if configs.get(name)]
        if update:
            admin.alter_configs(update, raise_on_unknown=False)
    finally:
        admin.close()
    wait_for_topics(bootstrap, wanted, timeout)
    if update:
        wait_for_configs(bootstrap, {r.name: dict(configs[r.name]) for r in update}, timeout)


def create_pipeline_topics(bootstrap: Bootstrap, kafka: "KafkaConfig", only: tuple[str, ...] | None = None,
                           timeout: float = 30) -> None:
    """Create every topic under ``kafka.topic_prefix`` and the tables' changelogs (``only``:
    just these logical topics), with the configured replication factor, ``min.insync.replicas``
    and topic configs (idempotent; configs are also applied to topics that exist)."""
    topics = Topics(kafka.topic_prefix)
    specs, configs = topics.all(kafka.partitions), topics.topic_configs(kafka)
    if only is None:
        specs.update(names.changelog_topics(topics, kafka.partitions))
        configs.update(names.changelog_configs(topics, kafka))
    else:
        wanted = {topics.name(t) for t in only}
        specs = {k: v for k, v in specs.items() if k in wanted}
        configs = {k: v for k, v in configs.items() if k in wanted}
    create_topics(bootstrap, specs, timeout, configs=configs, replicas=kafka.replication_factor)


def create_changelog_topics(bootstrap: Bootstrap, kafka: "KafkaConfig", timeout: float = 30) -> None:
    """Create the tables' changelog topics as create_pipeline_topics does (what each faust stage
    does before it starts: faust creating them itself races with its own metadata refresh)."""
    topics = Topics(kafka.topic_prefix)
    create_topics(bootstrap, names.changelog_topics(topics, kafka.partitions), timeout,
                  configs=names.changelog_configs(topics, kafka), replicas=kafka.replication_factor)


# ---- what every broker reports --------------------------------------------------------------
# A KRaft broker applies the cluster's metadata log on its own: a topic the controller has just
# created, or a config it has just changed, reaches the brokers one after another. A client asks
# whichever broker it likes, so a topic counts as ready only once every broker reports it.

@dataclass(frozen=True)
class TopicWanted:
    """What a broker must report of one topic: ``partitions`` partitions and ``replicas``
    replicas of each (None: any number, for a topic that existed before), each with a leader."""

    partitions: int | None = None
    replicas: int | None = None


def topic_not_ready(reported: dict | None, wanted: TopicWanted) -> str | None:
    """Why one broker's Metadata entry of a topic (``{"error_code", "partitions": [{"error_code",
    "leader", "replicas", ...}]}``, None when absent) falls short of ``wanted``; None when ready."""
    if reported is None:
        return "missing"
    if reported["error_code"]:
        return Errors.for_code(reported["error_code"]).__name__
    partitions = reported["partitions"]
    if not partitions or (wanted.partitions is not None and len(partitions) != wanted.partitions):
        return f"{len(partitions)} of {wanted.partitions or 'some'} partitions"
    for p in partitions:
        if p["error_code"] and p["error_code"] != Errors.ReplicaNotAvailableError.errno:
            return f"partition {p['partition']}: {Errors.for_code(p['error_code']).__name__}"
        if p["leader"] < 0:
            return f"partition {p['partition']}: no leader"
        if wanted.replicas is not None and len(p["replicas"]) != wanted.replicas:
            return f"partition {p['partition']}: {len(p['replicas'])} of {wanted.replicas} replicas"
    return None


def configs_not_applied(reported: list[dict], wanted: dict[str, dict[str, str]]) -> str | None:
    """Why one broker's DescribeConfigs resources (``[{"resource_name", "error_code",
    "config_entries": [{"config_names", "config_value"}]}]``) differ from ``wanted`` (topic ->
    config -> value); None when every value is there."""
    by_topic = {r["resource_name"]: r for r in reported}
    for topic, configs in wanted.items():
        resource = by_topic.get(topic)
        if resource is None or resource["error_code"]:
            return f"{topic}: {'missing' if resource is None else Errors.for_code(resource['error_code']).__name__}"
        values = {e["config_names"]: e["config_value"] for e in resource["config_entries"]}
        for key, value in configs.items():
            if values.get(key) != value:
                return f"{topic}: {key}={values.get(key)!r}, not {value!r}"
    return None


Check = Callable[[AIOKafkaConnection, dict], Awaitable[str | None]]


def until_every_broker(bootstrap: Bootstrap, topics: list[str], check: Check, what: str,
                       timeout: float = 30.0) -> None:
    """Return once ``check`` passes on every broker the cluster lists; KafkaTimeoutError after
    ``timeout`` s, naming each broker that falls short and why.

    Each broker is asked over its own connection. ``check(conn, metadata)`` gets the broker's
    Metadata answer for ``topics`` (a dict: ``brokers``, ``topics``) and returns why it is not
    ready, or None. The brokers to ask are those the answers list (a stopped node drops out once
    the cluster fences it), plus the bootstrap servers that answer."""
    cluster = as_cluster(bootstrap)
    per_request = min(timeout, 5.0)  # a hung broker costs a round this long, not the whole wait

    async def ask(server: str) -> tuple[str | None, set[str]]:
        try:
            conn = await _connect(cluster, server, per_request)
        except AUTH_ERRORS_AIO as exc:
            raise authentication_error(bootstrap, exc) from exc
        except (aiokafka.errors.KafkaError, OSError, asyncio.TimeoutError) as exc:
            return f"unreachable ({type(exc).__name__})", set()
        try:
            metadata = (await asyncio.wait_for(
                conn.send(MetadataRequest(topics, allow_auto_topic_creation=False)), per_request)).to_object()
            listed = {f"{b['host']}:{b['port']}" for b in metadata["brokers"]}
            return await asyncio.wait_for(check(conn, metadata), per_request), listed
        except (aiokafka.errors.KafkaError, OSError, asyncio.TimeoutError) as exc:
            return f"no answer ({type(exc).__name__})", set()
        finally:
            conn.close()

    async def wait() -> None:
        deadline = time.monotonic() + timeout
        servers = set(cluster.servers)
        while True:
            answers = dict(zip(sorted(servers), await asyncio.gather(*(ask(s) for s in sorted(servers)))))
            listed = set().union(*(brokers for _, brokers in answers.values()))
            pending = {s: answers[s][0] if s in answers else "not asked yet" for s in sorted(listed)
                       if s not in answers or answers[s][0] is not None}
            if listed and not pending:
                return
            if time.monotonic() > deadline:
                pending = pending or {s: reason for s, (reason, _) in answers.items()}
                raise Errors.KafkaTimeoutError(
                    f"{what} not on every broker after {timeout:.0f} s: "
                    + "; ".join(f"{s}: {reason}" for s, reason in pending.items()))
            servers = set(cluster.servers) | listed
            await asyncio.sleep(0.1)

    _run(wait)


def wait_for_topics(bootstrap: Bootstrap, wanted: dict[str, TopicWanted], timeout: float = 30.0) -> None:
    """Return once every broker reports each topic of ``wanted`` as it says (topic_not_ready);
    KafkaTimeoutError after ``timeout`` s."""

    async def check(_conn: AIOKafkaConnection, metadata: dict) -> str | None:
        reported = {t["topic"]: t for t in metadata["topics"]}
        reasons = {name: topic_not_ready(reported.get(name), w) for name, w in wanted.items()}
        return "; ".join(f"{name}: {r}" for name, r in sorted(reasons.items()) if r) or None

    until_every_broker(bootstrap, sorted(wanted), check, f"topics {sorted(wanted)}", timeout)


def wait_for_configs(bootstrap: Bootstrap, wanted: dict[str, dict[str, str]], timeout: float = 30.0) -> None:
    """Return once every broker reports ``wanted``'s values (topic -> config -> value);
    KafkaTimeoutError after ``timeout`` s."""

    async def check(conn: AIOKafkaConnection, _metadata: dict) -> str | None:
        request = DescribeConfigsRequest([(ConfigResourceType.TOPIC.value, name, sorted(configs))
                                          for name, configs in sorted(wanted.items())])
        return configs_not_applied((await conn.send(request)).to_object()["resources"], wanted)

    until_every_broker(bootstrap, sorted(wanted), check, f"the configs {wanted}", timeout)


def topic_partitions(bootstrap: Bootstrap, names: list[str]) -> dict[str, int]:
    """Partition count of each existing topic among ``names`` (missing topics are left out)."""
    admin = _admin(bootstrap)
    try:
        topics = admin.describe_topics(list(names))
    finally:
        admin.close()
    return {t["name"]: len(t["partitions"]) for t in topics
            if t.get("error_code", 0) == 0 and t.get("partitions")}


def check_copartitioned(bootstrap: Bootstrap, names: list[str], timeout: float = 10.0) -> int:
    """Raise TopicPartitionsMismatch unless all ``names`` exist with one partition count.

    Returns that count. Co-partitioned topics keep one key's events in one partition number. A
    topic created a moment ago may not be in every broker's metadata yet: missing topics are
    asked for again for up to ``timeout`` s before they count as missing.
    """
    if not names:
        raise ValueError("check_copartitioned needs at least one topic name")
    deadline = time.monotonic() + timeout
    while len(counts := topic_partitions(bootstrap, names)) < len(set(names)) and time.monotonic() < deadline:
        time.sleep(0.5)
    missing = sorted(set(names) - set(counts))
    if missing or len(set(counts.values())) > 1:
        raise TopicPartitionsMismatch(
            f"topics are not co-partitioned: partitions {counts}"
            + (f"; missing {missing}" if missing else "")
        )
    return next(iter(counts.values()))
