"""Embedded Apache Kafka brokers (KRaft) run with plain ``java``: one node, or a cluster of
nodes on loopback, optionally with SASL/SCRAM users.

No Docker: the jars come from rollstream.kafka.jars, and each JVM runs in its own process group
so that ``stop()`` can take down everything it started. ``start_daemon``/``stop_daemon`` keep a
broker or a cluster running between commands (`rollstream broker start|stop|status`).
All timeouts are in seconds.
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Mapping, NoReturn

from rollstream.exceptions import BrokerStartError
from rollstream.kafka.admin import cluster_brokers, metadata_ready
from rollstream.kafka.cluster import Cluster
from rollstream.kafka.jars import BROKER_FILES, KAFKA_VERSION, kafka_classpath
from rollstream.kafka.jars import java as java_executable

DEFAULT_DATA_DIR = Path(".rollstream/broker")  # relative to the CWD; the CLI passes its own

BROKER_JVM_OPTS = ["-Xms512m", "-Xmx1g", "-XX:+UseG1GC"]
CLUSTER_NODE_JVM_OPTS = ["-Xms256m", "-Xmx768m", "-XX:+UseG1GC"]  # three of them share a small machine
TOOL_JVM_OPTS = ["-Xmx256m"]

SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
SASL_ADMIN_USER = "rollstream-admin"  # the brokers' own user (inter-broker traffic)
SASL_USER = "rollstream"  # the user `broker start --sasl` creates for clients

# Combined broker+controller nodes (KRaft) on loopback. Ports, ids, voters, the
# listener's security and the internal topics' replication are filled in per node.
SERVER_PROPERTIES_TEMPLATE = """\
process.roles=broker,controller
node.id={node_id}
controller.quorum.voters={voters}
listeners={listener}://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}
advertised.listeners={listener}://127.0.0.1:{port}
controller.listener.names=CONTROLLER
inter.broker.listener.name={listener}
listener.security.protocol.map=CONTROLLER:PLAINTEXT,{listener}:{listener}
log.dirs={log_dirs}
num.partitions=1
default.replication.factor={replicas}
offsets.topic.replication.factor={replicas}
offsets.topic.num.partitions=1
transaction.state.log.replication.factor={replicas}
transaction.state.log.min.isr={min_isr}
transaction.state.log.num.partitions=1
share.coordinator.state.topic.replication.factor={replicas}
share.coordinator.state.topic.min.isr={min_isr}
group.initial.rebalance.delay.ms=0
num.network.threads=2
num.io.threads=2
num.recovery.threads.per.data.dir=1
auto.create.topics.enable=true
"""

# SASL/SCRAM on the client listener; the brokers authenticate to each other as SASL_ADMIN_USER.
# The users are written into the metadata log when the storage is formatted (--add-scram).
SASL_PROPERTIES_TEMPLATE = """\
sasl.enabled.mechanisms={mechanisms}
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-256
listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="{admin}" password="{admin_password}";
listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="{admin}" password="{admin_password}";
"""


def render_server_properties(data_dir: Path, port: int, controller_port: int, node_id: int = 1,
                             voters: str | None = None, nodes: int = 1,
                             sasl_admin_password: str | None = None,
                             properties: Mapping[str, str] | None = None) -> str:
    """server.properties text for one node listening on 127.0.0.1.

    ``voters``: the quorum (``id@host:port,...``; default this node alone); ``nodes``: the
    cluster's size, which sets the internal topics' replication (min(3, nodes), min ISR 2 when
    there are 3 replicas); ``sasl_admin_password``: SASL/SCRAM on the client listener
    (SASL_PLAINTEXT), the brokers authenticating as SASL_ADMIN_USER with that password;
    ``properties``: more settings, appended (a later line wins in a properties file)."""
    log_dirs = (Path(data_dir).resolve() / "kraft").as_posix()
    replicas = min(3, nodes)
    text = SERVER_PROPERTIES_TEMPLATE.format(
        node_id=node_id, voters=voters or f"{node_id}@127.0.0.1:{controller_port}",
        listener="SASL_PLAINTEXT" if sasl_admin_password else "PLAINTEXT",
        port=port, controller_port=controller_port, log_dirs=log_dirs,
        replicas=replicas, min_isr=min(2, replicas),
    )
    if sasl_admin_password:
        text += SASL_PROPERTIES_TEMPLATE.format(mechanisms=",".join(SCRAM_MECHANISMS), admin=SASL_ADMIN_USER,
                                                admin_password=sasl_admin_password)
    return text + "".join(f"{key}={value}\n" for key, value in (properties or {}).items())


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for a server to bind a moment later; never the
    same one twice in this process.

    Picked below the kernel's ephemeral range where the system tells it (Linux): outgoing
    connections and binds to port 0 take their ports from that range, so a port picked there could
    be taken before the server binds it (three brokers dialling each other while a fourth
    listener is not bound yet: "Address already in use"). Elsewhere: a port the OS gives to a
    bind to port 0."""
    try:
        low = int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for _ in range(1000):
        port = secrets.choice(range(10_000, low)) if low > 11_000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use now
                continue
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise BrokerStartError("no free TCP port found on 127.0.0.1")


