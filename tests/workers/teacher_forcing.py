"""The logprobs a trainer computes for sampled tokens (float32, one forward pass), to hold an
inference engine's logprobs against; and the fixed prompt whose answer names an engine's weights."""

from __future__ import annotations

import torch

PROBE = [1, 504, 3458, 314, 3997, 28]


def teacher_forced(model, prompt: list[int], response: list[int]) -> list[float]:
    """log p(response[t] | prompt, response[:t]) under ``model``."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()
