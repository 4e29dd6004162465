"""`rollstream audit`: a run's invariants checked from its topics and the trainer's manifest.

The checks are pure functions of the records read back (``audit_rlvr``, ``audit_agentic``), so
a test, a fault experiment and a user's own run are judged the same way:

* every admitted prompt (a round-0 GenerationRequest) or started episode (an EpisodeRequest) has
  one decision: several different outcomes fail; none is *pending*, which fails only once the
  admission said the data ended (every admitted prompt is decided before that verdict). The
  same decision written twice (at-least-once delivery after a crash) is counted, not failed:
  every consumer recognises it;
* an RLVR outcome agrees with its group: a commit has a group on ``groups.accepted`` (or an
  accepted validation group), an abort a rejected one;
* every accepted group is trained at most once, and only accepted groups are trained; the others
  are pending (or rejected by the trainer as stale or with an expired payload);
* no group is both accepted and rejected, apart from the trainer's own stale / payload_expired
  rejections, which re-publish groups the filters had accepted;
* dead letters are listed by reason (``fail_on_dead_letters`` makes any of them a failure).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from rollstream.filtering.reasons import RejectReason
from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.topics import Topics
from rollstream.tools.readback import read_topic
from rollstream.trainer.manifest import Manifest

TRAINER_REJECTIONS = {RejectReason.STALE.value, RejectReason.PAYLOAD_EXPIRED.value}
TRAINED_STATUSES = {"complete", "partial", "recovered"}
MAX_LISTED = 10  # offending keys named per check


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    offending: list[str] = field(default_factory=list)


@dataclass
class AuditReport:
    pipeline: str
    checks: list[Check]
    counts: dict[str, int]
    dead_letters: dict[str, int]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def to_json(self) -> dict:
        return {"pipeline": self.pipeline, "ok": self.ok, "checks": [asdict(c) for c in self.checks],
                "counts": self.counts, "dead_letters": self.dead_letters}


def _check(name: str, offending: Iterable[str], ok_detail: str, fail_detail: str) -> Check:
    bad = sorted(set(offending))
    if not bad:
        return Check(name, True, ok_detail)
    return Check(name, False, f"{fail_detail}: {len(bad)}", bad[:MAX_LISTED])


def _trained_keys(batches: list[dict], manifest_keys: list[str] | None) -> list[str]:
    """Every group key the trainer trained, once per batch: the manifest's lines when there is
    one (the trainer's own record), else its Batch events (one per step: a `recovered` event
    repeats a step the manifest already had)."""
    if manifest_keys is not None:
        return list(manifest_keys)
    by_step = {}
    for batch in batches:
        if batch["status"] in TRAINED_STATUSES:
            by_step.setdefault(batch["step"], batch["group_keys"])
    return [k for keys in by_step.values() for k in keys]


def _split(accepted: list[dict], rejected: list[dict]) -> tuple[list[dict], set[str]]:
    """(the filters' rejections, the keys the trainer rejected). Stricter than
    rollstream.tools.readback.filter_decisions, which counts any rejection of an accepted group
    as the trainer's: here it must carry the trainer's reason, so a filter that rejected a group
    it had also accepted shows up."""
    accepted_keys = {g["group_key"] for g in accepted}
    by_trainer = {g["group_key"] for g in rejected
                  if g["group_key"] in accepted_keys and g["reason"] in TRAINER_REJECTIONS}
    return [g for g in rejected if g["group_key"] not in by_trainer or g["reason"] not in TRAINER_REJECTIONS], by_trainer


def _group_checks(accepted: list[dict], rejected: list[dict], batches: list[dict],
                  manifest_keys: list[str] | None) -> tuple[list[Check], dict[str, int]]:
    accepted_keys = {g["group_key"] for g in accepted}
    by_filters, trainer_rejected = _split(accepted, rejected)
    filter_rejected = {g["group_key"] for g in by_filters}
    trained = Counter(_trained_keys(batches, manifest_keys))
    checks = [
        _check("trained_at_most_once", [k for k, n in trained.items() if n > 1],
               f"{len(trained)} groups trained, each once", "groups trained more than once"),
        _check("only_accepted_groups_trained", set(trained) - accepted_keys,
               "every trained group was accepted", "trained groups that were never accepted"),
        _check("accepted_xor_rejected", accepted_keys & filter_rejected,
               "no group both accepted and rejected by the filters", "groups both accepted and rejected"),
    ]
    counts = {"groups_accepted": len(accepted_keys), "groups_trained": len(trained),
              "groups_pending_training": len(accepted_keys - set(trained) - trainer_rejected),
              "groups_rejected_by_trainer": len(trainer_rejected & accepted_keys),
              "duplicate_group_events": len(accepted) - len(accepted_keys)}
    return checks, counts


def _dead_letters(records: list[dict]) -> dict[str, int]:
    return dict(sorted(Counter(r["reason"] for r in records).items()))


def _dead_letter_check(dead: dict[str, int], fail: bool) -> list[Check]:
    if not fail:
        return []
    return [_check("no_dead_letters", [f"{k}={v}" for k, v in dead.items()], "no dead letters", "dead letters")]


def audit_rlvr(requests: list[dict], outcomes: list[dict], accepted: list[dict], rejected: list[dict],
               validation: list[dict], batches: list[dict], manifest_keys: list[str] | None = None,
               dead_letters: list[dict] = (), fail_on_dead_letters: bool = False) -> AuditReport:
    """The RLVR invariants (module doc) over the records of a run's topics; ``manifest_keys``:
    the trainer manifest's group keys in file order (None: judge from the Batch events)."""
    admitted = {r["prompt_id"] for r in requests if r["round"] == 0}
    decisions: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for o in outcomes:
        decisions[o["prompt_id"]].add((o["outcome"], o["reason"]))
    ended = any(b["status"] == "end_of_data" for b in batches)
    pending = admitted - set(decisions)
    groups: dict[str, set[bool]] = defaultdict(set)
    for g in [*accepted, *validation, *_split(accepted, rejected)[0]]:
        groups[g["prompt_id"]].add(g["accepted"])
    disagree = [pid for pid, ds in decisions.items() if len(ds) == 1
                and groups.get(pid) != {next(iter(ds))[0] == "commit"}]
    checks = [
        _check("one_outcome_per_prompt", [p for p, ds in decisions.items() if len(ds) > 1],
               f"{len(decisions)} prompts decided once", "prompts with conflicting outcomes"),
        _check("outcomes_of_admitted_prompts", set(decisions) - admitted,
               "every outcome is of an admitted prompt", "outcomes of prompts never admitted"),
        _check("no_prompt_left_undecided", pending if ended else (),
               f"{len(pending)} prompts still in flight" + (" (the data ended)" if ended else ""),
               "prompts undecided after the end-of-data verdict"),
        _check("outcome_matches_group", disagree, "every outcome has its group on the matching topic",
               "outcomes without their group (or with the opposite one)"),
    ]
    group_checks, counts = _group_checks(accepted, rejected, batches, manifest_keys)
    dead = _dead_letters(list(dead_letters))
    counts = {"prompts_admitted": len(admitted), "prompts_decided": len(decisions), "prompts_pending": len(pending),
              "duplicate_outcomes": len(outcomes) - len(decisions), **counts}
    return AuditReport("rlvr", [*checks, *group_checks, *_dead_letter_check(dead, fail_on_dead_letters)], counts, dead)


def audit_agentic(episode_requests: list[dict], accepted: list[dict], rejected: list[dict], validation: list[dict],
                  batches: list[dict], manifest_keys: list[str] | None = None, dead_letters: list[dict] = (),
                  fail_on_dead_letters: bool = False) -> AuditReport:
    """The agentic invariants (module doc): episodes started on ``episodes.requests`` against the
    episode-level TrajectoryGroups decided on the group topics."""
    started = {(r["mode"], r["group_id"], r["episode_id"]) for r in episode_requests}
    decisions: dict[tuple, set[tuple[bool, str]]] = defaultdict(set)
    for g in [*accepted, *_split(accepted, rejected)[0], *validation]:
        if g.get("unit") == "episode":
            decisions[(g["mode"], g["group_id"], g["episode_id"])].add((g["accepted"], g["reason"]))
    name = lambda k: f"{k[0]}/{k[1]}/{k[2]}"  # noqa: E731
    checks = [
        _check("one_decision_per_episode", [name(k) for k, ds in decisions.items() if len(ds) > 1],
               f"{len(decisions)} episodes decided once", "episodes with conflicting decisions"),
        _check("decisions_of_started_episodes", [name(k) for k in set(decisions) - started],
               "every decision is of a started episode", "decisions of episodes never started"),
    ]
    episode_groups = [g for g in accepted if g.get("unit", "episode") == "episode"]
    group_checks, counts = _group_checks(episode_groups, [g for g in rejected if g.get("unit") == "episode"],
                                         batches, manifest_keys)
    dead = _dead_letters(list(dead_letters))
    counts = {"episodes_started": len(started), "episodes_decided": len(decisions),
              "episodes_pending": len(started - set(decisions)), **counts}
    return AuditReport("agentic", [*checks, *group_checks, *_dead_letter_check(dead, fail_on_dead_letters)],
                       counts, dead)


def run_audit(bootstrap: Bootstrap, topics: Topics, agentic: bool, manifest: Path | None = None,
              fail_on_dead_letters: bool = False) -> AuditReport:
    """Read a run's topics (and its manifest, when the file exists) and audit them."""
    manifest_keys = Manifest(manifest).load().group_keys if manifest is not None and Path(manifest).exists() else None

    dead = [r.value for r in read_topic(bootstrap, topics.dead_letter) if r.schema == "DeadLetter"]
    refused = {(d["source_topic"], d["partition"], d["offset"]) for d in dead}

    def read(name: str, schema: str) -> list[dict]:
        """The ``schema`` events of topic ``name`` that took effect: an event its consumer
        dead-lettered (another schema, or a malformed one) did not, and is listed with the dead
        letters instead."""
        return [r.value for r in read_topic(bootstrap, name)
                if r.schema == schema and (r.topic, r.partition, r.offset) not in refused]

    group = "TrajectoryGroup" if agentic else "Group"
    common = dict(accepted=read(topics.groups_accepted, group), rejected=read(topics.groups_rejected, group),
                  validation=read(topics.groups_validation, group), batches=read(topics.batches, "Batch"),
                  manifest_keys=manifest_keys, dead_letters=dead, fail_on_dead_letters=fail_on_dead_letters)
    if agentic:
        return audit_agentic(read(topics.episodes_requests, "EpisodeRequest"), **common)
    return audit_rlvr(read(topics.generation_requests, "GenerationRequest"),
                      read(topics.prompt_outcomes, "PromptOutcome"), **common)


def audit_summary(report: AuditReport) -> Mapping:
    """One line per check for the CLI: name -> ``ok`` / ``FAIL``, detail."""
    return {c.name: ("ok" if c.ok else "FAIL", c.detail + (f" ({', '.join(c.offending)})" if c.offending else ""))
            for c in report.checks}
