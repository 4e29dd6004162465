"""An embedded single-node Apache Kafka broker (KRaft) run with plain ``java``.

No Docker: the jars come from rollstream.kafka.jars, and the JVM runs in its own process group
so that ``stop()`` can take down everything it started. ``start_daemon``/``stop_daemon`` keep a
broker running between commands (`rollstream broker start|stop|status`).
All timeouts are in seconds.
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import NoReturn

from rollstream.exceptions import BrokerStartError
from rollstream.kafka.admin import metadata_ready
from rollstream.kafka.jars import BROKER_FILES, KAFKA_VERSION, kafka_classpath
from rollstream.kafka.jars import java as java_executable

DEFAULT_DATA_DIR = Path(".rollstream/broker")  # relative to the CWD; the CLI passes its own

BROKER_JVM_OPTS = ["-Xms512m", "-Xmx1g", "-XX:+UseG1GC"]
TOOL_JVM_OPTS = ["-Xmx256m"]

# Single node, loopback only (stack-notes 1.1). Ports and data dir are filled in per broker.
SERVER_PROPERTIES_TEMPLATE = """\
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:{controller_port}
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}
advertised.listeners=PLAINTEXT://127.0.0.1:{port}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs={log_dirs}
num.partitions=1
default.replication.factor=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
num.network.threads=2
num.io.threads=2
num.recovery.threads.per.data.dir=1
auto.create.topics.enable=true
"""


def render_server_properties(data_dir: Path, port: int, controller_port: int) -> str:
    """Return server.properties text for one broker listening on 127.0.0.1."""
    log_dirs = (Path(data_dir).resolve() / "kraft").as_posix()
    return SERVER_PROPERTIES_TEMPLATE.format(
        port=port, controller_port=controller_port, log_dirs=log_dirs
    )


def free_port() -> int:
    """A TCP port the OS says is free on 127.0.0.1 right now (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes, URL-safe base64 without padding.

    Made in Python to save a JVM start (``StorageTool random-uuid``). Like Kafka's
    ``Uuid.randomUuid`` it never returns an id that starts with '-' (reads as a CLI flag).
    """
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid


def _tail(path: Path, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except OSError:
        return "(no log)"


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # pid == pgid because the JVM leads its own session
    except (ProcessLookupError, PermissionError):
        pass


# Brokers started in this process and not detached; stopped at interpreter exit so that a
# crashed test run never leaves a JVM behind.
_LIVE: set[EmbeddedBroker] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _stop_live_brokers() -> None:
    for broker in list(_LIVE):
        broker.stop(timeout=10)


class EmbeddedBroker:
    """One single-node Kafka broker+controller in a child JVM, data under ``data_dir``.

    Ports default to free ones picked at ``start()``. Files in ``data_dir``:
    ``server.properties``, ``broker.log`` (JVM stdout/stderr) and ``kraft/`` (the log dir).
    """

    def __init__(self, data_dir: Path, port: int | None = None,
                 controller_port: int | None = None, kafka_version: str = KAFKA_VERSION):
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self.controller_port = controller_port
        self.kafka_version = kafka_version
        self._proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        """``127.0.0.1:PORT`` of the PLAINTEXT listener (port known once started)."""
        if self.port is None:
            raise BrokerStartError("broker has no port yet; call start() first")
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        """The broker's combined stdout/stderr log."""
        return self.data_dir / "broker.log"

    @property
    def properties_path(self) -> Path:
        return self.data_dir / "server.properties"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def is_running(self) -> bool:
        """True while the JVM this object started is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 60) -> str:
        """Format storage, launch the JVM and wait up to ``timeout`` s for Metadata to answer.

        Returns the bootstrap string. Raises BrokerStartError (with the log tail) on failure,
        after killing the JVM.
        """
        if self.is_running():
            return self.bootstrap
        deadline = time.monotonic() + timeout
        java = java_executable()
        cp = kafka_classpath(self.kafka_version)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        self.controller_port = self.controller_port or free_port()
        if self.controller_port == self.port:
            self.controller_port = free_port()
        self.properties_path.write_text(
            render_server_properties(self.data_dir, self.port, self.controller_port)
        )
        log4j = f"-Dlog4j.configuration=file:{BROKER_FILES / 'log4j.properties'}"
        with open(self.log_path, "ab") as log:
            self._format_storage(java, cp, log4j, log, max(deadline - time.monotonic(), 5))
            self._proc = subprocess.Popen(
                [java, *BROKER_JVM_OPTS, "-cp", cp, log4j, "kafka.Kafka",
                 str(self.properties_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.data_dir, start_new_session=True,
            )
        with _LIVE_LOCK:
            _LIVE.add(self)
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._fail(f"broker JVM exited with code {self._proc.returncode}")
            if metadata_ready(self.bootstrap, timeout=1):
                return self.bootstrap
            time.sleep(0.25)
        self._fail(f"broker did not answer Metadata within {timeout} s")

    def cluster_id(self) -> str:
        """The cluster id recorded in ``kraft/meta.properties``, or a new one if unformatted."""
        try:
            for line in (self.data_dir / "kraft" / "meta.properties").read_text().splitlines():
                key, _, value = line.partition("=")
                if key.strip() == "cluster.id" and value.strip():
                    return value.strip()
        except OSError:
            pass
        return new_cluster_id()

    def _format_storage(self, java, cp, log4j, log, timeout: float) -> None:
        # --ignore-formatted lets a restart keep its data, but 3.9 still checks that -t matches
        # the id already on disk, so a restart must pass the recorded id.
        cmd = [java, *TOOL_JVM_OPTS, "-cp", cp, log4j, "kafka.tools.StorageTool", "format",
               "-t", self.cluster_id(), "-c", str(self.properties_path), "--ignore-formatted"]
        try:
            res = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BrokerStartError(
                f"StorageTool format timed out after {timeout:.0f} s; log {self.log_path}:\n"
                + _tail(self.log_path)) from None
        if res.returncode != 0:
            raise BrokerStartError(
                f"StorageTool format failed (exit {res.returncode}); log {self.log_path}:\n"
                + _tail(self.log_path))

    def _fail(self, reason: str) -> NoReturn:
        self.stop(timeout=5)
        raise BrokerStartError(f"{reason}; last lines of {self.log_path}:\n{_tail(self.log_path)}")

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM the JVM's process group, wait up to ``timeout`` s, then SIGKILL it."""
        with _LIVE_LOCK:
            _LIVE.discard(self)
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            _kill_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # Also reached when the JVM leader died by itself: reap anything left in its group.
        _kill_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def detach(self) -> None:
        """Let the JVM outlive this Python process (no stop at exit); used for daemons."""
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if self._proc is not None:
            # Stop Popen.__del__ from warning about a child we leave running on purpose.
            self._proc.returncode = 0
            self._proc = None


# ---- daemon helpers for the CLI -------------------------------------------------------------

def _state_path(data_dir: Path) -> Path:
    return Path(data_dir) / "broker.json"


def _pid_is_broker(pid: int, properties: str) -> bool:
    """True if ``pid`` is alive and is our broker JVM (guards against pid reuse)."""
    if Path("/proc/self").exists():  # Linux: compare the command line too
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:  # gone
            return False
        # A zombie has an empty cmdline: it is no longer a broker.
        return b"kafka.Kafka" in args and properties.encode() in args
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _read_state(data_dir: Path) -> dict | None:
    try:
        return json.loads(_state_path(data_dir).read_text())
    except (OSError, ValueError):
        return None


def daemon_status(data_dir: Path = DEFAULT_DATA_DIR) -> dict | None:
    """The daemon's recorded state plus ``ready`` (Metadata answers), or None if not running."""
    state = _read_state(data_dir)
    if not state or not _pid_is_broker(state["pid"], state["properties"]):
        return None
    return {**state, "ready": metadata_ready(state["bootstrap"])}


def start_daemon(data_dir: Path = DEFAULT_DATA_DIR, port: int | None = None,
                 controller_port: int | None = None, timeout: float = 60) -> dict:
    """Start a broker that outlives this process; record it in ``<data_dir>/broker.json``.

    If the recorded broker is already running, wait for it to be ready and return its state.
    Returns a dict: pid, bootstrap, port, controller_port, log_path, data_dir, properties.
    """
    data_dir = Path(data_dir).resolve()
    status = daemon_status(data_dir)
    if status is not None:
        deadline = time.monotonic() + timeout
        while not status["ready"] and time.monotonic() < deadline:
            time.sleep(0.25)
            status = {**status, "ready": metadata_ready(status["bootstrap"])}
        if not status["ready"]:
            raise BrokerStartError(f"broker pid {status['pid']} runs but does not answer "
                                   f"Metadata; log {status['log_path']}")
        return {k: v for k, v in status.items() if k != "ready"}
    broker = EmbeddedBroker(data_dir, port=port, controller_port=controller_port)
    broker.start(timeout=timeout)
    state = {
        "pid": broker.pid, "bootstrap": broker.bootstrap, "port": broker.port,
        "controller_port": broker.controller_port, "log_path": str(broker.log_path),
        "data_dir": str(data_dir), "properties": str(broker.properties_path),
    }
    tmp = _state_path(data_dir).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(_state_path(data_dir))
    broker.detach()
    return state


def stop_daemon(data_dir: Path = DEFAULT_DATA_DIR, timeout: float = 20) -> bool:
    """Stop the recorded daemon broker (SIGTERM, then SIGKILL). True if one was running."""
    state = _read_state(data_dir)
    if not state:
        return False
    pid = state["pid"]
    was_running = _pid_is_broker(pid, state["properties"])
    if was_running:
        _kill_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _pid_is_broker(pid, state["properties"]):
            time.sleep(0.1)
        _kill_group(pid, signal.SIGKILL)
        try:  # reap it when the caller happens to be its parent (e.g. in tests)
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    _state_path(data_dir).unlink(missing_ok=True)
    return was_running
