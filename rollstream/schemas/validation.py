"""Consistency checks of decoded events beyond what Avro enforces (lengths that must agree,
finite numbers). Shared by the processors that accept an event and the trainer that uses it, so
an event the trainer would refuse is refused where it enters."""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from rollstream.schemas.packed import unpack_array


def check_trajectory(traj: dict, where: str = "") -> None:
    """Raise ``ValueError`` unless a decoded ``Trajectory`` record can be trained.

    Checks: ``turns[0].prompt_token_ids`` non-empty (when there are turns; a trajectory without
    turns is an all-padding placeholder), per turn as many ``infer_logprobs`` as
    ``response_token_ids``, a ``response_mask`` of 0/1 values exactly as long as the flattened
    response (``sum len(response_k) + sum_{k>=1} len(prompt_k)``), every ``extras`` array with
    that many entries along its first dimension, a finite ``response_level_rewards``. ``where``
    prefixes the message (default: the identity).

    The arrays may be the numpy views a decoded record holds (packed fields) or plain sequences
    (a record built in memory); the mask check is one vectorised pass either way.
    """
    where = where or (f"trajectory {traj.get('mode')}/{traj.get('group_id')}/{traj.get('episode_id')}/"
                      f"{traj.get('traj_index')}")
    turns = traj["turns"]
    if turns and not len(turns[0]["prompt_token_ids"]):
        raise ValueError(f"{where}: turns[0] has no prompt tokens")
    n_flat = 0
    for t, turn in enumerate(turns):
        n_tok, n_lp = len(turn["response_token_ids"]), len(turn["infer_logprobs"])
        if n_tok != n_lp:
            raise ValueError(f"{where} turn {t}: {n_tok} response tokens but {n_lp} infer_logprobs")
        n_flat += n_tok + (len(turn["prompt_token_ids"]) if t else 0)
    mask = traj["response_mask"]
    if len(mask) != n_flat:
        raise ValueError(f"{where}: response_mask has {len(mask)} entries but the flattened response "
                         f"has {n_flat} tokens")
    values = np.asarray(mask)
    if values.size and not (values.dtype == np.uint8 and int(values.max()) <= 1):
        bad = np.unique(values[(values != 0) & (values != 1)])
        if bad.size:
            raise ValueError(f"{where}: response_mask values must be 0 or 1, got {sorted(bad.tolist())}")
    check_extras(traj, n_flat, where)
    reward = traj["response_level_rewards"]
    if not math.isfinite(reward):
        raise ValueError(f"{where}: non-finite response_level_rewards {reward} "
                         "(such groups must be rejected upstream with reason invalid_reward)")


def check_extras(payload: Mapping, n_tokens: int, where: str) -> None:
    """Raise ``ValueError`` unless every ``extras`` entry of a payload (``Response``: along its
    response tokens; ``Trajectory``: along its flattened response) is a consistent ``PackedArray``
    (or array) whose first dimension is ``n_tokens``. ``where`` prefixes the message."""
    for name, packed in (payload.get("extras") or {}).items():
        try:
            array = unpack_array(packed) if isinstance(packed, Mapping) else np.asarray(packed)
        except ValueError as exc:
            raise ValueError(f"{where}: extras[{name!r}]: {exc}") from None
        if array.ndim < 1 or array.shape[0] != n_tokens:
            raise ValueError(f"{where}: extras[{name!r}] has shape {tuple(array.shape)}; its first dimension must "
                             f"be the {n_tokens} response tokens")
