"""YAML config -> validated, frozen models, one module per concern:

- ``base``: the frozen base model and the Kafka, inference and trainer settings;
- ``corrections``: the ``train_infer_correction`` mapping (no torch: the maths is in the trainer);
- ``pipeline``: PipelineConfig, the fields RLVR and agentic share;
- ``rlvr`` / ``agentic``: each pipeline's own fields and checks;
- ``loading``: ``parse_config`` / ``load_config``.

Invalid input raises ConfigError naming the field path; filter types are resolved here, so an
unknown type fails at start-up, never mid-run. Every name is re-exported here:
``from rollstream.config import RLVRConfig``.
"""

from rollstream.config.agentic import (
    AgenticConfig,
    EnvConfig,
    EnvManagerConfig,
    RefillConfig,
)
from rollstream.config.base import (
    ActorInferConfig,
    ActorTrainConfig,
    FrozenModel,
    GeneratingArgs,
    KafkaConfig,
    TrainerConfig,
)
from rollstream.config.corrections import (
    AGG_TYPES,
    AggType,
    CorrectionFilterConfig,
    ISWeightConfig,
    TrainInferCorrectionConfig,
    parse_correction_config,
)
from rollstream.config.loading import Config, load_config, parse_config
from rollstream.config.pipeline import PipelineConfig
from rollstream.config.rlvr import REWARD_SCORE_KEYS, DatasetConfig, FilterConfig, RewardDomainConfig, RLVRConfig

__all__ = [
    "AGG_TYPES", "ActorInferConfig", "ActorTrainConfig", "AgenticConfig", "AggType", "Config",
    "CorrectionFilterConfig", "DatasetConfig", "EnvConfig", "EnvManagerConfig",
    "FilterConfig", "FrozenModel", "GeneratingArgs", "ISWeightConfig", "KafkaConfig", "PipelineConfig",
    "REWARD_SCORE_KEYS", "RLVRConfig", "RefillConfig", "RewardDomainConfig",
    "TrainInferCorrectionConfig", "TrainerConfig", "load_config", "parse_config", "parse_correction_config",
]
