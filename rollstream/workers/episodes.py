"""Multi-turn episodes without Kafka: ``EpisodePlayer`` plays EpisodeRequest records as
trajectories (Trajectory records). The Kafka shell is rollstream.workers.env_worker.

* ``EpisodePlayer`` -- the episode logic. Up to ``max_concurrent`` trajectories live
  at once, each a small state machine: make env -> reset -> [model turn -> env step]* -> done.
  Every ``step()`` generates the turns of ALL trajectories waiting for the model in one
  ``backend.generate`` call, so the engine sees one batch. Environment calls run in helper
  threads so a slow environment never holds up the other trajectories; a call slower than the
  request's ``env_step_timeout_s`` ends its trajectory (its thread is abandoned: daemon, never
  joined, so it cannot block shutdown).

Token layout of a Trajectory (the trainer's contract, see trajectory.avsc)::

    turns[0].prompt_token_ids   = chat template of the first observation (system + user
                                  message, ends with "<|im_start|>assistant\\n")
    turns[k].response_token_ids = the model's sampled tokens, eos (<|im_end|>) included when
                                  sampled
    turns[k].prompt_token_ids   = (k >= 1) [<|im_end|> iff turn k-1 stopped without eos] +
                                  tokens("\\n<|im_start|>user\\n{observation}<|im_end|>\\n"
                                  "<|im_start|>assistant\\n")

(shown for the bundled SmolLM2's template; a user model's eos and template take their places,
see rollstream.policy.model.chat_turn_ids). A non-model ``<|im_end|>`` therefore always sits at the START of the next turn's prompt (never
in a response), and none is added after the final turn. The flattened response is
``turns[0].response + turns[1].prompt + turns[1].response + ...``; ``response_mask`` has exactly
``sum_k len(response_k) + sum_{k>=1} len(prompt_k)`` entries, 1 on response tokens, 0 on prompt
tokens. With an eos-terminated response the layout is token-for-token the tokenizer's own chat
template of the conversation.

Per-token extras: when the engine's samples carry ``extras`` (``Sample.extras``, e.g.
``routed_experts`` of shape ``(len(token_ids), ...)``), the record's ``extras`` holds, per name
that every turn's sample carried with one dtype and trailing shape, a PackedArray over the
flattened response (first dimension ``len(response_mask)``; zeros at environment tokens).
``extras`` is ``{}`` otherwise. A sample whose extras do not fit its tokens ends the trajectory
as ``engine_error``.

Stop reasons: ``done`` (the environment ended the episode), ``max_actions`` (turn limit),
``max_length`` (the next turn's prompt plus ``max_tokens_per_step`` would exceed
``max_context_tokens``; that prompt is not added), ``env_timeout`` / ``env_failed`` (infra:
``drop_flag`` set, ``error`` says what), ``engine_error`` (the inference engine returned an
error sample: ``drop_flag`` set, ``env_failed`` False -- the environment was fine, but the
trajectory is incomplete through no fault of the policy).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from rollstream.policy.model import chat_prompt_ids, chat_turn_ids, load_tokenizer
from rollstream.runtime import now_ms
from rollstream.schemas.packed import DTYPES, packed_array
from rollstream.schemas.records import (
    FINISH_ERROR,
    STOP_DONE,
    STOP_ENGINE_ERROR,
    STOP_ENV_FAILED,
    STOP_ENV_TIMEOUT,
    STOP_MAX_ACTIONS,
    STOP_MAX_LENGTH,
)
from rollstream.inference.engine import GenerationBackend, SamplingParams
from rollstream.workers.env_calls import EnvCall, close_quietly
from rollstream.workers.envs import StepResult, TextEnv, make_env

log = logging.getLogger(__name__)


DEFAULT_MAX_CONTEXT_TOKENS = 2048
# Building an environment is not a reset/step, but may import a library or load data: it gets
# this much time at least (the request's env_step_timeout_s when larger).
ENV_MAKE_TIMEOUT_S = 120.0

Identity = tuple[str, int, int, int]  # (mode, group_id, episode_id, traj_index)


def identity_of(request: dict) -> Identity:
    """(mode, group_id, episode_id, traj_index) of an EpisodeRequest or Trajectory record."""
    return (request["mode"], int(request["group_id"]), int(request["episode_id"]), int(request["traj_index"]))


def turn_seed(seed: int, traj_index: int, turn: int) -> int:
    """Sampling seed of model turn ``turn`` of run ``traj_index`` of the episode seeded ``seed``:
    a 63-bit int, stable across processes (sha256, not Python's salted hash)."""
    digest = hashlib.sha256(f"{int(seed)}/{int(traj_index)}/{int(turn)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def validate_request(request: dict) -> None:
    """Raise ValueError when an EpisodeRequest cannot be played whatever the environment does
    (an unknown mode, non-positive limits or timeout)."""
    if request["mode"] not in ("train", "val"):
        raise ValueError(f"mode must be 'train' or 'val', got {request['mode']!r}")
    if int(request["max_actions_per_traj"]) < 1:
        raise ValueError(f"max_actions_per_traj must be >= 1, got {request['max_actions_per_traj']}")
    if int(request["max_tokens_per_step"]) < 1:
        raise ValueError(f"max_tokens_per_step must be >= 1, got {request['max_tokens_per_step']}")
    if not float(request["env_step_timeout_s"]) > 0:
        raise ValueError(f"env_step_timeout_s must be > 0, got {request['env_step_timeout_s']}")


# -- one trajectory -------------------------------------------------------------------------------

_MAKING, _RESETTING, _WAIT_MODEL, _STEPPING = "making", "resetting", "wait_model", "stepping"


@dataclass
class _Trajectory:
    request: dict
    tag: Any
    started_ms: int
    phase: str = _MAKING
    env: TextEnv | None = None
    call: EnvCall | None = None
    turns: list[dict] = field(default_factory=list)
    context: list[int] = field(default_factory=list)  # prompt0 + response0 + prompt1 + ... so far
    next_prompt: list[int] | None = None  # prompt tokens of the turn about to be generated
    needs_im_end: bool = False  # last response stopped without eos
    policy_version: int | None = None
    success: bool = False
    extras: list[dict[str, np.ndarray]] = field(default_factory=list)  # per turn: the sample's extras


@dataclass(frozen=True)
class Finished:
    """A trajectory that just ended: ``tag`` as given to ``submit``, ``record`` a Trajectory
    record (schema ``Trajectory``)."""

    tag: Any
    record: dict


class EpisodePlayer:
    """Plays EpisodeRequest records with ``backend`` (no Kafka).

    ``temperature``/``top_p``: sampling of every turn (seeds come from ``turn_seed``).
    ``max_concurrent``: trajectories alive at once. ``max_context_tokens``: bound of prompt +
    responses of one trajectory (see the module doc). ``env_factory(env_type, env_config)``
    builds environments (default ``make_env``). ``tokenizer`` defaults to the backend's.
    ``gather_s``: how long a batch waits for environment calls still in flight (see step).

    Not thread-safe: one thread calls submit/step.
    """

    def __init__(
        self,
        backend: GenerationBackend,
        *,
        tokenizer: Any = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_concurrent: int = 16,
        max_context_tokens: int = DEFAULT_MAX_CONTEXT_TOKENS,
        worker: str = "",
        env_factory: Callable[[str, dict], TextEnv] = make_env,
        gather_s: float = 0.02,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        if max_context_tokens < 2:
            raise ValueError(f"max_context_tokens must be >= 2, got {max_context_tokens}")
        SamplingParams(temperature=temperature, top_p=top_p)  # raises ValueError if out of range
        self.backend = backend
        self.tokenizer = tokenizer or getattr(backend, "tokenizer", None) or load_tokenizer()
        self.im_end_id = int(self.tokenizer.eos_token_id)  # the model's eos ends a turn
        self.temperature = temperature
        self.top_p = top_p
        self.max_concurrent = max_concurrent
        self.max_context_tokens = max_context_tokens
        self.worker = worker
        self.env_factory = env_factory
        self.gather_s = gather_s
        self._live: dict[Identity, _Trajectory] = {}
        self._wakeup = threading.Event()
        self.generate_calls = 0  # backend.generate calls made (one per step with model work)

    # -- bookkeeping --------------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Trajectories alive (submitted, not yet finished)."""
        return len(self._live)

    @property
    def free_slots(self) -> int:
        return self.max_concurrent - len(self._live)

    def submit(self, request: dict, tag: Any = None) -> bool:
        """Start playing EpisodeRequest ``request``; ``tag`` comes back with its result.

        Returns False (and does nothing) when a trajectory with the same identity is already
        playing. Raises ValueError for an unplayable request (see validate_request) and
        RuntimeError when no slot is free. Environment problems never raise here: they end the
        trajectory with env_failed/env_timeout in a later ``step``.
        """
        validate_request(request)
        key = identity_of(request)
        if key in self._live:
            return False
        if self.free_slots <= 0:
            raise RuntimeError(f"all {self.max_concurrent} trajectory slots are busy")
        traj = _Trajectory(request=request, tag=tag, started_ms=now_ms())
        self._live[key] = traj
        env_type = request["env_type"]

        def build() -> TextEnv:
            # JSON errors surface as env_failed: the config belongs to the environment.
            config = json.loads(request.get("env_config") or "{}")
            if not isinstance(config, dict):
                raise ValueError(f"env_config must be a JSON object, got {type(config).__name__}")
            return self.env_factory(env_type, config)

        timeout = max(float(request["env_step_timeout_s"]), ENV_MAKE_TIMEOUT_S)
        traj.call = EnvCall(build, timeout, self._wakeup)
        return True

    def abandon_all(self) -> list[Any]:
        """Drop every live trajectory without a result (worker shutdown); returns their tags.
        Their environments are closed once any running call returns."""
        tags = []
        for traj in self._live.values():
            tags.append(traj.tag)
            self._release(traj)
        self._live.clear()
        return tags

    # -- the loop -----------------------------------------------------------------------------

    def step(self, wait_s: float = 0.0) -> list[Finished]:
        """Advance every trajectory once: collect finished environment calls (ending the slow
        and the failed ones), then generate one turn for every trajectory waiting for the model
        in ONE backend call and hand the answers to the environments.

        Blocks at most ``wait_s`` seconds for a first environment call to return when nothing
        is ready for the model, then at most ``gather_s`` more for the other calls in flight,
        so trajectories whose (fast) steps end a moment apart still share one batch. Returns
        the trajectories that ended, in no particular order.
        """
        finished = self._collect()
        in_flight = [t.call for t in self._live.values() if t.call is not None]
        if in_flight:
            ready = any(t.phase == _WAIT_MODEL for t in self._live.values())
            if self._wait_calls(in_flight, 0.0 if ready else wait_s):
                finished.extend(self._collect())
        waiting = [(k, t) for k, t in self._live.items() if t.phase == _WAIT_MODEL]
        if waiting:
            finished.extend(self._generate(waiting))
        return finished

    def _wait_calls(self, calls: list[EnvCall], first_s: float) -> bool:
        """Wait up to ``first_s`` for one of ``calls`` to return (0: do not wait for a first
        one), then up to ``gather_s`` for the rest; never past a call's deadline (it is then
        due for a timeout). Returns whether any call returned."""
        start = time.monotonic()
        gather_until = start + self.gather_s if first_s <= 0 else None
        while True:
            self._wakeup.clear()  # before looking: a call returning after this ends the wait
            pending = [c for c in calls if not c.finished]
            if not pending:
                return True
            now = time.monotonic()
            if len(pending) < len(calls) and gather_until is None:
                gather_until = now + self.gather_s
            until = gather_until if gather_until is not None else start + first_s
            until = min([until] + [c.deadline() + 0.001 for c in pending])
            if now >= until:
                return len(pending) < len(calls)
            self._wakeup.wait(until - now)

    def _collect(self) -> list[Finished]:
        """Apply every returned environment call; end the timed-out and failed trajectories."""
        finished: list[Finished] = []
        now = time.monotonic()
        for key, traj in list(self._live.items()):
            call = traj.call
            if call is None:
                continue
            if call.timed_out(now):
                finished.append(self._end_timeout(key, traj))
            elif call.finished:
                traj.call = None
                if call.exc is not None:
                    finished.append(self._end_failed(key, traj, call.exc))
                    continue
                try:
                    done = self._advance(traj, call.result, call.elapsed)
                except Exception as exc:  # a malformed reset/step result is the env's fault
                    finished.append(self._end_failed(key, traj, exc))
                    continue
                if done is not None:
                    finished.append(self._finish(key, traj, done))
        return finished

    def play(self, requests: Iterable[dict], timeout_s: float | None = None) -> list[dict]:
        """Play ``requests`` to the end (at most ``max_concurrent`` at once) and return their
        Trajectory records in request order; a request whose identity repeats an earlier one
        is skipped. Raises TimeoutError after ``timeout_s`` (live trajectories are abandoned)."""
        queue = list(enumerate(requests))
        queue.reverse()
        results: dict[int, dict] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        seen: set[Identity] = set()
        while queue or self._live:
            while queue and self.free_slots > 0:
                index, request = queue.pop()
                if identity_of(request) in seen:
                    continue
                seen.add(identity_of(request))
                self.submit(request, tag=index)
            for done in self.step(wait_s=0.05):
                results[done.tag] = done.record
            if deadline is not None and time.monotonic() > deadline:
                self.abandon_all()
                raise TimeoutError(f"episodes still playing after {timeout_s}s")
        return [results[i] for i in sorted(results)]

    # -- transitions --------------------------------------------------------------------------

    def _advance(self, traj: _Trajectory, result: Any, elapsed: float | None) -> str | None:
        """Apply a finished environment call; returns a stop reason when the trajectory ends."""
        request = traj.request
        if traj.phase == _MAKING:
            traj.env = result
            traj.phase = _RESETTING
            env, seed = result, int(request["seed"])
            traj.call = EnvCall(lambda: env.reset(seed), float(request["env_step_timeout_s"]), self._wakeup)
            return None
        if traj.phase == _RESETTING:
            if not isinstance(result, str):
                raise TypeError(f"reset returned {type(result).__name__}, expected the observation text")
            return self._queue_prompt(traj, chat_prompt_ids(self.tokenizer, result))
        # _STEPPING: the environment's answer to the last turn
        if not isinstance(result, StepResult):
            raise TypeError(f"step returned {type(result).__name__}, expected StepResult")
        turn = traj.turns[-1]
        turn["action"] = str(result.action or "")
        turn["invalid_move"] = bool(result.invalid_move)
        turn["step_reward"] = float(result.reward)
        turn["env_ms"] = float((elapsed or 0.0) * 1000.0)
        traj.success = bool(result.success)
        if result.done:
            return STOP_DONE
        if len(traj.turns) >= int(request["max_actions_per_traj"]):
            return STOP_MAX_ACTIONS
        prompt = [self.im_end_id] if traj.needs_im_end else []
        prompt += self.observation_ids(result.observation)
        return self._queue_prompt(traj, prompt)

    def observation_ids(self, observation: str) -> list[int]:
        """Token ids of a later turn's user message (without any leading eos): token-for-token
        what the model's chat template produces (rollstream.policy.model.chat_turn_ids)."""
        return chat_turn_ids(self.tokenizer, observation)

    def _queue_prompt(self, traj: _Trajectory, prompt: list[int]) -> str | None:
        budget = int(traj.request["max_tokens_per_step"])
        if len(traj.context) + len(prompt) + budget > self.max_context_tokens:
            return STOP_MAX_LENGTH
        traj.next_prompt = prompt
        traj.phase = _WAIT_MODEL
        return None

    def _generate(self, waiting: list[tuple[Identity, _Trajectory]]) -> list[Finished]:
        prompts, params = [], []
        for _, traj in waiting:
            req = traj.request
            prompts.append(traj.context + traj.next_prompt)
            params.append(SamplingParams(
                temperature=self.temperature, top_p=self.top_p,
                max_new_tokens=int(req["max_tokens_per_step"]),
                seed=turn_seed(req["seed"], req["traj_index"], len(traj.turns)),
            ))
        version = int(getattr(self.backend, "policy_version", 0))
        self.generate_calls += 1
        try:
            results = self.backend.generate(prompts, [1] * len(prompts), params)
        except Exception as exc:  # the protocol says never, but one bad engine must not kill us
            log.exception("backend.generate raised")
            results = [[None] for _ in prompts]
            engine_exc: Exception | None = exc
        else:
            engine_exc = None
        finished = []
        for (key, traj), samples in zip(waiting, results):
            sample = samples[0] if samples else None
            if sample is None or sample.finish_reason == FINISH_ERROR:
                error = (sample.error if sample is not None else None) or (
                    f"{type(engine_exc).__name__}: {engine_exc}" if engine_exc else "engine returned no sample")
                finished.append(self._finish(key, traj, STOP_ENGINE_ERROR, error=f"engine: {error}"[:2000]))
                continue
            tokens = [int(t) for t in sample.token_ids]
            try:
                extras = sample_extras(sample, len(tokens))
            except ValueError as exc:
                finished.append(self._finish(key, traj, STOP_ENGINE_ERROR, error=f"engine: extras: {exc}"[:2000]))
                continue
            if traj.policy_version is None:
                traj.policy_version = version  # oldest weights that produced any of its tokens
            traj.extras.append(extras)
            traj.turns.append({
                "prompt_token_ids": list(traj.next_prompt),
                "response_token_ids": tokens,
                "infer_logprobs": [float(x) for x in sample.logprobs],
                "response_text": sample.text,
                "action": "",
                "invalid_move": False,
                "step_reward": 0.0,
                "finish_reason": sample.finish_reason,
                "env_ms": 0.0,
            })
            traj.context.extend(traj.next_prompt)
            traj.context.extend(tokens)
            traj.next_prompt = None
            traj.needs_im_end = not tokens or tokens[-1] != self.im_end_id
            traj.phase = _STEPPING
            env, text = traj.env, sample.text
            traj.call = EnvCall(lambda env=env, text=text: env.step(text),
                                 float(traj.request["env_step_timeout_s"]), self._wakeup)
        return finished

    # -- endings ------------------------------------------------------------------------------

    def _release(self, traj: _Trajectory) -> None:
        call, env = traj.call, traj.env
        traj.call = None
        if call is not None and not call.finished:
            if traj.phase == _MAKING:
                # The env is still being built: close whatever the stuck constructor returns.
                call.abandon(lambda: close_quietly(call.result if call.exc is None else None))
            else:
                call.abandon(lambda: close_quietly(env))
        else:
            if call is not None and traj.phase == _MAKING and call.exc is None:
                env = call.result  # built, but too slowly to be used
            close_quietly(env)

    def _end_timeout(self, key: Identity, traj: _Trajectory) -> Finished:
        call = traj.call
        what = {_MAKING: "make", _RESETTING: "reset", _STEPPING: "step"}.get(traj.phase, traj.phase)
        took = f"{call.elapsed:.3f}s" if call.elapsed is not None else "still running"
        error = f"env {what} exceeded {call.timeout_s:g}s ({took})"
        return self._finish(key, traj, STOP_ENV_TIMEOUT, error=error)

    def _end_failed(self, key: Identity, traj: _Trajectory, exc: BaseException) -> Finished:
        what = {_MAKING: "make", _RESETTING: "reset", _STEPPING: "step"}.get(traj.phase, traj.phase)
        return self._finish(key, traj, STOP_ENV_FAILED, error=f"env {what}: {type(exc).__name__}: {exc}"[:2000])

    def _finish(self, key: Identity, traj: _Trajectory, reason: str, error: str | None = None) -> Finished:
        try:
            return Finished(traj.tag, self._record(traj, reason, error))
        finally:
            self._release(traj)
            self._live.pop(key, None)

    def _record(self, traj: _Trajectory, reason: str, error: str | None) -> dict:
        req = traj.request
        mask: list[int] = []
        for k, turn in enumerate(traj.turns):
            if k:
                mask.extend([0] * len(turn["prompt_token_ids"]))
            mask.extend([1] * len(turn["response_token_ids"]))
        step_rewards = [float(t["step_reward"]) for t in traj.turns]
        invalid = sum(1 for t in traj.turns if t["invalid_move"])
        infra = reason in (STOP_ENV_TIMEOUT, STOP_ENV_FAILED, STOP_ENGINE_ERROR)
        version = traj.policy_version
        return {
            "mode": req["mode"],
            "group_id": int(req["group_id"]),
            "episode_id": int(req["episode_id"]),
            "traj_index": int(req["traj_index"]),
            "tag": req.get("tag", ""),
            "env_type": req["env_type"],
            "seed": int(req["seed"]),
            "turns": traj.turns,
            "response_mask": mask,
            "step_rewards": step_rewards,
            "response_level_rewards": sum(step_rewards) + float(req.get("format_penalty", 0.0)) * invalid,
            "success": traj.success and reason == STOP_DONE,
            "stop_reason": reason,
            "env_timeout": reason == STOP_ENV_TIMEOUT,
            "env_failed": reason == STOP_ENV_FAILED,
            "drop_flag": infra,
            "error": error,
            "policy_version": int(version if version is not None else getattr(self.backend, "policy_version", 0)),
            "started_ms": traj.started_ms,
            "finished_ms": now_ms(),
            "worker": self.worker,
            "extras": flat_extras(traj.turns, traj.extras),
        }


def sample_extras(sample: Any, n_tokens: int) -> dict[str, np.ndarray]:
    """``sample.extras`` as numpy arrays (name -> array whose first dimension is ``n_tokens``).

    Raises ValueError for an array whose dtype cannot be packed (rollstream.schemas.packed.DTYPES)
    or whose first dimension is not the sample's token count."""
    out = {}
    for name, values in (getattr(sample, "extras", None) or {}).items():
        array = np.asarray(values)
        if array.dtype.name not in DTYPES:
            raise ValueError(f"extras[{name!r}] has dtype {array.dtype.name}; packable: {DTYPES}")
        if array.ndim == 0 or array.shape[0] != n_tokens:
            raise ValueError(f"extras[{name!r}] has shape {array.shape}; its first dimension must be the "
                             f"response length {n_tokens}")
        out[str(name)] = array
    return out


def flat_extras(turns: list[dict], extras: list[dict[str, np.ndarray]]) -> dict[str, dict]:
    """``Trajectory.extras``: per name every turn carries (one dtype, one trailing shape), a
    PackedArray over the flattened response -- each turn's response values, zeros at the later
    turns' prompt (environment) tokens. Names missing from a turn or inconsistent across turns
    are left out (logged)."""
    if not turns or len(extras) != len(turns):
        return {}
    names = set(extras[0]).intersection(*extras[1:])
    for dropped in sorted(set().union(*extras) - names):
        log.warning("extras[%r] missing from some turns of a trajectory: not carried", dropped)
    out = {}
    for name in sorted(names):
        arrays = [e[name] for e in extras]
        if len({(a.dtype.name, a.shape[1:]) for a in arrays}) != 1:
            log.warning("extras[%r] changes dtype or shape between turns: not carried", name)
            continue
        parts = []
        for k, (turn, array) in enumerate(zip(turns, arrays)):
            if k:
                parts.append(np.zeros((len(turn["prompt_token_ids"]), *array.shape[1:]), dtype=array.dtype))
            parts.append(array)
        out[name] = packed_array(np.concatenate(parts))
    return out
