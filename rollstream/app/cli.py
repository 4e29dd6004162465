"""`rollstream ...`: the one command line for the local default and for scale-out stages."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# Stages and the trainer share the CPU cores; OpenMP threads that spin while idle (the default)
# starve the other processes. Sleeping idle threads halved the demo's wall time
# (benchmarks/cpu_sharing.py). Set before torch starts its OpenMP runtime; an explicit value wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import typer
from rich.console import Console
from rich.live import Live
from rich.markup import escape

from rollstream.app.options import command_options
from rollstream.app.render import print_audit, print_whatif, replay_row, replay_table, stats_table
from rollstream.exceptions import CONFIG_ERROR_EXIT, ConfigError, RollstreamError
from rollstream.kafka.admin import check_copartitioned, create_pipeline_topics, wait_for_broker
from rollstream.kafka.broker import DEFAULT_DATA_DIR, daemon_status, start_daemon, stop_daemon
from rollstream.kafka.clients import make_producer
from rollstream.kafka.cluster import Cluster
from rollstream.kafka.topics import DEFAULT_PREFIX, TOPICS, Topics
from rollstream.tools.replay import Predicate, Selection, parse_time_ms
from rollstream.tools.replay import replay as replay_topic
from rollstream.tools.stats import figures, latest

# Commands that need them import their heavy stacks when they run: the config's filter statistics
# (torch), model code, faust stages and matplotlib take 1.5-10 s to import, and `broker`,
# `replay` and `stats` need none of it.

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Rollout filtering and dynamic resampling for LLM RL on Kafka.")
broker_app = typer.Typer(no_args_is_help=True, help="The embedded single-node Apache Kafka (KRaft, 127.0.0.1).")
app.add_typer(broker_app, name="broker")
console = Console(soft_wrap=True)  # a message is one line, whatever the width (logs, grep)
err = Console(stderr=True, soft_wrap=True)

BOOTSTRAP_OPT = typer.Option(..., "--bootstrap", "-b", help="Kafka bootstrap servers, host:port[,host:port] "
                             "(`rollstream broker start` prints the local one's).")
SECURITY_CONFIG_OPT = typer.Option(None, "--config", "-c", help="A pipeline YAML whose `kafka:` security settings "
                                   "(SASL/TLS) to connect with; plaintext without one.")
DATA_DIR_OPT = typer.Option(DEFAULT_DATA_DIR, "--data-dir", help="Broker data dir (log, kraft data, broker.json).")
OVERRIDES_ARG = typer.Argument(None, metavar="[KEY=VALUE]...", show_default=False,
                               help="Config overrides, e.g. max_steps=4 actor_train.lr=1e-6 "
                               "rewards.gsm8k.query_filter_config.filter_args.std_threshold=0.1 "
                               "(dotted keys; values in YAML syntax: lists, booleans, null).")
PRINT_CONFIG_OPT = typer.Option(False, "--print-config", help="Print the resolved config (file + overrides + "
                                "defaults) as YAML and exit.")


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        console.print(f"rollstream {version('rollstream')}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                          help="Print the installed version and exit.")) -> None:
    """Rollout filtering and dynamic resampling for LLM RL on Kafka."""


def _fail(exc: Exception, code: int = 2) -> None:
    err.print(f"[bold red]error:[/] {escape(str(exc))}")  # escaped: `trainer.loggers=[nope]` is no markup
    raise typer.Exit(code)


@broker_app.command("start")
def broker_start(data_dir: Path = DATA_DIR_OPT,
                 port: Optional[int] = typer.Option(None, help="Client port (one broker); free one when omitted."),
                 brokers: int = typer.Option(1, "--brokers", min=1, max=9, help="Nodes: 3 gives a replicated "
                                             "KRaft cluster on loopback (each node a broker and a controller)."),
                 sasl: bool = typer.Option(False, "--sasl", help="SASL/SCRAM on the client port: a user is created "
                                           "and written to <data-dir>/sasl.env for the ROLLSTREAM_KAFKA_* variables.")) -> None:
    """Start a broker (or a cluster) that keeps running after this command; prints its bootstrap address."""
    if port is not None and brokers > 1:
        _fail(ValueError("--port applies to one broker; a cluster picks free ports"))
    try:
        state = start_daemon(data_dir, port=port, brokers=brokers, sasl=sasl)
    except RollstreamError as exc:
        _fail(exc)
    pids = ", ".join(str(n["pid"]) for n in state["nodes"])
    console.print(f"broker ready at [bold]{state['bootstrap']}[/] (pid {pids}, log {state['log_path']})")
    if state["sasl"]:
        console.print(f"SASL/SCRAM ({state['sasl']['mechanism']}): user and password in {state['sasl']['env_file']}; "
                      f"`set -a; . {state['sasl']['env_file']}; set +a` and set kafka.security_protocol: SASL_PLAINTEXT, "
                      f"kafka.sasl_mechanism: {state['sasl']['mechanism']}")


@broker_app.command("stop")
def broker_stop(data_dir: Path = DATA_DIR_OPT) -> None:
    """Stop the broker started with `broker start` (no JVM is left behind)."""
    console.print("broker stopped" if stop_daemon(data_dir) else "no broker was running")


@broker_app.command("status")
def broker_status(data_dir: Path = DATA_DIR_OPT) -> None:
    """Print the broker's state as JSON; exit code 1 when none runs."""
    status = daemon_status(data_dir)
    if status is None:
        console.print("no broker running")
        raise typer.Exit(1)
    console.print_json(json.dumps(status))


