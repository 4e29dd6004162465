"""A prompt's chat-templated token ids for a stage that may hold no model (admission limits each
prompt's length): the bundled model's through rollstream.policy.chat, without transformers or
torch; any other model's through transformers (rollstream.policy.model), imported only then."""

from __future__ import annotations

import functools
import os

from rollstream.config.model_paths import default_cache_dir, is_built_model_cache
from rollstream.policy.chat import PromptIds, template_tokenizer


def load_prompt_ids(model_dir: str | os.PathLike | None = None) -> PromptIds:
    """A function from a prompt (see chat_messages) to its chat-templated token ids, the same as
    rollstream.policy.model.chat_prompt_ids with that model's tokenizer. ``model_dir``: a model
    folder or a hub id in the local cache (through transformers); None: the bundled model
    (without transformers once its cache is built, see template_tokenizer). Raises ConfigError
    for a missing or incomplete folder; the transformers path raises RollstreamError for a
    tokenizer without a chat template or an eos token."""
    if model_dir is None and is_built_model_cache(folder := default_cache_dir()):
        light = template_tokenizer(folder)
        if light is not None:
            return light.prompt_ids
    from rollstream.policy.model import chat_prompt_ids, load_tokenizer  # transformers and torch

    return functools.partial(chat_prompt_ids, load_tokenizer(model_dir))
