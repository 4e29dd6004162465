"""Per-domain reward functions and the reward worker.

A built-in reward function is ``fn(response_text: str, ground_truth: str) -> RewardResult``. It
never raises: any exception while scoring gives reward NaN with ``error`` set and ``failure``
``reward_error``, which the aggregator rejects instead of training on a made-up 0. Built-ins run
in the reward worker's own process: they take 0.5 ms (gsm8k) to 2 ms (math) per response, bound
math-verify's time themselves, and a pool round trip would only add its 0.3 ms.

A user function (``reward_type: pkg.module:function``, see rollstream.config.reward_functions)
runs in a pool of processes (rollstream.workers.reward_pool) with the domain's
``reward_timeout_s``. Its failures are per response, recorded as ``failure`` (RewardedResponse
``meta.reward_failure``, read by the response filter) and ``reward_error`` (the message):

=====================================================  ==================
the function                                           failure (reason)
=====================================================  ==================
hangs past ``reward_timeout_s``                         reward_timeout
raises, or its process dies (segfault, ``os._exit``)   reward_error
returns NaN/inf, a non-number, a dict without a         invalid_reward
numeric ``score`` (batched: a list of another length)
=====================================================  ==================

A returned float ``x`` gives reward ``x`` and scores ``{"score": x}``; a dict gives reward
``dict["score"]``, its numeric values as scores (``acc`` ... for a query filter's ``metric``)
and its other values as meta strings.

Built-in functions (rollstream.extensions.REWARDS):

- ``gsm8k``: the model's answer is the number after its last ``#### `` (format 1), else its last
  number (format 0); compared with math-verify to the ground truth (a number, or text ending in
  ``#### N``).
- ``math``: the model's last ``\\boxed{}`` (format 1), else whatever math-verify extracts from the
  whole reply (format 0); compared with math-verify to the ground truth (LaTeX; a ``\\boxed{}``
  in it is unwrapped).
- ``reasoning_gym``: the ground truth is JSON ``{"task", "config", "entry"}`` (rollstream.data);
  the task is rebuilt and its own ``score_answer(answer, entry)`` scores the reply.

math-verify and threads: its ``parse``/``verify`` default timeouts use ``signal.alarm``, which
raises ValueError outside the main thread. We pass the timeouts only in the main thread and
``None`` elsewhere, and bound the length of what is handed to it, so the worker loop is safe in
either.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from rollstream.config.reward_functions import info_keys, is_builtin, load_reward_function
from rollstream.extensions import REWARDS
from rollstream.exceptions import ConfigError
from rollstream.filtering.prompt_state import REWARD_METRIC
from rollstream.filtering.reasons import RejectReason
from rollstream.filtering.response_filters import BLANK_TEXT, REWARD_FAILURE
from rollstream.kafka.events import Input, Output
from rollstream.kafka.topics import Topics
from rollstream.kafka.context import StageContext
from rollstream.kafka.event_worker import EventWorker
from rollstream.schemas.records import FINISH_ERROR, payload_ref, response_summary
from rollstream.workers import reward_pool
from rollstream.answers import last_boxed
from rollstream.workers.reward_pool import Job, RewardPool, Scored

log = logging.getLogger(__name__)

NAN = float("nan")
MATH_VERIFY_TIMEOUT_S = 5  # per parse / per comparison, main thread only (signal.alarm, int s)
MAX_ANSWER_CHARS = 1000  # longer "answers" are garbage and can make sympy run for minutes
MAX_RESPONSE_CHARS = 20000  # bound for whole-reply extraction fallbacks
DEFAULT_REWARD_TIMEOUT_S = 30.0
DEFAULT_REWARD_CONCURRENCY = 4


@dataclass
class RewardResult:
    """One response's reward.

    response_level_reward: shaped scalar used for advantages (NaN when not computable).
    scores: raw components; always ``acc`` (0/1 correctness) and ``format`` (0/1).
    meta: string checks; always ``invalid_format`` ("true"/"false") and ``extracted_answer``.
    error: why the reward is NaN, else None.
    failure: the rejection reason when the reward is NaN (``reward_error``, ``reward_timeout``,
    ``invalid_reward``, ``engine_error``), else None.

    User functions' results carry their own scores and meta (see the module docstring).
    """

    response_level_reward: float
    scores: dict[str, float] = field(default_factory=dict)
    meta: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    failure: str | None = None
    ms: float | None = None  # a user function's own call time; None: the worker measures it


RewardFn = Callable[[str, str], RewardResult]


def _result(reward: float, acc: bool, fmt: bool, answer: str | None, **extra_scores: float) -> RewardResult:
    return RewardResult(
        response_level_reward=float(reward),
        scores={"acc": 1.0 if acc else 0.0, "format": 1.0 if fmt else 0.0, **extra_scores},
        meta={"invalid_format": "false" if fmt else "true", "extracted_answer": (answer or "")[:MAX_ANSWER_CHARS]},
    )


def failed(error: str, failure: str = RejectReason.REWARD_ERROR.value) -> RewardResult:
    """A NaN reward carrying ``error`` (acc/format 0 so the score map keeps its keys)."""
    return RewardResult(NAN, {"acc": 0.0, "format": 0.0},
                        {"invalid_format": "true", "extracted_answer": ""}, error, failure)


# reward_pool's outcome of a user call -> the response's rejection reason
_FAILURES = {
    reward_pool.RAISED: RejectReason.REWARD_ERROR.value,
    reward_pool.DIED: RejectReason.REWARD_ERROR.value,
    reward_pool.TIMEOUT: RejectReason.REWARD_TIMEOUT.value,
    reward_pool.INVALID: RejectReason.INVALID_REWARD.value,
}


def from_scored(scored: Scored) -> RewardResult:
    """A user function's Scored as a RewardResult (its failure kind as the rejection reason)."""
    return RewardResult(scored.reward, dict(scored.scores), dict(scored.meta), scored.error,
                        _FAILURES.get(scored.kind), scored.ms)


