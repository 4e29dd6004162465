"""What the admission does with each prompt, outcome and marker, without faust or asyncio: a
Store (rollstream.streams.store) in, events out. The faust agents (rollstream.streams.admission_agent) wait for credits,
read Kafka and send; the decisions are rollstream.filtering.admission's.

Table layout (one partition: the admission is a single writer):

- ``names.ADMISSION_KEY`` -> the ``AdmissionState`` (JSON): credits, step, budget, epoch and
  validation positions;
- ``names.ADMISSION_SEEN_PREFIX + prompt_id`` -> the offset on ``prompts`` at which that prompt
  was first admitted, so a redelivery (same offset) is told apart from a duplicate id.

A method that changes the state saves it before it returns, and returns the events to send as
the ``Handled`` every stream processor returns (rollstream.streams.processor; its Sends encoded
here): the shell never awaits between a load and the save that follows it. Admission is not driven
event by event as the others are (it waits for credits and reads its own topics back), so it
answers the calls of that wait rather than ``handle``/``tick``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Callable, Sequence

from rollstream.config import RLVRConfig
from rollstream.filtering import admission as core
from rollstream.filtering import history
from rollstream.filtering.decision import Decision
from rollstream.filtering.reasons import RejectReason
from rollstream.kafka import names
from rollstream.kafka.events import Send
from rollstream.kafka.topics import Topics
from rollstream.observability.metrics import process_metrics
from rollstream.policy.prompt_ids import load_prompt_ids
from rollstream.runtime import now_ms
from rollstream.schemas import encode
from rollstream.schemas.records import batch_event
from rollstream.streams.event_builders import derive_seed, generation_request, group_record
from rollstream.streams.processor import Handled
from rollstream.streams.store import Store

log = logging.getLogger(__name__)

Tokenize = Callable[[dict], Sequence[int]]  # a Prompt record -> its chat-templated token ids
Take = Callable[[core.AdmissionState], core.AdmissionState]
VersionOf = Callable[[float], "int | None"]  # max age in s -> the newest policy version (None: unknown)
VERSION_POLL_S = 0.5


@dataclass(frozen=True)
class Screened:
    """What to do with one event of ``prompts``: ``admit`` it (wait for a credit), record the
    ``end`` of data, ``skip`` a redelivery (``why`` is logged), or ``dead_letter`` it (``why`` is
    the error; reason ``invalid_event``)."""

    action: str
    why: str = ""


@dataclass(frozen=True)
class Replay:
    """The next prompt of a later epoch: the transaction to admit, how to move the epoch
    position past it, and (with the history filter on) its first-epoch record and epoch."""

    prompt: dict
    take: Take
    history_of: tuple[dict, int] | None


def default_tokenize(model_path: str | None = None) -> Tokenize:
    """The generation model's chat-templated tokenisation of a Prompt (what `prompt_length`
    limits): its ``messages`` when non-empty, else its ``prompt`` as one user turn."""
    prompt_ids = load_prompt_ids(model_path)  # the bundled model's without importing transformers
    return lambda prompt: prompt_ids(prompt.get("messages") or prompt["prompt"])


class AdmissionProcessor:
    """The admission of one RLVR config over ``store`` (its one partition, 0).

    ``latest_version(max_age_s)`` returns the newest published policy version (None: unknown or
    not watched); ``tokenize`` (default: the generation model's chat template, loaded on first
    use) gives the token count the prompt length filter limits.
    """

    def __init__(self, config: RLVRConfig, topics: Topics, store: Store, tokenize: Tokenize | None = None,
                 latest_version: VersionOf = lambda max_age_s=0.0: None) -> None:
        self.config = config
        self.topics = topics
        self.store = store
        self.limits = config.admission_limits()
        self.filters = config.domain_filters()  # a screened domain's round 0 asks for its first k samples
        self.latest_version = latest_version
        self.metrics = process_metrics()
        self.prompt_filter = core.prompt_filter_config(config.prompt_length)
        self.history_filter = core.history_filter_config(config.history_filter.model_dump())
        self.history_limits = config.history_limits()
        self.histories: dict[str, history.PromptHistory] | None = None  # base prompt_id -> history, once loaded
        self._tokenize = tokenize
        self._eval_checked: int | None = None  # the newest version eval_version_due has seen

    # -- state
    def load(self) -> core.AdmissionState:
        raw = self.store.get(names.ADMISSION_KEY)
        return core.AdmissionState.from_dict(json.loads(raw)) if raw else core.AdmissionState()

    def save(self, state: core.AdmissionState) -> None:
        self.store.put(0, names.ADMISSION_KEY, json.dumps(state.to_dict()).encode())
        self.metrics.in_flight.labels("prompts").set(len(state.in_flight))

    def tokenizer(self) -> Tokenize:
        """The tokenisation the prompt length filter counts, loaded on first use."""
        if self._tokenize is None:
            self._tokenize = default_tokenize(self.config.infer_model_path)
        return self._tokenize

    def tokenize(self, prompt: dict) -> list[int]:
        return list(self.tokenizer()(prompt))

    @property
    def needs_history(self) -> bool:
        """The history filter is on and ``prompt.history`` is not loaded yet (``load_history``)."""
        return self.history_limits is not None and self.histories is None

    def load_history(self, histories: dict[str, history.PromptHistory]) -> None:
        self.histories = dict(histories)

    # -- prompts
    def screen(self, schema: str, record: dict, offset: int) -> Screened:
        """Decide what the event at ``offset`` of ``prompts`` (decoded as ``schema``) is."""
        if schema == "PromptsEnd":
            return Screened("end")
        end = self.load().end_offset
        if end is not None and offset < end:
            return Screened("skip", f"prompt {record['prompt_id']} at offset {offset} before the end marker: "
                                    "already admitted")
        if end is not None:
            return Screened("dead_letter", f"prompt after the end of data (PromptsEnd at offset {end})")
        if record["domain"] not in self.config.rewards:
            return Screened("dead_letter", f"unknown domain {record['domain']!r}")
        seen = self.store.get(names.ADMISSION_SEEN_PREFIX + record["prompt_id"].encode())
        if seen is not None and int(seen) == offset:
            return Screened("skip", f"prompt {record['prompt_id']} at offset {offset}: already admitted")
        if seen is not None:
            return Screened("dead_letter", f"duplicate prompt_id {record['prompt_id']!r}: admitted at offset "
                                           f"{int(seen)} already (prompt ids must be unique per run)")
        return Screened("admit")

    def can_admit(self, mode: str) -> bool:
        return core.can_admit(self.load(), self.limits, mode, self.latest_version(0.0))

    def history_stalled(self) -> bool:
        """Revisits paced by versions (history_filter.revisit_versions): an epoch's worth of train
        prompts was skipped at the newest version and a train prompt is in flight, so the next
        waits for its outcome or a new version (core.history_pass_done)."""
        state = self.load()
        return state.train_in_flight() > 0 and self._pass_done(state, self.latest_version(0.0) or 0)

    def _pass_done(self, state: core.AdmissionState, version: int) -> bool:
        """Revisits are paced by versions and an epoch's worth was skipped at ``version``."""
        return (self.history_limits is not None and self.history_limits.revisit_versions > 0
                and core.history_pass_done(state, version))

    def stall_message(self, prompt: dict, waited_s: float) -> str:
        state, version = self.load(), self.latest_version(0.0)
        bound = self.limits.max_staleness
        return (f"prompt {prompt['prompt_id']} has waited {waited_s:.0f} s: {len(state.in_flight)} prompts in "
                f"flight, step {state.step}, newest policy version {version}"
                + ("" if bound is None else f" (step {state.step} needs version {state.step - bound}: "
                                            "is the trainer up?)"))

    def admit(self, prompt: dict, prompt_ids: Sequence[int], take: Take | None = None, offset: int | None = None,
              history_of: tuple[dict, int] | None = None) -> Handled:
        """Admit ``prompt`` (a credit is free: ``can_admit``) or reject it before generation.

        ``take``: it is the next prompt of a later epoch or of a validation round, and ``take``
        moves that position past it (saved with the decision); ``offset``: where the first read
        found it on ``prompts``, recorded so a later event with its id is a redelivery (same
        offset) or a duplicate; ``history_of``: (its first-epoch record, the epoch) for the
        history filter, decided now, with every outcome that returned a credit in the history.
        """
        state = self.load()
        if history_of is not None:
            skipped = self._skip_by_history(state, *history_of)
            if skipped is not None:
                return skipped
        if take is not None:
            state = take(state)
        if offset is not None:
            self.store.put(0, names.ADMISSION_SEEN_PREFIX + prompt["prompt_id"].encode(), str(offset).encode())
        mode = prompt.get("mode", "train")
        verdict = core.prompt_length_decision(len(prompt_ids), self.config.prompt_length)
        if verdict is not None:
            state = core.reject_before_generation(state, verdict.reason, mode)
            state, effects = core.check_step(state, self.limits)
            self.save(state)
            self.metrics.decision("prompt", False, verdict.reason)
            return Handled([self.rejected_group(prompt, verdict), *self.outputs(effects)])
        self.save(core.admit(state, prompt["prompt_id"], mode, now_ms()))
        self.metrics.decision("prompt", True, "accepted")
        n = self.filters[prompt["domain"]].first_round(mode)
        request = generation_request(prompt, round_=0, num_return_sequences=n, sample_offset=0,
                                     seed=derive_seed(self.config.seed, prompt["prompt_id"], 0))
        return Handled([self.send(self.topics.generation_requests, prompt["prompt_id"], "GenerationRequest", request)])

    def _skip_by_history(self, state: core.AdmissionState, prompt: dict, epoch: int) -> Handled | None:
        """When the history filter skips ``prompt`` (its first-epoch record) in ``epoch``: move
        past it, count it, save, and return its history and rejected Group; else None."""
        explore = history.ExploreState.from_dict(state.explore, self.history_limits)
        past = self.histories.get(prompt["prompt_id"])
        # the policy's change since the last outcome paces revisits (revisit_versions); the
        # learning curve counts a skip at this version
        current = self.latest_version(VERSION_POLL_S) or 0
        if self._pass_done(state, current):  # the shell waited until none was in flight (history_stalled)
            log.info("an epoch's worth of train prompts was skipped at version %d: %s, the next in order, is "
                     "admitted", current, prompt["prompt_id"])
            return None
        decision = history.decide_skip(past, explore, self.history_limits, prompt["prompt_id"], epoch, current)
        if not decision.skip:
            return None
        state = core.skip_by_history(core.take_replay(state, self.limits), current)
        state, effects = core.check_step(state, self.limits)
        self.save(state)
        self.metrics.decision("prompt", False, RejectReason.SKIPPED_BY_HISTORY.value)
        rejected = self.rejected_group({**prompt, "prompt_id": core.epoch_prompt_id(prompt["prompt_id"], epoch)},
                                       Decision.reject(RejectReason.SKIPPED_BY_HISTORY, **decision.values()),
                                       self.history_filter, policy_version=current)
        return Handled([self._history_output(history.on_skip(past)), rejected, *self.outputs(effects)])

    def rejected_group(self, prompt: dict, verdict: Decision, decided_by: tuple[str, str] | None = None,
                       policy_version: int = 0) -> Send:
        """A rejected Group for a prompt decided before generation; ``decided_by``: its
        (filter_config, filter_config_hash), the prompt length filter's by default."""
        filter_config, filter_hash = decided_by or self.prompt_filter
        group = group_record(prompt=prompt, decided_accepted=False, reason=verdict.reason, values=dict(verdict.values),
                             responses=[], filter_config=filter_config, filter_config_hash=filter_hash,
                             policy_version=policy_version, rounds=0, responses_generated=0)
        return self.send(self.topics.groups_rejected, prompt["prompt_id"], "Group", group)

    # -- end of data and the later epochs
    def is_new_end(self, offset: int) -> bool:
        """The PromptsEnd marker at ``offset`` ends the data (the first marker, or a redelivery of
        it); a later marker is logged and ignored."""
        state = self.load()
        if state.end_offset in (None, offset):
            return True
        self.outputs(core.on_data_end(state, self.limits, offset, state.epoch_size)[1])  # ExtraEnd: logged
        return False

    def end_data(self, offset: int, train_prompts: int) -> Handled:
        """Record the end of data at ``offset`` after ``train_prompts`` train prompts."""
        state, effects = core.on_data_end(self.load(), self.limits, offset, train_prompts)
        self.save(state)
        return Handled(self.outputs(effects))

    def replays_left(self) -> bool:
        return core.next_replay(self.load(), self.limits) is not None

    def next_replay(self, train: Sequence[dict]) -> Replay | None:
        """The next prompt of a later epoch, from ``train`` (the first epoch's train prompts in
        topic order), or None when every epoch is taken."""
        nxt = core.next_replay(self.load(), self.limits)
        if nxt is None:
            return None
        epoch, index = nxt
        original = train[index]
        return Replay({**original, "prompt_id": core.epoch_prompt_id(original["prompt_id"], epoch)},
                      lambda s: core.take_replay(s, self.limits),
                      (original, epoch) if self.history_limits is not None else None)

    def settle(self) -> Handled:
        """The step's verdict when it is due now (e.g. nothing is in flight after a pass)."""
        state, effects = core.check_step(self.load(), self.limits)
        self.save(state)
        return Handled(self.outputs(effects))

    # -- validation rounds
    def eval_version_due(self) -> int | None:
        """The policy version whose validation round starts now, or None (none due). The first
        check of each version that is not due a round says so in the log."""
        version = self.latest_version(0.0)
        due = core.eval_due(self.load(), self.limits, version)
        if version != self._eval_checked:
            self._eval_checked = version
            if due is None and version is not None and self.limits.eval_steps is not None:
                log.info("policy version %d is not due a validation round (eval_steps %d)", version,
                         self.limits.eval_steps)
        return due

    def eval_running(self) -> bool:
        return core.next_eval(self.load()) is not None

    def start_eval(self, version: int, val_prompts: Sequence[dict]) -> None:
        self.save(core.start_eval(self.load(), version, len(val_prompts)))
        log.info("validation round of policy version %d: %d prompts", version, len(val_prompts))

    def next_eval(self, val: Sequence[dict]) -> dict | None:
        """The next prompt of the running validation round, from ``val`` (the validation prompts
        in topic order, fewer than the round's size only when retention deleted some: it ends
        short), or None when it is all admitted."""
        state = self.load()
        if len(val) < state.eval_size:
            log.error("%s holds %d validation prompts, the round of version %d had %d: it ends short",
                      self.topics.prompts, len(val), state.eval_version, state.eval_size)
            state.eval_size = state.eval_position = min(state.eval_position, len(val))
            self.save(state)
        index = core.next_eval(state)
        if index is None:
            return None
        return {**val[index], "prompt_id": core.eval_prompt_id(val[index]["prompt_id"], state.eval_version)}

    # -- outcomes
    def on_outcome(self, outcome: dict) -> Handled:
        """Return the credit of ``outcome``'s prompt (a PromptOutcome record) and learn its
        reward pattern; an outcome of a prompt not in flight (a redelivery) changes nothing."""
        state, effects = core.on_outcome(self.load(), self.limits, outcome["prompt_id"],
                                         outcome["outcome"] == "commit", outcome["reason"],
                                         outcome.get("policy_version"))
        learned = None if any(isinstance(e, core.UnknownOutcome) for e in effects) else self._learn(state, outcome)
        self.save(state)
        return Handled(([] if learned is None else [self._history_output(learned)]) + self.outputs(effects))

    def _learn(self, state: core.AdmissionState, outcome: dict) -> history.PromptHistory | None:
        """A train group was decided: add its pattern to the prompt's history and adapt the
        exploration probabilities in ``state`` (saved by the caller); returns the history."""
        if self.history_limits is None or outcome.get("mode", "train") != "train" or not outcome.get("reward_pattern"):
            return None
        base, epoch = history.split_epoch(outcome["prompt_id"])
        entry = self.histories.get(base) or history.PromptHistory(base)
        entry.record(epoch, outcome["reward_pattern"], outcome["policy_version"])
        explore = history.ExploreState.from_dict(state.explore, self.history_limits)
        state.explore = history.observe(explore, self.history_limits, outcome["reward_pattern"]).to_dict()
        return entry

    def _history_output(self, entry: history.PromptHistory) -> Send:
        self.histories[entry.prompt_id] = entry
        return self.send(self.topics.prompt_history, entry.prompt_id, "PromptHistory", entry.to_record())

    def oldest_in_flight_ms(self) -> int | None:
        return core.oldest_admission_ms(self.load())

    def in_flight(self, prompt_id: str) -> bool:
        return prompt_id in self.load().in_flight

    # -- effects
    @staticmethod
    def send(topic: str, key: str, schema: str, record: dict) -> Send:
        """``record`` encoded as ``schema``, to send on ``topic`` under ``key``."""
        return Send(topic, key, encode(record, schema))

    def outputs(self, effects: Sequence[core.AdmissionEffect]) -> list[Send]:
        """Log the core's effects; a step verdict becomes a ``Batch`` event on ``batches``."""
        out: list[Send] = []
        for effect in effects:
            if isinstance(effect, core.StepComplete):
                log.info("step %d complete: %d groups accepted after %d prompts; rejected %s", effect.step,
                         effect.accepted, effect.prompts_consumed, dict(effect.rejected_by_reason))
            elif isinstance(effect, core.StepVerdict):
                log.warning("step %d ends %s: %d/%d groups after %d prompts", effect.step, effect.status,
                            effect.accepted, effect.target, effect.prompts_consumed)
                out.append(self.send(self.topics.batches, str(effect.step), "Batch", batch_event(
                    step=effect.step, status=effect.status, target=effect.target, accepted=effect.accepted,
                    prompts_consumed=effect.prompts_consumed, rejected_by_reason=effect.rejected_by_reason)))
            elif isinstance(effect, core.ExtraEnd):
                log.warning("PromptsEnd at offset %d after the end of data: ignored", effect.offset)
            elif isinstance(effect, core.UnknownOutcome):
                log.info("outcome for unknown prompt %s ignored (redelivery)", effect.prompt_id)
        return out
