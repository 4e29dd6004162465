"""Run by test_vllm_inprocess.py under the vLLM environment's interpreter: builds the in-process
VLLMBackend, loads perturbed weights in place and prints what changed, as JSON."""

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from rollstream.policy.model import model_folder
from rollstream.inference.engine import SamplingParams
from rollstream.inference.vllm_engine import VLLMBackend
from rollstream.trainer.logprobs import sequence_log_probs
from tests.inference.teacher_forcing import PROBE

def main(out_dir: str) -> None:
    backend = VLLMBackend(dtype="bfloat16", max_model_len=512, enforce_eager=True,
                          enable_chunked_prefill=False, max_num_batched_tokens=4096)
    engine = id(backend.llm)
    greedy = [SamplingParams(temperature=0.0, max_new_tokens=6)]
    before = backend.generate([PROBE], [1], greedy)[0][0]
    model = AutoModelForCausalLM.from_pretrained(model_folder(None), dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.02)
    model.save_pretrained(out_dir)
    backend.load_weights(out_dir, 1)
    after = backend.generate([PROBE], [1], greedy)[0][0]
    expected = sequence_log_probs(model, PROBE, after.token_ids)
    print("RESULT " + json.dumps({"same_engine": id(backend.llm) == engine, "version": backend.policy_version,
                      "before": [before.token_ids, before.logprobs], "after": [after.token_ids, after.logprobs],
                      "expected": expected}))


if __name__ == "__main__":  # the engine core is a spawned process: it re-imports this module
    main(sys.argv[1])
