"""Prompt ids without transformers (rollstream.policy.chat): token-for-token what transformers'
chat template gives, for the bundled model and templates that use every template variable;
transformers for a user's model and for folders the light path cannot match; and the stages
that hold no model import neither transformers nor torch."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollstream.policy.chat import TemplateTokenizer, template_tokenizer
from rollstream.policy.prompt_ids import load_prompt_ids
from rollstream.policy.model import chat_prompt_ids, ensure_model_cache, load_tokenizer
from tests.tiny_models import build_tiny_qwen2

PROMPTS = [
    "What is 2+3?",
    "",
    "  leading and trailing spaces \n\n",
    "Ünïcödé: 日本語, emoji 🎲, arabic مرحبا",
    "a prompt that names <|im_end|> and <|im_start|>user inside its text",
    "\t tabs\tand\r\nwindows newlines",
    "x" * 3000,
    [{"role": "user", "content": "6 * 7?"}],
    [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "6 * 7?"},
     {"role": "assistant", "content": "42"}, {"role": "user", "content": "and 6 * 8?"}],
]

# Every variable and helper the template environment offers, and a branch on each special token.
RICH_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
    "{% if loop.index > 9 %}{% break %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}{{ {'pad': pad_token, 'unk': unk_token, 'html': '<b>&</b>'} | tojson }}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def bundled() -> Path:
    return ensure_model_cache()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny-qwen2")


def variant(tmp_path: Path, source: Path, template: str | None = None, config: dict | None = None,
            files: dict[str, str] | None = None) -> Path:
    """A model folder that links ``source``'s files, with its chat template, tokenizer config
    keys and other files replaced."""
    folder = tmp_path / "variant"
    folder.mkdir()
    for f in source.iterdir():
        if f.name not in ("tokenizer_config.json", "chat_template.jinja"):
            (folder / f.name).symlink_to(f)
    tokenizer_config = {**json.loads((source / "tokenizer_config.json").read_text()), **(config or {})}
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in tokenizer_config.items() if v is not None}))
    (folder / "chat_template.jinja").write_text(template or (source / "chat_template.jinja").read_text())
    for name, text in (files or {}).items():
        (folder / name).write_text(text)
    return folder


def transformers_ids(model_dir: Path | None) -> list[list[int]]:
    tokenizer = load_tokenizer(model_dir)
    return [chat_prompt_ids(tokenizer, p) for p in PROMPTS]


def light_ids(model_dir: Path | None) -> list[list[int]]:
    prompt_ids = load_prompt_ids(model_dir)
    assert isinstance(getattr(prompt_ids, "__self__", None), TemplateTokenizer), "the light path was not taken"
    return [prompt_ids(p) for p in PROMPTS]


def test_the_bundled_models_prompt_ids_match_transformers(bundled):
    ids = light_ids(None)
    assert ids == transformers_ids(None)
    assert ids[0][-4:] == [1, 520, 9531, 198]  # ... <|im_start|> assistant \n
    assert len(ids[6]) > 375  # the long prompt is encoded whole


def test_a_user_models_prompt_ids_come_from_transformers(tiny):
    # transformers picks a Qwen2 folder's tokenizer class by model type and rebuilds its
    # pre-tokenizer: the light path would split "\n  leading" differently.
    prompt_ids = load_prompt_ids(tiny)
    assert isinstance(prompt_ids, functools.partial) and prompt_ids.func is chat_prompt_ids
    assert [prompt_ids(p) for p in PROMPTS] == transformers_ids(tiny)


def test_every_template_variable_matches_transformers(bundled, tmp_path):
    folder = variant(tmp_path, bundled, template=RICH_TEMPLATE, config={"unk_token": "<|endoftext|>"})
    light = template_tokenizer(folder)
    assert light is not None
    assert light.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                                    "unk_token": "<|endoftext|>"}
    ids = [light.prompt_ids(p) for p in PROMPTS]
    assert ids == transformers_ids(folder)
    text = load_tokenizer(folder).decode(ids[0])
    assert text.startswith("<|im_start|><|im_start|>user\nWhat is 2+3?<|im_end|>\n")
    assert '"html": "<b>&</b>"' in text  # tojson leaves HTML characters alone, as transformers' does


def test_a_template_that_raises_raises_the_same(bundled, tmp_path):
    light = template_tokenizer(variant(tmp_path, bundled, template=RICH_TEMPLATE))
    with pytest.raises(Exception, match="no tools"):
        light.prompt_ids([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="empty chat message list"):
        light.prompt_ids([])


@pytest.mark.parametrize("change", [
    {"config": {"tokenizer_class": "Qwen2Tokenizer"}},  # transformers rebuilds it its own way
    {"files": {"special_tokens_map.json": json.dumps({"eos_token": "<|im_start|>"})}},
    {"template": "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"},
    {"config": {"chat_template": "{{ messages[0]['content'] }}"}},  # a second template, besides the file
    {"files": {"chat_template.json": json.dumps({"chat_template": "x"})}},
])
def test_folders_the_light_path_cannot_match_are_declined(bundled, tmp_path, change):
    assert template_tokenizer(variant(tmp_path, bundled, **change)) is None


def test_a_folder_without_tokenizer_json_is_declined(tmp_path, bundled):
    folder = variant(tmp_path, bundled)
    (folder / "tokenizer.json").unlink()
    assert template_tokenizer(folder) is None


MODEL_FREE_STAGES = ["rollstream.streams.admission_agent", "rollstream.streams.aggregator_agent", "rollstream.streams.group_queue_agent",
                     "rollstream.workers.rewards", "rollstream.app.stages", "rollstream.observability.metrics",
                     "rollstream.kafka.event_worker", "rollstream.app.run"]  # run: the broker starts before torch loads


def test_the_stages_that_hold_no_model_import_neither_transformers_nor_torch(bundled):
    # ~25 CPU-s per process start on 2 cores; the admission stage tokenises prompts all the same.
    # (The aggregator and group queue load torch when their app is built, for their filters.)
    code = ("import sys\n" + "".join(f"import {m}\n" for m in MODEL_FREE_STAGES)
            + "from rollstream.streams.admission_agent import default_tokenize\n"
            + "assert default_tokenize(None)({'prompt': '2+3?'})[-4:] == [1, 520, 9531, 198]\n"
            + "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_trainer_that_trains_no_model_imports_no_model_code():
    # `rollstream worker trainer` with actor_train.enabled false batches, commits and publishes
    # with torch alone: transformers costs ~10 CPU-s per start
    code = "import sys, rollstream.trainer.driver\nprint('transformers' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_before_the_bundled_cache_is_built_the_ids_come_from_the_gguf_through_transformers(tmp_path, monkeypatch):
    expected = light_ids(None)
    monkeypatch.setenv("ROLLSTREAM_MODEL_CACHE", str(tmp_path / "not-built-yet"))
    prompt_ids = load_prompt_ids(None)
    assert isinstance(prompt_ids, functools.partial) and prompt_ids.func is chat_prompt_ids
    assert [prompt_ids(p) for p in PROMPTS] == expected
    assert not (tmp_path / "not-built-yet").exists()  # reading the GGUF builds nothing
