"""The broker's jars: resolved once with Maven from ``broker_files/pom.xml`` into
``~/.cache/rollstream/kafka/<version>/lib`` (or taken from ``$KAFKA_HOME/libs``), and the JVM
that runs them. No Docker, no download outside Maven Central."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

from rollstream.exceptions import BrokerStartError

KAFKA_VERSION = "3.9.2"
BROKER_FILES = Path(__file__).resolve().parent / "broker_files"


def require_tool(tool: str, hint: str) -> str:
    """The path of ``tool`` on PATH; BrokerStartError naming ``hint`` when missing."""
    path = shutil.which(tool)
    if path is None:
        raise BrokerStartError(f"`{tool}` was not found on PATH; {hint}")
    return path


def java() -> str:
    """The ``java`` executable; BrokerStartError with an install hint when missing."""
    return require_tool(
        "java", "install a Java 17+ runtime (e.g. `apt-get install openjdk-17-jre-headless`)"
    )


def kafka_lib_dir(kafka_version: str = KAFKA_VERSION) -> Path:
    """Where the Maven-resolved jars for ``kafka_version`` live (whether or not resolved yet)."""
    return jar_cache(f"kafka/{kafka_version}")


def jar_cache(name: str) -> Path:
    """``~/.cache/rollstream/<name>/lib``: where resolve_jars puts one pom's jars."""
    return Path.home() / ".cache" / "rollstream" / name / "lib"


def ensure_kafka_libs(kafka_version: str = KAFKA_VERSION, timeout: float = 600) -> Path:
    """Return the directory holding the broker's jars, resolving them with Maven if needed."""
    return resolve_jars(BROKER_FILES / "pom.xml", f"kafka/{kafka_version}", {"kafka.version": kafka_version},
                        marker="kafka_2.13-*.jar", timeout=timeout)


def resolve_jars(pom: Path, name: str, properties: dict[str, str], *, marker: str, timeout: float = 600) -> Path:
    """The runtime jars of ``pom`` (with ``-D`` ``properties``) in ``jar_cache(name)``, resolved
    with Maven once; ``marker`` is a glob that only a complete resolution contains.

    Tries Maven offline first (fast when ~/.m2 is warm), then online. Jars go to a temporary
    directory that is renamed into place, so a half-finished resolution is never used and two
    processes resolving at once do not corrupt each other. Raises BrokerStartError when Maven is
    missing or fails.
    """
    lib = jar_cache(name)
    if lib.is_dir() and any(lib.glob(marker)):
        return lib
    mvn = require_tool("mvn", "install Maven 3.8+ (e.g. `apt-get install maven`) or set KAFKA_HOME")
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.parent / f"lib.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    base = [mvn, "-q", "-B", "-f", str(pom), *(f"-D{k}={v}" for k, v in properties.items()),
            "dependency:copy-dependencies", "-DincludeScope=runtime", f"-DoutputDirectory={tmp}"]
    errors = []
    try:
        for extra in (["-o"], []):
            try:
                res = subprocess.run(base + extra, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                errors.append(f"mvn {' '.join(extra)} timed out after {timeout} s")
                continue
            if res.returncode == 0 and any(tmp.glob(marker)):
                try:
                    tmp.rename(lib)
                except OSError:  # another process won the race; its copy is as good
                    if not lib.is_dir():
                        raise
                return lib
            errors.append((res.stdout + res.stderr)[-2000:])
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    raise BrokerStartError(f"could not resolve the jars of {pom} with Maven (offline, then online):\n"
                           + "\n---\n".join(errors))


def kafka_classpath(kafka_version: str = KAFKA_VERSION) -> str:
    """The JVM classpath: ``$KAFKA_HOME/libs/*`` if KAFKA_HOME is set, else the Maven cache."""
    home = os.environ.get("KAFKA_HOME")
    if home:
        libs = Path(home) / "libs"
        if not libs.is_dir():
            raise BrokerStartError(f"KAFKA_HOME={home} has no libs/ directory")
        return f"{libs}/*"
    return f"{ensure_kafka_libs(kafka_version)}/*"
