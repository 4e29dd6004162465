"""GPU check: the train-inference correction and one GRPO training step on CUDA, against the CPU.

Meant for a bare CUDA machine: it needs only torch and transformers (no network, no vLLM, none of
rollstream's other dependencies). It imports four pure modules of ``rollstream.trainer``
(``corrections``, ``grpo``, ``logprobs``, ``batch``) from this checkout without running the
packages' ``__init__`` files (which import the whole config layer and the Avro codec). Where a
dependency of those modules is missing, a stand-in takes its place and is named in the output:

- ``rollstream.config.corrections`` (pydantic): a plain-namespace reader of the correction configs
  below, which spell out every field (where pydantic is present the check verifies that the real
  parser reads them to exactly the same values);
- ``rollstream.schemas.packed`` (fastavro): its ``unpack_array`` raises (only ``build_batch`` of
  decoded Avro groups uses it; the check builds its ``RolloutBatch`` directly).

Checks, each one's figures under ``checks.<name>`` with an ``ok`` flag (reference = CPU):

- ``correction_{token,segment,geometric,sequence}``: ``compute_train_infer_correction`` on
  ``--mask-rows`` x ``--mask-cols`` (default 16 x 4,096) random logprobs (right padding holding
  NaN / -inf, agentic gaps in every other row), IS weight of that granularity and one ratio + diff
  filter of it (bands in ``BANDS``; ``kept_share`` says what they keep): the filter mask equal on
  both devices, weights and metrics allclose. A mask difference is tolerated only at a position
  whose ratio or diff lies within ``1e-5`` of a filter bound (recomputed in float64 here, counted
  in ``mask_flips_at_border``): ``exp`` of the CPU and CUDA libraries may differ by an ulp, and
  with 65k tokens a diff that close to a bound is not rare enough to ignore.
  ``ms``: median time of one call on each device (CUDA synchronised), after a warm-up.
- ``correction_helpers``: ``segment_mean`` and ``apply_correction_mask`` on the same inputs.
- ``train_step_float32``: a tiny Qwen2 (random weights, built in place) and a synthetic padded
  GRPO batch through rollstream's own step, as ``PolicyTrainer.train`` runs it
  (``response_log_probs`` -> ``compute_train_infer_correction`` -> ``apply_correction_mask`` ->
  ``train_step`` with AdamW), on each device from the same weights: loss and gradient norm finite
  and allclose, old logprobs allclose, the same final mask, weights changed on both. ``seconds``:
  the second of two runs from the same weights (the first pays CUDA's lazy set-up).
- ``train_step_bfloat16``: the same step on the checked device in bfloat16 (``actor_train.dtype``):
  loss and gradient norm finite, weights changed.
- ``vllm_reload_in_place``: where vLLM is installed for the checked device, an in-process engine
  (bfloat16) of a random 2-layer Llama with a tied output embedding generates greedily from token
  ids, then loads other weights in place as rollstream's in-process backend does: its logprobs
  match float32 forward passes of the weights it should hold, before and after. Skipped, the
  reason under ``skipped``, without vLLM (a bare CUDA image) or with a vLLM of another device.
  ``make test`` runs it on vLLM's CPU build (``--device cpu``).

Prints one JSON object (also written to ``--out``): ``ok`` (every check not skipped passed),
``skipped``, ``device``, ``device_name``, versions, ``stand_ins``, ``rollstream_modules`` (what
was imported), ``heavy_modules_loaded`` (any of pydantic, fastavro, kafka, faust, typer, vllm that
is loaded; vllm when its check ran), ``sizes``, ``checks``, ``seconds``.
Exit status: 0 every check not skipped passed, 1 a check failed, 2 no CUDA (unless ``--device cpu``, which runs
the same checks with the CPU on both sides: a self-test of the script for machines without a GPU).

    python3 benchmarks/gpu_check.py --out runs/gpu-check.json      # or: make gpu-check
    python3 benchmarks/gpu_check.py --device cpu --tiny             # self-test, seconds
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
AGGS = ("token", "segment", "geometric", "sequence")
BORDER = 1e-5  # a mask flip this close to a filter bound is exp's rounding, not a bug
# Modules the check must run without (reported when something imported them anyway).
HEAVY = ("pydantic", "fastavro", "kafka", "faust", "typer", "vllm")


# Filter bands per granularity, (ratio_low, ratio_high, diff_bound): narrower for the means over
# many tokens, wider for the sequence sum, so that every filter keeps some tokens and drops some.
BANDS = {"token": (0.9, 1.1, 0.05), "segment": (0.99, 1.01, 0.005), "geometric": (0.999, 1.001, 0.001),
         "sequence": (0.05, 20.0, 3.0)}


def correction_config(agg: str) -> dict:
    """IS weight of granularity ``agg`` and one ratio + diff filter of it (``BANDS``); every field
    spelled out (the pydantic-free stand-in reads it as given)."""
    low, high, diff = BANDS[agg]
    return {
        "is_weight": {"enabled": True, "weight_type": agg, "upper_bound": 1.2, "detach": True},
        "filters": [{"enabled": True, "agg_type": agg, "ratio_enabled": True, "ratio_low": low,
                     "ratio_high": high, "diff_enabled": True, "diff_low": -diff, "diff_high": diff}],
        "mask_collapse_threshold": 0.5,
    }


# The training step's correction: bands wide enough that the CPU and the device agree on the mask.
STEP_CORRECTION = {
    "is_weight": {"enabled": True, "weight_type": "token", "upper_bound": 2.0, "detach": True},
    "filters": [{"enabled": True, "agg_type": "token", "ratio_enabled": True, "ratio_low": 0.5,
                 "ratio_high": 2.0, "diff_enabled": False, "diff_low": -0.2, "diff_high": 0.2}],
    "mask_collapse_threshold": 0.5,
}


# ---- imports ---------------------------------------------------------------------------------


def _namespace_config(config):
    """Stand-in ``parse_correction_config``: a complete mapping (see ``correction_config``) ->
    nested namespaces with the attributes the correction reads; a namespace is returned as is."""
    if isinstance(config, types.SimpleNamespace):
        return config
    return types.SimpleNamespace(
        is_weight=types.SimpleNamespace(**config["is_weight"]),
        filters=[types.SimpleNamespace(**f) for f in config["filters"]],
        mask_collapse_threshold=config["mask_collapse_threshold"])


def _config_stand_in() -> types.ModuleType:
    stub = types.ModuleType("rollstream.config.corrections")
    stub.AGG_TYPES = AGGS
    stub.CorrectionFilterConfig = stub.ISWeightConfig = stub.TrainInferCorrectionConfig = types.SimpleNamespace
    stub.parse_correction_config = _namespace_config
    return stub


def _packed_stand_in() -> types.ModuleType:
    def unpack_array(*args, **kwargs):
        raise RuntimeError("rollstream.schemas.packed could not be imported here (fastavro)")

    stub = types.ModuleType("rollstream.schemas.packed")
    stub.unpack_array = unpack_array
    return stub


STAND_INS = {  # module -> (stand-in, what it does)
    "rollstream.config.corrections": (_config_stand_in, "configs read as namespaces"),
    "rollstream.schemas.packed": (_packed_stand_in, "unpack_array raises"),
}


def load_trainer() -> tuple[dict[str, types.ModuleType], list[str]]:
    """Import ``rollstream.trainer.{corrections,grpo,logprobs,batch}`` from this checkout.

    Packages not imported yet get an empty shell (their ``__init__`` is not run), so only these
    modules and what they import load. A module of ``STAND_INS`` that cannot be imported (pydantic
    or fastavro missing) is replaced by its stand-in. Returns the modules by short name and one
    line per stand-in used (``"<module>: <import error> -> <what it does>"``).
    """
    for name in ("rollstream", "rollstream.config", "rollstream.schemas", "rollstream.trainer"):
        if name not in sys.modules:
            shell = types.ModuleType(name)
            shell.__path__ = [str(ROOT.joinpath(*name.split(".")))]
            sys.modules[name] = shell
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, shell)
    stand_ins = []
    for name, (make, does) in STAND_INS.items():
        try:
            importlib.import_module(name)
        except ImportError as exc:
            sys.modules[name] = make()
            stand_ins.append(f"{name}: {exc} -> {does}")
    modules = {short: importlib.import_module(f"rollstream.trainer.{short}")
               for short in ("corrections", "grpo", "logprobs", "batch")}
    return modules, stand_ins


# ---- helpers ---------------------------------------------------------------------------------


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, repeats: int) -> tuple[object, float]:
    """``fn()``'s result and the median wall time of ``repeats`` calls after a warm-up, in ms."""
    out = fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return out, round(statistics.median(times), 3)


