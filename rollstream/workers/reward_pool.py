"""User reward functions in a pool of worker processes, each call bounded by a timeout.

A user function may hang, raise, return garbage or kill its process; none of that may reach the
reward worker's loop or the neighbours of the response it scores. So every call is one task of a
``pebble.ProcessPool`` with a per-task timeout: a task past its timeout has its process killed
and replaced, a process that dies (segfault, ``os._exit``) is replaced, and either way only that
task's responses fail. The wrapper that runs in the pool process catches every exception and
returns plain data (``Scored``): an exception that does not unpickle would break the whole pool.

Processes come from a ``forkserver``: forking the reward worker itself would copy the Kafka
clients' threads and locks, and spawning would re-import the command line's main module per
process; the fork server is a clean single-threaded process, and a replacement process is a
cheap fork of it (the user's module preloaded there when importable). No pool process outlives
the reward worker, even one stuck in a user function when the worker is SIGKILLed
(``_init_process``).

This module imports only the standard library and pebble: it is what the pool processes load.
"""

from __future__ import annotations

import ctypes
import math
import multiprocessing
import numbers
import os
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from multiprocessing import forkserver
from typing import Any, Callable, Mapping, Sequence

import pebble

# Scored.kind: how a call ended
OK = "ok"
RAISED = "raised"  # the function raised
INVALID = "invalid"  # it returned NaN/inf, a non-number, a dict without a numeric score, a wrong-length list
TIMEOUT = "timeout"  # no result within the timeout: its process was killed
DIED = "died"  # its process died, or the pool failed

PR_SET_PDEATHSIG = 1  # prctl(2)
MAX_ERROR_CHARS = 2000
MAX_META_CHARS = 1000


@dataclass(frozen=True)
class Scored:
    """One response's score from a user function.

    reward: the score (NaN unless ``kind`` is OK). scores: ``score`` and every other numeric value
    of a returned dict (bools as 0.0/1.0). meta: the dict's other values as strings (at most
    1000 characters each). error: why the score is missing, else None. ms: wall time of the call
    in milliseconds (a batched call's time is shared evenly).
    """

    reward: float
    scores: dict[str, float] = field(default_factory=dict)
    meta: dict[str, str] = field(default_factory=dict)
    kind: str = OK
    error: str | None = None
    ms: float = 0.0


def failure(kind: str, error: str, ms: float = 0.0) -> Scored:
    return Scored(math.nan, kind=kind, error=error[:MAX_ERROR_CHARS], ms=ms)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, numbers.Real) else None


def normalise(value: Any) -> Scored:
    """A user function's return value as a Scored (never raises).

    A real number (int, float, bool, numpy scalar) is the score; a mapping holds it under
    ``score``. NaN/inf, any other type, or a mapping without a numeric ``score`` is INVALID.
    """
    if isinstance(value, Mapping):
        if "score" not in value:
            return failure(INVALID, f"returned a dict without 'score' (keys {sorted(map(str, value))[:20]})")
        score = _number(value["score"])
        if score is None:
            return failure(INVALID, f"returned score of type {type(value['score']).__name__}, not a number")
        scores, meta = {}, {}
        for key, item in value.items():
            number = _number(item)
            if number is not None:
                scores[str(key)] = number
            else:
                meta[str(key)] = str(item)[:MAX_META_CHARS]
    else:
        score = _number(value)
        if score is None:
            return failure(INVALID, f"returned {type(value).__name__}, not a number or a dict with 'score'")
        scores, meta = {"score": score}, {}
    if not math.isfinite(score):
        return failure(INVALID, f"returned score {score}")
    return Scored(score, scores, meta)


def _raised(exc: BaseException, ms: float) -> Scored:
    return failure(RAISED, f"{type(exc).__name__}: {exc}", ms)


def call_one(fn: Callable, response_text: str, ground_truth: str, info: Mapping[str, Any]) -> Scored:
    """Run in a pool process: ``fn(response_text, ground_truth, **info)``, normalised."""
    start = time.perf_counter()
    try:
        value = fn(response_text, ground_truth, **info)
        scored = normalise(value)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too: the user's, not ours
        return _raised(exc, (time.perf_counter() - start) * 1000.0)
    return replace(scored, ms=(time.perf_counter() - start) * 1000.0)


