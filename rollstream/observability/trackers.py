"""Experiment trackers: the trainer's figures in TensorBoard, Weights & Biases, MLflow or on the
console (``trainer.loggers``).

Names are those of ``METRICS`` (rollstream.observability.metrics), a metric's labels other than
its x axis (``step``, ``policy_version``) appended as path parts (``trainer/pass_rate/<check>``,
``run/groups_rejected/<reason>``, ``validation/pass_at_k/<k>``), every character outside
``[A-Za-z0-9_./-]`` written ``_`` (MLflow refuses ``@``). The x axis is the global step, the steps
committed so far:

* once, at the start: the run name and the resolved config (TensorBoard: two text summaries;
  wandb: the run's name and config; MLflow: the run's name and the config as parameters, keys
  flattened with dots);
* after each committed step ``s``, at ``s + 1`` (the policy version the step made): the step's
  figures, the ``Metric`` records ``step_metrics`` makes of its manifest entry (loss, reward,
  grad norm, correction masks, ratio/diff means, fill time, policy lag, ...);
* then, read from the run's topics in the background: the run summary's figures so far
  (``run/...``) at the newest step, and each validation round's figures (``validation/...``) at
  its policy version, again whenever they changed;
* at the end of `rollstream run`: the summary's own figures, the last point of each series.

Failures never stop training: each tracker runs on a thread of its own (a slow or hung one
delays no step and no other tracker); its first exception (no network, bad credentials, its
library's own error) is logged as one warning and the tracker logs nothing more this run. A
failed read of the topics likewise ends only the ``run/`` and ``validation/`` figures. A tracker
whose package is not installed is a ConfigError before anything starts (``check_installed``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import queue
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import yaml

from rollstream.exceptions import ConfigError
from rollstream.extensions import LOGGERS
from rollstream.observability.metrics import check_name

log = logging.getLogger(__name__)


AXIS_LABELS = ("step", "policy_version")
"""Labels that are a figure's x axis, not part of its name."""

GLOBAL_STEP = check_name("global_step")
"""wandb's column of the x axis (a METRICS name)."""

CLOSE_TIMEOUT_S = 120.0
"""How long ``Trackers.close`` waits in all for the trackers' last writes."""

PARAM_MAX_CHARS = 6000
"""MLflow's longest parameter value; a longer config value is cut there."""

_UNSAFE = re.compile(r"[^A-Za-z0-9_./-]")


# -- names and values: pure ----------------------------------------------------------------------

def tracker_key(name: str, labels: Mapping[str, str] | None = None) -> str:
    """The name a tracker logs metric ``name`` under, with ``labels``' values (bar the x axis's)
    as path parts in their order (module doc). Raises KeyError when METRICS lacks ``name``."""
    parts = [check_name(name), *(str(v) for k, v in (labels or {}).items() if k not in AXIS_LABELS and str(v))]
    return _UNSAFE.sub("_", "/".join(parts))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def step_values(records: Iterable[Mapping]) -> dict[str, float]:
    """``{name: value}`` of one step's ``Metric`` records (``step_metrics``)."""
    return {tracker_key(r["name"], r["labels"]): float(r["value"]) for r in records}


def summary_values(summary: Mapping) -> dict[str, float]:
    """The ``run/...`` figures of a run summary (rollstream.tools.summary, RLVR or agentic, final
    or so far): groups accepted, rejected by reason (``screened_out`` among them), retention rate,
    responses per accepted response, the share of zero-variance groups and of the generated
    tokens trained on (``difficulty``); a figure the summary lacks or has as null is left out."""
    out = {tracker_key("run/groups_rejected", {"reason": reason}): float(n)
           for reason, n in summary.get("groups_rejected", {}).items()}
    difficulty = summary.get("difficulty") or {}
    figures = [(k, summary.get(k)) for k in ("groups_accepted", "retention_rate", "responses_per_accepted_response")]
    figures += [(k, difficulty.get(k)) for k in ("zero_variance_share", "share_of_tokens_trained_on")]
    for key, value in figures:
        if _finite(value):
            out[tracker_key(f"run/{key}")] = float(value)
    return out


