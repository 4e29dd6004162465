"""What the faust apps share, and every reach into faust's internals: app construction, the
consumer's seek, recovery, the table as a Store (TableStore), the timer (punctuate_every), raw
topics, the Emitter (sends, the size guard, dead letters), and the one agent that runs a
Processor (serve_processor)."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from pathlib import Path
from typing import Awaitable, Callable, Mapping

import faust
from faust.tables.manager import TableManager
from faust.tables.recovery import Recovery
from faust.transport.drivers import aiokafka as aiokafka_driver
from faust.types import TP

from rollstream.config import PipelineConfig
from rollstream.config.base import KafkaConfig
from rollstream.exceptions import StageFault
from rollstream.filtering.query_filters import load_torch
from rollstream.kafka import names
from rollstream.kafka.admin import replication_factor
from rollstream.kafka.cluster import Bootstrap, Cluster, as_cluster
from rollstream.kafka.context import StageContext
from rollstream.kafka.events import Send, dead_letter, decode_expected, guard_size
from rollstream.policy.versions import STALENESS_VERSION_MAX_AGE_S, PolicyVersionWatcher
from rollstream.schemas import encode
from rollstream.streams.processor import Handled, Processor
from rollstream.streams.store import Store

log = logging.getLogger(__name__)

# The stateful agents take their input in batches (faust's take_events): up to BATCH_MAX events,
# or what arrived within a window after the previous batch (the aggregator's BATCH_WITHIN_S; the
# group queue has its own). A batch writes each changed table key once (one changelog record
# per key and batch, not per event) and its sends leave in a few produce requests. At a trickle
# the window is what an event waits; on a backlog a longer window gives larger batches.
BATCH_MAX = 1000
BATCH_WITHIN_S = 0.01
# Without a linger each changelog record and event became its own produce request (about 250 us
# of CPU per record here); 20 ms puts them in a few requests (about 55 us a record). A batch
# that sent events flushes the producer when it ends (Emitter.flush), so a decision does not
# wait for the linger.
PRODUCER_LINGER_S = 0.02
PRODUCER_MAX_BATCH_BYTES = 1 << 20


def faust_credentials(cluster: Cluster) -> faust.types.auth.CredentialsT | None:
    """faust's ``broker_credentials`` for ``cluster`` (None: PLAINTEXT)."""
    if cluster.sasl_mechanism is not None:
        return faust.SASLCredentials(username=cluster.sasl_username, password=cluster.sasl_password,
                                     mechanism=cluster.sasl_mechanism, ssl_context=cluster.ssl_context())
    if cluster.uses_ssl:
        return faust.SSLCredentials(cluster.ssl_context())
    return None


def make_app(app_id: str, bootstrap: Bootstrap, partitions: int, kafka: KafkaConfig, store: str = "memory://",
             producer_linger_s: float = 0.01, producer_max_batch_bytes: int = 16384) -> faust.App:
    """A stage's faust app on ``bootstrap`` (a Cluster: its security too), its topics
    replicated as ``kafka.replication_factor`` says (faust's own internal topics included) and
    its tables with ``kafka.table_standby_replicas`` standbys; clients sized by
    ``kafka.max_message_bytes``; its producer batches for ``producer_linger_s`` seconds and up to
    ``producer_max_batch_bytes`` bytes per partition."""
    cluster = as_cluster(bootstrap)
    # faust wants a data dir even for memory tables; keep it out of the working directory
    datadir = Path(tempfile.gettempdir()) / "rollstream-faust" / f"{app_id}-{os.getpid()}"
    datadir.parent.mkdir(parents=True, exist_ok=True)
    return StageApp(
        app_id,
        datadir=datadir,
        broker=[f"kafka://{server}" for server in cluster.servers],
        broker_credentials=faust_credentials(cluster),
        store=store,
        key_serializer="raw",
        value_serializer="raw",
        topic_partitions=partitions,
        topic_replication_factor=replication_factor(cluster, kafka.replication_factor),
        table_standby_replicas=kafka.table_standby_replicas,
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        web_enabled=False,
        TableManager=StageTableManager,
        stream_wait_empty=False,
        broker_commit_interval=1.0,
        # a killed worker's partitions move after this long (faust's default is 60 s)
        broker_session_timeout=20.0,
        # sized like every client (kafka.max_message_bytes): the group queue reads payloads
        producer_max_request_size=kafka.max_message_bytes,
        consumer_max_fetch_size=kafka.max_message_bytes,
        # every event writes a table value and one or more events: batching them for 10 ms cut
        # the group queue's CPU per trajectory by a third (benchmarks/agentic.py)
        producer_linger=producer_linger_s,
        producer_max_batch_size=producer_max_batch_bytes,
    )


