"""Admission: faust agents over ``prompts`` and ``prompt.outcomes`` (one partition each: the
admission budget is global, so admission is a single writer). State is one changelog-backed
table entry; the decisions come from rollstream.filtering.admission.

The prompts agent waits (does not consume further) while no credit is free; the outcomes agent
returns credits and wakes it. Both topics have one partition and one app, so both agents always
run in the same process.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Callable, Sequence

import faust

from rollstream.config import RLVRConfig
from rollstream.filtering import admission as core
from rollstream.filtering.decision import Decision
from rollstream.kafka import names
from rollstream.kafka.topics import Topics
from rollstream.observability.metrics import process_metrics
from rollstream.policy.model import chat_prompt_ids, load_tokenizer
from rollstream.policy.versions import PolicyVersionWatcher
from rollstream.schemas.records import batch_event
from rollstream.streams.common import Emitter, make_app, raw_topic
from rollstream.streams.events import derive_seed, generation_request, group_record

log = logging.getLogger(__name__)

Tokenize = Callable[[str], Sequence[int]]
VERSION_POLL_S = 0.5


def default_tokenize() -> Tokenize:
    """The generation model's chat-templated tokenisation (what `prompt_length` limits)."""
    tokenizer = load_tokenizer()
    return lambda text: chat_prompt_ids(tokenizer, text)


def limits_of(config: RLVRConfig) -> core.AdmissionLimits:
    return core.AdmissionLimits(
        rollout_batch_size=config.rollout_batch_size,
        max_running_prompts=config.max_running_prompts,
        max_prompts_per_batch=config.max_prompts_per_batch,
        max_additional_running_prompts=config.max_additional_running_prompts,
        max_steps=config.max_steps,
        max_staleness=config.max_staleness,
    )


def build_admission_app(config: RLVRConfig, bootstrap: str, tokenize: Tokenize | None = None,
                        store: str = "memory://") -> faust.App:
    topics = Topics(config.kafka.topic_prefix)
    app = make_app(names.app_id(topics, names.ADMISSION_APP), bootstrap, 1, store, config.kafka.max_message_bytes)
    limits = limits_of(config)
    emit = Emitter(app, topics, "admission")
    prompts = raw_topic(app, topics.prompts, 1)
    outcomes = raw_topic(app, topics.prompt_outcomes, 1)
    table = app.Table(names.ADMISSION_TABLE, default=None, partitions=1, key_type=bytes,
                      value_type=bytes, help="the single AdmissionState (credits, step, budget)")
    credit = asyncio.Event()
    metrics = process_metrics()
    prompt_filter, prompt_filter_hash = core.prompt_filter_config(config.prompt_length)
    versions = PolicyVersionWatcher(bootstrap, topics) if limits.max_staleness is not None else None
    # credits arrive as events; policy versions are polled while the staleness bound holds a step
    recheck_s = VERSION_POLL_S if versions is not None else None
    tokenizer: list[Tokenize] = [tokenize] if tokenize else []

    def load() -> core.AdmissionState:
        raw = table.get(names.ADMISSION_KEY)
        return core.AdmissionState.from_dict(json.loads(raw)) if raw else core.AdmissionState()

    def save(state: core.AdmissionState) -> None:
        table[names.ADMISSION_KEY] = json.dumps(state.to_dict()).encode()
        metrics.in_flight.labels("prompts").set(len(state.in_flight))

    async def admit_one(event) -> None:
        prompt = await emit.decode_or_dead_letter(event, "Prompt")
        if prompt is None:
            return
        if prompt["domain"] not in config.rewards:
            await emit.dead_letter(event, "invalid_event", f"unknown domain {prompt['domain']!r}")
            return
        mode = prompt.get("mode", "train")
        prompt_ids = list(tokenizer[0](prompt["prompt"]))
        while not core.can_admit(state := load(), limits, mode,
                                 versions.latest_version() if versions is not None else None):
            credit.clear()
            try:  # the outcomes agent returns credits
                await asyncio.wait_for(credit.wait(), timeout=recheck_s)
            except asyncio.TimeoutError:
                pass
        verdict = core.prompt_length_decision(len(prompt_ids), config.prompt_length)
        if verdict is not None:
            state = core.reject_before_generation(state, verdict.reason, mode)
            state, effects = core.check_step(state, limits)
            save(state)
            metrics.decision("prompt", False, verdict.reason)
            await _reject_prompt(prompt, verdict)
            await _apply(effects)
            return
        save(core.admit(state, prompt["prompt_id"], mode))
        metrics.decision("prompt", True, "accepted")
        request = generation_request(
            prompt, round_=0,
            num_return_sequences=config.val_num_return_sequences if mode == "val" else config.num_return_sequences_in_group,
            sample_offset=0, seed=derive_seed(config.seed, prompt["prompt_id"], 0),
        )
        await emit.send(topics.generation_requests, prompt["prompt_id"], request, "GenerationRequest")

    @app.agent(prompts)
    async def admit(stream):
        if not tokenizer:
            tokenizer.append(default_tokenize())
        async for event in stream.events():
            await emit.guarded(admit_one, event)

    async def _reject_prompt(prompt: dict, verdict: Decision) -> None:
        group = group_record(
            prompt=prompt, decided_accepted=False, reason=verdict.reason, values=dict(verdict.values),
            responses=[], filter_config=prompt_filter, filter_config_hash=prompt_filter_hash, policy_version=0, rounds=0,
            responses_generated=0,
        )
        await emit.send(topics.groups_rejected, prompt["prompt_id"], group, "Group")

    async def settle_one(event) -> None:
        outcome = await emit.decode_or_dead_letter(event, "PromptOutcome")
        if outcome is None:
            return
        state, effects = core.on_outcome(
            load(), limits, outcome["prompt_id"], outcome["outcome"] == "commit", outcome["reason"])
        save(state)
        await _apply(effects)

    @app.agent(outcomes)
    async def settle(stream):
        async for event in stream.events():
            await emit.guarded(settle_one, event)
            credit.set()

    async def _apply(effects: list) -> None:
        for effect in effects:
            if isinstance(effect, core.StepComplete):
                log.info("step %d complete: %d groups accepted after %d prompts; rejected %s", effect.step,
                         effect.accepted, effect.prompts_consumed, dict(effect.rejected_by_reason))
            elif isinstance(effect, core.BatchUnderfilled):
                log.warning("batch %d underfilled: %d/%d groups after %d prompts", effect.step,
                            effect.accepted, effect.target, effect.prompts_consumed)
                await emit.send(topics.batches, str(effect.step), batch_event(
                    step=effect.step, status="underfilled", target=effect.target,
                    accepted=effect.accepted, prompts_consumed=effect.prompts_consumed,
                    rejected_by_reason=effect.rejected_by_reason), "Batch")
            elif isinstance(effect, core.UnknownOutcome):
                log.info("outcome for unknown prompt %s ignored (redelivery)", effect.prompt_id)

    return app
