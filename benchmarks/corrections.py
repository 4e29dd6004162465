"""Throughput of the train-infer correction (rollstream.trainer.corrections), per aggregation type.

For each ``agg_type`` (token, segment, geometric, sequence) one config enables the IS weight of
that granularity (``upper_bound`` 1.2) and one filter of it (ratio [0.8, 1.2] and diff
[-0.2, 0.2]). The workload is ``--batch`` rows x ``--tokens`` positions (default 64 x 4,096):
response lengths between half and all of ``--tokens``, right padding holding 0.0 (as
``RolloutBatch``), and in every other row an agentic layout of 256 model tokens then 32
environment tokens (mask 0), so segments are real. Infer logprobs lie in [-4, 0]; old logprobs
drift from them by N(0, 0.02) a token, plus N(0, 0.5) on 2 % of tokens (so every filter drops
something).

Reported, per agg type:

- ``cpu``: ``compute_train_infer_correction`` on the whole batch (median and best of
  ``--repeats`` after one warm-up), tokens/s counting all B x T positions.
- ``cuda`` (only when CUDA is available): the same on the GPU, synchronised, plus how far its
  results are from the CPU's.
- ``loop_reference``: a plain Python implementation of the same formulas, row by row and token by
  token (written here, independent of the module). It is slow, so it is timed on the first
  ``--loop-rows`` rows only and the whole-batch time is EXTRAPOLATED linearly
  (``extrapolated: true``). ``agree`` compares it with the vectorised function run on the same
  rows: weights, filter mask, and the monitoring / pass-rate metrics.

Never asserts on time: it prints JSON and writes it to ``--out``.

    .venv/bin/python benchmarks/corrections.py --out runs/bench/corrections.json
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from filter_stage import parse_args, write_result
from rollstream.trainer.corrections import AGG_TYPES, compute_train_infer_correction

EPS = 1e-8  # the epsilon of the reference's mean denominators
RATIO_BAND = (0.8, 1.2)
DIFF_BAND = (-0.2, 0.2)
UPPER_BOUND = 1.2


# ---- workload --------------------------------------------------------------------------------


def make_batch(batch: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    infer = -torch.rand(batch, tokens, generator=g) * 4.0
    old = infer + torch.randn(batch, tokens, generator=g) * 0.02
    outliers = torch.rand(batch, tokens, generator=g) < 0.02  # a few tokens the engine got wrong
    old = old + outliers * torch.randn(batch, tokens, generator=g) * 0.5
    mask = torch.zeros(batch, tokens)
    lengths = torch.randint(tokens // 2, tokens + 1, (batch,), generator=g)
    cols = torch.arange(tokens)
    for b in range(batch):  # workload set-up only
        mask[b, : int(lengths[b])] = 1.0
        if b % 2 == 1:  # agentic: 256 model tokens, then 32 environment tokens
            mask[b, (cols % 288) >= 256] = 0.0
    infer = torch.where(mask.bool(), infer, torch.zeros(()))
    old = torch.where(cols < lengths[:, None], old, torch.zeros(()))
    return old, infer, mask


def config_for(agg: str) -> dict:
    return {
        "is_weight": {"enabled": True, "weight_type": agg, "upper_bound": UPPER_BOUND},
        "filters": [{"enabled": True, "agg_type": agg, "ratio_enabled": True,
                     "ratio_low": RATIO_BAND[0], "ratio_high": RATIO_BAND[1],
                     "diff_enabled": True, "diff_low": DIFF_BAND[0], "diff_high": DIFF_BAND[1]}],
    }


# ---- plain Python reference ------------------------------------------------------------------


def loop_reference(old: list[list[float]], infer: list[list[float]], mask: list[list[int]], agg: str):
    """Row by row, token by token, in Python floats: the reference's formulas
    with masked positions read as o = i = 0 (our rule). Returns (weights, keep, metrics)."""
    weights, keep = [], []
    sums = {f"{k}_{a}": 0.0 for k in ("ratio", "diff") for a in AGG_TYPES}
    rows_with_tokens = valid_tokens = 0
    ratio_pass = diff_pass = clipped = 0
    for o_row, i_row, m_row in zip(old, infer, mask):
        T = len(m_row)
        lr = [0.0] * T
        dt = [0.0] * T
        n = 0
        for t in range(T):
            if m_row[t]:
                lr[t] = o_row[t] - i_row[t]
                dt[t] = math.exp(o_row[t]) - math.exp(i_row[t])
                n += 1
        s_lr = sum(lr)
        s_dt = sum(dt)
        seg_ratio = [1.0] * T
        seg_diff = [0.0] * T
        t = 0
        while t < T:
            if not m_row[t]:
                t += 1
                continue
            end = t
            acc_lr = acc_dt = 0.0
            while end < T and m_row[end]:
                acc_lr += lr[end]
                acc_dt += dt[end]
                end += 1
            r = math.exp(acc_lr / (end - t + EPS))
            d = acc_dt / (end - t + EPS)
            for j in range(t, end):
                seg_ratio[j], seg_diff[j] = r, d
            t = end
        geo_r, geo_d = math.exp(s_lr / (n + EPS)), s_dt / (n + EPS)
        seq_r = math.exp(s_lr) if s_lr < 700 else math.inf
        ratio = {"token": [math.exp(x) for x in lr], "geometric": [geo_r] * T,
                 "sequence": [seq_r] * T, "segment": seg_ratio}
        diff = {"token": dt, "geometric": [geo_d] * T, "sequence": [s_dt] * T, "segment": seg_diff}

        if n:
            rows_with_tokens += 1
            valid_tokens += n
            for a in AGG_TYPES:
                sums[f"ratio_{a}"] += sum(ratio[a][t] for t in range(T) if m_row[t]) / (n + EPS)
                sums[f"diff_{a}"] += sum(diff[a][t] for t in range(T) if m_row[t]) / (n + EPS)

        lo, hi = RATIO_BAND
        w_row, k_row = [], []
        for t in range(T):
            w = ratio[agg][t]
            if m_row[t] and w > UPPER_BOUND:
                clipped += 1
            w_row.append(min(max(w, 0.0), UPPER_BOUND))
            if agg == "sequence":  # decided in log space, like the module
                r_ok = math.log(lo) <= s_lr <= math.log(hi)
            else:
                r_ok = lo <= ratio[agg][t] <= hi
            d_ok = DIFF_BAND[0] <= diff[agg][t] <= DIFF_BAND[1]
            if m_row[t]:
                ratio_pass += r_ok
                diff_pass += d_ok
            k_row.append(float(r_ok and d_ok))
        weights.append(w_row)
        keep.append(k_row)

    g_s, g_t = max(rows_with_tokens, 1), max(valid_tokens, 1)
    p = "actor/train_infer_"
    metrics = {f"{p}{k}_mean@sum": v / (g_s + EPS) for k, v in sums.items()}
    metrics[f"{p}{agg}_ratio_mask_mean@sum"] = ratio_pass / g_t
    metrics[f"{p}{agg}_diff_mask_mean@sum"] = diff_pass / g_t
    metrics["actor/is_weight_clipfrac@sum"] = clipped / g_t
    return weights, keep, metrics


# ---- timing ----------------------------------------------------------------------------------


def time_call(fn, repeats: int, sync=None) -> dict:
    fn()  # warm-up
    if sync:
        sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "best_s": min(times)}


def compare(a: tuple, b: tuple) -> dict:
    """(weights, keep) pairs on one device -> mismatch counts."""
    wa, fa = (x.double().cpu() for x in a)
    wb, fb = (x.double().cpu() for x in b)
    return {"filter_mask_mismatches": int((fa != fb).sum()),
            "max_abs_weight_diff": float((wa - wb).abs().max()) if wa.numel() else 0.0}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--loop-rows", type=int, default=16, help="rows the Python loop is timed on")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/bench/corrections.json")
    args = parse_args(ap, argv, {"batch": 4, "tokens": 64, "repeats": 1, "loop_rows": 2})

    old, infer, mask = make_batch(args.batch, args.tokens, args.seed)
    positions = args.batch * args.tokens
    rows = min(args.loop_rows, args.batch)
    sub = (old[:rows], infer[:rows], mask[:rows])
    sub_lists = (sub[0].double().tolist(), sub[1].double().tolist(), sub[2].int().tolist())
    cuda = torch.cuda.is_available()
    if cuda:
        dev = [x.cuda() for x in (old, infer, mask)]

    result: dict = {
        "benchmark": "train_infer_correction", "smoke": args.smoke,
        "batch": args.batch, "tokens_per_row": args.tokens, "positions": positions,
        "valid_tokens": int(mask.sum()), "repeats": args.repeats,
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "cuda_device": torch.cuda.get_device_name(0) if cuda else None,
        "throughput_unit": "positions (B x T, padding included) per second",
        "cpu": {}, "cuda": {} if cuda else None, "loop_reference": {},
    }
    all_agree = True
    for agg in AGG_TYPES:
        cfg = config_for(agg)
        full = compute_train_infer_correction(old, infer, mask, cfg)
        timing = time_call(lambda: compute_train_infer_correction(old, infer, mask, cfg), args.repeats)
        result["cpu"][agg] = {**timing, "tokens_per_s": positions / timing["median_s"],
                              "kept_fraction": full[2]["actor/train_infer_final_mask_mean"]}

        if cuda:
            sync = torch.cuda.synchronize
            timing = time_call(lambda: compute_train_infer_correction(*dev, cfg), args.repeats, sync)
            on_gpu = compute_train_infer_correction(*dev, cfg)
            result["cuda"][agg] = {**timing, "tokens_per_s": positions / timing["median_s"],
                                   "vs_cpu": compare(full[:2], on_gpu[:2])}

        t0 = time.perf_counter()
        lw, lk, lm = loop_reference(*sub_lists, agg)
        loop_s = time.perf_counter() - t0
        vw, vk, vm = compute_train_infer_correction(*sub, cfg)
        diffs = compare((vw, vk), (torch.tensor(lw), torch.tensor(lk)))
        metric_diff = max(abs(vm[k] - v) / max(1.0, abs(v)) for k, v in lm.items())
        agree = diffs["filter_mask_mismatches"] == 0 and diffs["max_abs_weight_diff"] <= 1e-5 \
            and metric_diff <= 1e-5
        all_agree &= agree
        per_row = loop_s / rows
        result["loop_reference"][agg] = {
            "rows_timed": rows, "timed_s": loop_s, "extrapolated": True,
            "extrapolated_batch_s": per_row * args.batch,
            "tokens_per_s": rows * args.tokens / loop_s,
            "speedup_vectorised_cpu": per_row * args.batch / result["cpu"][agg]["median_s"],
            **diffs, "max_rel_metric_diff": metric_diff, "agree": agree,
        }
    result["loop_reference_note"] = (
        f"plain Python, timed on the first {rows} of {args.batch} rows; batch time extrapolated "
        "linearly (rows are independent)")
    result["agree"] = all_agree
    write_result(result, Path(args.out))


if __name__ == "__main__":
    main()
