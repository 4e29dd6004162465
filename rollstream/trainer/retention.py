"""Which payload records no group can still need. The trainer deletes the records below the cuts
computed here (``rollstream.kafka.payloads.PayloadPruner``), so payload retention follows
consumption: the broker's clock never deletes a payload (the payload topics' ``retention.ms`` is
-1), and a pipeline that is down or behind deletes nothing it has not used.

Who may still need a payload record, and how each is covered:

* **an accepted group the trainer has not trained**: the trainer prunes only when it has read
  ``groups.accepted`` to its end, so it holds every such group with its references; a cut never
  passes the lowest offset they name (``cut_offsets``);
* **a group not decided yet, or decided and not yet appended**: the stages that read payloads or
  hold open groups (the *readers*: RLVR's reward worker on ``responses`` and aggregator on
  ``generation.requests`` and ``responses.rewarded``; the agentic group queue on
  ``trajectories``) must have been *current* without a break for ``completion_ms + margin_ms``
  (their oldest unread record at most ``CURRENT_WITHIN_MS`` old at every check, checks at most
  ``max_gap_ms`` apart, so ``margin_ms`` bounds how far behind they can have been unseen). A group's deadlines run on its stage's clock from when the stage read its
  request, so every group opened before that window is decided by now, and every group opened
  within it was requested at most ``margin_ms`` before it was read. Its payloads, written after
  its request, are then younger than ``now - completion_ms - margin_ms``; and a decision the
  trainer has not seen yet (not on ``groups.accepted`` when it asked for the end) was taken at
  most ``margin_ms`` ago, or its stage would have stopped committing and fallen behind: one more
  ``margin_ms``. A record the readers have not read yet is younger than ``now - CURRENT_WITHIN_MS``.

So the time cut is ``now - max(keep_ms, completion_ms + 2 margin_ms) - skew_ms``: records stamped
before it are in no group that can still be trained; ``keep_ms`` (``kafka.payload_retention_ms``)
keeps them longer for replay and export, and ``skew_ms`` covers the clocks of the hosts that stamp
records. Times are epoch milliseconds (the records' CreateTime).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

DEFAULT_KEEP_MS = 7 * 86_400_000
"""Payloads kept at least this long when ``kafka.payload_retention_ms`` is null (Kafka's usual default)."""
PRUNE_EVERY_S = 30.0
"""How often the readers are checked, and at most how often the trainer prunes."""
CURRENT_WITHIN_MS = 60_000
"""A reader is current when its oldest unread record is at most this old."""
CHECK_SLACK_MS = 30_000
"""What a reader check may take beyond its interval before the watch counts a break."""
SKEW_MS = 60_000
"""Clock difference allowed between the hosts stamping payloads and requests."""
COMPLETION_MS = 3_000_000
"""The completion bound of an RLVR run with the default timeouts (600 s x (3 rounds + 2 reissues))."""

RLVR_READERS = (("reward", "responses"), ("aggregator", "generation.requests"), ("aggregator", "responses.rewarded"))
AGENTIC_READERS = (("group-queue", "trajectories"),)
"""(consumer group, topic) of the stages that read payloads or hold open groups, logical names
(a pipeline's readers: the other's topics stay empty, so watching both is harmless)."""


@dataclass(frozen=True)
class PayloadRetention:
    """How a trainer prunes payloads.

    Attributes:
        keep_ms: the least time a payload is kept (< 0: forever, nothing is deleted).
        completion_ms: the longest a group may take to complete on its stage's clock.
        readers: (consumer group, topic) of the stages that read payloads or hold open groups,
            logical names (``RLVR_READERS`` or ``AGENTIC_READERS``).
        every_s: how often the readers are checked and the trainer prunes at most.
        skew_ms: see ``SKEW_MS``.
    """

    keep_ms: int = DEFAULT_KEEP_MS
    completion_ms: int = COMPLETION_MS
    readers: tuple[tuple[str, str], ...] = RLVR_READERS + AGENTIC_READERS
    every_s: float = PRUNE_EVERY_S
    skew_ms: int = SKEW_MS

    @property
    def max_gap_ms(self) -> int:
        """The longest gap between two reader checks that does not break their watch: the
        interval plus ``CHECK_SLACK_MS`` for a slow check."""
        return int(self.every_s * 1000) + CHECK_SLACK_MS

    @property
    def margin_ms(self) -> int:
        """The longest a reader may have been behind unseen: a gap between two checks plus
        ``CURRENT_WITHIN_MS``; 0 without readers (no stage upstream holds a group)."""
        return self.max_gap_ms + CURRENT_WITHIN_MS if self.readers else 0

    @classmethod
    def of(cls, config) -> "PayloadRetention":
        """A pipeline config's: ``kafka.payload_retention_ms`` (null: ``DEFAULT_KEEP_MS``), its
        ``group_completion_s`` and its pipeline's readers."""
        from rollstream.config import AgenticConfig

        keep = config.kafka.payload_retention_ms
        readers = AGENTIC_READERS if isinstance(config, AgenticConfig) else RLVR_READERS
        return cls(DEFAULT_KEEP_MS if keep is None else keep, int(config.group_completion_s * 1000), readers)


@dataclass
class ReaderWatch:
    """How long the readers have been current without a break: ``observe`` each check (a gap
    longer than ``max_gap_ms`` between two checks is a break: nothing is known in between)."""

    max_gap_ms: int
    current_since_ms: int | None = None
    last_check_ms: int | None = None

    def observe(self, now_ms: int, current: bool) -> None:
        unbroken = self.last_check_ms is not None and now_ms - self.last_check_ms <= self.max_gap_ms
        if not current:
            self.current_since_ms = None
        elif self.current_since_ms is None or not unbroken:
            self.current_since_ms = now_ms
        self.last_check_ms = now_ms

    def current_for_ms(self, now_ms: int) -> int | None:
        """How long they have been current as of ``now_ms``; None when they are not, or the last
        check is too old to say."""
        if self.current_since_ms is None or self.last_check_ms is None or now_ms - self.last_check_ms > self.max_gap_ms:
            return None
        return now_ms - self.current_since_ms


def is_current(first_unread_ms: Iterable[int | None], now_ms: int, within_ms: int = CURRENT_WITHIN_MS) -> bool:
    """Whether every reader partition's oldest unread record (its timestamp; None: nothing
    unread) is at most ``within_ms`` old."""
    return all(ts is None or ts >= now_ms - within_ms for ts in first_unread_ms)


def payload_horizon_ms(now_ms: int, policy: PayloadRetention, current_for_ms: int | None) -> int | None:
    """The time cut of the module doc, or None when nothing may be deleted: ``keep_ms`` < 0, or
    the readers not current for ``completion_ms + margin_ms`` (without readers, nothing to wait
    for)."""
    if policy.keep_ms < 0:
        return None
    if policy.readers and (current_for_ms is None or current_for_ms < policy.completion_ms + policy.margin_ms):
        return None
    return now_ms - max(policy.keep_ms, policy.completion_ms + 2 * policy.margin_ms) - policy.skew_ms


def cut_offsets(time_cuts: Mapping[tuple[str, int], int], held: Iterable[tuple[str, int, int]]) -> dict:
    """Per payload partition ``(topic, partition)``: the offset below which records go, the time
    cut's offset lowered to the lowest offset a held group names there (``held``: the ``(topic,
    partition, offset)`` of every reference of the groups the trainer holds)."""
    cuts = dict(time_cuts)
    for topic, partition, offset in held:
        if (topic, partition) in cuts:
            cuts[(topic, partition)] = min(cuts[(topic, partition)], offset)
    return cuts
