"""What the group queue does with one input event, and with the passing of time, without faust:
the processor shape of rollstream.streams.processor, a Store (rollstream.streams.store) in,
sends out. The faust agent (rollstream.streams.group_queue_agent), benchmarks and tests share it.

Time: ``tick(partitions, now)`` reissues or gives up the runs whose deadlines passed, in the
queues of the partitions the worker owns; the agent's timer calls it.

Table layout (every key belongs to its group's partition, which each write names):

- ``g:{mode}/{group_id}`` -> the group queue's ``QueueState`` (JSON);
- ``t:{mode}/{group_id}/{episode_id}/{traj_index}`` -> a member trajectory's encoded
  ``TrajectorySummary`` (rewards, flags, stop reason, lengths and a ``PayloadRef`` to the
  Trajectory on ``trajectories``: never its token arrays), deleted when its episode is decided
  (the emitted TrajectoryGroup splices these bytes in, not re-encoded);
- ``f:{mode}/{partition}`` -> the group filter's ``state_dict()`` (JSON), for filters with state.
  A stateful filter such as the drop_flag ratio guard therefore counts the groups of one
  partition; with one partition (the default for agentic runs) it is global, as in the reference.

Payload plane vs decision plane: ``trajectories`` carries the Trajectory payload events. A
trajectory is decoded and validated (``invalid_reason``) once, where it enters; from then on only
its summary exists here, so neither the table nor the TrajectoryGroup events grow with trajectory
length. The group filters decide on summaries; the trainer fetches the payloads of accepted
groups by reference.

The pure state machine (rollstream.filtering.group_queue) never calls the filter: a
``NeedsDecision`` effect asks for it, and this shell runs the staleness check and the group filter
(loading and saving its state) and hands the Verdict back with ``on_verdict``. A group id that
stops publishes a ``GroupQueueOutcome`` on ``episodes.outcomes``, the event the trainer acts on;
the ``group_queue/*`` metric records are for display only.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Callable, Collection

from rollstream.config import AgenticConfig
from rollstream.filtering import group_queue as gq
from rollstream.filtering.group_filters import filter_group, load_group_filter
from rollstream.filtering.reasons import ACCEPTED, RejectReason
from rollstream.filtering.staleness import stale_decision
from rollstream.kafka.events import Send, decode_expected
from rollstream.kafka.topics import Topics
from rollstream.observability.metrics import metric_record, process_metrics
from rollstream.runtime import now_ms, worker_id
from rollstream.schemas import REGISTRY, decode, encode
from rollstream.schemas.codec import HEADER_LEN
from rollstream.schemas.records import STOP_ENGINE_ERROR, payload_ref, trajectory_summary
from rollstream.schemas.validation import check_trajectory
from rollstream.streams.processor import Handled
from rollstream.streams.store import Store

log = logging.getLogger(__name__)


def _state_key(mode: str, group_id: int) -> bytes:
    return f"g:{mode}/{group_id}".encode()


def _traj_key(mode: str, group_id: int, episode_id: int, traj_index: int) -> bytes:
    return f"t:{mode}/{group_id}/{episode_id}/{traj_index}".encode()


def invalid_reason(trajectory: dict) -> str | None:
    """Why a ``Trajectory`` (the full payload record) cannot be trained (checked where it enters,
    so the trainer never has to refuse an accepted group): ``invalid_reward`` (NaN/inf return,
    never passed on silently), ``invalid_trajectory`` (token arrays that disagree), or None."""
    if not math.isfinite(trajectory["response_level_rewards"]):
        return RejectReason.INVALID_REWARD.value
    try:
        check_trajectory(trajectory)
    except ValueError:
        return RejectReason.INVALID_TRAJECTORY.value
    return None


def is_infra_failure(trajectory: dict) -> bool:
    """An environment timeout or crash, an engine error, or no turn at all: the run says nothing
    about the policy (infra failures are reasons of their own, never reward 0).
    ``trajectory``: a ``Trajectory`` or a ``TrajectorySummary`` record (``num_turns``)."""
    turns = trajectory["num_turns"] if "num_turns" in trajectory else len(trajectory.get("turns") or ())
    return bool(trajectory.get("env_timeout") or trajectory.get("env_failed")
                or trajectory.get("stop_reason") == STOP_ENGINE_ERROR or not turns)


class _Arriving:
    """The summary of the trajectory being handled, encoded at most once (only when it is stored
    or emitted: a late or duplicate run is never encoded)."""

    __slots__ = ("key", "summary", "_value")

    def __init__(self, key: bytes, summary: dict) -> None:
        self.key, self.summary, self._value = key, summary, None

    def encoded(self) -> bytes:
        if self._value is None:
            self._value = encode(self.summary, "TrajectorySummary")
        return self._value


class GroupQueueProcessor:
    """The group queues of one agentic config over ``store``. ``policy_version()``
    returns the newest published policy version (None: unknown) for the staleness bound: a
    training episode whose oldest trajectory lags it by more than ``max_staleness`` is dropped
    as ``stale`` (and replaced) before the group filter runs."""

    def __init__(self, config: AgenticConfig, store: Store,
                 policy_version: Callable[[], int | None] = lambda: None) -> None:
        self.config = config
        self.policy_version = policy_version
        self.metrics = process_metrics()
        self._filter_json = {mode: (config.filter_config_json(mode), config.filter_config_hash(mode))
                             for mode in config.env_managers()}
        self.store = store
        self.topics = Topics(config.kafka.topic_prefix)
        self.worker = worker_id("group-queue")
        self.managers = config.env_managers()
        self.params = {mode: gq.QueueParams.from_config(m, config.episodes_per_group(mode))
                       for mode, m in self.managers.items()}
        for mode, manager in self.managers.items():  # fail at start-up, not at the first decision
            load_group_filter(manager.group_filter_cls, config, manager, mode)
        self._filters: dict[tuple[str, int], Any] = {}
        self._arriving: _Arriving | None = None
        self._decoded: dict[bytes, dict] = {}  # member summaries decoded while handling one event
        self._summary_fp = REGISTRY.fingerprint("TrajectorySummary")
        # What this processor last wrote under a table key, kept decoded: table key -> (the bytes
        # written, their decoded form). Used only while the table still holds those very bytes
        # (identity: a restored or foreign value is parsed again), and dropped whole when handling
        # an event raises (a half-applied state must never be reused).
        self._states: dict[bytes, tuple[bytes, gq.QueueState]] = {}
        self._members: dict[bytes, tuple[bytes, dict]] = {}

    # -- inputs -----------------------------------------------------------------------------

    def handle(self, topic: str, partition: int, value: bytes, now: int | None = None, *, offset: int) -> Handled:
        """One event read from ``topic`` (``trajectories`` or ``episodes.control``) at
        ``partition`` and ``offset``: a Trajectory's summary names it by this (topic, partition,
        offset) PayloadRef. Never raises for bad input: it comes back as ``Handled.error``."""
        now = now_ms() if now is None else now
        try:
            return self._handle(topic, partition, offset, value, now)
        except BaseException:
            self._states.clear()
            self._members.clear()
            raise
        finally:
            self._decoded = {}  # the cache lives for one event: memory stays flat

    def _handle(self, topic: str, partition: int, offset: int, value: bytes, now: int) -> Handled:
        expected = {self.topics.episodes_control: "GroupCommand", self.topics.trajectories: "Trajectory"}.get(topic)
        if expected is None:
            return Handled(error=("invalid_event", f"{topic} is not an input of the group queue"))
        schema, record, problem = decode_expected(value, (expected,), where=f" on {topic}")
        if problem is not None:
            return Handled(error=problem)
        if schema == "GroupCommand":
            if record["command"] == "tick":  # sent through the topic by earlier versions; time is the timer's now
                return Handled()
            if record["command"] == "start":
                return self.start(record["mode"], record["group_id"], partition, now)
            return Handled(error=("invalid_event", f"unknown group command {record['command']!r}"))
        return self.trajectory(record, payload_ref(topic, partition, offset, len(value)), now)

    def end_batch(self) -> None:
        """Write what the store holds back (a HeldWrites: the faust stage's is)."""
        self.store.flush()

    def assigned(self) -> None:
        """Nothing kept beside the store depends on the partitions owned."""

    def start(self, mode: str, group_id: int, partition: int, now: int) -> Handled:
        manager = self.managers.get(mode)
        if manager is None:
            return Handled(error=("invalid_event", f"mode {mode!r} has no env manager; configured: {sorted(self.managers)}"))
        if not 0 <= group_id < manager.num_env_groups:
            return Handled(error=("invalid_event", f"{mode} group_id {group_id} outside [0, {manager.num_env_groups})"))
        key = _state_key(mode, group_id)
        if self.store.get(key) is not None:
            return Handled()  # a repeated start (redelivery, second `run`): the queue already runs
        state, effects = gq.start(mode, group_id, self.config.group_seed(mode, group_id), self.params[mode], now,
                                  partition=partition)
        out = self._apply(state, effects, now)
        self._save(state)
        return out

    def tick(self, partitions: Collection[int], now: int | None = None) -> Handled:
        """The passing of time up to ``now`` (epoch ms; None: the clock's) for the open queues of
        ``partitions`` (those this worker owns): runs past their deadline are reissued or given up."""
        now = now_ms() if now is None else now
        out = Handled()
        for key, value in list(self.store.items()):  # a snapshot: the loop writes
            if not key.startswith(b"g:"):
                continue
            state = self._load(key, value)
            if state.partition not in partitions or not state.open:
                continue
            state, effects = gq.on_tick(state, self.params[state.mode], now)
            if effects:  # on_tick changes a state only together with effects: nothing else to save
                applied = self._apply(state, effects, now)
                out.sends += applied.sends
                out.log += applied.log
                self._save(state)
        return out

    def trajectory(self, record: dict, ref: dict, now: int) -> Handled:
        """A decoded Trajectory (the payload, read at ``ref``) arrives: validated here, then only
        its summary is kept (see the module doc)."""
        mode, gid = record["mode"], record["group_id"]
        state_key = _state_key(mode, gid)
        raw = self.store.get(state_key)
        if raw is None:
            return Handled(error=("invalid_event", f"trajectory of {mode} group {gid}, which was never started"))
        state = self._load(state_key, raw)
        params = self.params[mode]
        eid, tix = record["episode_id"], record["traj_index"]
        key = _traj_key(mode, gid, eid, tix)
        invalid = invalid_reason(record)
        summary = trajectory_summary(record, ref)
        arriving = self._arriving = _Arriving(key, summary)  # readable as stored while its arrival is decided
        self._decoded[key] = summary  # a member is decoded once per event, not per use
        try:
            state, effects = gq.on_trajectory(state, params, eid, tix, is_infra_failure(summary),
                                              summary.get("finished_ms", 0), now, invalid=invalid)
            state, effects = self._decide(state, effects, now)
            out = self._apply(state, effects, now)
        finally:
            self._arriving = None
        redelivered = any(isinstance(e, (gq.Duplicate, gq.Late)) for e in effects)
        if not redelivered and eid in state.open and tix in state.open[eid].arrived:
            # a new member of a still open episode (a duplicate never overwrites)
            value = arriving.encoded()
            self.store.put(state.partition, key, value)
            self._members[key] = (value, summary)
        self._save(state)
        return out

    # -- decisions --------------------------------------------------------------------------

    def _decide(self, state: gq.QueueState, effects: list, now: int) -> tuple[gq.QueueState, list]:
        """Replace each ``NeedsDecision`` by the effects of its verdict: the group filter runs
        here, before any effect is carried out, so the effects keep the state machine's order."""
        out: list = []
        for effect in effects:
            if not isinstance(effect, gq.NeedsDecision):
                out.append(effect)
                continue
            group = [self._stored(state.mode, state.group_id, effect.episode_id, t) for t in effect.members]
            verdict = self._filter(state.mode, state.partition, state.group_id, effect.episode_id, group)
            state, decided = gq.on_verdict(state, self.params[state.mode], effect.episode_id, verdict, now)
            out += decided
        return state, out

    # -- effects ----------------------------------------------------------------------------

    def _apply(self, state: gq.QueueState, effects: list, now: int) -> Handled:
        out = Handled()
        mode, gid = state.mode, state.group_id
        labels = {"mode": mode, "group_id": str(gid)}
        for effect in effects:
            if isinstance(effect, gq.StartRun):
                # a reissue goes k partitions away from the group's own, so the runs of an env
                # worker that died (its partitions are static) reach a live one
                partition = ((state.partition + effect.reissue) % self.config.kafka.partitions
                             if effect.reissue else None)
                out.sends.append(Send(self.topics.episodes_requests, str(gid),
                                      encode(self._request(state, effect, now), "EpisodeRequest"), partition))
                if effect.cause == "start" and effect.traj_index == 0:
                    self.metrics.in_flight.labels("episodes").inc()  # an episode opens
                if effect.cause != "start":
                    out.log.append(f"{mode}/{gid}/{effect.episode_id}: {effect.cause} run {effect.traj_index}"
                                   + (f" to partition {partition}" if partition is not None else ""))
            elif isinstance(effect, gq.GroupDecided):
                self.metrics.in_flight.labels("episodes").dec()
                if mode == "val":
                    self.metrics.validation.labels("original").inc()
                    self.metrics.validation.labels("accepted" if effect.accepted else "rejected").inc()
                else:
                    self.metrics.decision("group", effect.accepted, effect.reason)
                values = {**effect.values, "started": float(effect.started), "arrived": float(effect.arrived)}
                out.sends.append(self._group_send(state, effect.episode_id, effect.accepted, effect.reason, values,
                                                  list(effect.members), effect=effect))
                for t in effect.members:
                    self.store.put(state.partition, _traj_key(mode, gid, effect.episode_id, t), None)
                    self._members.pop(_traj_key(mode, gid, effect.episode_id, t), None)
                out.sends.append(self._metric("group_queue/groups", 1.0, {**labels, "reason": effect.reason}, now))
                out.log.append(f"{mode}/{gid}/{effect.episode_id}: {effect.reason} with runs {list(effect.members)}"
                               + (f", replaced by episode {effect.replaced_by}" if effect.replaced_by is not None else ""))
                if not effect.accepted and effect.reason not in (RejectReason.REFILL_EXHAUSTED, RejectReason.EPISODE_TIMEOUT):
                    out.sends.append(self._metric("scheduler/group_filter_count", 1.0,
                                                  {**labels, "reason": effect.reason}, now))
                if effect.replaced_by is not None:
                    out.sends.append(self._metric("group_queue/episodes_replaced", 1.0, labels, now))
            elif isinstance(effect, gq.SetAside):
                self.metrics.decision("trajectory", False, effect.reason)
                out.sends.append(self._group_send(state, effect.episode_id, False, effect.reason, {},
                                                  [effect.traj_index], key_suffix=f"/{effect.traj_index}",
                                                  unit="trajectory"))
                out.sends.append(self._metric("group_queue/set_aside", 1.0, {**labels, "reason": effect.reason}, now))
            elif isinstance(effect, gq.Late):
                out.sends.append(self._metric("group_queue/late_trajectories", 1.0, labels, now))
            elif isinstance(effect, gq.RedundancySaved):
                out.sends.append(self._metric("group_queue/redundancy_saved_ms", float(effect.saved_ms), labels, now))
            elif isinstance(effect, gq.QueueDone):
                out.sends.append(self._metric("group_queue/done", float(effect.accepted),
                                              {**labels, "status": effect.status}, now))  # display only
                out.sends.append(self._outcome(state, effect, now))
                out.log.append(f"{mode}/{gid}: {effect.status} ({effect.accepted} accepted, {effect.replaced} replaced)")
        return out

    def _request(self, state: gq.QueueState, run: gq.StartRun, now: int) -> dict:
        tag = self.managers[state.mode].tag_of(state.group_id)
        env = self.config.custom_envs[tag]
        return {
            "mode": state.mode, "group_id": state.group_id, "episode_id": run.episode_id,
            "traj_index": run.traj_index, "tag": tag, "env_type": env.env_type,
            "env_config": json.dumps(env.env_config, sort_keys=True), "seed": run.seed,
            "max_actions_per_traj": env.max_actions_per_traj, "max_tokens_per_step": env.max_tokens_per_step,
            "env_step_timeout_s": env.env_step_timeout_s, "format_penalty": env.format_penalty,
            "cause": run.cause, "created_ms": now,
        }

    def _group_send(self, state: gq.QueueState, episode_id: int, accepted: bool, reason: str,
                    values: dict[str, float], traj_indices: list[int], *, effect: gq.GroupDecided | None = None,
                    key_suffix: str = "", unit: str = "episode") -> Send:
        mode, gid = state.mode, state.group_id
        members = [self._stored_bytes(mode, gid, episode_id, t) for t in traj_indices]
        records = [self._stored(mode, gid, episode_id, t) for t in traj_indices]
        tag = self.managers[mode].tag_of(gid)
        group = {
            "group_key": f"{mode}/{gid}/{episode_id}{key_suffix}", "kind": "agentic", "unit": unit, "mode": mode,
            "group_id": gid, "episode_id": episode_id, "tag": tag,
            "env_type": self.config.custom_envs[tag].env_type, "seed": state.group_seed + episode_id,
            "accepted": accepted, "reason": reason if not accepted else ACCEPTED,
            "decision_values": {k: float(v) for k, v in values.items()},
            "group_filter_cls": self.managers[mode].group_filter_cls,
            "filter_config": self._filter_json[mode][0], "filter_config_hash": self._filter_json[mode][1],
            "policy_version": min((r.get("policy_version", 0) for r in records), default=0),
            "trajectories_started": effect.started if effect else 1,
            "trajectories_arrived": effect.arrived if effect else 1,
            "refills": effect.refills if effect else 0, "reissues": effect.reissues if effect else 0,
            "created_ms": now_ms(), "trajectories": [],
        }
        topic = self.topics.decision_topic(mode, accepted)
        value = REGISTRY.encode_with_tail_array(group, "TrajectoryGroup", members, "TrajectorySummary")
        return Send(topic, group["group_key"], value)

    def _outcome(self, state: gq.QueueState, done: gq.QueueDone, now: int) -> Send:
        """The GroupQueueOutcome of a group id that stopped, from its final state."""
        record = {
            "mode": state.mode, "group_id": state.group_id, "status": done.status, "accepted": done.accepted,
            "rejected": state.rejected, "rejected_by_reason": dict(state.rejected_by_reason),
            "episodes_decided": state.accepted + state.rejected, "replaced": done.replaced, "created_ms": now,
        }
        return Send(self.topics.episodes_outcomes, str(state.group_id), encode(record, "GroupQueueOutcome"))

    def _metric(self, name: str, value: float, labels: dict[str, str], now: int) -> Send:
        record = metric_record(self.worker, name, value, labels, now)
        return Send(self.topics.metrics, self.worker, encode(record, "Metric"))

    # -- storage ----------------------------------------------------------------------------

    def _load(self, key: bytes, raw: bytes) -> gq.QueueState:
        """The QueueState stored as ``raw`` under ``key``: the one this processor saved, while the
        table still holds exactly what it saved; else parsed from the JSON."""
        cached = self._states.get(key)
        if cached is not None and cached[0] is raw:
            return cached[1]
        return gq.QueueState.from_dict(json.loads(raw))

    def _save(self, state: gq.QueueState) -> None:
        key = _state_key(state.mode, state.group_id)
        value = json.dumps(state.to_dict()).encode()
        self.store.put(state.partition, key, value)
        self._states[key] = (value, state)

    def _stored_bytes(self, mode: str, gid: int, eid: int, tix: int) -> bytes:
        """A member's encoded TrajectorySummary: the arriving one, or the table's. A table value
        written by a group queue before summaries existed (the Trajectory's own bytes, restored
        from the changelog) becomes a summary with the Trajectory inline as its payload."""
        key = _traj_key(mode, gid, eid, tix)
        if self._arriving is not None and self._arriving.key == key:
            return self._arriving.encoded()
        value = self.store.get(key)
        if value[2:HEADER_LEN] != self._summary_fp:
            schema, record = decode(value)
            if schema == "Trajectory":
                value = encode(trajectory_summary(record, record), "TrajectorySummary")
        return value

    def _stored(self, mode: str, gid: int, eid: int, tix: int) -> dict:
        key = _traj_key(mode, gid, eid, tix)
        if key not in self._decoded:
            cached = self._members.get(key)
            if cached is not None and self.store.get(key) is cached[0]:
                self._decoded[key] = cached[1]
            else:
                self._decoded[key] = decode(self._stored_bytes(mode, gid, eid, tix))[1]
        return self._decoded[key]

    def _filter(self, mode: str, partition: int, gid: int, eid: int, group: list[dict]) -> gq.Verdict:
        if mode == "train":
            oldest = min(int(t.get("policy_version", 0)) for t in group)
            stale = stale_decision(oldest, self.policy_version(), self.config.max_staleness)
            if stale is not None:
                return gq.Verdict(drop=True, reason=stale.reason, values=dict(stale.values))
        key = (mode, partition)
        if key not in self._filters:
            manager = self.managers[mode]
            self._filters[key] = load_group_filter(manager.group_filter_cls, self.config, manager, mode)
            saved = self.store.get(f"f:{mode}/{partition}".encode())
            if saved is not None and hasattr(self._filters[key], "load_state_dict"):
                self._filters[key].load_state_dict(json.loads(saved))
        filt = self._filters[key]
        drop, reason, values = filter_group(filt, gid, eid, group)
        state = filt.state_dict() if hasattr(filt, "state_dict") else None
        if state:  # stateless filters (the default) write nothing
            self.store.put(partition, f"f:{mode}/{partition}".encode(), json.dumps(state).encode())
        return gq.Verdict(drop=drop, reason=reason, values=values)
