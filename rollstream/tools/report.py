"""`rollstream report`: one self-contained HTML page about a run, read back from its topics.

Plots (matplotlib, PNG embedded as base64): the learning curve (validation and training accuracy
per policy version over retention and responses per accepted response; rollstream.tools.learning), retention over time, rejection reasons, rounds per
prompt (episodes per group id for agentic runs), batch fill times, mask fractions per training
step, and policy-version lag per step. A plot without data says so in the image (and ``data-has-data="false"`` on its figure). The page counts
its images that loaded (``data-images-loaded`` on <body>) so a headless browser can check it.

Only decision-plane topics are read (group events, rewarded-response summaries, batches, metrics, policy versions): no plot
needs a token, so the payload topics (``responses``, ``trajectories``) are never fetched.
"""

from __future__ import annotations

import base64
import html
import io
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: files only
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.topics import Topics  # noqa: E402
from rollstream.schemas.records import is_set_aside, is_trajectory_group  # noqa: E402
from rollstream.tools.learning import learning_curve  # noqa: E402
from rollstream.tools.readback import filter_decisions, read_values  # noqa: E402


@dataclass
class RunData:
    """The events a report needs (decoded records), all from decision-plane topics."""

    accepted: list[dict] = field(default_factory=list)
    rejected: list[dict] = field(default_factory=list)
    batches: list[dict] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)
    versions: list[dict] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)
    rewarded: list[dict] = field(default_factory=list)  # RewardedResponse records (summaries, no tokens)

    @classmethod
    def read(cls, bootstrap: Bootstrap, topics: Topics) -> "RunData":
        return cls(read_values(bootstrap, topics.groups_accepted), read_values(bootstrap, topics.groups_rejected),
                   read_values(bootstrap, topics.batches), read_values(bootstrap, topics.metrics),
                   read_values(bootstrap, topics.policy_versions), read_values(bootstrap, topics.groups_validation),
                   read_values(bootstrap, topics.responses_rewarded))

    def learning(self) -> dict:
        """rollstream.tools.learning.learning_curve of the run (RLVR groups; the group size is
        the largest accepted group's)."""
        groups = [g for g in self.train_groups() if not is_trajectory_group(g)]
        size = max((len(g["responses"]) for g in groups if g["accepted"]), default=1)
        return learning_curve(self.validation, self.rewarded, groups, size)

    def train_groups(self) -> list[dict]:
        """The filters' train decisions: a group the trainer later rejected as stale counts once,
        as accepted; a set-aside trajectory is not a group decision."""
        rejected, _ = filter_decisions(self.accepted, self.rejected)
        return [g for g in self.accepted + rejected if g.get("mode", "train") == "train" and not is_set_aside(g)]

    def steps(self) -> dict[int, dict]:
        """Built batches by step (Batch events are at least once: the last per step counts)."""
        return {b["step"]: b for b in self.batches if b["status"] not in ("underfilled", "end_of_data")}

    def step_metric(self, name: str) -> dict[tuple, dict[int, float]]:
        """``trainer/<name>`` samples: labels other than step -> {step: value}."""
        out: dict[tuple, dict[int, float]] = {}
        for m in self.metrics:
            if m["name"] == f"trainer/{name}":
                labels = tuple(sorted((k, v) for k, v in m["labels"].items() if k != "step"))
                out.setdefault(labels, {})[int(m["labels"]["step"])] = m["value"]
        return out


def _png(fig, has_data: bool) -> tuple[str, bool]:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode(), has_data


def _figure(title: str):
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.set_title(title)
    return fig, ax


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this run", ha="center", va="center", transform=ax.transAxes, fontsize=12)
    ax.set_xticks([])
    ax.set_yticks([])