def _reach(bootstrap: str, cfg=None) -> Cluster:
    """The cluster at ``bootstrap`` with the security of ``cfg.kafka`` (PLAINTEXT without a
    config), once it answers; a clear error and exit code 2 when it does not, or refuses the
    credentials."""
    try:
        cluster = Cluster.from_config(bootstrap, cfg.kafka) if cfg is not None else Cluster(bootstrap)
        wait_for_broker(cluster, timeout=float(os.environ.get("ROLLSTREAM_BROKER_WAIT_S", "15")))
    except RollstreamError as exc:
        _fail(exc)
    return cluster


def _config(path: Path, overrides: Optional[list[str]] = None, print_config: bool = False):
    """The validated config of ``path`` with ``overrides``; a clear error and exit code 2 when it is
    not valid. ``print_config``: print it as YAML and exit 0."""
    import yaml

    from rollstream.config import load_config

    try:
        cfg = load_config(path, overrides or ())
    except RollstreamError as exc:
        _fail(exc)
    if print_config:
        console.print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="", markup=False,
                      highlight=False)
        raise typer.Exit(0)
    return cfg


def _security_config(path: Optional[Path], overrides: Optional[list[str]]):
    """The config of a command whose ``-c`` only brings the cluster's security settings: None
    without one; overrides without a config are a clear error."""
    if path is None:
        if overrides:
            _fail(ValueError(f"overrides {' '.join(overrides)} given without a config (-c)"))
        return None
    return _config(path, overrides)


@app.command()
def worker(
    stage: str = typer.Argument(..., help="RLVR: admission | aggregator | generation | reward; agentic: group-queue | env; both: trainer"),
    config: Path = typer.Option(..., "--config", "-c", help="Pipeline YAML."),
    bootstrap: str = BOOTSTRAP_OPT,
    max_idle_s: Optional[float] = typer.Option(None, help="Exit after this many seconds without input (plain workers)."),
    instance: int = typer.Option(0, help="generation/reward/env: this process owns partitions p with p % instances == instance."),
    instances: int = typer.Option(1, help="generation/reward/env: number of processes sharing the stage's partitions."),
    metrics_port: int = typer.Option(0, "--metrics-port", envvar="ROLLSTREAM_METRICS_PORT",
                                     help="Serve Prometheus /metrics on this port (0: off; snapshots go to the metrics topic anyway)."),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", min=1,
                                              help="reward: processes running user reward functions (default: reward_concurrency)."),
    overrides: Optional[list[str]] = OVERRIDES_ARG,
    print_config: bool = PRINT_CONFIG_OPT,
) -> None:
    """Run one stage against any Kafka cluster; start more processes to scale out."""
    from rollstream.app.stages import Stage, load_engine, run_stage

    try:
        stage_enum = Stage(stage)
    except ValueError:
        _fail(ValueError(f"unknown stage {stage!r}; valid: {[s.value for s in Stage]}"))
    cfg = _config(config, overrides, print_config)
    if not 0 <= instance < instances:
        _fail(ValueError(f"--instance must be in [0, --instances={instances}), got {instance}"))
    try:
        engine = load_engine(stage_enum, cfg, instance, instances)  # a model loads while the broker may still start
    except RollstreamError as exc:
        _fail(exc)
    cluster = _reach(bootstrap, cfg)
    try:
        run_stage(stage_enum, cfg, cluster, max_idle_s=max_idle_s, instance=instance, instances=instances,
                  metrics_port=metrics_port, concurrency=concurrency, engine=engine)
    except ConfigError as exc:  # found while running (a reward's metric, say): a restart fails the same way
        _fail(exc, CONFIG_ERROR_EXIT)
    except RollstreamError as exc:
        _fail(exc)


