"""How long each stage takes from its process start to its first output, on a broker, warm caches.

The RLVR stages run one after another as a chain, each started (``rollstream worker <stage>``, a
subprocess as deployed) once its input is on its topic, and stopped once its first output is:
admission (a Prompt -> a GenerationRequest), generation (-> a Response: the model is loaded and
one request's samples generated), reward (-> a RewardedResponse), aggregator (the prompt's
rewarded responses -> its first decided Group). The agentic group queue: the config's start commands -> its first
EpisodeRequest. Per stage: ``first_output_s`` (process start to the first output record's
timestamp) and ``import_s`` (a process that only imports the stage's module, for the share that
is Python imports). Stages without a model should be ready within a few seconds; never asserted.

    .venv/bin/python benchmarks/startup.py --out runs/bench/startup.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from filter_stage import kafka_bootstrap, parse_args, start_worker, stop_worker, versions, write_result  # noqa: E402

from rollstream.app.producer import produce_prompts, start_env_groups  # noqa: E402
from rollstream.config import Config, load_config  # noqa: E402
from rollstream.kafka.admin import create_pipeline_topics  # noqa: E402
from rollstream.kafka.topics import Topics  # noqa: E402
from rollstream.runtime import now_ms  # noqa: E402
from rollstream.kafka.readback import count_records, first_record_ms  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = float(os.environ.get("STARTUP_TIMEOUT_S", 300))
STAGE_MODULES = {"admission": "rollstream.streams.admission_agent", "generation": "rollstream.workers.generation",
                 "reward": "rollstream.workers.rewards", "aggregator": "rollstream.streams.aggregator_agent",
                 "group-queue": "rollstream.streams.group_queue_agent"}


def import_seconds(module: str) -> float:
    """Wall seconds of a fresh interpreter that imports ``module`` (what every stage process pays first)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, cwd=ROOT)
    return round(time.perf_counter() - t0, 2)


def config_file(example: str, workdir: Path, prefix: str, **overrides) -> tuple[Path, Config]:
    """``examples/<example>`` under a fresh topic prefix (and ``overrides``), written to
    ``workdir``, and the config read back from that file (a bad one fails here, not in a worker)."""
    raw = yaml.safe_load((ROOT / "examples" / example).read_text())
    raw["kafka"] = {**raw.get("kafka", {}), "topic_prefix": prefix}
    path = workdir / f"{prefix.rstrip('.')}.yaml"
    path.write_text(yaml.safe_dump({**raw, **overrides}))
    return path, load_config(path)


def first_output(stage: str, config: Path, bootstrap: str, outputs: tuple[str, ...], want: int,
                 workdir: Path) -> dict:
    """Start ``stage``; seconds from its start to the first record on ``outputs``, once ``want``
    records are there; the stage is stopped either way."""
    started_ms = now_ms()
    proc = start_worker(stage, config, bootstrap, workdir / f"{stage}.log", workdir)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while sum(count_records(bootstrap, topic) for topic in outputs) < want:
            if proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited with {proc.returncode}" if proc.poll() is not None else f"no output after {TIMEOUT_S:.0f} s"
                log = (workdir / f"{stage}.log").read_text(errors="replace").splitlines()
                return {"error": f"{stage} {why} on {outputs}", "log_tail": log[-15:]}
            time.sleep(0.05)  # polling the topics' end offsets, not waiting for a result
    finally:
        stop_worker(proc)
    first = min(t for t in (first_record_ms(bootstrap, topic) for topic in outputs) if t is not None)
    return {"first_output_s": round((first - started_ms) / 1000, 2)}


def rlvr_chain(bootstrap: str, workdir: Path) -> dict:
    prefix = f"start-{uuid.uuid4().hex[:8]}."
    # no trainer publishes policy versions here: without a staleness bound nothing waits for one;
    # one round per prompt, so the aggregator's first output is the prompt's decided Group
    path, config = config_file("rlvr_math.yaml", workdir, prefix, datasets=[], max_staleness=None,
                               max_response_rounds=1)
    topics = Topics(prefix)
    create_pipeline_topics(bootstrap, config.kafka)
    n = config.num_return_sequences_in_group
    produce_prompts(config, bootstrap, [{"prompt_id": "p0", "domain": "gsm8k", "prompt": "What is 2 + 3?",
                                         "mode": "train", "ground_truth": "5"}], end=False)
    out = {}
    chain = (("admission", (topics.generation_requests,), 1), ("generation", (topics.responses,), n),
             ("reward", (topics.responses_rewarded,), n),
             ("aggregator", (topics.groups_accepted, topics.groups_rejected), 1))  # its first decision
    for stage, outputs, want in chain:
        out[stage] = first_output(stage, path, bootstrap, outputs, want, workdir)
        if "error" in out[stage]:
            break
    return out


def agentic_queue(bootstrap: str, workdir: Path) -> dict:
    prefix = f"start-{uuid.uuid4().hex[:8]}."
    path, config = config_file("agentic_frozenlake.yaml", workdir, prefix)
    create_pipeline_topics(bootstrap, config.kafka)
    start_env_groups(config, bootstrap)
    return {"group-queue": first_output("group-queue", path, bootstrap, (Topics(prefix).episodes_requests,), 1,
                                        workdir)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench/startup.json"))
    parser.add_argument("--bootstrap", default=None, help="existing broker; default: start an embedded one")
    args = parse_args(parser, argv, {})
    result: dict = {"benchmark": "startup", "smoke": args.smoke, "cpu_count": os.cpu_count(),
                    "loadavg_start": [round(x, 2) for x in os.getloadavg()], **versions()}
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-") as tmp:
        with kafka_bootstrap(args.bootstrap, Path(tmp), result) as bootstrap:
            stages = {**rlvr_chain(bootstrap, Path(tmp)), **agentic_queue(bootstrap, Path(tmp))}
    for stage, figures in stages.items():
        figures["import_s"] = import_seconds(STAGE_MODULES[stage])
    result["stages"] = stages
    result["correct"] = len(stages) == len(STAGE_MODULES) and all("error" not in f for f in stages.values())
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["correct"] else 1)
