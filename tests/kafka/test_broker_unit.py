"""Broker helpers that need no JVM: rendering, ids, classpath and missing-tool errors."""

from __future__ import annotations

import socket

import pytest

from rollstream.exceptions import BrokerStartError
from rollstream.kafka import broker as b


def test_properties_render_ports_and_log_dir(tmp_path):
    text = b.render_server_properties(tmp_path, 12345, 12346)
    props = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:12345,CONTROLLER://127.0.0.1:12346"
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:12345"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:12346"
    assert props["log.dirs"] == str(tmp_path.resolve() / "kraft")
    assert props["transaction.state.log.min.isr"] == "1"
    assert props["group.initial.rebalance.delay.ms"] == "0"
    assert "{" not in text  # every placeholder filled


def test_free_ports_are_bindable_distinct_and_below_the_ephemeral_range():
    ports = [b.free_port() for _ in range(50)]
    assert len(set(ports)) == 50  # never handed out twice
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    if b.EPHEMERAL_RANGE_FILE.exists():  # no outgoing connection can take them first
        low = int(b.EPHEMERAL_RANGE_FILE.read_text().split()[0])
        assert all(port < low for port in ports)


def test_cluster_id_shape():
    ids = {b.new_cluster_id() for _ in range(200)}
    assert len(ids) == 200
    assert all(len(i) == 22 and not i.startswith("-") and "=" not in i for i in ids)


def test_restart_reuses_recorded_cluster_id(tmp_path):
    (tmp_path / "kraft").mkdir()
    (tmp_path / "kraft" / "meta.properties").write_text("#x\nnode.id=1\ncluster.id=abcDEF_-12\n")
    assert b.EmbeddedBroker(tmp_path).cluster_id() == "abcDEF_-12"


def test_missing_java_raises_with_install_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no java, no mvn
    broker = b.EmbeddedBroker(tmp_path / "data")
    with pytest.raises(BrokerStartError, match="java.*install"):
        broker.start(timeout=5)
    assert not broker.is_running()


def test_missing_mvn_raises_when_jars_are_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))  # empty jar cache
    monkeypatch.delenv("KAFKA_HOME", raising=False)
    with pytest.raises(BrokerStartError, match="mvn.*install Maven"):
        b.kafka_classpath()


def test_kafka_home_overrides_maven(tmp_path, monkeypatch):
    (tmp_path / "libs").mkdir()
    monkeypatch.setenv("KAFKA_HOME", str(tmp_path))
    assert b.kafka_classpath() == f"{tmp_path}/libs/*"
    monkeypatch.setenv("KAFKA_HOME", str(tmp_path / "nope"))
    with pytest.raises(BrokerStartError, match="libs"):
        b.kafka_classpath()


def test_bootstrap_before_start_is_an_error(tmp_path):
    with pytest.raises(BrokerStartError, match=r"broker has no port yet; call start\(\) first"):
        b.EmbeddedBroker(tmp_path).bootstrap


def test_metadata_ready_false_when_nothing_listens():
    assert b.metadata_ready(f"127.0.0.1:{b.free_port()}", timeout=0.5) is False


def test_daemon_status_without_state_file(tmp_path):
    assert b.daemon_status(tmp_path) is None
    assert b.stop_daemon(tmp_path) is False
