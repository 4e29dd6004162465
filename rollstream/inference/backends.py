"""The engines by name (config ``actor_infer.backend``: rollstream.extensions.BACKENDS, or a
user's class by import path), each imported only when built (the transformers engine needs torch,
the in-process vLLM engine vllm, the server client httpx), and built from the typed
``actor_infer`` config."""

from __future__ import annotations

from typing import Any

from rollstream.config.base import ActorInferConfig
from rollstream.exceptions import ConfigError
from rollstream.extensions import BACKENDS
from rollstream.inference.engine import GenerationBackend


def make_backend(name: str, **kw: Any) -> GenerationBackend:
    """Build the backend ``name`` (a ``BACKENDS`` name or an import path); ``kw`` go to its
    constructor. Raises ConfigError naming the valid backends for an unknown name, or naming
    what failed for a bad import path or a class without ``generate``."""
    return BACKENDS.get_named(name)(**kw)


def load_backend(actor_infer: ActorInferConfig, model_path: str | None, instance: int = 0,
                 instances: int = 1) -> GenerationBackend:
    """The backend ``actor_infer`` configures, for generation worker ``instance`` of
    ``instances`` (backend_kwargs). Raises ConfigError for a bad backend configuration."""
    return make_backend(actor_infer.backend, **backend_kwargs(actor_infer, model_path, instance, instances))


def backend_kwargs(actor_infer: ActorInferConfig, model_path: str | None, instance: int = 0,
                   instances: int = 1) -> dict:
    """Constructor arguments of the backend ``actor_infer`` configures, beyond its defaults: the
    generation model (``model_path``: a config's ``infer_model_path``; None = the bundled one),
    its dtype, ``max_num_seqs`` when set and, for transformers, its device (vLLM picks its own GPU). A
    user's class gets ``model_dir``, ``dtype`` (its name) and ``max_num_seqs`` (None: unset). For
    ``vllm_server``: this worker's share of ``actor_infer.servers`` (server i belongs to worker
    i mod ``instances``: each server has one worker, which alone updates its weights). Raises
    ConfigError for no servers, or fewer servers than workers."""
    if actor_infer.backend == "vllm_server":
        return _server_kwargs(actor_infer, model_path, instance, instances)
    rows = {} if actor_infer.max_num_seqs is None else {"max_num_seqs": actor_infer.max_num_seqs}
    if actor_infer.backend not in BACKENDS:  # a user's class: the vllm engine's arguments
        return {"model_dir": model_path, "dtype": actor_infer.dtype, "max_num_seqs": actor_infer.max_num_seqs}
    if actor_infer.backend == "transformers":
        import torch  # only the model stages pay for it

        return {"model_dir": model_path, "dtype": getattr(torch, actor_infer.dtype),
                "device": actor_infer.device, **rows}
    return {"model_dir": model_path, "dtype": actor_infer.dtype, **rows}  # vllm.LLM takes the name


def _server_kwargs(actor_infer: ActorInferConfig, model_path: str | None, instance: int, instances: int) -> dict:
    from rollstream.policy.model import load_tokenizer, model_folder  # transformers: only the model stages

    if len(actor_infer.servers) < instances:
        raise ConfigError(f"actor_infer.servers: {len(actor_infer.servers)} server(s) for {instances} generation "
                          "workers; each worker needs at least one server of its own (empty: `rollstream run` "
                          "starts one)")
    server = actor_infer.server
    return {"servers": actor_infer.servers[instance::instances], "tokenizer": load_tokenizer(model_path),
            "initial_weights": str(model_folder(model_path)), "max_inflight": server.max_inflight,
            "request_timeout_s": server.request_timeout_s, "retries": server.retries, "down_s": server.down_s,
            "pause_mode": server.pause_mode}
