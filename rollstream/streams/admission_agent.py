"""Admission: faust agents over ``prompts`` and ``prompt.outcomes`` (one partition each: the
admission budget is global, so admission is a single writer). What each event does is
rollstream.streams.admission_processor's (over rollstream.filtering.admission's decisions); this
shell waits, reads Kafka with its own consumers, runs tasks and sends.

The prompts agent waits (does not consume further) while no credit is free; the outcomes agent
returns credits and wakes it. Both topics have one partition and one app, so both agents always
run in the same process.

End of data: on the ``PromptsEnd`` marker the state records where the data ended, and a task
re-reads the train prompts before it with its own consumer (seeking ``prompts`` back) and admits
them in each later epoch's order. The epoch and the position in it are saved with every
admission, so a restarted admission, once its table is restored, starts the task again at that
position (faust acks an event whose handler was cancelled, so the marker is not redelivered).
Resuming is idempotent and asked for after every outcome and on the timer (``punctuate_every``,
which waits for the table's recovery), so one missed signal never leaves the later epochs
unread.

Outcomes not delivered: a restarted admission once never received an outcome already on the
topic, its credit never returned (faust cleared events fetched while it seeked after recovery;
``streams.common.StageRecovery`` now prevents that). As a bounded backstop, when prompts are in
flight and no outcome arrived for ``OUTCOME_RECHECK_S``, the admission reads ``prompt.outcomes``
itself from the oldest in-flight prompt's admission time on and applies the outcomes of prompts still in flight. Applying an
outcome twice is harmless (the second is an UnknownOutcome).
"""

from __future__ import annotations

import asyncio
import logging
import time

import faust

from rollstream.config import RLVRConfig
from rollstream.filtering import admission as core
from rollstream.filtering import history
from rollstream.kafka import names
from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.context import StageContext
from rollstream.kafka.events import decode_expected
from rollstream.kafka.readback import read_history, read_outcomes_since, read_prompts
from rollstream.policy.versions import PolicyVersionWatcher
from rollstream.streams.admission_processor import (VERSION_POLL_S, AdmissionProcessor, Take, Tokenize,
                                                    default_tokenize)
from rollstream.streams.common import Emitter, TableStore, make_app, punctuate_every, raw_topic, tables_recovered
from rollstream.streams.processor import Handled

__all__ = ["AdmissionAgents", "build_admission_app", "default_tokenize"]

log = logging.getLogger(__name__)

EPOCHS_RETRY_S = 5.0
EPOCHS_CHECK_S = 2.0  # how often a restored admission checks that its epochs task runs
STALL_WARNING_S = 60.0  # a prompt waiting for a credit or a policy version this long is logged, again and again
OUTCOME_RECHECK_S = 10.0  # credits waited for this long without an outcome: read the topic itself
CLOCK_SKEW_MS = 60_000  # how far an outcome's timestamp may lag its admission (other machines' clocks)
# a validation round that is due waits at most this long for the next train admission while one
# could be admitted (none may be waiting); the prompts agent rechecks the version every VERSION_POLL_S
TRAIN_FIRST_S = 4 * VERSION_POLL_S