def _max_diff(a, b) -> float:
    """Largest absolute difference, NaN where both are NaN counted as equal."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    both_nan = torch.isnan(a) & torch.isnan(b)
    d = torch.where(both_nan | (a == b), torch.zeros_like(a), (a - b).abs())
    return float(d.max()) if d.numel() else 0.0


def _run_check(checks: dict, name: str, fn) -> None:
    """Record ``fn()``'s figures under ``checks[name]``; an exception fails only this check."""
    try:
        checks[name] = fn()
    except Exception as exc:  # noqa: BLE001  (one broken check must not hide the others' figures)
        checks[name] = _failure(exc)
    # progress on stderr: a run cut short still shows how far it got
    check = checks[name]
    state = f"skipped: {check['skipped']}" if "skipped" in check else "ok" if check["ok"] else "FAILED"
    print(f"gpu_check: {name}: {state}", file=sys.stderr, flush=True)


def _failure(exc: Exception) -> dict:
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc().splitlines()[-6:]}


# ---- correction parity -----------------------------------------------------------------------


def correction_inputs(rows: int, cols: int, seed: int):
    """``(old, infer, mask)`` float32 ``(rows, cols)`` on the CPU: infer logprobs in [-4, 0], old
    = infer + N(0, 0.05) (+ N(0, 0.5) on 2 % of tokens); responses of cols/2..cols tokens, right
    padding holding NaN (old) and -inf (infer); every other row alternates 48 model tokens and 8
    environment tokens (mask 0), so segments are real."""
    g = torch.Generator().manual_seed(seed)
    infer = -torch.rand(rows, cols, generator=g) * 4.0
    old = infer + torch.randn(rows, cols, generator=g) * 0.05
    old = old + (torch.rand(rows, cols, generator=g) < 0.02) * torch.randn(rows, cols, generator=g) * 0.5
    positions = torch.arange(cols)
    lengths = torch.randint(max(cols // 2, 1), cols + 1, (rows,), generator=g)
    inside = positions[None, :] < lengths[:, None]
    env = (positions % 56 >= 48)[None, :] & (torch.arange(rows) % 2 == 1)[:, None]
    mask = (inside & ~env).float()
    old = torch.where(inside, old, torch.full_like(old, math.nan))
    infer = torch.where(inside, infer, torch.full_like(infer, -math.inf))
    return old, infer, mask


def bound_margin(old, infer, mask, agg: str, segment_mean, config: dict):
    """Per position, how far (float64) ``agg``'s log-ratio and diff lie from the filter's bounds:
    ``min(|log r - log b|, |d - b'|)`` over the ratio and diff bounds. The formulas of the
    correction module's table, with masked inputs read as 0."""
    f = config["filters"][0]
    valid = mask.bool()
    o = torch.where(valid, old.double(), torch.zeros((), dtype=torch.float64))
    i = torch.where(valid, infer.double(), torch.zeros((), dtype=torch.float64))
    log_ratio, diff = o - i, torch.exp(o) - torch.exp(i)
    n = valid.sum(dim=1, keepdim=True).double()
    if agg == "token":
        r, d = log_ratio, diff
    elif agg == "segment":
        r, d = segment_mean(log_ratio, mask), segment_mean(diff, mask)
    elif agg == "geometric":
        r, d = log_ratio.sum(1, keepdim=True) / (n + 1e-8), diff.sum(1, keepdim=True) / (n + 1e-8)
    else:
        r, d = log_ratio.sum(1, keepdim=True), diff.sum(1, keepdim=True)
    r, d = r.expand_as(o), d.expand_as(o)
    margin = torch.minimum((r - math.log(f["ratio_low"])).abs(), (r - math.log(f["ratio_high"])).abs())
    return torch.minimum(margin, torch.minimum((d - f["diff_low"]).abs(), (d - f["diff_high"]).abs()))


def check_correction(mods, agg: str, inputs, device, repeats: int, config_check) -> dict:
    corr = mods["corrections"]
    config = correction_config(agg)
    config_check(config)
    old, infer, mask = inputs
    (w, f, m), cpu_ms = _timed(lambda: corr.compute_train_infer_correction(old, infer, mask, config),
                               torch.device("cpu"), repeats)
    on = [t.to(device) for t in inputs]
    (wd, fd, md), dev_ms = _timed(lambda: corr.compute_train_infer_correction(*on, config), device, repeats)
    flips = fd.cpu() != f
    margin = bound_margin(old, infer, mask, agg, corr.segment_mean, config)
    border_flips = int((flips & (margin < BORDER)).sum())
    hard_flips = int(flips.sum()) - border_flips
    valid_tokens = float(mask.sum())
    # a border flip moves a pass rate (and final_mask_mean) by 1 / valid tokens
    metric_abs = 1e-7 + border_flips / max(valid_tokens, 1.0)
    bad_metrics = sorted(k for k in m if not math.isclose(md.get(k, math.nan), m[k], rel_tol=1e-5, abs_tol=metric_abs)
                         and not (math.isnan(m[k]) and math.isnan(md.get(k, 0.0))))
    weights_close = bool(torch.allclose(wd.cpu(), w, rtol=1e-6, atol=1e-7))
    return {
        "ok": hard_flips == 0 and weights_close and not bad_metrics and set(md) == set(m)
        and wd.device.type == device.type and fd.device.type == device.type,
        "mask_flips_off_border": hard_flips,
        "mask_flips_at_border": border_flips,
        "kept_share": round(float((f * mask).sum()) / max(valid_tokens, 1.0), 6),
        "weight_max_abs_diff": _max_diff(wd, w),
        "weights_allclose": weights_close,
        "metrics_differing": bad_metrics,
        "ms": {"cpu": cpu_ms, "device": dev_ms},
    }


def check_helpers(mods, inputs, device) -> dict:
    corr = mods["corrections"]
    old, _, mask = inputs
    finite_old = torch.nan_to_num(old, nan=0.0)
    seg = corr.segment_mean(finite_old, mask)
    seg_d = corr.segment_mean(finite_old.to(device), mask.to(device)).cpu()
    keep = (torch.arange(mask.numel()).reshape(mask.shape) % 3 != 0).float()
    applied = corr.apply_correction_mask(mask, keep)
    applied_d = corr.apply_correction_mask(mask.to(device), keep.to(device)).cpu()
    seg_close = bool(torch.allclose(seg_d, seg, rtol=1e-6, atol=1e-7))
    applied_equal = bool(torch.equal(applied_d, applied))
    return {"ok": seg_close and applied_equal, "segment_mean_max_abs_diff": _max_diff(seg_d, seg),
            "segment_mean_allclose": seg_close, "apply_correction_mask_equal": applied_equal}


# ---- training step ---------------------------------------------------------------------------


def tiny_qwen2(vocab: int, positions: int, seed: int):
    """A 2-layer Qwen2 with random weights (float32, CPU), built in place: no download."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                         tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).eval()


def synthetic_batch(mods, rows: int, prompt: int, response: int, vocab: int, seed: int):
    """A padded ``RolloutBatch`` of ``rows`` responses in groups of 4 (CPU): prompts of
    prompt/2..prompt tokens left-padded, responses of response/4..response tokens right-padded,
    an environment-token gap in every other row, 0/1 rewards -> GRPO advantages. ``infer_logprobs``
    are filled in by the caller."""
    g = torch.Generator().manual_seed(seed)
    pad = 0
    p_len = torch.randint(max(prompt // 2, 1), prompt + 1, (rows,), generator=g)
    r_len = torch.randint(max(response // 4, 1), response + 1, (rows,), generator=g)
    prompt_mask = (torch.arange(prompt)[None, :] >= prompt - p_len[:, None]).long()
    prompt_ids = torch.where(prompt_mask.bool(), torch.randint(1, vocab, (rows, prompt), generator=g), pad)
    inside = torch.arange(response)[None, :] < r_len[:, None]
    response_ids = torch.where(inside, torch.randint(1, vocab, (rows, response), generator=g), pad)
    gap = (torch.arange(response) % 16 >= 12)[None, :] & (torch.arange(rows) % 2 == 1)[:, None]
    response_mask = (inside & ~gap).float()
    groups = rows // 4
    rewards = (torch.rand(rows, generator=g) > 0.5).float()
    advantages = mods["batch"].grpo_advantages(rewards.view(groups, 4)).reshape(rows)
    return mods["batch"].RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
        response_mask=response_mask, infer_logprobs=torch.zeros(rows, response),
        response_lengths=r_len, response_level_rewards=rewards,
        advantages=advantages[:, None] * response_mask,
        group_index=torch.arange(rows) // 4, group_keys=[f"g{k}" for k in range(groups)],
        prompt_ids_str=[f"p{k // 4}" for k in range(rows)], sample_index=[k % 4 for k in range(rows)],
        policy_versions=[0] * rows, step=0)


def one_step(mods, model, batch, device, dtype, micro: int, config_check) -> dict:
    """``PolicyTrainer.train``'s sequence on a copy of ``model`` moved to ``device`` / ``dtype``."""
    corr, grpo = mods["corrections"], mods["grpo"]
    config_check(STEP_CORRECTION)
    model = copy.deepcopy(model).to(device=device, dtype=dtype)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    _sync(device)
    start = time.perf_counter()
    old = mods["logprobs"].response_log_probs(model, batch, micro_batch_size=micro)
    mask = batch.response_mask.to(device)
    weight, filter_mask, _ = corr.compute_train_infer_correction(
        old, batch.infer_logprobs.to(device), mask, STEP_CORRECTION)
    final = corr.apply_correction_mask(mask, filter_mask)
    report = grpo.train_step(model, optimizer, batch, old, final, grpo.PolicyLossConfig(), is_weight=weight,
                             micro_batch_size=micro, max_grad_norm=1.0)
    _sync(device)
    seconds = time.perf_counter() - start
    change = max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before))
    return {"loss": report.loss, "grad_norm": report.grad_norm, "skipped": report.skipped,
            "weights_max_change": change, "seconds": round(seconds, 4),
            "old": old.detach().cpu(), "final": final.cpu()}


