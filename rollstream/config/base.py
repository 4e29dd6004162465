"""The building blocks every config model shares: the frozen base model and the settings of the
Kafka connection, the inference engine and the trainer (one meaning in both pipelines)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from rollstream.config.model_paths import check_model_path
from rollstream.exceptions import ConfigError
from rollstream.extensions import BACKENDS, LOGGERS
from rollstream.registry import Registry
from rollstream.runtime import DEFAULT_TOPIC_PREFIX, PAYLOAD_MAX_MESSAGE_BYTES


def _admits_bool(annotation: Any) -> bool:
    """Whether a field of this type may hold a boolean (bool, Any, or a union/container of one)."""
    if annotation is bool or annotation is Any:
        return True
    if get_origin(annotation) is Literal:
        return any(isinstance(arg, bool) for arg in get_args(annotation))
    return any(_admits_bool(arg) for arg in get_args(annotation))


def extension(registry: Registry) -> Any:
    """The type of a config field that names an object of ``registry`` (rollstream.extensions): a
    built-in name or an import path, checked when the config loads without importing anything."""
    def check(name: str) -> str:
        try:
            return registry.check_name(name)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    return Annotated[str, AfterValidator(check)]


def builtins(registry: Registry) -> str:
    """``registry``'s built-in names for a field description: ``a, b or c``."""
    *rest, last = registry.names()
    return f"{', '.join(rest)} or {last}" if rest else last


