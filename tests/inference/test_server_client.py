"""The inference-server backend without vLLM: its wire format, and what it does with servers
that are down or answer badly (a small HTTP server in a thread plays the broken server; the
real vLLM server's tests are in test_vllm_server.py)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollstream.kafka.broker import free_port
from rollstream.schemas.records import FINISH_ERROR
from rollstream.inference.backends import make_backend
from rollstream.inference.engine import SamplingParams
from rollstream.inference.server_client import ServerBackend, ServerError, _has_version, completion_request, parse_completion


def _choice(index, ids, logprobs, reason="stop", text="x"):
    return {"index": index, "text": text, "token_ids": ids, "finish_reason": reason,
            "logprobs": {"token_logprobs": logprobs, "tokens": [f"token_id:{t}" for t in ids]}}


def test_the_request_asks_for_token_ids_and_the_sampled_tokens_logprobs():
    body = completion_request("m", [1, 2, 3], 4, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=16, seed=5))
    assert body == {"model": "m", "prompt": [1, 2, 3], "n": 4, "max_tokens": 16, "temperature": 0.7, "top_p": 0.9,
                    "seed": 5, "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True}


def test_choices_become_samples_in_index_order():
    body = {"choices": [_choice(1, [7, 2], [-0.5, -0.25], "stop", "b"), _choice(0, [5], [-1.0], "length", "a")]}
    samples = parse_completion(body, 2)
    assert [(s.token_ids, s.logprobs, s.finish_reason, s.text) for s in samples] == [
        ([5], [-1.0], "length", "a"), ([7, 2], [-0.5, -0.25], "stop", "b")]


def test_token_ids_are_read_from_the_logprob_tokens_when_the_server_does_not_return_them():
    choice = _choice(0, [11, 12], [-0.1, -0.2])
    choice["token_ids"] = None
    assert parse_completion({"choices": [choice]}, 1)[0].token_ids == [11, 12]


@pytest.mark.parametrize("body, message, retry", [
    ({"error": "x"}, "not a completion response", False),
    ({"choices": [_choice(0, [1], [-1.0])]}, "expected 2 choices, got 1", False),
    ({"choices": [{**_choice(0, [1], [-1.0]), "logprobs": None}, _choice(1, [1], [-1.0])]}, "no logprobs", False),
    ({"choices": [_choice(0, [1, 2], [-1.0]), _choice(1, [1], [-1.0])]}, "2 tokens but 1 logprobs", False),
    ({"choices": [_choice(0, [1], [float("nan")]), _choice(1, [1], [-1.0])]}, "NaN or positive", False),
    ({"choices": [_choice(0, [1], [-1.0], "abort"), _choice(1, [1], [-1.0])]}, "aborted", True),
    ({"choices": [_choice(0, [1], [-1.0], "content_filter"), _choice(1, [1], [-1.0])]}, "content_filter", False),
    ({"choices": [_choice(0, [1], ["x"]), _choice(1, [1], [-1.0])]}, "malformed completion: ValueError", False),
    ({"choices": [_choice(0, [1], [-1.0]), {**_choice(1, [1], [-1.0]), "index": "b"}]}, "malformed completion", False),
    ({"choices": [{**_choice(0, [1], [-1.0]), "logprobs": "none"}, _choice(1, [1], [-1.0])]}, "malformed", False),
])
def test_a_malformed_completion_is_a_clear_error(body, message, retry):
    with pytest.raises(ServerError, match=message) as info:
        parse_completion(body, 2)
    assert info.value.retry is retry


def test_a_server_started_from_the_model_folder_holds_version_0_only():
    assert _has_version("default", 0) and _has_version(None, 0) and _has_version("3", 3)
    assert not _has_version("default", 1) and not _has_version("2", 3) and not _has_version(None, 1)


def test_the_backend_is_built_by_name_and_bad_limits_are_refused():
    backend = make_backend("vllm_server", servers=["http://127.0.0.1:9"])
    try:
        assert isinstance(backend, ServerBackend) and backend.pause_mode == "keep"
    finally:
        backend.close()
    with pytest.raises(ValueError, match="at least one server"):
        ServerBackend([])
    with pytest.raises(ValueError, match="pause_mode"):
        ServerBackend(["http://127.0.0.1:9"], pause_mode="later")


class _Broken(BaseHTTPRequestHandler):
    """Answers every completion the way ``server.mode`` says; ``/weight_info`` says version 0."""

    def log_message(self, *args):  # quiet
        pass

    def _send(self, code: int, text: str) -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/weight_info":
            self._send(200, json.dumps({"weight_version": "default"}))
        else:
            self._send(200, json.dumps({"data": [{"id": "served-model"}]}))

    def do_POST(self):
        length = int(self.headers.get("content-length", 0))
        body = json.loads(self.rfile.read(length) or b"{}")
        self.server.requests.append(body)
        mode = self.server.mode
        if mode == "ok" and not self.path.startswith("/v1/completions"):  # pause, reload, resume, ...
            self._send(200, "{}")
        elif mode == "ok":
            n = body["n"]
            self._send(200, json.dumps({"choices": [_choice(i, [5, 2], [-0.5, -0.1]) for i in range(n)]}))
        elif mode == "http500":
            self._send(500, '{"error": "engine dead"}')
        elif mode == "http404":
            self._send(404, '{"error": {"message": "The model `x` does not exist."}}')
        elif mode == "garbage":
            self._send(200, "<html>not json")
        elif mode == "no_logprobs":
            self._send(200, json.dumps({"choices": [{**_choice(i, [5], [-1.0]), "logprobs": None}
                                                    for i in range(body["n"])]}))
        elif mode == "silent":  # until the test ends
            self.server.ended.wait(60)


@pytest.fixture
def broken():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Broken)
    server.mode, server.requests, server.ended = "ok", [], threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.ended.set()
    server.shutdown()
    server.server_close()


def _backend(*urls, **kw):
    return ServerBackend(list(urls), request_timeout_s=kw.pop("request_timeout_s", 20.0), down_s=0.2, **kw)


def test_a_healthy_server_gets_every_request_and_the_model_is_asked_for(broken):
    backend = _backend(f"http://127.0.0.1:{broken.server_port}")
    try:
        out = backend.generate([[1, 2], [3]], [2, 1], [SamplingParams(max_new_tokens=4, seed=1)] * 2)
    finally:
        backend.close()
    assert [[(s.token_ids, s.finish_reason, s.versions) for s in row] for row in out] == [
        [([5, 2], "stop", (0,))] * 2, [([5, 2], "stop", (0,))]]
    assert sorted((r["model"], r["prompt"], r["n"]) for r in broken.requests) == [
        ("served-model", [1, 2], 2), ("served-model", [3], 1)]


@pytest.mark.parametrize("mode, cause", [
    ("http404", "HTTP 404"),
    ("garbage", "malformed JSON"),
    ("no_logprobs", "no logprobs"),
])
def test_a_bad_answer_is_an_error_sample_that_names_the_server_and_the_cause(broken, mode, cause):
    broken.mode = mode
    url = f"http://127.0.0.1:{broken.server_port}"
    backend = _backend(url)
    try:
        out = backend.generate([[1, 2]], [3], [SamplingParams(max_new_tokens=4)])
    finally:
        backend.close()
    assert [s.finish_reason for s in out[0]] == [FINISH_ERROR] * 3
    assert all(url in s.error and cause in s.error for s in out[0])
    assert len(broken.requests) == 1  # not worth a retry


def test_a_5xx_is_retried_then_given_up_with_its_cause(broken):
    broken.mode = "http500"
    backend = _backend(f"http://127.0.0.1:{broken.server_port}", retries=2)
    try:
        out = backend.generate([[1]], [1], [SamplingParams(max_new_tokens=4)])
    finally:
        backend.close()
    assert out[0][0].finish_reason == FINISH_ERROR
    assert "gave up after 3 tries" in out[0][0].error and "HTTP 500" in out[0][0].error
    assert len(broken.requests) == 3


def test_a_server_that_never_answers_times_the_request_out(broken):
    broken.mode = "silent"
    backend = _backend(f"http://127.0.0.1:{broken.server_port}", request_timeout_s=1.0, retries=0)
    try:
        started = time.monotonic()
        out = backend.generate([[1]], [2], [SamplingParams(max_new_tokens=4)])
        took = time.monotonic() - started
    finally:
        backend.close()
    assert [s.finish_reason for s in out[0]] == [FINISH_ERROR] * 2
    assert "Timeout" in out[0][0].error
    assert took < 30.0  # bounded by request_timeout_s (1 s), not by the server's silence (60 s)


def test_a_dead_server_leaves_the_rotation_and_the_live_one_serves(broken):
    dead = f"http://127.0.0.1:{free_port()}"
    backend = _backend(dead, f"http://127.0.0.1:{broken.server_port}")
    try:
        out = backend.generate([[1]] * 6, [1] * 6, [SamplingParams(max_new_tokens=4)] * 6)
        states = {s.url: (s.version, s.served) for s in backend.servers}
    finally:
        backend.close()
    assert all(row[0].finish_reason == "stop" for row in out)
    assert states == {dead: (None, 0), f"http://127.0.0.1:{broken.server_port}": (0, 6)}


def test_no_reachable_server_gives_error_samples_within_the_timeout():
    dead = f"http://127.0.0.1:{free_port()}"
    backend = _backend(dead, request_timeout_s=1.5)
    try:
        started = time.monotonic()
        out = backend.generate([[1], [2]], [2, 1], [SamplingParams(max_new_tokens=4)] * 2)
        took = time.monotonic() - started
    finally:
        backend.close()
    assert [[s.finish_reason for s in row] for row in out] == [[FINISH_ERROR] * 2, [FINISH_ERROR]]
    assert "no inference server reachable" in out[0][0].error and dead in out[0][0].error
    assert took < 30.0  # a few 1.5 s timeouts at most, not a wait for the dead server to return


def test_an_update_no_server_can_load_keeps_the_old_version(broken):
    broken.mode = "http500"  # /pause answers 500 too
    backend = _backend(f"http://127.0.0.1:{broken.server_port}")
    try:
        broken.mode = "ok"
        backend.generate([[1]], [1], [SamplingParams(max_new_tokens=4)])  # in rotation at version 0
        broken.mode = "http500"
        with pytest.raises(Exception, match="no server loaded policy version 1"):
            backend.load_weights("/no/such/checkpoint", 1)
        assert backend.policy_version == 0
        # its weights are unknown after a failed reload: it serves again only after reloading
        assert [(s.version, s.stale) for s in backend.servers] == [(None, True)]
        broken.mode = "ok"
        broken.requests.clear()
        out = backend.generate([[1]], [1], [SamplingParams(max_new_tokens=4)])
        assert out[0][0].versions == (0,)
        assert [s.version for s in backend.servers] == [0]
        assert len(broken.requests) == 5  # pause, reload, reset, update_weight_version, resume... then the completion
    finally:
        backend.close()


def test_the_served_model_is_asked_again_once_a_server_answers():
    port = free_port()
    backend = ServerBackend([f"http://127.0.0.1:{port}"], request_timeout_s=5.0, down_s=0.1)
    server = None
    try:
        first = backend.generate([[1]], [1], [SamplingParams(max_new_tokens=4)])
        assert first[0][0].finish_reason == FINISH_ERROR and backend.model is None
        server = ThreadingHTTPServer(("127.0.0.1", port), _Broken)  # the server starts late
        server.mode, server.requests = "ok", []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        second = backend.generate([[1]], [1], [SamplingParams(max_new_tokens=4)])
        assert second[0][0].finish_reason == "stop" and backend.model == "served-model"
    finally:
        backend.close()
        if server is not None:
            server.shutdown()
            server.server_close()


def test_a_server_down_during_an_update_loads_that_version_when_it_is_back(broken):
    url = f"http://127.0.0.1:{broken.server_port}"
    backend = _backend(url)
    try:
        backend.generate([[1]], [1], [SamplingParams(max_new_tokens=4)])  # in rotation at version 0
        port = broken.server_port
        broken.shutdown()
        broken.server_close()  # the server dies: the update cannot reach it
        backend.load_weights("/checkpoints/v000001", 1)  # no error: it is a dead server, not a bad checkpoint
        assert backend.policy_version == 1 and [(s.version, s.stale) for s in backend.servers] == [(None, True)]
        back = ThreadingHTTPServer(("127.0.0.1", port), _Broken)
        back.mode, back.requests = "ok", []
        threading.Thread(target=back.serve_forever, daemon=True).start()
        try:
            out = backend.generate([[1]], [1], [SamplingParams(max_new_tokens=4)])
        finally:
            back.shutdown()
            back.server_close()
        assert out[0][0].versions == (1,)
        reloads = [r for r in back.requests if r.get("method") == "reload_weights"]
        assert reloads == [{"method": "reload_weights", "kwargs": {"weights_path": "/checkpoints/v000001"}}]
    finally:
        backend.close()