@app.command("create-topics")
def create_topics_cmd(
    config: Path = typer.Option(..., "--config", "-c", help="Pipeline YAML (topic prefix, partitions)."),
    bootstrap: str = BOOTSTRAP_OPT,
    overrides: Optional[list[str]] = OVERRIDES_ARG,
    print_config: bool = PRINT_CONFIG_OPT,
) -> None:
    """Create every topic of the config's prefix (idempotent) and check co-partitioning."""
    cfg = _config(config, overrides, print_config)
    cluster = _reach(bootstrap, cfg)
    topics = Topics(cfg.kafka.topic_prefix)
    try:
        create_pipeline_topics(cluster, cfg.kafka)
        check_copartitioned(cluster, topics.keyed())
    except RollstreamError as exc:
        _fail(exc)
    console.print(f"topics ready under prefix {topics.prefix!r}")


@dataclass(frozen=True)
class ProducePromptsOptions:
    config: Path = typer.Option(..., "--config", "-c", help="Pipeline YAML (topic prefix, rewards domains, seed).")
    bootstrap: str = BOOTSTRAP_OPT
    file: Optional[str] = typer.Option(None, "--file", help="Publish this .jsonl / .json / .parquet file or Hugging "
                                       "Face datasets folder instead of the config's datasets.")
    domain: Optional[str] = typer.Option(None, "--domain", help="--file: the reward domain of every row.")
    domain_key: Optional[str] = typer.Option(None, "--domain-key", help="--file: the key of each row's reward domain.")
    mode: str = typer.Option("train", "--mode", help="--file: train or val.")
    prompt_key: Optional[str] = typer.Option(None, "--prompt-key", help="--file: the key of the prompt text (one user turn).")
    messages_key: Optional[str] = typer.Option(None, "--messages-key", help="--file: the key of the chat messages.")
    ground_truth_key: Optional[str] = typer.Option(None, "--ground-truth-key", help="--file: the key of the reference "
                                                   "answer (dotted path, e.g. reward_model.ground_truth).")
    id_key: Optional[str] = typer.Option(None, "--id-key", help="--file: the key of each row's id (default <file stem>-<row>).")
    num_samples: Optional[int] = typer.Option(None, "--num-samples", min=1, help="--file: the first N rows (default all).")
    prompt_template: Optional[str] = typer.Option(None, "--prompt-template", help="--file: wraps a text prompt; contains {question}.")
    end: bool = typer.Option(True, "--end/--no-end", help="Write the PromptsEnd marker after the prompts (--no-end: more "
                             "prompts will follow; admission waits for them).")
    overrides: Optional[list[str]] = OVERRIDES_ARG
    print_config: bool = PRINT_CONFIG_OPT


