"""Rollout batches and GRPO advantages: pure torch and numpy, no Kafka.

Capabilities and entry points:

- ``check_group(group)``: can one decoded ``Group`` (RLVR) or ``TrajectoryGroup`` (agentic)
  record be trained, judged on its small decision event alone (members, indices, rewards)?
  ``ValueError`` says why. Run at intake, before any payload is fetched.
- ``check_payloads(group)``: the same group once every member's ``payload`` is the decoded
  ``Response`` / ``Trajectory`` (see ``rollstream.trainer.intake.resolve_payloads``): token
  arrays that agree, prompt tokens, ``response_mask``, per-token ``extras``.
- ``build_batch(groups, step, pad_token_id)``: resolved ``Group`` / ``TrajectoryGroup`` records,
  in any mix -> padded ``RolloutBatch`` with per-token advantages.
- ``group_advantages(rewards, estimator)``: per-response advantages from each group's rewards,
  by ``adv_estimator`` (``ADV_ESTIMATORS``: ``grpo``, ``dr_grpo``, ``rloo``), for a ``(G, n)``
  tensor or for groups of unequal size; ``grpo_advantages(rewards)`` is the GRPO one.

The two kinds are told apart by key: a ``TrajectoryGroup`` has ``trajectories``, a ``Group`` has
``responses``. A member is a small summary (``RewardedResponse`` / ``TrajectorySummary``) whose
``payload`` names the token arrays; the trainer puts the decoded payload there before building.
Each group becomes uniform rows (prompt tokens, response tokens, infer logprobs, response mask,
reward, sample index, prompt id, policy version, extras), one per response / trajectory:

- RLVR response: prompt = its payload's ``prompt_token_ids``, response = ``response_token_ids``,
  every response token trained; reward = ``response_level_reward``; sample index =
  ``sample_index``.
- Agentic trajectory: prompt = ``turns[0].prompt_token_ids``; response = ``turns[0].response
  + turns[1].prompt + turns[1].response + turns[2].prompt + ...``; mask = the trajectory's
  ``response_mask`` (1 = model token); infer logprobs at model-token positions, 0.0 at environment
  tokens; reward = ``response_level_rewards``; sample index = ``traj_index``; prompt id = the
  group's ``group_key``.

Rewards, indices and versions come from the summary (what was decided on), tokens from the
payload. Token arrays are numpy arrays (decoded packed bytes) or lists; every row is copied into
the padded arrays with one slice assignment per array, never per token.

Layout (B = sum of rows over the groups, rows ordered by group, then by sample index)::

    prompt    | response
    0 0 p p p | r r e r 0      prompt_ids left-padded, response_ids right-padded (e = env token)
    0 0 1 1 1 | 1 1 0 1 0      prompt_mask, response_mask

Left-padded prompts make every response start at column P of ``cat([prompt_ids, response_ids])``,
so the logprob of response token t is read at position ``P - 1 + t`` for every row.

References:

- GRPO advantage: Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in
  Open Language Models", section 4.1.2 (outcome supervision).
- Mean-only variant (``dr_grpo``, ``norm_by_std=False``): Liu et al. 2025, "Understanding
  R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO), section 3.2.
- Leave-one-out baseline (``rloo``): Ahmadian et al. 2024, "Back to Basics: Revisiting
  REINFORCE Style Optimization for Learning from Human Feedback in LLMs", section 3.2 (after
  Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!").
- Unbiased std (n - 1) as torch's default, like the reference query filter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Callable, Mapping, Sequence, overload

import numpy as np
import torch
from torch import Tensor

from rollstream.extensions import ADV_ESTIMATORS
from rollstream.exceptions import ConfigError
from rollstream.schemas.packed import unpack_array
from rollstream.schemas.records import group_rows, is_payload_ref, is_trajectory_group
from rollstream.schemas.validation import check_extras, check_trajectory

GRPO_EPS = 1e-6
"""Added to the group std before dividing, so a near-constant group cannot blow up."""


EXTRAS_TORCH_DTYPE = {"uint16": np.int32}
"""numpy dtypes of ``extras`` widened for torch (which has few uint16 operations); the others
(uint8, int32, int64, float16, float32, float64) keep their dtype."""


@dataclass
class RolloutBatch:
    """One training step's rollouts: ``G`` accepted groups, ``B`` rows (responses / trajectories).

    Tensors (all on the CPU when built; see ``to``):

    - ``prompt_ids``: ``(B, P) int64``, left-padded with ``pad_token_id``.
    - ``prompt_mask``: ``(B, P) int64``, 1 = real prompt token, 0 = padding.
    - ``response_ids``: ``(B, T) int64``, right-padded with ``pad_token_id``.
    - ``response_mask``: ``(B, T) float32``, 1 = trained token (model token), 0 = padding or
      environment token (an agentic trajectory's later-turn prompt tokens).
    - ``infer_logprobs``: ``(B, T) float32``, the inference engine's log p(token) (nats) at model
      tokens; 0.0 at padding and environment tokens, so they stay finite for the train-infer
      correction.
    - ``response_lengths``: ``(B,) int64``, real tokens in each row's response (model and
      environment tokens); positions from there on are padding.
    - ``response_level_rewards``: ``(B,) float32``, the scalar reward of each row.
    - ``advantages``: ``(B, T) float32``, the row's advantage (``group_advantages`` of its
      group's rewards, by the batch's estimator) broadcast over its trained tokens
      (``response_mask == 1``), 0 at padding and environment tokens.
    - ``group_index``: ``(B,) int64``, index in ``group_keys`` of the row's group.
    - ``extras``: name -> ``(B, T, *rest)`` tensor for every optional per-token array (payload
      ``extras``, e.g. ``routed_experts`` of shape ``(B, T, layers, top_k)``) that EVERY row's
      payload carries; zero at padding. dtype: the arrays' (uint16 widened to int32, see
      ``EXTRAS_TORCH_DTYPE``). A name some row lacks is left out; empty without extras.

    Python lists:

    - ``group_keys``: ``G`` group keys, in batch order.
    - ``prompt_ids_str``: ``B`` prompt ids (a response's ``prompt_id``; a trajectory's
      ``group_key``).
    - ``sample_index``: ``B`` sample indices within the group (a trajectory's ``traj_index``).
    - ``policy_versions``: ``B`` policy versions that generated each row.

    ``step`` is the training step the batch belongs to.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    infer_logprobs: Tensor
    response_lengths: Tensor
    response_level_rewards: Tensor
    advantages: Tensor
    group_index: Tensor
    group_keys: list[str]
    prompt_ids_str: list[str]
    sample_index: list[int]
    policy_versions: list[int]
    step: int
    extras: dict[str, Tensor] = field(default_factory=dict)

    @property
    def response_attention_mask(self) -> Tensor:
        """``(B, T) int64``: 1 on every real response token (model or environment), 0 on padding.
        Unlike ``response_mask`` it marks what the model attends to, not what is trained."""
        T = self.response_ids.shape[1]
        positions = torch.arange(T, device=self.response_ids.device)
        return (positions[None, :] < self.response_lengths[:, None].to(positions.device)).long()

    @property
    def batch_size(self) -> int:
        """B, the number of response rows."""
        return int(self.response_ids.shape[0])

    @property
    def num_groups(self) -> int:
        """G, the number of groups."""
        return len(self.group_keys)

    @property
    def responses_per_group(self) -> list[int]:
        """Rows (responses or trajectories) per group, in ``group_keys`` order; sizes may differ."""
        return torch.bincount(self.group_index, minlength=self.num_groups).tolist()

    def to(self, device: torch.device | str) -> "RolloutBatch":
        """A copy with every tensor (``extras`` included) moved to ``device``; lists and step are
        shared."""
        moved = {
            f.name: (v.to(device) if isinstance(v := getattr(self, f.name), Tensor) else v)
            for f in fields(self)
        }
        moved["extras"] = {name: t.to(device) for name, t in self.extras.items()}
        return RolloutBatch(**moved)


@dataclass(frozen=True)
class _Row:
    """One batch row before padding, the same for an RLVR response and an agentic trajectory."""

    prompt: np.ndarray  # int
    response: np.ndarray  # int
    logprobs: np.ndarray  # float, len(response); 0.0 at environment tokens
    mask: np.ndarray | None  # len(response), 1 = trained; None = every token trained
    reward: float
    sample_index: int
    prompt_id: str
    policy_version: int
    extras: dict[str, np.ndarray]  # name -> (len(response), *rest)


# -- checks ---------------------------------------------------------------------------------------


def check_group(group: dict) -> None:
    """Raise ``ValueError`` unless ``group``'s decision event can go into a batch (intake check).

    ``group`` is a decoded ``Group`` (RLVR, has ``responses``) or ``TrajectoryGroup`` (agentic,
    has ``trajectories``) record; its members' payloads need not be fetched.

    A trainable ``Group`` has at least one response; every response has a finite
    ``response_level_reward`` and a ``sample_index`` unique within the group. A trainable
    ``TrajectoryGroup`` has at least one trajectory; every trajectory has a ``traj_index`` unique
    within the group and a finite ``response_level_rewards``. What needs the token arrays is
    ``check_payloads``'s.
    """
    key = group.get("group_key", "?")
    if is_trajectory_group(group):
        for traj, idx in _unique_members(key, group.get("trajectories") or [], "trajectories",
                                         lambda t: t["traj_index"], "traj_index"):
            _check_reward(traj["response_level_rewards"], f"group {key!r} trajectory {idx}",
                          "response_level_rewards")
        return
    for rr, idx in _unique_members(key, group.get("responses") or [], "responses",
                                   lambda rr: rr["response"]["sample_index"], "sample_index"):
        _check_reward(rr["response_level_reward"], f"group {key!r} sample {idx}", "response_level_reward")


def check_payloads(group: dict) -> None:
    """Raise ``ValueError`` unless every member of ``group`` has its payload resolved and the
    payload can be trained (run after the fetch, before ``build_batch``).

    RLVR: each ``payload`` is a ``Response`` with prompt tokens and as many ``infer_logprobs`` as
    ``response_token_ids``. Agentic: each ``payload`` is a ``Trajectory`` passing
    ``rollstream.schemas.validation.check_trajectory`` (turns[0] prompt tokens, per-turn logprob
    counts, a 0/1 ``response_mask`` as long as the flattened response). Both: every ``extras``
    entry is a consistent ``PackedArray`` whose first dimension is the response length (RLVR:
    response tokens; agentic: ``len(response_mask)``).
    """
    key = group.get("group_key", "?")
    if is_trajectory_group(group):
        for traj in group.get("trajectories") or []:
            where = f"group {key!r} trajectory {traj['traj_index']}"
            payload = _resolved(traj, where)
            check_trajectory(payload, where=where)  # its extras too
        extras_shapes(group)
        return
    extras_shapes(group)
    for rr in group.get("responses") or []:
        where = f"group {key!r} sample {rr['response']['sample_index']}"
        resp = _resolved(rr, where)
        n_tok, n_lp = len(resp["response_token_ids"]), len(resp["infer_logprobs"])
        if n_tok != n_lp:
            raise ValueError(f"{where}: {n_tok} response tokens but {n_lp} infer_logprobs")
        if not len(resp["prompt_token_ids"]):
            raise ValueError(f"{where}: no prompt tokens")
        check_extras(resp, n_tok, where)


def extras_shapes(group: Mapping) -> dict[str, tuple[int, ...]]:
    """Name -> shape beyond the token axis of each ``extras`` array of a resolved group's
    members (e.g. ``routed_experts`` -> (layers, top_k)). Raises ``ValueError`` when members
    disagree (one batch tensor needs one shape); the trainer also keeps a batch's groups to one
    shape per name (``BatchBuilder``)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for member in group_rows(group):
        for name, packed in ((member.get("payload") or {}).get("extras") or {}).items():
            rest = tuple(int(d) for d in packed["shape"][1:])
            if shapes.setdefault(name, rest) != rest:
                raise ValueError(f"group {group.get('group_key', '?')!r}: extras[{name!r}] shapes beyond the token "
                                 f"axis differ between members: {shapes[name]} and {rest}")
    return shapes


def _check_reward(reward: float, where: str, name: str) -> None:
    if not math.isfinite(reward):
        raise ValueError(f"{where}: non-finite {name} {reward} "
                         "(such groups must be rejected upstream with reason invalid_reward)")


def _resolved(member: Mapping, where: str) -> Mapping:
    """The decoded payload of a member; ValueError while it is still a ``PayloadRef``."""
    payload = member.get("payload")
    if payload is None or is_payload_ref(payload):
        raise ValueError(f"{where}: payload not resolved (a PayloadRef; fetch it first, "
                         "see rollstream.trainer.intake.resolve_payloads)")
    return payload


def _unique_members(key: str, members: list, kind: str, index_of, index_name: str):
    """Yield ``(member, index)``; ValueError for a group without members or with an index twice."""
    if not members:
        raise ValueError(f"group {key!r} has no {kind}")
    seen: set[int] = set()
    for member in members:
        idx = index_of(member)
        if idx in seen:
            raise ValueError(f"group {key!r}: {index_name} {idx} appears twice")
        seen.add(idx)
        yield member, idx


# -- rows and the batch ---------------------------------------------------------------------------


def _ints(values) -> np.ndarray:
    """A 1-D integer array: a decoded packed array as it is (no copy; the padded int64 array
    widens it on assignment), a list converted."""
    return values if isinstance(values, np.ndarray) else np.asarray(values, dtype=np.int64).reshape(-1)


def _floats(values) -> np.ndarray:
    return values if isinstance(values, np.ndarray) else np.asarray(values, dtype=np.float32).reshape(-1)


def _extras(payload: Mapping) -> dict[str, np.ndarray]:
    return {name: unpack_array(packed) for name, packed in (payload.get("extras") or {}).items()}


def _rows(group: dict) -> list[_Row]:
    """A checked, resolved group's rows, ordered by sample index (``sample_index`` /
    ``traj_index``)."""
    if not is_trajectory_group(group):
        rows = []
        for rr in sorted(group["responses"], key=lambda rr: rr["response"]["sample_index"]):
            resp, summary = rr["payload"], rr["response"]
            rows.append(_Row(prompt=_ints(resp["prompt_token_ids"]), response=_ints(resp["response_token_ids"]),
                             logprobs=_floats(resp["infer_logprobs"]), mask=None,
                             reward=rr["response_level_reward"], sample_index=summary["sample_index"],
                             prompt_id=summary["prompt_id"], policy_version=summary["policy_version"],
                             extras=_extras(resp)))
        return rows
    rows = []
    for traj in sorted(group["trajectories"], key=lambda tr: tr["traj_index"]):
        payload = traj["payload"]
        turns = payload["turns"]
        tokens, logprobs = [], []
        for t, turn in enumerate(turns):
            if t > 0:  # the environment's answer to the previous turn: not the model's tokens
                env = _ints(turn["prompt_token_ids"])
                tokens.append(env)
                logprobs.append(np.zeros(len(env), dtype=np.float32))
            tokens.append(_ints(turn["response_token_ids"]))
            logprobs.append(_floats(turn["infer_logprobs"]))
        rows.append(_Row(
            prompt=_ints(turns[0]["prompt_token_ids"]) if turns else _ints([]),
            response=np.concatenate(tokens) if tokens else _ints([]),
            logprobs=np.concatenate(logprobs) if logprobs else _floats([]),
            mask=np.asarray(payload["response_mask"], dtype=np.float32).reshape(-1),
            reward=traj["response_level_rewards"], sample_index=traj["traj_index"], prompt_id=group["group_key"],
            policy_version=traj["policy_version"], extras=_extras(payload)))
    return rows


def _extras_tensors(rows: list[_Row], T: int) -> dict[str, Tensor]:
    """``(B, T, *rest)`` zero-padded tensors of the extras every row has (see RolloutBatch)."""
    names = set(rows[0].extras)
    for row in rows[1:]:
        names &= set(row.extras)
    out = {}
    for name in sorted(names):
        arrays = [row.extras[name] for row in rows]
        rest = {tuple(a.shape[1:]) for a in arrays}
        if len(rest) != 1:
            raise ValueError(f"extras[{name!r}]: rows disagree on the shape beyond the token axis: {sorted(rest)}")
        dtype = np.result_type(*(a.dtype for a in arrays))
        dtype = np.dtype(EXTRAS_TORCH_DTYPE.get(dtype.name, dtype))
        padded = np.zeros((len(rows), T, *rest.pop()), dtype=dtype)
        for b, array in enumerate(arrays):
            padded[b, :array.shape[0]] = array
        out[name] = torch.from_numpy(padded)
    return out


def build_batch(groups: Sequence[dict], step: int, pad_token_id: int, adv_estimator: str = "grpo") -> RolloutBatch:
    """Pad resolved ``Group`` / ``TrajectoryGroup`` records into one ``RolloutBatch``.

    Args:
        groups: decoded records, RLVR and agentic in any mix, with every member's ``payload``
            resolved (the decoded ``Response`` / ``Trajectory``, not a ``PayloadRef``; see
            ``rollstream.trainer.intake.resolve_payloads``): a ``Group`` (``responses`` = list of
            ``RewardedResponse``) gives one row per response; a ``TrajectoryGroup``
            (``trajectories`` = list of ``TrajectorySummary``) gives one row per trajectory,
            laid out as in the module doc. Groups may differ in size.
        step: training step recorded on the batch.
        pad_token_id: token id written at padded positions of ``prompt_ids`` / ``response_ids``.
        adv_estimator: one of ``ADV_ESTIMATORS`` (see ``group_advantages``).

    Returns:
        A ``RolloutBatch``; rows are ordered by group (in ``groups`` order), then by
        ``sample_index`` (``traj_index``). ``advantages`` are ``group_advantages`` of each
        group's rewards, broadcast over each row's ``response_mask``. ``extras``: see RolloutBatch.

    Raises:
        ValueError: ``groups`` is empty, ``adv_estimator`` is unknown, or a group fails ``check_group`` / ``check_payloads``
            (no responses / trajectories, a payload not resolved, logprob/token length mismatch,
            bad response_mask, no prompt tokens, non-finite reward, repeated sample_index /
            traj_index, an extras array not along the response), or the rows' extras of one
            name disagree beyond the token axis.
    """
    if not groups:
        raise ValueError("build_batch needs at least one group, got an empty sequence")
    resolve_estimator(adv_estimator)
    rows: list[_Row] = []
    group_index: list[int] = []
    group_rewards: list[Tensor] = []
    for gi, group in enumerate(groups):
        check_group(group)
        check_payloads(group)
        grows = _rows(group)
        rows += grows
        group_index += [gi] * len(grows)
        group_rewards.append(torch.tensor([r.reward for r in grows], dtype=torch.float32))

    B = len(rows)
    P = max(len(row.prompt) for row in rows)
    T = max(len(row.response) for row in rows)
    prompt_ids = np.full((B, P), pad_token_id, dtype=np.int64)
    prompt_mask = np.zeros((B, P), dtype=np.int64)
    response_ids = np.full((B, T), pad_token_id, dtype=np.int64)
    response_mask = np.zeros((B, T), dtype=np.float32)
    infer_logprobs = np.zeros((B, T), dtype=np.float32)
    for b, row in enumerate(rows):  # one slice copy per row and array, never per token
        if len(row.prompt):
            prompt_ids[b, P - len(row.prompt):] = row.prompt
            prompt_mask[b, P - len(row.prompt):] = 1
        n = len(row.response)
        if n:
            response_ids[b, :n] = row.response
            infer_logprobs[b, :n] = row.logprobs
            response_mask[b, :n] = 1.0 if row.mask is None else row.mask
    response_mask_t = torch.from_numpy(response_mask)

    row_advantages = torch.cat(group_advantages(group_rewards, adv_estimator))  # (B,)
    return RolloutBatch(
        prompt_ids=torch.from_numpy(prompt_ids),
        prompt_mask=torch.from_numpy(prompt_mask),
        response_ids=torch.from_numpy(response_ids),
        response_mask=response_mask_t,
        infer_logprobs=torch.from_numpy(infer_logprobs),
        response_lengths=torch.tensor([len(row.response) for row in rows], dtype=torch.int64),
        response_level_rewards=torch.cat(group_rewards),
        advantages=row_advantages[:, None] * response_mask_t,
        group_index=torch.tensor(group_index, dtype=torch.int64),
        group_keys=[g["group_key"] for g in groups],
        prompt_ids_str=[row.prompt_id for row in rows],
        sample_index=[row.sample_index for row in rows],
        policy_versions=[row.policy_version for row in rows],
        step=step,
        extras=_extras_tensors(rows, T),
    )


@overload
def group_advantages(rewards: Tensor, estimator: str = ..., eps: float = ...) -> Tensor: ...
@overload
def group_advantages(rewards: Sequence[Tensor], estimator: str = ..., eps: float = ...) -> list[Tensor]: ...


def group_advantages(rewards, estimator: str = "grpo", eps: float = GRPO_EPS):
    """Per-response advantages from each group's rewards (outcome supervision: one scalar per
    response, broadcast over its tokens by ``build_batch``).

    Estimators, for a group of ``n`` rewards ``r`` with mean ``m``:

    - ``grpo``: ``(r_i - m) / (std(r) + eps)``, std unbiased (n - 1) (Shao et al. 2024,
      DeepSeekMath, section 4.1.2; the reference computes its std the same way).
    - ``dr_grpo``: ``r_i - m``, no std division, which biases updates towards groups with a
      small reward spread (Liu et al. 2025, "Understanding R1-Zero-Like Training", section 3.2).
      Dr. GRPO's other change, no per-response length normalisation, is the loss's
      ``loss_agg_mode: token-mean``.
    - ``rloo``: ``r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - m)``, the leave-one-out
      baseline (Ahmadian et al. 2024, "Back to Basics", section 3.2).

    Args:
        rewards: ``(G, n)`` float tensor, one row per group of ``n`` responses; or a sequence of
            ``G`` 1-D tensors ``(n_g,)`` for groups of unequal size. Integer rewards are cast to
            float32.
        estimator: one of ``ADV_ESTIMATORS``.
        eps: added to the std before dividing (``grpo`` only).

    Returns:
        Advantages shaped like ``rewards``: a ``(G, n)`` tensor, or a list of ``(n_g,)`` tensors.
        Every estimator gives exactly 0 to a group of size 1 (no baseline from one sample) and
        to a group whose rewards are all equal (ties: no learning signal); rounding of the mean
        cannot make them non-zero.

    Raises:
        ValueError: an unknown ``estimator``, a NaN or infinite reward, or ``rewards`` not 2-D /
            a sequence of 1-D tensors.
    """
    fn = resolve_estimator(estimator)
    if isinstance(rewards, Tensor):
        return _advantages_2d(_as_float(rewards, 2), fn, eps, offset=0)
    out: list[Tensor] = []
    for g, r in enumerate(rewards):  # one vectorised call per group; never per token
        out.append(_advantages_2d(_as_float(r, 1)[None, :], fn, eps, offset=g)[0])
    return out


@overload
def grpo_advantages(rewards: Tensor, eps: float = ..., norm_by_std: bool = ...) -> Tensor: ...
@overload
def grpo_advantages(
    rewards: Sequence[Tensor], eps: float = ..., norm_by_std: bool = ...
) -> list[Tensor]: ...


def grpo_advantages(rewards, eps: float = GRPO_EPS, norm_by_std: bool = True):
    """GRPO group-normalised advantages: ``A_i = (r_i - mean(r)) / (std(r) + eps)`` per group
    (``group_advantages`` with ``grpo``, or ``dr_grpo`` when ``norm_by_std`` is False).

    Args:
        rewards: ``(G, n)`` float tensor, one row per group of ``n`` responses; or a sequence of
            ``G`` 1-D tensors ``(n_g,)`` for groups of unequal size. Integer rewards are cast to
            float32.
        eps: added to the std before dividing.
        norm_by_std: divide by ``std + eps`` (GRPO); False keeps only ``r - mean`` (Dr. GRPO).

    Returns:
        Advantages shaped like ``rewards``: a ``(G, n)`` tensor, or a list of ``(n_g,)`` tensors.
        A group of size 1 (std undefined) and a group whose rewards are all equal get exactly 0.

    Raises:
        ValueError: a reward is NaN or infinite, or ``rewards`` is not 2-D / a sequence of 1-D.

    Note:
        Formula: Shao et al. 2024, DeepSeekMath, section 4.1.2. The std is torch's default unbiased
        estimator (denominator n - 1), as in the reference.
        ``norm_by_std=False``: Liu et al. 2025 (Dr. GRPO). Constant groups are set to 0 exactly
        instead of ``(r - mean) / eps``, which float32 rounding of the mean can make non-zero.
    """
    return group_advantages(rewards, "grpo" if norm_by_std else "dr_grpo", eps)


def grpo_estimator(centred: Tensor, rewards: Tensor, eps: float) -> Tensor:
    """``grpo``: ``(r_i - m) / (std(r) + eps)``, std unbiased (n - 1). ``centred``: ``r - m``;
    all ``(G, n)`` float."""
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def dr_grpo_estimator(centred: Tensor, rewards: Tensor, eps: float) -> Tensor:
    """``dr_grpo``: ``r_i - m``."""
    return centred


def rloo_estimator(centred: Tensor, rewards: Tensor, eps: float) -> Tensor:
    """``rloo``: ``r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - m)``."""
    n = rewards.shape[1]
    return centred * (n / (n - 1))


def resolve_estimator(estimator: str) -> Callable[[Tensor, Tensor, float], Tensor]:
    """The estimator ``estimator`` names (built-in, or an import path); ValueError when none."""
    try:
        return ADV_ESTIMATORS.get_named(estimator)
    except ConfigError as exc:
        raise ValueError(str(exc)) from exc


def _as_float(r: Tensor, dim: int) -> Tensor:
    if not isinstance(r, Tensor) or r.dim() != dim:
        got = f"{r.dim()}-D tensor" if isinstance(r, Tensor) else type(r).__name__
        raise ValueError(f"group advantages expect {'a (G, n)' if dim == 2 else 'per-group 1-D'} "
                         f"reward tensors, got a {got}")
    return r if r.is_floating_point() else r.to(torch.float32)


def _advantages_2d(r: Tensor, estimator: Callable[[Tensor, Tensor, float], Tensor], eps: float,
                   offset: int) -> Tensor:
    """``r``: (G, n) floating rewards; ``offset`` numbers groups in error messages."""
    bad = ~torch.isfinite(r)
    if bad.any():
        g, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"non-finite reward {r[g, i].item()} in group {g + offset} at position {i}; "
            "NaN/inf rewards must be rejected upstream (reason invalid_reward)"
        )
    n = r.shape[1]
    if n <= 1:
        return torch.zeros_like(r)  # no baseline (nor std) from one sample: no learning signal
    centred = estimator(r - r.mean(dim=1, keepdim=True), r, eps)
    constant = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    return centred.masked_fill(constant, 0.0)
