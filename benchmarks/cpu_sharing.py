"""A training step on CPU while a generation process shares the cores: OpenMP wait policies.

`rollstream run` puts generation workers and the trainer on the same cores. Idle OpenMP threads
spin (``OMP_WAIT_POLICY`` ``ACTIVE``; unset, libgomp spins a while before sleeping), burning the
cores the other process needs; ``PASSIVE`` makes them sleep. For each policy this runs, one after
the other on the same machine:

- a generation process (``TransformersBackend`` in bfloat16, 8 rows x 32 new tokens per call, as
  in the demo) generating in a loop, and
- in this process's child, ``--steps`` PolicyTrainer steps (old_log_probs + correction + GRPO
  step, float32) over a batch of 4 groups x 4 responses of 32 tokens,

and reports the median step seconds and the generator's calls per second. A third row measures
the training step alone (no generator) as the floor. Two more ask how a generator (validation
rounds, say) could yield to the step: generating with one torch thread, or at the lowest CPU
priority (nice 19). Prints JSON; never asserts.

    .venv/bin/python benchmarks/cpu_sharing.py --out runs/bench/cpu_sharing.json   # ~10 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from filter_stage import parse_args, write_result


def generate_forever(stop_file: str, counter_file: str, new_tokens: int, threads: int | None = None,
                     nice: int = 0) -> None:
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    os.nice(nice)

    from rollstream.policy.model import chat_prompt_ids
    from rollstream.inference.engine import SamplingParams
    from rollstream.inference.transformers_engine import TransformersBackend

    backend = TransformersBackend(dtype=torch.bfloat16, max_num_seqs=8)
    prompts = [chat_prompt_ids(backend.tokenizer, f"What is {i} + {i + 2}?") for i in range(2)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=i) for i in range(2)]
    calls = 0
    while not os.path.exists(stop_file):
        backend.generate(prompts, [4, 4], params)
        calls += 1
        Path(counter_file).write_text(str(calls))


def train_steps(steps: int, groups: int, group_size: int, tokens: int) -> list[float]:
    import torch

    from rollstream.trainer.batch import build_batch
    from rollstream.trainer.corrections import TrainInferCorrectionConfig
    from rollstream.trainer.policy_trainer import PolicyTrainer, TrainSettings

    trainer = PolicyTrainer(TrainSettings(lr=1e-6, micro_batch_size=4), TrainInferCorrectionConfig())
    torch.manual_seed(0)
    records = []
    for g in range(groups):
        prompt = torch.randint(100, 20000, (40,)).tolist()
        records.append({"group_key": f"g{g}", "responses": [
            {"response": {"prompt_id": f"g{g}", "sample_index": i, "policy_version": 0},
             "payload": {"prompt_id": f"g{g}", "sample_index": i, "prompt_token_ids": prompt,
                         "response_token_ids": torch.randint(100, 20000, (tokens,)).tolist(),
                         "infer_logprobs": [-5.0] * tokens},  # resolved: the trainer fetched it
             "response_level_reward": float(i % 2), "scores": {}} for i in range(group_size)]})
    batch = build_batch(records, step=0, pad_token_id=0)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train(batch)
        times.append(time.perf_counter() - t0)
    return times


def child(args) -> None:
    """Runs in a fresh interpreter with the wait policy under test in its environment."""
    work = Path(args.work)
    gen = None
    if args.with_generator:
        gen = mp.get_context("spawn").Process(target=generate_forever, args=(
            str(work / "stop"), str(work / "calls"), args.tokens, args.gen_threads, args.gen_nice))
        gen.start()
        while not (work / "calls").exists():  # the generator is loaded and running
            time.sleep(0.2)
    started, calls0 = time.monotonic(), int((work / "calls").read_text()) if gen else 0
    times = train_steps(args.steps, args.groups, args.group_size, args.tokens)
    elapsed = time.monotonic() - started
    calls = (int((work / "calls").read_text()) - calls0) if gen else 0
    if gen:
        (work / "stop").write_text("")
        gen.join(120)
    print(json.dumps({"step_seconds_median": round(statistics.median(times), 2),
                      "step_seconds": [round(t, 2) for t in times],
                      "generator_calls_per_s": round(calls / elapsed, 3) if gen else None}))


VARIANTS = {"alone": ("PASSIVE", False, None, 0), "shared_unset": (None, True, None, 0),
            "shared_active": ("ACTIVE", True, None, 0), "shared_passive": ("PASSIVE", True, None, 0),
            # how a generator could yield to the step: one torch thread, or the lowest CPU priority
            "shared_passive_gen_1_thread": ("PASSIVE", True, 1, 0), "shared_passive_gen_nice": ("PASSIVE", True, None, 19)}
"""name: (OMP_WAIT_POLICY, with the generator, the generator's torch threads (None: all), its nice value)."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per response, and per generator row")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", type=Path, default=Path("runs/bench/cpu_sharing.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--with-generator", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--gen-threads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--gen-nice", type=int, default=0, help=argparse.SUPPRESS)
    args = parse_args(parser, argv, {"steps": 1, "groups": 1, "group_size": 2, "tokens": 4,
                                     "variants": "shared_passive"})  # the generator and the trainer, once
    if args.child:
        child(args)
        return
    import tempfile

    variants = args.variants.split(",")
    if unknown := sorted(set(variants) - set(VARIANTS)):
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    result = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, "smoke": args.smoke,
              "steps": args.steps, "groups": args.groups, "group_size": args.group_size, "tokens": args.tokens,
              "variants": {}}
    for name in variants:
        policy, with_gen, gen_threads, gen_nice = VARIANTS[name]
        with tempfile.TemporaryDirectory() as work:
            env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
            if policy is not None:
                env["OMP_WAIT_POLICY"] = policy
            cmd = [sys.executable, __file__, "--child", "--steps", str(args.steps), "--groups", str(args.groups),
                   "--group-size", str(args.group_size), "--tokens", str(args.tokens), "--work", work]
            if with_gen:
                cmd += ["--with-generator", "--gen-nice", str(gen_nice)]
            if gen_threads is not None:
                cmd += ["--gen-threads", str(gen_threads)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=Path(__file__).parent.parent)
            if out.returncode != 0:
                raise RuntimeError(f"variant {name} failed:\n{out.stderr[-3000:]}")
            result["variants"][name] = {"omp_wait_policy": policy, "generator_threads": gen_threads,
                                        "generator_nice": gen_nice, **json.loads(out.stdout.strip().splitlines()[-1])}
    write_result(result, args.out)


if __name__ == "__main__":
    main()
