"""User reward functions for the reward pool's tests, imported by import path
(``tests.workers.user_rewards:<name>``) in the reward worker and its pool processes."""

import math
import os
import time

NOT_A_FUNCTION = 42


def exact_match(response_text, ground_truth, **info):
    """1.0 when the reply is the ground truth (stripped), with ``acc`` and the info it saw."""
    score = float(response_text.strip() == ground_truth.strip())
    return {"score": score, "acc": score, "sample_index": info["sample_index"], "seen": ",".join(sorted(info))}


def sleeps(response_text, ground_truth, **info):
    time.sleep(30)
    return 1.0


def raises(response_text, ground_truth, **info):
    raise ValueError(f"cannot score {response_text!r}")


def returns_nan(response_text, ground_truth, **info):
    return math.nan


def returns(response_text, ground_truth, **info):
    """Returns what the reply spells as a Python literal: ``"0.5"``, ``"inf"``, ``"'text'"``,
    ``"None"``, ``"{'score': 2, 'acc': True, 'pred': 'x'}"``..."""
    return {"inf": math.inf, "nan": math.nan}.get(response_text) if response_text in ("inf", "nan") \
        else eval(response_text)  # noqa: S307 - test input


def exits(response_text, ground_truth, **info):
    os._exit(3)


def by_text(response_text, ground_truth, **info):
    """Dispatch on the reply, so one domain exercises every outcome: ``sleep``, ``raise``,
    ``nan``, ``exit``, else exact match."""
    action = {"sleep": sleeps, "raise": raises, "nan": returns_nan, "exit": exits}.get(response_text, exact_match)
    return action(response_text, ground_truth, **info)


def named_only(response_text, ground_truth, prompt_id):
    """Takes one named info key and no **info."""
    return float(prompt_id.endswith("1"))


def batched(response_texts, ground_truths, infos):
    return [float(t == g) + 0.5 * info["sample_index"] for t, g, info in zip(response_texts, ground_truths, infos)]


def batched_short(response_texts, ground_truths, infos):
    return [1.0]


def two_args(response_text):
    return 1.0


class Weird(Exception):
    def __init__(self, a, b):  # does not unpickle: would break a pool that sent it back
        super().__init__(f"{a}/{b}")


def raises_weird(response_text, ground_truth, **info):
    raise Weird(1, 2)


def raises_batch(response_texts, ground_truths, infos):
    raise RuntimeError(f"batch of {len(response_texts)}")


lambda_reward = lambda response_text, ground_truth, **info: 1.0  # noqa: E731 - does not pickle by reference


def segfaults(response_text, ground_truth, **info):
    import ctypes

    ctypes.string_at(0)  # reads address 0: SIGSEGV