@app.command("produce-prompts")
@command_options(ProducePromptsOptions)
def produce_prompts_cmd(o: ProducePromptsOptions) -> None:
    """Publish prompts to the prompts topic, then the end-of-data marker: the config's datasets
    (interleaved by domain_interleave_probs), or with --file a file of your own mapped by keys
    (checked row by row before anything is sent)."""
    from pydantic import ValidationError

    from rollstream.app.producer import config_prompts, produce_prompts
    from rollstream.config import AgenticConfig, DatasetConfig
    from rollstream.exceptions import validation_problems

    cfg = _config(o.config, o.overrides, o.print_config)
    if isinstance(cfg, AgenticConfig):
        _fail(ValueError(f"{o.config} is an agentic config: it has no prompts; use start-groups"))
    keys = {k: getattr(o, k) for k in ("domain", "domain_key", "prompt_key", "messages_key", "ground_truth_key",
                                       "id_key", "num_samples", "prompt_template")}
    prompts = None
    if o.file is None:
        given = [f"--{k.replace('_', '-')}" for k, v in keys.items() if v is not None] + (["--mode"] if o.mode != "train" else [])
        if given:
            _fail(ValueError(f"{', '.join(given)} apply to --file only"))
    else:
        try:
            dataset = DatasetConfig(source=o.file, mode=o.mode, **{k: v for k, v in keys.items() if v is not None})
        except ValidationError as exc:
            _fail(ValueError("; ".join(validation_problems(exc))))
        unknown = sorted(dataset.domains - set(cfg.rewards))
        if unknown:
            _fail(ValueError(f"{o.file}: domain {unknown[0]!r} has no rewards entry in {o.config}; known: {sorted(cfg.rewards)}"))
        try:
            prompts = config_prompts(cfg, [dataset])
        except ValueError as exc:
            _fail(exc)
    cluster = _reach(o.bootstrap, cfg)
    sent = produce_prompts(cfg, cluster, prompts, end=o.end, producer_name="produce-prompts")
    console.print(f"produced {sent} prompts" + (", then the end-of-data marker" if o.end and (prompts is not None or cfg.datasets) else ""))


@app.command("start-groups")
def start_groups_cmd(
    config: Path = typer.Option(..., "--config", "-c", help="Agentic pipeline YAML (its env groups)."),
    bootstrap: str = BOOTSTRAP_OPT,
    overrides: Optional[list[str]] = OVERRIDES_ARG,
    print_config: bool = PRINT_CONFIG_OPT,
) -> None:
    """Agentic: open every env group of the config (train and val) on the group queue."""
    from rollstream.app.producer import start_env_groups
    from rollstream.config import AgenticConfig

    cfg = _config(config, overrides, print_config)
    if not isinstance(cfg, AgenticConfig):
        _fail(ValueError(f"{config} is an RLVR config; start-groups needs an agentic one (train_env_manager)"))
    cluster = _reach(bootstrap, cfg)
    console.print(f"started {start_env_groups(cfg, cluster)} env groups")


@app.command()
def run(
    config_arg: Optional[Path] = typer.Argument(None, metavar="[CONFIG]", show_default=False,
                                                help="Pipeline YAML, e.g. examples/rlvr_math.yaml (or -c)."),
    config_opt: Optional[Path] = typer.Option(None, "--config", "-c", help="Pipeline YAML, as every other command "
                                              "takes it (the same as the positional CONFIG)."),
    summary_json: Optional[Path] = typer.Option(None, "--summary-json", help="Also write the summary here."),
    report_html: Optional[Path] = typer.Option(None, "--report", help="Also write the HTML report (`rollstream "
                                               "report`) here, before the local broker stops."),
    replace: bool = typer.Option(False, "--replace", help="Delete the previous run of the same name once this one "
                                 "has started (default: keep it as runs/<name>.<its start>)."),
    overrides: Optional[list[str]] = OVERRIDES_ARG,
    print_config: bool = PRINT_CONFIG_OPT,
) -> None:
    """Run every stage on the local default (or the configured cluster) until the batches are built.
    KEY=VALUE arguments override the config's keys (`rollstream run examples/rlvr_math.yaml max_steps=4`).
    A previous run of the same name is kept as runs/<name>.<its start> (see --replace)."""
    import psutil

    from rollstream.app.run import run_pipeline

    started_ms = int(psutil.Process().create_time() * 1000)  # the start-up figures count from the command
    overrides = list(overrides or [])
    if config_arg is not None and "=" in str(config_arg) and config_opt is not None:
        config_arg, overrides = None, [str(config_arg), *overrides]  # `run -c FILE k=v`: the first override
    if config_arg is None and config_opt is None:
        _fail(ValueError("no config given: `rollstream run -c examples/rlvr_math.yaml` (or the path alone)"))
    if config_arg is not None and config_opt is not None and config_arg != config_opt:
        _fail(ValueError(f"two configs given ({config_arg} and -c {config_opt}); give one"))
    cfg = _config(config_opt or config_arg, overrides, print_config)
    if report_html is not None and report_html.is_dir():
        _fail(ValueError(f"--report {report_html} is a directory; give a file name, e.g. {report_html / 'report.html'}"))
    try:
        summary = run_pipeline(cfg, summary_json=summary_json, console=console, report_html=report_html,
                               started_ms=started_ms, replace=replace)
    except RollstreamError as exc:
        _fail(exc)
    if summary["outcome"] == "config_error":  # found by a stage at run time: bad input, as at config load
        raise typer.Exit(2)
    if summary["outcome"] not in ("complete", "end_of_data"):  # the data running out is a normal end
        raise typer.Exit(3)


