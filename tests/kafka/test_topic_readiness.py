"""What one broker must report before a topic or a config counts as ready (no broker needed)."""

from __future__ import annotations

import pytest

from rollstream.kafka.admin import TopicWanted, configs_not_applied, topic_not_ready


def _partition(i: int, leader: int = 1, replicas=(1, 2, 3), error_code: int = 0) -> dict:
    return {"error_code": error_code, "partition": i, "leader": leader, "replicas": list(replicas), "isr": []}


def _topic(*partitions: dict, error_code: int = 0) -> dict:
    return {"error_code": error_code, "topic": "t", "is_internal": False, "partitions": list(partitions)}


@pytest.mark.parametrize("reported, wanted, reason", [
    (None, TopicWanted(2, 3), "missing"),
    # how a broker that has not applied the creation yet answers
    (_topic(error_code=3), TopicWanted(2, 3), "UnknownTopicOrPartitionError"),
    (_topic(), TopicWanted(), "0 of some partitions"),
    (_topic(_partition(0)), TopicWanted(2, 3), "1 of 2 partitions"),
    (_topic(_partition(0), _partition(1, leader=-1)), TopicWanted(2, 3), "partition 1: no leader"),
    (_topic(_partition(0), _partition(1, replicas=(1, 2))), TopicWanted(2, 3), "partition 1: 2 of 3 replicas"),
    (_topic(_partition(0, error_code=5)), TopicWanted(1, 3), "partition 0: LeaderNotAvailableError"),
])
def test_a_topic_is_not_ready_on_a_broker_until_it_reports_what_was_created(reported, wanted, reason):
    assert topic_not_ready(reported, wanted) == reason


def test_a_topic_is_ready_with_its_partitions_replicas_and_leaders():
    assert topic_not_ready(_topic(_partition(0), _partition(1)), TopicWanted(2, 3)) is None
    # a topic of an older run: any partition count and replication
    assert topic_not_ready(_topic(_partition(0, replicas=(1,))), TopicWanted()) is None
    # an offline replica beside a live leader (REPLICA_NOT_AVAILABLE) still serves clients
    assert topic_not_ready(_topic(_partition(0, error_code=9)), TopicWanted(1, 3)) is None


def _resource(name: str, error_code: int = 0, **values: str) -> dict:
    return {"error_code": error_code, "error_message": None, "resource_type": 2, "resource_name": name,
            "config_entries": [{"config_names": k.replace("_", "."), "config_value": v} for k, v in values.items()]}


def test_configs_are_applied_on_a_broker_once_it_reports_every_value():
    wanted = {"a": {"retention.ms": "1000"}, "b": {"segment.ms": "600000"}}
    assert configs_not_applied([_resource("a", retention_ms="1000"), _resource("b", segment_ms="600000")],
                               wanted) is None
    assert configs_not_applied([_resource("a", retention_ms="604800000"), _resource("b", segment_ms="600000")],
                               wanted) == "a: retention.ms='604800000', not '1000'"
    assert configs_not_applied([_resource("a", retention_ms="1000")], wanted) == "b: missing"
    assert configs_not_applied([_resource("a", retention_ms="1000"), _resource("b", error_code=3)],
                               wanted) == "b: UnknownTopicOrPartitionError"
