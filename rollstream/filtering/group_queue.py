"""The agentic group queue of one env group (``mode``, ``group_id``): a pure state machine.

It follows the reference system's GroupQueue. What it keeps:

- each episode starts ``group_size + group_size_redundancy`` runs with one seed
  (``group_seed + episode_id``);
- the group filter runs exactly once, when the first ``group_size`` valid trajectories of the
  episode have arrived; keep -> the episode's group is emitted (exactly those trajectories), drop
  -> it is emitted as rejected and a replacement episode ``next_episode_id`` starts;
- trajectories of removed or decided episodes are ignored and counted as late.

Where it does better (each one tested):

- every group queue decides on its own: no head-of-line blocking between groups or episodes;
- a run that never arrives cannot hang its episode: at the deadline the missing runs are
  reissued (``max_reissues_per_episode`` times), then the episode is dropped as
  ``episode_timeout`` and replaced;
- an infra-aborted trajectory (``env_timeout`` / ``env_failed``) is set aside with reason
  ``infra_abort`` and refilled with a new run of the same seed, ``max_refills_per_group`` times
  (an infra failure is never reward 0); after that the group is dropped as ``refill_exhausted``,
  or accepted with fewer trajectories when ``min_valid_group_size`` allows it;
- replacement episodes per group id are bounded (``max_replaced_episodes``); a group id that
  spends them stops with status ``exhausted`` instead of resampling forever.

Like ``prompt_state.step``, every step is ``(state, ...) -> (state, effects)``: ``state`` is
changed in place and returned, and the caller (the faust processor, benchmarks, tests) stores
trajectories, persists the state and performs the effects. The group filter is not called from
here: when an episode's members are complete ``on_trajectory`` returns a ``NeedsDecision`` effect
(last of its effects); the caller runs the filter over those members and applies its ``Verdict``
with ``on_verdict`` before it persists the state or handles another event.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollstream.filtering.reasons import ACCEPTED, RejectReason

CLOSED_MEMORY = 32
"""Decided episodes remembered per group id to measure the time redundancy saved."""


@dataclass(frozen=True)
class QueueParams:
    """How one env manager's group queues behave (from ``EnvManagerConfig``)."""

    group_size: int
    group_size_redundancy: int = 0
    max_traj_per_env: int = 1  # episodes open at once per group id
    episodes_target: int = 1  # accepted episodes a group id delivers in total
    max_replaced_episodes: int = 8
    episode_timeout_ms: int = 600_000
    max_reissues_per_episode: int = 1
    refill_enabled: bool = True
    max_refills_per_group: int = 2
    min_valid_group_size: int | None = None

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.group_size_redundancy < 0 or self.max_traj_per_env < 1:
            raise ValueError(f"invalid group sizes: {self}")
        if self.min_valid_group_size is not None and not 1 <= self.min_valid_group_size <= self.group_size:
            raise ValueError(f"min_valid_group_size must be in [1, group_size], got {self.min_valid_group_size}")

    @classmethod
    def from_config(cls, manager, episodes_target: int) -> "QueueParams":
        """From an ``EnvManagerConfig``."""
        return cls(
            group_size=manager.group_size, group_size_redundancy=manager.group_size_redundancy,
            max_traj_per_env=manager.max_traj_per_env, episodes_target=episodes_target,
            max_replaced_episodes=manager.max_replaced_episodes,
            episode_timeout_ms=int(manager.episode_timeout_s * 1000),
            max_reissues_per_episode=manager.max_reissues_per_episode,
            refill_enabled=manager.refill.enabled, max_refills_per_group=manager.refill.max_refills_per_group,
            min_valid_group_size=manager.refill.min_valid_group_size,
        )

    @property
    def min_valid(self) -> int:
        return self.min_valid_group_size or self.group_size


