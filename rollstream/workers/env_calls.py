"""Environment calls that cannot hold up the caller: each runs in its own daemon thread with a
deadline, and a hanging close is left to a thread too (used by rollstream.workers.episodes)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from rollstream.workers.envs import TextEnv

log = logging.getLogger(__name__)


class EnvCall:
    """One environment call running in its own daemon thread.

    A thread per call (not a shared pool): a stuck call keeps its thread forever, and a pool
    would either shrink with every stuck call or have to be joined at exit. Daemon threads are
    never joined, so abandoned calls cannot block shutdown.
    """

    def __init__(self, fn: Callable[[], Any], timeout_s: float, wakeup: threading.Event) -> None:
        self.timeout_s = timeout_s
        self.started = time.monotonic()
        self.elapsed: float | None = None  # set when the call returns or raises
        self.result: Any = None
        self.exc: BaseException | None = None
        self._wakeup = wakeup
        self._lock = threading.Lock()
        self._finished = False
        self._cleanup: Callable[[], None] | None = None
        threading.Thread(target=self._run, args=(fn,), daemon=True, name="env-call").start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # reported to the player, never raised in this thread
            self.exc = exc
        self.elapsed = time.monotonic() - self.started
        with self._lock:
            self._finished = True
            cleanup = self._cleanup
        self._wakeup.set()
        if cleanup is not None:
            cleanup()

    @property
    def finished(self) -> bool:
        return self._finished

    def timed_out(self, now: float) -> bool:
        """Finished too slowly, or still running past the deadline."""
        if self._finished:
            return self.elapsed > self.timeout_s
        return now - self.started > self.timeout_s

    def deadline(self) -> float:
        return self.started + self.timeout_s

    def abandon(self, cleanup: Callable[[], None]) -> None:
        """Run ``cleanup`` once the call has returned (now, if it already has)."""
        with self._lock:
            if not self._finished:
                self._cleanup = cleanup
                return
        cleanup()


def close_quietly(env: TextEnv | None) -> None:
    """Close ``env`` in a daemon thread: a hanging close must not block the loop either."""
    if env is None:
        return

    def close() -> None:
        try:
            env.close()
        except Exception:
            log.debug("environment close failed", exc_info=True)

    threading.Thread(target=close, daemon=True, name="env-close").start()
