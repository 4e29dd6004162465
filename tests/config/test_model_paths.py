"""`pretrain` / `model_args.model_name_or_path`: checked on the files when the config loads
(rollstream.config.model_paths), a local folder or a hub id in a local Hugging Face cache layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rollstream.config import parse_config
from rollstream.config.model_paths import resolve_model_path
from rollstream.exceptions import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rlvr_math.yaml"


def example(**overrides) -> dict:
    return {**yaml.safe_load(EXAMPLE.read_text()), **overrides}


def model_folder(folder: Path, *, weights=("model.safetensors",), tokenizer=True, template=True) -> Path:
    """A model folder's layout, with placeholder file contents (only names are checked)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    for name in weights:
        (folder / name).write_bytes(b"\0")
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
    if template:
        (folder / "chat_template.jinja").write_text("{{ messages }}")
    return folder


def config_error(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return str(info.value)


def test_unset_means_the_bundled_model():
    config = parse_config(example())
    assert (config.pretrain, config.infer_model_path, config.train_model_path) == (None, None, None)


def test_pretrain_names_both_roles_and_each_role_may_override(tmp_path):
    base = model_folder(tmp_path / "base")
    tuned = model_folder(tmp_path / "tuned", weights=("pytorch_model.bin",))
    config = parse_config(example(pretrain=str(base),
                                  actor_train={"model_args": {"model_name_or_path": str(tuned)}}))
    assert (config.infer_model_path, config.train_model_path) == (str(base), str(tuned))


def test_a_missing_folder_is_a_config_error_naming_the_key(tmp_path):
    missing = tmp_path / "no-such-model"
    assert config_error(example(pretrain=str(missing))) == (
        f"invalid config: pretrain: model folder '{missing}' does not exist")
    message = config_error(example(actor_infer={"model_args": {"model_name_or_path": str(missing)}}))
    assert message.startswith("invalid config: actor_infer.model_args.model_name_or_path: "
                              f"model folder '{missing}' does not exist")


def test_a_folder_without_weights_names_what_is_missing(tmp_path):
    folder = model_folder(tmp_path / "m", weights=())
    assert config_error(example(pretrain=str(folder))) == (
        f"invalid config: pretrain: model folder '{folder}' is incomplete, it lacks: weights (one of "
        "model.safetensors, pytorch_model.bin, model.safetensors.index.json, pytorch_model.bin.index.json)")


def test_a_folder_without_config_tokenizer_or_template(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(ConfigError, match=r"lacks: config.json; weights .*; a tokenizer \(one of tokenizer.json, "
                                          r"tokenizer.model, vocab.json\)$"):
        resolve_model_path(str(bare))
    no_template = model_folder(tmp_path / "nt", template=False)
    with pytest.raises(ConfigError, match=r"lacks: a chat template \(chat_template.jinja or chat_template.json, "
                                          r"or chat_template in tokenizer_config.json\)"):
        resolve_model_path(str(no_template))
    (no_template / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert resolve_model_path(str(no_template)) == no_template


def test_pytorch_model_bin_and_sharded_layouts(tmp_path):
    assert resolve_model_path(str(model_folder(tmp_path / "bin", weights=("pytorch_model.bin",)))) == tmp_path / "bin"
    sharded = model_folder(tmp_path / "sharded", weights=("model-00001-of-00002.safetensors",))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ConfigError, match=r"lacks: weight shards \['model-00002-of-00002.safetensors'\] named by "
                                          r"model.safetensors.index.json$"):
        resolve_model_path(str(sharded))
    (sharded / "model-00002-of-00002.safetensors").write_bytes(b"\0")
    assert resolve_model_path(str(sharded)) == sharded


def test_a_file_is_not_a_model_folder(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0")
    with pytest.raises(ConfigError, match="is a file; expected a Hugging Face model folder"):
        resolve_model_path(str(tmp_path / "model.safetensors"))


def test_a_hub_id_resolves_from_the_local_cache_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    repo = tmp_path / "hf" / "hub" / "models--my-org--tiny-qwen2"
    snapshot = model_folder(repo / "snapshots" / "0123abc", weights=("pytorch_model.bin",))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    assert resolve_model_path("my-org/tiny-qwen2") == snapshot
    config = parse_config(example(pretrain="my-org/tiny-qwen2"))
    assert config.infer_model_path == config.train_model_path == "my-org/tiny-qwen2"
    assert config_error(example(pretrain="my-org/not-downloaded")) == (
        "invalid config: pretrain: 'my-org/not-downloaded' is not a folder, and hub id "
        f"'my-org/not-downloaded' is not in the local Hugging Face cache {tmp_path / 'hf' / 'hub'} (rollstream never "
        "downloads: fetch it first with `hf download my-org/not-downloaded`, or give a folder)")


def test_an_incomplete_cached_snapshot_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    repo = tmp_path / "cache" / "models--org--partial"
    model_folder(repo / "snapshots" / "rev1", weights=())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("rev1")
    with pytest.raises(ConfigError, match=r"models--org--partial/snapshots/rev1' is incomplete, it lacks: weights"):
        resolve_model_path("org/partial")
