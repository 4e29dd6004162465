"""History-aware admission (pre-rollout filtering): skip, before generation, a prompt whose
recent groups taught nothing. Pure state; the admission shell keeps it (rollstream.streams.admission_agent).

Source: GRESO (Zheng et al. 2025, "Act Only When It Pays", arXiv 2506.02177). A prompt that was
zero-variance (every response the same reward, so every GRPO advantage is 0) in one epoch tends
to stay so in the next; skipping it before rollout saves the generation that dynamic sampling
(DAPO: filter after generation) would spend and then throw away. The rule as rollstream applies it:

* Each train prompt has an outcome history (``PromptHistory``): per epoch it was generated in,
  the pattern of its group's ``response_level_rewards`` (``all_correct``, ``all_wrong``,
  ``mixed``; see ``reward_pattern``) and the policy version that generated it.
* ``z`` = the number of most recent entries that are zero-variance, back to back (a skipped
  epoch adds no entry). With the exploration probability ``p_e`` of the pattern class of the
  latest entry, the prompt is skipped with probability ``1 - p_e ** z`` (``z = 0``: never).
  A group rejected by two-phase screening (its first k samples all equal) is such an entry too:
  a prompt found hopeless costs k samples, then is mostly skipped.
* A prompt already skipped ``s`` epochs back to back is skipped with probability
  ``(1 - p_e ** z) ** (1 + s)``: the chance that it comes back rises while it stays skipped,
  so a prompt that became learnable meanwhile is found again (rollstream's addition; GRESO
  keeps the probability of its last outcome).
* ``p_e`` adapts per class: after every train group that was generated, if the share of that
  class among the last ``window`` generated groups is above its target
  (``target_all_correct`` / ``target_all_wrong``), ``p_e`` of that class goes down by ``step``
  (skip more), else up by ``step``; clamped to [``explore_min``, 1]. So the share of
  zero-variance groups generated stays near the targets.
* Exploration floor: ``p_e >= explore_min > 0``, and a prompt skipped ``max_skips`` epochs back
  to back is admitted in the next one whatever the draw: no prompt is skipped forever.
* The draw is ``random.Random(f"{seed}/{prompt_id}/{epoch}")``: deterministic, so a restart,
  replay and what-if decide the same way.

Revisits paced by policy versions (``revisit_versions`` = H > 0; rollstream's addition). GRESO
draws once per epoch, which suits epochs of hundreds of steps. When an epoch passes in a step or
two, a prompt found hopeless is drawn again before the policy has changed, and prompts that
``max_skips`` forces back return together. With H set, what counts is the policy's change since
the prompt was last generated: ``E`` = the policy versions since then. With ``P = 1 - p_e ** z``
as above, the prompt is still skipped at ``E`` with probability ``S(E) = P ** (x (x + 1) / 2)``,
``x = E / H``: at whole ``x`` this is the epoch rule's chance of ``x`` skips in a row, so H is
the versions one GRESO epoch stands for (e.g. train prompts / rollout_batch_size). One uniform
``u`` per streak, drawn with ``random.Random(f"{seed}/{prompt_id}/{epoch of the last entry}/revisit")``,
decides: skipped while ``u < S(E)``, so the revisit comes at a seeded age however often the
prompt is drawn.
``max_skips`` then admits it once ``E >= max_skips * H``. Since a pass at an unchanged version
decides as the last one did, admission does not pass over the data again: once an epoch's worth
was skipped at one version, it takes the next prompts in order one at a time until a new version
arrives (rollstream.filtering.admission.history_pass_done).

Epoch 0 has no history: nothing is skipped. Validation prompts are never skipped.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from rollstream.schemas.records import REWARD_PATTERNS as PATTERNS

ALL_CORRECT, ALL_WRONG, MIXED = PATTERNS
ZERO_VARIANCE = (ALL_CORRECT, ALL_WRONG)
EPOCH_SEPARATOR = "#e"


def reward_pattern(rewards: Sequence[float], tol: float = 1e-9) -> str:
    """The pattern of a group's ``response_level_rewards`` (floats, one per kept response):
    ``mixed`` when they differ by more than ``tol``; else ``all_correct`` when the common value is
    > 0, ``all_wrong`` when it is <= 0 (0/1 and -1/1 verifiable rewards alike). "" (no pattern)
    for an empty group or a NaN reward: such a group does not enter the history."""
    values = [float(r) for r in rewards]
    if not values or any(math.isnan(v) for v in values):
        return ""
    if max(values) - min(values) > tol:
        return MIXED
    return ALL_CORRECT if values[0] > 0 else ALL_WRONG


def split_epoch(prompt_id: str) -> tuple[str, int]:
    """``(base prompt_id, epoch)`` of an admission transaction id (``<id>#e<epoch>``; see
    rollstream.filtering.admission.epoch_prompt_id); epoch 0 for a plain id."""
    base, sep, epoch = prompt_id.rpartition(EPOCH_SEPARATOR)
    if sep and epoch.isdigit():
        return base, int(epoch)
    return prompt_id, 0


@dataclass(frozen=True)
class HistoryLimits:
    """The ``history_filter`` config (rollstream.config.rlvr.HistoryFilterConfig)."""

    target_all_correct: float = 0.125
    target_all_wrong: float = 0.125
    explore_init: float = 0.5
    explore_min: float = 0.05
    step: float = 0.01
    window: int = 64
    max_skips: int = 3
    revisit_versions: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.explore_min <= self.explore_init <= 1:
            raise ValueError(f"need 0 < explore_min <= explore_init <= 1, got {self.explore_min}, {self.explore_init}")
        for name in ("target_all_correct", "target_all_wrong"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.window < 1 or self.max_skips < 0 or not 0 <= self.step <= 1 or self.revisit_versions < 0:
            raise ValueError("window must be >= 1, max_skips >= 0, step in [0, 1], revisit_versions >= 0")


@dataclass
class PromptHistory:
    """One train prompt's outcomes: ``entries`` are ``{epoch, pattern, policy_version}`` in the
    order they were decided; ``skips`` the epochs skipped back to back since it was last generated."""

    prompt_id: str
    entries: list[dict] = field(default_factory=list)
    skips: int = 0

    def zero_variance_streak(self) -> int:
        """``z``: the most recent entries that are zero-variance, back to back."""
        z = 0
        for entry in reversed(self.entries):
            if entry["pattern"] not in ZERO_VARIANCE:
                break
            z += 1
        return z

    def record(self, epoch: int, pattern: str, policy_version: int) -> None:
        """A generated group of ``epoch`` was decided with ``pattern``; a redelivered outcome of
        an epoch already recorded changes nothing."""
        if any(e["epoch"] == epoch for e in self.entries):
            return
        self.entries.append({"epoch": epoch, "pattern": pattern, "policy_version": policy_version})
        self.skips = 0

    def to_record(self) -> dict:
        """The ``PromptHistory`` event (topic ``prompt.history``, compacted, key prompt_id)."""
        return {"prompt_id": self.prompt_id, "entries": [dict(e) for e in self.entries], "skips": self.skips}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "PromptHistory":
        return cls(record["prompt_id"], [dict(e) for e in record["entries"]], int(record.get("skips", 0)))


@dataclass
class ExploreState:
    """The adapted exploration probabilities and the window of recent generated groups'
    patterns they adapt on (kept in the AdmissionState, so a restart resumes them)."""

    explore: dict[str, float] = field(default_factory=dict)  # all_correct / all_wrong -> p_e
    recent: list[str] = field(default_factory=list)  # patterns of the last ``window`` generated groups

    @classmethod
    def initial(cls, limits: HistoryLimits) -> "ExploreState":
        return cls({c: limits.explore_init for c in ZERO_VARIANCE}, [])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, limits: HistoryLimits) -> "ExploreState":
        return cls(dict(data["explore"]), list(data["recent"])) if data else cls.initial(limits)


@dataclass(frozen=True)
class SkipDecision:
    """Whether to skip a prompt in an epoch, and why: ``probability`` = the skip probability
    (per epoch: (1 - p_e ** z) ** (1 + skips); paced by versions: S(E)), ``draw`` the seeded
    uniform it was compared with; ``forced`` when ``max_skips`` admitted it; ``elapsed`` = E
    when paced by versions, else None."""

    skip: bool
    probability: float
    zero_variance_streak: int
    explore: float
    draw: float
    forced: bool = False
    elapsed: int | None = None

    def values(self) -> dict[str, float]:
        values = {"skip_probability": self.probability, "zero_variance_streak": float(self.zero_variance_streak),
                  "explore_probability": self.explore, "draw": self.draw}
        return values if self.elapsed is None else {**values, "versions_elapsed": float(self.elapsed)}


def zero_variance_odds(history: PromptHistory | None, state: ExploreState) -> tuple[float, int, float]:
    """``(1 - p_e ** z, z, p_e)`` for ``history``: the chance one draw skips it (None or a
    streak of 0: ``(0.0, 0, 1.0)``, never skipped)."""
    if history is None or not history.entries:
        return 0.0, 0, 1.0
    z = history.zero_variance_streak()
    if z == 0:
        return 0.0, 0, 1.0
    p_e = state.explore[history.entries[-1]["pattern"]]
    return 1.0 - p_e ** z, z, p_e


def skip_probability(history: PromptHistory | None, state: ExploreState) -> tuple[float, int, float]:
    """``((1 - p_e ** z) ** (1 + skips), z, p_e)`` for ``history`` (None: no history,
    probability 0); ``skips`` the epochs it has been skipped back to back (module doc)."""
    odds, z, p_e = zero_variance_odds(history, state)
    return (odds ** (1 + history.skips) if odds else 0.0), z, p_e


def still_skipped(odds: float, elapsed: float, revisit_versions: int) -> float:
    """``S(E) = odds ** (x (x + 1) / 2)``, ``x = elapsed / revisit_versions``: the probability that
    a prompt skipped with ``odds`` per GRESO epoch is still skipped ``elapsed`` versions on
    (module doc). 1 at ``elapsed`` 0; ``odds`` at one epoch's worth of versions."""
    x = elapsed / revisit_versions
    return odds ** (x * (x + 1) / 2)