def learning_plot(data: RunData) -> tuple[str, bool]:
    """Top: validation accuracy (each eval_steps round) and on-policy training accuracy per
    policy version. Bottom, same versions: retention (left axis) and responses generated per
    accepted response (right axis)."""
    curve = data.learning()["curve"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.2), sharex=True)
    top.set_title("Learning curve by policy version")
    has = any(r.get("val_accuracy") is not None or r.get("train_accuracy") is not None for r in curve)
    if not has:
        _no_data(top, "validation or training responses")
        bottom.set_xticks([])
        bottom.set_yticks([])
        return _png(fig, False)
    pass_keys = sorted({k for r in curve for k in r if k.startswith("val_pass@")}, key=lambda k: int(k.split("@")[1]))
    pass_n = [(pass_keys[-1], f"validation pass@{pass_keys[-1].split('@')[1]}", "^:")] if len(pass_keys) > 1 else []
    for key, label, style in (("val_accuracy", "validation accuracy (= pass@1)", "o-"), *pass_n,
                              ("train_accuracy", "training accuracy (all generated)", "s--")):
        rows = [r for r in curve if r.get(key) is not None]
        if rows:
            top.plot([r["policy_version"] for r in rows], [r[key] for r in rows], style, label=label)
    top.set_ylabel("accuracy")
    top.set_ylim(-0.02, 1.05)
    top.legend(fontsize=8)
    rows = [r for r in curve if r.get("retention") is not None]
    bottom.plot([r["policy_version"] for r in rows], [r["retention"] for r in rows], "o-", color="tab:green",
                label="retention")
    bottom.set_ylabel("retention", color="tab:green")
    bottom.set_ylim(-0.02, 1.05)
    ratio = bottom.twinx()
    rows = [r for r in curve if r.get("responses_per_accepted_response") is not None]
    ratio.plot([r["policy_version"] for r in rows], [r["responses_per_accepted_response"] for r in rows], "s--",
               color="tab:orange")
    ratio.set_ylabel("responses / accepted", color="tab:orange")
    bottom.set_xlabel("policy version")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _png(fig, True)


def retention_over_time(data: RunData) -> tuple[str, bool]:
    fig, ax = _figure("Retention over time (train groups decided)")
    groups = sorted(data.train_groups(), key=lambda g: g.get("created_ms", 0))
    has = bool(groups)
    if has:
        t0 = groups[0].get("created_ms", 0)
        xs, ys, kept = [], [], 0
        for n, g in enumerate(groups, 1):
            kept += bool(g["accepted"])
            xs.append((g.get("created_ms", 0) - t0) / 1000)
            ys.append(kept / n)
        ax.plot(xs, ys, marker=".")
        ax.set_xlabel("seconds since the first decision")
        ax.set_ylabel("accepted / decided")
        ax.set_ylim(0, 1.05)
    else:
        _no_data(ax, "decided groups")
    return _png(fig, has)


def rejection_reasons(data: RunData) -> tuple[str, bool]:
    fig, ax = _figure("Rejected groups by reason")
    reasons = Counter(g["reason"] for g in data.rejected)
    has = bool(reasons)
    if has:
        names = sorted(reasons, key=lambda r: -reasons[r])
        ax.bar(names, [reasons[r] for r in names], color="tab:red")
        ax.set_ylabel("groups")
        ax.tick_params(axis="x", rotation=30)
    else:
        _no_data(ax, "rejected groups")
    return _png(fig, has)


def rounds_per_prompt(data: RunData) -> tuple[str, bool]:
    groups = data.train_groups()
    agentic = any(is_trajectory_group(g) for g in groups)
    fig, ax = _figure("Episodes per group id" if agentic else "Generation rounds per prompt")
    if agentic:
        counts = Counter(Counter(g["group_id"] for g in groups).values())
    else:
        counts = Counter(int(g.get("rounds", 0)) for g in groups if g.get("rounds", 0) > 0)
    has = bool(counts)
    if has:
        ax.bar([str(k) for k in sorted(counts)], [counts[k] for k in sorted(counts)])
        ax.set_xlabel("episodes" if agentic else "rounds")
        ax.set_ylabel("group ids" if agentic else "prompts")
    else:
        _no_data(ax, "groups")
    return _png(fig, has)


def batch_fill_times(data: RunData) -> tuple[str, bool]:
    fig, ax = _figure("Batch fill time per step")
    steps = data.steps()
    has = bool(steps)
    if has:
        order = sorted(steps)
        ax.bar([str(s) for s in order], [steps[s]["fill_seconds"] for s in order], color="tab:green")
        ax.set_xlabel("step")
        ax.set_ylabel("seconds")
    else:
        _no_data(ax, "batches")
    return _png(fig, has)


