"""The advantage estimators by ``adv_estimator`` name: the one list of their names.

Their code is rollstream.trainer.batch's, imported when the trainer first asks; the config checks
a name here without importing torch, and the trainer's maths reads it without the config's
dependencies (``make gpu-check`` runs the trainer modules with torch alone)."""

from __future__ import annotations

from typing import Callable

from rollstream.registry import Registry

ADV_ESTIMATORS: Registry[Callable] = Registry("adv_estimator", builtins={
    "grpo": "rollstream.trainer.batch:grpo_estimator",
    "dr_grpo": "rollstream.trainer.batch:dr_grpo_estimator",
    "rloo": "rollstream.trainer.batch:rloo_estimator",
})
