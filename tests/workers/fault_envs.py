"""Small deterministic environments for tests, importable as env_type
``tests.workers.fault_envs:<Class>``.

* ``CountingEnv`` -- accepts anything; reward ``reward`` per step; done after ``episode_len``
  steps (success). The base of the others.
* ``FailingEnv(fail_on="reset"|"step")`` -- raises RuntimeError there.
* ``SlowEnv(delay_s, slow_instances=1, slow_on="step")`` -- only the first ``slow_instances``
  instances built in this process are slow (class-level counter; ``SlowEnv.reset_count()``
  between tests). Lets a test make exactly one run of a group slow.
* ``RefusingEnv(reward)`` -- every move is invalid (reward ``reward`` each), never done: format
  penalty accounting with a known count.
"""

from __future__ import annotations

import itertools
import threading
import time

from rollstream.workers.envs import StepResult


class CountingEnv:
    def __init__(self, episode_len: int = 2, reward: float = 0.5) -> None:
        self.episode_len = episode_len
        self.reward = reward
        self.steps = 0
        self.seed: int | None = None
        self.closed = False

    def reset(self, seed: int) -> str:
        self.seed, self.steps = seed, 0
        return f"Episode {seed}. Say anything, e.g. [go]."

    def step(self, action_text: str) -> StepResult:
        self.steps += 1
        done = self.steps >= self.episode_len
        return StepResult(observation=f"Step {self.steps} accepted.", reward=self.reward, done=done,
                          success=done, action="go")

    def close(self) -> None:
        self.closed = True


class FailingEnv(CountingEnv):
    def __init__(self, fail_on: str = "step", **kwargs) -> None:
        if fail_on not in ("reset", "step"):
            raise ValueError(f"fail_on must be 'reset' or 'step', got {fail_on!r}")
        super().__init__(**kwargs)
        self.fail_on = fail_on

    def reset(self, seed: int) -> str:
        if self.fail_on == "reset":
            raise RuntimeError("reset exploded on purpose")
        return super().reset(seed)

    def step(self, action_text: str) -> StepResult:
        if self.fail_on == "step":
            raise RuntimeError("step exploded on purpose")
        return super().step(action_text)


class SlowEnv(CountingEnv):
    _counter = itertools.count()
    _lock = threading.Lock()

    def __init__(self, delay_s: float = 1.0, slow_instances: int = 1, slow_on: str = "step", **kwargs) -> None:
        if slow_on not in ("reset", "step"):
            raise ValueError(f"slow_on must be 'reset' or 'step', got {slow_on!r}")
        super().__init__(**kwargs)
        with SlowEnv._lock:
            self.instance = next(SlowEnv._counter)
        self.slow = self.instance < slow_instances
        self.delay_s = delay_s
        self.slow_on = slow_on

    @classmethod
    def reset_count(cls) -> None:
        with cls._lock:
            cls._counter = itertools.count()

    def reset(self, seed: int) -> str:
        if self.slow and self.slow_on == "reset":
            time.sleep(self.delay_s)
        return super().reset(seed)

    def step(self, action_text: str) -> StepResult:
        if self.slow and self.slow_on == "step":
            time.sleep(self.delay_s)
        return super().step(action_text)


class RefusingEnv(CountingEnv):
    def step(self, action_text: str) -> StepResult:
        self.steps += 1
        return StepResult(observation="Invalid move. Try again.", reward=self.reward, invalid_move=True)


class NotAnEnv:
    """Lacks reset/step/close: make_env must refuse it."""

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
