"""`rollstream run`: the whole RLVR or agentic pipeline on one machine.

Starts the embedded broker unless one is configured, creates the topics, starts one process per
stage (RLVR: admission, aggregator, generation, reward; agentic: group-queue, env), publishes the
config's prompts or starts its env groups, and acts as the trainer's batch builder until
``max_steps`` batches are built. It cannot loop forever: RLVR's resampling budget
(``max_prompts_per_batch``) and the agentic replacement budget (``max_replaced_episodes`` per
group id) end a hopeless step with a ``batch_underfilled`` verdict, which ships a partial batch
(``min_fill_ratio``) or ends the run, and ``time_limit_s`` bounds the wall clock. The summary is
computed from the topics afterwards.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rollstream.app.stages import Stage, groups_per_batch, pipeline_stages, preflight, start_metrics, start_training
from rollstream.config import AgenticConfig, Config, RLVRConfig
from rollstream.exceptions import StageDied
from rollstream.kafka.topics import Topics
from rollstream.tools.readback import filter_decisions, read_values
from rollstream.tools.stats import pass_at_k
from rollstream.trainer.loop import AgenticBatchEvents, BatchEvents, LoopResult, build_batches


class StageProcesses:
    """One subprocess per stage, logs under ``log_dir``; SIGTERM on close, then SIGKILL."""

    def __init__(self, config_path: Path, bootstrap: str, log_dir: Path) -> None:
        self.config_path, self.bootstrap, self.log_dir = config_path, bootstrap, log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, stage: Stage, *extra_args: str) -> str:
        """Start one process of ``stage`` (``extra_args`` appended to its command line, e.g.
        ``--instance 1 --instances 2``); returns its name (``aggregator``, ``aggregator-2``, ...),
        which also names its log file."""
        name, n = stage.value, 1
        while name in self.procs:
            n += 1
            name = f"{stage.value}-{n}"
        with open(self.log_dir / f"{name}.log", "wb") as log:  # the child keeps its own copy
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "rollstream", "worker", stage.value,
                 "--config", str(self.config_path), "--bootstrap", self.bootstrap, *extra_args],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        return name

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                lines = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
                tail = [line for line in lines if " INFO kafka." not in line][-30:]
                raise StageDied(f"stage {name} exited with {proc.returncode}; log tail:\n" + "\n".join(tail))

    def close(self, timeout: float = 15.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_pipeline(config: Config, summary_json: Path | None = None, console: Console | None = None,
                 run_dir: Path | None = None) -> dict:
    """Run the pipeline; returns the summary dict (also written to ``summary_json``)."""
    from rollstream.kafka.admin import wait_for_broker
    from rollstream.kafka.broker import EmbeddedBroker

    console = console or Console()
    preflight(config)  # a bad env type or group filter fails now, before the broker starts
    started = time.monotonic()
    run_dir = run_dir or Path("runs") / config.name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    (run_dir / "logs").mkdir(parents=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))

    broker = None
    bootstrap = config.kafka.bootstrap_servers
    if bootstrap is None:
        broker = EmbeddedBroker(run_dir / "kafka")
        with console.status("starting the local Kafka broker"):
            bootstrap = broker.start()
        console.print(f"local Kafka broker at {bootstrap} (log {broker.log_path})")
    else:
        wait_for_broker(bootstrap)
    topics = Topics(config.kafka.topic_prefix)
    stages = StageProcesses(config_path, bootstrap, run_dir / "logs")
    try:
        try:
            result = _build(config, bootstrap, topics, stages, run_dir, console, started)
        except StageDied as exc:
            result = LoopResult(outcome="stage_failed", detail=str(exc))
        finally:
            stages.close()
        summarize = summarize_agentic if isinstance(config, AgenticConfig) else summarize_rlvr
        summary = summarize(config, bootstrap, topics, result.batches, result.outcome, result.detail,
                            time.monotonic() - started)
    finally:
        if broker is not None:
            broker.stop()
    print_summary(summary, console)
    for path in {run_dir / "summary.json", *([summary_json] if summary_json else [])}:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2))
    return summary


def _build(config: Config, bootstrap: str, topics: Topics, stages: StageProcesses, run_dir: Path,
           console: Console, started: float) -> LoopResult:
    from rollstream.app.producer import produce_prompts, start_env_groups
    from rollstream.kafka.admin import create_topics
    from rollstream.trainer.consumer import BatchBuilder

    create_topics(bootstrap, topics.all(config.kafka.partitions))
    for stage in pipeline_stages(config):
        stages.start(stage)
    builder = BatchBuilder(bootstrap, topics, groups_per_batch(config), group_id=f"{topics.prefix}trainer",
                           manifest_path=run_dir / "batches.jsonl", max_staleness=config.max_staleness)
    if isinstance(config, AgenticConfig):
        n_groups = start_env_groups(config, bootstrap)
        console.print(f"started {n_groups} env groups on {topics.episodes_control}")
        events = AgenticBatchEvents(bootstrap, topics, config, builder)
    else:
        n_prompts = produce_prompts(config, bootstrap)
        console.print(f"published {n_prompts} prompts to {topics.prompts}")
        events = BatchEvents(bootstrap, topics)
    target = config.max_steps * groups_per_batch(config)
    try:
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                      TextColumn("{task.completed}/{task.total} groups"), TimeElapsedColumn(),
                      console=console) as progress:
            bar = progress.add_task("filling batches", total=target)

            def show(result: LoopResult, buffered: int) -> None:
                done = sum(b["accepted_groups"] for b in result.batches)
                last = f"batch {result.batches[-1]['step']} built" if result.batches else "filling batches"
                progress.update(bar, completed=min(target, done + buffered), description=last)

            metrics = start_metrics("trainer", bootstrap, topics)
            trainer, publisher = start_training(config, bootstrap, builder, run_dir)
            try:
                return build_batches(
                    builder, events, max_steps=config.max_steps, min_fill_ratio=config.min_fill_ratio,
                    deadline=started + config.time_limit_s, check=stages.check, on_progress=show,
                    train=trainer.train if trainer is not None else None, publish=publisher.publish_batch)
            finally:
                publisher.close()
                metrics.close()
    finally:
        events.close()
        builder.close()


def summarize_rlvr(config: RLVRConfig, bootstrap: str, topics: Topics, batches: list[dict], outcome: str,
              detail: str, elapsed: float) -> dict:
    """The run summary, derived from the durable events on the topics."""
    requests = read_values(bootstrap, topics.generation_requests)
    responses = read_values(bootstrap, topics.responses)
    accepted = read_values(bootstrap, topics.groups_accepted)
    rejected, stale_at_trainer = filter_decisions(accepted, read_values(bootstrap, topics.groups_rejected))
    validation = read_values(bootstrap, topics.groups_validation)
    dead = read_values(bootstrap, topics.dead_letter)
    prompts_admitted = len({r["prompt_id"] for r in requests if r["round"] == 0})
    domains = {d: {"accepted": 0, "rejected": 0} for d in config.rewards}
    by_reason: dict[str, int] = {}
    for g in accepted:
        domains[g["domain"]]["accepted"] += 1
    for g in rejected:
        domains[g["domain"]]["rejected"] += 1
        by_reason[g["reason"]] = by_reason.get(g["reason"], 0) + 1
    decided = len(accepted) + len(rejected)
    accepted_responses = sum(len(g["responses"]) for g in accepted)
    train_responses = sum(1 for r in responses if r.get("mode", "train") == "train")
    return {
        "outcome": outcome,
        "detail": detail,
        "elapsed_seconds": round(elapsed, 2),
        "prompts_admitted": prompts_admitted,
        "responses_generated": len(responses),
        "replacement_requests": sum(1 for r in requests if r["round"] > 0),
        "replacement_responses_requested": sum(r["num_return_sequences"] for r in requests if r["round"] > 0),
        "groups_accepted": len(accepted),
        "groups_rejected": dict(sorted(by_reason.items())),
        "groups_stale_at_trainer": stale_at_trainer,
        "domains": domains,
        "batches": [
            {"step": b["step"], "status": b["status"], "groups": b["accepted_groups"],
             "responses_per_group": b["responses_per_group"], "fill_seconds": round(b["fill_seconds"], 2),
             **_training(b)}
            for b in batches
        ],
        "retention_rate": round(len(accepted) / decided, 4) if decided else 0.0,
        "responses_per_accepted_response": round(train_responses / accepted_responses, 3) if accepted_responses else None,
        # validation bypasses every filter: all its groups are kept and scored unfiltered
        "validation": {
            "groups": len(validation),
            "responses": sum(len(g["responses"]) for g in validation),
            "correct_mean": _mean([r["scores"].get("acc", 0.0) for g in validation for r in g["responses"]]),
            **_pass_at_k([[r["scores"].get("acc", 0.0) >= 1.0 for r in g["responses"]] for g in validation]),
        },
        "reward": {
            "all": _mean([r["response_level_reward"] for g in accepted + rejected for r in g["responses"]]),
            "accepted": _mean([r["response_level_reward"] for g in accepted for r in g["responses"]]),
        },
        "dead_letters": len(dead),
        "finish_reasons": _counts(r["finish_reason"] for r in responses),
        "response_tokens_mean": round(sum(len(r["response_token_ids"]) for r in responses) / len(responses), 1)
        if responses else 0.0,
        **_policy(bootstrap, topics, [r["policy_version"] for r in responses]),
    }


def summarize_agentic(config: AgenticConfig, bootstrap: str, topics: Topics, batches: list[dict], outcome: str,
                      detail: str, elapsed: float) -> dict:
    """The agentic run summary: the RLVR summary's keys (a prompt is an episode, a response a
    trajectory, a domain an env tag) plus the group queue's own figures."""
    requests = read_values(bootstrap, topics.episodes_requests)
    trajectories = read_values(bootstrap, topics.trajectories)
    accepted = read_values(bootstrap, topics.groups_accepted)
    rejected_all, stale_at_trainer = filter_decisions(accepted, read_values(bootstrap, topics.groups_rejected))
    validation = read_values(bootstrap, topics.groups_validation)
    metrics = [m for m in read_values(bootstrap, topics.metrics) if m["name"].startswith(("group_queue/", "scheduler/"))]
    dead = read_values(bootstrap, topics.dead_letter)
    # single trajectories set aside (key mode/group/episode/traj) are not group decisions
    aside = [g for g in rejected_all if g["group_key"].count("/") == 3]
    rejected = [g for g in rejected_all if g["group_key"].count("/") != 3]
    by_reason = _counts(g["reason"] for g in rejected)
    tags = {t: {"accepted": 0, "rejected": 0} for t in config.custom_envs}
    for g in accepted:
        tags[g["tag"]]["accepted"] += 1
    for g in rejected:
        tags[g["tag"]]["rejected"] += 1
    train_traj = [t for t in trajectories if t["mode"] == "train"]
    accepted_traj = sum(len(g["trajectories"]) for g in accepted)
    decided = len(accepted) + len(rejected)
    saved = [m["value"] for m in metrics if m["name"] == "group_queue/redundancy_saved_ms"]
    model_tokens = [sum(t["response_mask"]) for t in trajectories]
    episodes = len({(r["mode"], r["group_id"], r["episode_id"]) for r in requests})
    reruns = sum(1 for r in requests if r["cause"] != "start")  # refills and reissues
    return {
        "outcome": outcome,
        "detail": detail,
        "elapsed_seconds": round(elapsed, 2),
        "prompts_admitted": episodes,
        "episodes_started": episodes,
        "responses_generated": len(trajectories),
        "trajectories_played": len(trajectories),
        "replacement_requests": reruns,
        "replacement_responses_requested": reruns,
        "requests_by_cause": _counts(r["cause"] for r in requests),
        "groups_accepted": len(accepted),
        "groups_rejected": by_reason,
        "groups_stale_at_trainer": stale_at_trainer,
        "domains": tags,
        "batches": [
            {"step": b["step"], "status": b["status"], "groups": b["accepted_groups"],
             "responses_per_group": b["responses_per_group"], "trajectories_per_group": b["responses_per_group"],
             "fill_seconds": round(b["fill_seconds"], 2), **_training(b)}
            for b in batches
        ],
        "retention_rate": round(len(accepted) / decided, 4) if decided else 0.0,
        "responses_per_accepted_response": round(len(train_traj) / accepted_traj, 3) if accepted_traj else None,
        "episodes_replaced": int(sum(m["value"] for m in metrics if m["name"] == "group_queue/episodes_replaced")),
        "late_trajectories": int(sum(m["value"] for m in metrics if m["name"] == "group_queue/late_trajectories")),
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
        "turns_mean": round(sum(len(t["turns"]) for t in trajectories) / len(trajectories), 2) if trajectories else 0.0,
        **_policy(bootstrap, topics, [t["policy_version"] for t in trajectories]),
    }


