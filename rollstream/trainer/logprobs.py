"""Per-token log-probabilities of a batch's sampled tokens under the training model
(``old_log_probs``), aligned with ``infer_logprobs`` and ``response_mask``.

The input of row b is ``cat([prompt_ids[b], response_ids[b]])``: the prompt left-padded to P
columns, the response right-padded to T. Response token t sits at column P + t and is predicted
by the logits at column P + t - 1. Position ids count real tokens only (``cumsum(mask) - 1``),
as the generation engine numbered them, so left padding does not shift positions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollstream.trainer.batch import RolloutBatch


def sequence_log_probs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> list[float]:
    """log p(response[t] | prompt, response[:t]) under ``model``, one unpadded forward pass on the
    model's device, log-softmax in float32: the trainer's logprob of each sampled token of one
    sample, to hold an inference engine's logprobs against. Returns ``len(response)`` floats
    (nats). Raises ValueError for an empty prompt or response."""
    if not prompt or not response:
        raise ValueError("sequence_log_probs needs a non-empty prompt and response")
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(response)], device=device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    picked = logits.log_softmax(-1).gather(-1, torch.tensor(list(response), device=device)[:, None])
    return picked.squeeze(-1).cpu().tolist()


def response_log_probs(model: torch.nn.Module, batch: RolloutBatch, micro_batch_size: int = 8,
                       grad: bool = False) -> Tensor:
    """log p(response_ids[b, t] | everything before it) under ``model``.

    Args:
        model: a causal LM (transformers ``AutoModelForCausalLM``) on the device it should run on.
        batch: the rollout batch; moved to the model's device row-chunk by row-chunk.
        micro_batch_size: rows per forward pass (memory: rows × (P + T) × vocab floats).
        grad: keep the autograd graph (the policy loss); False runs under ``torch.no_grad``.

    Returns:
        ``(B, T) float32`` on the model's device, in nats; 0.0 at padding positions (beyond
        ``response_lengths``). Environment tokens of agentic rows get their (unused) values;
        ``response_mask`` says which positions count.

    Raises:
        ValueError: ``micro_batch_size`` < 1.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    device = next(model.parameters()).device
    P = batch.prompt_ids.shape[1]
    T = batch.response_ids.shape[1]
    out = []
    with torch.set_grad_enabled(grad):
        for start in range(0, batch.batch_size, micro_batch_size):
            rows = slice(start, start + micro_batch_size)
            response_attention = batch.response_attention_mask[rows]
            input_ids = torch.cat([batch.prompt_ids[rows], batch.response_ids[rows]], dim=1).to(device)
            attention = torch.cat([batch.prompt_mask[rows], response_attention], dim=1).to(device)
            positions = (attention.cumsum(dim=1) - 1).clamp(min=0)
            # only the last T + 1 columns' logits (P-1 .. P+T-1): the vocabulary projection of
            # the prompt positions would be wasted work; column P-1+t predicts response token t
            logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                           logits_to_keep=T + 1).logits
            predicting = logits[:, :T, :].float()  # log_softmax in float32 whatever the model dtype
            targets = input_ids[:, P:P + T]
            logp = torch.log_softmax(predicting, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            out.append(torch.where(response_attention.to(device) > 0, logp, torch.zeros_like(logp)))
    if not out:  # no rows (a data-parallel rank's empty shard)
        return torch.zeros((0, T), dtype=torch.float32, device=device)
    return torch.cat(out, dim=0)