def decide_skip(history: PromptHistory | None, state: ExploreState, limits: HistoryLimits,
                prompt_id: str, epoch: int, policy_version: int = 0) -> SkipDecision:
    """Skip ``prompt_id`` (its base id) in ``epoch`` or not (module doc). Epoch 0 never skips.
    ``policy_version``: the newest published version, read when ``limits.revisit_versions`` is set."""
    if limits.revisit_versions and epoch > 0 and history is not None and history.entries:
        return _decide_by_versions(history, state, limits, prompt_id, policy_version)
    probability, z, p_e = skip_probability(history, state) if epoch > 0 else (0.0, 0, 1.0)
    draw = random.Random(f"{limits.seed}/{prompt_id}/{epoch}").random()
    if probability > 0 and history is not None and history.skips >= limits.max_skips:
        return SkipDecision(False, probability, z, p_e, draw, forced=True)
    return SkipDecision(draw < probability, probability, z, p_e, draw)


def _decide_by_versions(history: PromptHistory, state: ExploreState, limits: HistoryLimits, prompt_id: str,
                        policy_version: int) -> SkipDecision:
    odds, z, p_e = zero_variance_odds(history, state)
    last = history.entries[-1]
    elapsed = max(0, policy_version - int(last["policy_version"]))
    probability = still_skipped(odds, elapsed, limits.revisit_versions) if odds else 0.0
    draw = random.Random(f"{limits.seed}/{prompt_id}/{last['epoch']}/revisit").random()
    if probability > 0 and elapsed >= limits.max_skips * limits.revisit_versions:
        return SkipDecision(False, probability, z, p_e, draw, forced=True, elapsed=elapsed)
    return SkipDecision(draw < probability, probability, z, p_e, draw, elapsed=elapsed)


def on_skip(history: PromptHistory) -> PromptHistory:
    history.skips += 1
    return history


def observe(state: ExploreState, limits: HistoryLimits, pattern: str) -> ExploreState:
    """A generated train group was decided with ``pattern`` (module doc: adapt ``p_e``)."""
    if pattern not in PATTERNS:
        return state
    state.recent = (state.recent + [pattern])[-limits.window:]
    for cls, target in ((ALL_CORRECT, limits.target_all_correct), (ALL_WRONG, limits.target_all_wrong)):
        share = state.recent.count(cls) / len(state.recent)
        delta = -limits.step if share > target else limits.step
        state.explore[cls] = min(1.0, max(limits.explore_min, state.explore[cls] + delta))
    return state
