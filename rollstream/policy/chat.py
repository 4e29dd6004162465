"""Chat prompts as token ids, for the bundled model without transformers or torch.

A stage that holds no model (admission limits each prompt's length) still needs a prompt's
token ids exactly as the generation stage makes them. Importing transformers' tokenizer costs
~18 CPU-s per process start on 2 cores (it pulls in torch and its compiler stack), so for the
bundled model this module renders the folder's chat template with jinja2, in the environment
transformers renders it in (sandboxed, ``trim_blocks``, ``lstrip_blocks``, loop controls, a
``tojson`` that leaves HTML characters alone, ``raise_exception``, ``strftime_now``; the special
tokens and ``add_generation_prompt=True`` as variables), and encodes the text with the folder's
``tokenizer.json`` through the ``tokenizers`` library, no special tokens added.

That equals transformers' ``apply_chat_template`` only where transformers uses ``tokenizer.json``
as it is, and which tokenizer class transformers picks depends on the model type and its own
lists (for a Qwen2 folder it rebuilds the pre-tokenizer, whatever tokenizer_config.json says).
So a user's model always goes through transformers; the bundled model's cache, built by
rollstream, takes this path (tested token-for-token against transformers).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment


Prompt = str | Sequence[Mapping[str, str]]
PromptIds = Callable[[Prompt], list[int]]

BUNDLED_EOS = "<|im_end|>"  # the bundled SmolLM2's eos and pad (its GGUF metadata says otherwise)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# The tokenizer classes transformers builds straight from tokenizer.json (the bundled cache's).
PLAIN_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def chat_messages(prompt: Prompt) -> list[dict[str, str]]:
    """``prompt`` as chat messages: a string is one user turn (no system message is added; the
    template may add its own default one); a sequence of ``{"role", "content"}`` mappings is
    taken as given (values made strings). Raises ValueError for an empty message list."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    if not messages:
        raise ValueError("empty chat message list")
    return messages


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """``source`` compiled in the chat-template environment (module doc). Raises
    jinja2.TemplateSyntaxError, e.g. for a ``{% generation %}`` block (a transformers extension)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


@dataclass(frozen=True)
class TemplateTokenizer:
    """A model folder's chat template and ``tokenizer.json``, no transformers involved.

    ``special_tokens``: the template variables ``bos_token``, ``eos_token``, ... (strings), eos
    and pad as rollstream sets them up (rollstream.policy.model.load_tokenizer)."""

    tokenizer: tokenizers.Tokenizer
    template: jinja2.Template
    special_tokens: Mapping[str, str]

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Token ids of ``prompt`` (see chat_messages), chat template applied, ending with the
        assistant generation prompt. Raises ValueError for an empty message list,
        jinja2.TemplateError when the template refuses the messages."""
        text = self.template.render(messages=chat_messages(prompt), tools=None, documents=None,
                                    add_generation_prompt=True, **self.special_tokens)
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def _template_source(folder: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    in_config = tokenizer_config.get("chat_template")
    jinja_file = folder / "chat_template.jinja"
    if (folder / "chat_template.json").exists() or (folder / "additional_chat_templates").exists():
        return None
    if jinja_file.is_file():
        return None if in_config else jinja_file.read_text(encoding="utf-8")
    return in_config if isinstance(in_config, str) and in_config else None


def template_tokenizer(folder: Path) -> TemplateTokenizer | None:
    """The TemplateTokenizer of the bundled model's cache ``folder`` (eos and pad
    ``<|im_end|>``), or None when only transformers gives the right ids: no ``tokenizer.json``
    or ``tokenizer_config.json``; a tokenizer class other than the plain fast one
    (PLAIN_TOKENIZER_CLASSES); a ``special_tokens_map.json`` (merged by rules of its own); not
    exactly one chat template; a template this environment cannot compile."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if (not isinstance(config, dict) or config.get("tokenizer_class") not in PLAIN_TOKENIZER_CLASSES
            or not (folder / "tokenizer.json").is_file() or (folder / "special_tokens_map.json").exists()):
        return None
    source = _template_source(folder, config)
    if source is None:
        return None
    try:
        template = compile_chat_template(source)
    except jinja2.TemplateError:
        return None
    special = {k: config[k] for k in SPECIAL_TOKENS if isinstance(config.get(k), str)}
    special["eos_token"] = special["pad_token"] = BUNDLED_EOS
    return TemplateTokenizer(tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")), template, special)