@dataclass
class Episode:
    episode_id: int
    seed: int
    started_ms: int
    deadline_ms: int
    next_traj_index: int = 0
    issued: list[int] = field(default_factory=list)  # every run started, in order
    arrived: list[int] = field(default_factory=list)  # valid members, in arrival order
    aborted: list[int] = field(default_factory=list)  # infra-aborted runs set aside
    refills: int = 0
    reissues: int = 0

    @property
    def pending(self) -> int:
        return len(self.issued) - len(self.arrived) - len(self.aborted)


@dataclass
class Closed:
    """A decided episode, kept a while to count its late runs and the time they would have cost."""

    closed_ms: int
    pending: int
    slowest_ms: int = 0


@dataclass
class QueueState:
    mode: str
    group_id: int
    group_seed: int
    partition: int = 0  # Kafka partition of the group id: the processor's tick finds it by this
    next_episode_id: int = 0
    open: dict[int, Episode] = field(default_factory=dict)
    closed: dict[int, Closed] = field(default_factory=dict)
    accepted: int = 0
    rejected: int = 0
    replaced: int = 0
    late: int = 0
    status: str = "running"  # running | complete | exhausted
    # reason -> rejected episodes, for the outcome event; table values written before it existed
    # lack it (from_dict then starts it empty)
    rejected_by_reason: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """A JSON-able copy (what ``dataclasses.asdict`` gives, built by hand: this runs for every
        trajectory the group queue handles, and ``asdict``'s recursive deep copy was its largest
        cost)."""
        d = dict(vars(self))
        d["open"] = {eid: {**vars(ep), "issued": list(ep.issued), "arrived": list(ep.arrived),
                           "aborted": list(ep.aborted)} for eid, ep in self.open.items()}
        d["closed"] = {eid: dict(vars(c)) for eid, c in self.closed.items()}
        d["rejected_by_reason"] = dict(self.rejected_by_reason)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "QueueState":
        d = dict(d)
        d["open"] = {int(k): Episode(**v) for k, v in d["open"].items()}
        d["closed"] = {int(k): Closed(**v) for k, v in d["closed"].items()}
        return cls(**d)


# -- effects ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class StartRun:
    """Ask an env worker for trajectory ``traj_index`` of the episode (an EpisodeRequest)."""

    episode_id: int
    traj_index: int
    seed: int
    cause: str  # start | refill | reissue
    reissue: int = 0  # k for the k-th deadline reissue: the shell sends it k partitions away


@dataclass(frozen=True)
class SetAside:
    """A trajectory leaves its group (emitted as rejected with ``reason``: infra_abort,
    invalid_reward or invalid_trajectory)."""

    episode_id: int
    traj_index: int
    reason: str


@dataclass(frozen=True)
class GroupDecided:
    episode_id: int
    accepted: bool
    reason: str
    members: tuple[int, ...]  # traj indices emitted with the group, in arrival order
    values: dict[str, float]
    started: int
    arrived: int
    refills: int
    reissues: int
    replaced_by: int | None  # episode id of the replacement, when one was started


@dataclass(frozen=True)
class _Ignored:
    """A run the queue ignores; the subclass says why."""

    episode_id: int
    traj_index: int


class Late(_Ignored):
    """A run of an episode already decided or removed: ignored, counted."""


class Duplicate(_Ignored):
    """A run that already arrived (a redelivery): ignored, never stored over the first copy."""


@dataclass(frozen=True)
class RedundancySaved:
    """Every run of a decided episode has now arrived: the group closed ``saved_ms`` before its
    slowest run finished."""

    episode_id: int
    saved_ms: int


@dataclass(frozen=True)
class NeedsDecision:
    """The episode's members are complete: the caller runs the group filter over ``members``
    (traj indices in arrival order) and applies its Verdict with ``on_verdict``."""

    episode_id: int
    members: tuple[int, ...]


@dataclass(frozen=True)
class QueueDone:
    """The group id stops: ``complete`` (its accepted target reached) or ``exhausted``. The
    state then holds its final counts (accepted, rejected by reason, replaced)."""

    status: str
    accepted: int
    replaced: int


Effect = StartRun | SetAside | NeedsDecision | GroupDecided | Late | Duplicate | RedundancySaved | QueueDone


