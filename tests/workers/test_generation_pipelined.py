"""The generation worker with an inference-server backend polls on while earlier polls' requests
are in flight (so the servers batch continuously), and commits each poll's offsets only once its
Responses are written, in poll order. A scripted HTTP server holds every completion until the test
lets it answer; the broker is the real one."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kafka import KafkaConsumer, TopicPartition

from rollstream.kafka.context import StageContext
from rollstream.kafka.clients import make_producer
from rollstream.kafka.event_worker import EventWorker
from rollstream.policy.model import load_tokenizer
from rollstream.schemas import encode
from rollstream.kafka.readback import count_records
from rollstream.tools.readback import read_values
from rollstream.inference.engine import SamplingParams
from rollstream.workers.generation import GenerationWorker
from rollstream.inference.server_client import ServerBackend
from tests.integration.harness import wait_for

pytestmark = pytest.mark.integration

REQUESTS, N = 4, 2


class _Held(BaseHTTPRequestHandler):
    """Completions wait for ``server.release``; ``server.all_in`` is set once ``REQUESTS`` of them
    are waiting at the same time. Sample i of a request is the token ids [7, i]."""

    def log_message(self, *args):
        pass

    def _send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"weight_version": "default"} if self.path == "/weight_info" else {"data": [{"id": "m"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        with self.server.lock:
            self.server.waiting += 1
            if self.server.waiting == REQUESTS:
                self.server.all_in.set()
        self.server.release.wait(60)
        self._send({"choices": [{"index": i, "text": "", "token_ids": [7, i], "finish_reason": "length",
                                 "logprobs": {"token_logprobs": [-0.5, -0.25]}} for i in range(body["n"])]})


@pytest.fixture
def held():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Held)
    server.lock, server.waiting, server.all_in, server.release = threading.Lock(), 0, threading.Event(), threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


def _committed(bootstrap: str, group: str, topic: str) -> int | None:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        return consumer.committed(TopicPartition(topic, 0))
    finally:
        consumer.close()


def test_polls_go_out_while_earlier_ones_are_in_flight_and_commit_in_order(kafka_broker, topic_factory, held):
    topics = topic_factory(partitions=1)
    group = f"{topics.prefix}generation"
    backend = ServerBackend([f"http://127.0.0.1:{held.server_port}"], request_timeout_s=60)
    handler = GenerationWorker(backend, SamplingParams(max_new_tokens=2), topics, tokenizer=load_tokenizer(None))
    assert handler.pipelined
    worker = EventWorker(StageContext(kafka_broker, topics, "generation"), input_topic=topics.generation_requests,
                         group_id=group, expected_schema="GenerationRequest", max_batch=1, handler=handler)
    producer = make_producer(kafka_broker)
    for k in range(REQUESTS):
        request = {"prompt_id": f"p{k}", "domain": "math", "prompt": f"What is {k} + 1?", "round": 0,
                   "num_return_sequences": N, "seed": k}
        producer.send(topics.generation_requests, key=f"p{k}".encode(), value=encode(request, "GenerationRequest"))
    producer.flush()
    producer.close()
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        # one request per poll (max_batch 1), and all four at the server at once
        assert held.all_in.wait(60), f"{held.waiting} requests reached the server"
        assert _committed(kafka_broker, group, topics.generation_requests) is None
        assert count_records(kafka_broker, topics.responses) == 0
        held.release.set()
        wait_for(lambda: _committed(kafka_broker, group, topics.generation_requests) == REQUESTS, timeout=60,
                 what="the four polls committed")
    finally:
        worker.stop()
        thread.join(30)
        backend.close()
    responses = read_values(kafka_broker, topics.responses)
    assert sorted((r["prompt_id"], r["sample_index"]) for r in responses) == [
        (f"p{k}", i) for k in range(REQUESTS) for i in range(N)]
    assert all(r["response_token_ids"].tolist() == [7, r["sample_index"]] and r["error"] is None for r in responses)
    assert worker.processed == REQUESTS and worker.dead_lettered == 0 and handler._in_flight == 0
