"""The ``train_infer_correction`` mapping, validated: the IS weight, the token filters and the
collapse threshold (with the reference system's defaults).

Only the configuration lives here, so it loads without the trainer; the correction
itself (formulas, metrics) is rollstream.trainer.corrections.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, get_args

from pydantic import Field, ValidationError, field_validator, model_validator

from rollstream.config.base import FrozenModel
from rollstream.exceptions import validation_problems

AggType = Literal["token", "segment", "geometric", "sequence"]
AGG_TYPES: tuple[str, ...] = get_args(AggType)
"""Granularities of ratio/diff, as the reference system names them."""


def _finite_or_inf(name: str, value: float) -> float:
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got NaN")
    return value


class ISWeightConfig(FrozenModel):
    """``train_infer_correction.is_weight`` (with the reference system's defaults)."""

    enabled: bool = Field(False, description="Multiply the per-token loss by the IS weight.")
    weight_type: AggType = Field("token", description="Granularity of the ratio used as weight.")
    upper_bound: float | None = Field(
        1.2, description="Clamp the weight to [0, upper_bound]; null disables clamping.")
    detach: bool = Field(True, description="Detach the weight from the autograd graph.")

    @field_validator("upper_bound")
    @classmethod
    def _upper_bound_ok(cls, v: float | None) -> float | None:
        if v is None:
            return v
        _finite_or_inf("upper_bound", v)
        if v < 0:
            raise ValueError(f"upper_bound must be >= 0 (the weight is clamped to [0, upper_bound]), got {v}")
        return v


class CorrectionFilterConfig(FrozenModel):
    """One entry of ``train_infer_correction.filters`` (with the reference system's defaults).

    A listed filter is inert unless ``enabled`` is True, as in the reference. Bounds are
    inclusive; ``ratio_*`` bound ``exp(l)`` at the chosen granularity, ``diff_*`` the probability
    difference.
    """

    enabled: bool = Field(False, description="Apply this filter (a listed filter is inert by default).")
    agg_type: AggType = Field("token", description="token | segment | geometric | sequence.")
    ratio_enabled: bool = Field(True, description="Check ratio_low <= ratio <= ratio_high.")
    ratio_low: float = Field(0.8, description="Lowest train/inference probability ratio kept.")
    ratio_high: float = Field(1.2, description="Highest train/inference probability ratio kept.")
    diff_enabled: bool = Field(False, description="Check diff_low <= diff <= diff_high.")
    diff_low: float = Field(-0.2, description="Lowest train minus inference probability kept.")
    diff_high: float = Field(0.2, description="Highest train minus inference probability kept.")

    @model_validator(mode="after")
    def _bounds_ok(self) -> "CorrectionFilterConfig":
        for kind in ("ratio", "diff"):
            low = _finite_or_inf(f"{kind}_low", getattr(self, f"{kind}_low"))
            high = _finite_or_inf(f"{kind}_high", getattr(self, f"{kind}_high"))
            if low > high:
                raise ValueError(f"{kind}_low ({low}) must be <= {kind}_high ({high})")
        return self


class TrainInferCorrectionConfig(FrozenModel):
    """The ``train_infer_correction`` mapping: IS weight, filters and the collapse threshold.

    Unknown keys, an unknown ``agg_type`` / ``weight_type``, ``low > high``, a NaN bound or a
    negative ``upper_bound`` raise ``pydantic.ValidationError`` (a ``ValueError``).
    ``mask_collapse_threshold`` is ours (not in the reference): the share of valid tokens the
    filters may remove before ``actor/train_infer_mask_collapse`` is raised.
    """

    is_weight: ISWeightConfig = Field(default_factory=ISWeightConfig, description="The train-inference "
                                      "importance-sampling weight on each token's loss.")
    filters: list[CorrectionFilterConfig] = Field(default_factory=list, description="Filters that drop tokens, "
                                                  "segments or responses whose train and inference probabilities "
                                                  "disagree.")
    mask_collapse_threshold: float = Field(0.5, ge=0.0, le=1.0, description="Share of a batch's valid tokens the "
                                           "filters may remove before actor/train_infer_mask_collapse is raised.")

    @field_validator("is_weight", "filters", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info) -> Any:  # YAML "filters:" with nothing under it
        if v is None:
            return {} if info.field_name == "is_weight" else []
        return v


def _error_message(exc: ValidationError) -> str:
    return "invalid train_infer_correction config: " + "; ".join(validation_problems(exc))


def parse_correction_config(
    config: TrainInferCorrectionConfig | Mapping[str, Any] | None,
) -> TrainInferCorrectionConfig:
    """Validate a ``train_infer_correction`` mapping (``None`` -> defaults; a model is returned as is).

    Raises:
        ValueError: unknown key, unknown ``agg_type`` / ``weight_type``, ``low > high``, NaN bound,
            negative ``upper_bound``, ``mask_collapse_threshold`` outside [0, 1], or a non-mapping;
            the message names the field path, e.g. ``filters.0.agg_type: Input should be ...``.
    """
    if isinstance(config, TrainInferCorrectionConfig):
        return config
    if config is None:
        return TrainInferCorrectionConfig()
    if not isinstance(config, Mapping):
        raise ValueError(
            "train_infer_correction config must be a mapping or TrainInferCorrectionConfig, "
            f"got {type(config).__name__}")
    try:
        return TrainInferCorrectionConfig.model_validate(dict(config))
    except ValidationError as exc:
        raise ValueError(_error_message(exc)) from exc