@dataclass(frozen=True)
class ReplayOptions:
    topic: str = typer.Argument(..., help="Topic: a full name, or a logical one (groups.rejected) under --prefix.")
    bootstrap: str = BOOTSTRAP_OPT
    prefix: str = typer.Option(DEFAULT_PREFIX, "--prefix", help="Prefix of logical topic names.")
    where: list[str] = typer.Option([], "--where", "-w", help="FIELD=VALUE (or != >= <= > <); dotted paths; repeat to AND.")
    key: Optional[str] = typer.Option(None, "--key", help="Only records with this key.")
    partition: list[int] = typer.Option([], "--partition", "-p", help="Only these partitions (repeat).")
    from_offset: Optional[int] = typer.Option(None, "--from-offset", help="First offset (per partition).")
    to_offset: Optional[int] = typer.Option(None, "--to-offset", help="Stop before this offset (per partition).")
    since: Optional[str] = typer.Option(None, "--since", help="Record time >= this (epoch ms or ISO 8601, UTC).")
    until: Optional[str] = typer.Option(None, "--until", help="Record time < this (epoch ms or ISO 8601, UTC).")
    output: str = typer.Option("jsonl", "--format", "-f", help="jsonl or table.")
    follow: bool = typer.Option(False, "--follow", help="Keep reading new records until interrupted.")
    limit: Optional[int] = typer.Option(None, "--limit", help="Stop after this many selected records.")
    to_topic: Optional[str] = typer.Option(None, "--to-topic", help="Re-inject the selected records (same key and bytes) into this topic (a full name: --prefix does not apply).")
    payloads: bool = typer.Option(False, "--payloads", help="Fetch the token payloads the shown records reference (one fetch per page) and show each member's token counts and text; JSON lines carry the payload record under `payload`, the reference under `payload_ref`. Without it only references are shown and no payload topic is read.")
    config: Optional[Path] = SECURITY_CONFIG_OPT
    overrides: Optional[list[str]] = OVERRIDES_ARG


@app.command()
@command_options(ReplayOptions)
def replay(o: ReplayOptions) -> None:
    """Decode a rollstream topic: what was filtered and why (e.g. `replay groups.rejected -w reason=zero_std`)."""
    try:
        if o.output not in ("jsonl", "table"):
            raise ValueError(f"--format must be jsonl or table, got {o.output!r}")
        if o.limit is not None and o.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {o.limit}")
        if o.from_offset is not None and o.from_offset < 0:
            raise ValueError(f"--from-offset must be >= 0, got {o.from_offset}")
        selection = Selection(
            from_offset=o.from_offset, to_offset=o.to_offset, key=o.key, partitions=tuple(o.partition) or None,
            since_ms=parse_time_ms(o.since) if o.since else None, until_ms=parse_time_ms(o.until) if o.until else None,
            predicates=tuple(Predicate.parse(w) for w in o.where))
    except ValueError as exc:
        _fail(exc)
    name = Topics(o.prefix).name(o.topic) if o.topic in TOPICS else o.topic
    if o.to_topic is not None and o.to_topic == name:
        _fail(ValueError("--to-topic must differ from the topic read"))
    cluster = _reach(o.bootstrap, _security_config(o.config, o.overrides))
    _print_replay(cluster, name, selection, o)


