"""Publish prompts to a running pipeline from your own code.

A pipeline whose config has ``datasets: []`` (or any other) reads its prompts from the topic
``<topic_prefix>prompts``; ``PromptPublisher`` writes them there, checked against the ``Prompt``
schema, and ends the data with a ``PromptsEnd`` marker, after which admission runs the later
epochs and, once everything is decided, gives the end-of-data verdict::

    from rollstream.client import PromptPublisher

    with PromptPublisher("127.0.0.1:9092", topic_prefix="rollstream.", domain="math") as publisher:
        publisher.publish([
            "What is 2 + 2?",                                   # one user turn, id prompt-00000
            {"prompt_id": "q7", "prompt": "What is 3 * 3?", "ground_truth": "9"},
            {"prompt_id": "q8", "ground_truth": "4",            # a chat prompt, system turn included
             "messages": [{"role": "system", "content": "Answer with a number."},
                          {"role": "user", "content": "What is 2 + 2?"}]},
        ])
    # leaving the block without an exception wrote the PromptsEnd marker

A prompt is a string (the text, one user turn) or a mapping of Prompt fields: ``prompt`` and/or
``messages`` (``prompt`` defaults to the last user message), ``prompt_id`` (default
``<id_prefix><n:05d>``, n counting this publisher's prompts), ``domain`` and ``mode`` (default:
the publisher's), ``ground_truth``, ``tag``. The generation worker templates ``messages`` when
there are any, else ``prompt`` as one user turn. Prompt ids must be unique per run; a val prompt
(``mode="val"``) should not reuse a train prompt's id.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from rollstream.data import prompt_record, publish_end, publish_prompts
from rollstream.exceptions import RollstreamError
from rollstream.kafka.admin import create_topics
from rollstream.kafka.clients import make_producer
from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.topics import Topics
from rollstream.runtime import DEFAULT_TOPIC_PREFIX

__all__ = ["PromptPublisher"]


class PromptPublisher:
    """Publishes prompts to ``<topic_prefix>prompts`` on the Kafka cluster at ``bootstrap``.

    Args:
        bootstrap: Kafka bootstrap servers, ``host:port[,host:port]``, or a
            ``rollstream.kafka.cluster.Cluster`` (TLS / SASL settings with them).
        topic_prefix: the pipeline's ``kafka.topic_prefix``.
        domain: the reward domain of prompts that do not name one (a ``rewards`` key of the config).
        mode: ``train`` or ``val``, for prompts that do not say.
        id_prefix: default ids are ``<id_prefix><n:05d>``.
        name: who ends the data (``PromptsEnd.producer``), for replay.
        end_on_exit: leaving the ``with`` block without an exception calls ``end_of_data()``.

    The prompts topic is created when missing (one partition, so the end marker follows every
    prompt), replicated ``replication_factor`` times (None: the smaller of 3 and the cluster's
    brokers). Raises RollstreamError subclasses when the broker cannot be reached.
    """

    def __init__(self, bootstrap: Bootstrap, topic_prefix: str = DEFAULT_TOPIC_PREFIX, *, domain: str | None = None,
                 mode: str = "train", id_prefix: str = "prompt-", name: str = "client",
                 end_on_exit: bool = True, replication_factor: int | None = None) -> None:
        self.topics = Topics(topic_prefix)
        self.domain, self.mode, self.id_prefix, self.name = domain, mode, id_prefix, name
        self.end_on_exit = end_on_exit
        self.published = 0  # prompts sent so far
        self.ended = False
        create_topics(bootstrap, {self.topics.prompts: self.topics.all(1)[self.topics.prompts]},
                      replicas=replication_factor)
        self._producer = make_producer(bootstrap)

    def publish(self, prompts: Iterable[str | Mapping[str, Any]]) -> int:
        """Check every prompt of ``prompts``, then send them all (in order) and wait for the
        broker's acknowledgement; returns how many were sent.

        Raises ValueError naming the first bad item (``prompts[3]: domain must be a non-empty
        string ...``); nothing of that call is sent then. Raises RollstreamError after
        ``end_of_data()``."""
        if self.ended:
            raise RollstreamError("end_of_data() was called: no prompt may follow the PromptsEnd marker")
        records = [prompt_record(item, f"prompts[{k}]", domain=self.domain, mode=self.mode,
                                 prompt_id=f"{self.id_prefix}{self.published + k:05d}")
                   for k, item in enumerate(prompts)]
        sent = publish_prompts(self._producer, self.topics, records)
        self._producer.flush()
        self.published += sent
        return sent

    def end_of_data(self) -> None:
        """Write the ``PromptsEnd`` marker (once; a second call does nothing): no prompt follows."""
        if self.ended:
            return
        publish_end(self._producer, self.topics, self.published, self.name)
        self._producer.flush()
        self.ended = True

    def close(self) -> None:
        """Flush and close the connection (without ending the data)."""
        self._producer.flush()
        self._producer.close()

    def __enter__(self) -> "PromptPublisher":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None and self.end_on_exit:
                self.end_of_data()
        finally:
            self.close()