def _never_raises(fn: RewardFn) -> RewardFn:
    @functools.wraps(fn)
    def wrapper(response_text: str, ground_truth: str) -> RewardResult:
        try:
            return fn(response_text, ground_truth)
        except BaseException as exc:  # math-verify's TimeoutException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return failed(f"{type(exc).__name__}: {exc}"[:2000])

    return wrapper


# --- math-verify ---------------------------------------------------------------------------

def _mv_timeout() -> int | None:
    # signal.alarm only works in the main thread; elsewhere math-verify raises ValueError.
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=1)
def _mv():
    # Imported on first use: it pulls in sympy / latex2sympy (seconds), and only the gsm8k and
    # math domains need it.
    import math_verify

    # With timeouts off it logs a one-time warning; that is our choice off the main thread.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify


def _mv_parse(text: str, latex: bool = True, expr: bool = True) -> list:
    mv = _mv()
    config = []
    if latex:
        config.append(mv.LatexExtractionConfig())
    if expr:
        config.append(mv.ExprExtractionConfig())
    return mv.parse(text, extraction_config=config, parsing_timeout=_mv_timeout(), raise_on_error=False)


def _mv_equal(gold: list, pred: list) -> bool:
    if not gold or not pred:
        return False
    return bool(_mv().verify(gold, pred, timeout_seconds=_mv_timeout(), raise_on_error=False))


# --- gsm8k ---------------------------------------------------------------------------------

