"""Rollout batches and GRPO advantages: pure torch, no Kafka.

Capabilities and entry points:

- ``check_group(group)``: is one decoded ``Group`` (RLVR) or ``TrajectoryGroup`` (agentic) record
  trainable? ``ValueError`` says why.
- ``build_batch(groups, step, pad_token_id)``: decoded ``Group`` / ``TrajectoryGroup`` records, in
  any mix -> padded ``RolloutBatch`` with per-token advantages.
- ``grpo_advantages(rewards)``: group-normalised advantages, for a ``(G, n)`` tensor or for
  groups of unequal size.

The two kinds are told apart by key: a ``TrajectoryGroup`` has ``trajectories``, a ``Group`` has
``responses``. Each group becomes uniform rows (prompt tokens, response tokens, infer logprobs,
response mask, reward, sample index, prompt id, policy version), one per response / trajectory:

- RLVR response: prompt = its ``prompt_token_ids`` (or the group's), response = its
  ``response_token_ids``, every response token trained; sample index = ``sample_index``.
- Agentic trajectory: prompt = ``turns[0].prompt_token_ids``; response = ``turns[0].response
  + turns[1].prompt + turns[1].response + turns[2].prompt + ...``; mask = the trajectory's
  ``response_mask`` (1 = model token); infer logprobs at model-token positions, 0.0 at environment
  tokens; reward = ``response_level_rewards``; sample index = ``traj_index``; prompt id = the
  group's ``group_key``.

Layout (B = sum of rows over the groups, rows ordered by group, then by sample index)::

    prompt    | response
    0 0 p p p | r r e r 0      prompt_ids left-padded, response_ids right-padded (e = env token)
    0 0 1 1 1 | 1 1 0 1 0      prompt_mask, response_mask

Left-padded prompts make every response start at column P of ``cat([prompt_ids, response_ids])``,
so the logprob of response token t is read at position ``P - 1 + t`` for every row.

References:

- GRPO advantage: Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in
  Open Language Models", section 4.1.2 (outcome supervision).
- Mean-only variant (``norm_by_std=False``): Liu et al. 2025, "Understanding R1-Zero-Like Training:
  A Critical Perspective" (Dr. GRPO).
- Unbiased std (n - 1) as torch's default, like the reference query filter:
  reference-behaviour.md section (b).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Sequence, overload

import torch
from torch import Tensor

from rollstream.schemas.records import is_trajectory_group
from rollstream.schemas.validation import check_trajectory

GRPO_EPS = 1e-6
"""Added to the group std before dividing, so a near-constant group cannot blow up."""


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
      correction (reference-behaviour.md (h)).
    - ``response_lengths``: ``(B,) int64``, real tokens in each row's response (model and
      environment tokens); positions from there on are padding.
    - ``response_level_rewards``: ``(B,) float32``, the scalar reward of each row.
    - ``advantages``: ``(B, T) float32``, the row's GRPO advantage broadcast over its trained
      tokens (``response_mask == 1``), 0 at padding and environment tokens.
    - ``group_index``: ``(B,) int64``, index in ``group_keys`` of the row's group.

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
        """A copy with every tensor moved to ``device``; lists and step are shared."""
        moved = {
            f.name: (v.to(device) if isinstance(v := getattr(self, f.name), Tensor) else v)
            for f in fields(self)
        }
        return RolloutBatch(**moved)


@dataclass(frozen=True)
class _Row:
    """One batch row before padding, the same for an RLVR response and an agentic trajectory."""

    prompt: list[int]
    response: list[int]
    logprobs: list[float]  # len(response); 0.0 at environment tokens
    mask: list[int] | None  # len(response), 1 = trained; None = every token trained
    reward: float
    sample_index: int
    prompt_id: str
    policy_version: int


def check_group(group: dict) -> None:
    """Raise ``ValueError`` unless ``group`` can go into a batch.

    ``group`` is a decoded ``Group`` (RLVR, has ``responses``) or ``TrajectoryGroup`` (agentic,
    has ``trajectories``) record.

    A trainable ``Group`` has at least one response; every response has prompt tokens (its own or
    the group's), as many ``infer_logprobs`` as ``response_token_ids``, a finite
    ``response_level_reward`` and a ``sample_index`` unique within the group.

    A trainable ``TrajectoryGroup`` has at least one trajectory; every trajectory has a
    ``traj_index`` unique within the group, at least one turn with ``turns[0].prompt_token_ids``
    non-empty, per turn as many ``infer_logprobs`` as ``response_token_ids``, a ``response_mask``
    of 0/1 values exactly as long as the flattened response, and a finite
    ``response_level_rewards``.
    """
    if is_trajectory_group(group):
        _check_trajectory_group(group)
        return
    key = group.get("group_key", "?")
    responses = group.get("responses") or []
    for rr, idx in _unique_members(key, responses, "responses", lambda rr: rr["response"]["sample_index"],
                                   "sample_index"):
        resp = rr["response"]
        n_tok, n_lp = len(resp["response_token_ids"]), len(resp["infer_logprobs"])
        if n_tok != n_lp:
            raise ValueError(
                f"group {key!r} sample {idx}: {n_tok} response tokens but {n_lp} infer_logprobs"
            )
        if not (resp["prompt_token_ids"] or group.get("prompt_token_ids")):
            raise ValueError(f"group {key!r} sample {idx}: no prompt tokens")
        reward = rr["response_level_reward"]
        if not math.isfinite(reward):
            raise ValueError(
                f"group {key!r} sample {idx}: non-finite response_level_reward {reward} "
                "(such groups must be rejected upstream with reason invalid_reward)"
            )


def _check_trajectory_group(group: dict) -> None:
    key = group.get("group_key", "?")
    trajectories = group.get("trajectories") or []
    for traj, idx in _unique_members(key, trajectories, "trajectories", lambda t: t["traj_index"], "traj_index"):
        check_trajectory(traj, where=f"group {key!r} trajectory {idx}")


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


def _rows(group: dict) -> list[_Row]:
    """A checked group's rows, ordered by sample index (``sample_index`` / ``traj_index``)."""
    if not is_trajectory_group(group):
        ordered = sorted(group["responses"], key=lambda rr: rr["response"]["sample_index"])
        return [
            _Row(prompt=rr["response"]["prompt_token_ids"] or group["prompt_token_ids"],
                 response=rr["response"]["response_token_ids"],
                 logprobs=rr["response"]["infer_logprobs"], mask=None,
                 reward=rr["response_level_reward"], sample_index=rr["response"]["sample_index"],
                 prompt_id=rr["response"]["prompt_id"],
                 policy_version=rr["response"]["policy_version"])
            for rr in ordered
        ]
    rows = []
    for traj in sorted(group["trajectories"], key=lambda tr: tr["traj_index"]):
        turns = traj["turns"]
        response: list[int] = []
        logprobs: list[float] = []
        for t, turn in enumerate(turns):
            if t > 0:  # the environment's answer to the previous turn: not the model's tokens
                response += turn["prompt_token_ids"]
                logprobs += [0.0] * len(turn["prompt_token_ids"])
            response += turn["response_token_ids"]
            logprobs += turn["infer_logprobs"]
        rows.append(_Row(prompt=turns[0]["prompt_token_ids"] if turns else [], response=response,
                         logprobs=logprobs, mask=traj["response_mask"],
                         reward=traj["response_level_rewards"], sample_index=traj["traj_index"],
                         prompt_id=group["group_key"], policy_version=traj["policy_version"]))
    return rows


def build_batch(groups: Sequence[dict], step: int, pad_token_id: int) -> RolloutBatch:
    """Pad decoded ``Group`` / ``TrajectoryGroup`` records into one ``RolloutBatch``.

    Args:
        groups: decoded records, RLVR and agentic in any mix: ``Group``
            (``rollstream.events.Group``, ``responses`` = list of ``RewardedResponse``) gives one
            row per response;
            ``TrajectoryGroup`` (``trajectories`` = list of ``Trajectory``) gives one row per
            trajectory, laid out as in the module doc. Groups may differ in size.
        step: training step recorded on the batch.
        pad_token_id: token id written at padded positions of ``prompt_ids`` / ``response_ids``.

    Returns:
        A ``RolloutBatch``; rows are ordered by group (in ``groups`` order), then by
        ``sample_index`` (``traj_index``). ``advantages`` are ``grpo_advantages`` of each group's
        rewards, broadcast over each row's ``response_mask``.

    Raises:
        ValueError: ``groups`` is empty, or a group fails ``check_group`` (no responses /
            trajectories, logprob/token length mismatch, bad response_mask, no prompt tokens,
            non-finite reward, repeated sample_index / traj_index).
    """
    if not groups:
        raise ValueError("build_batch needs at least one group, got an empty sequence")
    rows: list[_Row] = []
    group_index: list[int] = []
    group_rewards: list[Tensor] = []
    for gi, group in enumerate(groups):
        check_group(group)
        grows = _rows(group)
        rows += grows
        group_index += [gi] * len(grows)
        group_rewards.append(torch.tensor([r.reward for r in grows], dtype=torch.float32))

    B = len(rows)
    P = max(len(row.prompt) for row in rows)
    T = max(len(row.response) for row in rows)
    prompt_ids = torch.full((B, P), pad_token_id, dtype=torch.int64)
    prompt_mask = torch.zeros((B, P), dtype=torch.int64)
    response_ids = torch.full((B, T), pad_token_id, dtype=torch.int64)
    response_mask = torch.zeros((B, T), dtype=torch.float32)
    infer_logprobs = torch.zeros((B, T), dtype=torch.float32)
    for b, row in enumerate(rows):  # one slice copy per row, never per token
        if row.prompt:
            prompt_ids[b, P - len(row.prompt):] = torch.tensor(row.prompt, dtype=torch.int64)
            prompt_mask[b, P - len(row.prompt):] = 1
        n = len(row.response)
        if n:
            response_ids[b, :n] = torch.tensor(row.response, dtype=torch.int64)
            infer_logprobs[b, :n] = torch.tensor(row.logprobs, dtype=torch.float32)
            response_mask[b, :n] = 1.0 if row.mask is None else torch.tensor(
                row.mask, dtype=torch.float32)

    row_advantages = torch.cat(grpo_advantages(group_rewards))  # (B,)
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        infer_logprobs=infer_logprobs,
        response_lengths=torch.tensor([len(row.response) for row in rows], dtype=torch.int64),
        response_level_rewards=torch.cat(group_rewards),
        advantages=row_advantages[:, None] * response_mask,
        group_index=torch.tensor(group_index, dtype=torch.int64),
        group_keys=[g["group_key"] for g in groups],
        prompt_ids_str=[row.prompt_id for row in rows],
        sample_index=[row.sample_index for row in rows],
        policy_versions=[row.policy_version for row in rows],
        step=step,
    )