def validation_values(summary: Mapping) -> dict[int, dict[str, float]]:
    """Policy version -> the ``validation/...`` figures of its round (accuracy, mean reward,
    pass@k) from a summary's ``validation.by_policy_version`` (RLVR; an agentic summary has none).
    Null figures are left out."""
    out: dict[int, dict[str, float]] = {}
    for version, row in summary.get("validation", {}).get("by_policy_version", {}).items():
        values = {tracker_key(f"validation/{k}"): float(row[k]) for k in ("accuracy", "reward_mean")
                  if _finite(row.get(k))}
        values.update({tracker_key("validation/pass_at_k", {"k": k.removeprefix("pass@")}): float(v)
                       for k, v in row.items() if k.startswith("pass@") and _finite(v)})
        if values:
            out[int(version)] = values
    return out


def flat_params(config: Mapping, prefix: str = "") -> dict[str, str]:
    """A nested config as ``{"actor_train.lr": "1e-06", ...}``: mapping keys joined with dots
    (characters MLflow refuses written ``_``), a string as itself, any other leaf (numbers, booleans,
    null, lists) as JSON, cut at PARAM_MAX_CHARS."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = _UNSAFE.sub("_", f"{prefix}{key}")
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{name}."))
        else:
            out[name] = (value if isinstance(value, str) else json.dumps(value))[:PARAM_MAX_CHARS]
    return out


def check_installed(loggers: Iterable[str]) -> None:
    """Raises ConfigError (one line naming ``trainer.loggers``) for a tracker whose package
    (its class's ``package``) is not installed, or a name that is not a tracker class
    (rollstream.extensions.LOGGERS); imports no tracker library."""
    for name in loggers:
        module = getattr(LOGGERS.get_named(name), "package", None)
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(f"trainer.loggers: {name} needs the {module} package, which is not installed: "
                              f"pip install 'rollstream[{name}]'")


# -- the trackers --------------------------------------------------------------------------------

class Tracker(Protocol):
    """One experiment tracker, built as ``Class(project, log_dir)`` (``trainer.project``, the run's
    ``trainer.log_dir``); its methods are called from one thread, in order. A class may name the
    module it needs as ``package`` (checked before the run starts)."""

    name: str

    def start(self, run_name: str, config: Mapping[str, Any]) -> None:
        """Open the run ``run_name`` and record ``config`` (the resolved config, JSON-able)."""

    def log(self, values: Mapping[str, float], step: int) -> None:
        """Record ``values`` (name -> finite float) at global step ``step`` (>= 0; may repeat or
        go back: a validation round is logged at its policy version)."""

    def close(self) -> None:
        """Write what is buffered and end the run."""


class ConsoleTracker:
    """One line per call on standard error (``rollstream run``'s progress bar prints it above
    itself)."""

    name = "console"

    def __init__(self, project: str = "", log_dir: Path | None = None) -> None:
        pass

    def start(self, run_name: str, config: Mapping[str, Any]) -> None:
        self._print(f"run {run_name}, config {json.dumps(config, separators=(',', ':'))}")

    def log(self, values: Mapping[str, float], step: int) -> None:
        self._print(f"step {step}: " + " ".join(f"{k}={v:.6g}" for k, v in sorted(values.items())))

    def close(self) -> None:
        sys.stderr.flush()

    @staticmethod
    def _print(line: str) -> None:
        print(f"tracker: {line}", file=sys.stderr, flush=True)


class TensorBoardTracker:
    """Event files under ``log_dir``/tensorboard (tensorboardX's SummaryWriter: no torch); the run
    name and the config as YAML are text summaries ``run_name`` and ``config`` at step 0."""

    name = "tensorboard"
    package = "tensorboardX"

    def __init__(self, project: str, log_dir: Path) -> None:
        self.log_dir = Path(log_dir) / "tensorboard"
        self._writer = None

    def start(self, run_name: str, config: Mapping[str, Any]) -> None:
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(logdir=str(self.log_dir))
        self._writer.add_text("run_name", run_name, 0)
        as_yaml = yaml.safe_dump(dict(config), sort_keys=False)
        self._writer.add_text("config", "".join(f"    {line}\n" for line in as_yaml.splitlines()), 0)  # a code block

    def log(self, values: Mapping[str, float], step: int) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()  # visible to a running TensorBoard at once

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class WandbTracker:
    """A wandb run in ``project`` (its local folder under ``log_dir``/wandb; ``WANDB_MODE``,
    ``WANDB_API_KEY``, ``WANDB_ENTITY`` as wandb reads them). Every row carries ``global_step``,
    the x axis of every chart, so a validation round logged late still lands at its version; the
    console is not captured."""

    name = "wandb"
    package = "wandb"

    def __init__(self, project: str, log_dir: Path) -> None:
        self.project, self.log_dir = project, Path(log_dir)
        self._run = None

    def start(self, run_name: str, config: Mapping[str, Any]) -> None:
        import wandb

        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=self.project, name=run_name, config=dict(config), dir=str(self.log_dir),
                               settings=wandb.Settings(console="off"))
        self._run.define_metric(GLOBAL_STEP)
        self._run.define_metric("*", step_metric=GLOBAL_STEP, step_sync=True)

    def log(self, values: Mapping[str, float], step: int) -> None:
        self._run.log({**values, GLOBAL_STEP: step})

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()


class MlflowTracker:
    """An MLflow run in experiment ``project`` at ``MLFLOW_TRACKING_URI``, else in a file store
    at ``log_dir``/mlruns (for which it sets ``MLFLOW_ALLOW_FILE_STORE=true`` unless set: MLflow 3 asks
    for it). MlflowClient keeps the run and the URI to itself: no process-wide active run, no
    tracking URI written to the environment."""

    name = "mlflow"
    package = "mlflow"

    def __init__(self, project: str, log_dir: Path) -> None:
        self.experiment, self.store = project, Path(log_dir) / "mlruns"
        self._client = None
        self._run_id = ""

    def start(self, run_name: str, config: Mapping[str, Any]) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri = os.environ.get("MLFLOW_TRACKING_URI") or None
        if uri is None:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = self.store.absolute().as_uri()
        self._client = client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found is not None else client.create_experiment(self.experiment)
        self._run_id = client.create_run(experiment_id, run_name=run_name).info.run_id
        client.log_batch(self._run_id, params=[Param(k, v) for k, v in flat_params(config).items()])

    def log(self, values: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self._run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self) -> None:
        if self._client is not None and self._run_id:
            self._client.set_terminated(self._run_id)


def make_tracker(name: str, project: str, log_dir: Path) -> Tracker:
    """The tracker ``name`` (a ``trainer.loggers`` value: rollstream.extensions.LOGGERS or an
    import path) writing under ``log_dir``. Raises ConfigError as ``Registry.get_named``."""
    return LOGGERS.get_named(name)(project, log_dir)


# -- the fan-out ---------------------------------------------------------------------------------

class SummarySource(Protocol):
    """The run summary so far (rollstream.tools.summary.LiveSummary), called from one thread."""

    def __call__(self) -> Mapping: ...

    def close(self) -> None: ...


def _close(tracker: Tracker) -> None:
    tracker.close()


class _Worker:
    """One tracker on a daemon thread of its own: calls run in order; the first that raises is
    one warning and the tracker logs nothing more (its ``close`` is still tried, quietly)."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.failed = False
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"tracker-{tracker.name}", daemon=True)
        self._thread.start()

    def put(self, call: Callable[[Tracker], None]) -> None:
        self._calls.put(call)

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            if self.failed and call is not _close:
                continue
            try:
                call(self.tracker)
            except Exception as exc:
                if not self.failed:
                    log.warning("tracker %s failed and logs nothing more this run (training goes on): %r",
                                self.tracker.name, exc)
                self.failed = True

    def finish(self) -> None:
        """Close the tracker after the calls queued, then end the thread."""
        self._calls.put(_close)
        self._calls.put(None)

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the thread's end; False when it goes on."""
        self._thread.join(max(timeout_s, 0.0))
        return not self._thread.is_alive()


class Trackers:
    """The trackers of one trainer process (module doc), fed by ``log_step`` after each commit
    (PolicyPublisher.publish_step, on this process's ``process_trackers()``).

    Args:
        trackers: the trackers; none: every call does nothing and no thread starts.
        summary: the run summary so far, read on a thread of its own after each step (at most
            one read at a time: steps that commit meanwhile share the next); None: no ``run/`` or
            ``validation/`` figures until ``close(summary)``.
    """

    def __init__(self, trackers: Sequence[Tracker] = (), summary: SummarySource | None = None) -> None:
        self._workers = [_Worker(t) for t in trackers]
        self._summary = summary if self._workers else None
        self._step = 0  # the global step: steps committed
        self._summarized = 0  # the global step the newest summary read was taken at
        self._validation: dict[int, dict[str, float]] = {}  # validation figures logged, by version
        self._lock = threading.Lock()
        self._due = threading.Event()
        self._closing = self._superseded = False
        self._reader = None
        if self._summary is not None:
            self._reader = threading.Thread(target=self._read_summaries, name="tracker-summary", daemon=True)
            self._reader.start()

    @classmethod
    def of(cls, loggers: Sequence[str], project: str, log_dir: str | os.PathLike,
           summary: SummarySource | None = None) -> "Trackers":
        """The trackers ``loggers`` names (``trainer.loggers``), in ``project`` (``trainer.project``),
        writing under ``log_dir``. Raises ConfigError when a tracker's package is not installed."""
        check_installed(loggers)
        return cls([make_tracker(name, project, Path(log_dir)) for name in loggers], summary)

    @property
    def names(self) -> list[str]:
        """The trackers' names, in order."""
        return [w.tracker.name for w in self._workers]

    def start(self, run_name: str, config: Mapping[str, Any]) -> "Trackers":
        """Open every tracker's run: its name and the resolved ``config`` (JSON-able), once."""
        for worker in self._workers:
            worker.put(lambda t: t.start(run_name, config))
        return self

    def log_step(self, step: int, records: Sequence[Mapping]) -> None:
        """A committed step's ``Metric`` records (``step_metrics``), logged at ``step + 1``; then
        the summary is due. Returns at once (the trackers write on their threads)."""
        if not self._workers:
            return
        with self._lock:
            self._step = max(self._step, step + 1)
            self._log(step_values(records), step + 1)
        self._due.set()

    def _log(self, values: Mapping[str, float], step: int) -> None:
        if values:
            for worker in self._workers:
                worker.put(lambda t, v=dict(values): t.log(v, step))

    def _log_summary(self, summary: Mapping, step: int) -> None:
        """The summary's run figures at ``step``, and each validation round whose figures changed
        (a round fills while its groups are decided) at its version."""
        with self._lock:
            self._log(summary_values(summary), step)
            for version, values in validation_values(summary).items():
                if self._validation.get(version) != values:
                    self._validation[version] = values
                    self._log(values, version)

    def _read_summaries(self) -> None:
        try:
            while not self._superseded:
                self._due.wait()
                self._due.clear()
                step = self._step
                if step > self._summarized and not self._superseded:
                    summary = self._summary()
                    self._summarized = step
                    if not self._superseded:
                        self._log_summary(summary, step)
                if self._closing:
                    break
        except Exception as exc:
            log.warning("reading the run's figures for the trackers failed; no more run/ or validation/ "
                        "figures until the end (training goes on): %r", exc)
        finally:
            try:
                self._summary.close()
            except Exception:
                log.debug("closing the summary reader", exc_info=True)

    def install(self) -> "Trackers":
        """Make these this process's trackers (``process_trackers()``) until ``close``."""
        global _PROCESS
        _PROCESS = self
        return self

    def close(self, summary: Mapping | None = None, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """End the run: stop the summary reads (after one still due, unless ``summary`` is given),
        log ``summary`` (the run's final one) at the last step, then close every tracker. Waits up
        to ``timeout_s`` in all; a tracker not done by then is left to finish on its daemon
        thread, with a warning. Uninstalls them from the process."""
        global _PROCESS
        if _PROCESS is self:
            _PROCESS = Trackers()
        deadline = time.monotonic() + timeout_s
        self._closing, self._superseded = True, summary is not None
        self._due.set()
        if self._reader is not None:
            self._reader.join(timeout_s)
        if summary is not None and self._workers:
            self._log_summary(summary, self._step)
        for worker in self._workers:
            worker.finish()
        late = [w.tracker.name for w in self._workers if not w.join(deadline - time.monotonic())]
        if late:
            log.warning("trackers %s did not finish writing within %g s; they go on in the background", late,
                        timeout_s)


_PROCESS = Trackers()


def process_trackers() -> Trackers:
    """This process's trackers (``Trackers.install``); without any, one that logs nothing."""
    return _PROCESS
