"""The run summary, derived from the durable events on a run's topics (never from in-process
counters): what `rollstream run` prints and writes to ``summary.json``. Keys are listed in
docs/demo.md and docs/agentic.md.

Only decision-plane events are read: the payload topics (``responses``, ``trajectories``) carry
every response's token arrays (16k-64k tokens each in real runs) and are never fetched. Response
figures come from ``responses.rewarded`` (one RewardedResponse per generated Response, its
``ResponseSummary`` has the lengths, finish reason and policy version); trajectory figures from
the TrajectorySummary members of the group events (see ``summarize_agentic``)."""

from __future__ import annotations

import re
import time
from functools import partial
from typing import Callable

from rollstream.config import AgenticConfig, RLVRConfig
from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.topics import Topics
from rollstream.filtering.reasons import RejectReason
from rollstream.filtering.response_filters import REWARD_FAILURE
from rollstream.schemas import decode
from rollstream.schemas.records import is_set_aside
from rollstream.kafka.readback import TopicTail, first_record_ms, records_written
from rollstream.tools.readback import filter_decisions, read_values
from rollstream.tools.learning import SKIPPED, difficulty, learning_curve, pass_at_ks, screening
from rollstream.tools.learning import mean as _mean
from rollstream.tools.stats import PREFIX as SNAPSHOT_PREFIX
from rollstream.tools.stats import percentiles


Reader = Callable[[str], list[dict]]
"""A topic's decoded values (``read_values`` on a cluster, or a ``TopicTail``'s ``values``)."""


def summarize_rlvr(config: RLVRConfig, bootstrap: Bootstrap, topics: Topics, batches: list[dict], outcome: str,
              detail: str, elapsed: float, read: Reader | None = None) -> dict:
    """The run summary, derived from the durable events on the topics (each read with ``read``;
    default ``read_values`` on ``bootstrap``).

    Response figures (``responses_generated``, ``responses_per_accepted_response``,
    ``finish_reasons``, ``response_tokens_mean``, ``generated_by_policy_version``) count the
    RewardedResponse events on ``responses.rewarded``: the reward worker writes one for every
    Response it reads (NaN reward and ``reward_error`` when it could not score one), so they are
    the generated responses, bar a Response dead-lettered as undecodable."""
    read = read or partial(read_values, bootstrap)
    requests = read(topics.generation_requests)
    rewarded = read(topics.responses_rewarded)
    responses = [r["response"] for r in rewarded]
    accepted = read(topics.groups_accepted)
    rejected, stale_at_trainer = filter_decisions(accepted, read(topics.groups_rejected))
    validation = read(topics.groups_validation)
    dead = read(topics.dead_letter)
    prompts_admitted = len({r["prompt_id"] for r in requests if r["round"] == 0})
    domains = {d: {"accepted": 0, "rejected": 0} for d in config.rewards}
    by_reason: dict[str, int] = {}
    for g in accepted:
        domains[g["domain"]]["accepted"] += 1
    for g in rejected:
        domains[g["domain"]]["rejected"] += 1
        by_reason[g["reason"]] = by_reason.get(g["reason"], 0) + 1
    skipped = by_reason.get(SKIPPED, 0)  # never generated: not in the retention
    decided = len(accepted) + len(rejected) - skipped
    accepted_responses = sum(len(g["responses"]) for g in accepted)
    train_responses = sum(1 for r in responses if r.get("mode", "train") == "train")
    learning = learning_curve(validation, rewarded, accepted + rejected, config.num_return_sequences_in_group)
    return {
        "outcome": outcome,
        "detail": detail,
        "elapsed_seconds": round(elapsed, 2),
        "prompts_admitted": prompts_admitted,
        "responses_generated": len(responses),
        "replacement_requests": sum(1 for r in requests if r["round"] > 0),
        "replacement_responses_requested": sum(r["num_return_sequences"] for r in requests if r["round"] > 0),
        "groups_accepted": len(accepted),
        **trained_groups(accepted, stale_at_trainer, batches, dead, topics.groups_accepted),
        "groups_rejected": dict(sorted(by_reason.items())),
        "groups_stale_at_trainer": stale_at_trainer,
        "domains": domains,
        "batches": [
            {"step": b["step"], "status": b["status"], "groups": b["accepted_groups"],
             "responses_per_group": b["responses_per_group"], "fill_seconds": round(b["fill_seconds"], 2),
             **({"end_of_data": True} if b.get("end_of_data") else {}), **_training(b)}
            for b in batches
        ],
        "group_arrival_lag_ms": _arrival_lag(batches),
        "retention_rate": round(len(accepted) / decided, 4) if decided else 0.0,
        "responses_per_accepted_response": round(train_responses / accepted_responses, 3) if accepted_responses else None,
        # validation bypasses every filter: all its groups are kept and scored unfiltered
        "validation": {
            "groups": len(validation),
            "responses": sum(len(g["responses"]) for g in validation),
            "correct_mean": _mean([r["scores"].get("acc", 0.0) for g in validation for r in g["responses"]]),
            **pass_at_ks([[r["scores"].get("acc", 0.0) >= 1.0 for r in g["responses"]] for g in validation]),
            "by_policy_version": learning["validation"],
        },
        "train_reward_by_policy_version": learning["train"],
        "prompts_skipped_by_history": skipped,
        "difficulty": difficulty(rewarded, accepted + rejected),
        "screening": screening(rejected),
        "learning_curve": learning["curve"],
        "reward": {
            "all": _mean([r["response_level_reward"] for g in accepted + rejected for r in g["responses"]]),
            "accepted": _mean([r["response_level_reward"] for g in accepted for r in g["responses"]]),
        },
        "reward_failures": reward_failures(rewarded),
        "dead_letters": len(dead),
        "finish_reasons": _counts(r["finish_reason"] for r in responses),
        "response_tokens_mean": round(sum(r["response_length"] for r in responses) / len(responses), 1)
        if responses else 0.0,
        **_policy(read, topics, [r["policy_version"] for r in responses]),
        "engine": config.actor_infer.backend,
        "weight_updates": weight_updates(read(topics.metrics)),
    }


