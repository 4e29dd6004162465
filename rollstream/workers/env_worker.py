"""The env worker: consumes ``episodes.requests``, plays each EpisodeRequest as a multi-turn
trajectory with rollstream.workers.episodes.EpisodePlayer, and emits one Trajectory per request
(topic ``trajectories``, key group_id): the payload event, with the token arrays packed (written
once; the group queue decides on its summary and names it by reference).

A trajectory above ``kafka.max_message_bytes`` never leaves its episode waiting: a stub
Trajectory of the same identity goes out instead (no turns, ``env_failed``, ``drop_flag``,
``error`` starting with ``too_large:``), which the group queue sets aside as an infra failure and
refills, plus a ``too_large`` dead letter.

Static partition assignment (instance ``i`` of ``n`` owns ``p % n == i``), dead letters for
undecodable input, and offset commits that never pass a request whose trajectory is not yet
emitted: a killed worker replays every unfinished request; downstream drops duplicates by
identity.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kafka.errors import CommitFailedError

from rollstream.exceptions import EncodeError
from rollstream.kafka.clients import commit_offsets
from rollstream.kafka.events import Output, Send, SourceRecord, dead_letter, decode_expected, fit, too_large_error
from rollstream.kafka.offsets import OffsetTracker
from rollstream.kafka.context import StageContext
from rollstream.kafka.event_worker import PartitionWorker
from rollstream.observability.metrics import process_metrics
from rollstream.policy.versions import PolicyFollower, PolicyVersionWatcher
from rollstream.runtime import lower_cpu_priority
from rollstream.schemas.records import STOP_ENV_FAILED
from rollstream.inference.backends import make_backend
from rollstream.inference.engine import GenerationBackend
from rollstream.workers.envs import TextEnv, make_env, resolve_env
from rollstream.workers.episodes import EpisodePlayer, Finished, identity_of

log = logging.getLogger(__name__)

POLICY_MAX_AGE_S = 1.0  # between turns, policy.versions is asked at most this often
def too_large_stub(record: dict, size: int, limit: int) -> dict:
    """The Trajectory sent in place of ``record`` when its event is ``size`` bytes, above
    ``kafka.max_message_bytes`` = ``limit``: same identity, rewards and timing, no turns, an empty
    response_mask and no extras, ``stop_reason`` env_failed with ``env_failed`` and ``drop_flag``
    set (an infra failure: the group queue sets it aside and refills the run)."""
    error = too_large_error("Trajectory", size, limit,
                            f"{len(record.get('turns', ()))} turns, {len(record.get('response_mask', ()))} response "
                            f"tokens; played as {record['stop_reason']}")
    return {**record, "turns": [], "response_mask": [], "extras": {}, "stop_reason": STOP_ENV_FAILED,
            "env_failed": True, "env_timeout": False, "drop_flag": True, "success": False, "error": error}


# -- Kafka shell ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Source:
    """Where a request came from (the tag the player hands back)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes


@dataclass(frozen=True)
class EnvSampling:
    """How an env worker samples: ``temperature`` and ``top_p`` of every turn, episodes played at
    once, and the context budget of one episode in tokens (prompt and every turn). The defaults
    are the config's (``EnvSampling.of(None)``)."""

    temperature: float
    top_p: float
    max_concurrent_episodes: int
    max_context_tokens: int

    @classmethod
    def of(cls, config: Any = None, **overrides: Any) -> "EnvSampling":
        """From an AgenticConfig (``actor_infer.generating_args``, ``max_concurrent_episodes``,
        ``max_context_tokens``; None: its defaults), with ``overrides`` by field name."""
        from rollstream.config import AgenticConfig
        from rollstream.config.base import GeneratingArgs

        if config is None:
            fields = AgenticConfig.model_fields
            args = GeneratingArgs()
            concurrent, context = fields["max_concurrent_episodes"].default, fields["max_context_tokens"].default
        else:
            args = config.actor_infer.generating_args
            concurrent, context = config.max_concurrent_episodes, config.max_context_tokens
        return cls(**{"temperature": args.temperature, "top_p": args.top_p, "max_concurrent_episodes": concurrent,
                      "max_context_tokens": context, **overrides})