def _step_figures(r: dict) -> dict:
    return {k: r[k] for k in ("loss", "grad_norm", "weights_max_change", "seconds")}


def _step_ok(r: dict) -> bool:
    return (not r["skipped"] and math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
            and r["grad_norm"] > 0 and r["weights_max_change"] > 0)


def warm_step(*args) -> dict:
    """``one_step`` run twice from the same weights; the second's figures, so ``seconds`` leaves
    out the first call's lazy set-up (cuBLAS handles, kernel selection)."""
    one_step(*args)
    return one_step(*args)


def check_step_float32(mods, model, batch, device, micro, config_check) -> dict:
    ref = warm_step(mods, model, batch, torch.device("cpu"), torch.float32, micro, config_check)
    dev = warm_step(mods, model, batch, device, torch.float32, micro, config_check)
    loss_close = math.isclose(dev["loss"], ref["loss"], rel_tol=1e-4, abs_tol=1e-6)
    grad_close = math.isclose(dev["grad_norm"], ref["grad_norm"], rel_tol=1e-3, abs_tol=1e-6)
    old_close = bool(torch.allclose(dev["old"], ref["old"], rtol=1e-4, atol=1e-5))
    final_equal = bool(torch.equal(dev["final"], ref["final"]))
    return {
        "ok": _step_ok(ref) and _step_ok(dev) and loss_close and grad_close and old_close and final_equal,
        "cpu": _step_figures(ref), "device": _step_figures(dev),
        "loss_allclose": loss_close, "grad_norm_allclose": grad_close,
        "old_log_probs_max_abs_diff": _max_diff(dev["old"], ref["old"]), "old_log_probs_allclose": old_close,
        "final_mask_equal": final_equal, "tokens_trained": int(ref["final"].sum()),
    }