def new_cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes, URL-safe base64 without padding.

    Made in Python to save a JVM start (``StorageTool random-uuid``). Like Kafka's
    ``Uuid.randomUuid`` it never returns an id that starts with '-' (reads as a CLI flag).
    """
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid


def _allocated_bytes(folder: Path) -> int:
    """Blocks allocated by the files of ``folder``; files (or the folder) the broker deletes
    meanwhile count 0."""
    total = 0
    try:
        for entry in folder.iterdir():
            try:
                total += entry.stat().st_blocks * 512 if entry.is_file() else 0
            except OSError:
                continue
    except OSError:
        return total
    return total


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
    """One Kafka broker+controller node in a child JVM, data under ``data_dir``.

    Alone (the default) it is a single-node cluster; EmbeddedCluster makes several, giving each
    its ``node_id``, the shared ``voters`` and ``cluster_id``. ``sasl_users`` (name -> password;
    the first is the brokers' own inter-broker user) turns on SASL/SCRAM on the client listener;
    ``properties`` (an attribute) holds more server.properties settings. Ports default to free
    ones picked at ``start()`` and are kept for restarts. Files in ``data_dir``:
    ``server.properties``, ``broker.log`` (JVM stdout/stderr) and ``kraft/``.
    """

    def __init__(self, data_dir: Path, port: int | None = None,
                 controller_port: int | None = None, kafka_version: str = KAFKA_VERSION, *,
                 node_id: int = 1, voters: str | None = None, nodes: int = 1, cluster_id: str | None = None,
                 sasl_users: Mapping[str, str] | None = None, jvm_opts: list[str] | None = None):
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self.controller_port = controller_port
        self.kafka_version = kafka_version
        self.node_id, self.voters, self.nodes = node_id, voters, nodes
        self._cluster_id = cluster_id
        self.sasl_users = dict(sasl_users or {})
        self.jvm_opts = jvm_opts or BROKER_JVM_OPTS
        self.properties: dict[str, str] = {}  # more server.properties settings, written at start()
        self._proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        """``127.0.0.1:PORT`` of the client listener (port known once started)."""
        if self.port is None:
            raise BrokerStartError("broker has no port yet; call start() first")
        return f"127.0.0.1:{self.port}"

    @property
    def cluster(self) -> Cluster:
        """This node as a Cluster, with the brokers' own SASL user when SASL is on."""
        if not self.sasl_users:
            return Cluster(self.bootstrap)
        admin, password = next(iter(self.sasl_users.items()))
        return Cluster(self.bootstrap, security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-256",
                       sasl_username=admin, sasl_password=password)

    @property
    def log_path(self) -> Path:
        """The broker's combined stdout/stderr log."""
        return self.data_dir / "broker.log"

    @property
    def properties_path(self) -> Path:
        return self.data_dir / "server.properties"

    @property
    def log_dir(self) -> Path:
        """Where the broker keeps its partitions (``log.dirs``)."""
        return self.data_dir / "kraft"

    def topic_bytes(self) -> dict[str, int]:
        """Bytes on disk per topic (its partitions' folders: blocks allocated, so the sparse,
        preallocated index files count what they hold), largest first; the broker's own topics
        (``__cluster_metadata``, ``__consumer_offsets``) included."""
        sizes: dict[str, int] = {}
        for folder in self.log_dir.iterdir() if self.log_dir.is_dir() else ():
            topic, _, partition = folder.name.rpartition("-")
            if topic and partition.isdigit():
                sizes[topic] = sizes.get(topic, 0) + _allocated_bytes(folder)
        return dict(sorted(sizes.items(), key=lambda kv: -kv[1]))

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
        deadline = time.monotonic() + timeout
        self.launch(timeout)
        return self.wait_ready(deadline)

    def launch(self, timeout: float = 60) -> None:
        """Format the storage (once) and start the JVM without waiting for it to be ready."""
        if self.is_running():
            return
        java = java_executable()
        cp = kafka_classpath(self.kafka_version)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        self.controller_port = self.controller_port or free_port()
        if self.controller_port == self.port:
            self.controller_port = free_port()
        admin_password = next(iter(self.sasl_users.values())) if self.sasl_users else None
        self.properties_path.write_text(render_server_properties(
            self.data_dir, self.port, self.controller_port, self.node_id, self.voters, self.nodes, admin_password,
            self.properties))
        log4j = f"-Dlog4j.configuration=file:{BROKER_FILES / 'log4j.properties'}"
        with open(self.log_path, "ab") as log:
            self._format_storage(java, cp, log4j, log, max(timeout, 5))
            self._proc = subprocess.Popen(
                [java, *self.jvm_opts, "-cp", cp, log4j, "kafka.Kafka", str(self.properties_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.data_dir, start_new_session=True,
            )
        with _LIVE_LOCK:
            _LIVE.add(self)

    def wait_ready(self, deadline: float) -> str:
        """Wait until this node answers Metadata (until the monotonic ``deadline``)."""
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                self._fail(f"broker JVM exited with code {code}")
            if metadata_ready(self.cluster, timeout=1):
                return self.bootstrap
            time.sleep(0.25)
        self._fail("broker did not answer Metadata in time")

    def cluster_id(self) -> str:
        """The cluster id recorded in ``kraft/meta.properties``, else the one given, else new."""
        try:
            for line in (self.data_dir / "kraft" / "meta.properties").read_text().splitlines():
                key, _, value = line.partition("=")
                if key.strip() == "cluster.id" and value.strip():
                    return value.strip()
        except OSError:
            pass
        if self._cluster_id is None:
            self._cluster_id = new_cluster_id()
        return self._cluster_id

    def _format_storage(self, java, cp, log4j, log, timeout: float) -> None:
        # --ignore-formatted lets a restart keep its data, but 3.9 still checks that -t matches
        # the id already on disk, so a restart must pass the recorded id.
        cmd = [java, *TOOL_JVM_OPTS, "-cp", cp, log4j, "kafka.tools.StorageTool", "format",
               "-t", self.cluster_id(), "-c", str(self.properties_path), "--ignore-formatted"]
        for name, password in self.sasl_users.items():
            for mechanism in SCRAM_MECHANISMS:
                cmd += ["--add-scram", f"{mechanism}=[name={name},password={password}]"]
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

    def kill(self) -> None:
        """SIGKILL the JVM (a crash: nothing is flushed or handed over); ``start()`` brings the
        node back on the same ports and data."""
        if self._proc is not None and self._proc.poll() is None:
            _kill_group(self._proc.pid, signal.SIGKILL)
            self._proc.wait(10)

    def terminate(self) -> None:
        """SIGTERM the JVM's process group without waiting (``stop`` waits)."""
        if self._proc is not None and self._proc.poll() is None:
            _kill_group(self._proc.pid, signal.SIGTERM)

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM the JVM's process group, wait up to ``timeout`` s, then SIGKILL it."""
        with _LIVE_LOCK:
            _LIVE.discard(self)
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            self.terminate()
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


class EmbeddedCluster:
    """``brokers`` combined broker+controller nodes on loopback, one quorum, data under
    ``data_dir/node-<id>``; internal topics replicated min(3, brokers) times.

    ``sasl_users`` and ``properties`` as for EmbeddedBroker (the same on every node). ``nodes[i]``
    can be killed, stopped and started again on its own (failover tests).
    """

    def __init__(self, data_dir: Path, brokers: int = 3, sasl_users: Mapping[str, str] | None = None,
                 kafka_version: str = KAFKA_VERSION, properties: Mapping[str, str] | None = None):
        if brokers < 1:
            raise ValueError("a cluster needs at least one broker")
        self.data_dir = Path(data_dir).resolve()
        ports = [(free_port(), free_port()) for _ in range(brokers)]
        voters = ",".join(f"{i + 1}@127.0.0.1:{c}" for i, (_, c) in enumerate(ports))
        cluster_id = EmbeddedBroker(self.data_dir / "node-1").cluster_id()  # recorded, or new
        self.nodes = [
            EmbeddedBroker(self.data_dir / f"node-{i + 1}", port=p, controller_port=c, kafka_version=kafka_version,
                           node_id=i + 1, voters=voters, nodes=brokers, cluster_id=cluster_id, sasl_users=sasl_users,
                           jvm_opts=CLUSTER_NODE_JVM_OPTS if brokers > 1 else BROKER_JVM_OPTS)
            for i, (p, c) in enumerate(ports)
        ]
        for node in self.nodes:
            node.properties.update(properties or {})

    @property
    def bootstrap(self) -> str:
        return ",".join(node.bootstrap for node in self.nodes)

    @property
    def cluster(self) -> Cluster:
        """Every node, with the brokers' own SASL user when SASL is on."""
        first = self.nodes[0].cluster
        return Cluster(self.bootstrap, **{k: v for k, v in vars(first).items() if k != "bootstrap"})

    def start(self, timeout: float = 120) -> str:
        """Start every node (in parallel: none is ready before a quorum is), then wait until the
        cluster reports all of them. Returns the bootstrap list; BrokerStartError on failure."""
        deadline = time.monotonic() + timeout
        try:
            for node in self.nodes:
                node.launch(timeout)
            for node in self.nodes:
                node.wait_ready(deadline)
            while cluster_brokers(self.cluster, timeout=5) < len(self.nodes):
                if time.monotonic() > deadline:
                    raise BrokerStartError(f"the cluster did not report {len(self.nodes)} brokers within {timeout} s")
                time.sleep(0.5)
        except BaseException:
            self.stop(timeout=5)
            raise
        return self.bootstrap

    def stop(self, timeout: float = 20) -> None:
        """Stop every node; all are told at once, since a node whose quorum has already left
        would wait out ``timeout`` before it exits."""
        for node in self.nodes:
            node.terminate()
        for node in self.nodes:
            node.stop(timeout)

    def detach(self) -> None:
        for node in self.nodes:
            node.detach()


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


def _state_cluster(state: dict) -> Cluster:
    """The recorded daemon as a Cluster (the client user's credentials when SASL is on)."""
    sasl = state.get("sasl")
    if not sasl:
        return Cluster(state["bootstrap"])
    env = dict(line.split("=", 1) for line in Path(sasl["env_file"]).read_text().split())
    return Cluster(state["bootstrap"], security_protocol="SASL_PLAINTEXT", sasl_mechanism=sasl["mechanism"],
                   sasl_username=env["ROLLSTREAM_KAFKA_USERNAME"], sasl_password=env["ROLLSTREAM_KAFKA_PASSWORD"])


def daemon_status(data_dir: Path = DEFAULT_DATA_DIR) -> dict | None:
    """The daemon's recorded state plus ``ready`` (Metadata answers), or None if none of its
    nodes runs."""
    state = _read_state(data_dir)
    if not state:
        return None
    nodes = state.get("nodes") or [{"pid": state["pid"], "properties": state["properties"]}]
    if not any(_pid_is_broker(n["pid"], n["properties"]) for n in nodes):
        return None
    return {**state, "ready": metadata_ready(_state_cluster(state))}


def start_daemon(data_dir: Path = DEFAULT_DATA_DIR, port: int | None = None,
                 controller_port: int | None = None, timeout: float = 60, brokers: int = 1,
                 sasl: bool = False) -> dict:
    """Start a broker (``brokers`` > 1: a cluster of that many nodes) that outlives this
    process; record it in ``<data_dir>/broker.json``. ``sasl``: SASL/SCRAM on the client
    listener, with a client user whose name and password are written to ``<data_dir>/sasl.env``
    (``ROLLSTREAM_KAFKA_USERNAME=...``, ``ROLLSTREAM_KAFKA_PASSWORD=...``, mode 0600).

    If the recorded broker is already running, wait for it to be ready and return its state.
    Returns a dict: pid, bootstrap, port, controller_port, log_path, data_dir, properties,
    nodes (pid and properties of each node), sasl (mechanism and env_file, or None).
    """
    data_dir = Path(data_dir).resolve()
    status = daemon_status(data_dir)
    if status is not None:
        deadline = time.monotonic() + timeout
        while not status["ready"] and time.monotonic() < deadline:
            time.sleep(0.25)
            status = {**status, "ready": metadata_ready(_state_cluster(status))}
        if not status["ready"]:
            raise BrokerStartError(f"broker pid {status['pid']} runs but does not answer "
                                   f"Metadata; log {status['log_path']}")
        return {k: v for k, v in status.items() if k != "ready"}
    data_dir.mkdir(parents=True, exist_ok=True)
    users, sasl_state = None, None
    if sasl:
        env_file = data_dir / "sasl.env"
        if env_file.exists():  # a restart: the users are already in the formatted storage
            env = dict(line.split("=", 1) for line in env_file.read_text().split())
            users = {SASL_ADMIN_USER: env["ROLLSTREAM_KAFKA_ADMIN_PASSWORD"],
                     env["ROLLSTREAM_KAFKA_USERNAME"]: env["ROLLSTREAM_KAFKA_PASSWORD"]}
        else:
            users = {SASL_ADMIN_USER: secrets.token_urlsafe(18), SASL_USER: secrets.token_urlsafe(18)}
            env_file.touch(mode=0o600)
            env_file.write_text(f"ROLLSTREAM_KAFKA_USERNAME={SASL_USER}\nROLLSTREAM_KAFKA_PASSWORD={users[SASL_USER]}\n"
                                f"ROLLSTREAM_KAFKA_ADMIN_PASSWORD={users[SASL_ADMIN_USER]}\n")
        sasl_state = {"mechanism": "SCRAM-SHA-256", "env_file": str(env_file)}
    if brokers == 1:
        one = EmbeddedBroker(data_dir, port=port, controller_port=controller_port, sasl_users=users)
        one.start(timeout=timeout)
        nodes = [one]
    else:
        cluster = EmbeddedCluster(data_dir, brokers, sasl_users=users)
        cluster.start(timeout=max(timeout, 120))
        nodes = cluster.nodes
    first = nodes[0]
    state = {
        "pid": first.pid, "bootstrap": ",".join(n.bootstrap for n in nodes), "port": first.port,
        "controller_port": first.controller_port, "log_path": str(first.log_path),
        "data_dir": str(data_dir), "properties": str(first.properties_path),
        "nodes": [{"pid": n.pid, "properties": str(n.properties_path), "log_path": str(n.log_path)} for n in nodes],
        "sasl": sasl_state,
    }
    tmp = _state_path(data_dir).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(_state_path(data_dir))
    for node in nodes:
        node.detach()
    return state


def stop_daemon(data_dir: Path = DEFAULT_DATA_DIR, timeout: float = 20) -> bool:
    """Stop the recorded daemon's nodes (SIGTERM, then SIGKILL). True if one was running."""
    state = _read_state(data_dir)
    if not state:
        return False
    nodes = state.get("nodes") or [{"pid": state["pid"], "properties": state["properties"]}]
    running = [n for n in nodes if _pid_is_broker(n["pid"], n["properties"])]
    for node in running:
        _kill_group(node["pid"], signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_pid_is_broker(n["pid"], n["properties"]) for n in running):
        time.sleep(0.1)
    for node in running:
        _kill_group(node["pid"], signal.SIGKILL)
        try:  # reap it when the caller happens to be its parent (e.g. in tests)
            os.waitpid(node["pid"], 0)
        except ChildProcessError:
            pass
    _state_path(data_dir).unlink(missing_ok=True)
    return bool(running)