_NUMBER = r"-?\$?\s*\d[\d,]*(?:\.\d+)?|-?\$?\s*\.\d+"
_HASHES = re.compile(r"####\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def _clean_number(s: str) -> str:
    return s.replace("$", "").replace(",", "").replace(" ", "").rstrip(".")


def extract_gsm8k_answer(text: str) -> tuple[str | None, bool]:
    """(answer, followed_format): the number after the last ``####``, else the last number."""
    marked = _HASHES.findall(text)
    if marked:
        return _clean_number(marked[-1]), True
    numbers = _ANY_NUMBER.findall(text[-MAX_RESPONSE_CHARS:])
    return (_clean_number(numbers[-1]), False) if numbers else (None, False)


@_never_raises
def gsm8k_reward(response_text: str, ground_truth: str) -> RewardResult:
    """1.0 when the extracted number equals the ground truth (math-verify), else 0.0.

    ``ground_truth`` is a number or a GSM8K solution ending in ``#### N``; ValueError (-> NaN)
    when it holds no number.
    """
    truth = ground_truth.rsplit("####", 1)[-1] if "####" in ground_truth else ground_truth
    truth = _clean_number(truth.strip())
    if not _ANY_NUMBER.fullmatch(truth):
        raise ValueError(f"gsm8k ground truth is not a number: {ground_truth[-80:]!r}")
    answer, fmt = extract_gsm8k_answer(response_text)
    acc = answer is not None and _mv_equal(_mv_parse(truth, latex=False), _mv_parse(answer, latex=False))
    return _result(1.0 if acc else 0.0, acc, fmt, answer)


# --- math ----------------------------------------------------------------------------------

@_never_raises
def math_reward(response_text: str, ground_truth: str) -> RewardResult:
    """1.0 when the reply's last ``\\boxed{}`` is equivalent to the ground truth, else 0.0.

    Without a box the whole reply goes to math-verify's own extraction (format 0). ValueError
    (-> NaN) when math-verify cannot parse the ground truth.
    """
    truth = last_boxed(ground_truth) or ground_truth.strip()
    gold = _mv_parse("\\boxed{" + truth[:MAX_ANSWER_CHARS] + "}")
    if not gold:
        raise ValueError(f"math-verify cannot parse ground truth {ground_truth[:80]!r}")
    boxed = last_boxed(response_text)
    if boxed is not None:
        answer, fmt = boxed, True
        pred = _mv_parse("\\boxed{" + boxed[:MAX_ANSWER_CHARS] + "}")
    else:
        fmt = False
        pred = _mv_parse(response_text[-MAX_RESPONSE_CHARS:])
        # parse returns [sympy object, source string]; the string is what was extracted
        answer = str(pred[-1]) if pred else None
    acc = _mv_equal(gold, pred)
    return _result(1.0 if acc else 0.0, acc, fmt, answer)


# --- reasoning-gym -------------------------------------------------------------------------

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def extract_final_answer(text: str) -> tuple[str | None, bool]:
    """(answer, followed_format) for "give only the final answer" prompts.

    An ``<answer>…</answer>`` tag or a ``\\boxed{}`` counts as the answer; otherwise a reply that
    is one non-empty line is the answer (format 1), and a longer reply is scored by its last
    non-empty line (format 0). Surrounding ``$``, ``**`` and a trailing period are stripped.
    """
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return _strip_answer(tags[-1]), True
    boxed = last_boxed(text)
    if boxed is not None:
        return _strip_answer(boxed), True
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return None, False
    return _strip_answer(lines[-1]), len(lines) == 1


_LAST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _is_number(s: str) -> bool:
    try:
        float(s.replace(",", ""))
    except ValueError:
        return False
    return True


def _strip_answer(s: str) -> str:
    s = s.strip().strip("*$` ").strip()
    return s[:-1].rstrip() if s.endswith(".") and not s[:-1].endswith(".") else s


@functools.lru_cache(maxsize=256)
def _rg_dataset(task: str, config_json: str):
    # Imported on first use: loading its many task modules takes seconds, and only the
    # reasoning_gym domain needs it.
    import reasoning_gym

    # Rebuilding is cheap for arithmetic tasks but not for all (some load word lists): cache.
    return reasoning_gym.create_dataset(task, **json.loads(config_json))


@_never_raises
def reasoning_gym_reward(response_text: str, ground_truth: str) -> RewardResult:
    """The task's own ``score_answer`` (0..1; partial credit is the task's choice) as the reward.

    ``acc`` is 1 only for a full score (>= 1.0); ``task_score`` keeps the raw value. ValueError /
    KeyError (-> NaN) for a ground truth that is not the JSON rollstream.data writes.
    """
    try:
        truth = json.loads(ground_truth)
        task, config, entry = truth["task"], truth["config"], truth["entry"]
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"reasoning_gym ground truth is not {{task, config, entry}} JSON: {exc}") from exc
    dataset = _rg_dataset(task, json.dumps(config, sort_keys=True))
    answer, fmt = extract_final_answer(response_text)
    if _is_number(str(entry.get("answer", ""))) and not _is_number(answer or ""):
        # A numeric task answered in words ("4 + 3 = 7", "The final answer is 14."): score the
        # reply's last number, like the GSM8K fallback, and record the format miss.
        numbers = _LAST_NUMBER.findall(response_text)
        answer, fmt = (numbers[-1], False) if numbers else (answer, False)
    score = float(dataset.score_answer(answer, entry))
    if not math.isfinite(score):
        raise ValueError(f"{task}.score_answer returned {score}")
    return _result(score, score >= 1.0, fmt, answer, task_score=score)


