"""Generation by inference servers over HTTP (``actor_infer.backend: vllm_server``).

The contract is vLLM's OpenAI-compatible completions API: prompt token ids in; sampled token
ids, one raw log-probability per token and a finish reason out. New policy weights are loaded
into the live servers in place (vLLM's dev endpoints ``/pause``, ``/collective_rpc
reload_weights``, ``/update_weight_version``, ``/resume``), never by restarting them.

``ServerBackend`` is a ``GenerationBackend``: the generation worker hands it each poll's requests
(``submit``, without waiting for the previous poll's) and it keeps them in flight across its
servers, so each server batches continuously. It runs its own asyncio loop in a thread.

Routing: a request goes to the server with the fewest sequences in flight among those in
rotation with room (``max_inflight`` sequences each); when none has room it waits. A server that
refuses connections leaves the rotation for ``down_s`` (doubled at each failure in a row, at most
60 s) and is probed again after; one that comes back, restarted or not, first loads the newest
weights (its ``/weight_info`` tells), then serves. Requests are retried on another server after a
connection error, a 5xx or an abort, ``retries`` times, then become error samples that name the
server and the cause: the prompt is replaced downstream, never hung and never rewarded 0.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import httpx

from rollstream.exceptions import RollstreamError
from rollstream.schemas.records import FINISH_LENGTH, FINISH_STOP
from rollstream.inference.engine import Sample, SamplingParams, check_args, error_samples
from rollstream.inference.vllm_extension import WORKER_EXTENSION

log = logging.getLogger(__name__)

PauseMode = Literal["keep", "abort", "wait"]
MAX_DOWN_S = 60.0


class ServerError(RollstreamError):
    """A server answered, but not with a usable completion (HTTP error, malformed body, no
    logprobs). ``retry``: whether another try (here or on another server) may succeed."""

    def __init__(self, message: str, retry: bool = False) -> None:
        super().__init__(message)
        self.retry = retry


class WeightUpdateError(RollstreamError):
    """A server could not load a policy version (unreadable checkpoint, dead server)."""


# -- the wire format (pure) -------------------------------------------------------------------


def completion_request(model: str, prompt_token_ids: Sequence[int], n: int, params: SamplingParams) -> dict:
    """The ``/v1/completions`` body sampling ``n`` responses of one tokenised prompt.

    ``logprobs: 0`` asks for the sampled token's log-probability only (vLLM's default logprobs
    mode is the raw model distribution, as TransformersBackend reports); ``return_token_ids``
    returns the ids themselves. Temperature 0 is greedy. Generation stops at the model's eos or
    after ``max_new_tokens``."""
    return {
        "model": model,
        "prompt": [int(t) for t in prompt_token_ids],
        "n": int(n),
        "max_tokens": int(params.max_new_tokens),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "seed": int(params.seed),
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }


def _token_ids(choice: dict) -> list[int]:
    ids = choice.get("token_ids")
    if ids is not None:
        return [int(t) for t in ids]
    # A server without return_token_ids still names each token "token_id:N" in the logprobs.
    tokens = (choice.get("logprobs") or {}).get("tokens") or []
    try:
        return [int(str(t).removeprefix("token_id:")) for t in tokens]
    except ValueError:
        raise ServerError(f"token {tokens[:3]}... is not a token id (return_tokens_as_token_ids ignored)") from None


def parse_completion(body: Any, n: int) -> list[Sample]:
    """The ``n`` samples of a ``/v1/completions`` response body, in choice order.

    Returns Samples with ``finish_reason`` ``stop`` or ``length``. Raises ServerError for a
    body that is not a completion of ``n`` choices, a choice without one logprob per token, a
    value of the wrong type, or a finish reason other than stop/length (``abort``: retryable,
    the server was paused or the request cancelled)."""
    try:
        return _parse_completion(body, n)
    except (TypeError, ValueError, AttributeError) as exc:  # a field of the wrong type or shape
        raise ServerError(f"malformed completion: {type(exc).__name__}: {exc}"[:500]) from None


def _parse_completion(body: Any, n: int) -> list[Sample]:
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        raise ServerError(f"not a completion response: {str(body)[:200]}")
    if len(body["choices"]) != n or not all(isinstance(c, dict) for c in body["choices"]):
        raise ServerError(f"expected {n} choices, got {len(body['choices'])}")
    samples = []
    for choice in sorted(body["choices"], key=lambda c: int(c.get("index", 0))):
        reason = choice.get("finish_reason")
        if reason == "abort":
            raise ServerError("the request was aborted (server paused or restarting)", retry=True)
        if reason not in (FINISH_STOP, FINISH_LENGTH):
            raise ServerError(f"finish_reason {reason!r}")
        ids = _token_ids(choice)
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if logprobs is None:
            raise ServerError("the response has no logprobs (the server ignored logprobs: 0)")
        if len(logprobs) != len(ids) or any(lp is None for lp in logprobs):
            raise ServerError(f"{len(ids)} tokens but {len(logprobs)} logprobs")
        values = [float(lp) for lp in logprobs]
        if any(math.isnan(v) or v > 1e-3 for v in values):
            raise ServerError("a logprob is NaN or positive")
        samples.append(Sample(ids, values, str(choice.get("text") or ""), reason))
    return samples


# -- servers ------------------------------------------------------------------------------


@dataclass
class Server:
    """One inference server as the pool sees it. ``version``: the policy version its weights
    are at (None: unknown, checked before it serves); ``inflight``: sequences sent and not yet
    answered; ``down_until``: monotonic time it stays out of rotation until."""

    url: str
    version: int | None = None
    inflight: int = 0
    down_until: float = 0.0
    failures: int = 0
    updating: bool = False
    stale: bool = False  # an update failed part-way: reload before serving, whatever it reports
    extension: bool | None = None  # has rollstream's worker extension (None: not asked yet)
    served: int = 0  # sequences answered
    errors: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightUpdate:
    """One in-place weight load: ``ms`` from the pause to the resume (reload included)."""

    version: int
    server: str
    ms: float
    mode: str


class ServerBackend:
    """A ``GenerationBackend`` over one or more inference servers (module doc).

    Args:
        servers: base URLs (``http://host:port``), at least one.
        model: the model name the servers serve (None: asked from the first server's
            ``/v1/models``); a server that does not serve it answers 404, an error sample.
        tokenizer: the model's tokenizer (the workers template chat prompts with it).
        initial_weights: what version 0 is (the model folder the servers started from); a
            server that lost its weights reloads it.
        max_inflight: sequences in flight per server at most.
        request_timeout_s: one HTTP request's limit (a completion of ``n`` samples).
        retries: further tries of a request after a retryable failure.
        down_s: how long a refusing server stays out of rotation at first.
        pause_mode: what an update does with the requests in flight: ``keep`` (frozen, then
            continued with the new weights: their responses record both versions), ``abort``
            (cancelled and sent again after the update) or ``wait`` (finished first).

    Raises ValueError for no servers or non-positive limits.
    """

    def __init__(self, servers: Sequence[str], *, model: str | None = None, tokenizer: Any = None,
                 initial_weights: str = "", max_inflight: int = 256, request_timeout_s: float = 600.0,
                 retries: int = 3, down_s: float = 1.0, pause_mode: PauseMode = "keep") -> None:
        if not servers:
            raise ValueError("at least one server URL is needed")
        if max_inflight < 1 or request_timeout_s <= 0 or retries < 0 or down_s <= 0:
            raise ValueError("max_inflight >= 1, request_timeout_s > 0, retries >= 0 and down_s > 0 are needed")
        if pause_mode not in ("keep", "abort", "wait"):
            raise ValueError(f"pause_mode must be keep, abort or wait, got {pause_mode!r}")
        self.servers = [Server(url.rstrip("/")) for url in servers]
        self.model = model
        self.tokenizer = tokenizer
        self.max_inflight = max_inflight
        self.request_timeout_s = request_timeout_s
        self.retries = retries
        self.down_s = down_s
        self.pause_mode = pause_mode
        self.policy_version = 0
        self.checkpoint = initial_weights  # the weights of policy_version
        self.weight_updates: list[WeightUpdate] = []
        self._probes: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="inference-servers", daemon=True)
        self._thread.start()
        self._client: httpx.AsyncClient = self._call(self._make_client())
        self._changed: asyncio.Condition = self._call(self._make_condition())

    # -- the loop thread ----------------------------------------------------------------------

    def _call(self, coro):
        """Run ``coro`` on the backend's loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _make_client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        return httpx.AsyncClient(timeout=httpx.Timeout(self.request_timeout_s, connect=5.0), limits=limits)

    @staticmethod
    async def _make_condition() -> asyncio.Condition:
        return asyncio.Condition()

    def close(self) -> None:
        """Close the HTTP client and stop the loop thread."""
        if self._loop.is_closed():
            return
        self._call(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    # -- generation ---------------------------------------------------------------------------

    def generate(self, prompt_token_ids: list[list[int]], n: list[int],
                 params: list[SamplingParams]) -> list[list[Sample]]:
        """See GenerationBackend.generate. All requests are in flight together; each sample's
        ``versions`` lists the policy versions that produced it (two when a weight update fell
        inside its request)."""
        return self.submit(prompt_token_ids, n, params).result()

    def submit(self, prompt_token_ids: list[list[int]], n: list[int],
               params: list[SamplingParams]) -> Future:
        """``generate`` without waiting: a ``concurrent.futures.Future`` of its result. Calls
        may overlap (the generation worker submits each poll while earlier ones are in flight);
        the servers see one stream of requests. Raises ValueError for mismatched arguments."""
        check_args(prompt_token_ids, n, params)
        return asyncio.run_coroutine_threadsafe(self._generate_all(prompt_token_ids, n, params), self._loop)

    @property
    def capacity(self) -> int:
        """Sequences the servers take at once: ``max_inflight`` per server."""
        return self.max_inflight * len(self.servers)

    async def _generate_all(self, prompts, n, params) -> list[list[Sample]]:
        if not self.model:  # asked again until a server answers
            self.model = await self._served_model() or None
        return list(await asyncio.gather(*(
            self._request(p, int(k), sp) if k > 0 else _empty() for p, k, sp in zip(prompts, n, params))))

    async def _served_model(self) -> str:
        for server in self.servers:
            try:
                response = await self._client.get(f"{server.url}/v1/models", timeout=10.0)
                return str(response.json()["data"][0]["id"])
            except (httpx.HTTPError, ValueError, LookupError, TypeError):
                continue
        return ""  # unknown: the request's error names the servers

    async def _request(self, prompt: list[int], n: int, params: SamplingParams) -> list[Sample]:
        deadline = time.monotonic() + self.request_timeout_s
        body = completion_request(self.model or "", prompt, n, params)
        cause = "no server answered"
        for _ in range(self.retries + 1):
            server = await self._acquire(n, deadline)
            if server is None:
                return error_samples(n, f"no inference server reachable within {self.request_timeout_s:.0f} s "
                                        f"({', '.join(s.url for s in self.servers)}): {cause}")
            started = server.version
            try:
                response = await self._client.post(f"{server.url}/v1/completions", json=body,
                                                   timeout=max(1.0, deadline - time.monotonic()))
                samples = self._samples(response, n)
            except httpx.TransportError as exc:  # refused, reset, timed out
                cause = f"{server.url}: {type(exc).__name__}: {exc}"
                if not isinstance(exc, httpx.TimeoutException):
                    self._mark_down(server)
                self._count(server, type(exc).__name__)
                continue
            except ServerError as exc:
                cause = f"{server.url}: {exc}"
                self._count(server, "bad_response")
                if exc.retry:
                    continue
                return error_samples(n, cause[:2000])
            finally:
                await self._release(server, n)
            versions = tuple(sorted({v for v in (started, server.version) if v is not None}))
            server.served += n
            return [Sample(s.token_ids, s.logprobs, s.text, s.finish_reason, versions=versions) for s in samples]
        return error_samples(n, f"gave up after {self.retries + 1} tries: {cause}"[:2000])

    def _samples(self, response: httpx.Response, n: int) -> list[Sample]:
        if response.status_code >= 400:
            raise ServerError(f"HTTP {response.status_code}: {response.text[:500]}", retry=response.status_code >= 500)
        try:
            body = response.json()
        except ValueError:
            raise ServerError(f"malformed JSON: {response.text[:200]!r}") from None
        return parse_completion(body, n)

    # -- routing --------------------------------------------------------------------------

    def _pick(self, n: int) -> Server | None:
        """The server in rotation with room for ``n`` more sequences and the fewest in flight."""
        now = time.monotonic()
        ready = [s for s in self.servers if s.version is not None and not s.updating and s.down_until <= now
                 and (s.inflight == 0 or s.inflight + n <= self.max_inflight)]
        return min(ready, key=lambda s: s.inflight, default=None)

    async def _acquire(self, n: int, deadline: float) -> Server | None:
        """A server for ``n`` sequences (its ``inflight`` already counts them), or None when
        none is in rotation before ``deadline``."""
        async with self._changed:
            while True:
                self._probe_returning()
                server = self._pick(n)
                if server is not None:
                    server.inflight += n
                    return server
                now = time.monotonic()
                if now >= deadline:
                    return None
                # woken by a release, a server back or an update done; else at the next probe
                wake = min([s.down_until for s in self.servers if s.down_until > now] + [deadline])
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=max(0.05, wake - now))
                except asyncio.TimeoutError:
                    pass

    async def _release(self, server: Server, n: int) -> None:
        async with self._changed:
            server.inflight -= n
            self._changed.notify_all()

    def _mark_down(self, server: Server) -> None:
        server.failures += 1
        server.version = None  # it may come back restarted, with its first weights
        server.down_until = time.monotonic() + min(MAX_DOWN_S, self.down_s * 2 ** (server.failures - 1))
        log.warning("inference server %s left the rotation for %.1f s", server.url, server.down_until - time.monotonic())

    @staticmethod
    def _count(server: Server, kind: str) -> None:
        server.errors[kind] = server.errors.get(kind, 0) + 1

    def _probe_returning(self) -> None:
        """Start probing, in the background, each server whose time out of rotation is over."""
        now = time.monotonic()
        for server in self.servers:
            if server.version is None and not server.updating and server.down_until <= now:
                server.updating = True  # one probe per server at a time
                task = self._loop.create_task(self._admit(server))
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)

    async def _admit(self, server: Server) -> None:
        """Bring ``server`` back when it answers: it first loads the newest weights unless its
        ``/weight_info`` shows it has them. One still down stays out longer."""
        try:
            version, path = self.policy_version, self.checkpoint
            if server.stale or not _has_version(await self._weight_version(server), version):
                await self._load(server, path, version)
            server.version, server.stale = version, False
            while server.version < self.policy_version:  # published while it was loading
                await self._load(server, self.checkpoint, self.policy_version)
            server.failures = 0
            log.info("inference server %s is in rotation at policy version %d", server.url, server.version)
        except (httpx.HTTPError, WeightUpdateError) as exc:
            log.warning("inference server %s is not back: %s", server.url, exc)
            server.version = None
            self._mark_down(server)
        finally:
            server.updating = False
            async with self._changed:
                self._changed.notify_all()

    async def _weight_version(self, server: Server) -> str | None:
        response = await self._client.get(f"{server.url}/weight_info", timeout=10.0)
        if response.status_code == 404:  # a server without vLLM's weight endpoints
            return None
        response.raise_for_status()
        return str(response.json().get("weight_version"))

    # -- weights ------------------------------------------------------------------------------

    def load_weights(self, path: str, version: int) -> None:
        """Load policy ``version`` from the model folder ``path`` (as the servers see it) into
        every server in rotation, each once: pause (``pause_mode``), reload, set the version,
        resume. Requests keep flowing to the others meanwhile. A server that is down, or goes
        down during the load, loads it when it comes back. Raises WeightUpdateError when every
        server answered and none could load it (the checkpoint is at fault: ``policy_version``
        stays, and the servers reload the old weights before they serve again)."""
        self._call(self._load_everywhere(str(path), int(version)))

    async def _load_everywhere(self, path: str, version: int) -> None:
        targets = [s for s in self.servers if s.version is not None and s.version < version]
        for server in targets:
            server.updating = True
        results = await asyncio.gather(*(self._load(s, path, version) for s in targets), return_exceptions=True)
        failed, refused = [], 0
        async with self._changed:
            for server, result in zip(targets, results):
                server.updating = False
                if isinstance(result, BaseException):
                    failed.append(f"{server.url}: {result}")
                    refused += isinstance(result, httpx.TransportError)
                    # Its weights are unknown now (the reload may have half happened): out of
                    # rotation until it is back with the weights of policy_version.
                    server.stale = True
                    self._mark_down(server)
            if targets and len(failed) == len(targets) and not refused:
                # every server answered and none could load it: the checkpoint is at fault
                self._changed.notify_all()
                raise WeightUpdateError(f"no server loaded policy version {version} from {path}: " + "; ".join(failed))
            # a server that was unreachable loads this version when it is back
            for problem in failed:
                log.error("policy version %d not loaded: %s", version, problem)
            self.policy_version, self.checkpoint = version, path
            self._changed.notify_all()

    async def _load(self, server: Server, path: str, version: int) -> None:
        """pause -> reload_weights -> reset the prefix cache -> update_weight_version -> resume
        on one server; resumes even when a step fails. Raises WeightUpdateError or httpx errors.

        The KV cache holds keys and values the old weights computed: prefix blocks a new request
        would reuse, and the blocks of requests kept in flight. Resetting it with
        ``reset_running_requests`` drops both, so a kept request recomputes its prompt and the
        tokens it has so far with the new weights when it resumes."""
        base = server.url
        t0 = time.perf_counter()
        await self._post(f"{base}/pause", params={"mode": self.pause_mode})
        try:
            if path:
                await self._post(f"{base}/collective_rpc",
                                 json={"method": "reload_weights", "kwargs": {"weights_path": path}})
                await self._refresh_output_embedding(server)
            reset = await self._post(f"{base}/reset_prefix_cache", params={"reset_running_requests": "true"})
            if reset.get("success") is False:
                raise WeightUpdateError("the server kept KV blocks of the old weights (reset_prefix_cache failed)")
            await self._post(f"{base}/update_weight_version", json={"new_version": str(version)})
            # set before the resume: a request answered from now on has new-weight tokens
            server.version = version
        finally:
            await self._post(f"{base}/resume")
        update = WeightUpdate(version, base, (time.perf_counter() - t0) * 1000.0, self.pause_mode)
        self.weight_updates.append(update)
        log.info("inference server %s: policy version %d loaded in place in %.0f ms", base, version, update.ms)

    async def _refresh_output_embedding(self, server: Server) -> None:
        """rollstream's worker extension rebuilds a tied output embedding's kernel, which vLLM's
        CPU build leaves on the old weights after a reload (rollstream.inference.vllm_extension).
        A server started without the extension is told once in the log, then left alone."""
        if server.extension is False:
            return
        try:
            await self._post(f"{server.url}/collective_rpc", json={"method": "refresh_output_embedding"})
            server.extension = True
        except WeightUpdateError as exc:
            if "refresh_output_embedding" not in str(exc) and "has no attribute" not in str(exc):
                raise
            server.extension = False
            log.warning("inference server %s runs without rollstream's worker extension (--worker-extension-cls %s): "
                        "on vLLM's CPU build a tied output embedding keeps its old weights after a reload",
                        server.url, WORKER_EXTENSION)

    async def _post(self, url: str, **kw: Any) -> dict:
        """POST to a control endpoint; returns its JSON object ({} for another body). Raises
        WeightUpdateError for an HTTP error, httpx errors for a transport one."""
        response = await self._client.post(url, timeout=self.request_timeout_s, **kw)
        if response.status_code >= 400:
            raise WeightUpdateError(f"POST {url.rsplit('/', 1)[-1]}: HTTP {response.status_code}: {response.text[:300]}")
        try:
            body = response.json()
        except ValueError:
            return {}
        return body if isinstance(body, dict) else {}


def _has_version(weight_version: str | None, version: int) -> bool:
    """Whether a server reporting ``weight_version`` (``/weight_info``; None: it has no such
    endpoint) holds policy ``version``. A server started from the model folder reports
    ``default``: that is version 0."""
    if weight_version in (None, "default", "None"):
        return version == 0
    return weight_version == str(version)


async def _empty() -> list[Sample]:
    return []