def _print_replay(bootstrap: Cluster, name: str, selection, o: ReplayOptions) -> None:
    """Stream the selection as JSON lines (or collect a rich table), re-injecting into
    ``o.to_topic`` on request; ``o.payloads``: with the referenced token payloads resolved
    (rollstream.tools.replay.replay)."""
    producer = make_producer(bootstrap) if o.to_topic else None
    table = replay_table() if o.output == "table" else None
    count = 0
    try:
        for item in replay_topic(bootstrap, name, selection, follow=o.follow, limit=o.limit, payloads=o.payloads):
            count += 1
            if producer is not None:
                producer.send(o.to_topic, key=item.record.key, value=item.record.raw)
            if table is not None:
                table.add_row(*replay_row(item))
            else:
                print(json.dumps(item.to_json(), sort_keys=True), flush=True)
    except (RollstreamError, ValueError) as exc:  # a missing topic, or a selection the topic cannot meet
        _fail(exc)
    except KeyboardInterrupt:
        pass
    finally:
        if producer is not None:
            producer.flush()
            producer.close()
    if table is not None:
        console.print(table)
    err.print(f"{count} record{'s' if count != 1 else ''}" + (f" re-injected into {o.to_topic}" if o.to_topic else ""))
    if count == 0 and selection.predicates:
        err.print("no record matched: a field that an event lacks never matches; fields are dotted paths "
                  "into the decoded event (e.g. response.mode, decision_values.std); see `replay TOPIC --limit 1`")


@app.command()
def whatif(
    config: Path = typer.Option(..., "--config", "-c", help="The alternative config (its kafka.topic_prefix names the recorded run)."),
    bootstrap: str = BOOTSTRAP_OPT,
    prefix: Optional[str] = typer.Option(None, "--prefix", help="Recorded run's topic prefix, if not the config's."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the report here."),
    overrides: Optional[list[str]] = OVERRIDES_ARG,
    print_config: bool = PRINT_CONFIG_OPT,
) -> None:
    """Re-decide a recorded run with another config's filters, offline; report beside what happened."""
    from rollstream.tools.whatif import run_whatif

    cfg = _config(config, overrides, print_config)
    if prefix is not None:
        cfg = cfg.model_copy(update={"kafka": cfg.kafka.model_copy(update={"topic_prefix": prefix})})
    cluster = _reach(bootstrap, cfg)
    try:
        report = run_whatif(cfg, cluster)
    except (RollstreamError, ValueError) as exc:
        _fail(exc)
    if report["actual"]["groups_decided"] == 0 and not report["needs_generation"]:
        _fail(ValueError(f"no recorded {report['pipeline']} train groups under prefix {cfg.kafka.topic_prefix!r}: "
                         "is it the run's prefix (--prefix), and the run's kind of pipeline?"))
    print_whatif(report, str(config), console)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2))


@app.command()
def export(
    config: Path = typer.Option(..., "--config", "-c", help="The run's config (its kafka.topic_prefix names the topics)."),
    bootstrap: str = BOOTSTRAP_OPT,
    out: Path = typer.Option(..., "--out", "-o", help="The Parquet file to write (replaced when it exists)."),
    rejected: bool = typer.Option(False, "--rejected", help="Also the rejected groups (column `decision`)."),
    prefix: Optional[str] = typer.Option(None, "--prefix", help="Topic prefix, if not the config's."),
    overrides: Optional[list[str]] = OVERRIDES_ARG,
    print_config: bool = PRINT_CONFIG_OPT,
) -> None:
    """Write a run's decided train groups to Parquet, one row per response or trajectory, tokens
    fetched by reference (loads with the `datasets` Parquet loader)."""
    from rollstream.config import AgenticConfig
    from rollstream.tools.export import export_run

    cfg = _config(config, overrides, print_config)
    if out.is_dir():
        _fail(ValueError(f"--out {out}: a directory; give a file name, e.g. {out / 'groups.parquet'}"))
    if not out.parent.is_dir():
        _fail(ValueError(f"--out {out}: its folder {out.parent} does not exist"))
    cluster = _reach(bootstrap, cfg)
    try:
        done = export_run(cluster, Topics(prefix or cfg.kafka.topic_prefix), out,
                          agentic=isinstance(cfg, AgenticConfig), rejected=rejected)
    except RollstreamError as exc:
        _fail(exc)
    rows = ", ".join(f"{n} {k}" for k, n in done.rows.items() if k == "accepted" or rejected)
    console.print(f"wrote {out}: {rows} rows from {sum(done.groups.values())} groups"
                  + (f"; {done.payload_errors} payloads could not be fetched" if done.payload_errors else ""))


