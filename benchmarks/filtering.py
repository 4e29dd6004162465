"""Does filtering pay on a mixed-difficulty workload? examples/rlvr_mixed.yaml (1-digit sums the
model can learn mixed with 4-digit sums it cannot: most groups are zero-variance at v0), the same
model, prompts, lr, group size and batch size five ways:

  (a) no_filter          rollstream, no query filter: every group is trained on
  (b) dynamic_sampling   rollstream, mean_filter on acc (DAPO's dynamic sampling), full groups
  (c) screening          (b) + two-phase screening: the first ``--screening-samples`` k samples of
                         a group first; k equal rewards the filter rejects end it (screened_out)
  (d) screening_history  (c) + history-aware admission (GRESO: skip prompts before generation)
  (e) trl_grpo           Hugging Face TRL's GRPOTrainer on the same train prompts
                         (benchmarks/learning.py's TRL worker)

each over ``--seeds``, seeds outermost (a slow spell of the machine hits every variant).

``workload``: each train prompt's pass rate at v0, ``--probe-samples`` samples generated in
process with the config's sampling and scored by its reward: the histogram of correct samples
per prompt, the zero-variance share (every sample right or every one wrong) and, by reward
domain, the mean pass rate; a domain passing at least LEARNABLE_MIN_PASS on average is the
learnable band, the others the hopeless part; ``screened_but_mixed_v0``: the expected share of
prompts a screening of k samples rejects though their full group would be kept.

One evaluator validates every variant: learning.validate_policy, on versions 0, ``eval_steps``,
2 ``eval_steps``, ... (the validation prompts, ``val_num_return_sequences`` samples each, the
config's sampling, seeded by seed and version). A rollstream run validates nothing while it runs:
it keeps those versions' weights and they are validated after it ends; TRL's run validates
between its steps and takes that time off its clock. The same weights give the same figures
either way (version 0 is the same for every variant, so the rollstream variants of a seed validate
it once and reuse the row, its round time included), and no validation competes with a run for
the 2 cores.

The target is the validation accuracy (a) ends at: the mean over seeds of its last validated
version's accuracy. It is known once every run is done, so every figure comes from the runs'
stored validation curves afterwards. Per variant, each as ``{values, mean, stdev}`` over seeds
(a seed that never reaches the target has null, left out of the mean):

* ``seconds_to_target``: validation outside the clock: from the run's start (broker, stages and
  model loading included) to the end of the step that made the first version at or above the
  target; ``seconds_to_target_validation_inside``: that plus the validation rounds up to it;
* ``tokens_to_target``: train response tokens generated (rejected groups included) by the
  versions before that one;
* ``final_val_accuracy``, ``final_learnable_val_accuracy`` (the learnable band's validation
  prompts only), ``val_accuracy_at_budget``: the accuracy of the newest validated version made
  (the same clock) by the time (a) of the same seed made its last version;
* ``tokens_generated`` and ``share_of_tokens_trained_on`` (the summary's ``difficulty``; TRL
  trains on every token it generates);
* ``tokens_per_version``: ``tokens_generated`` over the steps trained, what a version costs.

Then the ratios (d)/(a) of the mean ``tokens_to_target`` and ``seconds_to_target`` and per seed
(``at_most``, ``at_most_per_seed``: the same with a seed (a) never brought to the target counted
at what it spent, which bounds the ratio from above), and of the token ratio's two factors:
``tokens_per_version`` (what a version costs: screening and history act here) and
``version_to_target`` (how many versions learning needs: the batches' content acts here); and whether (d) reaches the target sooner than (e): per seed (a seed (e) never reaches counts
for (d) when (d) does) and on the means (each over the seeds that reach it). ``--plots DIR``:
the validation accuracy against seconds and against generated tokens, one line per variant
(mean over seeds at each version) and its band (min to max), as ``filtering_seconds.png`` and
``filtering_tokens.png``. JSON to ``--out``, written after every run (``complete`` false until
the last): the full run takes hours on 2 cores, and ``--resume`` goes on from such a file, running
only the variant-seed pairs it lacks (same settings, or it refuses).

    .venv/bin/python benchmarks/filtering.py [--base examples/rlvr_mixed.yaml] [--seeds 1,2,3] [--variants no_filter,...] [--max-steps 16]
        [--screening-samples 4] [--diagnose] [--out runs/bench/filtering.json] [--resume] [--plots docs/img]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml

import learning  # sets OMP_WAIT_POLICY as `rollstream run` does, before torch loads
from filter_stage import parse_args
from learning import ROOT, spread, trl_variant

BASE = ROOT / "examples" / "rlvr_mixed.yaml"
VARIANTS = ("no_filter", "dynamic_sampling", "screening", "screening_history", "trl_grpo")
BASELINE, OURS, TRL = "no_filter", "screening_history", "trl_grpo"
AS_LEARNING = {"no_filter": "no_filter", "dynamic_sampling": "dynamic_sampling", "screening": "dynamic_sampling",
               "screening_history": "ds_history", "trl_grpo": "trl_grpo"}  # learning.variant_config's names
LEARNABLE_MIN_PASS = 0.05  # a domain's mean v0 pass rate from which it is the learnable band
# how every run is validated (module doc); --resume refuses a report validated otherwise
VALIDATION = "one evaluator (learning.validate_policy), after a rollstream run, between TRL's steps"
# a filtered variant generates several groups a step: room for it to reach the horizon
TIME_LIMIT_PER_STEP_S = 180
SMOKE_GROUP = 3  # --smoke: groups of 3, so a screening of 2 fits (2 <= k < the group)
FIGURES = ("seconds_to_target", "seconds_to_target_validation_inside", "tokens_to_target", "version_to_target",
           "final_val_accuracy", "final_learnable_val_accuracy", "val_accuracy_at_budget", "tokens_generated",
           "share_of_tokens_trained_on", "tokens_per_version", "wall_seconds")


def variant_config(variant: str, seed: int, max_steps: int, screening_samples: int, smoke: bool = False,
                   diagnose: bool = False, base: Path = BASE) -> dict:
    """The raw config of ``variant`` (benchmarks/learning.py's, on ``base``) for ``seed``."""
    cfg = learning.variant_config(yaml.safe_load(base.read_text()), AS_LEARNING[variant], seed, max_steps, smoke)
    cfg["name"] = f"bench-filtering-{variant}-s{seed}"
    cfg["time_limit_s"] = max(cfg["time_limit_s"], TIME_LIMIT_PER_STEP_S * max_steps)
    if smoke:  # two epochs: the history filter needs them
        cfg.update(num_return_sequences_in_group=SMOKE_GROUP, num_epochs=2)
        cfg["actor_train"]["micro_batch_size"] = SMOKE_GROUP
    for domain in cfg["rewards"].values():
        if variant == "no_filter":
            domain["query_filter_config"] = {"type": "no_filter"}
        if variant.startswith("screening"):
            domain["screening"] = {"samples": screening_samples, "diagnose": diagnose}
    return cfg


# -- the workload at v0 ----------------------------------------------------------------------------

def screened_but_mixed(p: float, k: int, n: int) -> float:
    """The chance that a prompt of pass rate ``p`` has its first ``k`` of ``n`` samples equal
    (screened out) while all ``n`` are not (the full group would be kept by a mean filter 0/1)."""
    return p ** k * (1 - p ** (n - k)) + (1 - p) ** k * (1 - (1 - p) ** (n - k))


def probe_v0(raw: dict, samples: int, k: int) -> dict:
    """Each train prompt of ``raw`` sampled ``samples`` times by the initial weights (module doc);
    ``screened_but_mixed_v0``: the expected share of the prompts that a screening of ``k``
    samples rejects though their full group is mixed (the pass rates taken as measured)."""
    from rollstream.inference.backends import backend_kwargs
    from rollstream.config import parse_config
    from rollstream.data import dataset_prompts
    from rollstream.policy.model import chat_prompt_ids
    from rollstream.tools.learning import correct
    from rollstream.inference.engine import SamplingParams
    from rollstream.inference.transformers_engine import TransformersBackend
    from rollstream.workers.rewards import get_reward_fn

    started = time.monotonic()
    cfg = parse_config(raw)
    prompts = [p for d in cfg.datasets if d.mode == "train" for p in dataset_prompts(d, cfg.seed)]
    engine = TransformersBackend(**backend_kwargs(cfg.actor_infer, cfg.infer_model_path))
    gen = cfg.actor_infer.generating_args
    outs = engine.generate([chat_prompt_ids(engine.tokenizer, p["prompt"]) for p in prompts], [samples] * len(prompts),
                           [SamplingParams(temperature=gen.temperature, top_p=gen.top_p, max_new_tokens=gen.max_new_tokens,
                                           seed=cfg.seed * 100_003 + i) for i in range(len(prompts))])
    del engine
    rights: dict[str, list[int]] = {}  # domain -> correct samples of each of its prompts
    for p, out in zip(prompts, outs):
        score = get_reward_fn(cfg.rewards[p["domain"]].reward_type)
        rights.setdefault(p["domain"], []).append(sum(correct(vars(score(s.text, p["ground_truth"]))) for s in out))
    every = [c for cs in rights.values() for c in cs]
    rate = lambda cs: round(sum(cs) / (len(cs) * samples), 4) if cs else None  # noqa: E731
    zero = lambda cs: round(sum(c in (0, samples) for c in cs) / len(cs), 4)  # noqa: E731
    wasted = lambda cs: round(statistics.fmean(  # noqa: E731
        screened_but_mixed(c / samples, k, cfg.num_return_sequences_in_group) for c in cs), 4)
    domains = {d: {"prompts": len(cs), "pass_rate_v0": rate(cs), "learnable": rate(cs) >= LEARNABLE_MIN_PASS,
                   "zero_variance_share_v0": zero(cs), "screened_but_mixed_v0": wasted(cs)}
               for d, cs in sorted(rights.items())}
    part = lambda learnable: [c for d, cs in rights.items() if domains[d]["learnable"] == learnable for c in cs]  # noqa: E731
    return {"samples": samples, "prompts": len(every), "seconds": round(time.monotonic() - started, 1),
            "zero_variance_share_v0": zero(every), "screening_samples": k, "screened_but_mixed_v0": wasted(every),
            "pass_rate_histogram_v0": [sum(x == c for x in every) for c in range(samples + 1)],
            "learnable_pass_rate_v0": rate(part(True)), "hopeless_pass_rate_v0": rate(part(False)),
            "domains": domains}


# -- the runs --------------------------------------------------------------------------------------

def rollstream_run(raw: dict, workdir: Path, v0: dict | None = None) -> dict:
    """One rollstream run of the config ``raw`` without validation in the run (no eval_steps, and
    no validation prompts: they would be generated once at the start): every
    ``raw["eval_steps"]``-th version's weights are kept and validated afterwards
    (``validate_versions``, on ``raw``'s validation prompts; ``v0``: version 0's row from another
    run of the same seed). Its validation curve and train tokens by the version that generated them."""
    from rollstream.app.run import run_pipeline
    from rollstream.config import parse_config

    every = raw["eval_steps"]
    cfg = parse_config(raw)  # what is validated: the validation prompts of the workload
    run_cfg = parse_config({**raw, "eval_steps": None, "datasets": [d for d in raw["datasets"] if d.get("mode") != "val"],
                            "actor_train": {**raw["actor_train"], "keep_checkpoint_every": every}})
    started_ms = time.time() * 1000
    summary = run_pipeline(run_cfg, run_dir=workdir / cfg.name)
    train = summary["train_reward_by_policy_version"]
    difficulty = summary.get("difficulty") or {}
    batches = summary["batches"]
    validation, seconds = validate_versions(cfg, summary, started_ms, workdir / cfg.name / "checkpoints", every, v0)
    return {"outcome": summary["outcome"], "wall_seconds": summary["elapsed_seconds"], "steps": len(batches),
            "train_seconds": [b.get("train_seconds") for b in batches],
            "fill_seconds": [b["fill_seconds"] for b in batches],
            "validation": validation, "validation_seconds": seconds,
            "tokens_by_version": {v: r["tokens"] for v, r in train.items()},
            "tokens_generated": sum(r["tokens"] for r in train.values()),
            "share_of_tokens_trained_on": difficulty.get("share_of_tokens_trained_on"), "difficulty": difficulty,
            "groups_rejected": summary["groups_rejected"], "retention_rate": summary["retention_rate"],
            "screening": summary["screening"],
            "prompts_skipped_by_history": summary["prompts_skipped_by_history"]}


def validate_versions(cfg, summary: dict, started_ms: float, checkpoints: Path, every: int,
                      v0: dict | None = None) -> tuple[list[dict], float]:
    """Versions 0, ``every``, 2 ``every``, ... of a finished run, each validated by
    learning.validate_policy (the evaluator TRL's run uses in its own process) from its kept
    checkpoint, version 0 from the initial weights, seeded as TRL's round of that version.
    Rows as learning.version_curve's: ``seconds`` until the step that made the version ended,
    ``validated_seconds`` that plus the validation rounds up to this one (TRL's rule: its rounds
    run between its steps), ``round_seconds`` what its round took. Also the seconds all rounds
    took. ``v0``: version 0's row of another run of the same seed, the same weights and seed, so
    the same figures: it is reused, its round counted as if run again."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollstream.data import dataset_prompts
    from rollstream.policy.model import load_tokenizer, model_folder
    from rollstream.trainer.checkpoint import CheckpointStore

    initial = model_folder(cfg.infer_model_path)
    tokenizer = load_tokenizer(initial)
    val = [p for d in cfg.datasets if d.mode == "val" for p in dataset_prompts(d, cfg.seed)]
    made_ms = {0: started_ms, **{b["policy_version"]: b["trained_ms"] for b in summary["batches"] if "trained_ms" in b}}
    rows, spent = [], 0.0
    for version in sorted(v for v in made_ms if v % every == 0):
        if version == 0 and v0 is not None:
            row, took = {"val_accuracy": v0["val_accuracy"], "domains": v0["domains"]}, v0["round_seconds"]
        else:
            t0 = time.monotonic()
            folder = initial if version == 0 else CheckpointStore(checkpoints).path_of(version)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            row = learning.validate_policy(model, tokenizer, val, cfg, seed=cfg.seed * 1000 + version)
            took = round(time.monotonic() - t0, 1)
        spent += took
        made = round((made_ms[version] - started_ms) / 1000, 1)
        rows.append({"policy_version": version, **row, "seconds": made, "validated_seconds": round(made + spent, 1),
                     "round_seconds": took})
    return rows, round(spent, 1)


def known_v0(runs: dict[str, list[dict]], seed: int) -> dict | None:
    """Version 0's validation row of a rollstream run of ``seed`` made already, if any."""
    rows = (r["validation"][0] for v, rs in runs.items() if v != TRL for r in rs
            if r["seed"] == seed and r.get("validation") and "round_seconds" in r["validation"][0])
    return next(rows, None)


def trl_run(seed: int, max_steps: int, out: Path, smoke: bool, base: Path = BASE) -> dict:
    run = trl_variant(seed, max_steps, 1.0, out, smoke, base)  # its own threshold figures are not used
    return {**run, "share_of_tokens_trained_on": 1.0} if "validation" in run else run


def horizon(requested: int | None, base: Path) -> int:
    """The steps of every run: ``requested``, else the workload's own ``max_steps``."""
    return requested if requested is not None else int(yaml.safe_load(base.read_text())["max_steps"])


# -- the figures, from the stored curves -----------------------------------------------------------

def learnable_accuracy(row: dict, weights: dict[str, int]) -> float | None:
    """The validation accuracy of a curve row over the learnable domains (``weights``: their
    validation prompts), from its per-domain accuracies."""
    parts = [(row["domains"][d], n) for d, n in weights.items() if row.get("domains", {}).get(d) is not None]
    return round(sum(a * n for a, n in parts) / sum(n for _, n in parts), 4) if parts else None


def tokens_before(run: dict, version: int) -> int:
    """Train response tokens a run generated by the policy versions before ``version``."""
    return sum(n for v, n in run["tokens_by_version"].items() if int(v) < version)


def run_figures(run: dict, target: float | None, budget: float | None, weights: dict[str, int]) -> dict:
    from rollstream.tools.learning import first_reaching

    curve = run.get("validation") or []
    for row in curve:
        row["learnable_val_accuracy"] = learnable_accuracy(row, weights)
    hit = first_reaching(curve, "val_accuracy", target) if curve and target is not None else None
    made = [r for r in curve if budget is not None and r["seconds"] is not None and r["seconds"] <= budget]
    return {
        "seconds_to_target": hit["seconds"] if hit else None,
        "seconds_to_target_validation_inside": hit["validated_seconds"] if hit else None,
        "tokens_to_target": tokens_before(run, hit["policy_version"]) if hit else None,
        "version_to_target": hit["policy_version"] if hit else None,
        "final_val_accuracy": curve[-1]["val_accuracy"] if curve else None,
        "final_learnable_val_accuracy": curve[-1]["learnable_val_accuracy"] if curve else None,
        "val_accuracy_at_budget": made[-1]["val_accuracy"] if made else None,
        **{k: run.get(k) for k in ("tokens_generated", "share_of_tokens_trained_on", "wall_seconds")},
        "tokens_per_version": round(run["tokens_generated"] / run["steps"], 1) if run.get("steps") else None,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def sooner(ours: float | None, theirs: float | None) -> bool | None:
    """Whether ``ours`` reached the target before ``theirs`` (None: neither did)."""
    if ours is None or theirs is None:
        return None if ours is None and theirs is None else ours is not None
    return ours < theirs


def spent(run: dict) -> dict[str, float]:
    """What a run spent before its last validated version, in the units of ``tokens_to_target``
    and ``seconds_to_target``: the least it would have needed for a target it never reached."""
    last = run["validation"][-1]
    return {"tokens_to_target": tokens_before(run, last["policy_version"]), "seconds_to_target": last["seconds"]}


def compare(variants: dict, seeds: list[int]) -> dict:
    """(d) against (a) and (e), per seed and on the means. A mean is over the seeds that reached
    the target, so a seed (a) never brought there drops out of (a)'s mean: ``at_most`` and
    ``at_most_per_seed`` count it at what (a) spent in its whole run (less than it would have
    needed), which bounds the ratio from above."""
    def per_seed(variant: str, key: str) -> list:
        values = dict(zip(variants[variant]["seeds"], variants[variant][key]["values"])) if variant in variants else {}
        return [values.get(s) for s in seeds]

    def at_least_baseline(key: str) -> list:
        runs = {r["seed"]: r for r in variants[BASELINE]["runs"] if r.get("validation")}
        return [a if a is not None else spent(runs[s])[key] if s in runs else None
                for s, a in zip(seeds, per_seed(BASELINE, key))]

    def at_most(key: str) -> dict:
        ours, theirs = per_seed(OURS, key), at_least_baseline(key)
        both = [(d, a) for d, a in zip(ours, theirs) if d is not None and a is not None]
        return {"at_most": ratio(statistics.fmean(d for d, _ in both), statistics.fmean(a for _, a in both))
                if both and len(both) == sum(d is not None for d in ours) else None,
                "at_most_per_seed": [ratio(d, a) if d is not None else None for d, a in zip(ours, theirs)]}

    out: dict = {}
    if OURS in variants and BASELINE in variants:
        out[f"{OURS}_over_{BASELINE}"] = {key: {
            "mean": ratio(variants[OURS][key]["mean"], variants[BASELINE][key]["mean"]),
            "per_seed": [ratio(d, a) for d, a in zip(per_seed(OURS, key), per_seed(BASELINE, key))]}
            for key in ("tokens_to_target", "seconds_to_target", "tokens_per_version", "version_to_target")}
        for key in ("tokens_to_target", "seconds_to_target"):
            out[f"{OURS}_over_{BASELINE}"][key].update(at_most(key))
    if OURS in variants and TRL in variants:
        key = "seconds_to_target"
        both = set(variants[OURS]["seeds"]) & set(variants[TRL]["seeds"])  # a seed not run yet is no verdict
        out[f"{OURS}_sooner_than_{TRL}"] = {
            "mean": sooner(variants[OURS][key]["mean"], variants[TRL][key]["mean"]),
            "per_seed": [sooner(d, e) if s in both else None
                         for s, d, e in zip(seeds, per_seed(OURS, key), per_seed(TRL, key))]}
    return out


def report_variants(runs: dict[str, list[dict]], weights: dict[str, int]) -> tuple[float | None, dict]:
    """(target, per-variant figures) from every run's stored curve."""
    base = [r for r in runs.get(BASELINE, []) if r.get("validation")]
    target = round(statistics.fmean(r["validation"][-1]["val_accuracy"] for r in base), 4) if base else None
    budget = {r["seed"]: r["validation"][-1]["seconds"] for r in base}
    out = {}
    for variant, rs in runs.items():
        figures = [run_figures(r, target, budget.get(r["seed"]), weights) for r in rs]
        out[variant] = {"seeds": [r["seed"] for r in rs], **{k: spread([f[k] for f in figures]) for k in FIGURES},
                        "runs": rs}
    return target, out


# -- the plots -------------------------------------------------------------------------------------

def mean_curve(runs: list[dict], axis: str) -> list[tuple[float, float, float, float]]:
    """(x, mean accuracy, min, max) per validated version over the seeds' runs; x is the mean of
    the seeds' seconds (``axis`` "seconds") or train tokens generated before the version."""
    at: dict[int, list[tuple[float, float]]] = {}
    for run in runs:
        for row in run.get("validation") or []:
            v = row["policy_version"]
            x = row["seconds"] if axis == "seconds" else tokens_before(run, v)
            if x is not None:
                at.setdefault(v, []).append((x, row["val_accuracy"]))
    return [(statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts), min(y for _, y in pts),
             max(y for _, y in pts)) for _, pts in sorted(at.items())]


def plot(variants: dict, target: float | None, folder: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for axis, label in (("seconds", "seconds from the start (validation outside the clock)"),
                        ("tokens", "train response tokens generated")):
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        for variant, v in variants.items():
            points = mean_curve(v["runs"], axis)
            if points:
                xs, ys, lo, hi = zip(*points)
                [line] = ax.plot(xs, ys, marker="o", label=variant)
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.3f}")
        ax.set(xlabel=label, ylabel="validation accuracy", title="rlvr_mixed: mean over seeds, band min-max")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = folder / f"filtering_{axis}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written


# -- the report, written after every run ----------------------------------------------------------

def report(settings: dict, seeds: list[int], workload: dict, runs: dict[str, list[dict]], weights: dict[str, int],
           complete: bool) -> dict:
    """The JSON of the runs so far (``complete``: every variant-seed pair asked for has run)."""
    target, figures = report_variants({v: rs for v, rs in runs.items() if rs}, weights)
    return {**settings, "complete": complete, "seeds": seeds,
            "target": {"val_accuracy": target, "rule": f"mean over seeds of {BASELINE}'s final validation accuracy"},
            "workload": workload, "variants": figures, "comparison": compare(figures, seeds)}


def earlier(out: Path, settings: dict) -> tuple[dict | None, dict[str, list[dict]]]:
    """The v0 workload and the runs (variant -> runs) of the report at ``out``, for ``--resume``;
    (None, {}) when there is none. Raises ValueError when it was made with other ``settings``."""
    if not out.exists():
        return None, {}
    old = json.loads(out.read_text())
    differ = {k: {"there": old.get(k), "now": v} for k, v in settings.items() if old.get(k) != v}
    if differ:
        raise ValueError(f"--resume: {out} was made with other settings {differ}; move it away or run without --resume")
    return old["workload"], {v: figures["runs"] for v, figures in old["variants"].items()}


def write(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


# -- main ------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--max-steps", type=int, default=None,
                        help="steps of every run: the horizon (default: the --base config's max_steps)")
    # k = 2 would screen out more than half of every learnable group: two 0/1 samples agree with
    # probability p^2 + (1-p)^2 >= 0.5; k = 4 of 16 with p^4 + (1-p)^4 (0.21 at p = 0.33)
    parser.add_argument("--screening-samples", type=int, default=4, help="k of the screening variants")
    parser.add_argument("--diagnose", action="store_true", help="generate screened-out groups in full too and "
                        "report the false-rejection rate (slower: the screening's saving is spent)")
    parser.add_argument("--probe-samples", type=int, default=16, help="samples per train prompt of the v0 probe")
    parser.add_argument("--base", type=Path, default=BASE, help="the workload: an RLVR config whose reward "
                        "domains all have a query filter (default examples/rlvr_mixed.yaml)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/filtering.json"))
    parser.add_argument("--resume", action="store_true", help="keep the runs already in --out (written after "
                        "every run) and run only the missing variant-seed pairs, with the same settings")
    parser.add_argument("--plots", type=Path, default=None, help="a folder for the PNG plots (none: no plots)")
    args = parse_args(parser, argv, {"seeds": "1", "variants": "no_filter,screening_history,trl_grpo", "max_steps": 1,
                                     "probe_samples": 2, "screening_samples": 2})
    seeds = [int(s) for s in args.seeds.split(",") if s]
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    from rollstream.config import parse_config
    from rollstream.data import dataset_prompts

    base = args.base.resolve()
    args.max_steps = horizon(args.max_steps, base)
    settings = {"smoke": args.smoke, "config": os.path.relpath(base, ROOT), "max_steps": args.max_steps,
                "screening_samples": args.screening_samples, "diagnose": args.diagnose, "validation": VALIDATION}
    try:
        workload, runs = earlier(args.out, settings) if args.resume else (None, {})
    except ValueError as e:
        parser.error(str(e))
    probe_cfg = variant_config(BASELINE, seeds[0], args.max_steps, args.screening_samples, args.smoke, base=base)
    if workload is None:
        workload = probe_v0(probe_cfg, args.probe_samples, args.screening_samples)
    print(json.dumps({"workload": workload}), flush=True)
    cfg = parse_config(probe_cfg)
    val_prompts = Counter(p["domain"] for d in cfg.datasets if d.mode == "val" for p in dataset_prompts(d, cfg.seed))
    weights = {d: n for d, n in val_prompts.items() if workload["domains"].get(d, {}).get("learnable")}
    workload = {**workload, "learnable_domains": sorted(weights)}
    runs = {v: runs.get(v, []) for v in dict.fromkeys([*variants, *runs])}
    seeds = [*seeds, *sorted({r["seed"] for rs in runs.values() for r in rs} - set(seeds))]
    with tempfile.TemporaryDirectory(prefix="rollstream-filtering-") as tmp:
        for seed in seeds:
            for variant in variants:
                if any(r["seed"] == seed for r in runs[variant]):
                    continue
                if variant == TRL:
                    run = trl_run(seed, args.max_steps, Path(tmp) / f"trl-{seed}.json", args.smoke, base)
                else:
                    run = rollstream_run(variant_config(variant, seed, args.max_steps, args.screening_samples,
                                                        args.smoke, args.diagnose, base), Path(tmp),
                                         known_v0(runs, seed))
                runs[variant].append({"seed": seed, **run})
                print(json.dumps({"variant": variant, "seed": seed, **{k: run.get(k) for k in (
                    "outcome", "wall_seconds", "tokens_generated", "not_run", "failed")},
                    "validation": [(r["policy_version"], r["val_accuracy"], r["seconds"])
                                   for r in run.get("validation") or []]}), flush=True)
                write(args.out, report(settings, seeds, workload, runs, weights, complete=False))
    result = report(settings, seeds, workload, runs, weights, complete=True)
    if args.plots is not None:
        result["plots"] = plot(result["variants"], result["target"]["val_accuracy"], args.plots)
    write(args.out, result)
    print(json.dumps({"target": result["target"]["val_accuracy"], "comparison": result["comparison"],
                      **{v: {k: f[k]["mean"] for k in FIGURES} for v, f in result["variants"].items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