def _pass_at_k(groups: list[list[bool]]) -> dict:
    """``pass@1`` and ``pass@n`` (n = samples per validation prompt, unbiased estimator) over
    validation groups of equal size; empty when there are none."""
    sizes = {len(g) for g in groups if g}
    if len(sizes) != 1:
        return {}
    (n,) = sizes
    return {f"pass@{k}": _mean([pass_at_k(n, sum(g), k) for g in groups]) for k in sorted({1, n})}


TRAINING_KEYS = ("loss", "skipped", "policy_version", "final_mask_mean", "pass_rates", "ratio_means", "diff_means",
                 "mask_collapse", "reward_mean", "grad_norm", "pg_clipfrac", "policy_lag_max", "generator_versions",
                 "train_seconds")


def _policy(bootstrap: str, topics: Topics, generated_by: list[int]) -> dict:
    """The policy versions published and how many responses/trajectories each one generated."""
    published = read_values(bootstrap, topics.policy_versions)
    return {"policy_versions_published": sorted({p["version"] for p in published}),
            "generated_by_policy_version": {str(k): v for k, v in sorted(_counts(generated_by).items())}}


def _training(batch: dict) -> dict:
    """The training step's figures of a manifest entry (none when training is off)."""
    return {k: batch[k] for k in TRAINING_KEYS if k in batch}


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return round(sum(finite) / len(finite), 4) if finite else None