class EnvWorker(PartitionWorker):
    """Consume ``episodes.requests``, play them with an EpisodePlayer, produce ``trajectories``.

    Partitions are assigned statically (instance ``i`` of ``n`` owns ``p % n == i``; see
    EventWorker). Each finished trajectory is produced (key ``str(group_id)``) and flushed at
    once. The committed offset of a partition is its lowest offset whose request is still
    playing (or the next unread one), so a restart replays exactly the unfinished requests
    (plus, possibly, finished ones above them: downstream drops duplicates by identity).
    Undecodable or unplayable requests go to dead-letter and count as handled. A request whose
    identity is already playing is skipped. With ``follow_policy`` the worker loads the newest
    published policy version between turns (PolicyFollower); a trajectory carries the oldest
    version that produced any of its tokens.

    ``context.max_message_bytes`` (``kafka.max_message_bytes``) bounds one event; a trajectory
    above it goes out as ``too_large_stub`` plus a ``too_large`` dead letter (``too_large`` counts
    them). The producer compresses with ``context.compression_type`` (``kafka.compression_type``).
    """

    def __init__(
        self,
        context: StageContext,
        *,
        backend: GenerationBackend,
        sampling: EnvSampling | None = None,
        group_id: str = "rollstream-env",
        poll_timeout_ms: int = 200,
        tokenizer: Any = None,
        env_factory: Callable[[str, dict], TextEnv] = make_env,
        follow_policy: bool = True,
    ) -> None:
        sampling = sampling or EnvSampling.of(None)
        temperature, top_p = sampling.temperature, sampling.top_p
        max_concurrent_episodes, max_context_tokens = sampling.max_concurrent_episodes, sampling.max_context_tokens
        super().__init__(context, input_topic=context.topics.episodes_requests, group_id=group_id,
                         max_poll_records=max_concurrent_episodes, poll_timeout_ms=poll_timeout_ms, compress=True)
        self.player = EpisodePlayer(
            backend, tokenizer=tokenizer, temperature=temperature, top_p=top_p,
            max_concurrent=max_concurrent_episodes, max_context_tokens=max_context_tokens,
            worker=self.worker, env_factory=env_factory,
        )
        self.emitted = 0
        self.dead_lettered = 0
        self.duplicates_skipped = 0
        self.stop_reasons: Counter[str] = Counter()
        self.offsets = OffsetTracker()  # pending: requests whose trajectory is not out yet
        self.policy = (PolicyFollower(PolicyVersionWatcher(context.bootstrap, context.topics), backend)
                       if follow_policy else None)

    def _dead_letter(self, source: SourceRecord, reason: str, error: str) -> Output:
        self.dead_lettered += 1
        return dead_letter(self.topics, source, reason, error, self.worker)

    def _accept(self, msg) -> Output | None:
        """Start playing one polled message; returns a dead letter when it cannot be played."""
        process_metrics().events.labels("env").inc()
        _, record, problem = decode_expected(msg.value, ("EpisodeRequest",))
        if problem is not None:
            self.offsets.read(msg.partition, msg.offset, pending=False)
            return self._dead_letter(msg, *problem)
        source = _Source(msg.topic, msg.partition, msg.offset, msg.key, msg.value)
        try:
            started = self.player.submit(record, tag=source)
        except (ValueError, TypeError, KeyError) as exc:
            self.offsets.read(msg.partition, msg.offset, pending=False)
            return self._dead_letter(msg, "invalid_event", f"unplayable EpisodeRequest: {exc!r}")
        self.offsets.read(msg.partition, msg.offset, pending=started)
        if not started:
            self.duplicates_skipped += 1
        return None

    def _emit(self, finished: Sequence[Finished]) -> list[Output | Send]:
        """The events of ``finished``: one encoded Trajectory each (a ``too_large_stub`` and its
        dead letter for one above max_message_bytes), a dead letter for a record that does not
        encode."""
        outputs: list[Output | Send] = []
        for done in finished:
            rec = done.record
            key = str(rec["group_id"])
            try:
                sent, events = fit(self.topics, self.topics.trajectories, key, "Trajectory", rec,
                                   self.max_message_bytes, self.worker,
                                   lambda r, size: too_large_stub(r, size, self.max_message_bytes))
            except EncodeError as exc:  # a bug, but one bad record must not stop the worker
                log.exception("trajectory %s does not encode", identity_of(rec))
                outputs.append(self._dead_letter(done.tag, "handler_error", f"EncodeError: {exc}"))
                continue
            if sent is not rec:
                log.warning("trajectory %s is above max_message_bytes %d: sent as a too_large stub",
                            identity_of(rec), self.max_message_bytes)
                self.too_large += 1
                self.dead_lettered += 1
                rec = sent
            outputs += events
            self.emitted += 1
            self.stop_reasons[rec["stop_reason"]] += 1
            if rec["error"]:  # infra failures must be visible to whoever runs the worker
                log.warning("%s/%s/%s/%s ended %s: %s", *identity_of(rec), rec["stop_reason"], rec["error"])
        return outputs

    def _commit(self) -> None:
        offsets = self.offsets.to_commit()
        try:
            commit_offsets(self.consumer, self.input_topic, offsets)
        except CommitFailedError as exc:
            log.warning("offset commit refused (%s); finished requests may be replayed", exc)
            return
        self.offsets.committed(offsets)

    def run(self, max_idle_s: float | None = None) -> None:
        """Loop until stop() (or SIGTERM/SIGINT), or until no trajectory is playing and no
        input arrived for ``max_idle_s`` seconds. Live trajectories are abandoned on exit
        (their requests stay uncommitted)."""
        idle_since = time.monotonic()
        try:
            while not self.stop_event.is_set():
                outputs: list[Output | Send] = []
                got = 0
                room = self.player.free_slots
                polled = {}
                if room > 0:
                    # Short poll while trajectories play: the model should not wait on Kafka.
                    timeout = 10 if self.player.active else self.poll_timeout_ms
                    polled = self.consumer.poll(timeout_ms=timeout, max_records=room)
                if self.policy is not None:
                    # new requests: the newest weights, exactly; between turns: a recent answer
                    self.policy.refresh(max_age_s=0.0 if polled else POLICY_MAX_AGE_S)
                for batch in polled.values():
                    for msg in batch:
                        got += 1
                        dl = self._accept(msg)
                        if dl is not None:
                            outputs.append(dl)
                finished = self.player.step(wait_s=self.poll_timeout_ms / 1000.0)
                outputs.extend(self._emit(finished))
                self.send(outputs)
                if outputs or finished:
                    self.producer.flush()  # acknowledged before the offsets move past them
                for done in finished:
                    self.offsets.done(done.tag.partition, done.tag.offset)
                self._commit()
                if got or self.player.active:
                    idle_since = time.monotonic()
                elif max_idle_s is not None and time.monotonic() - idle_since > max_idle_s:
                    break
        finally:
            self.close()

    def close(self) -> None:
        self.player.abandon_all()
        try:
            super().close()
        finally:
            if self.policy is not None:
                self.policy.close()


