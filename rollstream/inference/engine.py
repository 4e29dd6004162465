"""What every generation engine is: the ``GenerationBackend`` protocol and its types, so the
Kafka workers (rollstream.workers.generation, the env workers) do not care which engine samples.

Every engine returns, for each sampled token, its log-probability under the *raw* model
distribution (log_softmax of the unprocessed logits, before temperature/top-p): these are the
``infer_logprobs`` the trainer compares with its own ``old_log_probs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

from rollstream.schemas.records import FINISH_ERROR


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature`` 0 means greedy; ``top_p`` in (0, 1]; ``seed`` makes a
    request reproducible (same prompt + params + seed + weights -> same tokens)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        """Raises ValueError for temperature < 0, top_p outside (0, 1] or max_new_tokens < 1."""
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class Sample:
    """One sampled response.

    ``token_ids``: generated ids, eos included when generated, no padding.
    ``logprobs``: one float (nats, <= 0) per token id, under the raw model distribution.
    ``finish_reason``: ``"stop"`` (eos sampled), ``"length"`` (max_new_tokens hit) or
    ``"error"`` (engine failed; tokens empty and ``error`` holds the message).
    ``extras``: optional per-token arrays by name (e.g. ``routed_experts``: a numpy array of
    shape ``(len(token_ids), layers, top_k)``, uint8/uint16); the first dimension is always the
    response length. They travel in ``Response.extras`` (rollstream.schemas.packed).
    ``versions``: the policy versions whose weights produced the tokens, ascending (two when
    an in-place weight update fell inside the request); empty: the backend's ``policy_version``.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    error: str | None = None
    extras: dict = field(default_factory=dict)
    versions: tuple[int, ...] = ()


@runtime_checkable
class GenerationBackend(Protocol):
    """An inference engine. ``generate`` never raises for engine failures: they come back as
    ``finish_reason="error"`` samples."""

    policy_version: int

    def generate(
        self, prompt_token_ids: list[list[int]], n: list[int], params: list[SamplingParams]
    ) -> list[list[Sample]]:
        """Sample ``n[i]`` responses of prompt ``i`` with ``params[i]``; returns one list of
        ``n[i]`` samples per prompt, in order. Raises ValueError only when the three argument
        lists differ in length."""
        ...

    def load_weights(self, path: str, version: int) -> None:
        """Swap in new policy weights from ``path`` and set ``policy_version`` to ``version``."""
        ...


def error_samples(k: int, message: str) -> list[Sample]:
    """``k`` samples of a failed request: no tokens, ``finish_reason="error"``, ``error`` set."""
    return [Sample([], [], "", FINISH_ERROR, message) for _ in range(k)]


def check_args(prompt_token_ids: Sequence, n: Sequence, params: Sequence) -> None:
    """Raises ValueError unless a ``generate`` call's three argument lists have one length."""
    if not (len(prompt_token_ids) == len(n) == len(params)):
        raise ValueError(
            f"prompt_token_ids, n and params must have equal lengths, got "
            f"{len(prompt_token_ids)}, {len(n)}, {len(params)}"
        )