class AdmissionAgents:
    """The admission's asynchronous shell around an AdmissionProcessor: waits for credits, reads
    ``prompts``, ``prompt.history`` and ``prompt.outcomes`` with its own consumers, runs the
    later epochs and the validation rounds as tasks, and sends what the processor returns."""

    def __init__(self, app: faust.App, processor: AdmissionProcessor, bootstrap: Bootstrap, emit: Emitter,
                 watch_versions: bool) -> None:
        self.app, self.processor, self.bootstrap, self.emit = app, processor, bootstrap, emit
        self.topics = processor.topics
        self.domains = set(processor.config.rewards)
        self.credit = asyncio.Event()
        self.train_admitted = asyncio.Event()  # set after each train prompt's decision is sent
        self.watch_versions = watch_versions
        # credits arrive as events; policy versions are polled while the staleness bound holds a step
        self.recheck_s = VERSION_POLL_S if watch_versions else None
        self.history_loaded = asyncio.Lock()
        self.epochs_task: asyncio.Future | None = None  # the running task of run_epochs, if any
        self.eval_task: asyncio.Future | None = None  # the running task of run_eval, if any
        self.last_outcome = time.monotonic()  # when an outcome was last applied (or the process started)

    async def send(self, handled: Handled) -> None:
        for out in handled.sends:
            await self.emit.send_raw(out.topic, out.key, out.value, out.partition)

    # -- prompts
    async def admit_event(self, event) -> None:
        schema, record, problem = decode_expected(event.value, ("Prompt", "PromptsEnd"))
        if problem is not None:
            await self.emit.dead_letter(event, *problem)
            return
        offset = event.message.offset
        screened = self.processor.screen(schema, record, offset)
        if screened.action == "end":
            await self.end_of_data(offset)
        elif screened.action == "skip":
            log.info("%s", screened.why)
        elif screened.action == "dead_letter":
            await self.emit.dead_letter(event, "invalid_event", screened.why)
        else:
            await self.admit(record, offset=offset)

    async def admit(self, prompt: dict, take: Take | None = None, offset: int | None = None,
                    history_of: tuple[dict, int] | None = None) -> None:
        """Wait for a credit (and, for a prompt the history filter judges, for a reason to judge
        again: history_stalled), then admit ``prompt`` or reject it (AdmissionProcessor.admit)."""
        prompt_ids = self.processor.tokenize(prompt)
        waiting_since = last_warning = time.monotonic()
        while (not self.processor.can_admit(prompt.get("mode", "train"))
               or (history_of is not None and self.processor.history_stalled())):
            self.credit.clear()
            try:  # the outcomes agent returns credits
                await asyncio.wait_for(self.credit.wait(), timeout=self.recheck_s)
            except asyncio.TimeoutError:
                pass
            if time.monotonic() - last_warning > STALL_WARNING_S:  # a stall is never silent
                last_warning = time.monotonic()
                log.warning("%s", self.processor.stall_message(prompt, last_warning - waiting_since))
        await self.send(self.processor.admit(prompt, prompt_ids, take, offset, history_of))
        if prompt.get("mode", "train") != "val":
            self.train_admitted.set()

    async def end_of_data(self, offset: int) -> None:
        """The PromptsEnd marker at ``offset``: record the end (or ignore a later marker), then
        run the later epochs."""
        if not self.processor.is_new_end(offset):
            return
        train = await asyncio.to_thread(read_prompts, self.bootstrap, self.topics.prompts, offset, self.domains)
        await self.send(self.processor.end_data(offset, len(train)))
        self.resume_epochs(train)

    # -- the later epochs
    def resume_epochs(self, train: list[dict] | None = None) -> None:
        """Start the task that admits the later epochs' prompts, unless it runs, none is left, or
        the table is still being restored (a half-restored state would repeat prompts)."""
        if not tables_recovered(self.app) or (self.epochs_task is not None and not self.epochs_task.done()):
            return
        if self.processor.replays_left():
            self.epochs_task = asyncio.ensure_future(self.run_epochs(train))

    async def run_epochs(self, train: list[dict] | None) -> None:
        while True:
            try:
                await self.admit_epochs(train)
                return
            except Exception:  # e.g. the broker did not deliver the prompts in time: read them again
                log.exception("admitting the next epoch's prompts failed; retrying in %.0f s", EPOCHS_RETRY_S)
                train = None
                await asyncio.sleep(EPOCHS_RETRY_S)

    async def admit_epochs(self, train: list[dict] | None) -> None:
        state = self.processor.load()
        if train is None:  # resumed after a restart
            log.info("resuming epoch %d at position %d", state.epoch, state.epoch_position)
            train = await asyncio.to_thread(read_prompts, self.bootstrap, self.topics.prompts, state.end_offset,
                                            self.domains)
        if len(train) != state.epoch_size:
            log.error("%s holds %d train prompts before the end marker, the first epoch had %d (retention deleted "
                      "some?): the later epochs cannot be replayed", self.topics.prompts, len(train), state.epoch_size)
            return
        await self.ensure_history()
        while (replay := self.processor.next_replay(train)) is not None:
            await self.admit(replay.prompt, replay.take, history_of=replay.history_of)
        await self.send(self.processor.settle())  # when nothing is in flight, the verdict is due now

    async def ensure_history(self) -> None:
        """Load ``prompt.history`` once per process (history filter on), before its first use."""
        async with self.history_loaded:
            if self.processor.needs_history:
                self.processor.load_history(
                    await asyncio.to_thread(read_history, self.bootstrap, self.topics.prompt_history,
                                            history.PromptHistory.from_record))

    # -- validation rounds
    def resume_eval(self) -> None:
        """Start the task that admits a validation round when one is due or unfinished."""
        if not self.watch_versions or self.processor.limits.eval_steps is None or not tables_recovered(self.app):
            return
        if self.eval_task is None or self.eval_task.done():
            self.eval_task = asyncio.ensure_future(self.run_eval())

    async def run_eval(self) -> None:
        running = self.processor.eval_running()  # a round resumed after a restart
        if not running:
            if self.processor.eval_version_due() is None:
                return
            await self.train_first()
        version = None if running else self.processor.eval_version_due()  # the newest, after the wait
        val = await asyncio.to_thread(read_prompts, self.bootstrap, self.topics.prompts,
                                      self.processor.load().end_offset, self.domains, "val")
        if not running:
            self.processor.start_eval(version, val)
        while (prompt := self.processor.next_eval(val)) is not None:
            await self.admit(prompt, core.take_eval)
        await self.send(self.processor.settle())  # the end of data may have waited for this round

    async def train_first(self) -> None:
        """Before a validation round starts, let the train prompts that the new version (or a
        returned credit) lets in be admitted first: a round is admitted whole at once, and the
        generation workers take requests in topic order, so a round admitted first would make
        the next training batch wait behind all its samples. Returns once no train prompt can
        be admitted, or when none was for ``TRAIN_FIRST_S`` while one could (none is waiting)."""
        while self.processor.can_admit("train"):
            self.train_admitted.clear()
            try:
                await asyncio.wait_for(self.train_admitted.wait(), timeout=TRAIN_FIRST_S)
            except asyncio.TimeoutError:
                return

    # -- outcomes
    async def settle_event(self, event) -> None:
        outcome = await self.emit.decode_or_dead_letter(event, "PromptOutcome")
        if outcome is not None:
            await self.apply_outcome(outcome)

    async def apply_outcome(self, outcome: dict) -> None:
        self.last_outcome = time.monotonic()
        await self.ensure_history()
        await self.send(self.processor.on_outcome(outcome))

    async def recover_outcomes(self) -> None:
        """Apply the outcomes of prompts in flight that faust did not deliver (module doc)."""
        oldest = self.processor.oldest_in_flight_ms()
        if (oldest is None or not tables_recovered(self.app)
                or time.monotonic() - self.last_outcome < OUTCOME_RECHECK_S):
            return
        try:
            records = await asyncio.to_thread(read_outcomes_since, self.bootstrap, self.topics.prompt_outcomes,
                                              oldest - CLOCK_SKEW_MS)
        except Exception:  # the broker is slow or away: the next tick tries again
            log.exception("reading %s for undelivered outcomes failed", self.topics.prompt_outcomes)
            return
        missed = [r for r in records if self.processor.in_flight(r["prompt_id"])]
        for outcome in missed:
            log.warning("outcome %s of prompt %s was on %s but not delivered to the outcomes agent: applied",
                        outcome["outcome"], outcome["prompt_id"], self.topics.prompt_outcomes)
            await self.apply_outcome(outcome)
        if missed:
            self.credit.set()
            self.resume_epochs()
        self.last_outcome = time.monotonic()