@dataclass(frozen=True)
class Verdict:
    """What the group filter decided: ``drop`` True means DROP (the reference's convention)."""

    drop: bool
    reason: str = ACCEPTED
    values: dict[str, float] = field(default_factory=dict)


def _open_episode(state: QueueState, params: QueueParams, now_ms: int, out: list) -> int:
    eid = state.next_episode_id
    state.next_episode_id += 1
    ep = Episode(episode_id=eid, seed=state.group_seed + eid, started_ms=now_ms,
                 deadline_ms=now_ms + params.episode_timeout_ms)
    state.open[eid] = ep
    for _ in range(params.group_size + params.group_size_redundancy):
        _issue(ep, "start", out)
    return eid


def _issue(ep: Episode, cause: str, out: list, reissue: int = 0) -> None:
    ep.issued.append(ep.next_traj_index)
    out.append(StartRun(ep.episode_id, ep.next_traj_index, ep.seed, cause, reissue))
    ep.next_traj_index += 1


def start(mode: str, group_id: int, group_seed: int, params: QueueParams, now_ms: int,
          partition: int = 0) -> tuple[QueueState, list[Effect]]:
    """A new group queue with ``min(max_traj_per_env, episodes_target)`` episodes open."""
    state = QueueState(mode=mode, group_id=group_id, group_seed=group_seed, partition=partition)
    out: list[Effect] = []
    for _ in range(min(params.max_traj_per_env, params.episodes_target)):
        _open_episode(state, params, now_ms, out)
    return state, out


def on_trajectory(state: QueueState, params: QueueParams, episode_id: int, traj_index: int,
                  infra_failed: bool, finished_ms: int, now_ms: int,
                  invalid: str | None = None) -> tuple[QueueState, list[Effect]]:
    """One trajectory arrived. ``infra_failed``: it ended with env_timeout, env_failed or an
    engine error (set aside as ``infra_abort`` when refills are enabled, else a member);
    ``invalid``: why it cannot be trained at all (``invalid_reward`` for a NaN/inf return,
    ``invalid_trajectory`` for inconsistent token arrays): always set aside with that reason.
    A set-aside run is refilled while ``max_refills_per_group`` allows. When the episode's members
    are complete the effects end with ``NeedsDecision`` (see ``on_verdict``).

    The caller stores the trajectory when the effects contain no Late/Duplicate for it (it then
    is a member or set aside) and may delete the stored members of a decided episode.
    """
    ep = state.open.get(episode_id)
    if ep is None:
        state.late += 1
        out: list[Effect] = [Late(episode_id, traj_index)]
        closed = state.closed.get(episode_id)
        if closed is not None:
            closed.pending -= 1
            closed.slowest_ms = max(closed.slowest_ms, finished_ms)
            if closed.pending <= 0:
                del state.closed[episode_id]
                out.append(RedundancySaved(episode_id, max(0, closed.slowest_ms - closed.closed_ms)))
        return state, out
    if traj_index in ep.arrived or traj_index in ep.aborted or traj_index not in ep.issued:
        return state, [Duplicate(episode_id, traj_index)]
    out = []
    aside = invalid or (RejectReason.INFRA_ABORT.value if infra_failed and params.refill_enabled else None)
    if aside is not None:
        ep.aborted.append(traj_index)
        out.append(SetAside(episode_id, traj_index, aside))
        if (params.refill_enabled and ep.refills < params.max_refills_per_group
                and len(ep.arrived) + ep.pending < params.group_size):
            ep.refills += 1
            _issue(ep, "refill", out)
    else:
        ep.arrived.append(traj_index)
    out += _maybe_decide(state, params, ep, now_ms)
    return state, out


def on_verdict(state: QueueState, params: QueueParams, episode_id: int, verdict: Verdict,
               now_ms: int) -> tuple[QueueState, list[Effect]]:
    """Apply the group filter's ``verdict`` on the members a ``NeedsDecision`` named: keep emits
    the group, drop emits it as rejected and starts a replacement (bounded). ValueError when the
    episode awaits no decision (a verdict without its NeedsDecision, or applied twice)."""
    ep = state.open.get(episode_id)
    members = _members_to_decide(params, ep) if ep is not None else None
    if members is None:
        raise ValueError(f"episode {episode_id} of {state.mode}/{state.group_id} awaits no decision")
    return state, _close(state, params, ep, now_ms, accepted=not verdict.drop,
                         reason=verdict.reason if verdict.drop else ACCEPTED, members=members,
                         values=verdict.values)