@app.command()
def report(
    config: Path = typer.Option(..., "--config", "-c", help="The run's config (its kafka.topic_prefix names the topics)."),
    bootstrap: str = BOOTSTRAP_OPT,
    out: Path = typer.Option(Path("report.html"), "--out", "-o", help="The HTML file to write (one self-contained page)."),
    prefix: Optional[str] = typer.Option(None, "--prefix", help="Topic prefix, if not the config's."),
    overrides: Optional[list[str]] = OVERRIDES_ARG,
    print_config: bool = PRINT_CONFIG_OPT,
) -> None:
    """Write an HTML report of a run read back from its topics (plots embedded)."""
    from rollstream.tools.report import write_report

    cfg = _config(config, overrides, print_config)
    if out.is_dir():
        _fail(ValueError(f"--out {out} is a directory; give a file name, e.g. {out / 'report.html'}"))
    cluster = _reach(bootstrap, cfg)
    plots, with_data = write_report(cluster, Topics(prefix or cfg.kafka.topic_prefix), out, f"rollstream run {cfg.name}")
    console.print(f"wrote {out} ({plots} plots, {with_data} with data)")
    if with_data == 0:
        err.print(f"[yellow]warning:[/] nothing recorded under prefix {prefix or cfg.kafka.topic_prefix!r}")


@app.command()
def audit(
    config: Path = typer.Option(..., "--config", "-c", help="The run's config (its kafka.topic_prefix names the topics)."),
    bootstrap: str = BOOTSTRAP_OPT,
    prefix: Optional[str] = typer.Option(None, "--prefix", help="Topic prefix, if not the config's."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="The run's folder (default runs/<name>): its "
                                           "trainer manifest batches.jsonl, when there is one."),
    no_dead_letters: bool = typer.Option(False, "--no-dead-letters", help="Fail when there is any dead letter."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the report here."),
    overrides: Optional[list[str]] = OVERRIDES_ARG,
    print_config: bool = PRINT_CONFIG_OPT,
) -> None:
    """Check a run's invariants from its topics and manifest; exit code 1 when one fails."""
    from rollstream.config import AgenticConfig
    from rollstream.tools.audit import audit_summary, run_audit

    cfg = _config(config, overrides, print_config)
    cluster = _reach(bootstrap, cfg)
    manifest = (run_dir or Path("runs") / cfg.name) / "batches.jsonl"
    try:
        report = run_audit(cluster, Topics(prefix or cfg.kafka.topic_prefix), isinstance(cfg, AgenticConfig),
                           manifest, fail_on_dead_letters=no_dead_letters)
    except (RollstreamError, ValueError) as exc:
        _fail(exc)
    print_audit(report.pipeline, audit_summary(report), report.counts, report.dead_letters, console)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report.to_json(), indent=2))
    if not report.ok:
        err.print(f"[bold red]audit failed:[/] {', '.join(c.name for c in report.failed)}")
        raise typer.Exit(1)


@app.command()
def stats(
    bootstrap: str = BOOTSTRAP_OPT,
    prefix: str = typer.Option(DEFAULT_PREFIX, "--prefix", help="The run's topic prefix (its config's kafka.topic_prefix)."),
    follow: bool = typer.Option(False, "--follow", help="Refresh live until interrupted."),
    interval_s: float = typer.Option(2.0, "--interval", help="Refresh period with --follow."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON instead of a table."),
    config: Optional[Path] = SECURITY_CONFIG_OPT,
    overrides: Optional[list[str]] = OVERRIDES_ARG,
) -> None:
    """The pipeline's live figures from the workers' metric snapshots (topic `metrics`)."""
    bootstrap = _reach(bootstrap, _security_config(config, overrides))
    topic = Topics(prefix).metrics
    try:
        records = [r.record.value for r in replay_topic(bootstrap, topic, Selection()) if r.record.value]
    except (RollstreamError, ValueError) as exc:
        _fail(ValueError(f"{exc} (is --prefix the run's topic prefix?)"))
    if not follow:
        view = figures(latest(records))
        console.print_json(json.dumps(view)) if as_json else console.print(stats_table(view))
        return
    with Live(stats_table(figures(latest(records))), console=console, refresh_per_second=2) as live:
        try:
            last = time.monotonic()
            for item in replay_topic(bootstrap, topic, Selection(since_ms=int(time.time() * 1000)), follow=True):
                if item.record.value:
                    records.append(item.record.value)
                if time.monotonic() - last >= interval_s:
                    live.update(stats_table(figures(latest(records))))
                    last = time.monotonic()
        except KeyboardInterrupt:
            pass


def main() -> None:
    app()


if __name__ == "__main__":
    main()
