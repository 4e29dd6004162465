"""`rollstream stats`: the pipeline's figures from the workers' metric snapshots on ``metrics``.

Each worker publishes cumulative samples (rollstream.observability.metrics); the newest sample per (worker,
name, labels) counts, summed over workers.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

PREFIX = "rollstream_"


def latest(records: list[dict]) -> dict[tuple, float]:
    """(name, labels as a sorted tuple) -> value summed over workers, newest sample per worker.
    Records that are not rollstream_* snapshots (e.g. the group queue's per-event metrics) are
    skipped."""
    newest: dict[tuple, tuple[int, float]] = {}
    for r in records:
        if not r["name"].startswith(PREFIX):
            continue
        key = (r["worker"], r["name"], tuple(sorted(r["labels"].items())))
        if key not in newest or r["created_ms"] >= newest[key][0]:
            newest[key] = (r["created_ms"], r["value"])
    out: dict[tuple, float] = defaultdict(float)
    for (_, name, labels), (_, value) in newest.items():
        out[(name, labels)] += value
    return dict(out)


def figures(samples: dict[tuple, float]) -> dict:
    """The stats view: per unit decided / rejected / retention and rejections by reason,
    in-flight, replacement rounds, reward all vs accepted, validation, the train and validation
    reward mean and ``positive_share`` (the share of rewards > 0; the summary's accuracy reads the
    ``acc`` score instead, which differs when rewards are not 0/1) by policy version, batch
    fill, events."""
    def get(name: str, **labels) -> float:
        return samples.get((PREFIX + name, tuple(sorted(labels.items()))), 0.0)

    units: dict[str, dict] = {}
    for (name, labels), value in samples.items():
        lab = dict(labels)
        if name == PREFIX + "decided_total":
            unit = units.setdefault(lab["unit"], {"accepted": 0.0, "rejected": 0.0, "reasons": {}})
            unit[lab["outcome"]] += value
        elif name == PREFIX + "rejections_total":
            units.setdefault(lab["unit"], {"accepted": 0.0, "rejected": 0.0, "reasons": {}})["reasons"][lab["reason"]] = value
    for unit in units.values():
        total = unit["accepted"] + unit["rejected"]
        unit["retention"] = round(unit["accepted"] / total, 4) if total else None

    def mean(scope: str) -> float | None:
        n = get("reward_count", scope=scope)
        return round(get("reward_sum", scope=scope) / n, 4) if n else None

    by_version: dict[str, dict[int, dict]] = {"train": {}, "val": {}}
    for (name, labels), value in samples.items():
        if name.startswith(PREFIX + "version_"):
            lab = dict(labels)
            row = by_version.setdefault(lab["mode"], {}).setdefault(int(lab["policy_version"]), {})
            row[name.removeprefix(PREFIX + "version_")] = value
    learning = {mode: {str(v): {"responses": int(r.get("reward_count", 0)),
                                "reward_mean": round(r["reward_sum"] / r["reward_count"], 4) if r.get("reward_count") else None,
                                "positive_share": round(r.get("correct_count", 0) / r["reward_count"], 4)
                                if r.get("reward_count") else None}
                       for v, r in sorted(rows.items())} for mode, rows in by_version.items()}
    fills = get("batch_fill_seconds_count")
    return {
        "units": dict(sorted(units.items())),
        "in_flight": {dict(l)["kind"]: v for (n, l), v in samples.items() if n == PREFIX + "in_flight"},
        "replacement_rounds": get("replacement_rounds_total"),
        "reward": {"all": mean("all"), "accepted": mean("accepted")},
        "validation": {o: get("validation_total", outcome=o) for o in ("original", "accepted", "rejected")},
        "by_policy_version": learning,
        "batches": {"count": fills, "fill_seconds_mean": round(get("batch_fill_seconds_sum") / fills, 2) if fills else None},
        "events": {dict(l)["stage"]: v for (n, l), v in samples.items() if n == PREFIX + "events_total"},
    }


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct among ``n`` samples (Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code", eq. 1): 1 - C(n-c, k) / C(n, k).
    n = 4, c = 1: pass@4 = 1.0 (not 1 - (3/4)^4 = 0.684). Raises ValueError unless
    0 <= c <= n and 1 <= k <= n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def percentiles(values: list[float]) -> dict[str, float]:
    """``p50``, ``p90``, ``p99``, ``max`` and ``mean`` of ``values`` (inclusive method: the
    percentiles lie within the values), rounded to 0.1; empty for no values."""
    if not values:
        return {}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"p50": round(q[49], 1), "p90": round(q[89], 1), "p99": round(q[98], 1),
            "max": round(max(values), 1), "mean": round(sum(values) / len(values), 1)}