def _counts(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


def print_summary(summary: dict, console: Console) -> None:
    agentic = "episodes_started" in summary
    unit = "trajectories" if agentic else "responses"
    table = Table(title=f"rollstream run: {summary['outcome']}", show_header=False)
    keys = (("episodes_started", "trajectories_played", "requests_by_cause") if agentic else
            ("prompts_admitted", "responses_generated", "replacement_requests"))
    for key in ("elapsed_seconds", *keys, "groups_accepted", "retention_rate",
                "responses_per_accepted_response", "dead_letters"):
        table.add_row(key, str(summary[key]))
    table.add_row("groups_rejected", ", ".join(f"{k}={v}" for k, v in summary["groups_rejected"].items()) or "-")
    if summary["groups_stale_at_trainer"]:
        table.add_row("accepted, then stale at the trainer", str(summary["groups_stale_at_trainer"]))
    for domain, counts in summary["domains"].items():
        table.add_row(f"{'env' if agentic else 'domain'} {domain}",
                      f"accepted={counts['accepted']} rejected={counts['rejected']}")
    for b in summary["batches"]:
        table.add_row(f"batch {b['step']}", f"{b['groups']} groups x {b['responses_per_group']} {unit}, "
                                            f"filled in {b['fill_seconds']} s ({b['status']})")
        if "loss" in b:
            step = "skipped (every token masked)" if b["skipped"] else f"loss {b['loss']}, policy v{b['policy_version']}"
            table.add_row(f"  step {b['step']}", f"{step}, reward {b['reward_mean']}, generated by "
                                                 f"v{b['generator_versions']} (lag {b['policy_lag_max']}), "
                                                 f"{b['train_seconds']} s")
            collapse = " [mask_collapse]" if b["mask_collapse"] else ""
            table.add_row("    masks", f"final mean {b['final_mask_mean']}{collapse}; pass "
                          + (", ".join(f"{k.removeprefix('actor/train_infer_')}={v}" for k, v in b["pass_rates"].items()) or "-"))
            table.add_row("    ratio / diff means", ", ".join(
                f"{agg} {b['ratio_means'][agg]} / {b['diff_means'][agg]}" for agg in b["ratio_means"]))
    table.add_row("generated by policy version", ", ".join(
        f"v{k}: {v}" for k, v in summary["generated_by_policy_version"].items()) or "-")
    table.add_row("reward all / accepted", f"{summary['reward']['all']} / {summary['reward']['accepted']}")
    val = summary["validation"]
    if agentic:
        table.add_row("validation", f"original={val['original']} accepted={val['accepted']} rejected={val['rejected']}, "
                                    f"success mean {val['correct_mean']}")
        for key in ("episodes_replaced", "late_trajectories", "group_filter_count", "infra_aborts", "success_rate"):
            table.add_row(key, str(summary[key]))
        table.add_row("redundancy saved (ms)", f"mean {summary['redundancy_saved_ms']['mean']} over "
                                               f"{summary['redundancy_saved_ms']['episodes']} episodes")
    else:
        table.add_row("validation (unfiltered)", f"{val['groups']} groups, correct mean {val['correct_mean']}")
    if summary["detail"]:
        table.add_row("detail", summary["detail"])
    console.print(table)
