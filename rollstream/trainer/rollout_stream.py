"""Train on rollstream's accepted groups from your own training loop (TRL, verl, plain torch).

``RolloutStream`` is an iterator of padded batches of torch tensors, exactly once::

    from rollstream.trainer import RolloutStream

    with RolloutStream("localhost:9092", "runs/mine", groups_per_batch=8, max_steps=100,
                       adv_estimator="rloo") as stream:
        for batch in stream:
            loss = my_loss(model, batch.input_ids, batch.attention_mask, batch.response_mask,
                           batch.advantages, batch.infer_logprobs)
            loss.backward(); optimizer.step(); optimizer.zero_grad()
            model.save_pretrained(path := f"runs/mine/ckpt/v{batch.step + 1}")
            batch.commit(checkpoint=path)
    print(stream.result.outcome)

The contract:

- **One trainer per run.** The stream takes the place of rollstream's own trainer: start the
  pipeline's other stages with ``rollstream worker <stage>`` (RLVR: admission, aggregator,
  generation, reward), not with ``rollstream run`` or ``rollstream worker trainer``, whose
  trainer would consume the same groups under the same consumer group.
- **Exactly once.** A batch is done when ``batch.commit()`` returns: its manifest line
  (``<run_dir>/batches.jsonl``) is written, its ``Batch`` event published and the offsets of its
  groups committed. A batch not committed (a crash, a ``break``, an exception) is delivered again,
  the same groups in the same order, by the next stream with the same ``run_dir`` and group id.
  Commit each batch before taking the next. If your checkpoint can be written and the process
  die before ``commit``, save ``batch.trainer_state`` with the checkpoint and pass it back as
  ``resume=`` on restart: that batch is then recorded as trained instead of redelivered.
- **A checkpoint written while the next step trains** (one process, no ranks):
  ``batch.commit(checkpoint=path, durable=future)`` with a Future that completes once the
  folder is durable. The stream publishes the version from the writer's thread as soon as the
  Future completes, and commits the batch then (between polls) or at the latest before the next
  commit; meanwhile the next batch may be taken. Call ``stream.settle()`` (commit the held
  batch, waiting for its Future) before starting the next checkpoint's write, so that at most
  the newest checkpoint is ever uncommitted: the one ``resume=`` recovers.
- **Policy versions.** After each commit a ``PolicyVersion`` is published on
  ``policy.versions``: version ``step + 1`` naming the checkpoint folder you passed (a Hugging
  Face model folder, ``save_pretrained``, on a filesystem the generation workers see; they load
  it by path). Without ``checkpoint`` the version is published untrained (workers keep the
  weights they have). At start the stream republishes the version of the last committed batch.
- **The end of a run**, as ``rollstream run``'s own trainer: ``max_steps`` batches in total
  (a restarted run's earlier ones included); an ``underfilled`` verdict ships the accepted groups
  as a partial batch when ``accepted / target >= min_fill_ratio``, else the iteration stops with
  outcome ``batch_underfilled``; an ``end_of_data`` verdict ships the accepted rest as a final
  partial batch (``batch.end_of_data`` True) when the ratio allows, then stops with outcome
  ``end_of_data``. ``stream.result`` (a ``LoopResult``) says how it ended, counts the committed
  batches and holds the last manifest entry (the run's manifest holds them all).
- **Data-parallel ranks** (``torch.distributed`` initialised, e.g. under ``torchrun``): create the
  stream on every rank with the same arguments. Rank 0 alone connects to Kafka; each batch is cut
  by whole groups into one shard per rank (sizes differing by at most one group; a rank may get
  an empty shard, ``batch.num_rows == 0``, and must still join your collectives) and every rank
  iterates in lockstep. Call ``batch.commit(...)`` on every rank: after a barrier, rank 0 commits
  and publishes (its ``checkpoint`` and ``report`` count). See rollstream.trainer.distributed for
  summing gradients so that they equal the single-process gradient.

The tensors of a ``StreamBatch`` (``b`` = this rank's rows, one per response; ``P`` prompt
columns, ``T`` response columns; all on the CPU until ``to(device)``):

==================  ==============  ======================================================
``input_ids``       (b, P+T) int64  left-padded prompt, then the right-padded response
``attention_mask``  (b, P+T) int64  1 on real tokens (prompt and response)
``position_ids``    (b, P+T) int64  ``cumsum(attention_mask) - 1`` (left padding not counted)
``response_ids``    (b, T) int64    the response alone; token t is ``input_ids[:, P + t]``
``response_mask``   (b, T) float32  1 = trained (model) token; 0 = padding, environment token
``infer_logprobs``  (b, T) float32  log p of each response token when generated, 0 at padding
``advantages``      (b, T) float32  the row's advantage (``adv_estimator``) on trained tokens
``rewards``         (b,) float32    each response's scalar reward
``group_index``     (b,) int64      the row's group in ``shard_group_keys``
==================  ==============  ======================================================

``batch.log_probs(model)`` gives ``(b, T) float32`` log p of the response tokens under ``model``
(the "old" log-probs of a PPO-style ratio, or with ``grad=True`` the new ones), read at
``P - 1 + t``; ``batch.rollout`` is the underlying ``RolloutBatch`` (extras such as
``routed_experts`` included).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

import torch
from torch import Tensor

from rollstream.kafka import names
from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.topics import DEFAULT_PREFIX, Topics
from rollstream.runtime import PAYLOAD_MAX_MESSAGE_BYTES
from rollstream.trainer.batch import RolloutBatch
from rollstream.trainer.batch_builder import BatchBuilder
from rollstream.trainer.distributed import Ranks, shard_batch
from rollstream.trainer.logprobs import response_log_probs
from rollstream.trainer.loop import BatchLoop, LoopControl, LoopResult
from rollstream.trainer.publisher import PolicyPublisher, version_of
from rollstream.trainer.retention import PayloadRetention
from rollstream.trainer.verdicts import AgenticBatchEvents, BatchEvents

log = logging.getLogger(__name__)


@dataclass(eq=False)
class StreamBatch:
    """One training step's batch on this rank (see the module doc for the tensors).

    Attributes:
        rollout: this rank's rows as a ``RolloutBatch`` (the whole batch with one rank).
        step: the training step (0-based, counted over restarts).
        end_of_data: True for the final partial batch of the data.
        group_keys: every group key of the whole batch, in batch order (all ranks).
        policy_versions: the generating policy version of every row of the whole batch.
        target_groups: groups a full batch has (``groups_per_batch``); fewer = a partial batch.
        rank, world_size: this process's place among the training ranks.
    """

    rollout: RolloutBatch
    step: int
    end_of_data: bool
    group_keys: list[str]
    policy_versions: list[int]
    target_groups: int
    rank: int = 0
    world_size: int = 1
    _stream: "RolloutStream | None" = field(default=None, repr=False)

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self.rollout.prompt_ids, self.rollout.response_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.rollout.prompt_mask, self.rollout.response_attention_mask], dim=1)

    @property
    def position_ids(self) -> Tensor:
        return (self.attention_mask.cumsum(dim=1) - 1).clamp(min=0)

    @property
    def prompt_length(self) -> int:
        """P, the prompt columns of ``input_ids``."""
        return int(self.rollout.prompt_ids.shape[1])

    @property
    def response_ids(self) -> Tensor:
        return self.rollout.response_ids

    @property
    def response_mask(self) -> Tensor:
        return self.rollout.response_mask

    @property
    def infer_logprobs(self) -> Tensor:
        return self.rollout.infer_logprobs

    @property
    def advantages(self) -> Tensor:
        return self.rollout.advantages

    @property
    def rewards(self) -> Tensor:
        return self.rollout.response_level_rewards

    @property
    def group_index(self) -> Tensor:
        return self.rollout.group_index

    @property
    def shard_group_keys(self) -> list[str]:
        """This rank's group keys (``group_index`` points into them)."""
        return self.rollout.group_keys

    @property
    def num_rows(self) -> int:
        """b, this rank's rows (0 for an empty shard)."""
        return self.rollout.batch_size

    @property
    def num_groups(self) -> int:
        """Groups in the whole batch."""
        return len(self.group_keys)

    @property
    def trainer_state(self) -> dict:
        """``{"step", "group_keys"}`` of the whole batch, JSON-able: save it with the checkpoint
        of this batch and pass it (with ``"checkpoint"``: the folder) as ``resume=`` when
        restarting, so a batch checkpointed but not committed is not trained again."""
        return {"step": self.step, "group_keys": list(self.group_keys)}

    def log_probs(self, model: torch.nn.Module, micro_batch_size: int = 8, grad: bool = False) -> Tensor:
        """``(b, T) float32`` log p of each response token under ``model`` (a transformers causal
        LM), on the model's device; 0 at padding. ``grad``: keep the graph (the loss's)."""
        return response_log_probs(model, self.rollout, micro_batch_size=micro_batch_size, grad=grad)

    def to(self, device: torch.device | str) -> "StreamBatch":
        """A copy with every tensor on ``device``; ``commit`` it like the original."""
        return replace(self, rollout=self.rollout.to(device))

    def commit(self, checkpoint: str | os.PathLike | None = None, report: Mapping | None = None, *,
               durable: Future | None = None) -> dict | None:
        """Confirm this batch was trained; call on every rank (see the module doc).

        Args:
            checkpoint: the folder of the weights this batch produced (a Hugging Face model
                folder), published as policy version ``step + 1``; None: none published.
            report: JSON-able figures of your step (loss, ...) joined to the manifest entry.
            durable: a Future that completes once ``checkpoint`` (or ``report["checkpoint"]``)
                is written and durable; the commit then waits for it, off the caller's path
                (module doc). One process only.

        Returns:
            The manifest entry (``step``, ``status``, ``group_keys``, ``offsets``, ...; see
            ``BatchBuilder.commit``), the same on every rank; None with ``durable`` (the entry
            becomes ``stream.result.last`` once committed).

        Raises:
            ValueError: the batch is not the stream's current one (committed already),
                ``checkpoint`` is not a folder, or ``durable`` under several ranks.
        """
        if self._stream is None:
            raise ValueError(f"step {self.step} does not belong to a stream")
        if durable is not None:
            return self._stream._hold(self, checkpoint, report, durable)
        return self._stream._commit(self, checkpoint, report)


