"""A disk that fills up mid-run: `rollstream run` (its embedded broker on a 256 MiB filesystem of
its own) ends `disk_full` naming the largest topics while Kafka can still write, and nothing
accepted is lost: on a broker restarted over the same data, the audit passes and every accepted
group is trained or still waits on groups.accepted."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from rollstream.app.run import run_pipeline
from rollstream.config import parse_config
from rollstream.kafka.broker import EmbeddedBroker
from rollstream.kafka.topics import Topics
from rollstream.tools.audit import run_audit
from tests.tiny_models import build_tiny_qwen2

from .test_user_model import own_config

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

DISK_MB, RESERVE_MB, LEFT_MB = 256, 64, 48


@pytest.fixture
def small_disk(tmp_path):
    """A 256 MiB tmpfs at ``tmp_path/disk`` (mounting needs root: skipped without it)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill_after_first_batch(run_dir: Path, filler: Path, timeout_s: float = 300) -> threading.Thread:
    """Once the trainer has committed its first batch, fill the disk to ``LEFT_MB`` free."""
    def fill() -> None:
        manifest, deadline = run_dir / "batches.jsonl", time.monotonic() + timeout_s
        while time.monotonic() < deadline and not (manifest.exists() and manifest.read_text().strip()):
            time.sleep(0.2)
        free = os.statvfs(filler.parent).f_bavail * os.statvfs(filler.parent).f_frsize
        with open(filler, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, free - LEFT_MB * 2**20)

    thread = threading.Thread(target=fill, daemon=True)
    thread.start()
    return thread


def test_a_full_disk_ends_the_run_disk_full_naming_the_topics_and_loses_nothing_accepted(small_disk, tmp_path):
    model_dir = build_tiny_qwen2(tmp_path / "tiny")
    prefix = f"e2e-disk-{uuid.uuid4().hex[:8]}."
    raw = own_config("unused", model_dir, prefix)
    raw["kafka"] = {"topic_prefix": prefix, "partitions": 1, "disk_reserve_mb": RESERVE_MB}  # the embedded broker
    raw.update(max_steps=40, time_limit_s=600)
    raw["datasets"][0]["num_samples"] = 40
    run_dir = small_disk / "runs" / "disk-full"
    filler = small_disk / "filler"
    thread = fill_after_first_batch(run_dir, filler)

    summary = run_pipeline(parse_config(raw), run_dir=run_dir)
    thread.join()

    assert summary["outcome"] == "disk_full", summary
    assert summary["detail"].startswith(f"the embedded broker's disk ({(run_dir / 'kafka').resolve()}) has "), \
        summary["detail"]
    assert f"below kafka.disk_reserve_mb {RESERVE_MB}; largest topics: " in summary["detail"]
    assert 1 <= len(summary["batches"]) < 40
    filler.unlink()
    broker = EmbeddedBroker(run_dir / "kafka")  # the run's own data, served again
    bootstrap = broker.start(timeout=120)
    try:
        report = run_audit(bootstrap, Topics(prefix), False, run_dir / "batches.jsonl")
    finally:
        broker.stop()
    assert report.ok, report.to_json()
    counts = report.counts
    assert counts["groups_trained"] == sum(b["groups"] for b in summary["batches"])
    assert counts["groups_accepted"] == counts["groups_trained"] + counts["groups_pending_training"]