@overload
def grpo_advantages(rewards: Tensor, eps: float = ..., norm_by_std: bool = ...) -> Tensor: ...
@overload
def grpo_advantages(
    rewards: Sequence[Tensor], eps: float = ..., norm_by_std: bool = ...
) -> list[Tensor]: ...


def grpo_advantages(rewards, eps: float = GRPO_EPS, norm_by_std: bool = True):
    """GRPO group-normalised advantages: ``A_i = (r_i - mean(r)) / (std(r) + eps)`` per group.

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
        estimator (denominator n - 1), as in the reference (reference-behaviour.md (b)).
        ``norm_by_std=False``: Liu et al. 2025 (Dr. GRPO). Constant groups are set to 0 exactly
        instead of ``(r - mean) / eps``, which float32 rounding of the mean can make non-zero.
    """
    if isinstance(rewards, Tensor):
        return _grpo_2d(_as_float(rewards, 2), eps, norm_by_std, offset=0)
    out: list[Tensor] = []
    for g, r in enumerate(rewards):  # one vectorised call per group; never per token
        out.append(_grpo_2d(_as_float(r, 1)[None, :], eps, norm_by_std, offset=g)[0])
    return out


def _as_float(r: Tensor, dim: int) -> Tensor:
    if not isinstance(r, Tensor) or r.dim() != dim:
        got = f"{r.dim()}-D tensor" if isinstance(r, Tensor) else type(r).__name__
        raise ValueError(f"grpo_advantages expects {'a (G, n)' if dim == 2 else 'per-group 1-D'} "
                         f"reward tensors, got a {got}")
    return r if r.is_floating_point() else r.to(torch.float32)


def _grpo_2d(r: Tensor, eps: float, norm_by_std: bool, offset: int) -> Tensor:
    """``r``: (G, n) floating rewards; ``offset`` numbers groups in error messages."""
    bad = ~torch.isfinite(r)
    if bad.any():
        g, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"non-finite reward {r[g, i].item()} in group {g + offset} at position {i}; "
            "NaN/inf rewards must be rejected upstream (reason invalid_reward)"
        )
    if r.shape[1] <= 1:
        return torch.zeros_like(r)  # std of one sample is undefined: no learning signal
    centred = r - r.mean(dim=1, keepdim=True)
    if norm_by_std:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)  # unbiased, n - 1
    constant = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    return centred.masked_fill(constant, 0.0)
