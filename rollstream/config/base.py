"""The building blocks every config model shares: the frozen base model and the settings of the
Kafka connection, the inference engine and the trainer (one meaning in both pipelines)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollstream.config.models import check_model_path
from rollstream.runtime import DEFAULT_TOPIC_PREFIX, PAYLOAD_MAX_MESSAGE_BYTES


class FrozenModel(BaseModel):
    """Immutable and strict: an unknown (e.g. misspelt) key is an error, never ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class KafkaConfig(FrozenModel):
    bootstrap_servers: str | None = Field(None, description="null starts the embedded local broker.")
    topic_prefix: str = DEFAULT_TOPIC_PREFIX
    partitions: int = Field(4, gt=0, le=1024, description="Partitions of the prompt_id-keyed topics.")
    max_message_bytes: int = Field(
        PAYLOAD_MAX_MESSAGE_BYTES, ge=1024 * 1024, le=512 * 1024 * 1024,
        description="Largest payload event (a Response or Trajectory with its token arrays), in bytes: "
                    "`max.message.bytes` of the payload topics (responses, trajectories) and the size "
                    "every producer and consumer is set up for. A larger payload is dead-lettered "
                    "`too_large`. The default carries one 64k-token response with its prompt, arrays and "
                    "text several times over; raise it for per-token extras such as routed_experts. At "
                    "least 1 MiB: every client is sized by it, and decision events, table values and "
                    "producer batches must fit too.")
    compression_type: Literal["lz4", "zstd", "gzip", "none"] = Field(
        "lz4", description="Compression of the payload topics (producers and topic).")
    payload_retention_ms: int | None = Field(
        None, ge=-1, description="`retention.ms` of the payload topics (-1: forever; null: the "
                                 "broker's default). Must outlive every decision naming a payload: a "
                                 "reference to a deleted record rejects its group `payload_expired`.")


class ModelArgs(FrozenModel):
    """Reference name ``model_args``: which model a role loads."""

    model_name_or_path: str | None = Field(
        None, description="A local Hugging Face model folder (config.json, safetensors or pytorch_model.bin, "
                          "tokenizer) or a hub id already in the local Hugging Face cache (read offline). "
                          "null: the pipeline's `pretrain`, else the bundled SmolLM2-135M-Instruct.")

    @field_validator("model_name_or_path")
    @classmethod
    def _model_exists(cls, value: str | None) -> str | None:
        return check_model_path(value)  # a bad path fails at config load, naming this key


Device = Literal["cpu", "cuda", "auto"]


class GeneratingArgs(FrozenModel):
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(64, gt=0, le=32768, description="response_length: tokens per response at most.")


class ActorInferConfig(FrozenModel):
    backend: Literal["transformers", "vllm"] = "transformers"
    model_args: ModelArgs = Field(default_factory=ModelArgs)
    device: Device = Field("auto", description="Where generation runs; auto: cuda when available, else cpu.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Generation weights' dtype; the trainer computes old_log_probs in float32, so bfloat16 here gives the train-inference mismatch the correction masks handle.")
    generating_args: GeneratingArgs = Field(default_factory=GeneratingArgs)
    max_batch: int = Field(16, gt=0, description="Generation requests per engine call.")


class ActorTrainConfig(FrozenModel):
    """The trainer's GRPO step (reference names: pg_clip, loss_agg_mode). The trainer builds its
    own settings from it (rollstream.trainer.policy.TrainSettings.from_config)."""

    enabled: bool = Field(True, description="False: build and commit batches without training (no model in the trainer).")
    model_args: ModelArgs = Field(default_factory=ModelArgs)
    device: Device = Field("auto", description="Where training runs; auto: cuda when available, else cpu.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Training weights' dtype (old_log_probs are computed in it).")
    lr: float = Field(1e-6, gt=0.0, le=1.0, description="AdamW learning rate.")
    micro_batch_size: int = Field(4, gt=0, le=4096, description="Rows per forward/backward pass (gradients accumulate over the batch).")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.")
    pg_clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="The ratio is clipped below at 1 - pg_clip_low.")
    pg_clip_high: float = Field(0.2, ge=0.0, description="The ratio is clipped above at 1 + pg_clip_high.")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    keep_checkpoints: int = Field(2, gt=0, le=1000, description="Policy-version checkpoints kept on disk (runs/<name>/checkpoints); older ones are deleted.")