class StageConsumer(aiokafka_driver.Consumer):
    """faust's aiokafka consumer whose seek to the committed offsets also moves a stream
    partition nothing was committed on: to its first offset.

    faust drops what it fetched while its flow is stopped and then seeks every partition to its
    committed offset, so the dropped events are fetched again. aiokafka seeks only partitions
    whose committed offset is above 0, so a partition without one (a new group, a worker killed
    before its first commit) kept its position past the dropped events. A fetch in flight when a
    restarted stage resumed its stream partitions came back that way after every seek of its
    recovery: a killed aggregator's successor lost the responses of its first prompts and the
    run stalled. The first offset is what ``consumer_auto_offset_reset="earliest"`` means for
    such a partition; what an agent already handled is handled again (at least once). Table
    changelogs are left alone: recovery positions them itself."""

    async def seek_to_committed(self) -> Mapping[TP, int]:
        committed = await super().seek_to_committed()
        changelogs = self.app.tables.changelog_topics
        uncommitted = [tp for tp, offset in committed.items() if not offset and tp.topic not in changelogs]
        if uncommitted:
            await self._thread.call_thread(self._seek_to_first, uncommitted)
        return committed

    async def _seek_to_first(self, partitions: list[TP]) -> None:
        """On the consumer thread's loop, where the aiokafka client lives. A seek to an offset,
        not aiokafka's ``seek_to_beginning``: that leaves the position unset until the broker
        answers, and faust's livelock check, which reads it from the main thread, asserts it is
        set (a restarted aggregator crashed on it)."""
        client = self._thread._ensure_consumer()
        for tp, offset in (await client.beginning_offsets(partitions)).items():
            client.seek(tp, offset)


class StageTransport(aiokafka_driver.Transport):
    Consumer = StageConsumer


class StageApp(faust.App):
    """faust's App with :class:`StageConsumer`. faust restarts a failed agent forever, silently
    stuck if the cause persists. Our agents only fail on infrastructure errors (event errors are
    dead-lettered), so the process exits instead and its supervisor (`rollstream run`, compose)
    sees it; uncommitted input is processed again by the restarted stage."""

    def _new_transport(self) -> StageTransport:
        return StageTransport(self.conf.broker_consumer, self)

    async def _on_agent_error(self, agent, exc: BaseException) -> None:
        await super()._on_agent_error(agent, exc)
        log.critical("agent %s failed: %r; exiting", agent.name, exc)
        logging.shutdown()
        os._exit(70)


class StageRecovery(Recovery):
    """faust's recovery, without losing the events fetched while it seeks the stream partitions.

    When a table's recovery completes, faust resumes the stream partitions, then seeks them to
    their committed offsets, then resumes the flow, which clears every agent's queue (to drop
    what was fetched before the seek). The flow is already running while the seek awaits the
    broker, so events fetched right after the seek land in a queue that is then cleared: the
    fetch position is past them, and a restarted stage never sees them (one in five restarts of
    a stage on a backlog, on two busy cores). Stopping the flow first means nothing is fetched
    between the resume and the seek; whatever an agent already holds is processed again after
    the seek (at least once, as after a crash)."""

    async def on_recovery_completed(self, generation_id: int = 0) -> None:
        self._stop_flow()
        await super().on_recovery_completed(generation_id)

    async def _resume_streams(self, generation_id: int = 0) -> None:  # the same order, for apps without tables
        self._stop_flow()
        await super()._resume_streams(generation_id)

    def _stop_flow(self) -> None:
        """Hold the fetcher and the agents' queues until faust resumes them after its seek (a
        rebalance that interrupts the seek resumes them again when it completes)."""
        self.app.flow_control.suspend()
        self.app.consumer.stop_flow()


class StageTableManager(TableManager):
    """faust's table manager with :class:`StageRecovery`."""

    @property
    def recovery(self) -> Recovery:
        if self._recovery is None:
            self._recovery = StageRecovery(self.app, self, beacon=self.beacon, loop=self.loop)
        return self._recovery


def active_partitions(app: faust.App, topic: str) -> set[int]:
    """The partitions of ``topic`` this worker owns now (actives, not standbys)."""
    return {tp.partition for tp in app.assignor.assigned_actives() if tp.topic == topic}