def get_reward_fn(name: str) -> RewardFn:
    """The built-in reward function ``name`` (``REWARDS``); ValueError listing the valid names."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward function {name!r}; valid: {sorted(REWARDS)}")
    return REWARDS[name]


# --- worker --------------------------------------------------------------------------------

@dataclass(frozen=True)
class RewardSpec:
    """A domain's reward: ``reward_type`` (a built-in name or ``pkg.module:function``), the
    per-call ``timeout_s`` and ``batched`` form of a user function, and the ``metric`` its query
    filter reads (built-ins ignore all three: their scores are checked at config load)."""

    reward_type: str
    timeout_s: float = DEFAULT_REWARD_TIMEOUT_S
    batched: bool = False
    metric: str = REWARD_METRIC


@dataclass(frozen=True)
class _UserFn:
    fn: Callable
    spec: RewardSpec
    info_keys: tuple[str, ...] | None  # None: all of INFO_KEYS


def _info(response: Mapping, keys: tuple[str, ...] | None) -> dict:
    """The ``**info`` of one response (rollstream.config.reward_functions.INFO_KEYS)."""
    tokens = response.get("response_token_ids")
    info = {
        "prompt_id": response.get("prompt_id"), "domain": response.get("domain"), "mode": response.get("mode"),
        "prompt": response.get("prompt"), "messages": list(response.get("messages") or []),
        "sample_index": response.get("sample_index"), "round": response.get("round"),
        "finish_reason": response.get("finish_reason"), "response_length": 0 if tokens is None else len(tokens),
        "policy_version": response.get("policy_version"),
    }
    return info if keys is None else {k: info[k] for k in keys}


class RewardWorker:
    """Batch handler: each ``Response`` -> one small ``RewardedResponse`` on ``responses.rewarded``.

    ``domain_reward_fns`` maps a domain to a reward function name or a RewardSpec; unknown names
    raise ValueError and bad import paths ConfigError here (at start-up), never per event.
    ``concurrency``: processes of the pool that runs user functions (started only when a domain
    has one; ``close()`` stops it). Per event:

    - finish_reason ``error``: passed through, reward NaN, reward_error ``engine_error``;
    - a domain without a function: reward NaN, reward_error ``no reward function for domain X``;
    - otherwise the function's result (NaN + its error and failure when scoring failed).

    Every input gets its output, in input order: a user function's hang, exception, death or
    invalid return fails only the responses of that call (see the module docstring), never the
    rest of the batch.

    The RewardedResponse is a decision-plane event: the response's ``ResponseSummary`` (identity,
    ``prompt_length``/``response_length``, finish reason; no arrays, no text) and ``payload``, a
    PayloadRef to the Response it was computed from (topic, partition, offset, size of the input
    event). Its size does not depend on the response's length. ``meta`` gains ``blank_text``
    (``"true"`` when the response text is empty or whitespace only: the response filter's
    ``reject_empty`` reads it, the text is not in the event) and, when the reward is NaN,
    ``reward_failure`` (the rejection reason). reward_ms is the scoring wall time in
    milliseconds. Other finish reasons (``length``, ``abort``) are scored as usual: the
    aggregator reads finish_reason itself.
    """

    def __init__(self, topics: Topics, domain_reward_fns: Mapping[str, str | RewardSpec],
                 concurrency: int = DEFAULT_REWARD_CONCURRENCY) -> None:
        self.topics = topics
        self.fns: dict[str, RewardFn] = {}
        self.user_fns: dict[str, _UserFn] = {}
        for domain, spec in domain_reward_fns.items():
            spec = spec if isinstance(spec, RewardSpec) else RewardSpec(spec)
            if is_builtin(spec.reward_type) or ":" not in spec.reward_type:
                self.fns[domain] = get_reward_fn(spec.reward_type)
            else:
                fn = load_reward_function(spec.reward_type, spec.batched)
                self.user_fns[domain] = _UserFn(fn, spec, None if spec.batched else info_keys(fn))
        modules = sorted({u.spec.reward_type.partition(":")[0] for u in self.user_fns.values()})
        self.pool = RewardPool(concurrency, preload=modules) if self.user_fns else None
        # user domains whose query filter reads a score: checked at their first scored response
        self._unchecked = {d for d, u in self.user_fns.items() if u.spec.metric != REWARD_METRIC}

    def reward(self, response: dict) -> RewardResult:
        """Score one Response record (raises as ``rewards``); a user function runs in the pool."""
        return self.rewards([response])[0]

    def rewards(self, responses: Sequence[Mapping]) -> list[RewardResult]:
        """Score Response records: built-ins here, user functions concurrently in the pool (a
        batched one: one call per domain). A response's failure is its result, never an
        exception; raises ConfigError only when a user function's first scores lack its
        domain's query filter metric (``_check_metrics``)."""
        results: list[RewardResult | None] = [None] * len(responses)
        pending: dict[str, list[int]] = {}  # domain -> indices for its user function
        for i, response in enumerate(responses):
            domain = response.get("domain")
            if response.get("finish_reason") == FINISH_ERROR:
                results[i] = failed("engine_error", RejectReason.ENGINE_ERROR.value)
            elif domain in self.user_fns:
                pending.setdefault(domain, []).append(i)
            elif domain in self.fns:
                results[i] = self.fns[domain](response.get("response_text") or "", response.get("ground_truth") or "")
            else:
                results[i] = failed(f"no reward function for domain {domain}")
        jobs, owners = [], []
        for domain, indices in pending.items():
            user = self.user_fns[domain]
            calls = [indices] if user.spec.batched else [[i] for i in indices]
            for call in calls:
                jobs.append(Job(
                    user.fn, [responses[i].get("response_text") or "" for i in call],
                    [responses[i].get("ground_truth") or "" for i in call],
                    [_info(responses[i], user.info_keys) for i in call], user.spec.timeout_s, user.spec.batched,
                ))
                owners.append(call)
        if jobs:
            for call, scored in zip(owners, self.pool.score(jobs)):
                for i, one in zip(call, scored):
                    results[i] = from_scored(one)
            self._check_metrics(responses, results)
            failures = Counter(r.failure for r in results if r.failure is not None)
            if failures:  # one line per batch: what the user's function did, and one example
                first = next(r for r in results if r.failure is not None)
                log.warning("%d of %d responses have no reward %s; e.g. %s", sum(failures.values()), len(results),
                            dict(failures), first.error)
        return results

    def _check_metrics(self, responses: Sequence[Mapping], results: Sequence[RewardResult]) -> None:
        """At a user domain's first scored response: raise ConfigError when the scores its
        function returned lack the metric its query filter reads (every group would be rejected
        ``invalid_reward`` on a NaN metric, with nothing naming the cause)."""
        if not self._unchecked:  # every domain checked: nothing on the hot path
            return
        for response, result in zip(responses, results):
            domain = response.get("domain")
            if domain not in self._unchecked or result.failure is not None:
                continue
            spec = self.user_fns[domain].spec
            if spec.metric not in result.scores:
                raise ConfigError(
                    f"rewards.{domain}.query_filter_config.metric {spec.metric!r} is not among the scores "
                    f"{spec.reward_type} returned: {sorted(result.scores)}; name one of them (or {REWARD_METRIC!r}) "
                    f"or return {spec.metric!r} in the function's dict")
            self._unchecked.discard(domain)

    def __call__(self, inputs: Sequence[Input]) -> Iterable[Output]:
        start = time.perf_counter()
        results = self.rewards([inp.record for inp in inputs])
        # a built-in's time is measured per batch here; a user function's is its call's own
        builtin_ms = (time.perf_counter() - start) * 1000.0 / max(len(inputs), 1)
        outputs = []
        for inp, result in zip(inputs, results):
            response = inp.record
            meta = {k: str(v) for k, v in result.meta.items()}
            meta[BLANK_TEXT] = "false" if (response.get("response_text") or "").strip() else "true"
            if result.failure is not None:
                meta[REWARD_FAILURE] = result.failure
            outputs.append(Output(
                topic=self.topics.responses_rewarded,
                key=response["prompt_id"],
                schema="RewardedResponse",
                record={
                    "response": response_summary(response),
                    "response_level_reward": float(result.response_level_reward),
                    "scores": {k: float(v) for k, v in result.scores.items()},
                    "meta": meta,
                    "reward_error": result.error,
                    "reward_ms": result.ms if result.ms is not None else builtin_ms,
                    "payload": payload_ref(inp.topic, inp.partition, inp.offset, len(inp.value)),
                },
            ))
        return outputs

    def close(self) -> None:
        """Stop the pool's processes, if any."""
        if self.pool is not None:
            self.pool.close()


def run_reward_worker(
    context: StageContext,
    domain_reward_fns: Mapping[str, str | RewardSpec],
    group_id: str = "rollstream-reward",
    max_batch: int = 64,
    max_idle_s: float | None = None,
    concurrency: int = DEFAULT_REWARD_CONCURRENCY,
) -> EventWorker:
    """Consume ``responses``, produce ``responses.rewarded`` until SIGTERM/SIGINT or ``max_idle_s``
    seconds without input; returns the (closed) worker for its counters. ``context`` (stage
    ``reward``): the cluster, topics, this process's partitions and ``max_message_bytes`` (see
    EventWorker). ``concurrency``: processes running user reward functions.

    ValueError for an unknown reward function name in ``domain_reward_fns``, ConfigError for an
    import path that does not resolve.
    """
    handler = RewardWorker(context.topics, domain_reward_fns, concurrency)
    try:
        worker = EventWorker(
            context, input_topic=context.topics.responses, group_id=group_id, expected_schema="Response",
            handler=handler, max_batch=max_batch,
            domains=domain_reward_fns,  # a response of another domain is dead-lettered where it enters
        )
        worker.install_signal_handlers()
        worker.run(max_idle_s=max_idle_s)
    finally:
        handler.close()
    return worker
