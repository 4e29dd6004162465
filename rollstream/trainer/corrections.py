"""Train-infer correction: importance-sampling weights and token filters, vectorised torch.

The inference engine samples with its own numerics (``infer_logprobs``); the trainer recomputes
the old policy's logprobs (``old_log_probs``). Where the two disagree, the reference system
(ROLL) can reweight each token's loss by a clipped probability ratio and drop tokens, segments or
whole rows whose ratio or probability difference leaves a band. This module computes both, with
the reference's formulas, defaults and metric names, and with the deliberate differences listed
below.

Entry points:

- ``compute_train_infer_correction(old_log_probs, infer_logprobs, response_mask, config, *,
  global_valid_samples=None, global_valid_tokens=None) -> (is_weight, filter_mask, metrics)``.
- ``apply_correction_mask(mask, filter_mask)``: the mask the loss (and its normaliser) uses.
- ``segment_mean(values, mask)``: per-segment masked mean, the segment granularity's helper.
- ``TrainInferCorrectionConfig`` (pydantic) and ``parse_correction_config``: the
  ``train_infer_correction`` YAML mapping, validated; defined in rollstream.config.corrections
  (the config layer reads it without the trainer) and re-exported here.

Notation (the reference's), per row b and position t of ``[B, T]`` tensors:
``o`` = old logprob, ``i`` = infer logprob, ``m`` = mask, ``l = o - i``, ``n_b = sum_t m``.

====================  ==============================================  =============================
agg                   ratio at (b, t)                                 diff at (b, t)
====================  ==============================================  =============================
token                 ``exp(l_t)``                                    ``exp(o_t) - exp(i_t)``
geometric             ``exp(sum_t m*l / (n_b + 1e-8))``, broadcast    ``sum_t m*diff / (n_b + 1e-8)``
sequence              ``exp(sum_t m*l)``, broadcast                   ``sum_t m*diff``
segment               ``exp(sum_S l / (|S| + 1e-8))`` inside run S    ``sum_S diff / (|S| + 1e-8)``
                      of consecutive valid tokens, 1 outside          inside, 0 outside
====================  ==============================================  =============================

Where we differ from the reference on purpose (each one tested in
``tests/trainer/test_corrections.py``):

1. **Masked inputs first.** Where ``m == 0`` we use ``o = i = 0`` (so ``l = 0`` and ``diff = 0``)
   before any arithmetic. A non-finite logprob at padding or at an environment token therefore
   never touches its row (the reference multiplies ``inf * 0 = NaN`` inside masked sums and drops
   the whole row for geometric/sequence, and every monitoring metric becomes NaN).
   Consequence for finite inputs: at masked positions the *token* ratio is 1 and the token diff 0
   (the reference evaluates ``exp(o - i)`` of whatever the padding holds). Values at masked
   positions never matter to training (the mask is 0 there); at valid positions, and for the
   other granularities everywhere, the outputs are the reference's.
2. **Pass rates over valid tokens.** ``..._ratio_mask_mean@sum``, ``..._diff_mask_mean@sum`` and
   ``actor/is_weight_clipfrac@sum`` count valid tokens only (numerator and denominator), so they
   never exceed 1. The reference counts padding and empty rows in the numerator only (1.6
   "pass rate"; clipfrac 0.6 where the true value is 0.2).
3. **One metric key per filter** (see "Metric keys"): two enabled filters with the same
   ``agg_type`` no longer overwrite each other's pass rate.
4. **Sequence ratio decided in log space.** ``ratio_low <= exp(S) <= ratio_high`` is evaluated as
   ``log(ratio_low) <= S <= log(ratio_high)`` in float64 (``log`` of a bound <= 0 is ``-inf``), so
   a float32 overflow of ``exp(S)`` cannot turn a decision (e.g. ``ratio_high = 1e39`` is inf in
   float32). The reported ``ratio_sequence`` metric is still ``exp(S)`` and may be ``inf``.
5. **No NaN weight.** A non-finite IS weight after clamping (NaN from a NaN logprob at a valid
   token, or ``+inf`` when ``upper_bound`` is None) becomes 0, so ``weight * mask`` stays finite
   in the loss (the reference keeps NaN, which makes the masked loss NaN).
   ``+inf`` with an ``upper_bound`` is clamped to it, as in the reference.
6. **Dtypes.** ``filter_mask`` is always float32 0/1 (the reference returns int64 ones when no
   check ran, else float32) and ``apply_correction_mask`` keeps the mask's dtype (the reference
   turns ``final_response_mask`` into int64).
7. **Extra metrics, always emitted**: ``final_mask_mean`` (the reference emits it only when the
   ``filters`` list is non-empty), ``mask_collapse``, ``all_masked`` and ``nonfinite_frac@sum``.
8. Sums accumulate in float64 and are rounded to float32, so long rows keep their precision and
   the summation order (CPU vs CUDA atomics) practically never shows; per-token values are float32.

Kept from the reference: the four granularities and their formulas, the ``1e-8`` in the mean
denominators, inclusive bounds, NaN failing every bound, filters applied in list order (their
masks multiply), an empty row's geometric/sequence ratio 1 and diff 0, masked positions of
``is_weight`` not zeroed, the IS weight clamped to ``[0, upper_bound]`` and detached by default,
``G_s`` / ``G_t`` from the caller when given, and a *valid* non-finite logprob propagating into
the monitoring means (they become NaN/inf; ``nonfinite_frac@sum`` says how many tokens).

Metric keys (values are Python floats; ``@sum`` = the caller sums them over micro-batches, with
``G_s`` = ``global_valid_samples`` or the number of rows with a valid token, ``G_t`` =
``global_valid_tokens`` or the number of valid tokens, each at least 1):

- ``actor/train_infer_ratio_{agg}_mean@sum``, ``actor/train_infer_diff_{agg}_mean@sum`` for agg in
  token, geometric, sequence, segment: the masked mean over each row's valid tokens, summed over
  rows, divided by ``G_s + 1e-8``. Always.
- ``actor/is_weight_clipfrac@sum``: valid tokens whose weight exceeds ``upper_bound``, / ``G_t``.
  Only when the weight is enabled and ``upper_bound`` is not None.
- ``actor/train_infer_{agg}_ratio_mask_mean@sum`` / ``actor/train_infer_{agg}_diff_mask_mean@sum``:
  valid tokens passing that check, / ``G_t``; one per enabled check. The **first** enabled filter
  of each ``agg_type`` keeps this reference key; every later enabled filter of the same
  ``agg_type`` is keyed by its 0-based position ``i`` in the ``filters`` list (disabled entries
  count): ``actor/train_infer_{agg}_{i}_ratio_mask_mean@sum`` (``..._diff_...`` likewise).
  ``filter_metric_keys(config)`` lists them.
- ``actor/train_infer_final_mask_mean``: ``sum(m * F) / (sum(m) + 1e-8)``, the share of valid
  tokens every filter kept (0 when there is no valid token). Always.
- ``actor/train_infer_mask_collapse``: 1.0 when the removed share of valid tokens,
  ``(sum(m) - sum(m * F)) / max(sum(m), 1)``, exceeds ``mask_collapse_threshold`` (default 0.5),
  else 0.0. Always.
- ``actor/train_infer_all_masked``: 1.0 when no valid token survives, ``sum(m * F) == 0`` (also
  when the input mask had none), else 0.0: the trainer should skip the step. Always.
- ``actor/train_infer_nonfinite_frac@sum``: valid tokens whose old or infer logprob is NaN/inf,
  / ``G_t``. Always.

All of this is local to one call; ``final_mask_mean``, ``mask_collapse`` and ``all_masked`` use
the local mask, never the global counts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

# The validated config lives in the config layer (below the trainer); re-exported for callers here.
from rollstream.config.corrections import (
    AGG_TYPES,
    CorrectionFilterConfig,
    ISWeightConfig,
    TrainInferCorrectionConfig,
    parse_correction_config,
)

__all__ = [
    "AGG_TYPES",
    "CorrectionFilterConfig",
    "ISWeightConfig",
    "METRIC_PREFIX",
    "TrainInferCorrectionConfig",
    "apply_correction_mask",
    "compute_train_infer_correction",
    "filter_metric_keys",
    "parse_correction_config",
    "segment_mean",
]

_MONITOR_ORDER = ("token", "geometric", "sequence", "segment")  # the reference's key order
_MEAN_EPS = 1e-8  # the reference's only epsilon, in mean denominators
METRIC_PREFIX = "actor/train_infer_"  # every metric key of the correction starts so
_F64 = torch.float64  # accumulator dtype of every sum


def filter_metric_keys(
    config: TrainInferCorrectionConfig | Mapping[str, Any] | None,
) -> list[dict[str, Any]]:
    """Pass-rate metric keys of each enabled filter, in list order.

    Returns one dict per enabled filter with ``index`` (int, position in ``filters``),
    ``ratio`` and ``diff`` keys (present only for checks that are on). The first enabled filter
    of an ``agg_type`` gets the reference key ``actor/train_infer_{agg}_ratio_mask_mean@sum``;
    later ones ``actor/train_infer_{agg}_{i}_ratio_mask_mean@sum``.
    """
    cfg = parse_correction_config(config)
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    for i, f in enumerate(cfg.filters):
        if not f.enabled:
            continue
        tag = f.agg_type if f.agg_type not in seen else f"{f.agg_type}_{i}"
        seen.add(f.agg_type)
        keys: dict[str, Any] = {"index": i}
        if f.ratio_enabled:
            keys["ratio"] = f"{METRIC_PREFIX}{tag}_ratio_mask_mean@sum"
        if f.diff_enabled:
            keys["diff"] = f"{METRIC_PREFIX}{tag}_diff_mask_mean@sum"
        out.append(keys)
    return out


# ---- tensor helpers --------------------------------------------------------------------------


def _check_01(mask: Tensor, valid: Tensor, name: str) -> None:
    """``valid`` is ``mask.bool()``; a 0/1 mask equals it elementwise."""
    if mask.dtype != torch.bool and not bool((mask == valid).all()):
        raise ValueError(f"{name} must hold only 0 and 1")


def _segment_index(valid: Tensor) -> tuple[Tensor, Tensor]:
    """Segment bucket of every position and the length of every segment.

    ``valid``: (B, T) bool. A segment is a maximal run of consecutive valid positions in one row
    (the reference's segment granularity). Returns ``idx`` (B*T,) int64, the segment's number
    counted over the flattened batch, or B*T (a dump bucket) outside every segment, and
    ``counts`` (B*T + 1,) float64, the number of positions per bucket. No Python loop: starts are
    ``valid & ~previous``, numbers their cumsum.
    """
    B, T = valid.shape
    prev = torch.zeros_like(valid)
    prev[:, 1:] = valid[:, :-1]
    start = (valid & ~prev).reshape(-1)
    flat_valid = valid.reshape(-1)
    seg = torch.cumsum(start, dim=0) - 1
    idx = torch.where(flat_valid, seg, torch.full_like(seg, B * T))
    counts = torch.zeros(B * T + 1, dtype=_F64, device=valid.device)
    counts.scatter_add_(0, idx, flat_valid.to(_F64))
    return idx, counts


def _segment_mean_at(masked_values: Tensor, idx: Tensor, counts: Tensor) -> Tensor:
    """``sum_S v / (|S| + 1e-8)`` at each position of segment S, 0 outside; float64 sums.

    ``masked_values`` must already hold 0 at every masked position: the dump bucket then sums to
    0 and its mean 0 / (0 + 1e-8) = 0 is what masked positions read back.
    """
    sums = torch.zeros(counts.shape[0], dtype=_F64, device=masked_values.device)
    sums = sums.scatter_add(0, idx, masked_values.reshape(-1).to(_F64))
    means = sums / (counts + _MEAN_EPS)
    per_pos = means.gather(0, idx).reshape(masked_values.shape)
    return per_pos.to(masked_values.dtype if masked_values.is_floating_point() else torch.float32)


def segment_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Per-segment masked mean, broadcast over each segment; 0 outside every segment.

    A segment is each maximal run of consecutive positions with ``mask == 1`` in a row; its value
    is ``sum_S values / (|S| + 1e-8)`` (the reference's
    ``compute_segment_masked_mean``). Masked positions never contribute, even when they hold
    NaN/inf; a non-finite value inside a segment affects that segment only.

    Args:
        values: ``(B, T)`` floating tensor.
        mask: ``(B, T)`` 0/1 tensor (bool, integer or floating) on the same device.

    Returns:
        ``(B, T)`` tensor of ``values.dtype`` (float32 for non-floating ``values``); sums
        accumulate in float64. Vectorised: segment numbers from a cumsum over run starts, sums by
        ``scatter_add``.

    Raises:
        ValueError: shapes differ or are not 2-D, devices differ, or ``mask`` is not 0/1.
    """
    if values.dim() != 2 or values.shape != mask.shape:
        raise ValueError(f"segment_mean expects two (B, T) tensors of one shape, got "
                         f"{tuple(values.shape)} and {tuple(mask.shape)}")
    if values.device != mask.device:
        raise ValueError(f"values on {values.device} but mask on {mask.device}")
    valid = mask.bool()
    _check_01(mask, valid, "mask")
    idx, counts = _segment_index(valid)
    masked = torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return _segment_mean_at(masked, idx, counts)


def apply_correction_mask(mask: Tensor, filter_mask: Tensor) -> Tensor:
    """The loss mask after the correction: ``mask`` where ``filter_mask != 0``, else 0.

    Take the loss normaliser (number of trained tokens) from this result, not from ``mask``:
    a token the correction removed must not count.

    Args:
        mask: ``(B, T)`` 0/1 mask of any dtype (float32 ``response_mask`` of a ``RolloutBatch``),
            or ``(B, T + 1)`` in the reference's full-width layout, where the statistics used
            ``mask[:, 1:]``; column 0 is then kept as is (as the reference's
            ``apply_train_infer_correction_to_batch`` does).
        filter_mask: ``(B, T)`` 0/1 from ``compute_train_infer_correction``.

    Returns:
        A new tensor of ``mask``'s shape, dtype and device (the reference overwrites in place and
        turns a same-width float mask into int64; we keep the dtype and never mutate the input).

    Raises:
        ValueError: shapes do not fit either layout, or devices differ.
    """
    if mask.dim() != 2 or filter_mask.dim() != 2 or mask.shape[0] != filter_mask.shape[0]:
        raise ValueError(f"apply_correction_mask expects (B, T) masks, got {tuple(mask.shape)} "
                         f"and {tuple(filter_mask.shape)}")
    if mask.device != filter_mask.device:
        raise ValueError(f"mask on {mask.device} but filter_mask on {filter_mask.device}")
    keep = filter_mask != 0
    zero = torch.zeros((), dtype=mask.dtype, device=mask.device)
    if mask.shape[1] == filter_mask.shape[1]:
        return torch.where(keep, mask, zero)
    if mask.shape[1] == filter_mask.shape[1] + 1:
        out = mask.clone()
        out[:, 1:] = torch.where(keep, mask[:, 1:], zero)
        return out
    raise ValueError(f"mask width {mask.shape[1]} fits neither filter_mask width "
                     f"{filter_mask.shape[1]} nor that + 1")


# ---- the correction --------------------------------------------------------------------------


def _check_inputs(old: Tensor, infer: Tensor, mask: Tensor) -> Tensor:
    """Raise ValueError on bad inputs; return ``mask.bool()``."""
    for name, t in (("old_log_probs", old), ("infer_logprobs", infer), ("response_mask", mask)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a (B, T) tensor, got {type(t).__name__}"
                             + (" (the correction needs the engine's logprobs; no silent fallback)"
                                if t is None else ""))
    if old.dim() != 2 or old.shape != infer.shape or old.shape != mask.shape:
        raise ValueError("old_log_probs, infer_logprobs and response_mask must be (B, T) of one "
                         f"shape, got {tuple(old.shape)}, {tuple(infer.shape)}, {tuple(mask.shape)}")
    if not (old.is_floating_point() and infer.is_floating_point()):
        raise ValueError(f"logprobs must be floating tensors, got {old.dtype} and {infer.dtype}")
    if not (old.device == infer.device == mask.device):
        raise ValueError(f"tensors on different devices: {old.device}, {infer.device}, {mask.device}")
    valid = mask.bool()
    _check_01(mask, valid, "response_mask")
    return valid


def _global_count(value: int | None, local: Tensor, name: str) -> Tensor:
    """The caller's global count, or the local one; at least 1 (float64 scalar tensor)."""
    if value is None:
        return local.to(_F64).clamp(min=1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    return torch.tensor(max(float(value), 1.0), dtype=_F64, device=local.device)


def _log_bound(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def compute_train_infer_correction(
    old_log_probs: Tensor,
    infer_logprobs: Tensor,
    response_mask: Tensor,
    config: TrainInferCorrectionConfig | Mapping[str, Any] | None,
    *,
    global_valid_samples: int | None = None,
    global_valid_tokens: int | None = None,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """IS weights, filter mask and metrics of the train-infer correction.

    Formulas, defaults and metric names are the reference's (table in the module doc); the
    differences from the reference are listed in the module doc. Everything runs on the tensors'
    device, vectorised (no loop over rows or tokens); per-token values are float32, sums
    accumulate in float64.

    Args:
        old_log_probs: ``(B, T)`` floating, the trainer's logprobs of the sampled tokens (cast to
            float32). May require grad; see ``is_weight.detach``.
        infer_logprobs: ``(B, T)`` floating, the engine's logprobs (``RolloutBatch.infer_logprobs``).
        response_mask: ``(B, T)`` 0/1 (bool, integer or floating), 1 = trained token. Inputs at
            ``0`` positions are ignored entirely (read as ``o = i = 0``), whatever they hold.
        config: the ``train_infer_correction`` mapping or a ``TrainInferCorrectionConfig``;
            ``None`` = defaults (weight off, no filters).
        global_valid_samples: ``G_s`` for the ``@sum`` monitoring means (worker-level calls pass
            the global number of rows with a valid token); default: local count. At least 1.
        global_valid_tokens: ``G_t`` for the pass-rate, clipfrac and non-finite ``@sum``
            metrics; default: local number of valid tokens. At least 1.

    Returns:
        ``(is_weight, filter_mask, metrics)``:

        - ``is_weight``: ``(B, T)`` float32. All ones when the weight is disabled; else the ratio
          of ``weight_type`` clamped to ``[0, upper_bound]`` (no clamp if None), non-finite -> 0,
          detached when ``detach``. Masked positions are not zeroed (token: 1 there; row and
          segment granularities: their broadcast value).
        - ``filter_mask``: ``(B, T)`` float32 0/1, the product of every enabled check; never
          requires grad. Multiply it into the loss mask with ``apply_correction_mask``.
        - ``metrics``: ``dict[str, float]``, keys in the module doc.

    Raises:
        ValueError: invalid config (see ``parse_correction_config``), a missing tensor, shapes not
            ``(B, T)`` or unequal, non-floating logprobs, tensors on different devices, a mask
            with values other than 0/1, or a negative global count.
    """
    cfg = parse_correction_config(config)
    valid = _check_inputs(old_log_probs, infer_logprobs, response_mask)
    device = old_log_probs.device
    f32 = torch.float32
    zero32 = torch.zeros((), dtype=f32, device=device)

    o_raw = old_log_probs.to(f32)
    i_raw = infer_logprobs.to(f32)
    # o - i is non-finite exactly when o or i is (inf - inf = NaN)
    nonfinite_valid = valid & ~torch.isfinite(o_raw - i_raw)
    # Difference 1: masked positions read as o = i = 0 before any arithmetic, so inf * 0 never
    # happens and whatever padding holds cannot reach a row sum (nor a gradient).
    o = torch.where(valid, o_raw, zero32)
    i = torch.where(valid, i_raw, zero32)
    log_ratio = o - i                                   # l_t, 0 where masked
    diff_tok = torch.exp(o) - torch.exp(i)              # exp(o) - exp(i), 0 where masked

    n_row = valid.sum(dim=1)                            # (B,) int64
    n_row64 = n_row.to(_F64)
    total_valid = n_row.sum()
    G_s = _global_count(global_valid_samples, (n_row > 0).sum(), "global_valid_samples")
    G_t = _global_count(global_valid_tokens, total_valid, "global_valid_tokens")

    # Row sums in float64 (masked positions already hold 0).
    S_ratio = torch.sum(log_ratio, dim=1, dtype=_F64)    # sum_t m*l
    S_diff = torch.sum(diff_tok, dim=1, dtype=_F64)      # sum_t m*diff
    seg_idx, seg_counts = _segment_index(valid)

    B, T = valid.shape

    def rows(x: Tensor) -> Tensor:  # (B,) -> (B, T) float32 view, broadcast over the row
        return x.to(f32)[:, None].expand(B, T)

    ratio = {
        "token": torch.exp(log_ratio),
        "geometric": rows(torch.exp((S_ratio / (n_row64 + _MEAN_EPS)).to(f32))),
        "sequence": rows(torch.exp(S_ratio.to(f32))),
        "segment": torch.exp(_segment_mean_at(log_ratio, seg_idx, seg_counts)),
    }
    diff = {
        "token": diff_tok,
        "geometric": rows(S_diff / (n_row64 + _MEAN_EPS)),
        "sequence": rows(S_diff),
        "segment": _segment_mean_at(diff_tok, seg_idx, seg_counts),
    }

    metric_values: dict[str, Tensor] = {}

    # Monitoring: seq-mean-token-mean over valid tokens, summed over rows, / (G_s + 1e-8).
    # Token and segment values are finite at masked positions (1 or 0 by difference 1), so a
    # multiplication by the mask is safe; row values need no per-token pass at all.
    valid32 = valid.to(f32)
    row_share = n_row64 / (n_row64 + _MEAN_EPS)         # mean of a row-broadcast value

    def seq_mean_token_mean(v: Tensor) -> Tensor:
        per_row = torch.sum(v * valid32, dim=1, dtype=_F64) / (n_row64 + _MEAN_EPS)
        return per_row.sum() / (G_s + _MEAN_EPS)

    def seq_mean_row_value(v_row: Tensor) -> Tensor:  # (B,) float32 row values
        per_row = torch.where(n_row > 0, v_row.to(_F64) * row_share, torch.zeros((), dtype=_F64, device=device))
        return per_row.sum() / (G_s + _MEAN_EPS)

    row_values = {
        "geometric": (ratio["geometric"][:, 0], diff["geometric"][:, 0]),
        "sequence": (ratio["sequence"][:, 0], diff["sequence"][:, 0]),
    } if T > 0 else {}
    for agg in _MONITOR_ORDER:
        if agg in row_values:
            r_row, d_row = row_values[agg]
            metric_values[f"{METRIC_PREFIX}ratio_{agg}_mean@sum"] = seq_mean_row_value(r_row)
            metric_values[f"{METRIC_PREFIX}diff_{agg}_mean@sum"] = seq_mean_row_value(d_row)
        else:
            metric_values[f"{METRIC_PREFIX}ratio_{agg}_mean@sum"] = seq_mean_token_mean(ratio[agg])
            metric_values[f"{METRIC_PREFIX}diff_{agg}_mean@sum"] = seq_mean_token_mean(diff[agg])

    def valid_frac(check: Tensor) -> Tensor:  # difference 2: valid tokens only, / G_t
        return (valid & check).sum().to(_F64) / G_t

    # IS weight (h, step 2).
    iw = cfg.is_weight
    if iw.enabled:
        w = ratio[iw.weight_type]
        if iw.upper_bound is not None:
            metric_values["actor/is_weight_clipfrac@sum"] = valid_frac(w > iw.upper_bound)
            w = w.clamp(min=0.0, max=iw.upper_bound)
        w = torch.where(torch.isfinite(w), w, zero32)   # difference 5
        if iw.detach:
            w = w.detach()
    else:
        w = torch.ones((B, T), dtype=f32, device=device)

    # Filters (h, step 3), in list order; checks multiply.
    fmask = torch.ones((B, T), dtype=f32, device=device)
    keys = iter(filter_metric_keys(cfg))
    for f in cfg.filters:
        if not f.enabled:
            continue
        fkeys = next(keys)
        if f.ratio_enabled:
            if f.agg_type == "sequence":  # difference 4: log space, float64
                lo, hi = _log_bound(f.ratio_low), _log_bound(f.ratio_high)
                row_ok = (S_ratio >= lo) & (S_ratio <= hi)
                check = row_ok[:, None].expand(B, T)
            else:
                r = ratio[f.agg_type]
                check = (r >= f.ratio_low) & (r <= f.ratio_high)
            fmask = fmask * check
            metric_values[fkeys["ratio"]] = valid_frac(check)
        if f.diff_enabled:
            d = diff[f.agg_type]
            check = (d >= f.diff_low) & (d <= f.diff_high)
            fmask = fmask * check
            metric_values[fkeys["diff"]] = valid_frac(check)

    kept = torch.sum(valid32 * fmask, dtype=_F64)
    total64 = total_valid.to(_F64)
    removed_frac = (total64 - kept) / total64.clamp(min=1.0)
    metric_values[f"{METRIC_PREFIX}final_mask_mean"] = kept / (total64 + _MEAN_EPS)
    metric_values[f"{METRIC_PREFIX}mask_collapse"] = (removed_frac > cfg.mask_collapse_threshold).to(_F64)
    metric_values[f"{METRIC_PREFIX}all_masked"] = (kept == 0).to(_F64)
    metric_values[f"{METRIC_PREFIX}nonfinite_frac@sum"] = nonfinite_valid.sum().to(_F64) / G_t

    names = list(metric_values)
    # One device sync for all metrics; float32 rounding first, like the reference's float32 math.
    values = torch.stack([metric_values[k].detach().to(_F64) for k in names]).to(f32).tolist()
    metrics = dict(zip(names, (float(v) for v in values)))
    return w, fmask, metrics