def build_admission_app(config: RLVRConfig, context: StageContext, tokenize: Tokenize | None = None,
                        store: str = "memory://") -> faust.App:
    topics = context.topics
    app = make_app(names.app_id(topics, names.ADMISSION_APP), context.bootstrap, 1, config.kafka, store)
    prompts = raw_topic(app, topics.prompts, partitions=1)
    outcomes = raw_topic(app, topics.prompt_outcomes, partitions=1)
    table = app.Table(names.ADMISSION_TABLE, default=None, partitions=1, key_type=bytes, value_type=bytes,
                      help="the AdmissionState (credits, step, budget, epoch) and the seen prompt ids")
    watch_versions = config.max_staleness is not None or config.eval_steps is not None
    versions = PolicyVersionWatcher(context.bootstrap, topics) if watch_versions else None
    processor = AdmissionProcessor(config, topics, TableStore(table), tokenize,
                                   versions.latest_version if versions is not None else lambda max_age_s=0.0: None)
    agents = AdmissionAgents(app, processor, context.bootstrap, Emitter(app, context), watch_versions)

    async def keep_epochs_running() -> None:
        """A restored admission resumes its epochs and validation."""
        agents.resume_epochs()
        agents.resume_eval()

    # no turns: the prompts agent waits for credits, which outcomes and the timer return
    punctuate_every(app, EPOCHS_CHECK_S, keep_epochs_running, None, "admission.epochs")
    punctuate_every(app, OUTCOME_RECHECK_S, agents.recover_outcomes, None, "admission.outcomes")

    @app.agent(prompts)
    async def admit(stream):
        processor.tokenizer()  # loaded before the first event
        async for event in stream.events():
            await agents.emit.guarded(agents.admit_event, event)

    @app.agent(outcomes)
    async def settle(stream):
        async for event in stream.events():
            await agents.emit.guarded(agents.settle_event, event)
            agents.credit.set()
            agents.resume_epochs()

    return app
