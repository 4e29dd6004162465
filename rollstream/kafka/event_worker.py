"""The thin Kafka shell every plain worker shares.

consume a batch -> decode (undecodable -> dead-letter) -> handler -> produce outputs ->
flush -> commit. Offsets are committed only after every output of the batch is acknowledged, so
a killed worker re-processes (never loses) its last batch; downstream recognises redelivered
events by their deterministic identity. A handler may split a batch into parts handled in turn
(``parts``), each produced as soon as it is handled.

A handler that can work on several batches at once (``PipelinedHandler``: generation by
inference servers) is handed each batch as it is polled, while earlier ones are still in flight;
their outputs are produced and their offsets committed in poll order, so the committed offset
never passes a batch whose outputs are not acknowledged.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Protocol, Sequence

from kafka.errors import CommitFailedError
from kafka.structs import OffsetAndMetadata, TopicPartition

from rollstream.exceptions import ConfigError
from rollstream.kafka.clients import assigned_consumer, make_producer
from rollstream.kafka.context import StageContext
from rollstream.kafka.events import Input, Output, Send, dead_letter, decode_expected, guard_size
from rollstream.observability.metrics import process_metrics
from rollstream.schemas import encode

log = logging.getLogger(__name__)

BatchHandler = Callable[[Sequence[Input]], Iterable[Output | Send]]
# while batches are in flight, how long a poll waits for more input before finished ones are produced
PIPELINE_POLL_MS = 20
# with lookahead, a poll is topped up while more records arrive within this long: a step's
# requests span partitions, whose records a single fetch may not hold yet
LOOKAHEAD_LINGER_MS = 100


class InFlight(Protocol):
    """One batch a PipelinedHandler is working on."""

    def done(self) -> bool: ...

    def wait(self, timeout_s: float) -> None:
        """Return when done or after ``timeout_s``."""

    def outputs(self) -> Iterable[Output | Send]:
        """The batch's outputs, built in the calling thread; raises what the work raised."""


class PipelinedHandler(Protocol):
    """A handler that takes a new batch while earlier ones are in flight."""

    pipelined: bool  # False: called synchronously, as a BatchHandler

    def __call__(self, inputs: Sequence[Input]) -> Iterable[Output | Send]: ...

    def submit(self, inputs: Sequence[Input]) -> InFlight: ...

    def room(self) -> bool:
        """Whether another batch may start now (the in-flight work is bounded)."""


@dataclass
class _Batch:
    """A polled batch: what it produced so far, and the offsets to commit once it is produced."""

    inputs: list[Input]
    outputs: list[Output | Send]
    offsets: dict[TopicPartition, int]
    work: InFlight | None = None


class PartitionWorker:
    """What every plain worker shares: a consumer owning its partitions of ``input_topic``, a
    producer, a stop flag, and a clean close.

    Partitions are assigned statically: instance ``i`` of ``n`` (``context.instance``,
    ``context.instances``) owns the partitions ``p`` with ``p % n == i`` (scale out by starting
    instances 0..n-1). The group id only stores committed offsets. kafka-python 3.0's group
    membership proved unreliable here: a leader that rejoins right after its first assignment
    could stall in the second rebalance for good, assigned nothing, and then die on a refused
    commit. ``compress``: the producer writes payloads (``context.compression_type``); decision
    events go uncompressed.
    """

    def __init__(self, context: StageContext, *, input_topic: str, group_id: str, max_poll_records: int,
                 poll_timeout_ms: int = 200, compress: bool = False) -> None:
        self.context = context
        self.topics = context.topics
        self.input_topic = input_topic
        self.stage = context.stage
        self.worker = context.worker
        self.poll_timeout_ms = poll_timeout_ms
        self.stop_event = threading.Event()
        self.consumer, self.partitions = assigned_consumer(
            context.bootstrap, group_id, input_topic, self.worker, max_poll_records, context.instance,
            context.instances)
        self.max_message_bytes = context.max_message_bytes
        self.producer = make_producer(context.bootstrap, client_id=self.worker, max_request_size=self.max_message_bytes,
                                      compression_type=context.compression_type if compress else "none")
        self.too_large = 0  # outputs dead-lettered for their size

    def stop(self, *_: object) -> None:
        self.stop_event.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT stop the loop. Only the main thread may install handlers; a worker run
        in another thread is stopped by its caller via stop()."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)

    def send(self, outputs: Iterable[Output | Send]) -> None:
        """Encode and send ``outputs`` (not flushed: the caller flushes before it commits). An
        event above ``max_message_bytes`` is replaced by its ``too_large`` dead letter: no worker
        dies of a size."""
        for out in outputs:
            send = out if isinstance(out, Send) else Send(out.topic, out.key, encode(out.record, out.schema))
            send, replaced = guard_size(self.topics, send, "event" if isinstance(out, Send) else out.schema,
                                        self.max_message_bytes, self.worker)
            self.too_large += replaced
            self.producer.send(send.topic, key=send.key.encode(), value=send.value)

    def close(self) -> None:
        try:
            self.producer.flush()
            self.producer.close()
        finally:
            self.consumer.close()