def call_batch(fn: Callable, response_texts: list[str], ground_truths: list[str],
               infos: list[dict]) -> list[Scored]:
    """Run in a pool process: ``fn(response_texts, ground_truths, infos)``, one Scored per
    response. An exception fails them all (RAISED); a result that is not a list/tuple of the
    same length fails them all (INVALID); otherwise each item is normalised on its own."""
    n = len(response_texts)
    start = time.perf_counter()
    try:
        values = fn(response_texts, ground_truths, infos)
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = f"{len(values)} results" if isinstance(values, (list, tuple)) else type(values).__name__
            return [failure(INVALID, f"batched reward returned {got} for {n} responses")] * n
        scored = [normalise(v) for v in values]
    except BaseException as exc:
        return [_raised(exc, (time.perf_counter() - start) * 1000.0 / max(n, 1))] * n
    ms = (time.perf_counter() - start) * 1000.0 / max(n, 1)
    return [replace(s, ms=ms) for s in scored]


def _init_process(paths: list[str]) -> None:
    # The fork server starts from `python -c`: give each process the reward worker's import path.
    sys.path[:] = paths
    # This process must not outlive the reward worker, even stuck in a user function (a worker
    # killed with SIGKILL cannot stop its pool): it dies with its parent, the fork server (Linux),
    # and the fork server exits once the reward worker is gone, if no process of its own keeps
    # the "alive" pipe the fork server watches open: this process closes its inherited copy.
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        alive_fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)  # CPython 3.8-3.13
        if alive_fd is not None:
            os.close(alive_fd)
            forkserver._forkserver._forkserver_alive_fd = None


@dataclass(frozen=True)
class Job:
    """One call: a per-response function (one text) or a batched one (``batched``: many)."""

    fn: Callable
    response_texts: list[str]
    ground_truths: list[str]
    infos: list[dict]
    timeout_s: float
    batched: bool = False


class RewardPool:
    """``workers`` processes running Jobs; ``score`` never raises.

    ``preload``: modules the fork server imports once (the user's reward modules), so a replaced
    process does not import them again. Close with ``close()`` (or use as a context manager).
    """

    def __init__(self, workers: int, preload: Sequence[str] = ()) -> None:
        self.workers = workers
        self._context = multiprocessing.get_context("forkserver")
        # Only the first pool of a process starts the fork server; later preload lists are ignored.
        self._context.set_forkserver_preload([__name__, *preload])
        self._pool = self._start()

    def _start(self) -> pebble.ProcessPool:
        return pebble.ProcessPool(max_workers=self.workers, initializer=_init_process,
                                  initargs=(list(sys.path),), context=self._context)

    def _schedule(self, job: Job):
        if job.batched:
            return self._pool.schedule(call_batch, (job.fn, job.response_texts, job.ground_truths, job.infos),
                                       timeout=job.timeout_s)
        return self._pool.schedule(call_one, (job.fn, job.response_texts[0], job.ground_truths[0], job.infos[0]),
                                   timeout=job.timeout_s)

    def score(self, jobs: Sequence[Job]) -> list[list[Scored]]:
        """Run ``jobs`` concurrently; per job one Scored per response text, in order.

        A job past its ``timeout_s`` (counted from when a process starts it) is TIMEOUT, one
        whose process died or that the pool lost is DIED; the pool replaces the process and the
        other jobs are unaffected. A pool that failed as a whole is replaced afterwards."""
        futures = []
        for job in jobs:
            try:
                futures.append(self._schedule(job))
            except RuntimeError:  # the pool stopped working: start a new one, once
                self._restart()
                futures.append(self._schedule(job))
        results = []
        broken = False
        for job, future in zip(jobs, futures):
            n = len(job.response_texts)
            try:
                out = future.result()
                results.append(out if job.batched else [out])
            except TimeoutError:
                results.append([failure(TIMEOUT, f"no result within reward_timeout_s={job.timeout_s:g}",
                                        job.timeout_s * 1000.0 / n)] * n)
            except pebble.ProcessExpired as exc:
                code = exc.exitcode
                how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                results.append([failure(DIED, f"reward process died ({how})")] * n)
            except Exception as exc:  # the pool itself failed (e.g. a result that did not unpickle)
                broken = True
                results.append([failure(DIED, f"reward pool failed: {type(exc).__name__}: {exc}")] * n)
        if broken or not self._pool.active:
            self._restart()
        return results

    def _restart(self) -> None:
        self._pool.stop()
        self._pool.join()
        self._pool = self._start()

    def close(self) -> None:
        """Stop every process (a running call is killed)."""
        self._pool.stop()
        self._pool.join()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
