"""Metrics on the real broker: admission and aggregator workers serve Prometheus /metrics and
publish snapshots to `metrics`; `rollstream stats` reads them back with exact counts."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from rollstream.app.processes import StageProcesses
from rollstream.app.stages import Stage
from rollstream.kafka.broker import free_port
from rollstream.tools.readback import read_values

from .harness import SyntheticRollout, produce, prompt, wait_for, write_config

pytestmark = pytest.mark.integration

REWARDS = {"p0": [1, 0, 0, 0], "p1": [0, 0, 0, 0], "p2": [1, 1, 0, 0], "p3": [1, 0, 1, 0]}




def stats(bootstrap: str, prefix: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "rollstream", "stats", "-b", bootstrap, "--prefix", prefix,
                          "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_workers_expose_and_publish_exact_metrics(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory(partitions=2)
    config = write_config(tmp_path, topics, 2, rollout_batch_size=3, max_running_prompts=4)
    (tmp_path / "logs").mkdir()
    stages = StageProcesses(config, kafka_broker, tmp_path / "logs")
    port = free_port()
    stages.start(Stage.admission)
    stages.start(Stage.aggregator, "--metrics-port", str(port))
    rollout = SyntheticRollout(kafka_broker, topics, lambda pid, i, r: (float(REWARDS[pid][i]), "stop"))
    rollout.start()
    try:
        produce(kafka_broker, topics.prompts, "Prompt", [prompt(p) for p in REWARDS])
        wait_for(lambda: len(read_values(kafka_broker, topics.prompt_outcomes)) == 4, timeout=180,
                 what="every prompt decided", stages=stages)
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert 'rollstream_decided_total{outcome="rejected",unit="query"} 1.0' in scraped
        assert 'rollstream_rejections_total{reason="zero_std",unit="query"} 1.0' in scraped

        def settled() -> bool:  # snapshots every 10 s
            view = stats(kafka_broker, topics.prefix)
            units = view["units"]  # each worker's snapshot arrives on its own 10 s clock
            return units.get("query", {}).get("rejected") == 1 and units.get("prompt", {}).get("accepted") == 4
        wait_for(settled, timeout=60, interval=2, what="snapshots with every decision")
    finally:
        rollout.stop()
        stages.close()
    view = stats(kafka_broker, topics.prefix)
    assert view["units"]["query"] == {"accepted": 3.0, "rejected": 1.0, "reasons": {"zero_std": 1.0}, "retention": 0.75}
    assert view["units"]["response"]["accepted"] == 16.0 and view["units"]["prompt"]["accepted"] == 4.0
    assert view["in_flight"] == {"prompts": 0.0}
    assert view["reward"] == {"all": round(5 / 16, 4), "accepted": round(5 / 12, 4)}  # p1 adds 0 of 4
    wrong = subprocess.run([sys.executable, "-m", "rollstream", "stats", "-b", kafka_broker, "--prefix", "nope."],
                           capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "does not exist" in wrong.stderr
