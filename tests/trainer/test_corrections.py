"""Tests of rollstream.trainer.corrections against the reference vectors and our differences.

Vectors: ``tests/vectors/roll_reference_vectors.json`` key ``train_infer_correction``, obtained by
running the reference's own functions. Finite-input cases must match to 1e-6 except where we
deliberately do better; each such expectation is
spelled out below with the reason it differs from the vector.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.trainer.corrections import (
    AGG_TYPES,
    TrainInferCorrectionConfig,
    apply_correction_mask,
    compute_train_infer_correction,
    filter_metric_keys,
    parse_correction_config,
    segment_mean,
)

VECTORS = json.loads(
    (Path(__file__).resolve().parents[1] / "vectors" / "roll_reference_vectors.json").read_text()
)["train_infer_correction"]
COMPUTE = {c["name"]: c for c in VECTORS["compute"]}
APPLY = {c["name"]: c for c in VECTORS["apply_to_batch"]}
NAN_CASES = ("nan_inf_token", "nan_inf_geometric", "nan_inf_sequence", "nan_inf_segment")
FINITE_CASES = [n for n in COMPUTE if n not in NAN_CASES]

P = "actor/train_infer_"
MONITOR_KEYS = [f"{P}{kind}_{agg}_mean@sum" for agg in ("token", "geometric", "sequence", "segment")
                for kind in ("ratio", "diff")]
NAN, INF = math.nan, math.inf


def t(rows, dtype=torch.float32) -> torch.Tensor:
    """Vector JSON (numbers, "NaN", "Infinity", "-Infinity") -> tensor."""
    return torch.tensor([[float(v) for v in row] for row in rows], dtype=dtype)


def run_case(case, **overrides):
    inp = case["inputs"]
    return compute_train_infer_correction(
        t(inp["old_log_probs"]), t(inp["infer_log_probs"]), t(inp["response_mask"]), case["config"],
        global_valid_samples=inp["global_valid_samples"],
        global_valid_tokens=inp["global_valid_tokens"], **overrides)


def assert_metrics(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key, want in expected.items():
        if isinstance(want, float) and math.isnan(want):
            assert math.isnan(got[key]), key
        else:
            assert got[key] == pytest.approx(want, abs=1e-6, rel=0), key


# ---- finite compute vectors ------------------------------------------------------------------

# Our metric values where the vector holds the reference's buggy pass rates (it counts padding and
# empty rows in the numerator only): we count valid tokens only, so a rate never exceeds 1. The
# shared inputs have 15 valid tokens in rows 0, 1, 3; row 2 is empty (6 padding slots).
METRIC_FIXES = {
    # 12 of 15 valid tokens pass [0.8, 1.2]; the vector's 14/15 also counts padding that passes.
    "token_ratio_only": {f"{P}token_ratio_mask_mean@sum": 0.8},
    # all 15 valid tokens pass; the vector's 17/15 adds two padding slots.
    "token_diff_only": {f"{P}token_diff_mask_mean@sum": 1.0},
    # every valid token's row passes; the vector's 1.6 = 24/15 counts all 24 slots.
    "geometric_ratio": {f"{P}geometric_ratio_mask_mean@sum": 1.0},
    "geometric_ratio_and_diff": {f"{P}geometric_ratio_mask_mean@sum": 1.0,
                                 f"{P}geometric_diff_mask_mean@sum": 1.0},
    # rows 0 and 3 pass: 11/15; the vector's 1.2 = 18/15 counts the empty row's 6 slots.
    "sequence_ratio": {f"{P}sequence_ratio_mask_mean@sum": 11 / 15},
    # one key per filter: the first [0, 100] passes all 15; the second [0.95, 1.05] passes 9 of 15
    # under its own key. The vector's single key holds the second filter's value over all slots
    # (11/15), the first filter's rate is lost.
    "same_agg_type_twice_metric_overwrite": {f"{P}token_ratio_mask_mean@sum": 1.0,
                                             f"{P}token_1_ratio_mask_mean@sum": 0.6},
    # 3 of 15 valid tokens exceed 1.2; the vector's 0.6 adds 6 padding slots of the empty row.
    "is_weight_token_clamped": {"actor/is_weight_clipfrac@sum": 0.2},
    # G_t = 40. Geometric weights of rows 0 (1.026) and 1 (1.051) exceed 1.0: 9 valid tokens
    # (vector: 12 slots). 12 valid tokens pass the token filter (vector: 14 slots).
    "is_weight_geometric_with_explicit_globals": {"actor/is_weight_clipfrac@sum": 9 / 40,
                                                  f"{P}token_ratio_mask_mean@sum": 12 / 40},
}
# Metrics we always emit (module doc, "Metric keys"); the reference emits final_mask_mean only when
# the filters list is non-empty, the others not at all.
EXTRA_METRICS = {f"{P}final_mask_mean": 1.0, f"{P}mask_collapse": 0.0, f"{P}all_masked": 0.0,
                 f"{P}nonfinite_frac@sum": 0.0}


def _masked_token_expectation(config, vec_w, vec_f, mask):
    """Our values at masked positions where the token granularity is involved.

    Difference 1 (module doc): masked inputs read as o = i = 0, so the token ratio there is 1 and
    the token diff 0. The vector evaluates exp(o - i) of the padding values instead (e.g. 0.00745
    at row 1 column 2, 7.39 -> 1.2 in the empty row 2). Geometric, sequence and segment values at
    masked positions are the reference's (row broadcast / outside-segment constants).
    """
    cfg = parse_correction_config(config)
    w, f = vec_w.clone(), vec_f.clone()
    iw = cfg.is_weight
    if iw.enabled and iw.weight_type == "token":
        w[~mask] = 1.0 if iw.upper_bound is None else min(1.0, iw.upper_bound)
    enabled = [flt for flt in cfg.filters if flt.enabled]
    if any(flt.agg_type == "token" for flt in enabled):
        assert all(flt.agg_type == "token" for flt in enabled)  # true of every vector case
        keep = 1.0
        for flt in enabled:
            if flt.ratio_enabled:
                keep *= float(flt.ratio_low <= 1.0 <= flt.ratio_high)
            if flt.diff_enabled:
                keep *= float(flt.diff_low <= 0.0 <= flt.diff_high)
        f[~mask] = keep
    return w, f


@pytest.mark.parametrize("name", FINITE_CASES)
def test_compute_matches_finite_vectors(name):
    case = COMPUTE[name]
    out = case["outputs"]
    mask = t(case["inputs"]["response_mask"]).bool()
    w, f, metrics = run_case(case)

    exp_w, exp_f = _masked_token_expectation(case["config"], t(out["is_weight"]), t(out["filter_mask"]), mask)
    assert w.dtype == torch.float32 and f.dtype == torch.float32  # vector filter dtype may be int64
    assert torch.allclose(w, exp_w, atol=1e-6, rtol=0)
    assert torch.equal(f, exp_f)
    # At valid positions the values are exactly the vector's, and so is what training uses.
    assert torch.allclose(w[mask], t(out["is_weight"])[mask], atol=1e-6, rtol=0)
    effective = t(out["effective_mask (response_mask.long()*filter_mask.long())"])
    assert torch.equal(apply_correction_mask(mask.float(), f), effective)

    # vector keys win over EXTRA_METRICS (final_mask_mean where the vector has it), fixes win over both
    expected = {**EXTRA_METRICS, **out["metrics"], **METRIC_FIXES.get(name, {})}
    assert_metrics(metrics, {k: float(v) for k, v in expected.items()})


def test_masked_token_positions_are_neutral_not_padding_garbage():
    """Difference 1 on the finite vector ``is_weight_token_clamped``: masked slots get weight 1."""
    case = COMPUTE["is_weight_token_clamped"]
    w, _, _ = run_case(case)
    ref = t(case["outputs"]["is_weight"])
    assert ref[1, 2].item() == pytest.approx(0.007446582, abs=1e-8)  # exp(-5 - -0.1) of padding
    assert ref[2].tolist() == pytest.approx([1.2] * 6)                # exp(-1 - -3) clamped
    assert w[1, 2].item() == 1.0 and w[2].tolist() == [1.0] * 6
    assert w[0].tolist() == pytest.approx(ref[0].tolist(), abs=1e-7)


# ---- non-finite compute vectors --------------------------------------------------------------

# Inputs of every nan_inf case (3 rows x 4): row 0 has infer = -inf at its PADDING slot only, row 1
# -inf at a valid token (column 1), row 2 NaN at a valid token (column 2); 10 valid tokens.
# The vectors show the reference losing row 0 for geometric/sequence (inf * 0 = NaN in its masked
# sums) and NaN weights. Ours: row 0 is untouched (difference 1), NaN weights become 0
# (difference 5), pass rates/clipfrac count valid tokens (difference 2). The monitoring means stay
# NaN because row 2 holds a NaN at a VALID token (kept from the reference, and counted by
# nonfinite_frac = 2 / 10); test_nonfinite_padding_only_keeps_metrics_finite shows them finite when
# only padding is non-finite.
NAN_EXPECTED = {
    "nan_inf_token": {
        # row 1 col 1: ratio exp(+inf) = inf -> clamped to 1.2; row 2 col 2: NaN -> 0.
        "is_weight": [[1, 1, 1, 1], [1, 1.2, 1, 1], [1, 1, 0, 1]],
        # only the two offending valid tokens fail; row 0's padding (ratio 1) passes.
        "filter_mask": [[1, 1, 1, 1], [1, 0, 1, 1], [1, 1, 0, 1]],
        "metrics": {"actor/is_weight_clipfrac@sum": 0.1,  # vector 0.2 counts the padding inf
                    f"{P}token_ratio_mask_mean@sum": 0.8,  # vector 0.9 (9 of 12 slots)
                    f"{P}token_diff_mask_mean@sum": 0.8,
                    f"{P}final_mask_mean": 0.8, f"{P}mask_collapse": 0.0},
    },
    "nan_inf_geometric": {
        # row 0 keeps geometric ratio exp(0) = 1 (vector: NaN row); row 1 exp(inf) -> 1.2; row 2
        # NaN -> 0 (vector NaN).
        "is_weight": [[1] * 4, [1.2] * 4, [0] * 4],
        # row 0 passes (vector: dropped, inf * 0 at its padding); rows 1 and 2 fail.
        "filter_mask": [[1] * 4, [0] * 4, [0] * 4],
        "metrics": {"actor/is_weight_clipfrac@sum": 0.3,  # row 1's 3 valid tokens (vector 0.4)
                    f"{P}geometric_ratio_mask_mean@sum": 0.3,  # row 0 (vector 0.0)
                    # row 1's geometric diff (0 + 0.8187 + 0) / 3 = 0.273 fails: row 0 only
                    # (vector 0.4 counts row 1's padding slot... and row 0 is NaN there).
                    f"{P}geometric_diff_mask_mean@sum": 0.3,
                    f"{P}final_mask_mean": 0.3,  # vector 0.0: every row lost
                    f"{P}mask_collapse": 1.0},  # 70 % of valid tokens removed > 0.5
    },
    "nan_inf_sequence": {
        "is_weight": [[1] * 4, [1.2] * 4, [0] * 4],
        "filter_mask": [[1] * 4, [0] * 4, [0] * 4],
        "metrics": {"actor/is_weight_clipfrac@sum": 0.3,
                    f"{P}sequence_ratio_mask_mean@sum": 0.3,
                    f"{P}sequence_diff_mask_mean@sum": 0.3,  # row 1 diff sum 0.8187 fails
                    f"{P}final_mask_mean": 0.3, f"{P}mask_collapse": 1.0},
    },
    "nan_inf_segment": {
        # segment values as the reference (padding is outside every segment); row 2's NaN -> 0.
        "is_weight": [[1, 1, 1, 1], [1.2, 1.2, 1.2, 1], [0] * 4],
        "filter_mask": [[1, 1, 1, 1], [0, 0, 0, 1], [0] * 4],
        "metrics": {"actor/is_weight_clipfrac@sum": 0.3,  # same as the vector
                    f"{P}segment_ratio_mask_mean@sum": 0.3,  # vector 0.5 adds 2 padding slots
                    f"{P}segment_diff_mask_mean@sum": 0.3,
                    f"{P}final_mask_mean": 0.3, f"{P}mask_collapse": 1.0},
    },
}


@pytest.mark.parametrize("name", NAN_CASES)
def test_compute_nonfinite_vectors_our_behaviour(name):
    case = COMPUTE[name]
    exp = NAN_EXPECTED[name]
    w, f, metrics = run_case(case)
    assert torch.allclose(w, torch.tensor(exp["is_weight"], dtype=torch.float32), atol=1e-6, rtol=0)
    assert torch.isfinite(w).all()
    assert torch.equal(f, torch.tensor(exp["filter_mask"], dtype=torch.float32))
    # where the vector agrees with us (token and segment: every row's decision is the reference's)
    if name in ("nan_inf_token", "nan_inf_segment"):
        mask = t(case["inputs"]["response_mask"]).bool()
        assert torch.equal(f[mask], t(case["outputs"]["filter_mask"])[mask])
    expected = {k: NAN for k in MONITOR_KEYS}
    expected.update({f"{P}all_masked": 0.0, f"{P}nonfinite_frac@sum": 0.2})
    expected.update(exp["metrics"])
    assert_metrics(metrics, expected)


@pytest.mark.parametrize("agg", AGG_TYPES)
def test_nonfinite_padding_only_keeps_metrics_finite(agg):
    """Difference 1: -inf / NaN / +inf at masked slots never reach a row (vector row 0 pattern)."""
    old = torch.tensor([[-0.1, -0.2, -0.3, 0.0, -0.5]] * 3)
    clean = torch.tensor([[-0.12, -0.2, -0.25, 0.0, -0.5]] * 3)
    dirty = clean.clone()
    dirty[0, 3], dirty[1, 3], dirty[2, 3] = -INF, NAN, INF
    old_dirty = old.clone()
    old_dirty[1, 3] = -INF
    mask = torch.tensor([[1, 1, 1, 0, 1]] * 3, dtype=torch.float32)
    cfg = {"is_weight": {"enabled": True, "weight_type": agg},
           "filters": [{"enabled": True, "agg_type": agg, "diff_enabled": True}]}
    w0, f0, m0 = compute_train_infer_correction(old, clean, mask, cfg)
    w1, f1, m1 = compute_train_infer_correction(old_dirty, dirty, mask, cfg)
    assert torch.equal(w0, w1) and torch.equal(f0, f1)
    assert m0 == m1
    assert all(math.isfinite(v) for v in m1.values())
    assert m1[f"{P}nonfinite_frac@sum"] == 0.0
    # every row passes: ratios exp(0.02 - 0.05) etc. stay inside [0.8, 1.2]
    assert f1[mask.bool()].eq(1).all()


# ---- segment helper --------------------------------------------------------------------------


def test_segment_mean_matches_vector():
    vec = VECTORS["segment_helper"]
    got = segment_mean(t(vec["inputs"]["tensor"]), t(vec["inputs"]["mask"], torch.int64))
    assert torch.allclose(got, t(vec["output"]), atol=1e-6, rtol=0)
    assert got.dtype == torch.float32


def test_segment_mean_isolates_nonfinite_values():
    values = torch.tensor([[1.0, 3.0, NAN, INF, 2.0, 4.0, -INF, 7.0]])
    mask = torch.tensor([[1, 1, 0, 1, 0, 1, 1, 0]])
    got = segment_mean(values, mask)
    # segments: [0, 1] -> 2; [3] -> inf; [5, 6] -> -inf; masked NaN/inf contribute nothing
    assert got[0, :2].tolist() == pytest.approx([2.0, 2.0])
    assert got[0, 3].item() == INF and got[0, 5].item() == -INF and got[0, 6].item() == -INF
    assert got[0, [2, 4, 7]].tolist() == [0.0, 0.0, 0.0]
    # a segment never crosses a row boundary: row 0 ends valid, row 1 starts valid
    two = segment_mean(torch.tensor([[1.0, 5.0], [9.0, 11.0]]), torch.ones(2, 2))
    assert torch.allclose(two, torch.tensor([[3.0, 3.0], [10.0, 10.0]]))


def test_segment_mean_rejects_bad_input():
    with pytest.raises(ValueError, match="0 and 1"):
        segment_mean(torch.zeros(1, 3), torch.tensor([[0, 2, 1]]))
    with pytest.raises(ValueError, match="one shape"):
        segment_mean(torch.zeros(1, 3), torch.ones(1, 2))


# ---- apply_to_batch vectors ------------------------------------------------------------------


def _apply_case(name):
    case = APPLY[name]
    inp = case["inputs"]
    response_mask = t(inp["response_mask"], torch.int64)  # [B, T + 1], the reference's layout
    final_mask = t(inp["final_response_mask"])
    stats_mask = response_mask[:, 1:]
    old = t(inp["old_log_probs"])
    infer = t(inp["infer_logprobs"]) if "infer_logprobs" in inp else None
    return case, response_mask, final_mask, stats_mask, old, infer


def test_apply_rlvr_style_both_masks():
    case, response_mask, final_mask, stats_mask, old, infer = _apply_case("rlvr_style_both_masks")
    out = case["outputs"]
    w, f, metrics = compute_train_infer_correction(old, infer, stats_mask, case["config"])
    new_response = apply_correction_mask(response_mask, f)   # full width: column 0 kept
    new_final = apply_correction_mask(final_mask, f)         # same width
    assert torch.equal(new_response, t(out["response_mask"], torch.int64))
    assert new_response.dtype == torch.int64
    assert torch.equal(new_final, t(out["final_response_mask"]))
    # the reference turns final_response_mask into int64; we keep float32 (same values)
    assert out["dtypes"]["final_response_mask"] == "int64" and new_final.dtype == torch.float32
    assert torch.equal(w, t(out["train_infer_is_weight"]))
    # inputs are never mutated (the reference writes response_mask[:, 1:] in place)
    assert torch.equal(response_mask, t(case["inputs"]["response_mask"], torch.int64))
    expected = {**out["metrics"], **EXTRA_METRICS,
                f"{P}final_mask_mean": out["metrics"][f"{P}final_mask_mean"],
                f"{P}token_ratio_mask_mean@sum": 0.8}  # 12/15 valid (vector 14/15, padding)
    assert_metrics(metrics, expected)


def test_apply_agentic_style_default_key():
    case, response_mask, final_mask, stats_mask, old, infer = _apply_case("agentic_style_default_key")
    out = case["outputs"]
    _, f, metrics = compute_train_infer_correction(old, infer, stats_mask, case["config"])
    # agentic updates response_mask only; final_response_mask is left as it was
    assert torch.equal(apply_correction_mask(response_mask, f), t(out["response_mask"], torch.int64))
    assert torch.equal(final_mask, t(out["final_response_mask"]))
    expected = {**out["metrics"], **EXTRA_METRICS,
                f"{P}final_mask_mean": out["metrics"][f"{P}final_mask_mean"],
                f"{P}sequence_ratio_mask_mean@sum": 11 / 15}  # vector 1.2 = 18/15
    assert_metrics(metrics, expected)


def test_missing_infer_logprobs_is_an_error_not_a_silent_pass():
    """Vector ``missing_infer_logprobs``: the reference warns and leaves masks alone (weight 1).

    ``RolloutBatch`` always carries ``infer_logprobs``; a missing tensor is a caller bug, so we
    raise instead of silently training on unfiltered tokens.
    """
    case, _, _, stats_mask, old, infer = _apply_case("missing_infer_logprobs")
    assert infer is None and case["outputs"]["metrics"] == {}
    with pytest.raises(ValueError, match="infer_logprobs"):
        compute_train_infer_correction(old, infer, stats_mask, case["config"])


def test_apply_correction_mask_dtypes_and_errors():
    f = torch.tensor([[1.0, 0.0, 1.0]])
    assert apply_correction_mask(torch.tensor([[True, True, False]]), f).tolist() == [[True, False, False]]
    assert apply_correction_mask(torch.ones(1, 3, dtype=torch.float64), f).dtype == torch.float64
    with pytest.raises(ValueError, match="fits neither"):
        apply_correction_mask(torch.ones(1, 5), f)


# ---- our differences, one by one -------------------------------------------------------------


def test_sequence_ratio_decided_in_log_space_under_overflow():
    """Difference 4: exp(S) overflows (or underflows) in float32; log-space keeps decisions right.

    Rows of 1000 valid tokens with a constant drift: S = 100, 89.5, -120, -110. With
    ratio_high = 1e39 (inf in float32) and ratio_low = 1e-50 (0 in float32):
    e^100 = 2.7e43 > 1e39 (drop), e^89.5 = 7.1e38 <= 1e39 (keep), e^-120 = 7.7e-53 < 1e-50 (drop),
    e^-110 = 1.7e-48 >= 1e-50 (keep). In float32 exp(S) is inf, inf, 0, 0, so comparing ratios
    there cannot tell rows 0/1 or 2/3 apart.
    """
    n = 1000
    drift = torch.tensor([0.1, 0.0895, -0.12, -0.11])  # per-token log-ratio o - i
    old = drift.clamp(max=0.0)[:, None].expand(4, n).clone()
    infer = (-drift).clamp(max=0.0)[:, None].expand(4, n).clone()
    mask = torch.ones(4, n)
    cfg = {"is_weight": {"enabled": True, "weight_type": "sequence", "upper_bound": 2.0},
           "filters": [{"enabled": True, "agg_type": "sequence", "ratio_low": 1e-50, "ratio_high": 1e39}]}
    w, f, metrics = compute_train_infer_correction(old, infer, mask, cfg)
    s32 = (old - infer).sum(dim=1)
    assert torch.exp(s32).tolist() == [INF, INF, 0.0, 0.0]  # the overflow is real
    assert f[:, 0].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert torch.equal(f, f[:, :1].expand(4, n))
    assert w[:, 0].tolist() == [2.0, 2.0, 0.0, 0.0]          # inf clamped to upper_bound, 0 stays
    assert metrics[f"{P}sequence_ratio_mask_mean@sum"] == 0.5
    assert metrics[f"{P}ratio_sequence_mean@sum"] == INF      # reported as exp(S), documented
    assert metrics["actor/is_weight_clipfrac@sum"] == 0.5


def test_sequence_ratio_bounds_at_or_below_zero():
    old = torch.tensor([[-50.0, -60.0], [-0.1, -0.1]])
    infer = torch.zeros(2, 2)
    mask = torch.ones(2, 2)
    # ratio_low = -1 (log -> -inf): e^-110 ~ 1.7e-48 passes, e^-0.2 passes
    cfg = {"filters": [{"enabled": True, "agg_type": "sequence", "ratio_low": -1.0, "ratio_high": 1.0}]}
    _, f, _ = compute_train_infer_correction(old, infer, mask, cfg)
    assert f.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    # ratio_high = 0: exp(S) <= 0 never holds for a real S
    cfg = {"filters": [{"enabled": True, "agg_type": "sequence", "ratio_low": 0.0, "ratio_high": 0.0}]}
    _, f, _ = compute_train_infer_correction(old, infer, mask, cfg)
    assert f.tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_two_filters_same_agg_have_their_own_keys():
    """Difference 3: key scheme (module doc). Disabled entries count in the index."""
    cfg = {"filters": [
        {"enabled": True, "agg_type": "token", "ratio_low": 0.0, "ratio_high": 100.0},
        {"enabled": False, "agg_type": "token"},
        {"enabled": True, "agg_type": "geometric", "diff_enabled": True},
        {"enabled": True, "agg_type": "token", "ratio_low": 0.95, "ratio_high": 1.05, "diff_enabled": True},
    ]}
    assert filter_metric_keys(cfg) == [
        {"index": 0, "ratio": f"{P}token_ratio_mask_mean@sum"},
        {"index": 2, "ratio": f"{P}geometric_ratio_mask_mean@sum", "diff": f"{P}geometric_diff_mask_mean@sum"},
        {"index": 3, "ratio": f"{P}token_3_ratio_mask_mean@sum", "diff": f"{P}token_3_diff_mask_mean@sum"},
    ]
    old = torch.tensor([[-0.1, -0.5, -1.0]])
    infer = torch.tensor([[-0.1, -0.45, -1.3]])
    _, f, m = compute_train_infer_correction(old, infer, torch.ones(1, 3), cfg)
    # token ratios 1, 0.951, 1.35: filter 0 keeps all, filter 3 keeps 2 of 3 by ratio, all by diff;
    # geometric exp(0.25 / 3) = 1.087 and its mean diff 0.021 pass.
    assert m[f"{P}token_ratio_mask_mean@sum"] == 1.0
    assert m[f"{P}token_3_ratio_mask_mean@sum"] == pytest.approx(2 / 3)
    assert m[f"{P}token_3_diff_mask_mean@sum"] == 1.0
    assert f.tolist() == [[1.0, 1.0, 0.0]]


@pytest.mark.parametrize("weight_type", AGG_TYPES)
def test_weights_detached_by_default(weight_type):
    """Difference list: weights carry no gradient when detach=True (the default)."""
    old = torch.tensor([[-0.1, -0.5, -1.0, -0.3]], requires_grad=True)
    infer = torch.tensor([[-0.2, -0.4, -1.1, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    cfg = {"is_weight": {"enabled": True, "weight_type": weight_type, "upper_bound": None}}
    w, f, _ = compute_train_infer_correction(old, infer, mask, cfg)
    assert not w.requires_grad and w.grad_fn is None and not f.requires_grad
    (w * old).sum().backward()
    assert torch.equal(old.grad, w)  # only the explicit factor's gradient, nothing through w


def test_weights_differentiable_when_detach_false():
    old = torch.tensor([[-0.1, -0.5, -1.0, -0.3]], requires_grad=True)
    infer = torch.tensor([[-0.2, -0.4, -1.1, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    cfg = {"is_weight": {"enabled": True, "weight_type": "token", "upper_bound": None, "detach": False}}
    w, _, _ = compute_train_infer_correction(old, infer, mask, cfg)
    assert w.requires_grad
    w.sum().backward()
    # d exp(o - i) / d o = exp(o - i) at valid tokens; the masked slot reads o = 0: no gradient
    expected = torch.exp(torch.tensor([[0.1, -0.1, 0.1]]))
    assert torch.allclose(old.grad[:, :3], expected) and old.grad[0, 3].item() == 0.0


def test_nan_weight_becomes_zero_and_inf_without_bound_too():
    """Difference 5: a non-finite weight is 0, so weight * mask * loss stays finite."""
    old = torch.tensor([[-0.1, NAN, -0.2, 0.0]])
    infer = torch.tensor([[-0.1, -0.3, -INF, -200.0]])
    mask = torch.ones(1, 4)
    w, _, m = compute_train_infer_correction(
        old, infer, mask, {"is_weight": {"enabled": True, "upper_bound": None}})
    # token ratios: 1, NaN, +inf, exp(200) = inf in float32
    assert w.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert m[f"{P}nonfinite_frac@sum"] == 0.5  # NaN and -inf inputs; exp overflow is not an input
    w, _, _ = compute_train_infer_correction(old, infer, mask, {"is_weight": {"enabled": True}})
    assert torch.allclose(w, torch.tensor([[1.0, 0.0, 1.2, 1.2]]))


def test_final_mask_mean_collapse_and_all_masked():
    old = torch.tensor([[-0.1, -0.1, -0.1, -0.1, 0.0]])
    infer = torch.tensor([[-0.1, -0.1, -0.6, -0.6, 0.0]])  # token ratios 1, 1, 1.65, 1.65
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    token = {"enabled": True, "agg_type": "token"}
    _, f, m = compute_train_infer_correction(old, infer, mask, {"filters": [token]})
    assert f[0, :4].tolist() == [1.0, 1.0, 0.0, 0.0]
    # half removed: not a collapse at the default 0.5 (strictly more is)
    assert (m[f"{P}final_mask_mean"], m[f"{P}mask_collapse"], m[f"{P}all_masked"]) == (0.5, 0.0, 0.0)
    _, _, m = compute_train_infer_correction(
        old, infer, mask, {"filters": [token], "mask_collapse_threshold": 0.4})
    assert m[f"{P}mask_collapse"] == 1.0
    reject_all = {**token, "ratio_low": 2.0, "ratio_high": 3.0}
    _, f, m = compute_train_infer_correction(old, infer, mask, {"filters": [reject_all]})
    assert (m[f"{P}final_mask_mean"], m[f"{P}mask_collapse"], m[f"{P}all_masked"]) == (0.0, 1.0, 1.0)
    # no valid token at all: nothing removed, but nothing to train on either
    _, _, m = compute_train_infer_correction(old, infer, torch.zeros(1, 5), {"filters": [token]})
    assert (m[f"{P}final_mask_mean"], m[f"{P}mask_collapse"], m[f"{P}all_masked"]) == (0.0, 0.0, 1.0)


def test_listed_filter_is_inert_unless_enabled():
    """Reference default: a filter entry has enabled=False."""
    old = torch.tensor([[-0.1, -3.0]])
    infer = torch.tensor([[-0.1, -0.1]])
    _, f, m = compute_train_infer_correction(old, infer, torch.ones(1, 2), {"filters": [{"agg_type": "token"}]})
    assert f.tolist() == [[1.0, 1.0]]
    assert not any("mask_mean@sum" in k for k in m)
    assert m[f"{P}final_mask_mean"] == 1.0


def test_global_counts():
    case = COMPUTE["token_ratio_only"]
    inp = case["inputs"]
    args = (t(inp["old_log_probs"]), t(inp["infer_log_probs"]), t(inp["response_mask"]), case["config"])
    _, _, m = compute_train_infer_correction(*args, global_valid_samples=6, global_valid_tokens=30)
    assert m[f"{P}ratio_token_mean@sum"] == pytest.approx(1.0381712913513184 * 3 / 6, abs=1e-6)
    assert m[f"{P}token_ratio_mask_mean@sum"] == pytest.approx(12 / 30, abs=1e-7)
    assert m[f"{P}final_mask_mean"] == pytest.approx(0.8, abs=1e-7)  # local, never global
    _, _, m = compute_train_infer_correction(*args, global_valid_tokens=0)  # treated as 1
    assert m[f"{P}token_ratio_mask_mean@sum"] == 12.0
    for bad in (-1, True, "3", NAN):
        with pytest.raises(ValueError, match="global_valid_tokens"):
            compute_train_infer_correction(*args, global_valid_tokens=bad)


def test_empty_batch_shapes():
    for shape in ((0, 5), (3, 0)):
        w, f, m = compute_train_infer_correction(torch.zeros(shape), torch.zeros(shape), torch.zeros(shape),
                                                 {"filters": [{"enabled": True, "agg_type": "segment"}]})
        assert w.shape == f.shape == shape
        assert m[f"{P}all_masked"] == 1.0 and m[f"{P}ratio_token_mean@sum"] == 0.0


# ---- config validation -----------------------------------------------------------------------


def test_config_defaults_follow_the_reference():
    cfg = parse_correction_config(None)
    assert cfg.is_weight.model_dump() == {"enabled": False, "weight_type": "token", "upper_bound": 1.2,
                                          "detach": True}
    assert cfg.filters == [] and cfg.mask_collapse_threshold == 0.5
    flt = parse_correction_config({"filters": [{}]}).filters[0]
    assert flt.model_dump() == {"enabled": False, "agg_type": "token", "ratio_enabled": True,
                                "ratio_low": 0.8, "ratio_high": 1.2, "diff_enabled": False,
                                "diff_low": -0.2, "diff_high": 0.2}
    assert parse_correction_config({"filters": None, "is_weight": None}) == TrainInferCorrectionConfig()
    model = TrainInferCorrectionConfig(filters=[{"enabled": True}])
    assert parse_correction_config(model) is model
    # the model and the mapping give the same result
    old, infer, mask = torch.tensor([[-0.1, -2.0]]), torch.tensor([[-0.1, -0.1]]), torch.ones(1, 2)
    a = compute_train_infer_correction(old, infer, mask, model)
    b = compute_train_infer_correction(old, infer, mask, {"filters": [{"enabled": True}]})
    assert torch.equal(a[1], b[1]) and a[2] == b[2]


@pytest.mark.parametrize("config, message", [
    ({"filters": [{"agg_type": "tokens"}]}, r"filters\.0\.agg_type"),
    ({"is_weight": {"weight_type": "mean"}}, r"is_weight\.weight_type"),
    ({"filter": []}, r"filter: Extra inputs"),
    ({"filters": [{"ratio_lo": 0.5}]}, r"filters\.0\.ratio_lo"),
    ({"is_weight": {"clip": 2}}, r"is_weight\.clip"),
    ({"filters": [{"ratio_low": 1.3}]}, r"ratio_low \(1\.3\) must be <= ratio_high \(1\.2\)"),
    ({"filters": [{}, {"diff_low": 0.5, "diff_high": 0.1}]}, r"filters\.1.*diff_low \(0\.5\) must be <= diff_high"),
    ({"filters": [{"ratio_high": NAN}]}, r"ratio_high must be a number"),
    ({"is_weight": {"upper_bound": -0.1}}, r"upper_bound must be >= 0"),
    ({"mask_collapse_threshold": 1.5}, r"mask_collapse_threshold"),
    ([("filters", [])], r"must be a mapping"),
])
def test_config_errors(config, message):
    old = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=message):
        compute_train_infer_correction(old, old, torch.ones(1, 2), config)


def test_input_errors():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="one shape"):
        compute_train_infer_correction(z, torch.zeros(2, 4), torch.ones(2, 3), None)
    with pytest.raises(ValueError, match="0 and 1"):
        compute_train_infer_correction(z, z, torch.full((2, 3), 0.5), None)
    with pytest.raises(ValueError, match="floating"):
        compute_train_infer_correction(z.long(), z, torch.ones(2, 3), None)


# ---- independent per-token oracle ------------------------------------------------------------


def _oracle(old, infer, mask, cfg):
    """Plain Python, float64, row by row: the reference's formulas with our masked-input rule."""
    cfg = parse_correction_config(cfg)
    B, T = len(old), len(old[0])
    ratio = {a: [[1.0] * T for _ in range(B)] for a in AGG_TYPES}
    diff = {a: [[0.0] * T for _ in range(B)] for a in AGG_TYPES}
    seq_log = []
    for b in range(B):
        m = mask[b]
        lr = [(old[b][t_] - infer[b][t_]) if m[t_] else 0.0 for t_ in range(T)]
        dt = [(math.exp(old[b][t_]) - math.exp(infer[b][t_])) if m[t_] else 0.0 for t_ in range(T)]
        n = sum(m)
        s, sd = sum(lr), sum(dt)
        seq_log.append(s)
        for t_ in range(T):
            ratio["token"][b][t_], diff["token"][b][t_] = math.exp(lr[t_]), dt[t_]
            ratio["geometric"][b][t_], diff["geometric"][b][t_] = math.exp(s / (n + 1e-8)), sd / (n + 1e-8)
            ratio["sequence"][b][t_], diff["sequence"][b][t_] = math.exp(min(s, 700.0)), sd
        t_ = 0
        while t_ < T:
            if not m[t_]:
                t_ += 1
                continue
            end = t_
            while end < T and m[end]:
                end += 1
            k = end - t_
            mr, md = sum(lr[t_:end]) / (k + 1e-8), sum(dt[t_:end]) / (k + 1e-8)
            for j in range(t_, end):
                ratio["segment"][b][j], diff["segment"][b][j] = math.exp(mr), md
            t_ = end
    keep = [[1.0] * T for _ in range(B)]
    for f in cfg.filters:
        if not f.enabled:
            continue
        for b in range(B):
            for t_ in range(T):
                if f.ratio_enabled:
                    if f.agg_type == "sequence":
                        lo = math.log(f.ratio_low) if f.ratio_low > 0 else -INF
                        hi = math.log(f.ratio_high) if f.ratio_high > 0 else -INF
                        ok = lo <= seq_log[b] <= hi
                    else:
                        ok = f.ratio_low <= ratio[f.agg_type][b][t_] <= f.ratio_high
                    keep[b][t_] *= float(ok)
                if f.diff_enabled:
                    keep[b][t_] *= float(f.diff_low <= diff[f.agg_type][b][t_] <= f.diff_high)
    iw = cfg.is_weight
    weight = [[1.0] * T for _ in range(B)]
    if iw.enabled:
        ub = INF if iw.upper_bound is None else iw.upper_bound
        weight = [[min(max(v, 0.0), ub) for v in row] for row in ratio[iw.weight_type]]
    return weight, keep


