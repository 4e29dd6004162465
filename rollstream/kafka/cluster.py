"""How a process reaches its Kafka cluster: the bootstrap servers plus the client security that
every producer, consumer and admin client (kafka-python) and every faust app (aiokafka) of the
process is built with, so one setting reaches them all.

Secrets never come from the YAML: the config names environment variables
(``kafka.sasl_username_env``, ``kafka.sasl_password_env``, ``kafka.ssl_password_env``) and
``Cluster.from_config`` reads them.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Union

from rollstream.exceptions import ConfigError

if TYPE_CHECKING:  # the config package loads the filters (torch): not needed to connect
    from rollstream.config.base import KafkaConfig


@dataclass(frozen=True)
class Cluster:
    """The bootstrap servers (``host:port[,host:port...]``) and the client security settings.

    ``str(cluster)`` is the bootstrap list, so a Cluster prints where a bootstrap string did.
    ``security_protocol``: PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL; ``sasl_mechanism``:
    PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (SASL_* only); ``ssl_*``: PEM files (SSL, SASL_SSL).
    Passwords are left out of ``repr``.
    """

    bootstrap: str
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_password: str | None = field(default=None, repr=False)

    def __str__(self) -> str:
        return self.bootstrap

    @property
    def servers(self) -> list[str]:
        """The bootstrap list, one ``host:port`` each."""
        return [s.strip() for s in self.bootstrap.split(",") if s.strip()]

    @classmethod
    def from_config(cls, bootstrap: str, kafka: "KafkaConfig",
                    environ: Mapping[str, str] | None = None) -> "Cluster":
        """The cluster at ``bootstrap`` with ``kafka``'s security, secrets read from ``environ``
        (default ``os.environ``). Raises ConfigError when a SASL protocol is configured and a
        variable it names is unset."""
        env = os.environ if environ is None else environ
        username = password = None
        if kafka.security_protocol.startswith("SASL_"):
            missing = [v for v in (kafka.sasl_username_env, kafka.sasl_password_env) if not env.get(v)]
            if missing:
                raise ConfigError(
                    f"kafka.security_protocol is {kafka.security_protocol}: set the environment variable(s) "
                    f"{', '.join('$' + v for v in missing)} (named by kafka.sasl_username_env / sasl_password_env)")
            username, password = env[kafka.sasl_username_env], env[kafka.sasl_password_env]
        return cls(bootstrap=bootstrap, security_protocol=kafka.security_protocol,
                   sasl_mechanism=kafka.sasl_mechanism, sasl_username=username, sasl_password=password,
                   ssl_cafile=kafka.ssl_cafile, ssl_certfile=kafka.ssl_certfile, ssl_keyfile=kafka.ssl_keyfile,
                   ssl_password=env.get(kafka.ssl_password_env) or None)

    @property
    def uses_ssl(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    def client_kwargs(self) -> dict[str, Any]:
        """``bootstrap_servers`` and the security arguments of kafka-python's KafkaProducer,
        KafkaConsumer and KafkaAdminClient (only those that differ from its defaults)."""
        kwargs: dict[str, Any] = {"bootstrap_servers": self.bootstrap}
        if self.security_protocol != "PLAINTEXT":
            kwargs["security_protocol"] = self.security_protocol
        if self.sasl_mechanism is not None:
            kwargs.update(sasl_mechanism=self.sasl_mechanism, sasl_plain_username=self.sasl_username,
                          sasl_plain_password=self.sasl_password)
        if self.uses_ssl:
            kwargs.update({k: v for k, v in (("ssl_cafile", self.ssl_cafile), ("ssl_certfile", self.ssl_certfile),
                                             ("ssl_keyfile", self.ssl_keyfile), ("ssl_password", self.ssl_password))
                           if v is not None})
        return kwargs

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context aiokafka (faust) needs for SSL and SASL_SSL; None otherwise."""
        if not self.uses_ssl:
            return None
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ssl_cafile)
        if self.ssl_certfile:
            context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile, password=self.ssl_password)
        return context


Bootstrap = Union[str, Cluster]
"""What every client factory takes: a Cluster, or a plain bootstrap string (PLAINTEXT)."""


def as_cluster(bootstrap: Bootstrap) -> Cluster:
    """``bootstrap`` as a Cluster (a string is a PLAINTEXT cluster)."""
    return bootstrap if isinstance(bootstrap, Cluster) else Cluster(str(bootstrap))