@dataclass(frozen=True)
class StreamSettings:
    """What a RolloutStream builds its batches by (``StreamSettings.of(config)``: a pipeline
    config's).

    Attributes:
        groups_per_batch: groups (prompts) per batch.
        max_steps: batches in total, then the iteration stops (outcome ``complete``).
        topic_prefix: the run's topic prefix (``kafka.topic_prefix``).
        min_fill_ratio: a verdict's partial batch ships if accepted/target >= this.
        adv_estimator: ``grpo``, ``dr_grpo`` or ``rloo`` (rollstream.trainer.batch.group_advantages).
        max_staleness: policy versions a group may lag the step that trains it; None: unbounded.
        pad_token_id: written at padded positions of the id tensors (masked everywhere).
        group_id: the consumer group holding the committed offsets; default the run's trainer
            group (``<prefix>trainer``), so do not run rollstream's own trainer beside it.
        max_message_bytes: the largest payload event (``kafka.max_message_bytes``).
        batch_timeout_s: see rollstream.trainer.loop.BatchLoop.
        payload_retention: how the trainer deletes the payloads no group needs any more
            (rollstream.trainer.retention.PayloadRetention; by default each kept at least 7
            days, the default timeouts' completion bound); None: it deletes none (the payload
            topics' own ``retention.ms`` is -1: they then grow without bound).
    """

    groups_per_batch: int
    max_steps: int
    topic_prefix: str = DEFAULT_PREFIX
    min_fill_ratio: float = 1.0
    adv_estimator: str = "grpo"
    max_staleness: int | None = None
    pad_token_id: int = 0
    group_id: str | None = None
    max_message_bytes: int = PAYLOAD_MAX_MESSAGE_BYTES
    batch_timeout_s: float | None = None
    payload_retention: PayloadRetention | None = PayloadRetention()

    @classmethod
    def of(cls, config, **overrides) -> "StreamSettings":
        """The settings of a pipeline config (RLVR or agentic), ``overrides`` by field name."""
        return cls(**{"groups_per_batch": config.groups_per_batch, "max_steps": config.max_steps,
                      "topic_prefix": config.kafka.topic_prefix, "min_fill_ratio": config.min_fill_ratio,
                      "adv_estimator": config.adv_estimator, "max_staleness": config.max_staleness,
                      "max_message_bytes": config.kafka.max_message_bytes,
                      "batch_timeout_s": config.batch_timeout_s,
                      "payload_retention": PayloadRetention.of(config), **overrides})