# bounds per granularity that both keep and drop tokens on the random batch below
ORACLE_BOUNDS = {"token": (0.9, 1.1, 0.02), "segment": (0.9, 1.1, 0.02),
                 "geometric": (0.99, 1.01, 0.005), "sequence": (0.7, 1.4, 0.1)}


@pytest.mark.parametrize("agg", AGG_TYPES)
def test_matches_plain_python_oracle(agg):
    g = torch.Generator().manual_seed(7 + AGG_TYPES.index(agg))
    B, T = 12, 40
    infer = -torch.rand(B, T, generator=g) * 3.0
    old = infer + torch.randn(B, T, generator=g) * 0.08
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    mask[0] = 0.0
    old[mask == 0] = torch.randn(int((mask == 0).sum()), generator=g) * 50  # garbage padding
    low, high, dmax = ORACLE_BOUNDS[agg]
    cfg = {"is_weight": {"enabled": True, "weight_type": agg, "upper_bound": 1.1},
           "filters": [{"enabled": True, "agg_type": agg, "ratio_low": low, "ratio_high": high,
                        "diff_enabled": True, "diff_low": -dmax, "diff_high": dmax}]}
    w, f, _ = compute_train_infer_correction(old, infer, mask, cfg)
    ow, of = _oracle(old.double().tolist(), infer.double().tolist(), mask.bool().tolist(), cfg)
    assert torch.allclose(w.double(), torch.tensor(ow, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    assert torch.equal(f, torch.tensor(of, dtype=torch.float32))
    assert 0 < f[mask.bool()].mean() < 1  # the case exercises both outcomes


# ---- properties ------------------------------------------------------------------------------

_finite = st.floats(-6.0, 0.0, width=32)
_anything = st.one_of(_finite, st.sampled_from([NAN, INF, -INF, 3.0e38, -3.0e38]),
                      st.floats(width=32))


@st.composite
def _scenario(draw):
    B, T, K = draw(st.integers(1, 4)), draw(st.integers(1, 9)), draw(st.integers(1, 3))
    cells = B * T
    old = draw(st.lists(_finite, min_size=cells, max_size=cells))
    infer = draw(st.lists(_finite, min_size=cells, max_size=cells))
    mask = draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=cells, max_size=cells))
    pad_old = draw(st.lists(_anything, min_size=B * K, max_size=B * K))
    pad_inf = draw(st.lists(_anything, min_size=B * K, max_size=B * K))
    filters = []
    for _ in range(draw(st.integers(0, 2))):
        rlo = draw(st.floats(0.0, 1.5))
        dlo = draw(st.floats(-0.5, 0.1))
        filters.append({"enabled": draw(st.booleans()), "agg_type": draw(st.sampled_from(AGG_TYPES)),
                        "ratio_enabled": draw(st.booleans()), "ratio_low": rlo,
                        "ratio_high": rlo + draw(st.floats(0.0, 2.0)),
                        "diff_enabled": draw(st.booleans()), "diff_low": dlo,
                        "diff_high": dlo + draw(st.floats(0.0, 0.6))})
    config = {"is_weight": {"enabled": draw(st.booleans()), "weight_type": draw(st.sampled_from(AGG_TYPES)),
                            "upper_bound": draw(st.sampled_from([None, 1.0, 1.2, 3.0]))},
              "filters": filters}

    def grid(vals, width):
        return torch.tensor(vals, dtype=torch.float32).reshape(B, width)

    return (grid(old, T), grid(infer, T), grid(mask, T), grid(pad_old, K), grid(pad_inf, K), config)