def trained_groups(accepted: list[dict], stale_at_trainer: int, batches: list[dict], dead: list[dict],
                   accepted_topic: str) -> dict:
    """``groups_trained``: the accepted groups in the run's batches; ``groups_untrained``: the
    ``accepted`` groups (by distinct key: a redelivered one counts once) in none, neither trained,
    rejected by the trainer (stale, payload_expired) nor dead-lettered by it (a payload it could
    not train: in ``dead``, the dead letters, from ``accepted_topic``): the run ended first, and
    they stay uncommitted on ``groups.accepted``, where a later trainer of the same group id finds
    them."""
    trained = sum(b["accepted_groups"] for b in batches)
    keys = {g["group_key"] for g in accepted}
    dead_keys = set()
    for letter in dead:
        if letter["source_topic"] == accepted_topic:
            try:
                dead_keys.add(decode(letter["payload"])[1]["group_key"])
            except Exception:  # a malformed event, never a group
                continue
    return {"groups_trained": trained,
            "groups_untrained": max(0, len(keys) - len(keys & dead_keys) - stale_at_trainer - trained)}


# what the reward function did wrong, not the engine (an ``engine_error`` response is passed through)
FUNCTION_FAILURES = (RejectReason.REWARD_ERROR.value, RejectReason.REWARD_TIMEOUT.value,
                     RejectReason.INVALID_REWARD.value)


RAISED = re.compile(r"([A-Za-z_][\w.]*): ")  # "ValueError: ..." (the reward pool's text of a raise)


