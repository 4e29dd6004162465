"""Production clusters: replication and topic settings on a 3-node KRaft cluster, and client
security (SASL/SCRAM) against a broker that requires it, credentials from the environment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import yaml
from kafka.admin import ConfigResource, ConfigResourceType
from kafka.errors import KafkaTimeoutError

from rollstream.app.stages import Stage
from rollstream.config import load_config
from rollstream.kafka import names
from rollstream.kafka import admin as admin_module
from rollstream.kafka.admin import (TopicWanted, _admin, cluster_brokers, create_pipeline_topics, create_topics,
                                    wait_for_topics)
from rollstream.kafka.cluster import Cluster
from rollstream.kafka.topics import TOPICS, Topics
from rollstream.tools.readback import read_values

from ..conftest import SASL_PASSWORD, SASL_USER
from .harness import SyntheticRollout, produce, prompt, start_stages, wait_for, write_config
from .test_end_of_data import end_data, first_sample_passes, verdicts

pytestmark = pytest.mark.integration


def _describe(bootstrap, names_: list[str]) -> tuple[dict[str, list[int]], dict[str, dict[str, str]]]:
    """Per topic: the replica count of each partition, and its topic configs."""
    admin = _admin(bootstrap)
    try:
        replicas = {t["name"]: [len(p["replica_nodes"]) for p in t["partitions"]] for t in admin.describe_topics(names_)}
        described = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n) for n in names_])["topic"]
    finally:
        admin.close()
    return replicas, {n: {k: v["value"] for k, v in c.items()} for n, c in described.items()}


def _config(tmp_path, topics: Topics, **kafka) -> "object":
    path = write_config(tmp_path, topics, 2, num_epochs=1, max_steps=5)
    raw = yaml.safe_load(path.read_text())
    raw["kafka"].update(kafka)
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_run_on_the_3_broker_cluster_replicates_every_topic_and_changelog(kafka_cluster, tmp_path):
    """replication_factor unset: min(3, brokers) = 3 for every topic rollstream creates, faust's
    own included; min_insync_replicas and topic_configs reach the topics they name."""
    bootstrap = kafka_cluster.cluster
    topics = Topics("rep.")
    path = _config(tmp_path, topics, min_insync_replicas=2,
                   topic_configs={"groups.rejected": {"retention.ms": 3_600_000}, "changelogs": {"segment.ms": 600_000}})
    config = load_config(path)
    create_pipeline_topics(bootstrap, config.kafka)
    stages = start_stages(path, str(bootstrap), tmp_path / "logs", Stage.admission, Stage.aggregator)
    rollout = SyntheticRollout(bootstrap, topics, first_sample_passes)
    rollout.start()
    try:
        produce(bootstrap, topics.prompts, "Prompt", [prompt("p0"), prompt("p1")])
        end_data(bootstrap, topics, 2)
        wait_for(lambda: verdicts(bootstrap, topics), timeout=240, what="the end-of-data verdict", stages=stages)
    finally:
        rollout.stop()
        stages.close()
    assert sorted(g["prompt_id"] for g in read_values(bootstrap, topics.groups_accepted)) == ["p0", "p1"]
    changelogs = sorted(names.changelog_topics(topics, 2))
    faust_own = [f"{names.app_id(topics, names.ADMISSION_APP)}-__assignor-__leader"]
    every = [topics.name(t) for t in TOPICS] + changelogs + faust_own
    replicas, configs = _describe(bootstrap, every)
    assert {name: set(counts) for name, counts in replicas.items()} == {name: {3} for name in every}
    assert all(configs[name]["min.insync.replicas"] == "2" for name in [topics.name(t) for t in TOPICS] + changelogs)
    assert configs[topics.groups_rejected]["retention.ms"] == "3600000"
    assert "retention.ms" not in configs[topics.groups_accepted]  # the broker default
    assert all(configs[name]["segment.ms"] == "600000" for name in changelogs)


@pytest.mark.parametrize("reported", [1, 2])
def test_unset_replication_is_decided_by_the_controller_not_a_lagging_metadata_view(kafka_cluster, monkeypatch,
                                                                                    reported):
    """A node's metadata can lag a broker that just joined (in CI, one node still reported 2 of
    3 brokers a second after start): with replication_factor unset, 3 is asked for first, and
    the controller, which knows every broker it has unfenced, grants it."""
    monkeypatch.setattr(admin_module, "cluster_brokers", lambda bootstrap, timeout=5.0: reported)
    name = Topics(f"lag{reported}.").prompts
    create_topics(kafka_cluster.cluster, {name: (2, False)})
    assert _describe(kafka_cluster.cluster, [name])[0] == {name: [3, 3]}


def test_every_broker_must_report_a_topic_before_it_counts_as_ready(kafka_cluster):
    """A client asks whichever broker it likes, so create_topics waits for every broker's own
    view: one that cannot confirm (here, paused) holds the wait back and is named in the error;
    once it answers, each broker alone describes the topic in full."""
    name = Topics("every.").prompts
    create_topics(kafka_cluster.cluster, {name: (2, False)})
    # the node to pause must be one the cluster lists: a node the controller fenced (a heartbeat
    # missed on a loaded machine) is rightly not waited for, and pausing it would prove nothing
    wait_for(lambda: cluster_brokers(kafka_cluster.cluster) == len(kafka_cluster.nodes), timeout=60,
             what="every node listed by the cluster")
    paused = kafka_cluster.nodes[-1]
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        with pytest.raises(KafkaTimeoutError, match=f"{paused.bootstrap}: unreachable|{paused.bootstrap}: no answer"):
            wait_for_topics(kafka_cluster.cluster, {name: TopicWanted(2, 3)}, timeout=2)
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    wait_for_topics(kafka_cluster.cluster, {name: TopicWanted(2, 3)}, timeout=60)
    for node in kafka_cluster.nodes:
        assert _describe(node.bootstrap, [name])[0] == {name: [3, 3]}


def test_unset_replication_on_a_smaller_cluster_falls_back_to_its_brokers(kafka_broker):
    name = Topics("fallback.").prompts
    create_topics(kafka_broker, {name: (2, False)})
    expected = min(3, cluster_brokers(kafka_broker))
    assert _describe(kafka_broker, [name])[0] == {name: [expected, expected]}


def test_a_run_on_the_sasl_broker_takes_its_credentials_from_the_environment(sasl_broker, tmp_path, monkeypatch):
    topics = Topics("sasl.")
    path = _config(tmp_path, topics, security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-256")
    assert SASL_PASSWORD not in path.read_text()  # the YAML names the variables, never the secret
    monkeypatch.setenv("ROLLSTREAM_KAFKA_USERNAME", SASL_USER)
    monkeypatch.setenv("ROLLSTREAM_KAFKA_PASSWORD", SASL_PASSWORD)
    config = load_config(path)
    cluster = Cluster.from_config(sasl_broker.bootstrap, config.kafka)
    assert cluster == sasl_broker
    create_pipeline_topics(cluster, config.kafka)
    stages = start_stages(path, sasl_broker.bootstrap, tmp_path / "logs", Stage.admission, Stage.aggregator)
    rollout = SyntheticRollout(cluster, topics, first_sample_passes)
    rollout.start()
    try:
        produce(cluster, topics.prompts, "Prompt", [prompt("p0"), prompt("p1"), prompt("p2")])
        end_data(cluster, topics, 3)
        wait_for(lambda: verdicts(cluster, topics), timeout=240, what="the end-of-data verdict", stages=stages)
    finally:
        rollout.stop()
        stages.close()
    [verdict] = verdicts(cluster, topics)
    assert (verdict["status"], verdict["accepted_groups"]) == ("end_of_data", 3)
    assert sorted(g["prompt_id"] for g in read_values(cluster, topics.groups_accepted)) == ["p0", "p1", "p2"]


def test_wrong_sasl_credentials_are_a_clear_error_naming_the_user_never_the_password(sasl_broker, tmp_path):
    path = _config(tmp_path, Topics("sasl-bad."), security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-256")
    env = {**os.environ, "ROLLSTREAM_KAFKA_USERNAME": SASL_USER, "ROLLSTREAM_KAFKA_PASSWORD": "not-the-password"}
    res = subprocess.run([sys.executable, "-m", "rollstream", "worker", "admission", "-c", str(path),
                          "-b", sasl_broker.bootstrap], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "refused the credentials (SASL_PLAINTEXT SCRAM-SHA-256, user 'alice')" in res.stderr
    assert "not-the-password" not in res.stdout + res.stderr
    del env["ROLLSTREAM_KAFKA_PASSWORD"]
    res = subprocess.run([sys.executable, "-m", "rollstream", "create-topics", "-c", str(path),
                          "-b", sasl_broker.bootstrap], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "set the environment variable(s) $ROLLSTREAM_KAFKA_PASSWORD" in res.stderr
