"""Generation by a real vLLM server (the CPU build in .venv-vllm, one server per test session):
token ids and logprobs per sample, the trainer's logprobs for the same tokens, weights loaded
in place, and requests in flight across an update."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from rollstream.policy.model import load_model, model_folder
from rollstream.inference.engine import SamplingParams
from rollstream.inference.server_client import ServerBackend
from rollstream.trainer.logprobs import sequence_log_probs
from tests.inference.teacher_forcing import PROBE

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

@pytest.fixture(scope="module")
def trainer_model():
    return load_model(dtype=torch.float32, device="cpu")[1]


@pytest.fixture
def backend(vllm_server):
    backend = ServerBackend([vllm_server.url], initial_weights=str(model_folder(None)))
    try:
        yield backend
    finally:
        backend.close()


def _greedy_probe(backend: ServerBackend, tokens: int = 8):
    return backend.generate([PROBE], [1], [SamplingParams(temperature=0.0, max_new_tokens=tokens)])[0][0]


def test_samples_carry_token_ids_and_logprobs_the_trainer_recomputes(backend, trainer_model):
    prompts = [[1, 9690, 198, 2683, 314, 1401, 28, 216, 35, 1232, 216, 36, 47], PROBE]
    out = backend.generate(prompts, [4, 4], [SamplingParams(temperature=1.0, max_new_tokens=24, seed=s) for s in (1, 2)])
    diffs = []
    for prompt, row in zip(prompts, out):
        assert len(row) == 4
        for sample in row:
            assert sample.finish_reason in ("stop", "length") and sample.error is None
            assert 0 < len(sample.token_ids) == len(sample.logprobs) <= 24
            assert sample.versions == (0,)
            assert all(lp <= 0.0 for lp in sample.logprobs)
            diffs += [abs(a - b) for a, b in zip(sample.logprobs, sequence_log_probs(trainer_model, prompt, sample.token_ids))]
    diffs.sort()
    # The server computes in bfloat16 (8 mantissa bits: relative error ~0.4% per op, over 30
    # layers); the trainer in float32. Measured on SmolLM2-135M: median |diff| ~0.02 nats,
    # 95th percentile ~0.1; sampled low-probability tokens differ most. Far larger differences
    # would mean other weights or misaligned tokens (those differ by whole nats).
    assert diffs[len(diffs) // 2] < 0.08, diffs[len(diffs) // 2]
    assert diffs[int(len(diffs) * 0.95)] < 0.4, diffs[int(len(diffs) * 0.95)]


def test_weights_are_loaded_in_place_and_the_server_then_answers_with_them(backend, trainer_model, tmp_path):
    before = _greedy_probe(backend)
    changed = tmp_path / "v1"
    perturbed = load_model(dtype=torch.float32, device="cpu")[1]
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for p in perturbed.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.02)
    perturbed.save_pretrained(changed)
    backend.load_weights(str(changed), 1)
    after = _greedy_probe(backend)
    [update] = [u for u in backend.weight_updates if u.version == 1]
    assert update.mode == "keep" and update.ms > 0
    assert after.versions == (1,)
    expected = sequence_log_probs(perturbed, PROBE, after.token_ids)
    old = sequence_log_probs(trainer_model, PROBE, after.token_ids)
    # the server now agrees with the perturbed weights (bf16 tolerance) and not with the old ones
    assert max(abs(a - b) for a, b in zip(after.logprobs, expected)) < 0.3
    assert max(abs(a - b) for a, b in zip(after.logprobs, old)) > 0.3 or after.token_ids != before.token_ids
    backend.load_weights(str(model_folder(None)), 2)  # back to the initial weights for the next tests
    assert _greedy_probe(backend).token_ids == before.token_ids


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_a_request_in_flight_across_an_update_records_the_right_versions(vllm_server, mode):
    backend = ServerBackend([vllm_server.url], initial_weights=str(model_folder(None)), pause_mode=mode)
    try:
        backend.generate([PROBE], [1], [SamplingParams(max_new_tokens=1)])  # in rotation
        version = backend.policy_version + 1
        result = {}
        # One request of 8 sequences: the engine admits them in one step, so every one runs from
        # the first gauge reading that shows 8 until its 300th token, seconds later. (Four requests
        # of 2 reached the engine one by one on a loaded machine: the window with all 8 running
        # could close before the update began.)
        long = threading.Thread(target=lambda: result.setdefault("out", backend.generate(
            [PROBE], [8], [SamplingParams(temperature=1.0, max_new_tokens=300, seed=7)])))
        long.start()
        deadline = time.monotonic() + 120
        while (running := _running(vllm_server.url)) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)  # the server's own gauge: every sequence is in its engine, generating
        assert running == 8
        backend.load_weights(str(model_folder(None)), version)
        long.join(600)
        samples = [s for row in result["out"] for s in row]
    finally:
        backend.close()
    assert len(samples) == 8 and all(s.finish_reason in ("stop", "length") for s in samples)
    versions = {s.versions for s in samples}
    if mode == "keep":  # frozen, then continued by the new weights
        assert versions == {(version - 1, version)}
    else:  # cancelled and sent again: wholly the new weights'
        assert versions == {(version,)}


def _running(url: str) -> float:
    """Sequences the server's engine is running now (its Prometheus gauge)."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