def check_step_bfloat16(mods, model, batch, device, micro, config_check) -> dict:
    r = warm_step(mods, model, batch, device, torch.bfloat16, micro, config_check)
    return {"ok": _step_ok(r), **_step_figures(r), "tokens_trained": int(r["final"].sum())}


# ---- vLLM on the device ----------------------------------------------------------------------

VLLM_VOCAB = 512
VLLM_PROMPT = [5, 17, 42, 8, 99, 3, 250, 64]


def vllm_model(folder: Path, seed: int):
    """A 2-layer Llama with a tied output embedding, random weights (float32) and a word-level
    tokenizer of its vocabulary, saved to ``folder`` for vLLM to load: nothing is downloaded.
    Returns the transformers model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=VLLM_VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VLLM_VOCAB)}, unk_token="w2"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, bos_token="w0", eos_token="w1", unk_token="w2").save_pretrained(folder)
    return model


def check_vllm(mods, device, workdir: Path, seed: int) -> dict:
    """vLLM in this process on ``device`` (bfloat16): greedy generation from token ids with
    per-token logprobs, then new weights loaded into the same engine in place, as rollstream's
    in-process backend does it (``collective_rpc("reload_weights")``, the worker extension's
    ``refresh_output_embedding``, ``reset_prefix_cache``). ok: each time, the engine's logprobs
    are within 0.1 nats of a float32 forward pass of the weights it should hold (bfloat16 on a
    random 2-layer model stays far inside; the other weights' are far outside), and the reload
    changed its answer. Skipped, with the reason, without vLLM or with a vLLM built for another
    device."""
    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vLLM is not installed in this Python (pip install vllm; on a CPU: make vllm-env)"}
    from vllm.platforms import current_platform

    if current_platform.device_type != device.type:
        return {"skipped": f"this vLLM is built for {current_platform.device_type!r}, the check is on {device.type!r}"}
    from vllm import LLM, SamplingParams

    first, second = vllm_model(workdir / "v0", seed), vllm_model(workdir / "v1", seed + 1)
    # its workers import rollstream's worker extension from this checkout
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    extra = {"gpu_memory_utilization": 0.2} if device.type == "cuda" else {}
    t0 = time.perf_counter()
    llm = LLM(model=str(workdir / "v0"), dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=seed,
              worker_extension_cls="rollstream.inference.vllm_extension.WeightSyncExtension", **extra)
    start_s = time.perf_counter() - t0
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)

    def probe() -> tuple[list[int], list[float]]:
        [out] = llm.generate([{"prompt_token_ids": VLLM_PROMPT}], sampling_params=greedy, use_tqdm=False)
        ids = list(out.outputs[0].token_ids)
        return ids, [float(step[t].logprob) for t, step in zip(ids, out.outputs[0].logprobs)]

    def off(model, ids: list[int], logprobs: list[float]) -> float:
        expected = mods["logprobs"].sequence_log_probs(model.to(device), VLLM_PROMPT, ids)
        return max(abs(a - b) for a, b in zip(logprobs, expected))

    before = probe()
    t0 = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(workdir / "v1")})
    llm.collective_rpc("refresh_output_embedding")
    llm.reset_prefix_cache()
    reload_ms = (time.perf_counter() - t0) * 1000
    after = probe()
    figures = {"engine_start_s": round(start_s, 1), "reload_ms": round(reload_ms, 1),
               "before_off_its_weights": off(first, *before), "after_off_new_weights": off(second, *after),
               "after_off_old_weights": off(first, *after), "answer_changed": after != before}
    ok = (figures["before_off_its_weights"] < 0.1 and figures["after_off_new_weights"] < 0.1
          and figures["after_off_old_weights"] > 0.1 and figures["answer_changed"])
    return {"ok": ok, **figures}


# ---- main ------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="device checked against the CPU; cpu = self-test of the script")
    p.add_argument("--mask-rows", type=int, default=16)
    p.add_argument("--mask-cols", type=int, default=4096)
    p.add_argument("--step-rows", type=int, default=16, help="responses in the training batch (groups of 4)")
    p.add_argument("--step-prompt", type=int, default=32)
    p.add_argument("--step-response", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per correction and device")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="small sizes and one repeat (the unit test)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.tiny:
        args.mask_rows, args.mask_cols, args.repeats = 4, 256, 1
        args.step_rows, args.step_prompt, args.step_response, args.vocab = 8, 8, 32, 64
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.step_rows < 4 or args.step_rows % 4:
        p.error("--step-rows must be a positive multiple of 4 (groups of 4)")
    return args


def emit(result: dict, out: Path | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    result = {"ok": False, "device": args.device, "device_name": None, "python": platform.python_version(),
              "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if args.device == "cuda" and not torch.cuda.is_available():
        result["error"] = (f"CUDA is not available (torch {torch.__version__}, built for CUDA "
                           f"{torch.version.cuda}): nothing checked; --device cpu runs the self-test")
        emit(result, args.out)
        print(f"gpu_check: {result['error']}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    torch.set_float32_matmul_precision("highest")  # no TF32: the float32 step is compared with the CPU
    import transformers

    result["transformers"] = transformers.__version__
    result["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    try:
        mods, result["stand_ins"] = load_trainer()
    except Exception as exc:  # noqa: BLE001  (reported in the JSON like a failed check)
        result["error"] = f"importing rollstream's trainer modules failed: {type(exc).__name__}: {exc}"
        emit(result, args.out)
        return 1
    result["rollstream_modules"] = sorted(m for m in sys.modules if m.startswith("rollstream"))
    result["sizes"] = {"mask": [args.mask_rows, args.mask_cols],
                       "step": {"rows": args.step_rows, "prompt": args.step_prompt,
                                "response": args.step_response, "vocab": args.vocab,
                                "micro_batch": args.micro_batch}}

    parse = mods["corrections"].parse_correction_config

    def config_check(config: dict) -> None:
        """With pydantic present: the real parser must read the config to exactly the values the
        stand-in would use (no default filled in), so both paths check the same thing."""
        parsed = parse(config)
        if hasattr(parsed, "model_dump") and parsed.model_dump() != config:
            raise AssertionError(f"config not spelled out in full: {parsed.model_dump()}")

    checks: dict = {}
    inputs = correction_inputs(args.mask_rows, args.mask_cols, args.seed)
    for agg in AGGS:
        _run_check(checks, f"correction_{agg}",
                   lambda agg=agg: check_correction(mods, agg, inputs, device, args.repeats, config_check))
    _run_check(checks, "correction_helpers", lambda: check_helpers(mods, inputs, device))
    try:
        model = tiny_qwen2(args.vocab, args.step_prompt + args.step_response + 8, args.seed)
        batch = synthetic_batch(mods, args.step_rows, args.step_prompt, args.step_response, args.vocab, args.seed)
        # the engine's logprobs: the CPU model's, off by N(0, 0.02) at trained tokens
        old = mods["logprobs"].response_log_probs(model, batch, micro_batch_size=args.micro_batch)
        noise = torch.randn(old.shape, generator=torch.Generator().manual_seed(args.seed + 1)) * 0.02
        batch.infer_logprobs = (old + noise) * batch.response_mask
        _run_check(checks, "train_step_float32",
                   lambda: check_step_float32(mods, model, batch, device, args.micro_batch, config_check))
        _run_check(checks, "train_step_bfloat16",
                   lambda: check_step_bfloat16(mods, model, batch, device, args.micro_batch, config_check))
    except Exception as exc:  # noqa: BLE001  (building the model or batch failed: both steps fail)
        checks.setdefault("train_step_float32", _failure(exc))
        checks.setdefault("train_step_bfloat16", _failure(exc))
    with tempfile.TemporaryDirectory(prefix="gpu-check-vllm-") as tmp:
        _run_check(checks, "vllm_reload_in_place", lambda: check_vllm(mods, device, Path(tmp), args.seed))
    result["checks"] = checks
    result["heavy_modules_loaded"] = [m for m in HEAVY if sys.modules.get(m) is not None]
    result["skipped"] = {name: c["skipped"] for name, c in checks.items() if "skipped" in c}
    result["ok"] = all(c["ok"] for c in checks.values() if "skipped" not in c)
    result["seconds"] = round(time.perf_counter() - started, 2)
    emit(result, args.out)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
