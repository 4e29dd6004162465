"""Whether a run learns: its figures per policy version, from decision-plane records only.

* ``validation``: each validation round (the prompts generated again by version ``v`` every
  ``eval_steps``; rollstream.filtering.admission) -- accuracy (mean ``acc`` score, else 1 for a
  reward > 0), mean reward, unbiased pass@1 / pass@n (Chen et al. 2021, eq. 1), per domain too.
  A round is keyed by the version it was started for; ``generated_by`` lists the versions that
  actually generated it (a later one when the trainer moved on meanwhile), ``decided_ms`` when
  its last group was decided (epoch ms).
* ``train``: the on-policy reward of *all* generated train responses by the version that
  generated them (every RewardedResponse on ``responses.rewarded``, kept or filtered), with
  their count and response tokens.
* ``filtering``: by the decided group's policy version, groups decided and accepted, retention
  and responses generated per accepted response; prompts skipped by the history filter are
  counted apart (they were never generated).

``curve`` joins them: one row per version, what the report plots.

``difficulty`` says whether filtering can pay on a run's data: the share of its generated train
groups that were zero-variance (every response the same reward: all-correct or all-wrong,
screened-out groups included), the response tokens spent on them, and the share of all
generated train tokens that accepted groups carried to the trainer.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, Mapping, Sequence

from rollstream.filtering.admission import eval_version_of
from rollstream.filtering.history import ZERO_VARIANCE, reward_pattern
from rollstream.filtering.reasons import RejectReason
from rollstream.tools.stats import pass_at_k

SKIPPED = RejectReason.SKIPPED_BY_HISTORY.value
SCREENED = RejectReason.SCREENED_OUT.value


def mean(values: Iterable[float]) -> float | None:
    """The mean of the finite values, rounded to 4 places; None when there are none."""
    finite = [float(v) for v in values if math.isfinite(v)]
    return round(sum(finite) / len(finite), 4) if finite else None


def pass_at_ks(groups: Sequence[Sequence[bool]]) -> dict[str, float | None]:
    """``pass@1`` and ``pass@n`` (n = samples per prompt; unbiased) over groups of equal size;
    empty when there are none or their sizes differ."""
    sizes = {len(g) for g in groups if g}
    if len(sizes) != 1:
        return {}
    (n,) = sizes
    return {f"pass@{k}": mean(pass_at_k(n, sum(g), k) for g in groups) for k in sorted({1, n})}


def correct(rewarded: Mapping) -> bool:
    """A response counts as correct when its ``acc`` score is >= 1, or, without one, when its
    reward is > 0."""
    scores = rewarded.get("scores") or {}
    if "acc" in scores:
        return float(scores["acc"]) >= 1.0
    reward = float(rewarded.get("response_level_reward", math.nan))
    return math.isfinite(reward) and reward > 0


def _validation_round(groups: list[dict]) -> dict:
    members = [r for g in groups for r in g["responses"]]
    by_domain: dict[str, list[dict]] = defaultdict(list)
    for g in groups:
        by_domain[g["domain"]].append(g)
    return {
        "groups": len(groups),
        "responses": len(members),
        "accuracy": mean(float(correct(r)) for r in members),
        "reward_mean": mean(r["response_level_reward"] for r in members),
        **pass_at_ks([[correct(r) for r in g["responses"]] for g in groups]),
        "generated_by": sorted({int(r["response"]["policy_version"]) for r in members}),
        "decided_ms": max((int(g.get("created_ms", 0)) for g in groups), default=0),
        "domains": {d: {"groups": len(gs), "accuracy": mean(float(correct(r)) for g in gs for r in g["responses"]),
                        **pass_at_ks([[correct(r) for r in g["responses"]] for g in gs])}
                    for d, gs in sorted(by_domain.items())},
    }


def validation_by_version(validation: Iterable[dict]) -> dict[int, dict]:
    """Validation groups (``groups.validation``) by the round's policy version."""
    rounds: dict[int, list[dict]] = defaultdict(list)
    for g in validation:
        rounds[eval_version_of(g["prompt_id"])].append(g)
    return {v: _validation_round(gs) for v, gs in sorted(rounds.items())}


def train_by_version(rewarded: Iterable[dict]) -> dict[int, dict]:
    """Train RewardedResponse records by the policy version that generated them."""
    by: dict[int, list[dict]] = defaultdict(list)
    for r in rewarded:
        if r["response"].get("mode", "train") == "train":
            by[int(r["response"]["policy_version"])].append(r)
    return {v: {"responses": len(rs), "tokens": sum(int(r["response"].get("response_length", 0)) for r in rs),
                "reward_mean": mean(r["response_level_reward"] for r in rs),
                "accuracy": mean(float(correct(r)) for r in rs)} for v, rs in sorted(by.items())}


