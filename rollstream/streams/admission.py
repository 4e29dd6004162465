"""Admission: faust agents over ``prompts`` and ``prompt.outcomes`` (one partition each: the
admission budget is global, so admission is a single writer). State is one changelog-backed
table entry; the decisions come from rollstream.filtering.admission.

The prompts agent waits (does not consume further) while no credit is free; the outcomes agent
returns credits and wakes it. Both topics have one partition and one app, so both agents always
run in the same process.

End of data: on the ``PromptsEnd`` marker the state records where the data ended, and a task
re-reads the train prompts before it with its own consumer (seeking ``prompts`` back) and admits
them in each later epoch's order. The epoch and the position in it are saved with every
admission, so a restarted admission, once its table is restored, starts the task again at that
position (faust acks an event whose handler was cancelled, so the marker is not redelivered).
Resuming is idempotent and asked for at three points: when faust reports the rebalance (and
with it the table's recovery) complete, after every outcome, and on a timer, so one missed
signal never leaves the later epochs unread.

Outcomes not delivered: a restarted admission once never received an outcome already on the
topic, its credit never returned (faust cleared events fetched while it seeked after recovery;
``streams.common.StageRecovery`` now prevents that). As a bounded backstop, when prompts are in
flight and no outcome arrived for ``OUTCOME_RECHECK_S``, the admission reads ``prompt.outcomes`` itself from the oldest in-flight
prompt's admission time on and applies the outcomes of prompts still in flight. Applying an
outcome twice is harmless (the second is an UnknownOutcome).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Callable, Sequence

import faust
from kafka import TopicPartition

from rollstream.config import RLVRConfig
from rollstream.filtering import admission as core
from rollstream.filtering import history
from rollstream.filtering.decision import Decision
from rollstream.filtering.reasons import RejectReason
from rollstream.kafka import names
from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.clients import reader_consumer
from rollstream.kafka.events import decode_expected
from rollstream.kafka.topics import Topics
from rollstream.observability.metrics import process_metrics
from rollstream.policy.chat import load_prompt_ids
from rollstream.policy.versions import PolicyVersionWatcher
from rollstream.runtime import now_ms
from rollstream.schemas.records import batch_event
from rollstream.streams.common import Emitter, make_app, raw_topic
from rollstream.streams.records import derive_seed, generation_request, group_record

log = logging.getLogger(__name__)

Tokenize = Callable[[dict], Sequence[int]]  # a Prompt record -> its chat-templated token ids
VERSION_POLL_S = 0.5
EPOCHS_RETRY_S = 5.0
EPOCHS_CHECK_S = 2.0  # how often a restored admission checks that its epochs task runs
STALL_WARNING_S = 60.0  # a prompt waiting for a credit or a policy version this long is logged, again and again
OUTCOME_RECHECK_S = 10.0  # credits waited for this long without an outcome: read the topic itself
CLOCK_SKEW_MS = 60_000  # how far an outcome's timestamp may lag its admission (other machines' clocks)


def default_tokenize(model_path: str | None = None) -> Tokenize:
    """The generation model's chat-templated tokenisation of a Prompt (what `prompt_length`
    limits): its ``messages`` when non-empty, else its ``prompt`` as one user turn."""
    prompt_ids = load_prompt_ids(model_path)  # the bundled model's without importing transformers
    return lambda prompt: prompt_ids(prompt.get("messages") or prompt["prompt"])


def _read_partition(bootstrap: Bootstrap, topic: str, schemas: tuple[str, ...], end_offset: int | None = None,
                    since_ms: int | None = None, timeout_s: float = 60.0) -> list[tuple[str, dict]]:
    """``(schema, record)`` of the decodable, valid records of ``schemas`` on partition 0 of
    ``topic``, in topic order: from the earliest offset held (or the first written at
    ``since_ms``, epoch ms, or later) to ``end_offset`` (None: the end offset at the call).
    Raises TimeoutError when the broker does not deliver them within ``timeout_s``."""
    consumer = reader_consumer(bootstrap)
    tp = TopicPartition(topic, 0)
    try:
        consumer.assign([tp])
        end = consumer.end_offsets([tp])[tp] if end_offset is None else end_offset
        if since_ms is None:
            consumer.seek_to_beginning(tp)
        else:
            start = consumer.offsets_for_times({tp: max(0, since_ms)})[tp]
            if start is None:  # nothing written since then
                return []
            consumer.seek(tp, start.offset)
        out: list[tuple[str, dict]] = []
        deadline = time.monotonic() + timeout_s
        while consumer.position(tp) < end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: read up to offset {consumer.position(tp)} of {end} in {timeout_s}s")
            for message in consumer.poll(timeout_ms=500).get(tp, []):
                if message.offset >= end:
                    break
                schema, record, problem = decode_expected(message.value, schemas)
                if problem is None:
                    out.append((schema, record))
        return out
    finally:
        consumer.close()


def read_prompts(bootstrap: Bootstrap, topic: str, end_offset: int | None, domains: set[str], mode: str = "train",
                 timeout_s: float = 60.0) -> list[dict]:
    """The Prompt records of ``mode`` and ``domains`` at offsets below ``end_offset`` (None: the
    end offset at the call) on ``topic``, in topic order: what each later epoch re-reads (train)
    and each validation round admits again (val). Undecodable or malformed events, unknown
    domains and repeated ids were never admitted and are skipped."""
    out: list[dict] = []
    seen: set[str] = set()  # a repeated id was dead-lettered as a duplicate: admitted once
    for schema, record in _read_partition(bootstrap, topic, ("Prompt", "PromptsEnd"), end_offset, timeout_s=timeout_s):
        if (schema == "Prompt" and record.get("mode", "train") == mode and record["domain"] in domains
                and record["prompt_id"] not in seen):
            seen.add(record["prompt_id"])
            out.append(record)
    return out


def read_outcomes_since(bootstrap: Bootstrap, topic: str, since_ms: int, timeout_s: float = 30.0) -> list[dict]:
    """The PromptOutcome records on ``topic`` written at ``since_ms`` (epoch ms) or later, up to
    the end offset at the call, in topic order (undecodable events skipped: the outcomes agent
    dead-letters them)."""
    return [r for _, r in _read_partition(bootstrap, topic, ("PromptOutcome",), since_ms=since_ms, timeout_s=timeout_s)]


def read_history(bootstrap: Bootstrap, topic: str, timeout_s: float = 60.0) -> dict[str, history.PromptHistory]:
    """The newest PromptHistory of every prompt on the compacted ``topic`` (prompt_id -> history)."""
    return {r["prompt_id"]: history.PromptHistory.from_record(r)
            for _, r in _read_partition(bootstrap, topic, ("PromptHistory",), timeout_s=timeout_s)}


def limits_of(config: RLVRConfig) -> core.AdmissionLimits:
    return core.AdmissionLimits(
        rollout_batch_size=config.rollout_batch_size,
        max_running_prompts=config.max_running_prompts,
        max_prompts_per_batch=config.max_prompts_per_batch,
        max_additional_running_prompts=config.max_additional_running_prompts,
        max_steps=config.max_steps,
        max_staleness=config.max_staleness,
        num_epochs=config.num_epochs,
        seed=config.seed,
        eval_steps=config.eval_steps,
    )


def build_admission_app(config: RLVRConfig, bootstrap: Bootstrap, tokenize: Tokenize | None = None,
                        store: str = "memory://") -> faust.App:
    topics = Topics(config.kafka.topic_prefix)
    app = make_app(names.app_id(topics, names.ADMISSION_APP), bootstrap, 1, config.kafka, store)
    limits = limits_of(config)
    emit = Emitter(app, topics, "admission")
    prompts = raw_topic(app, topics.prompts, 1)
    outcomes = raw_topic(app, topics.prompt_outcomes, 1)
    # use_partitioner: the epochs task saves the state outside any event (one partition anyway)
    table = app.Table(names.ADMISSION_TABLE, default=None, partitions=1, key_type=bytes, value_type=bytes,
                      use_partitioner=True, help="the AdmissionState (credits, step, budget, epoch) and the seen prompt ids")
    credit = asyncio.Event()
    metrics = process_metrics()
    prompt_filter, prompt_filter_hash = core.prompt_filter_config(config.prompt_length)
    history_filter = core.history_filter_config(config.history_filter.model_dump())
    watch_versions = limits.max_staleness is not None or limits.eval_steps is not None
    versions = PolicyVersionWatcher(bootstrap, topics) if watch_versions else None
    history_limits = config.history_limits()
    histories: dict[str, history.PromptHistory] = {}  # base prompt_id -> its history, once loaded
    history_loaded = asyncio.Lock()
    loaded: list[bool] = []
    # credits arrive as events; policy versions are polled while the staleness bound holds a step
    recheck_s = VERSION_POLL_S if versions is not None else None
    tokenizer: list[Tokenize] = [tokenize] if tokenize else []
    epochs_task: list[asyncio.Future] = []  # the running task of resume_epochs, if any
    eval_task: list[asyncio.Future] = []  # the running task of resume_eval, if any

    def load() -> core.AdmissionState:
        raw = table.get(names.ADMISSION_KEY)
        return core.AdmissionState.from_dict(json.loads(raw)) if raw else core.AdmissionState()

    def save(state: core.AdmissionState) -> None:
        table[names.ADMISSION_KEY] = json.dumps(state.to_dict()).encode()
        metrics.in_flight.labels("prompts").set(len(state.in_flight))

    async def admit_one(event) -> None:
        schema, record, problem = decode_expected(event.value, ("Prompt", "PromptsEnd"))
        if problem is not None:
            await emit.dead_letter(event, *problem)
            return
        offset = event.message.offset
        if schema == "PromptsEnd":
            await end_of_data(offset)
            return
        end = load().end_offset
        if end is not None and offset < end:  # redelivered after a restart: admitted already
            log.info("prompt %s at offset %d before the end marker: already admitted", record["prompt_id"], offset)
            return
        if end is not None:
            await emit.dead_letter(event, "invalid_event", f"prompt after the end of data (PromptsEnd at offset {end})")
            return
        if record["domain"] not in config.rewards:
            await emit.dead_letter(event, "invalid_event", f"unknown domain {record['domain']!r}")
            return
        seen = table.get(seen_key(record["prompt_id"]))
        if seen is not None and int(seen) == offset:  # redelivered after a restart: admitted already
            log.info("prompt %s at offset %d: already admitted", record["prompt_id"], offset)
            return
        if seen is not None:
            await emit.dead_letter(event, "invalid_event", f"duplicate prompt_id {record['prompt_id']!r}: admitted "
                                   f"at offset {int(seen)} already (prompt ids must be unique per run)")
            return
        await admit_prompt(record, offset=offset)

    def seen_key(prompt_id: str) -> bytes:
        return names.ADMISSION_SEEN_PREFIX + prompt_id.encode()

    async def admit_prompt(prompt: dict, take: Callable[[core.AdmissionState], core.AdmissionState] | None = None,
                           offset: int | None = None, history_of: tuple[dict, int] | None = None) -> None:
        """Wait for a credit, then admit ``prompt`` or reject it before generation; ``take``:
        it is the next prompt of a later epoch or of a validation round, and ``take`` moves that
        position past it (saved with the decision); ``offset``: where a first read found it on
        ``prompts``, recorded with the decision so a later event with its id is told apart as a
        redelivery (same offset) or a duplicate; ``history_of``: (its first-epoch record, the
        epoch) for the history filter, decided once the credit is there (so with the newest
        history: every outcome that returned a credit is in it)."""
        mode = prompt.get("mode", "train")
        if not tokenizer:  # the epochs task may start before the prompts agent loaded it
            tokenizer.append(default_tokenize(config.infer_model_path))
        prompt_ids = list(tokenizer[0](prompt))
        waiting_since = last_warning = time.monotonic()
        while not core.can_admit(state := load(), limits, mode,
                                 version := versions.latest_version() if versions is not None else None):
            credit.clear()
            try:  # the outcomes agent returns credits
                await asyncio.wait_for(credit.wait(), timeout=recheck_s)
            except asyncio.TimeoutError:
                pass
            if time.monotonic() - last_warning > STALL_WARNING_S:  # a stall is never silent
                last_warning = time.monotonic()
                log.warning("prompt %s has waited %.0f s: %d prompts in flight, step %d, newest policy version %s%s",
                            prompt["prompt_id"], last_warning - waiting_since, len(state.in_flight), state.step,
                            version, "" if limits.max_staleness is None else
                            f" (step {state.step} needs version {state.step - limits.max_staleness}: is the trainer up?)")
        if history_of is not None and await skipped_by_history(state, *history_of):
            return
        if take is not None:
            state = take(state)
        if offset is not None:
            table[seen_key(prompt["prompt_id"])] = str(offset).encode()
        verdict = core.prompt_length_decision(len(prompt_ids), config.prompt_length)
        if verdict is not None:
            state = core.reject_before_generation(state, verdict.reason, mode)
            state, effects = core.check_step(state, limits)
            save(state)
            metrics.decision("prompt", False, verdict.reason)
            await _reject_prompt(prompt, verdict)
            await _apply(effects)
            return
        save(core.admit(state, prompt["prompt_id"], mode, now_ms()))
        metrics.decision("prompt", True, "accepted")
        request = generation_request(
            prompt, round_=0,
            num_return_sequences=config.val_num_return_sequences if mode == "val" else config.num_return_sequences_in_group,
            sample_offset=0, seed=derive_seed(config.seed, prompt["prompt_id"], 0),
        )
        await emit.send(topics.generation_requests, prompt["prompt_id"], request, "GenerationRequest")

    async def end_of_data(offset: int) -> None:
        """The PromptsEnd marker at ``offset``: record the end (or ignore a later marker), then
        run the later epochs."""
        state = load()
        if state.end_offset not in (None, offset):
            await _apply(core.on_data_end(state, limits, offset, state.epoch_size)[1])  # ExtraEnd
            return
        train = await asyncio.to_thread(read_prompts, bootstrap, topics.prompts, offset, set(config.rewards))
        state, effects = core.on_data_end(load(), limits, offset, len(train))
        save(state)
        await _apply(effects)
        resume_epochs(train)

    def resume_epochs(train: list[dict] | None = None) -> None:
        """Start the task that admits the later epochs' prompts, unless it runs, none is left, or
        the table is still being restored (a half-restored state would repeat prompts)."""
        if not app.tables.recovery.completed.is_set():
            return
        if (epochs_task and not epochs_task[0].done()) or core.next_replay(load(), limits) is None:
            return
        epochs_task[:] = [asyncio.ensure_future(run_epochs(train))]

    async def run_epochs(train: list[dict] | None) -> None:
        while True:
            try:
                await admit_epochs(train)
                return
            except Exception:  # e.g. the broker did not deliver the prompts in time: read them again
                log.exception("admitting the next epoch's prompts failed; retrying in %.0f s", EPOCHS_RETRY_S)
                train = None
                await asyncio.sleep(EPOCHS_RETRY_S)

    async def admit_epochs(train: list[dict] | None) -> None:
        state = load()
        if train is None:  # resumed after a restart
            log.info("resuming epoch %d at position %d", state.epoch, state.epoch_position)
            train = await asyncio.to_thread(read_prompts, bootstrap, topics.prompts, state.end_offset,
                                            set(config.rewards))
        if len(train) != state.epoch_size:
            log.error("%s holds %d train prompts before the end marker, the first epoch had %d (retention deleted "
                      "some?): the later epochs cannot be replayed", topics.prompts, len(train), state.epoch_size)
            return
        if history_limits is not None:
            await ensure_history()
        take = lambda s: core.take_replay(s, limits)  # noqa: E731
        while (nxt := core.next_replay(load(), limits)) is not None:
            epoch, index = nxt
            original = train[index]
            await admit_prompt({**original, "prompt_id": core.epoch_prompt_id(original["prompt_id"], epoch)}, take,
                               history_of=(original, epoch) if history_limits is not None else None)
        state, effects = core.check_step(load(), limits)  # when nothing is in flight, the verdict is due now
        save(state)
        await _apply(effects)

    async def ensure_history() -> None:
        """Load ``prompt.history`` once per process, before the first read or write of it."""
        async with history_loaded:
            if not loaded:
                histories.update(await asyncio.to_thread(read_history, bootstrap, topics.prompt_history))
                loaded.append(True)

    async def skipped_by_history(state: core.AdmissionState, prompt: dict, epoch: int) -> bool:
        """Decide the history filter for ``prompt`` (its first-epoch record) in ``epoch``; when it
        skips, move past it, count it, and record it (history, a rejected Group). ``state`` was
        just loaded: nothing awaits before it is saved (ensure_history ran before)."""
        explore = history.ExploreState.from_dict(state.explore, history_limits)
        past = histories.get(prompt["prompt_id"])
        decision = history.decide_skip(past, explore, history_limits, prompt["prompt_id"], epoch)
        if not decision.skip:
            return False
        state = core.skip_by_history(core.take_replay(state, limits))
        state, effects = core.check_step(state, limits)
        save(state)
        await write_history(history.on_skip(past))
        metrics.decision("prompt", False, RejectReason.SKIPPED_BY_HISTORY.value)
        current = versions.latest_version(VERSION_POLL_S) if versions is not None else None  # where the curve counts it
        await _reject_prompt({**prompt, "prompt_id": core.epoch_prompt_id(prompt["prompt_id"], epoch)},
                             Decision.reject(RejectReason.SKIPPED_BY_HISTORY, **decision.values()), history_filter,
                             policy_version=current or 0)
        await _apply(effects)
        return True

    async def write_history(entry: history.PromptHistory) -> None:
        histories[entry.prompt_id] = entry
        await emit.send(topics.prompt_history, entry.prompt_id, entry.to_record(), "PromptHistory")

    def learn_history(state: core.AdmissionState, outcome: dict) -> history.PromptHistory | None:
        """A train group was decided (not a redelivery): add its pattern to the prompt's history
        and adapt the exploration probabilities in ``state`` (saved by the caller with the
        outcome, in one table write); returns the history to publish."""
        if history_limits is None or outcome.get("mode", "train") != "train" or not outcome.get("reward_pattern"):
            return None
        base, epoch = history.split_epoch(outcome["prompt_id"])
        entry = histories.get(base) or history.PromptHistory(base)
        entry.record(epoch, outcome["reward_pattern"], outcome["policy_version"])
        histories[base] = entry
        explore = history.ExploreState.from_dict(state.explore, history_limits)
        state.explore = history.observe(explore, history_limits, outcome["reward_pattern"]).to_dict()
        return entry

    def resume_eval() -> None:
        """Start the task that admits a validation round when one is due or unfinished."""
        if versions is None or limits.eval_steps is None or not app.tables.recovery.completed.is_set():
            return
        if eval_task and not eval_task[0].done():
            return
        eval_task[:] = [asyncio.ensure_future(run_eval())]

    async def run_eval() -> None:
        state = load()
        running = core.next_eval(state) is not None  # a round resumed after a restart
        version = None if running else core.eval_due(state, limits, versions.latest_version())  # not thread-safe
        if not running and version is None:
            return
        val = await asyncio.to_thread(read_prompts, bootstrap, topics.prompts, state.end_offset,
                                      set(config.rewards), "val")
        if not running:
            state = core.start_eval(load(), version, len(val))
            save(state)
            log.info("validation round of policy version %d: %d prompts", version, len(val))
        if len(val) < state.eval_size:
            log.error("%s holds %d validation prompts, the round of version %d had %d: it ends short",
                      topics.prompts, len(val), state.eval_version, state.eval_size)
            state.eval_size = state.eval_position = min(state.eval_position, len(val))
            save(state)
        while (index := core.next_eval(load())) is not None:
            original = val[index]
            await admit_prompt({**original, "prompt_id": core.eval_prompt_id(original["prompt_id"],
                                                                              load().eval_version)}, core.take_eval)
        state, effects = core.check_step(load(), limits)  # the end of data may have waited for this round
        save(state)
        await _apply(effects)

    @app.on_rebalance_complete.connect
    async def restored(sender, **kwargs) -> None:
        """The table is restored: a restarted admission resumes its epochs and validation."""
        resume_epochs()
        resume_eval()

    @app.timer(EPOCHS_CHECK_S)
    async def keep_epochs_running() -> None:
        resume_epochs()
        resume_eval()

    @app.agent(prompts)
    async def admit(stream):
        if not tokenizer:
            tokenizer.append(default_tokenize(config.infer_model_path))
        async for event in stream.events():
            await emit.guarded(admit_one, event)

    async def _reject_prompt(prompt: dict, verdict: Decision, decided_by: tuple[str, str] | None = None,
                             policy_version: int = 0) -> None:
        """A rejected Group for a prompt decided before generation; ``decided_by``: its
        (filter_config, filter_config_hash), the prompt length filter's by default."""
        filter_config, filter_hash = decided_by or (prompt_filter, prompt_filter_hash)
        group = group_record(
            prompt=prompt, decided_accepted=False, reason=verdict.reason, values=dict(verdict.values),
            responses=[], filter_config=filter_config, filter_config_hash=filter_hash, policy_version=policy_version,
            rounds=0, responses_generated=0,
        )
        await emit.send(topics.groups_rejected, prompt["prompt_id"], group, "Group")

    async def settle_one(event) -> None:
        outcome = await emit.decode_or_dead_letter(event, "PromptOutcome")
        if outcome is not None:
            await apply_outcome(outcome)

    async def apply_outcome(outcome: dict) -> None:
        last_outcome[0] = time.monotonic()
        if history_limits is not None:
            await ensure_history()
        state, effects = core.on_outcome(
            load(), limits, outcome["prompt_id"], outcome["outcome"] == "commit", outcome["reason"])
        learned = None if any(isinstance(e, core.UnknownOutcome) for e in effects) else learn_history(state, outcome)
        save(state)
        if learned is not None:
            await write_history(learned)
        await _apply(effects)

    last_outcome = [time.monotonic()]  # when an outcome was last applied (or the process started)

    @app.agent(outcomes)
    async def settle(stream):
        async for event in stream.events():
            await emit.guarded(settle_one, event)
            credit.set()
            resume_epochs()

    @app.timer(OUTCOME_RECHECK_S)
    async def recover_outcomes() -> None:
        """Apply the outcomes of prompts in flight that faust did not deliver (module doc)."""
        oldest = core.oldest_admission_ms(load())
        if (oldest is None or not app.tables.recovery.completed.is_set()
                or time.monotonic() - last_outcome[0] < OUTCOME_RECHECK_S):
            return
        try:
            records = await asyncio.to_thread(read_outcomes_since, bootstrap, topics.prompt_outcomes,
                                              oldest - CLOCK_SKEW_MS)
        except Exception:  # the broker is slow or away: the next tick tries again
            log.exception("reading %s for undelivered outcomes failed", topics.prompt_outcomes)
            return
        missed = [r for r in records if r["prompt_id"] in load().in_flight]
        for outcome in missed:
            log.warning("outcome %s of prompt %s was on %s but not delivered to the outcomes agent: applied",
                        outcome["outcome"], outcome["prompt_id"], topics.prompt_outcomes)
            await apply_outcome(outcome)
        if missed:
            credit.set()
            resume_epochs()
        last_outcome[0] = time.monotonic()

    async def _apply(effects: list) -> None:
        for effect in effects:
            if isinstance(effect, core.StepComplete):
                log.info("step %d complete: %d groups accepted after %d prompts; rejected %s", effect.step,
                         effect.accepted, effect.prompts_consumed, dict(effect.rejected_by_reason))
            elif isinstance(effect, core.StepVerdict):
                log.warning("step %d ends %s: %d/%d groups after %d prompts", effect.step, effect.status,
                            effect.accepted, effect.target, effect.prompts_consumed)
                await emit.send(topics.batches, str(effect.step), batch_event(
                    step=effect.step, status=effect.status, target=effect.target,
                    accepted=effect.accepted, prompts_consumed=effect.prompts_consumed,
                    rejected_by_reason=effect.rejected_by_reason), "Batch")
            elif isinstance(effect, core.ExtraEnd):
                log.warning("PromptsEnd at offset %d after the end of data: ignored", effect.offset)
            elif isinstance(effect, core.UnknownOutcome):
                log.info("outcome for unknown prompt %s ignored (redelivery)", effect.prompt_id)

    return app
