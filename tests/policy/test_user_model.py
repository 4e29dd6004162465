"""A user's own model (a tiny random-weights Qwen2, tests/tiny_models.py) through the model
loading, the generation engine and the trainer: eos/pad from the model, `pytorch_model.bin`
folders, hub ids from the local cache, different train/infer dtypes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoTokenizer

from rollstream.config import parse_config
from rollstream.exceptions import ConfigError, RollstreamError
from rollstream.policy import model as model_mod
from rollstream.policy.model import (
    chat_prompt_ids,
    chat_turn_ids,
    ensure_model_cache,
    load_model,
    load_tokenizer,
    resolve_device,
)
from rollstream.trainer.checkpoint import CheckpointStore
from rollstream.trainer.policy_trainer import PolicyTrainer
from rollstream.inference.engine import SamplingParams
from rollstream.inference.transformers_engine import TransformersBackend
from tests.tiny_models import TINY_EOS, TINY_EOS_ID, build_tiny_qwen2

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rlvr_math.yaml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny-qwen2")


@pytest.fixture(scope="module")
def tiny_bin(tmp_path_factory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny-qwen2-bin", weights="bin")


def test_eos_and_pad_come_from_the_model(tiny):
    tok, model = load_model(model_dir=tiny)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    # the tokenizer's eos (not the bundled <|im_end|> fix); no pad token -> pad = eos
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == (TINY_EOS, 0, TINY_EOS, 0)
    assert tok.padding_side == "left"
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (0, 0)
    bundled = load_tokenizer()
    assert (bundled.eos_token, bundled.pad_token) == ("<|im_end|>", "<|im_end|>")


def test_eos_falls_back_to_the_generation_config(tiny):
    tok = AutoTokenizer.from_pretrained(tiny)
    tok.eos_token = None
    generation = json.loads((tiny / "generation_config.json").read_text())
    assert generation["eos_token_id"] == TINY_EOS_ID
    fixed = model_mod._model_tokenizer(tok, tiny)
    assert (fixed.eos_token_id, fixed.pad_token_id) == (TINY_EOS_ID, TINY_EOS_ID)


def test_a_pytorch_model_bin_folder_loads_and_is_never_built_into(tiny_bin, monkeypatch):
    assert sorted(p.name for p in tiny_bin.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "pytorch_model.bin", "tokenizer.json",
        "tokenizer_config.json"]
    tok, model = load_model(model_dir=tiny_bin)
    assert type(model).__name__ == "Qwen2ForCausalLM" and tok.eos_token_id == TINY_EOS_ID
    # the old way (ROLLSTREAM_MODEL_CACHE at a user folder) used to die building SmolLM2 there
    # with `OSError: Directory not empty`; now it says what to do and leaves the folder alone
    before = sorted(p.name for p in tiny_bin.iterdir())
    monkeypatch.setenv("ROLLSTREAM_MODEL_CACHE", str(tiny_bin))
    with pytest.raises(ConfigError, match="is not the bundled model's cache .* give your own model as `pretrain`"):
        load_model()
    assert sorted(p.name for p in tiny_bin.iterdir()) == before


def test_a_folder_without_weights_fails_to_load(tmp_path, tiny):
    folder = tmp_path / "no-weights"
    shutil.copytree(tiny, folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"is incomplete, it lacks: weights"):
        load_model(model_dir=folder)
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_tokenizer(tmp_path / "missing")


def test_a_hub_id_loads_from_the_local_cache(tmp_path, tiny_bin, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    repo = tmp_path / "hf" / "hub" / "models--someone--tiny-qwen2"
    shutil.copytree(tiny_bin, repo / "snapshots" / "5e1f00d")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("5e1f00d")
    tok, model = load_model(model_dir="someone/tiny-qwen2")
    assert type(model).__name__ == "Qwen2ForCausalLM" and tok.eos_token_id == TINY_EOS_ID


def test_chat_messages_with_a_system_turn(tiny):
    tok = load_tokenizer(tiny)
    messages = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "2+3?"}]
    assert tok.decode(chat_prompt_ids(tok, messages)) == (
        "<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(chat_prompt_ids(tok, "2+3?")).endswith("<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="empty chat message list"):
        chat_prompt_ids(tok, [])
    tok.chat_template = None
    with pytest.raises(RollstreamError, match="has no chat template"):
        chat_prompt_ids(tok, "2+3?")


def test_chat_turn_ids_needs_a_template_that_ends_turns_with_eos(tiny):
    # the tiny model's eos (<|endoftext|>) is not what its template closes a turn with
    with pytest.raises(RollstreamError, match="does not end an assistant turn with the eos token '<|endoftext|>'"):
        chat_turn_ids(load_tokenizer(tiny), "next")


def test_resolve_device():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="expected one of auto, cpu, cuda"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device is available"):
            resolve_device("cuda")


def test_generation_stops_on_the_models_eos(tiny):
    backend = TransformersBackend(model_dir=tiny, device="auto", max_num_seqs=8)
    assert (backend.eos_id, backend.pad_id) == (TINY_EOS_ID, TINY_EOS_ID)
    prompt = chat_prompt_ids(backend.tokenizer, "What is 2+3?")
    samples = backend.generate([prompt], [8], [SamplingParams(max_new_tokens=8, seed=3)])[0]
    assert len(samples) == 8
    for s in samples:
        assert (s.finish_reason == "stop") == (s.token_ids[-1] == TINY_EOS_ID)
        assert TINY_EOS_ID not in s.token_ids[:-1] and len(s.token_ids) <= 8
        assert all(0 <= t < 49152 for t in s.token_ids) and len(s.logprobs) == len(s.token_ids)
    assert any(s.finish_reason == "stop" for s in samples)  # eos has p = 0.5 per step


def test_trainer_from_config_uses_the_train_model_dtype_and_device(tmp_path, tiny, tiny_bin):
    data = {**yaml.safe_load(EXAMPLE.read_text()), "pretrain": str(tiny),
            "actor_train": {"model_args": {"model_name_or_path": str(tiny_bin)}, "dtype": "bfloat16", "device": "cpu"}}
    config = parse_config(data)
    store = CheckpointStore(tmp_path / "checkpoints")
    trainer = PolicyTrainer.from_config(config, store)
    assert type(trainer.model).__name__ == "Qwen2ForCausalLM"
    param = next(trainer.model.parameters())
    assert (param.dtype, param.device.type) == (torch.bfloat16, "cpu")
    assert trainer.settings.lr == config.actor_train.lr and trainer.tokenizer.eos_token_id == TINY_EOS_ID
    # the fp32 generation engine loads the bf16 trainer's policy version (cast to its dtype)
    with torch.no_grad():
        trainer.model.model.norm.weight.fill_(0.5)
    path = store.save(1, trainer.model, None, {"version": 1, "step": 0, "group_keys": [], "report": {}},
                      tokenizer=trainer.tokenizer)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    backend = TransformersBackend(model_dir=config.infer_model_path, device="cpu")
    backend.load_weights(str(path), 1)
    norm = backend.model.model.norm.weight
    assert norm.dtype == torch.float32 and torch.equal(norm, torch.full_like(norm, 0.5))
    assert backend.policy_version == 1


def test_the_bundled_cache_folder_is_a_model_folder_too():
    tok, model = load_model(model_dir=ensure_model_cache())
    assert (tok.eos_token, tok.pad_token, type(model).__name__) == ("<|im_end|>", "<|im_end|>", "LlamaForCausalLM")