def filtering_by_version(decided: Iterable[dict], group_size: int) -> dict[int, dict]:
    """The filters' train decisions (accepted and rejected Groups, the trainer's own rejections
    left out) by the group's policy version."""
    by: dict[int, dict] = defaultdict(lambda: {"groups_decided": 0, "groups_accepted": 0, "responses_generated": 0,
                                              "prompts_skipped": 0})
    for g in decided:
        row = by[int(g["policy_version"])]
        if g["reason"] == SKIPPED:
            row["prompts_skipped"] += 1
            continue
        row["groups_decided"] += 1
        row["groups_accepted"] += int(g["accepted"])
        row["responses_generated"] += int(g["responses_generated"])
    out = {}
    for v, row in sorted(by.items()):
        accepted_responses = row["groups_accepted"] * group_size
        out[v] = {**row, "retention": round(row["groups_accepted"] / row["groups_decided"], 4)
                  if row["groups_decided"] else None,
                  "responses_per_accepted_response": round(row["responses_generated"] / accepted_responses, 3)
                  if accepted_responses else None}
    return out


def difficulty(rewarded: Iterable[dict], decided: Iterable[dict]) -> dict:
    """The module doc's ``difficulty`` from train RewardedResponse records and the filters'
    decided train Groups (skipped ones carry no responses and count nowhere). Tokens are
    response tokens (``response_length``); a group's are all its prompt's generated responses,
    the ones its response filter rejected included."""
    tokens_of: dict[str, int] = defaultdict(int)
    for r in rewarded:
        if r["response"].get("mode", "train") == "train":
            tokens_of[r["response"]["prompt_id"]] += int(r["response"].get("response_length", 0))
    generated = [g for g in decided if g.get("responses_generated", 0) > 0]
    zero = [g for g in generated if reward_pattern([r["response_level_reward"] for r in g["responses"]])
            in ZERO_VARIANCE]
    total = sum(tokens_of.values())
    trained = sum(int(r["response"].get("response_length", 0)) for g in generated if g["accepted"]
                  for r in g["responses"])
    return {"groups_generated": len(generated),
            "zero_variance_share": round(len(zero) / len(generated), 4) if generated else None,
            "tokens_generated": total, "zero_variance_tokens": sum(tokens_of[g["prompt_id"]] for g in zero),
            "tokens_trained_on": trained,
            "share_of_tokens_trained_on": round(trained / total, 4) if total else None}


def screening(decided: Iterable[dict]) -> dict:
    """Two-phase screening's figures over decided train Groups: groups ``screened_out``, those
    generated in full to check the screen (``screening.diagnose``: ``checked_in_full``) and
    ``false_rejection_rate``, the share of those whose full group would have been kept (None
    without such groups)."""
    screened = [g for g in decided if g["reason"] == SCREENED]
    checked = [g["decision_values"]["full_group_kept"] for g in screened
               if "full_group_kept" in (g.get("decision_values") or {})]
    return {"screened_out": len(screened), "checked_in_full": len(checked),
            "false_rejection_rate": round(sum(checked) / len(checked), 4) if checked else None}


def learning_curve(validation: Iterable[dict], rewarded: Iterable[dict], decided: Iterable[dict],
                   group_size: int) -> dict:
    """``{"validation", "train", "filtering", "curve"}`` (module doc); version keys are strings
    in the result (JSON)."""
    val = validation_by_version(validation)
    train = train_by_version(rewarded)
    filt = filtering_by_version(decided, group_size)
    curve = []
    for v in sorted(set(val) | set(train) | set(filt)):
        row: dict = {"policy_version": v}
        if v in val:
            row.update({"val_accuracy": val[v]["accuracy"], **{f"val_{k}": x for k, x in val[v].items()
                                                               if k.startswith("pass@")}})
        if v in train:
            row.update({"train_reward": train[v]["reward_mean"], "train_accuracy": train[v]["accuracy"]})
        if v in filt:
            row.update({k: filt[v][k] for k in ("retention", "responses_per_accepted_response", "prompts_skipped")})
        curve.append(row)
    return {"validation": {str(k): x for k, x in val.items()}, "train": {str(k): x for k, x in train.items()},
            "filtering": {str(k): x for k, x in filt.items()}, "curve": curve}


def first_reaching(curve: Sequence[Mapping], key: str, threshold: float) -> Mapping | None:
    """The first row of ``curve`` whose ``key`` is >= ``threshold``; None when none is."""
    return next((row for row in curve if row.get(key) is not None and row[key] >= threshold), None)


def final_round_done(validation: Iterable[dict], eval_steps: int, last_version: int) -> bool:
    """Whether the validation round of ``last_version``'s block (``v // eval_steps`` equal to
    ``last_version // eval_steps``) has as many groups as the first round (version 0). True when
    that block is the first one."""
    if last_version // eval_steps == 0:
        return True
    rounds: dict[int, int] = defaultdict(int)
    for g in validation:
        rounds[eval_version_of(g["prompt_id"])] += 1
    return any(v // eval_steps == last_version // eval_steps and n >= rounds.get(0, 0)
               for v, n in rounds.items() if v > 0)