def mask_fractions(data: RunData) -> tuple[str, bool]:
    fig, ax = _figure("Correction masks per step (share of valid tokens kept)")
    series = {"final mask": next(iter(data.step_metric("final_mask_mean").values()), {})}
    for labels, values in data.step_metric("pass_rate").items():
        check = dict(labels).get("check", "?").removeprefix("actor/train_infer_").removesuffix("_mask_mean@sum")
        series[check] = values
    series = {k: v for k, v in series.items() if v}
    has = bool(series)
    if has:
        for name, values in series.items():
            order = sorted(values)
            ax.plot(order, [values[s] for s in order], marker="o", label=name)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
    else:
        _no_data(ax, "training steps")
    return _png(fig, has)


def policy_lag(data: RunData) -> tuple[str, bool]:
    fig, ax = _figure("Policy-version lag per step (trained version - oldest generator)")
    lag = next(iter(data.step_metric("policy_lag_max").values()), {})
    has = bool(lag)
    if has:
        order = sorted(lag)
        ax.plot([str(s) for s in order], [lag[s] for s in order], marker="o", color="tab:purple")
        ax.set_xlabel("step")
        ax.set_ylabel("versions")
        ax.set_ylim(-0.1, max(1.0, max(lag.values()) + 0.5))  # a lag of 0 is a visible line, not empty axes
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        _no_data(ax, "training steps")
    return _png(fig, has)


CURVE_COLUMNS = ("policy_version", "val_accuracy", "train_accuracy", "retention", "responses_per_accepted_response")

PLOTS = (learning_plot, retention_over_time, rejection_reasons, rounds_per_prompt, batch_fill_times, mask_fractions, policy_lag)


def render_html(data: RunData, title: str) -> tuple[str, int]:
    """The report page (self-contained: no external resources) and how many plots have data."""
    groups = data.train_groups()
    accepted = sum(1 for g in groups if g["accepted"])
    facts = [("train groups decided", len(groups)), ("accepted", accepted),
             ("retention", f"{accepted / len(groups):.3f}" if groups else "-"),
             ("batches", len(data.steps())),
             ("policy versions published", ", ".join(str(v) for v in sorted({p["version"] for p in data.versions})) or "-")]
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in facts)
    curve_rows = "".join(
        f'<tr data-version="{r["policy_version"]}">' + "".join(
            f"<td>{'-' if r.get(k) is None else html.escape(str(r[k]))}</td>" for k in CURVE_COLUMNS) + "</tr>"
        for r in data.learning()["curve"])
    curve = (f"<h2>Learning curve</h2><table><tr>{''.join(f'<th>{c}</th>' for c in CURVE_COLUMNS)}</tr>"
             f"{curve_rows}</table>") if curve_rows else ""
    figures = []
    for plot in PLOTS:
        png, has_data = plot(data)
        figures.append(f'<figure data-plot="{plot.__name__}" data-has-data="{str(has_data).lower()}">'
                       f'<img alt="{plot.__name__}" src="data:image/png;base64,{png}"></figure>')
    images = "".join(figures)
    with_data = sum('data-has-data="true"' in f for f in figures)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}th,td{{padding:2px 10px;
text-align:left}}figure{{margin:1em 0}}</style></head>
<body data-images-loaded="0"><h1>{html.escape(title)}</h1><table>{rows}</table>{curve}{images}
<script>
window.addEventListener("load", function () {{
  var ok = Array.prototype.filter.call(document.images, function (i) {{ return i.complete && i.naturalWidth > 0; }});
  document.body.setAttribute("data-images-loaded", String(ok.length));
}});
</script></body></html>
""", with_data


def write_report(bootstrap: Bootstrap, topics: Topics, out, title: str) -> tuple[int, int]:
    """Read the run, write the page to ``out``; returns (plots, plots with data)."""
    page, with_data = render_html(RunData.read(bootstrap, topics), title)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(page)
    return len(PLOTS), with_data
