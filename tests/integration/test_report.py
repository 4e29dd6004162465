"""`rollstream report` from a run's topics on the real broker, rendered by headless Chromium
(Debian's `chromium`): seven plots, each drawn from data, each a non-blank image, all loaded."""

from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess
import sys

import matplotlib.image as mpimg
import pytest

from rollstream.kafka.clients import make_producer
from rollstream.schemas import encode
from rollstream.schemas.records import payload_ref
from rollstream.trainer.publisher import PolicyPublisher, version_of

from .harness import write_config

pytestmark = pytest.mark.integration


def decided(key: str, accepted: bool, reason: str, rounds: int, created_ms: int, mode: str = "train",
            version: int = 0, rewards: tuple[float, float] = (0.0, 1.0)) -> dict:
    """A Group of two responses whose Responses were never written: the report reads decisions
    only, never a payload."""
    members = [{"response": {"prompt_id": key, "domain": "math", "mode": mode, "round": 0, "sample_index": i,
                             "prompt_length": 3, "response_length": 2, "finish_reason": "stop", "policy_version": version},
                "response_level_reward": rewards[i], "payload": payload_ref("nowhere.responses", 0, i, 64)}
               for i in range(2)]
    return {"group_key": key, "prompt_id": key, "domain": "math", "mode": mode, "accepted": accepted,
            "reason": reason, "rounds": rounds, "responses_generated": 2, "created_ms": created_ms,
            "responses": members, "policy_version": version}


def record_a_run(bootstrap: str, topics) -> None:
    producer = make_producer(bootstrap)
    groups = [decided("p0", True, "accepted", 1, 1000), decided("p1", False, "zero_std", 1, 2000),
              decided("p2", True, "accepted", 2, 3500), decided("p3", False, "mean_too_low", 3, 5000),
              decided("p4", True, "accepted", 1, 6000)]
    stale_at_trainer = {**groups[0], "accepted": False, "reason": "stale"}  # on both topics: counts once
    for g in [*groups, stale_at_trainer]:
        topic = topics.groups_accepted if g["accepted"] else topics.groups_rejected
        producer.send(topic, key=g["group_key"].encode(), value=encode(g, "Group"))
    # validation rounds of versions 0 and 2 (accuracy 0.25 then 0.75) and what each version generated
    validation = [decided("v0", True, "accepted", 1, 100, "val", 0, (0.0, 0.0)),
                  decided("v1", True, "accepted", 1, 100, "val", 0, (1.0, 0.0)),
                  decided("v0#v2", True, "accepted", 1, 7000, "val", 2, (1.0, 1.0)),
                  decided("v1#v2", True, "accepted", 1, 7000, "val", 2, (1.0, 0.0))]
    for g in validation:
        producer.send(topics.groups_validation, key=g["group_key"].encode(), value=encode(g, "Group"))
    for g in groups + validation:
        for member in g["responses"]:
            producer.send(topics.responses_rewarded, key=g["group_key"].encode(), value=encode(member, "RewardedResponse"))
    for step, fill in ((0, 12.5), (1, 4.0)):
        producer.send(topics.batches, key=str(step).encode(), value=encode(
            {"step": step, "status": "complete", "target_groups": 2, "accepted_groups": 2, "fill_seconds": fill}, "Batch"))
    producer.flush()
    producer.close()
    publisher = PolicyPublisher(bootstrap, topics)
    for step, (final, token, lag) in enumerate(((0.97, 0.97, 0), (0.61, 0.84, 1))):
        entry = {
            "step": step, "fill_seconds": 10.0, "loss": 0.1, "policy_version": step + 1, "checkpoint": f"/ckpt/v{step + 1}",
            "final_mask_mean": final, "pass_rates": {"actor/train_infer_token_ratio_mask_mean@sum": token},
            "ratio_means": {"token": 1.0}, "diff_means": {"token": 0.0}, "policy_lag_max": lag, "mask_collapse": False,
            "accepted_groups": 2}
        publisher.publish_step(entry)
        publisher.publish(*version_of(entry))
    publisher.close()


def test_report_renders_in_headless_chromium_with_seven_non_empty_plots(kafka_broker, topic_factory, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Debian's chromium is needed (make test installs it)"
    topics = topic_factory()
    record_a_run(kafka_broker, topics)
    config = write_config(tmp_path, topics, 1)
    out = tmp_path / "report.html"
    proc = subprocess.run([sys.executable, "-m", "rollstream", "report", "-c", str(config), "-b", kafka_broker,
                           "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    page = out.read_text()
    assert re.findall(r'data-plot="(\w+)" data-has-data="(\w+)"', page) == [
        ("learning_plot", "true"), ("retention_over_time", "true"), ("rejection_reasons", "true"), ("rounds_per_prompt", "true"),
        ("batch_fill_times", "true"), ("mask_fractions", "true"), ("policy_lag", "true")]
    assert "<td>5</td>" in page and "<td>0.600</td>" in page  # 5 groups decided, 3 accepted
    # the learning curve's table: version, validation accuracy, training accuracy, retention, responses/accepted
    assert re.findall(r'<tr data-version="(\d+)">((?:<td>[^<]*</td>)+)</tr>', page) == [
        ("0", "<td>0</td><td>0.25</td><td>0.5</td><td>0.6</td><td>1.667</td>"),
        ("2", "<td>2</td><td>0.75</td><td>-</td><td>-</td><td>-</td>")]
    assert "7 plots, 7 with data" in proc.stdout
    elsewhere = subprocess.run([sys.executable, "-m", "rollstream", "report", "-c", str(config), "-b", kafka_broker,
                                "-o", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert elsewhere.returncode == 2 and "is a directory" in " ".join(elsewhere.stderr.split())
    for png in re.findall(r'src="data:image/png;base64,([^"]+)"', page):
        image = mpimg.imread(io.BytesIO(base64.b64decode(png)), format="png")
        assert image.shape[0] > 100 and image.shape[1] > 200 and image[..., :3].std() > 0.05  # drawn, not blank

    browser = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--virtual-time-budget=10000"]
    dom = subprocess.run([*browser, "--dump-dom", out.as_uri()], capture_output=True, text=True, timeout=120)
    assert 'data-images-loaded="7"' in dom.stdout, dom.stderr[-2000:]
    shot = tmp_path / "shot.png"
    subprocess.run([*browser, f"--screenshot={shot}", "--window-size=1000,2600", out.as_uri()],
                   capture_output=True, timeout=120, check=True)
    image = mpimg.imread(shot)
    assert image.shape[:2] == (2600, 1000) and image[..., :3].std() > 0.05