def reward_failures(rewarded: list[dict]) -> list[dict]:
    """The responses the reward function could not score, from RewardedResponse records: one
    entry per (``failure``: reward_error, reward_timeout or invalid_reward; ``kind``: for a
    raise, the exception's type that starts ``reward_error``; else the failure), with its
    ``count`` and the first ``example`` message; most frequent first."""
    out: dict[tuple[str, str], dict] = {}
    for r in rewarded:
        failure = (r.get("meta") or {}).get(REWARD_FAILURE)
        if failure not in FUNCTION_FAILURES:
            continue
        error = r.get("reward_error") or ""
        raised = RAISED.match(error) if failure == RejectReason.REWARD_ERROR.value else None
        kind = raised.group(1) if raised else failure
        entry = out.setdefault((failure, kind), {"failure": failure, "kind": kind, "count": 0, "example": error})
        entry["count"] += 1
    return sorted(out.values(), key=lambda e: (-e["count"], e["failure"], e["kind"]))


def weight_updates(metrics: list[dict]) -> list[dict]:
    """The inference servers' in-place weight loads from the ``metrics`` records: one entry per
    (version, server), ``ms`` from the pause to the resume, by version."""
    latest = {}
    for m in metrics:
        if m["name"] == "rollstream_weight_update_ms":
            labels = m["labels"]
            latest[(int(labels["version"]), labels["server"])] = {
                "version": int(labels["version"]), "server": labels["server"], "mode": labels["mode"],
                "ms": round(m["value"], 1)}
    return [latest[key] for key in sorted(latest)]


