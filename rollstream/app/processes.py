"""Process supervision for `rollstream run`: one subprocess per stage, its log in a file, and a
supervisor's restarts: a stage that dies is started again (same command line; it resumes from
its committed offsets and changelog state) after a backoff that doubles each time, at most
``max_restarts`` times per stage; the next death raises StageDied. A clean stop sends SIGTERM,
then SIGKILL. The current pids are kept in ``<log_dir>/../stages.json`` (fault tests and
operators find a stage's process there)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping

from rollstream.app.stages import Stage
from rollstream.exceptions import CONFIG_ERROR_EXIT, StageConfigError, StageDied

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colour codes, where a terminal's environment forces them


@contextlib.contextmanager
def stop_on_terminate() -> Iterator[None]:
    """While in the block, SIGTERM and SIGHUP raise SystemExit(128 + signal) in the main thread
    (Python's default would end the process at once), so the ``finally`` blocks that stop the
    stage processes, the inference server and the embedded broker run: a supervisor's stop, a
    closed terminal or a job scheduler's kill leaves nothing running. Outside the main thread
    (no handler can be set) it does nothing. The previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, _frame) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class StageProcesses:
    """One subprocess per stage, logs under ``log_dir``; SIGTERM on close, then SIGKILL.

    ``max_restarts``: restarts per stage before a death is fatal (0: the first death raises);
    ``backoff_s``: the wait before the first restart, doubled per later one; ``on_restart``:
    called with a line about each restart; ``cwd``: the processes' working directory (the
    trainer keeps ``runs/<name>`` there); ``env``: variables set for them beside this process's.
    ``restarts`` counts them per stage name.
    """

    def __init__(self, config_path: Path, bootstrap, log_dir: Path, max_restarts: int = 0,
                 backoff_s: float = 1.0, on_restart: Callable[[str], None] | None = None,
                 cwd: Path | None = None, env: Mapping[str, str] | None = None) -> None:
        self.config_path, self.bootstrap, self.log_dir, self.cwd = config_path, bootstrap, log_dir, cwd
        self.env = {**os.environ, **env} if env else None
        self.max_restarts, self.backoff_s, self.on_restart = max_restarts, backoff_s, on_restart
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {}
        self._commands: dict[str, list[str]] = {}
        self._due: dict[str, float] = {}  # stage name -> when its restart is due (monotonic s)

    @property
    def pid_file(self) -> Path:
        return self.log_dir.parent / "stages.json"

    def start(self, stage: Stage, *extra_args: str) -> str:
        """Start one process of ``stage`` (``extra_args`` appended to its command line, e.g.
        ``--instance 1 --instances 2``); returns its name (``aggregator``, ``aggregator-2``, ...),
        which also names its log file."""
        name, n = stage.value, 1
        while name in self.procs:
            n += 1
            name = f"{stage.value}-{n}"
        self._commands[name] = [sys.executable, "-m", "rollstream", "worker", stage.value,
                                "--config", str(self.config_path), "--bootstrap", str(self.bootstrap), *extra_args]
        self._spawn(name, "wb")
        return name

    def _spawn(self, name: str, mode: str) -> None:
        with open(self.log_dir / f"{name}.log", mode) as log:  # the child keeps its own copy
            self.procs[name] = subprocess.Popen(self._commands[name], stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True, cwd=self.cwd, env=self.env)
        tmp = self.pid_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({n: p.pid for n, p in self.procs.items()}, indent=2))
        tmp.replace(self.pid_file)

    def check(self, finished: frozenset[str] = frozenset()) -> None:
        """Restart the stages that died and whose backoff is over; raise StageDied (with the log
        tail) for one that died with its restarts spent. Stages in ``finished`` that exited 0
        ended their work (e.g. a trainer at its last batch): they are left alone."""
        now = time.monotonic()
        for name, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None or (code == 0 and name in finished):
                continue
            if code == CONFIG_ERROR_EXIT:  # bad input: a restart would fail the same way
                raise StageConfigError(f"stage {name}: {self.error_line(name)}")
            if name not in self._due:
                used = self.restarts.get(name, 0)
                if used >= self.max_restarts:
                    spent = f" after {used} restart{'s' if used != 1 else ''}" if self.max_restarts else ""
                    raise StageDied(f"stage {name} exited with {code}{spent}; log tail:\n{self.tail(name)}")
                self._due[name] = now + self.backoff_s * 2 ** used
                self._say(f"stage {name} exited with {code}; restart {used + 1} of {self.max_restarts} "
                          f"in {self.backoff_s * 2 ** used:.1f} s")
            elif now >= self._due[name]:
                del self._due[name]
                self.restarts[name] = self.restarts.get(name, 0) + 1
                with open(self.log_dir / f"{name}.log", "ab") as log:
                    log.write(f"\n---- rollstream run: restart {self.restarts[name]} of stage {name} "
                              f"(it exited with {code}) ----\n".encode())
                self._spawn(name, "ab")
                self._say(f"stage {name} restarted (pid {self.procs[name].pid})")

    def _say(self, line: str) -> None:
        if self.on_restart is not None:
            self.on_restart(line)

    def error_line(self, name: str) -> str:
        """The last ``error: ...`` line the CLI printed in stage ``name``'s log (without the
        prefix), else the log's last line."""
        text = [ANSI.sub("", line) for line in (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()]
        errors = [line.removeprefix("error: ") for line in text if line.startswith("error: ")]
        return errors[-1] if errors else (text[-1] if text else "(empty log)")

    def tail(self, name: str, lines: int = 30) -> str:
        """The last ``lines`` lines of stage ``name``'s log, without the kafka clients' INFO lines."""
        text = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join([line for line in text if " INFO kafka." not in line][-lines:])

    def close(self, timeout: float = 15.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
