"""The generation worker: an EventWorker handler that samples responses for GenerationRequest
events and emits one Response per sample. The sampling itself is an engine's
(rollstream.workers.engines: transformers or vLLM behind ``GenerationBackend``).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Sequence

from rollstream.kafka.events import Input, Output
from rollstream.kafka.topics import Topics
from rollstream.kafka.worker import EventWorker
from rollstream.policy.model import chat_prompt_ids, load_tokenizer
from rollstream.policy.versions import PolicyFollower, PolicyVersionWatcher
from rollstream.runtime import now_ms
from rollstream.workers.engines import GenerationBackend, SamplingParams, error_samples, make_backend


class GenerationWorker:
    """EventWorker handler: GenerationRequest inputs -> one Response output per sample.

    All requests of one poll go to the backend in a single ``generate`` call. A request whose
    prompt cannot be tokenised yields error Responses (never an exception), so downstream
    groups still complete. ``generation_ms`` is the wall time of that batched backend call.
    With a ``policy`` follower, the newest published policy version is loaded before each call,
    and every Response carries the version that produced it.
    """

    def __init__(
        self,
        backend: GenerationBackend,
        params: SamplingParams,
        topics: Topics,
        tokenizer: Any = None,
        policy: PolicyFollower | None = None,
    ) -> None:
        self.backend = backend
        self.params = params
        self.topics = topics
        self.policy = policy
        self.tokenizer = tokenizer or getattr(backend, "tokenizer", None) or load_tokenizer()

    def __call__(self, inputs: Sequence[Input]) -> list[Output]:
        if self.policy is not None:
            self.policy.refresh()
        records = [inp.record for inp in inputs]
        prompt_ids: list[list[int] | None] = []
        errors: list[str | None] = []
        for rec in records:
            try:
                prompt_ids.append(chat_prompt_ids(self.tokenizer, rec["prompt"]))
                errors.append(None)
            except Exception as exc:
                prompt_ids.append(None)
                errors.append(f"tokenize: {type(exc).__name__}: {exc}"[:2000])
        live = [k for k, ids in enumerate(prompt_ids) if ids is not None and records[k]["num_return_sequences"] > 0]
        t0 = time.perf_counter()
        samples_live = self.backend.generate(
            [prompt_ids[k] for k in live],
            [int(records[k]["num_return_sequences"]) for k in live],
            [replace(self.params, seed=int(records[k]["seed"])) for k in live],
        ) if live else []
        gen_ms = (time.perf_counter() - t0) * 1000.0
        by_req = dict(zip(live, samples_live))
        version = int(self.backend.policy_version)
        created = now_ms()
        outputs: list[Output] = []
        for k, rec in enumerate(records):
            if k in by_req:
                samples = by_req[k]
            else:
                samples = error_samples(max(int(rec["num_return_sequences"]), 0), errors[k] or "")
            for i, s in enumerate(samples):
                outputs.append(
                    Output(
                        topic=self.topics.responses,
                        key=rec["prompt_id"],
                        schema="Response",
                        record={
                            "prompt_id": rec["prompt_id"],
                            "domain": rec["domain"],
                            "mode": rec.get("mode", "train"),
                            "prompt": rec["prompt"],
                            "ground_truth": rec.get("ground_truth", ""),
                            "round": int(rec["round"]),
                            "sample_index": int(rec.get("sample_offset", 0)) + i,
                            "prompt_token_ids": list(prompt_ids[k] or []),
                            "response_token_ids": list(s.token_ids),
                            "infer_logprobs": list(s.logprobs),
                            "response_text": s.text,
                            "finish_reason": s.finish_reason,
                            "error": s.error,
                            "policy_version": version,
                            "generation_ms": gen_ms,
                            "created_ms": created,
                        },
                    )
                )
        return outputs


def run_generation_worker(
    bootstrap: str,
    topics: Topics,
    params: SamplingParams,
    backend: str | GenerationBackend = "transformers",
    group_id: str = "rollstream-generation",
    max_batch: int = 16,
    max_idle_s: float | None = None,
    backend_kwargs: dict[str, Any] | None = None,
    instance: int = 0,
    instances: int = 1,
) -> EventWorker:
    """Consume ``generation.requests``, produce ``responses`` until stopped (SIGTERM/SIGINT)
    or idle for ``max_idle_s``. ``max_batch`` caps requests per poll (each may ask for many
    samples); ``instance``/``instances`` select this process's partitions (see EventWorker).
    The worker follows ``policy.versions`` (PolicyFollower). Returns the finished EventWorker
    (its ``processed``/``dead_lettered`` counts). Raises ConfigError for an unknown backend name."""
    engine = make_backend(backend, **(backend_kwargs or {})) if isinstance(backend, str) else backend
    policy = PolicyFollower(PolicyVersionWatcher(bootstrap, topics), engine)
    worker = EventWorker(
        bootstrap=bootstrap,
        topics=topics,
        input_topic=topics.generation_requests,
        group_id=group_id,
        expected_schema="GenerationRequest",
        handler=GenerationWorker(engine, params, topics, policy=policy),
        stage="generation",
        max_batch=max_batch,
        instance=instance,
        instances=instances,
    )
    worker.install_signal_handlers()
    try:
        worker.run(max_idle_s=max_idle_s)
    finally:
        policy.close()
    return worker