class TableStore:
    """A faust table as a :class:`rollstream.streams.store.Store`: reads this worker's copy (every
    partition it was assigned, without faust's default value); a write names its partition, so it
    is valid inside an event and from a timer alike."""

    def __init__(self, table: faust.types.TableT) -> None:
        self.table = table

    def get(self, key: bytes) -> bytes | None:
        return self.table.data.get(key)

    def __contains__(self, key: bytes) -> bool:
        return key in self.table.data

    def items(self) -> list[tuple[bytes, bytes]]:
        """A snapshot: the caller may write while it iterates."""
        return list(self.table.data.items())

    def put(self, partition: int, key: bytes, value: bytes | None) -> None:
        if value is None:
            self.table.send_changelog(partition, key, None, value_serializer="raw")
            self.table.data.pop(key, None)
        else:
            self.table.send_changelog(partition, key, value)
            self.table.data[key] = value

    def flush(self) -> int:
        return 0  # every put is queued on the changelog at once


def tables_recovered(app: faust.App) -> bool:
    """Whether ``app``'s tables are restored from their changelogs and no rebalance is under way
    (a rebalance ends when the recovery it starts does). Anything that reads a table outside an
    event waits for this: a half-restored value, written back, would overwrite the newer one the
    recovery has yet to read."""
    return app.tables.recovery.completed.is_set() and not app.rebalancing


def punctuate_every(app: faust.App, interval_s: float, punctuate: Callable[[], Awaitable[None]],
                    turn: asyncio.Lock | None, name: str) -> None:
    """The stages' one mechanism for time: every ``interval_s`` seconds, once ``app``'s tables are
    recovered (:func:`tables_recovered`), await ``punctuate()`` holding ``turn``, the lock the
    stage's agent holds while it handles events (None: the stage's agents need no turns), so a
    timer's table writes and sends never interleave with an event's. Its writes go through a
    :class:`TableStore`, which names their partition."""

    @app.timer(interval_s, name=name)
    async def timer() -> None:
        if not tables_recovered(app):
            return
        if turn is None:
            await punctuate()
            return
        async with turn:
            await punctuate()


def raw_topic(app: faust.App, *names: str, partitions: int | None = None) -> faust.TopicT:
    """``names`` (one topic, or co-partitioned ones read as one source) as bytes keys and values."""
    return app.topic(*names, key_type=bytes, value_type=bytes, key_serializer="raw",
                     value_serializer="raw", partitions=partitions)


class Emitter:
    """Encodes and sends events from inside an agent; undecodable input goes to dead-letter."""

    def __init__(self, app: faust.App, context: StageContext) -> None:
        self.app = app
        self.topics = context.topics
        self.worker = context.worker
        self._unflushed = False  # an event was sent since the last flush
        self._flushing: asyncio.Future | None = None  # the last flush task, referenced so it is not collected
        self.dead_lettered = 0
        self.max_message_bytes = int(app.conf.producer_max_request_size)

    async def send(self, topic: str, key: str, record: dict, schema: str) -> None:
        await self.send_raw(topic, key, encode(record, schema))

    async def send_raw(self, topic: str, key: str, value: bytes, partition: int | None = None) -> None:
        send, replaced = guard_size(self.topics, Send(topic, key, value, partition), "event", self.max_message_bytes,
                                    self.worker)
        self.dead_lettered += replaced
        topic, key, value, partition = send.topic, send.key, send.value, send.partition
        # Straight to the app's producer (faust's Topic.send adds a message future, callbacks and
        # sensors per event: a tenth of the aggregator's time on a backlog). faust flushes this
        # producer before it commits the source offsets, so delivery still precedes the commit.
        await self.app.producer.send(topic, key.encode(), value, partition, None, None)
        self._unflushed = True

    async def flush(self) -> None:
        """Send what was sent (and the table writes queued with it) now instead of after the
        producer's linger: an agent calls it after a batch that sent events, so its decisions
        leave at once. It does not wait for the acknowledgements (faust waits for them before it
        commits offsets). aiokafka's ``flush`` waits for the linger to pass; its accumulator's
        ``flush_for_commit`` closes the open batches, which sends them now: it runs as a task of
        its own, so the agent goes on with its next batch."""
        if self._unflushed:
            self._unflushed = False
            producer = self.app.producer
            await producer.buffer.flush()  # faust's own queue, into aiokafka's batches
            accumulator = producer._ensure_producer()._message_accumulator
            self._flushing = asyncio.ensure_future(accumulator.flush_for_commit())

    async def guarded(self, handler, event) -> None:
        """Run ``handler(event)``; an unexpected exception dead-letters the event (bytes kept)
        instead of killing the agent, whose failed event faust would otherwise just ack. A
        StageFault is raised on: the process exits (StageApp) and its restart reprocesses."""
        try:
            await handler(event)
        except StageFault:
            raise
        except Exception as exc:
            log.exception("handler failed on %s[%d]@%d", event.message.topic, event.message.partition,
                          event.message.offset)
            await self.dead_letter(event, "handler_error", f"{type(exc).__name__}: {exc}")

    async def dead_letter(self, event, reason: str, error: str) -> None:
        msg = event.message
        out = dead_letter(self.topics, msg, reason, error, self.worker)
        self.dead_lettered += 1
        log.warning("dead-letter %s[%d]@%d: %s: %s", msg.topic, msg.partition, msg.offset, reason, error)
        await self.send(out.topic, out.key, out.record, out.schema)

    async def decode_or_dead_letter(self, event, expected: str) -> dict | None:
        _, record, problem = decode_expected(event.value, (expected,))
        if problem is not None:
            await self.dead_letter(event, *problem)
        return record


