"""Topic names: one function builds every name, so the prefix is the only knob.

Renaming a topic orphans its data and consumer offsets: treat names as a contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollstream.exceptions import ConfigError
from rollstream.runtime import DEFAULT_TOPIC_PREFIX as DEFAULT_PREFIX

if TYPE_CHECKING:  # the config package loads the filters (torch): not needed to name topics
    from rollstream.config.base import KafkaConfig

# logical name -> (partition class, compacted). "keyed" topics share one partition count: the RLVR
# topics keyed by prompt_id, so one prompt's events meet in one partition (co-partitioning), and
# the agentic topics keyed by group_id; "single" topics have one partition.
TOPICS: dict[str, tuple[str, bool]] = {
    "prompts": ("single", False),
    "generation.requests": ("keyed", False),
    "responses": ("keyed", False),
    "responses.rewarded": ("keyed", False),
    "groups.accepted": ("keyed", False),
    "groups.rejected": ("keyed", False),
    "groups.validation": ("keyed", False),
    "prompt.outcomes": ("single", False),
    # each train prompt's outcome history (PromptHistory, key the prompt_id of its first epoch):
    # what the history-aware admission skips by; compacted, so a restart reads the latest of each
    "prompt.history": ("single", True),
    # agentic topics, keyed by group_id
    "episodes.control": ("keyed", False),
    "episodes.requests": ("keyed", False),
    "trajectories": ("keyed", False),
    # a group id's GroupQueueOutcome, keyed by group_id; one partition: its one reader (the
    # trainer) sees every group id's verdict in order
    "episodes.outcomes": ("single", False),
    "batches": ("single", False),
    "policy.versions": ("single", True),
    "metrics": ("single", False),
    "dead-letter": ("single", False),
}


PAYLOAD_TOPICS = ("responses", "trajectories")
"""The topics whose events carry token arrays (the payload plane): written once, read back by
reference (``PayloadRef``) by the trainer and the tools. Every other topic carries small
decision-plane events."""
PAYLOAD_SEGMENT_MS = 3_600_000
"""The payload topics' ``segment.ms``: deleted records free their disk within the hour."""

CHANGELOGS = "changelogs"
"""The ``kafka.topic_configs`` key that applies to every table's changelog topic."""
CHANGELOG_SEGMENT_MS = 600_000
"""The changelogs' ``segment.ms``: the broker compacts closed segments only, and at its default
(a week, or 1 GiB) a changelog keeps every update of the run until then."""
CHANGELOG_DELETE_RETENTION_MS = 3_600_000
"""The changelogs' ``delete.retention.ms``: how long a deleted key's tombstone outlives
compaction (the broker's default is a day). A table restores in seconds, so an hour still lets
every restore see the deletes it reads past."""


