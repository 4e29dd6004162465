"""Cluster settings without a broker: client security from config + environment, the secrets
rule, per-topic settings, replication checks and the brokers' properties."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollstream.config.base import KafkaConfig
from rollstream.exceptions import ConfigError
from rollstream.filtering import admission as core
from rollstream.kafka import broker, names
from rollstream.kafka.cluster import Cluster, as_cluster
from rollstream.kafka.topics import Topics, topic_settings

SASL = {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512"}


def test_plaintext_clients_get_only_the_bootstrap_servers():
    assert Cluster.from_config("a:1,b:2", KafkaConfig(), environ={}).client_kwargs() == {"bootstrap_servers": "a:1,b:2"}
    assert as_cluster("a:1") == Cluster("a:1") and str(Cluster("a:1,b:2")) == "a:1,b:2"
    assert Cluster("a:1, b:2 ,").servers == ["a:1", "b:2"]


def test_sasl_credentials_come_from_the_named_environment_variables(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("not read here")
    kafka = KafkaConfig(**SASL, ssl_cafile=str(ca), sasl_username_env="MY_USER", sasl_password_env="MY_PASS")
    cluster = Cluster.from_config("h:9093", kafka, environ={"MY_USER": "bob", "MY_PASS": "s3cret"})
    assert cluster.client_kwargs() == {
        "bootstrap_servers": "h:9093", "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "bob", "sasl_plain_password": "s3cret", "ssl_cafile": str(ca)}
    assert "s3cret" not in repr(cluster)
    with pytest.raises(ConfigError, match=r"set the environment variable\(s\) \$MY_PASS"):
        Cluster.from_config("h:9093", kafka, environ={"MY_USER": "bob"})


@pytest.mark.parametrize("key", ["sasl_password", "password", "sasl_plain_password", "sasl_username", "ssl_password"])
def test_secrets_in_the_yaml_are_refused_with_a_pointer_to_the_environment(key):
    with pytest.raises(ValidationError, match=f"{key}: secrets are not read from the config") as info:
        KafkaConfig(**SASL, **{key: "hunter2"})
    assert "hunter2" not in str(info.value.errors()[0]["msg"])


@pytest.mark.parametrize("kwargs, message", [
    ({"security_protocol": "SASL_PLAINTEXT"}, "needs sasl_mechanism"),
    ({"sasl_mechanism": "PLAIN"}, "sasl_mechanism is set but security_protocol is PLAINTEXT"),
    ({"ssl_cafile": "/ca.pem"}, "apply to SSL and SASL_SSL only"),
    ({"security_protocol": "SSL", "ssl_cafile": "/no/such/ca.pem"}, "ssl_cafile: no file"),
    ({"replication_factor": 2, "min_insync_replicas": 3}, "min_insync_replicas 3 > replication_factor 2"),
])
def test_inconsistent_cluster_settings_fail_at_load(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        KafkaConfig(**kwargs)


def test_topic_settings_layer_rollstreams_own_under_the_users():
    kafka = KafkaConfig(min_insync_replicas=2, payload_retention_ms=86_400_000, compression_type="none",
                        topic_configs={"responses": {"retention.ms": 1000}, "groups.rejected": {"cleanup.policy": "compact"},
                                       "changelogs": {"unclean.leader.election.enable": False}})
    assert topic_settings(kafka, "responses") == {
        "min.insync.replicas": "2", "max.message.bytes": str(kafka.max_message_bytes),
        "compression.type": "uncompressed", "retention.ms": "1000", "segment.ms": "3600000"}  # the user's value wins
    assert topic_settings(kafka, "groups.rejected") == {"min.insync.replicas": "2", "cleanup.policy": "compact"}
    topics = Topics("x.")
    assert set(topics.topic_configs(kafka)) == {topics.name(t) for t in ("prompts", "generation.requests",
                                                "responses", "responses.rewarded", "groups.accepted", "groups.rejected",
                                                "groups.validation", "prompt.outcomes", "prompt.history", "episodes.control",
                                                "episodes.requests", "trajectories", "episodes.outcomes", "batches",
                                                "policy.versions", "metrics", "dead-letter")}
    changelogs = names.changelog_configs(topics, kafka)
    assert set(changelogs) == set(names.changelog_topics(topics, kafka.partitions))
    assert all(c == {"min.insync.replicas": "2", "segment.ms": "600000", "delete.retention.ms": "3600000",
                     "unclean.leader.election.enable": "false"} for c in changelogs.values())
    # by default the changelogs roll segments every 10 minutes, so compaction bounds them
    assert all(c == {"segment.ms": "600000", "delete.retention.ms": "3600000"}
               for c in names.changelog_configs(topics, KafkaConfig()).values())
    assert Topics("x.").topic_configs(KafkaConfig()) == {  # defaults: only the payload topics' sizes
        n: topic_settings(KafkaConfig(), t) for n, t in (("x.responses", "responses"), ("x.trajectories", "trajectories"))}


def test_an_unknown_topic_in_topic_configs_is_a_config_error():
    with pytest.raises(ConfigError, match=r"unknown topics \['groups.accpted'\]"):
        Topics().topic_configs(KafkaConfig(topic_configs={"groups.accpted": {"retention.ms": 1}}))


def test_cluster_node_properties_name_the_quorum_and_replicate_internal_topics(tmp_path):
    text = broker.render_server_properties(tmp_path, 1001, 1002, node_id=2, voters="1@127.0.0.1:9,2@127.0.0.1:1002",
                                           nodes=3, sasl_admin_password="pw")
    props = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    assert props["node.id"] == "2" and props["controller.quorum.voters"] == "1@127.0.0.1:9,2@127.0.0.1:1002"
    assert props["listeners"] == "SASL_PLAINTEXT://127.0.0.1:1001,CONTROLLER://127.0.0.1:1002"
    assert props["inter.broker.listener.name"] == "SASL_PLAINTEXT"
    assert (props["offsets.topic.replication.factor"], props["transaction.state.log.min.isr"],
            props["default.replication.factor"]) == ("3", "2", "3")
    assert props["sasl.enabled.mechanisms"] == "SCRAM-SHA-256,SCRAM-SHA-512"
    assert 'username="rollstream-admin" password="pw";' in props["listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config"]


def test_more_properties_are_appended_and_override_the_template(tmp_path):
    text = broker.render_server_properties(tmp_path, 1001, 1002, properties={"broker.session.timeout.ms": "60000",
                                                                            "num.io.threads": "4"})
    props = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)  # a later line wins
    assert (props["broker.session.timeout.ms"], props["num.io.threads"]) == ("60000", "4")
    cluster = broker.EmbeddedCluster(tmp_path / "cluster", brokers=2, properties={"broker.session.timeout.ms": "60000"})
    assert [node.properties for node in cluster.nodes] == [{"broker.session.timeout.ms": "60000"}] * 2


def test_the_oldest_admission_bounds_where_undelivered_outcomes_can_be():
    limits = core.AdmissionLimits(rollout_batch_size=2, max_running_prompts=4, max_prompts_per_batch=8)
    state = core.AdmissionState()
    assert core.oldest_admission_ms(state) is None
    core.admit(state, "p0", now_ms=5_000)
    core.admit(state, "v0", "val", now_ms=3_000)
    core.admit(state, "p1", now_ms=7_000)
    assert core.oldest_admission_ms(state) == 3_000
    state, _ = core.on_outcome(state, limits, "v0", True, "accepted")
    assert core.oldest_admission_ms(state) == 5_000 and state.admitted_ms == {"p0": 5_000, "p1": 7_000}
    old = core.AdmissionState.from_dict({**state.to_dict(), "admitted_ms": {}})  # a state written before this field
    assert core.oldest_admission_ms(old) == 0