def serve_processor(app: faust.App, source: faust.TopicT, processor: Processor, emit: Emitter, *, name: str,
                    within_s: float, tick_interval_s: float) -> None:
    """Run ``processor`` (rollstream.streams.processor) as ``app``'s agent ``name`` over
    ``source``: events in batches of up to ``BATCH_MAX`` or what arrived within ``within_s``
    seconds; each event's bytes to ``processor.handle``, what it returns sent (its error
    dead-lettered), then ``end_batch`` (the batch's table writes) and the producer flushed, so the
    batch's decisions leave at once. faust acknowledges a batch's events only after the batch and
    flushes the producer before it commits their offsets, so every committed event's effect is in
    the changelog. Every ``tick_interval_s`` the timer calls ``processor.tick`` with the
    partitions of ``source``'s first topic this worker owns, taking turns with the batches; a
    rebalance calls ``processor.assigned``."""
    turn = asyncio.Lock()
    owned_topic = source.topics[0]

    async def send(handled: Handled) -> None:
        for out in handled.sends:
            await emit.send_raw(out.topic, out.key, out.value, partition=out.partition)
        for line in handled.log:
            log.info("%s", line)

    async def handle(event) -> None:
        msg = event.message
        handled = processor.handle(msg.topic, msg.partition, event.value, offset=msg.offset)
        if handled.error is not None:
            await emit.dead_letter(event, *handled.error)
        await send(handled)

    async def agent(stream) -> None:
        async for events in stream.take_events(BATCH_MAX, within=within_s):
            async with turn:
                try:
                    for event in events:
                        await emit.guarded(handle, event)
                finally:
                    processor.end_batch()
                    await emit.flush()

    async def tick() -> None:
        try:
            await send(processor.tick(active_partitions(app, owned_topic)))
        finally:
            processor.end_batch()
            await emit.flush()

    app.agent(source, name=name)(agent)
    punctuate_every(app, tick_interval_s, tick, turn, f"{name}.tick")

    @app.on_rebalance_complete.connect
    async def reassigned(sender, **kwargs) -> None:
        processor.assigned()


def processor_app(config: PipelineConfig, context: StageContext, *, app_name: str, table: str,
                  sources: tuple[str, ...], processor: Callable[[Store, Callable[[], int | None]], Processor],
                  name: str, within_s: float, tick_interval_s: float, store: str = "memory://") -> faust.App:
    """The faust app of a stateful stage: one table ``table`` keyed by bytes, a processor built by
    ``processor(table store, newest policy version)`` (the version: None without a staleness
    bound) and served (``serve_processor``, as agent ``name``) over ``sources``, co-partitioned. torch is imported
    while the app starts (the filters compute with it), not at the first decision."""
    load_torch()
    topics, partitions = context.topics, config.kafka.partitions
    app = make_app(names.app_id(topics, app_name), context.bootstrap, partitions, config.kafka, store,
                   producer_linger_s=PRODUCER_LINGER_S, producer_max_batch_bytes=PRODUCER_MAX_BATCH_BYTES)
    state = app.Table(table, default=None, partitions=partitions, key_type=bytes, value_type=bytes,
                      help=f"the state of agent {name} (its processor's module doc)")
    versions = PolicyVersionWatcher(context.bootstrap, topics) if config.max_staleness is not None else None
    version_of = ((lambda: versions.latest_version(STALENESS_VERSION_MAX_AGE_S)) if versions is not None
                  else (lambda: None))
    serve_processor(app, raw_topic(app, *sources, partitions=partitions), processor(TableStore(state), version_of),
                    Emitter(app, context), name=name, within_s=within_s,
                    tick_interval_s=tick_interval_s)
    return app