def run_env_worker(
    context: StageContext,
    config: Any = None,
    *,
    backend: GenerationBackend | str | None = None,
    backend_kwargs: dict[str, Any] | None = None,
    group_id: str = "rollstream-env",
    max_idle_s: float | None = None,
    nice: int = 0,
) -> EnvWorker:
    """Run an env worker until SIGTERM/SIGINT or ``max_idle_s`` idle seconds; returns the
    finished EnvWorker (``emitted``, ``dead_lettered``, ``duplicates_skipped``,
    ``stop_reasons``).

    ``context`` (stage ``env``): the cluster, topics, this process's partitions, and the
    Kafka settings. ``config``: an AgenticConfig (or None: the defaults). It supplies the sampling
    (``EnvSampling.of``), the backend name, ``max_num_seqs`` and ``device`` from
    ``config.actor_infer``, the model from ``config.infer_model_path`` (None: the bundled one);
    every ``custom_envs`` env_type is resolved up front. ``backend``: a GenerationBackend
    instance, or a backend name built with ``make_backend(name, **backend_kwargs)``. ``nice``:
    added to the process's nice value once the backend is loaded (``actor_infer.nice``).
    Raises ConfigError for an unknown env_type in ``config.custom_envs`` or an unknown backend.
    """
    for env in getattr(config, "custom_envs", {}).values():
        resolve_env(env.env_type)  # fail at start-up, not on the first request
    if backend is None or isinstance(backend, str):
        actor = getattr(config, "actor_infer", None)
        name = backend or (actor.backend if actor is not None else "transformers")
        kwargs = dict(backend_kwargs or {})
        if actor is not None and name != "vllm_server":  # a server backend's model is the servers'
            kwargs.setdefault("model_dir", getattr(config, "infer_model_path", None))
        if actor is not None and name != "vllm_server" and actor.max_num_seqs is not None:
            kwargs.setdefault("max_num_seqs", actor.max_num_seqs)
        if actor is not None and name == "transformers":
            kwargs.setdefault("device", actor.device)
        backend = make_backend(name, **kwargs)
    lower_cpu_priority(nice)
    worker = EnvWorker(context, backend=backend, sampling=EnvSampling.of(config), group_id=group_id)
    worker.install_signal_handlers()
    worker.run(max_idle_s=max_idle_s)
    return worker
