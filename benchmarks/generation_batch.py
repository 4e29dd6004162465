"""Generation seconds by rows per engine call (``actor_infer.max_num_seqs``), with a request's
samples sharing one prefill of its prompt (the default) and each row prefilling its own, side by side.

64 rows (8 prompts x 8 samples, 16 new tokens, temperature 1.0) of SmolLM2-135M in float32 on
the CPU, through ``TransformersBackend.generate`` with ``max_num_seqs`` 8, 16, 32 and 64 and
``share_prefill`` on and off, the variants interleaved over ``--repeats`` rounds (these machines are noisy) after one warm-up call.
``OMP_WAIT_POLICY`` is PASSIVE, as in ``rollstream run``. Prints JSON (median seconds per size,
and rows per second); never asserts.

    .venv/bin/python benchmarks/generation_batch.py --out runs/bench/generation_batch.json   # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import torch  # noqa: E402

from filter_stage import parse_args, write_result  # noqa: E402

SIZES = (8, 16, 32, 64)
SUMS = [(3, 4), (5, 9), (1, 8), (7, 7), (2, 2), (6, 3), (8, 1), (9, 9)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=len(SUMS), help=f"prompts (at most {len(SUMS)})")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="max_num_seqs values, comma-separated")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/generation_batch.json"))
    args = parse_args(parser, argv, {"repeats": 1, "prompts": 2, "samples": 2, "max_new_tokens": 2, "sizes": "1,4"})
    sizes = [int(s) for s in args.sizes.split(",")]

    from rollstream.policy.model import chat_prompt_ids
    from rollstream.inference.engine import SamplingParams
    from rollstream.inference.transformers_engine import TransformersBackend

    backend = TransformersBackend(max_num_seqs=max(sizes))
    prompts = [chat_prompt_ids(backend.tokenizer, f"What is {a} + {b}? Answer with the number only.")
               for a, b in SUMS[:args.prompts]]
    params = [SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=i) for i in range(len(prompts))]
    n = [args.samples] * len(prompts)
    backend.generate(prompts, n, params)  # warm-up: first-call allocations
    seconds: dict[tuple[int, bool], list[float]] = {(size, share): [] for size in sizes for share in (True, False)}
    for _ in range(args.repeats):
        for size, share in seconds:
            backend.max_num_seqs, backend.share_prefill = size, share
            t0 = time.perf_counter()
            backend.generate(prompts, n, params)
            seconds[size, share].append(time.perf_counter() - t0)
    rows = sum(n)

    def figures(ts: list[float]) -> dict:
        return {"seconds_median": round(statistics.median(ts), 2), "seconds": [round(t, 2) for t in ts],
                "rows_per_second": round(rows / statistics.median(ts), 1)}

    write_result({
        "benchmark": "generation_batch", "smoke": args.smoke, "rows": rows, "max_new_tokens": args.max_new_tokens,
        "dtype": "float32",
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
        # a request's samples share one prefill of its prompt; prefill_per_row: each row its own
        "by_max_num_seqs": {str(size): {**figures(seconds[size, True]), "prefill_per_row": figures(seconds[size, False])}
                            for size in sizes},
    }, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