class FrozenModel(BaseModel):
    """Immutable and strict: an unknown (e.g. misspelt) key is an error, never ignored, and a
    boolean is never read as a number (pydantic's lax mode would take ``eval_steps: true`` as 1)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and not _admits_bool(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"{str(value).lower()} is not a value for this key (true/false fit on/off switches only)")
        return value


class KafkaConfig(FrozenModel):
    bootstrap_servers: str | None = Field(None, description="null starts the embedded local broker.")
    disk_reserve_mb: int = Field(1024, ge=0, le=10_000_000, description="The embedded broker: `rollstream run` ends "
                                 "`disk_full`, naming the largest topics, once the broker's disk has less free space "
                                 "than this (MiB), before Kafka would fail on a full disk; 0: never.")
    topic_prefix: str = Field(DEFAULT_TOPIC_PREFIX, description="Prefix of every topic, table and consumer group "
                              "name of the run (`<prefix>prompts`, ...): two runs on one cluster need two prefixes.")
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
        None, ge=-1, description="How long payload records are kept at least, for replay and export (ms; -1: "
                                 "forever; null: 7 days). The trainer deletes older ones once no group that "
                                 "can still be trained needs them (the topics' own retention.ms is -1): a "
                                 "payload is never deleted before its group is trained or decided against.")
    # -- the cluster: replication and per-topic settings, applied to every topic rollstream creates
    replication_factor: int | None = Field(
        None, ge=1, le=32, description="Replicas of every topic rollstream creates, faust changelogs included; "
                                       "null: the smaller of 3 and the number of brokers the cluster reports.")
    min_insync_replicas: int | None = Field(
        None, ge=1, le=32, description="`min.insync.replicas` of every topic rollstream creates (producers wait "
                                       "for that many replicas: acks=all); null: the broker's default.")
    topic_configs: dict[str, dict[str, bool | int | float | str]] = Field(
        default_factory=dict, description="More topic configs by logical topic name (`responses`, `groups.accepted`, "
                                          "... or `changelogs` for the tables' changelogs), e.g. "
                                          "{groups.rejected: {retention.ms: 604800000}}; applied on creation and to "
                                          "existing topics; they win over rollstream's own settings.")
    table_standby_replicas: int = Field(
        0, ge=0, le=8, description="faust standby replicas per table partition: set 1 when two or more workers "
                                   "run a faust stage (admission, aggregator, group-queue), so a failed worker's "
                                   "table moves without replaying its whole changelog.")
    # -- client security (kafka-python, faust/aiokafka and the admin client alike)
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="How every client reaches the brokers: plain, TLS (SSL), SASL (sasl_mechanism, "
                                 "credentials from the environment) without or with TLS.")
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        None, description="Required with SASL_PLAINTEXT and SASL_SSL.")
    sasl_username_env: str = Field("ROLLSTREAM_KAFKA_USERNAME", description="Environment variable holding the SASL user name.")
    sasl_password_env: str = Field("ROLLSTREAM_KAFKA_PASSWORD", description="Environment variable holding the SASL password.")
    ssl_cafile: str | None = Field(None, description="PEM file of the CA that signed the brokers' certificates (SSL, SASL_SSL).")
    ssl_certfile: str | None = Field(None, description="PEM client certificate (mutual TLS).")
    ssl_keyfile: str | None = Field(None, description="PEM private key of ssl_certfile.")
    ssl_password_env: str = Field("ROLLSTREAM_KAFKA_SSL_PASSWORD", description="Environment variable holding ssl_keyfile's password, if any.")

    @model_validator(mode="before")
    @classmethod
    def _no_secrets(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in sorted(data):
                if "password" in key and not key.endswith("_env") or key in ("sasl_plain_username", "sasl_username"):
                    raise ValueError(
                        f"{key}: secrets are not read from the config; put them in environment variables "
                        "(kafka.sasl_username_env, kafka.sasl_password_env, kafka.ssl_password_env name them; "
                        "defaults $ROLLSTREAM_KAFKA_USERNAME, $ROLLSTREAM_KAFKA_PASSWORD)")
        return data

    @model_validator(mode="after")
    def _consistent_security(self) -> "KafkaConfig":
        sasl = self.security_protocol.startswith("SASL_")
        if sasl and self.sasl_mechanism is None:
            raise ValueError(f"security_protocol {self.security_protocol} needs sasl_mechanism "
                             "(PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512)")
        if not sasl and self.sasl_mechanism is not None:
            raise ValueError(f"sasl_mechanism is set but security_protocol is {self.security_protocol}; "
                             "use SASL_PLAINTEXT or SASL_SSL")
        files = {k: getattr(self, k) for k in ("ssl_cafile", "ssl_certfile", "ssl_keyfile") if getattr(self, k)}
        if files and self.security_protocol not in ("SSL", "SASL_SSL"):
            raise ValueError(f"{sorted(files)} apply to SSL and SASL_SSL only; security_protocol is {self.security_protocol}")
        for key, path in files.items():
            if not Path(path).is_file():
                raise ValueError(f"{key}: no file {path!r}")
        if self.ssl_keyfile and not self.ssl_certfile:
            raise ValueError("ssl_keyfile needs ssl_certfile")
        if (self.replication_factor is not None and self.min_insync_replicas is not None
                and self.min_insync_replicas > self.replication_factor):
            raise ValueError(f"min_insync_replicas {self.min_insync_replicas} > replication_factor "
                             f"{self.replication_factor}: no write could ever succeed")
        return self


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
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0: greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: the smallest set of tokens whose "
                         "probability reaches top_p (1: every token).")
    max_new_tokens: int = Field(64, gt=0, le=32768, description="response_length: tokens per response at most.")


class InferenceServerConfig(FrozenModel):
    """How the ``vllm_server`` backend talks to its servers, and the local one `rollstream run`
    starts when ``actor_infer.servers`` is empty."""

    max_inflight: int = Field(256, gt=0, le=65536, description="Sequences in flight per server at most (a request of n samples counts n); new requests go to the server with the fewest.")
    request_timeout_s: float = Field(600.0, gt=0.0, le=86400.0, description="Limit of one completion request; past it the request's samples are errors and its prompt is replaced.")
    retries: int = Field(3, ge=0, le=100, description="Further tries of a request after a refused connection, a 5xx or an abort, on another server when there is one.")
    down_s: float = Field(1.0, gt=0.0, le=600.0, description="How long a server that refuses connections leaves the rotation at first (doubled per failure in a row, at most 60 s).")
    pause_mode: Literal["keep", "abort", "wait"] = Field("keep", description="A weight update's pause: keep (requests in flight are frozen and continue with the new weights, their responses record both versions), abort (they are sent again after the update) or wait (they finish first).")
    python: str | None = Field(None, description="Python interpreter with vLLM for the local server; null: $ROLLSTREAM_VLLM_PYTHON, else .venv-vllm/bin/python (make vllm-env).")
    port: int = Field(0, ge=0, le=65535, description="Port of the local server; 0: a free one.")
    startup_timeout_s: float = Field(600.0, gt=0.0, le=7200.0, description="How long the local server may take to become healthy.")
    kv_cache_gb: int = Field(1, ge=1, le=4096, description="KV cache of the local server on a CPU (VLLM_CPU_KVCACHE_SPACE), GiB.")
    max_model_len: int = Field(2048, gt=0, le=1048576, description="The local server's context length (prompt + response tokens).")
    extra_args: list[str] = Field(default_factory=list, description="More command-line arguments of the local server, e.g. [--max-num-seqs, '128'].")


Backend = extension(BACKENDS)
"""A generation backend `actor_infer.backend` may name (rollstream.extensions.BACKENDS)."""


class ActorInferConfig(FrozenModel):
    backend: Backend = Field("transformers", description=f"{builtins(BACKENDS)}, or an import path 'pkg.module:Class'. transformers or vllm: an engine in each generation worker; vllm_server: inference servers over HTTP (servers), weights updated in place; a class of yours is built as Class(model_dir, dtype, max_num_seqs).")
    servers: list[str] = Field(default_factory=list, description="vllm_server: base URLs of the inference servers (http://host:port). Empty: `rollstream run` starts one locally. With several generation workers, each drives its own share (server i belongs to worker i mod instances).")
    server: InferenceServerConfig = Field(default_factory=InferenceServerConfig, description="vllm_server: how the "
                                          "client talks to the servers, and the local server `rollstream run` starts.")
    model_args: ModelArgs = Field(default_factory=ModelArgs, description="The generation model.")
    device: Device = Field("auto", description="Where generation runs; auto: cuda when available, else cpu.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Generation weights' dtype; the trainer computes old_log_probs in float32, so bfloat16 here gives the train-inference mismatch the correction masks handle.")
    generating_args: GeneratingArgs = Field(default_factory=GeneratingArgs, description="How train responses are "
                                            "sampled (validation rounds sample the same way).")
    max_batch: int = Field(16, gt=0, description="Generation requests per engine call (each request is one prompt's num_return_sequences samples). A worker with an in-process engine polls up to 4 calls' worth and generates their train requests before the validation ones; an inference-server worker polls one call's worth at a time.")
    max_num_seqs: int | None = Field(None, gt=0, le=65536, description="Sequences (rows) per engine batch: per transformers generate call, in generation and env workers (None: 32); vLLM's max_num_seqs (None: vLLM's default).")
    nice: int = Field(10, ge=0, le=19, description="CPU priority the model's generators give up (os.nice, and their session's autogroup when they lead one): a generation or env worker once its engine is loaded, the local vLLM server from its start. A trainer sharing their cores then trains at full speed while they use the CPU it leaves (validation rounds included); 0: same priority as the trainer. No effect on cores nothing else uses.")

    @field_validator("servers")
    @classmethod
    def _urls(cls, servers: list[str]) -> list[str]:
        for url in servers:
            if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
                raise ValueError(f"{url!r} is not a server base URL (http://host:port)")
        if len(set(servers)) != len(servers):
            raise ValueError("a server is listed twice")
        return [url.rstrip("/") for url in servers]


class ActorTrainConfig(FrozenModel):
    """The trainer's GRPO step (reference names: pg_clip, loss_agg_mode). The trainer builds its
    own settings from it (rollstream.trainer.policy_trainer.TrainSettings.from_config)."""

    enabled: bool = Field(True, description="False: build and commit batches without training (no model in the trainer).")
    model_args: ModelArgs = Field(default_factory=ModelArgs, description="The trained model.")
    device: Device = Field("auto", description="Where training runs; auto: cuda when available, else cpu.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Training weights' dtype (old_log_probs are computed in it).")
    lr: float = Field(1e-6, gt=0.0, le=1.0, description="AdamW learning rate.")
    micro_batch_size: int = Field(4, gt=0, le=4096, description="Rows per forward/backward pass (gradients accumulate over the batch).")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.")
    pg_clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="The ratio is clipped below at 1 - pg_clip_low.")
    pg_clip_high: float = Field(0.2, ge=0.0, description="The ratio is clipped above at 1 + pg_clip_high.")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean"] = Field(
        "token-mean", description="token-mean: the loss averaged over every trained token of the batch; "
                                  "seq-mean-token-mean: each response's token mean, averaged over the responses.")
    keep_checkpoints: int = Field(2, gt=0, le=1000, description="Policy-version checkpoints kept on disk (runs/<name>/checkpoints); older ones are deleted.")
    keep_checkpoint_every: int | None = Field(None, gt=0, description="Also keep the weights (not the optimizer state) of every version divisible by this, to evaluate a run's versions afterwards; none: only the newest keep_checkpoints.")
    async_save: bool = Field(True, description="Write each checkpoint on a thread of its own while the next step trains (a copy in memory first); the batch is committed once it is durable. False: the step waits for the write. Under torchrun the write is always waited for.")


Logger = extension(LOGGERS)
"""An experiment tracker `trainer.loggers` may name (rollstream.extensions.LOGGERS)."""


class TrainerConfig(FrozenModel):
    """The trainer process's experiment trackers: every committed step's figures, the run's
    retention, rejections and validation figures, and once at the start the run name and the
    resolved config (rollstream.observability.trackers)."""

    loggers: list[Logger] = Field(
        default_factory=list, description=f"Experiment trackers the trainer logs to: any of {builtins(LOGGERS)} (all "
                                          "but console need their extra: pip install 'rollstream[wandb]'), or the "
                                          "import path 'pkg.module:Class' of yours, built as Class(project, log_dir). "
                                          "Empty: none. A tracker that fails mid-run warns once and is dropped; "
                                          "training goes on.")
    log_dir: str | None = Field(
        None, description="Where trackers write locally: TensorBoard event files (<log_dir>/tensorboard), the wandb "
                          "run folder (<log_dir>/wandb) and, without MLFLOW_TRACKING_URI, MLflow's file store "
                          "(<log_dir>/mlruns). null: the run folder, runs/<name> (a new run of the same name moves "
                          "it to runs/<name>.<its start>: set a folder of your own to keep runs side by side).")
    project: str = Field("rollstream", min_length=1, description="The wandb project and the MLflow experiment the "
                                                                 "run is logged under; the run is named `name`.")

    @field_validator("loggers", mode="before")
    @classmethod
    def _one_name_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value  # `trainer.loggers=wandb`

    @field_validator("loggers")
    @classmethod
    def _once_each(cls, loggers: list[str]) -> list[str]:
        if len(set(loggers)) != len(loggers):
            raise ValueError("a logger is listed twice")
        return loggers