def _config_value(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_topic_configs(kafka: "KafkaConfig") -> None:
    """Raise ConfigError when ``kafka.topic_configs`` names a topic rollstream does not have."""
    unknown = sorted(set(kafka.topic_configs) - set(TOPICS) - {CHANGELOGS})
    if unknown:
        raise ConfigError(f"kafka.topic_configs names unknown topics {unknown}; known: {sorted(TOPICS) + [CHANGELOGS]}")


def topic_settings(kafka: "KafkaConfig", logical: str) -> dict[str, str]:
    """The topic configs rollstream sets on the topic ``logical`` (a TOPICS name or CHANGELOGS),
    beyond the broker's defaults: ``min.insync.replicas`` when set; for payload topics
    ``max.message.bytes``, ``compression.type`` (``none`` -> ``uncompressed``), ``retention.ms``
    -1 (the trainer deletes payloads once no group needs them, rollstream.trainer.retention; the
    broker's clock never does) and ``segment.ms`` of an hour (the broker frees whole segments only:
    the disk then follows the deletions within the hour); for the changelogs ``segment.ms`` and
    ``delete.retention.ms`` that let compaction keep them near the tables' live size; then the
    user's ``kafka.topic_configs[logical]``, which win."""
    configs: dict[str, str] = {}
    if kafka.min_insync_replicas is not None:
        configs["min.insync.replicas"] = str(kafka.min_insync_replicas)
    if logical in PAYLOAD_TOPICS:
        configs["max.message.bytes"] = str(kafka.max_message_bytes)
        configs["compression.type"] = "uncompressed" if kafka.compression_type == "none" else kafka.compression_type
        configs["retention.ms"] = "-1"
        configs["segment.ms"] = str(PAYLOAD_SEGMENT_MS)
    elif logical == CHANGELOGS:
        configs["segment.ms"] = str(CHANGELOG_SEGMENT_MS)
        configs["delete.retention.ms"] = str(CHANGELOG_DELETE_RETENTION_MS)
    configs.update({key: _config_value(value) for key, value in kafka.topic_configs.get(logical, {}).items()})
    return configs


@dataclass(frozen=True)
class Topics:
    """Full topic names for one deployment (``prefix`` + logical name)."""

    prefix: str = DEFAULT_PREFIX

    def name(self, logical: str) -> str:
        """The full name of a logical topic; KeyError names the known ones."""
        if logical not in TOPICS:
            raise KeyError(f"unknown topic {logical!r}; known: {sorted(TOPICS)}")
        return f"{self.prefix}{logical}"

    def all(self, partitions: int) -> dict[str, tuple[int, bool]]:
        """Full name -> (partition count, compacted) for topic creation."""
        return {
            self.name(t): (partitions if cls == "keyed" else 1, compacted)
            for t, (cls, compacted) in TOPICS.items()
        }

    def payload(self) -> list[str]:
        """Full names of the payload topics (``PAYLOAD_TOPICS``)."""
        return [self.name(t) for t in PAYLOAD_TOPICS]

    def topic_configs(self, kafka: "KafkaConfig") -> dict[str, dict[str, str]]:
        """Topic configs beyond the broker's defaults by full name (``topic_settings`` of each
        topic that has some). Raises ConfigError for an unknown name in ``kafka.topic_configs``."""
        check_topic_configs(kafka)
        configs = {self.name(t): topic_settings(kafka, t) for t in TOPICS}
        return {name: c for name, c in configs.items() if c}

    def keyed(self) -> list[str]:
        """Full names of the topics that must be co-partitioned (one partition count)."""
        return [self.name(t) for t, (cls, _) in TOPICS.items() if cls == "keyed"]

    def decision_topic(self, mode: str, accepted: bool) -> str:
        """Where a decided group goes: validation groups to ``groups.validation`` whatever the
        decision (they bypass the filters' consequences), train groups to ``groups.accepted`` or
        ``groups.rejected``."""
        if mode == "val":
            return self.groups_validation
        return self.groups_accepted if accepted else self.groups_rejected

    prompts = property(lambda self: self.name("prompts"))
    generation_requests = property(lambda self: self.name("generation.requests"))
    responses = property(lambda self: self.name("responses"))
    responses_rewarded = property(lambda self: self.name("responses.rewarded"))
    groups_accepted = property(lambda self: self.name("groups.accepted"))
    groups_rejected = property(lambda self: self.name("groups.rejected"))
    groups_validation = property(lambda self: self.name("groups.validation"))
    prompt_outcomes = property(lambda self: self.name("prompt.outcomes"))
    prompt_history = property(lambda self: self.name("prompt.history"))
    episodes_control = property(lambda self: self.name("episodes.control"))
    episodes_requests = property(lambda self: self.name("episodes.requests"))
    trajectories = property(lambda self: self.name("trajectories"))
    episodes_outcomes = property(lambda self: self.name("episodes.outcomes"))
    batches = property(lambda self: self.name("batches"))
    policy_versions = property(lambda self: self.name("policy.versions"))
    metrics = property(lambda self: self.name("metrics"))
    dead_letter = property(lambda self: self.name("dead-letter"))
