"""`rollstream whatif` over a run recorded on the real broker (admission + aggregator workers,
synthetic rollouts): the same config re-decides every group the same way; a changed std_threshold
reports exactly the groups a brute-force recomputation finds; nothing is written to the topics."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from rollstream.app.stages import Stage
from rollstream.kafka.payloads import PayloadFetcher
from rollstream.schemas.records import is_payload_ref
from rollstream.tools.readback import read_values
from rollstream.trainer.batch import build_batch
from rollstream.trainer.intake import resolve_payloads

from .harness import SyntheticRollout, count, produce, prompt, start_stages, wait_for, write_config

pytestmark = pytest.mark.integration

REWARDS = {"p0": [1, 0, 0, 0], "p1": [0.2, 0.1, 0.1, 0.1], "p2": [0, 0, 0, 0], "p3": [0.9, 1, 1, 1],
           "p4": [1, 0, 1, 0], "p5": [0.5, 0.4, 0.5, 0.5]}


def whatif(config, bootstrap: str, tmp_path, name: str) -> dict:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, "-m", "rollstream", "whatif", "-c", str(config), "-b", bootstrap,
                           "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def test_whatif_is_deterministic_and_exact(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory(partitions=2)
    config = write_config(tmp_path, topics, 2, rollout_batch_size=3, max_running_prompts=6, max_steps=2)
    stages = start_stages(config, kafka_broker, tmp_path / "logs", Stage.admission, Stage.aggregator)
    rollout = SyntheticRollout(kafka_broker, topics, lambda pid, i, r: (float(REWARDS[pid][i]), "stop"))
    rollout.start()
    try:
        produce(kafka_broker, topics.prompts, "Prompt", [prompt(p) for p in REWARDS])
        wait_for(lambda: len(read_values(kafka_broker, topics.prompt_outcomes)) == len(REWARDS), timeout=180,
                 what="every prompt decided", stages=stages)
    finally:
        rollout.stop()
        stages.close()
    groups = read_values(kafka_broker, topics.groups_accepted) + read_values(kafka_broker, topics.groups_rejected)
    sizes = {t: count(kafka_broker, t) for t in (topics.groups_accepted, topics.groups_rejected, topics.generation_requests)}

    same = whatif(config, kafka_broker, tmp_path, "same")
    assert same["changed"] == [] and same["needs_generation"] == [] and same["actual"] == same["alternative"]
    assert same["actual"]["reasons"] == {"accepted": 5, "zero_std": 1}

    (tmp_path / "alt").mkdir()
    alt = write_config(tmp_path / "alt", topics, 2, rollout_batch_size=3, max_running_prompts=6, max_steps=2, rewards={
        "synth": {"reward_type": "gsm8k", "query_filter_config": {"type": "std_filter", "filter_args": {"std_threshold": 0.1}}}})
    changed = whatif(alt, kafka_broker, tmp_path, "alt")["changed"]
    expected = []
    for g in sorted(groups, key=lambda g: g["prompt_id"]):  # brute force over the recorded groups
        std = float(np.array([r["response_level_reward"] for r in g["responses"]] or REWARDS[g["prompt_id"]],
                             dtype=np.float32).std(ddof=1))
        keep = std > 0.1
        if keep != g["accepted"]:
            expected.append((g["prompt_id"], g["reason"], "accepted" if keep else "zero_std"))
    assert sorted((c["group_key"], c["actual"], c["alternative"]) for c in changed) == expected == [
        ("p1", "accepted", "zero_std"), ("p3", "accepted", "zero_std"), ("p5", "accepted", "zero_std")]
    # a prefix without a recorded run is an error, not a table of zeros
    nothing = subprocess.run([sys.executable, "-m", "rollstream", "whatif", "-c", str(config), "-b", kafka_broker,
                              "--prefix", "nothing-here."], capture_output=True, text=True, timeout=120)
    assert nothing.returncode == 2 and "no recorded rlvr train groups" in " ".join(nothing.stderr.split())
    # offline: the topics hold exactly what they held
    assert {t: count(kafka_broker, t) for t in sizes} == sizes

    # the recorded responses, replayed into a fresh aggregator (sandbox prefix,
    # same config), give the same split, group ids and reasons ...
    sandbox = topic_factory(partitions=2)
    replayed = subprocess.run([sys.executable, "-m", "rollstream", "replay", "responses.rewarded", "-b",
                               kafka_broker, "--prefix", topics.prefix, "--to-topic", sandbox.responses_rewarded],
                              capture_output=True, text=True, timeout=120)
    assert replayed.returncode == 0, replayed.stderr
    (tmp_path / "sandbox").mkdir()
    sandbox_config = write_config(tmp_path / "sandbox", sandbox, 2, rollout_batch_size=3, max_running_prompts=6,
                                  max_steps=2)
    fresh = start_stages(sandbox_config, kafka_broker, tmp_path / "sandbox-logs", Stage.aggregator)
    try:
        wait_for(lambda: len(read_values(kafka_broker, sandbox.prompt_outcomes)) == len(REWARDS), timeout=180,
                 what="the sandbox aggregator's decisions", stages=fresh)
    finally:
        fresh.close()
    again = read_values(kafka_broker, sandbox.groups_accepted) + read_values(kafka_broker, sandbox.groups_rejected)

    def split(gs):
        return sorted((g["group_key"], g["accepted"], g["reason"], g["decision_values"]["std"]) for g in gs)
    assert split(again) == split(groups)
    # ... and the trainer, fed the recorded accepted groups twice (their payloads fetched by
    # reference, as the trainer does), builds bit-identical batches
    accepted = [g for g in groups if g["accepted"]]
    refs = [r["payload"] for g in accepted for r in g["responses"]]
    assert refs and all(is_payload_ref(ref) for ref in refs)  # the decisions name their tokens only
    with PayloadFetcher(kafka_broker) as fetcher:
        fetched = fetcher.fetch(refs)
    assert fetched.expired == {} and len(fetched.values) == len(refs)
    accepted = [resolve_payloads(g, fetched.values) for g in accepted]
    first, second = build_batch(accepted, step=0, pad_token_id=0), build_batch(accepted, step=0, pad_token_id=0)
    for name in ("response_ids", "response_mask", "advantages", "infer_logprobs"):
        assert torch.equal(getattr(first, name), getattr(second, name)), name