class RolloutStream:
    """The accepted groups of a rollstream run as training batches (module doc: the contract).

    Args:
        bootstrap: Kafka bootstrap servers (rank 0 connects).
        run_dir: where the manifest lives (``batches.jsonl``); a restarted stream with the same
            ``run_dir`` and group id resumes after the last committed batch.
        settings: a ``StreamSettings``, or its fields as keywords (``groups_per_batch=8,
            max_steps=100, adv_estimator="rloo"``).
        resume: the ``trainer_state`` saved with your newest checkpoint plus ``"checkpoint"``:
            its folder (or a PolicyTrainer's ``resumed`` state and ``checkpoint``); see the
            module doc.
        control: deadline, stage check, stop flag and progress callback
            (rollstream.trainer.loop.LoopControl).
        ranks: the training ranks; default ``Ranks.current()`` (the default process group).
        agentic: an AgenticConfig when its groups are trajectory groups (set by ``from_config``):
            its verdict comes from the group queues.

    Raises:
        ValueError: ``groups_per_batch`` < 1 or an unknown ``adv_estimator``.
        TypeError: a keyword that is not a ``StreamSettings`` field.
    """

    def __init__(self, bootstrap: Bootstrap, run_dir: str | os.PathLike, settings: StreamSettings | None = None, *,
                 resume: Mapping | None = None, control: LoopControl = LoopControl(), ranks: Ranks | None = None,
                 agentic=None, **fields) -> None:
        settings = replace(settings, **fields) if settings is not None else StreamSettings(**fields)
        self.settings = settings
        self.ranks = ranks or Ranks.current()
        self.groups_per_batch = settings.groups_per_batch
        self.result = LoopResult()
        self._held: _Held | None = None  # a batch whose checkpoint is being written
        self._current: StreamBatch | None = None
        self._whole: RolloutBatch | None = None  # rank 0: the whole batch of ``_current``
        self._done = False
        self._loop: BatchLoop | None = None
        self._builder = self._events = self._publisher = None
        if not self.ranks.is_main:
            return
        topics = Topics(settings.topic_prefix)
        self._builder = BatchBuilder(
            bootstrap, topics, settings.groups_per_batch,
            group_id=settings.group_id or names.consumer_group(topics, "trainer"),
            manifest_path=Path(run_dir) / "batches.jsonl", pad_token_id=settings.pad_token_id,
            max_staleness=settings.max_staleness, max_message_bytes=settings.max_message_bytes,
            adv_estimator=settings.adv_estimator, payload_retention=settings.payload_retention)
        try:
            self._events = (AgenticBatchEvents(bootstrap, topics, agentic, self._builder) if agentic is not None
                            else BatchEvents(bootstrap, topics))
            self._publisher = PolicyPublisher(bootstrap, topics)
            if resume is not None:
                self._builder.recover(_trained_state(resume))
            self._publish_current()
        except BaseException:
            self.close()
            raise
        control = replace(control, check=self._checking(control.check),
                          on_progress=self._held_counted(control.on_progress))
        self._loop = BatchLoop(self._builder, self._events, max_steps=settings.max_steps,
                               min_fill_ratio=settings.min_fill_ratio, control=control,
                               batch_timeout_s=settings.batch_timeout_s)
        self.result = self._loop.result
        self._batches = self._loop.batches()

    @classmethod
    def from_config(cls, config, bootstrap: Bootstrap, run_dir: str | os.PathLike, **kwargs) -> "RolloutStream":
        """A stream for a pipeline config (RLVR or agentic): ``StreamSettings.of(config)``;
        ``kwargs``: ``resume``, ``control``, ``ranks``, or settings fields that override the
        config's."""
        from rollstream.config import AgenticConfig

        return cls(bootstrap, run_dir, StreamSettings.of(config),
                   agentic=config if isinstance(config, AgenticConfig) else None, **kwargs)

    @property
    def step(self) -> int | None:
        """Rank 0: the next step to be built (= batches committed so far, restarts included)."""
        return self._builder.step if self._builder is not None else None

    def __iter__(self) -> "RolloutStream":
        return self

    def __next__(self) -> StreamBatch:
        """The next batch, this rank's shard of it; StopIteration when the run ends (see
        ``result``). Raises RuntimeError while the previous batch is not committed, or on the
        other ranks when rank 0 failed."""
        if self._current is not None:
            raise RuntimeError(f"commit step {self._current.step} before taking the next batch "
                               "(an uncommitted batch is delivered again only to a restarted stream)")
        if self._done:
            raise StopIteration
        messages = None
        if self.ranks.is_main:
            try:
                item = next(self._batches, None)
            except BaseException as exc:  # the other ranks must not wait for a batch forever
                self.ranks.scatter([("error", f"rank 0: {exc!r}")] * self.ranks.world_size)
                raise
            if item is None:
                self.settle()
                messages = [("end", self.result.outcome, self.result.detail)] * self.ranks.world_size
            else:
                whole, end_of_data = item
                self._whole = whole
                meta = (whole.step, end_of_data, list(whole.group_keys), list(whole.policy_versions))
                messages = [("batch", shard, *meta) for shard in shard_batch(whole, self.ranks.world_size)]
        message = self.ranks.scatter(messages)
        if message[0] == "error":
            self._done = True
            raise RuntimeError(message[1])
        if message[0] == "end":
            self._done = True
            self.result.outcome, self.result.detail = message[1], message[2]
            raise StopIteration
        _, shard, step, end_of_data, group_keys, versions = message
        self._current = StreamBatch(shard, step, end_of_data, group_keys, versions, self.groups_per_batch,
                                    self.ranks.rank, self.ranks.world_size, self)
        return self._current

    def settle(self) -> dict | None:
        """Commit the batch held for its checkpoint (``commit(durable=...)``), waiting for the
        checkpoint first; returns its manifest entry, or None when none is held. Raises what the
        Future raised (the batch stays uncommitted: a restart trains it again)."""
        held, self._held = self._held, None
        if held is None:
            return None
        held.durable.result()
        return self._record(held.whole, held.report, held.batch.end_of_data)

    def _hold(self, batch: StreamBatch, checkpoint, report: Mapping | None, durable: Future) -> None:
        self._check_current(batch)
        if self.ranks.distributed:
            raise ValueError("commit(durable=...) is for one training process; under several ranks commit "
                             "once the checkpoint is written")
        self.settle()  # batches are committed in order
        report = dict(report or {})
        path = checkpoint if checkpoint is not None else report.pop("checkpoint", None)
        if path is None:
            raise ValueError(f"step {batch.step}: commit(durable=...) needs the checkpoint folder")
        report = _report(batch.step, path, report, written=False)
        self._held = _Held(batch, self._whole, report, durable)
        self._current = self._whole = None
        durable.add_done_callback(lambda done: self._publish_durable(done, report, batch.step))

    def _publish_durable(self, done: Future, report: dict, step: int) -> None:
        """On the writer's thread: the version's folder is durable, so workers may load it now
        instead of after the commit (a failed write publishes nothing)."""
        if done.cancelled() or done.exception() is not None:
            return
        try:
            self._publisher.publish(*version_of({**report, "step": step}))
        except Exception:  # the commit publishes it again
            log.exception("publishing policy version %s early failed", report["policy_version"])

    def _checking(self, check):
        """``check`` that also commits a held batch whose checkpoint became durable (the loop
        calls it between polls, so a waiting stream does not sit on a finished batch)."""
        def checked() -> None:
            check()
            if self._held is not None and self._held.durable.done():
                self.settle()
        return checked

    def _held_counted(self, on_progress):
        """``on_progress`` that counts the groups of a batch held for its checkpoint as buffered
        (trained, not committed yet)."""
        def counted(result: LoopResult, buffered: int) -> None:
            on_progress(result, buffered + (len(self._held.whole.group_keys) if self._held is not None else 0))
        return counted

    def _check_current(self, batch: StreamBatch) -> None:
        current = self._current
        if current is None or batch.step != current.step or batch._stream is not self:
            raise ValueError(f"step {batch.step} is not this stream's current batch; was it committed already?")

    def _commit(self, batch: StreamBatch, checkpoint, report: Mapping | None) -> dict:
        self._check_current(batch)
        if self.ranks.is_main:
            self.settle()
        self.ranks.barrier()  # every rank's step (and rank 0's checkpoint) is done
        entry: dict | tuple | None = None
        if self.ranks.is_main:
            try:
                entry = self._record(self._whole, _report(batch.step, checkpoint, report), batch.end_of_data)
            except BaseException as exc:  # the other ranks wait for the entry: tell them, with the
                # entry when the batch was committed before the failure (its announcement failed)
                last = self.result.last
                committed = last if last is not None and last["step"] == batch.step else None
                self.ranks.broadcast(("error", f"rank 0: {exc!r}", committed))
                raise
        entry = self.ranks.broadcast(entry)
        if isinstance(entry, tuple):
            if entry[2] is not None:  # committed: every rank's result has it, as rank 0's does
                self.result.add(entry[2])
            raise RuntimeError(entry[1])
        if not self.ranks.is_main:
            self.result.add(entry)
        self._current = self._whole = None
        return entry

    def _record(self, whole: RolloutBatch, report: Mapping | None, end_of_data: bool) -> dict:
        """Rank 0: commit ``whole`` (``BatchBuilder.commit``: its manifest line, Batch event and
        offsets) with ``report`` joined (plus ``"end_of_data": true`` for the final partial
        batch), then announce it: its step figures, then the policy version it made. Returns the
        manifest entry; raises as ``BatchBuilder.commit`` and ``version_of``."""
        report = {**(report or {}), "end_of_data": True} if end_of_data else report
        version_of({**(report or {}), "step": whole.step})  # a version without its weights: refused before the commit
        entry = self._builder.commit(whole, report)
        self.result.add(entry)
        self._publisher.publish_step(entry)
        self._publisher.publish(*version_of(entry))
        return entry

    def _publish_current(self) -> None:
        """Republish the policy version of the last committed batch, trained when it names a
        checkpoint (a worker started since must load it), or version 0 untrained before any
        batch, so workers and the admission start from it."""
        last = self._builder.last_entry
        if last is None:
            self._publisher.publish(0, -1, "", False)
            return
        step = int(last["step"])
        version = int(last.get("policy_version", step + 1))
        checkpoint = last.get("checkpoint", "")
        self._publisher.publish(version, step, checkpoint, version > 0 and bool(checkpoint))

    def close(self) -> None:
        """Commit a held batch once its checkpoint is durable, then close the Kafka clients
        (rank 0); an uncommitted batch is delivered again later."""
        if self._held is not None:
            try:
                self.settle()
            except Exception:  # a restart recovers or retrains it
                log.exception("the held batch was not committed")
        for client in (self._events, self._builder, self._publisher):
            if client is not None:
                client.close()
        self._events = self._builder = self._publisher = None

    def __enter__(self) -> "RolloutStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class _Held:
    """A trained batch waiting for its checkpoint to be durable before its commit."""

    batch: StreamBatch
    whole: RolloutBatch
    report: dict
    durable: Future