def summarize_agentic(config: AgenticConfig, bootstrap: Bootstrap, topics: Topics, batches: list[dict], outcome: str,
                      detail: str, elapsed: float, read: Reader | None = None) -> dict:
    """The agentic run summary: the RLVR summary's keys (a prompt is an episode, a response a
    trajectory, a domain an env tag) plus the group queue's own figures.

    Trajectories are known from the decision plane only: every TrajectorySummary in a group event
    (accepted, rejected, validation, and the single set-aside ones), each trajectory once (a group
    the trainer rejected as stale is on two topics). ``trajectories_played`` /
    ``responses_generated`` count the records ever written to ``trajectories``, from its end
    offsets (no record is read; those the trainer has deleted since count too). The
    per-trajectory figures (``success_rate``, ``finish_reasons``, ``response_tokens_mean`` (model
    tokens), ``turns_mean``, ``generated_by_policy_version``) cover the trajectories in group
    events: a late run (arrived after its episode was decided; ``late_trajectories``) and the runs
    of episodes still open when the run ended are in none. ``responses_per_accepted_response``
    counts the train trajectories in group events plus the late train runs. ``read`` as for
    ``summarize_rlvr``."""
    read = read or partial(read_values, bootstrap)
    requests = read(topics.episodes_requests)
    accepted = read(topics.groups_accepted)
    rejected_all, stale_at_trainer = filter_decisions(accepted, read(topics.groups_rejected))
    validation = read(topics.groups_validation)
    metrics = [m for m in read(topics.metrics) if m["name"].startswith(("group_queue/", "scheduler/"))]
    dead = read(topics.dead_letter)
    # single trajectories set aside (unit "trajectory") are not group decisions
    aside = [g for g in rejected_all if is_set_aside(g)]
    rejected = [g for g in rejected_all if not is_set_aside(g)]
    by_reason = _counts(g["reason"] for g in rejected)
    tags = {t: {"accepted": 0, "rejected": 0} for t in config.custom_envs}
    for g in accepted:
        tags[g["tag"]]["accepted"] += 1
    for g in rejected:
        tags[g["tag"]]["rejected"] += 1
    trajectories = _decided_trajectories(accepted + rejected_all + validation)
    played = records_written(bootstrap, topics.trajectories)
    late = [m for m in metrics if m["name"] == "group_queue/late_trajectories"]
    train_traj = [t for t in trajectories if t.get("mode", "train") == "train"]
    train_played = len(train_traj) + int(sum(m["value"] for m in late if m["labels"].get("mode", "train") == "train"))
    accepted_traj = sum(len(g["trajectories"]) for g in accepted)
    decided = len(accepted) + len(rejected)
    saved = [m["value"] for m in metrics if m["name"] == "group_queue/redundancy_saved_ms"]
    model_tokens = [t["model_tokens"] for t in trajectories]
    episodes = len({(r["mode"], r["group_id"], r["episode_id"]) for r in requests})
    reruns = sum(1 for r in requests if r["cause"] != "start")  # refills and reissues
    return {
        "outcome": outcome,
        "detail": detail,
        "elapsed_seconds": round(elapsed, 2),
        "prompts_admitted": episodes,
        "episodes_started": episodes,
        "responses_generated": played,
        "trajectories_played": played,
        "replacement_requests": reruns,
        "replacement_responses_requested": reruns,
        "requests_by_cause": _counts(r["cause"] for r in requests),
        "groups_accepted": len(accepted),
        **trained_groups(accepted, stale_at_trainer, batches, dead, topics.groups_accepted),
        "groups_rejected": by_reason,
        "groups_stale_at_trainer": stale_at_trainer,
        "domains": tags,
        "batches": [
            {"step": b["step"], "status": b["status"], "groups": b["accepted_groups"],
             "responses_per_group": b["responses_per_group"], "trajectories_per_group": b["responses_per_group"],
             "fill_seconds": round(b["fill_seconds"], 2), **_training(b)}
            for b in batches
        ],
        "group_arrival_lag_ms": _arrival_lag(batches),
        "retention_rate": round(len(accepted) / decided, 4) if decided else 0.0,
        "responses_per_accepted_response": round(train_played / accepted_traj, 3) if accepted_traj else None,
        "episodes_replaced": int(sum(m["value"] for m in metrics if m["name"] == "group_queue/episodes_replaced")),
        "late_trajectories": int(sum(m["value"] for m in late)),
        "group_filter_count": int(sum(m["value"] for m in metrics if m["name"] == "scheduler/group_filter_count")),
        "infra_aborts": sum(g["reason"] == "infra_abort" for g in aside),
        "trajectories_set_aside": _counts(g["reason"] for g in aside),
        "redundancy_saved_ms": {"episodes": len(saved), "mean": _mean(saved), "max": max(saved) if saved else None},
        "validation": {
            "groups": len(validation),
            "original": len(validation),
            "accepted": sum(1 for g in validation if g["accepted"]),
            "rejected": sum(1 for g in validation if not g["accepted"]),
            "responses": sum(len(g["trajectories"]) for g in validation),
            "correct_mean": _mean([float(t["success"]) for g in validation for t in g["trajectories"]]),
        },
        "reward": {
            "all": _mean([t["response_level_rewards"] for g in accepted + rejected for t in g["trajectories"]]),
            "accepted": _mean([t["response_level_rewards"] for g in accepted for t in g["trajectories"]]),
        },
        "success_rate": _mean([float(t["success"]) for t in train_traj]),
        "dead_letters": len(dead),
        "finish_reasons": _counts(t["stop_reason"] for t in trajectories),
        "response_tokens_mean": round(sum(model_tokens) / len(model_tokens), 1) if model_tokens else 0.0,
        "turns_mean": round(sum(t["num_turns"] for t in trajectories) / len(trajectories), 2) if trajectories else 0.0,
        **_policy(read, topics, [t["policy_version"] for t in trajectories]),
    }


def _decided_trajectories(groups: list[dict]) -> list[dict]:
    """The TrajectorySummary members of group events, each trajectory (mode, group id, episode,
    run) once, first seen first."""
    seen: dict[tuple, dict] = {}
    for g in groups:
        for t in g["trajectories"]:
            seen.setdefault((t.get("mode", "train"), t["group_id"], t["episode_id"], t["traj_index"]), t)
    return list(seen.values())


TRAINING_KEYS = ("loss", "skipped", "policy_version", "final_mask_mean", "pass_rates", "ratio_means", "diff_means",
                 "mask_collapse", "reward_mean", "grad_norm", "pg_clipfrac", "policy_lag_max", "generator_versions",
                 "train_seconds", "trained_ms", "old_log_probs_pass")


