"""The soak's reward functions (benchmarks/soak.py copies this module beside the config it
writes; the config names them ``soak_rewards:<name>``).

``SOAK_HANG_FLAG`` (environment): a file the soak creates to inject a hang. The first call that
finds it removes it and sleeps ``SOAK_HANG_S`` seconds, past the domain's ``reward_timeout_s``:
the reward pool must kill that process, reject the response ``reward_timeout`` and go on.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time

_NUMBER = re.compile(r"-?\d+")


def _maybe_hang() -> None:
    flag = os.environ.get("SOAK_HANG_FLAG")
    if not flag:
        return
    try:
        os.remove(flag)  # one call hangs per flag, whichever pool process finds it first
    except FileNotFoundError:
        return
    time.sleep(float(os.environ.get("SOAK_HANG_S", "60")))


def last_number(response_text: str, ground_truth: str, **info) -> float:
    """1.0 when the reply's last integer equals the answer (the bundled model's sums). A
    reasoning-gym prompt's ground truth is its task entry as JSON, the answer under
    ``entry.answer``; any other ground truth is the answer itself."""
    _maybe_hang()
    answer = str(ground_truth).strip()
    if answer.startswith("{"):
        answer = str(json.loads(answer)["entry"]["answer"]).strip()
    numbers = _NUMBER.findall(response_text)
    return float(bool(numbers) and numbers[-1] == answer)


def coin(response_text: str, ground_truth: str, **info) -> float:
    """A fair coin fixed by the reply's text (a random-weights model's replies carry no answer):
    a group of n has all-equal rewards with chance 2 / 2**n, so the mean filter rejects some
    groups and resampling runs, as on a real workload."""
    _maybe_hang()
    return float(hashlib.sha256(response_text.encode()).digest()[0] & 1)
