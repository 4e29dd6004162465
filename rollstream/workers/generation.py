"""The generation worker: an EventWorker handler that samples responses for GenerationRequest
events and emits one ``Response`` payload event per sample (topic ``responses``: the token
arrays, written once; everything downstream names it by a PayloadRef). The sampling itself is an
engine's (rollstream.workers.engines: transformers or vLLM behind ``GenerationBackend``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Iterable, Mapping, Sequence

from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.events import Input, Output, Send, fit, too_large_error
from rollstream.kafka.topics import Topics
from rollstream.kafka.worker import EventWorker
from rollstream.policy.model import chat_prompt_ids, load_tokenizer
from rollstream.policy.versions import PolicyFollower, PolicyVersionWatcher
from rollstream.runtime import PAYLOAD_MAX_MESSAGE_BYTES, now_ms
from rollstream.schemas.packed import packed_array
from rollstream.schemas.records import FINISH_ERROR
from rollstream.workers.engines import GenerationBackend, Sample, SamplingParams, error_samples, make_backend

log = logging.getLogger(__name__)

def pack_extras(sample: Sample) -> dict:
    """``sample.extras`` as ``Response.extras`` (name -> PackedArray record).

    Raises ValueError when an array's first dimension is not the response length or its dtype
    cannot be packed (rollstream.schemas.packed.DTYPES)."""
    out = {}
    for name, values in (getattr(sample, "extras", None) or {}).items():
        record = packed_array(values)
        if not record["shape"] or record["shape"][0] != len(sample.token_ids):
            raise ValueError(f"extras[{name!r}] has shape {tuple(record['shape'])}; its first dimension must be "
                             f"the response length {len(sample.token_ids)}")
        out[str(name)] = record
    return out


class GenerationWorker:
    """EventWorker handler: GenerationRequest inputs -> one encoded Response (a ``Send``) per
    sample.

    All requests of one poll go to the backend in a single ``generate`` call. A request whose
    prompt cannot be tokenised yields error Responses (never an exception), so downstream
    groups still complete. ``generation_ms`` is the wall time of that batched backend call.
    With a ``policy`` follower, the newest published policy version is loaded before each call,
    and every Response carries the version that produced it.

    Each Response is encoded once, here. One above ``max_message_bytes`` (``kafka.max_message_bytes``)
    is replaced by an error Response of the same ``(prompt_id, sample_index)`` (finish_reason
    ``error``, empty arrays, ``error`` starting with ``too_large:``) plus a ``too_large`` dead
    letter: the reward worker scores it NaN, the response filter rejects it ``engine_error`` and
    the aggregator asks for a replacement, so the prompt never stalls. Invalid per-token
    ``extras`` from the engine (wrong length or dtype) likewise give an error Response.
    """

    def __init__(
        self,
        backend: GenerationBackend,
        params: SamplingParams,
        topics: Topics,
        tokenizer: Any = None,
        policy: PolicyFollower | None = None,
        max_message_bytes: int = PAYLOAD_MAX_MESSAGE_BYTES,
        worker: str = "generation",
    ) -> None:
        self.backend = backend
        self.params = params
        self.topics = topics
        self.policy = policy
        self.max_message_bytes = max_message_bytes
        self.worker = worker  # names the worker in its dead letters
        self.too_large = 0  # samples replaced by a too_large error Response
        self.tokenizer = tokenizer or getattr(backend, "tokenizer", None) or load_tokenizer()

    def __call__(self, inputs: Sequence[Input]) -> list[Send | Output]:
        if self.policy is not None:
            self.policy.refresh()
        records = [inp.record for inp in inputs]
        prompt_ids: list[list[int] | None] = []
        errors: list[str | None] = []
        for rec in records:
            try:
                # a chat prompt's messages (system turn included) as given, else the text as one user turn
                prompt_ids.append(chat_prompt_ids(self.tokenizer, rec.get("messages") or rec["prompt"]))
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
        outputs: list[Send | Output] = []
        for k, rec in enumerate(records):
            if k in by_req:
                samples = by_req[k]
            else:
                samples = error_samples(max(int(rec["num_return_sequences"]), 0), errors[k] or "")
            for i, s in enumerate(samples):
                record = {
                    "prompt_id": rec["prompt_id"],
                    "domain": rec["domain"],
                    "mode": rec.get("mode", "train"),
                    "prompt": rec["prompt"],
                    "ground_truth": rec.get("ground_truth", ""),
                    "messages": list(rec.get("messages") or []),
                    "round": int(rec["round"]),
                    "sample_index": int(rec.get("sample_offset", 0)) + i,
                    "prompt_token_ids": prompt_ids[k] or [],
                    "response_token_ids": s.token_ids,
                    "infer_logprobs": s.logprobs,
                    "response_text": s.text,
                    "finish_reason": s.finish_reason,
                    "error": s.error,
                    "policy_version": version,
                    "generation_ms": gen_ms,
                    "created_ms": created,
                    "extras": {},
                }
                try:
                    record["extras"] = pack_extras(s)
                except (ValueError, TypeError) as exc:
                    log.warning("sample %s/%d: bad extras from the engine: %s", rec["prompt_id"],
                                record["sample_index"], exc)
                    record = error_response(record, f"extras: {exc}"[:2000])
                outputs += self._encoded(record)
        return outputs

    def _encoded(self, record: dict) -> list[Send | Output]:
        """The Response ``record`` encoded once; above ``max_message_bytes`` its error Response
        and the ``too_large`` dead letter instead (``rollstream.kafka.events.fit``)."""
        def stand_in(r: dict, size: int) -> dict:
            detail = (f"{len(r['response_token_ids'])} response tokens, {len(r['prompt_token_ids'])} prompt tokens, "
                      f"extras {sorted(r['extras'])}")
            return error_response(r, too_large_error("Response", size, self.max_message_bytes, detail))

        sent, outputs = fit(self.topics, self.topics.responses, record["prompt_id"], "Response", record,
                            self.max_message_bytes, self.worker, stand_in)
        if sent is not record:
            self.too_large += 1
            log.warning("Response of %s/%d is above kafka.max_message_bytes %d: sent as an error response",
                        record["prompt_id"], record["sample_index"], self.max_message_bytes)
        return outputs


def error_response(record: Mapping, error: str) -> dict:
    """``record`` (a Response) as an engine error: same identity, finish_reason ``error``, no
    tokens, text or extras, ``error`` set."""
    return {**record, "prompt_token_ids": [], "response_token_ids": [], "infer_logprobs": [],
            "response_text": "", "finish_reason": FINISH_ERROR, "error": error, "extras": {}}


def run_generation_worker(
    bootstrap: Bootstrap,
    topics: Topics,
    params: SamplingParams,
    backend: str | GenerationBackend = "transformers",
    group_id: str = "rollstream-generation",
    max_batch: int = 16,
    max_idle_s: float | None = None,
    backend_kwargs: dict[str, Any] | None = None,
    instance: int = 0,
    instances: int = 1,
    max_message_bytes: int = PAYLOAD_MAX_MESSAGE_BYTES,
    compression_type: str = "none",
    domains: Iterable[str] | None = None,
) -> EventWorker:
    """Consume ``generation.requests``, produce ``responses`` until stopped (SIGTERM/SIGINT)
    or idle for ``max_idle_s``. ``max_batch`` caps requests per poll (each may ask for many
    samples); ``instance``/``instances`` select this process's partitions (see EventWorker).
    ``max_message_bytes`` (``kafka.max_message_bytes``) bounds one Response (larger ones become
    error Responses, see GenerationWorker); ``compression_type`` (``kafka.compression_type``)
    compresses the payload producer's batches; ``domains``: the run's reward domains (a request
    of another one is dead-lettered, never generated). The worker follows ``policy.versions`` (PolicyFollower). Returns the finished EventWorker
    (its ``processed``/``dead_lettered`` counts). Raises ConfigError for an unknown backend name."""
    engine = make_backend(backend, **(backend_kwargs or {})) if isinstance(backend, str) else backend
    policy = PolicyFollower(PolicyVersionWatcher(bootstrap, topics), engine)
    handler = GenerationWorker(engine, params, topics, policy=policy, max_message_bytes=max_message_bytes)
    worker = EventWorker(
        bootstrap=bootstrap,
        topics=topics,
        input_topic=topics.generation_requests,
        group_id=group_id,
        expected_schema="GenerationRequest",
        handler=handler,
        stage="generation",
        max_batch=max_batch,
        instance=instance,
        instances=instances,
        max_message_bytes=max_message_bytes,
        compression_type=compression_type,
        domains=domains,
    )
    handler.worker = worker.worker
    worker.install_signal_handlers()
    try:
        worker.run(max_idle_s=max_idle_s)
    finally:
        policy.close()
    return worker