def _trained_state(resume: Mapping) -> dict:
    """``BatchBuilder.recover``'s state from ``resume`` (``step``, ``group_keys``, optionally a
    PolicyTrainer checkpoint's ``report`` and the ``checkpoint`` folder): the folder joins the
    report as policy version ``step + 1`` (unless the report has its version), so the recovered
    manifest entry names the weights the stream republishes at start."""
    state = {"step": int(resume["step"]), "group_keys": list(resume["group_keys"])}
    report = dict(resume.get("report") or {})
    if resume.get("checkpoint"):
        report.setdefault("policy_version", state["step"] + 1)
        report["checkpoint"] = str(Path(resume["checkpoint"]).absolute())
    if report:
        state["report"] = report
    return state


def _report(step: int, checkpoint, report: Mapping | None, written: bool = True) -> dict:
    """The manifest additions of a commit: the caller's ``report``, plus the ``checkpoint`` folder
    (absolute: it is published to other processes) as policy version ``step + 1``. Raises
    ValueError when ``checkpoint`` is not a folder (``written``; a checkpoint still being written
    is not checked)."""
    out = dict(report or {})
    if checkpoint is not None:
        path = Path(checkpoint).absolute()
        if written and not path.is_dir():
            raise ValueError(f"checkpoint {str(path)!r} of step {step} is not a folder")
        out.setdefault("policy_version", step + 1)
        out["checkpoint"] = str(path)
    return out