@settings(max_examples=150, deadline=None)
@given(_scenario())
def test_masks_are_01_and_padding_independent(scenario):
    old, infer, mask, pad_old, pad_inf, config = scenario
    w, f, m = compute_train_infer_correction(old, infer, mask, config)
    assert set(f.unique().tolist()) <= {0.0, 1.0}
    final = apply_correction_mask(mask, f)
    assert set(final.unique().tolist()) <= {0.0, 1.0} and bool((final <= mask).all())
    assert torch.isfinite(w).all() and bool((w >= 0).all())

    T = old.shape[1]
    w2, f2, m2 = compute_train_infer_correction(
        torch.cat([old, pad_old], 1), torch.cat([infer, pad_inf], 1),
        torch.cat([mask, torch.zeros_like(pad_old)], 1), config)
    assert torch.equal(f2[:, :T], f)
    assert torch.allclose(w2[:, :T], w, rtol=1e-6, atol=1e-7)
    assert set(m2) == set(m)
    for key, value in m.items():
        assert m2[key] == pytest.approx(value, rel=1e-6, abs=1e-7, nan_ok=True), key


# ---- CUDA ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("agg", AGG_TYPES)
def test_cuda_matches_cpu(agg):
    g = torch.Generator().manual_seed(11)
    B, T = 16, 512
    infer = -torch.rand(B, T, generator=g) * 3.0
    old = infer + torch.randn(B, T, generator=g) * 0.05
    mask = (torch.rand(B, T, generator=g) > 0.2).float()
    infer[mask == 0] = -INF  # non-finite padding must not matter on either device
    cfg = {"is_weight": {"enabled": True, "weight_type": agg},
           "filters": [{"enabled": True, "agg_type": agg, "ratio_low": 0.9, "ratio_high": 1.1,
                        "diff_enabled": True, "diff_low": -0.05, "diff_high": 0.05}]}
    w, f, m = compute_train_infer_correction(old, infer, mask, cfg)
    wc, fc, mc = compute_train_infer_correction(old.cuda(), infer.cuda(), mask.cuda(), cfg)
    assert wc.device.type == "cuda" and fc.device.type == "cuda"
    assert torch.equal(fc.cpu(), f)
    assert torch.allclose(wc.cpu(), w, rtol=1e-6, atol=1e-7)
    assert set(mc) == set(m)
    for key, value in m.items():
        assert mc[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