def _members_to_decide(params: QueueParams, ep: Episode) -> list[int] | None:
    """The members the group filter decides once the episode's arrivals allow it, else None."""
    if len(ep.arrived) >= params.group_size:
        return ep.arrived[:params.group_size]
    if ep.pending == 0 and len(ep.arrived) >= params.min_valid:
        return list(ep.arrived)  # refills spent: accept the smaller group the config allows
    return None


def _maybe_decide(state: QueueState, params: QueueParams, ep: Episode, now_ms: int) -> list[Effect]:
    n, reachable = len(ep.arrived), len(ep.arrived) + ep.pending
    members = _members_to_decide(params, ep)
    if members is not None:
        return [NeedsDecision(ep.episode_id, tuple(members))]
    if reachable >= params.group_size:
        return []  # runs still on their way
    if reachable >= params.min_valid:
        return []  # a smaller group is still possible once the pending runs land
    return _close(state, params, ep, now_ms, accepted=False, reason=RejectReason.REFILL_EXHAUSTED.value,
                  members=list(ep.arrived), values={"valid": float(n), "refills": float(ep.refills)})


def _close(state: QueueState, params: QueueParams, ep: Episode, now_ms: int, *, accepted: bool, reason: str,
           members: list[int], values: dict[str, float]) -> list[Effect]:
    del state.open[ep.episode_id]
    if ep.pending > 0:
        state.closed[ep.episode_id] = Closed(closed_ms=now_ms, pending=ep.pending)
        while len(state.closed) > CLOSED_MEMORY:
            del state.closed[min(state.closed)]
    if accepted:
        state.accepted += 1
    else:
        state.rejected += 1
        state.rejected_by_reason[reason] = state.rejected_by_reason.get(reason, 0) + 1
    # the next episode: one more of the target after a keep, a replacement (bounded) after a drop
    run_effects: list[Effect] = []
    next_episode = None
    if params.episodes_target - state.accepted - len(state.open) > 0 and (
            accepted or state.replaced < params.max_replaced_episodes):
        state.replaced += not accepted
        next_episode = _open_episode(state, params, now_ms, run_effects)
    out: list[Effect] = [GroupDecided(
        episode_id=ep.episode_id, accepted=accepted, reason=reason, members=tuple(members), values=dict(values),
        started=len(ep.issued), arrived=len(ep.arrived) + len(ep.aborted), refills=ep.refills,
        reissues=ep.reissues, replaced_by=None if accepted else next_episode)]
    out += run_effects
    if not state.open and state.status == "running":
        state.status = "complete" if state.accepted >= params.episodes_target else "exhausted"
        out.append(QueueDone(state.status, state.accepted, state.replaced))
    return out


def on_tick(state: QueueState, params: QueueParams, now_ms: int) -> tuple[QueueState, list[Effect]]:
    """Check the deadlines of the open episodes: reissue the runs still missing, or drop the
    episode (``episode_timeout``) once its reissues are spent."""
    out: list[Effect] = []
    for ep in [e for e in state.open.values() if now_ms >= e.deadline_ms]:
        missing = params.group_size - len(ep.arrived)
        if ep.reissues < params.max_reissues_per_episode:
            ep.reissues += 1
            ep.deadline_ms = now_ms + params.episode_timeout_ms
            for _ in range(missing):
                _issue(ep, "reissue", out, ep.reissues)
        else:
            out += _close(state, params, ep, now_ms, accepted=False, reason=RejectReason.EPISODE_TIMEOUT.value,
                          members=list(ep.arrived), values={"valid": float(len(ep.arrived)),
                                                            "missing": float(missing)})
    return state, out
