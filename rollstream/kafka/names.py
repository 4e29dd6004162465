"""Stable names of the stateful parts. faust derives changelog topics from the app id and the
table name (``<app id>-<table>-changelog``): renaming either orphans state, so treat these as a
contract and migrate with a note."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollstream.kafka.topics import CHANGELOGS, Topics, topic_settings

if TYPE_CHECKING:
    from rollstream.config.base import KafkaConfig

ADMISSION_APP = "admission"
AGGREGATOR_APP = "aggregator"
ADMISSION_TABLE = "admission-state"  # ADMISSION_KEY and the seen prompt ids, on partition 0
ADMISSION_KEY = b"admission"
ADMISSION_SEEN_PREFIX = b"seen:"  # + prompt_id -> the offset on `prompts` it was admitted from
PROMPT_STATE_TABLE = "prompt-state"  # prompt_id -> PromptState + accepted response bytes
GROUP_QUEUE_APP = "group-queue"
GROUP_QUEUE_TABLE = "group-queues"  # see rollstream.streams.group_queue_processor


def app_id(topics: Topics, app: str) -> str:
    """The faust app id (= its consumer group) of a stream processor."""
    return f"{topics.prefix}{app}"


def consumer_group(topics: Topics, stage: str) -> str:
    """The consumer group that stores a plain worker's or the trainer's committed offsets
    (``generation``, ``reward``, ``env``, ``trainer``): renaming it restarts the stage from its
    topics' beginning."""
    return f"{topics.prefix}{stage}"


def changelog_topics(topics: Topics, partitions: int) -> dict[str, tuple[int, bool]]:
    """The tables' changelog topics (full name -> (partitions, compacted)). Created up front:
    faust creating them itself races with its own metadata refresh and can see 0 partitions."""
    return {
        f"{app_id(topics, ADMISSION_APP)}-{ADMISSION_TABLE}-changelog": (1, True),
        f"{app_id(topics, AGGREGATOR_APP)}-{PROMPT_STATE_TABLE}-changelog": (partitions, True),
        f"{app_id(topics, GROUP_QUEUE_APP)}-{GROUP_QUEUE_TABLE}-changelog": (partitions, True),
    }


def changelog_configs(topics: Topics, kafka: "KafkaConfig") -> dict[str, dict[str, str]]:
    """The changelog topics' configs by full name (``topic_settings`` of CHANGELOGS)."""
    settings = topic_settings(kafka, CHANGELOGS)
    return {name: dict(settings) for name in changelog_topics(topics, kafka.partitions)}