def _policy(read: Reader, topics: Topics, generated_by: list[int]) -> dict:
    """The policy versions published and how many responses/trajectories each one generated."""
    published = read(topics.policy_versions)
    return {"policy_versions_published": sorted({p["version"] for p in published}),
            "generated_by_policy_version": {str(k): v for k, v in sorted(_counts(generated_by).items())}}


def startup_seconds(bootstrap: Bootstrap, topics: Topics, agentic: bool, started_ms: int,
                    read: Reader | None = None) -> dict:
    """Seconds from a run's start (``started_ms``, epoch ms) to its first request for generation
    (``first_request``: a GenerationRequest; agentic, an EpisodeRequest) and to its first generated
    response (``first_response``: a Response; agentic, a finished Trajectory), from the first
    record timestamps of their topics (the producers' clocks, one machine's for `rollstream run`),
    and to the first token an engine sampled (``first_token``, from the ``metrics`` topic read
    with ``read``, as the summary reads it); None where a topic stayed empty."""
    read = read or partial(read_values, bootstrap)
    requests, responses = ((topics.episodes_requests, topics.trajectories) if agentic
                           else (topics.generation_requests, topics.responses))
    out = {}
    for name, topic in (("first_request", requests), ("first_response", responses)):
        first = first_record_ms(bootstrap, topic)
        out[name] = None if first is None else round((first - started_ms) / 1000, 2)
    stamps = [m["value"] for m in read(topics.metrics) if m.get("name") == "rollstream_first_token_ms" and m["value"] > 0]
    out["first_token"] = round((min(stamps) - started_ms) / 1000, 2) if stamps else None
    return out


def _arrival_lag(batches: list[dict]) -> dict:
    """The trained groups' lag from their decision (the group event's ``created_ms``) to their
    arrival in the trainer's batch builder, in ms (the manifest's ``arrival_lag_ms``):
    ``groups`` counted and their percentiles (rollstream.tools.stats.percentiles)."""
    lags = [lag for b in batches for lag in b.get("arrival_lag_ms", []) if lag is not None]
    return {"groups": len(lags), **percentiles(lags)}


def _training(batch: dict) -> dict:
    """The training step's figures of a manifest entry (none when training is off)."""
    return {k: batch[k] for k in TRAINING_KEYS if k in batch}


def _counts(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


class LiveSummary:
    """The run summary so far, for the experiment trackers (rollstream.observability.trackers):
    ``summarize_rlvr`` / ``summarize_agentic`` over the topics read on from call to call (a
    TopicTail: a record is fetched and decoded once), taken after each committed step on the
    trackers' reading thread, off the training step's path. The workers' periodic snapshots on
    ``metrics`` (``rollstream_*`` samples) are not kept: no tracker figure needs them and they
    are most of that topic, so its ``weight_updates`` stays empty. The other decision-plane
    records are held for the run, as the end-of-run summary reads them. Connects on its first
    call; one caller thread."""

    def __init__(self, config: RLVRConfig | AgenticConfig, bootstrap: Bootstrap, topics: Topics) -> None:
        self.config, self.bootstrap, self.topics = config, bootstrap, topics
        self._started = time.monotonic()
        self._tail: TopicTail | None = None

    def __call__(self) -> dict:
        """The summary of the records on the topics now (outcome ``running``, no batches)."""
        if self._tail is None:
            self._tail = TopicTail(self.bootstrap, keep={self.topics.metrics: _not_a_snapshot})
        summarize = summarize_agentic if isinstance(self.config, AgenticConfig) else summarize_rlvr
        return summarize(self.config, self.bootstrap, self.topics, [], "running", "",
                         time.monotonic() - self._started, read=self._tail.values)

    def close(self) -> None:
        if self._tail is not None:
            self._tail.close()


def _not_a_snapshot(metric: dict) -> bool:
    return not metric["name"].startswith(SNAPSHOT_PREFIX)