class EventWorker(PartitionWorker):
    """Run ``handler`` over ``input_topic`` until stopped (partitions: see PartitionWorker).

    ``expected_schema`` names the only schema the handler accepts; anything else, and (with
    ``domains``) an event of a reward domain the run does not have, is dead-lettered with reason
    ``invalid_event``. A handler exception dead-letters the whole batch with reason
    ``handler_error`` (bytes kept), and the worker goes on; a ConfigError (the run's configuration
    is wrong, not the events) stops it with the poll uncommitted.

    The handler gets at most ``max_batch`` events per call. ``lookahead`` > 1 polls up to
    ``lookahead * max_batch`` at once, so a handler that orders a poll (``parts``: generation,
    train requests before validation ones) orders what is waiting, not only the share of one
    partition that a poll of ``max_batch`` happens to return. Offsets are committed once the
    whole poll is produced.
    """

    def __init__(self, context: StageContext, *, input_topic: str, group_id: str, expected_schema: str,
                 handler: BatchHandler, max_batch: int = 16, poll_timeout_ms: int = 200, compress: bool = False,
                 domains: Iterable[str] | None = None, lookahead: int = 1) -> None:
        if max_batch < 1 or lookahead < 1:
            raise ValueError(f"max_batch and lookahead must be >= 1, got {max_batch} and {lookahead}")
        super().__init__(context, input_topic=input_topic, group_id=group_id, max_poll_records=max_batch * lookahead,
                         poll_timeout_ms=poll_timeout_ms, compress=compress)
        self.expected_schema = expected_schema
        self.domains = None if domains is None else frozenset(domains)
        self.handler = handler
        self.max_batch = max_batch
        self.lookahead = lookahead
        self.processed = 0
        self.dead_lettered = 0

    def _decode(self, msg) -> tuple[Input | None, Output | None]:
        schema, record, problem = decode_expected(msg.value, (self.expected_schema,))
        if problem is None and self.domains is not None and record.get("domain") not in self.domains:
            problem = ("invalid_event", f"unknown domain {str(record.get('domain'))[:100]!r}; "
                                        f"configured: {sorted(self.domains)}")
        if problem is None:
            return Input(schema, record, msg.topic, msg.partition, msg.offset, msg.key, msg.value), None
        return None, dead_letter(self.topics, msg, *problem, self.worker)

    def _decoded(self, messages: Sequence) -> tuple[list[Input], list[Output]]:
        """The batch's inputs, and the dead letters of what could not be decoded or is not wanted."""
        inputs: list[Input] = []
        dead: list[Output] = []
        for msg in messages:
            inp, dl = self._decode(msg)
            if dl is not None:
                dead.append(dl)
            else:
                inputs.append(inp)
        if inputs:
            process_metrics().events.labels(self.stage).inc(len(inputs))
        return inputs, dead

    def _handler_failed(self, inputs: Sequence[Input], exc: Exception) -> list[Output]:
        """One bad batch never kills the worker: its inputs are dead-lettered ``handler_error``."""
        log.error("handler failed on %s[%d]@%d", inputs[0].topic, inputs[0].partition, inputs[0].offset,
                  exc_info=exc)
        return [dead_letter(self.topics, i, "handler_error", f"{type(exc).__name__}: {exc}", self.worker)
                for i in inputs]

    def _count(self, inputs: Sequence[Input], outputs: Sequence[Output | Send]) -> None:
        self.processed += len(inputs)
        self.dead_lettered += sum(1 for o in outputs if o.topic == self.topics.dead_letter)

    def _process_parts(self, messages: Sequence) -> Iterator[list[Output | Send]]:
        """Decode one poll of raw messages, then handle it a part at a time, yielding each
        part's outputs (the dead letters of the poll come with the first). A handler with
        ``parts(inputs)`` (generation: train requests before validation ones) names the parts,
        in the order to handle them; else the poll is one part. A part above ``max_batch`` is
        handled ``max_batch`` at a time."""
        inputs, dead = self._decoded(messages)
        parts = getattr(self.handler, "parts", None)
        ordered = (parts(inputs) if parts is not None and inputs else None) or [inputs]
        for part in _chunks(ordered, self.max_batch):
            outputs, dead = dead, []
            if part:
                try:
                    outputs.extend(self.handler(part))
                except ConfigError:  # the configuration, not the events: stop, nothing committed
                    raise
                except Exception as exc:
                    outputs.extend(self._handler_failed(part, exc))
            self._count(part, outputs)
            yield outputs

    def produce(self, outputs: Iterable[Output | Send]) -> None:
        before = self.too_large
        self.send(outputs)
        self.dead_lettered += self.too_large - before
        self.producer.flush()

    def run(self, max_idle_s: float | None = None) -> None:
        """Loop until stop() (or SIGTERM), or until ``max_idle_s`` pass with no input."""
        if getattr(self.handler, "pipelined", False):
            self._run_pipelined(max_idle_s)
            return
        idle_since = time.monotonic()
        try:
            while not self.stop_event.is_set():
                messages = self._poll()
                if not messages:
                    if max_idle_s is not None and time.monotonic() - idle_since > max_idle_s:
                        break
                    continue
                idle_since = time.monotonic()
                # each part is produced (acknowledged) once it is handled, so a later part does
                # not hold it back; the offsets are committed after the last
                for outputs in self._process_parts(messages):
                    self.produce(outputs)
                self.commit()
        finally:
            self.close()

    def _poll(self) -> list:
        """Up to ``max_batch * lookahead`` records; with lookahead, topped up while more arrive
        within ``LOOKAHEAD_LINGER_MS``."""
        limit = self.max_batch * self.lookahead
        polled = self.consumer.poll(timeout_ms=self.poll_timeout_ms, max_records=limit)
        messages = [m for batch in polled.values() for m in batch]
        while self.lookahead > 1 and 0 < len(messages) < limit:
            more = self.consumer.poll(timeout_ms=LOOKAHEAD_LINGER_MS, max_records=limit - len(messages))
            if not more:
                break
            messages += [m for batch in more.values() for m in batch]
        return messages

    def _run_pipelined(self, max_idle_s: float | None) -> None:
        """``run`` for a PipelinedHandler: poll and submit while it has room; produce and commit
        finished batches in poll order. Batches still in flight at a stop are not committed:
        they are redelivered after a restart."""
        pending: deque[_Batch] = deque()
        idle_since = time.monotonic()
        try:
            while not self.stop_event.is_set():
                while pending and (pending[0].work is None or pending[0].work.done()):
                    self._finish(pending.popleft())
                if pending and not self.handler.room():
                    pending[0].work.wait(self.poll_timeout_ms / 1000)
                    continue
                polled = self.consumer.poll(timeout_ms=PIPELINE_POLL_MS if pending else self.poll_timeout_ms,
                                            max_records=self.max_batch)
                messages = [m for batch in polled.values() for m in batch]
                if messages:
                    idle_since = time.monotonic()
                    pending.append(self._submit(messages))
                elif not pending and max_idle_s is not None and time.monotonic() - idle_since > max_idle_s:
                    break
        finally:
            self.close()

    def _submit(self, messages: Sequence) -> _Batch:
        inputs, dead = self._decoded(messages)
        offsets: dict[TopicPartition, int] = {}
        for msg in messages:
            tp = TopicPartition(msg.topic, msg.partition)
            offsets[tp] = max(offsets.get(tp, 0), msg.offset + 1)
        batch = _Batch(inputs, dead, offsets)
        if inputs:
            try:
                batch.work = self.handler.submit(inputs)
            except Exception as exc:
                batch.outputs.extend(self._handler_failed(inputs, exc))
        return batch

    def _finish(self, batch: _Batch) -> None:
        if batch.work is not None:
            try:
                batch.outputs.extend(batch.work.outputs())
            except Exception as exc:
                batch.outputs.extend(self._handler_failed(batch.inputs, exc))
        self._count(batch.inputs, batch.outputs)
        self.produce(batch.outputs)
        self.commit(batch.offsets)

    def commit(self, offsets: dict[TopicPartition, int] | None = None) -> None:
        """Commit ``offsets`` (next offset per partition; None: what was polled), only after
        every output is acknowledged. A refused commit is not fatal: the batch is redelivered
        after a restart and downstream ignores the duplicates by their identity."""
        try:
            if offsets is None:
                self.consumer.commit()
            else:
                self.consumer.commit({tp: OffsetAndMetadata(offset, "", -1) for tp, offset in offsets.items()})
        except CommitFailedError as exc:
            log.warning("offset commit refused (%s); the batch may be redelivered", exc)


def _chunks(parts: Sequence[list[Input]], size: int) -> Iterator[list[Input]]:
    """Each part in order, ``size`` inputs at a time (an empty part stays one: it carries the
    poll's dead letters)."""
    for part in parts:
        for k in range(0, max(len(part), 1), size):
            yield part[k:k + size]
