"""One root exception; each package raises precisely named subclasses."""


class RollstreamError(Exception):
    """Root of every error rollstream raises on purpose."""


class ConfigError(RollstreamError):
    """A configuration value is invalid; the message names the field path."""


def validation_problems(exc) -> list[str]:
    """``field.path: message`` for each error of a pydantic ValidationError."""
    return [f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()]


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


class BatchUnderfilledError(RollstreamError):
    """The resampling budget ran out below min_fill_ratio; carries the batch event."""

    def __init__(self, message: str, event: dict | None = None):
        super().__init__(message)
        self.event = event or {}


class TopicPartitionsMismatch(RollstreamError):
    """Topics that must be co-partitioned have different partition counts (or are missing)."""
