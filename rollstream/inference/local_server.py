"""A vLLM inference server on this machine, started and supervised as the embedded broker is.

vLLM carries a torch of its own, so it lives in an environment of its own (``.venv-vllm``,
``make vllm-env``) and runs as a subprocess of that interpreter: vLLM's OpenAI-compatible server
with its dev endpoints on (``VLLM_SERVER_DEV_MODE=1``: pause, resume, ``collective_rpc``), which
the ``vllm_server`` backend uses to load new weights in place.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

import httpx

from rollstream.exceptions import ConfigError, RollstreamError
from rollstream.kafka.broker import free_port
from rollstream.runtime import lower_session_priority
from rollstream.inference.vllm_extension import WORKER_EXTENSION

PROJECT_ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON_ENV = "ROLLSTREAM_VLLM_PYTHON"


class InferenceServerError(RollstreamError):
    """The local inference server did not start, or died."""


def vllm_python(configured: str | None = None) -> str:
    """The interpreter with vLLM: ``configured`` (``actor_infer.server.python``), else
    ``$ROLLSTREAM_VLLM_PYTHON``, else the project's ``.venv-vllm/bin/python``. Raises
    ConfigError when that file does not exist."""
    python = configured or os.environ.get(VLLM_PYTHON_ENV) or str(PROJECT_ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(python).is_file():
        raise ConfigError(f"actor_infer.server.python: no Python with vLLM at {python} "
                          f"(build it with `make vllm-env`, or set ${VLLM_PYTHON_ENV})")
    return python


class LocalInferenceServer:
    """One vLLM OpenAI-compatible server subprocess serving ``model_dir``.

    Args:
        model_dir: the model folder it serves (version 0 of the policy).
        log_path: its stdout and stderr.
        python: the interpreter with vLLM (``vllm_python``).
        dtype: the weights' dtype in the server (``float32``, ``bfloat16``, ``float16``).
        port: 0 picks a free one at the first start; restarts keep it.
        max_model_len: prompt + response tokens at most.
        kv_cache_gb: the KV cache on a CPU (``VLLM_CPU_KVCACHE_SPACE``).
        max_num_seqs: vLLM's ``--max-num-seqs`` (None: its default).
        extra_args: more command-line arguments.

    ``url`` is its base URL once started.
    """

    def __init__(self, model_dir: str | os.PathLike, log_path: Path, *, python: str, dtype: str = "bfloat16",
                 port: int = 0, max_model_len: int = 2048, kv_cache_gb: int = 1, max_num_seqs: int | None = None,
                 extra_args: Sequence[str] = (), nice: int = 0) -> None:
        self.model_dir = str(model_dir)
        self.nice = nice
        self.log_path = Path(log_path)
        self.python = python
        self.port = port
        self.args = ["--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager",
                     # sampling defaults are the request's own, never the model's generation_config.json
                     "--generation-config", "vllm",
                     # Every request is seeded. A prefill split over engine steps makes vLLM rewind
                     # the request's random generator, which a CPU generator cannot do: the engine
                     # dies ("CPU Generator does not use offset"). Whole prefills never rewind.
                     "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(max_model_len, 4096)),
                     # refresh_output_embedding, called after each in-place reload
                     "--worker-extension-cls", WORKER_EXTENSION,
                     *(["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else []), *extra_args]
        # PYTHONPATH: vLLM's workers import the extension from this checkout
        path = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb),
                    "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}
        self.restarts = 0
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def launch(self) -> None:
        """Start the process without waiting for it (``wait_ready``)."""
        if self.is_running():
            return
        self.port = self.port or free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                   "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        with open(self.log_path, "ab") as log:
            log.write(f"---- {' '.join(command)}\n".encode())
            self._proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=self.env, start_new_session=True, preexec_fn=self._lower_priority)

    def _lower_priority(self) -> None:
        # in the child before exec (it leads its own session): vLLM's engine processes inherit both
        os.nice(self.nice)
        lower_session_priority(self.nice)

    def wait_ready(self, timeout_s: float) -> str:
        """Wait until ``/health`` answers 200; returns ``url``. Raises InferenceServerError (with
        the log tail) when the process exits or ``timeout_s`` passes, after stopping it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.is_running():
                code = None if self._proc is None else self._proc.returncode
                self._fail(f"the vLLM server exited with code {code}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self._fail(f"the vLLM server was not healthy after {timeout_s:.0f} s")

    def start(self, timeout_s: float = 600.0) -> str:
        """``launch`` then ``wait_ready``; returns ``url``."""
        self.launch()
        return self.wait_ready(timeout_s)

    def restart_if_dead(self) -> bool:
        """Launch it again (same port) when it died; returns whether it did. Clients see it come
        back through ``/health``: the ``vllm_server`` backend reloads the newest weights then."""
        if self._proc is None or self.is_running():
            return False
        with open(self.log_path, "ab") as log:
            log.write(f"\n---- restart {self.restarts + 1}: it exited with {self._proc.returncode} ----\n".encode())
        self.restarts += 1
        self.launch()
        return True

    def kill(self) -> None:
        """SIGKILL the server's process group (a crash)."""
        if self.is_running():
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(30)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group, wait up to ``timeout_s``, then SIGKILL it."""
        if not self.is_running():
            return
        try:
            os.killpg(self._proc.pid, signal.SIGTERM)
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(30)
        except ProcessLookupError:
            pass

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _fail(self, reason: str):
        self.stop(timeout_s=5)
        raise InferenceServerError(f"{reason}; last lines of {self.log_path}:\n{self.tail()}")
