"""vLLM as an engine in this process (an optional dependency, imported only when built)."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

from rollstream.exceptions import RollstreamError
from rollstream.inference.engine import Sample, SamplingParams, check_args, error_samples
from rollstream.inference.vllm_extension import WORKER_EXTENSION
from rollstream.policy.model import load_tokenizer, model_folder
from rollstream.schemas.records import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP

log = logging.getLogger(__name__)


class VLLMBackend:
    """vLLM engine in this process behind the same interface (``pip install rollstream[vllm]``,
    or the CPU build in ``.venv-vllm``: ``make vllm-env``).

    vLLM's V1 sampler returns logprobs of the raw logits by default (``logprobs_mode=
    "raw_logprobs"``), matching TransformersBackend. ``model_dir`` as TransformersBackend's;
    ``tokenizer`` is the model's (load_tokenizer), for the workers' chat templating. Raises
    RuntimeError when vllm is missing, ConfigError for a missing or incomplete model folder.
    """

    def __init__(self, model_dir: str | os.PathLike | None = None, **llm_kwargs: Any) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError(
                "the 'vllm' generation backend needs the optional vllm package: "
                "pip install rollstream[vllm]  (or use backend='transformers')"
            )
        # vllm is an optional, heavy dependency with a torch of its own: it is imported only
        # when this backend is built, here and in generate.
        from vllm import LLM

        self._model_dir = str(model_folder(model_dir))
        self.tokenizer = load_tokenizer(model_dir)
        # refresh_output_embedding after each in-place reload (rollstream.inference.vllm_extension)
        llm_kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)
        self.llm = LLM(model=self._model_dir, **llm_kwargs)
        self.policy_version = 0

    def generate(
        self, prompt_token_ids: list[list[int]], n: list[int], params: list[SamplingParams]
    ) -> list[list[Sample]]:
        """See GenerationBackend.generate."""
        check_args(prompt_token_ids, n, params)
        from vllm import SamplingParams as VSamplingParams

        out: list[list[Sample]] = [[] for _ in n]
        live = [i for i, k in enumerate(n) if k > 0]
        if not live:
            return out
        try:
            vparams = [
                VSamplingParams(
                    n=int(n[i]), temperature=params[i].temperature, top_p=params[i].top_p,
                    max_tokens=params[i].max_new_tokens, seed=params[i].seed, logprobs=0,
                )
                for i in live
            ]
            prompts = [{"prompt_token_ids": list(prompt_token_ids[i])} for i in live]
            results = self.llm.generate(prompts, sampling_params=vparams, use_tqdm=False)
            for i, res in zip(live, results):
                for comp in res.outputs:
                    ids = list(comp.token_ids)
                    # logprobs=0 -> each step's dict holds just the sampled token
                    lps = [float(step[t].logprob) for t, step in zip(ids, comp.logprobs or [])]
                    if len(lps) != len(ids):
                        raise RollstreamError("vllm returned no logprob for some sampled tokens")
                    reason = comp.finish_reason if comp.finish_reason in (FINISH_STOP, FINISH_LENGTH) else FINISH_ERROR
                    err = None if reason != FINISH_ERROR else f"vllm finish_reason={comp.finish_reason}"
                    out[i].append(Sample(ids, lps, comp.text, reason, err))
        except Exception as exc:  # one vLLM call is one chunk: all or nothing
            log.exception("vllm generation failed")
            msg = f"{type(exc).__name__}: {exc}"[:2000]
            return [error_samples(max(int(k), 0), msg) for k in n]
        return out

    def load_weights(self, path: str, version: int) -> None:
        """Load new weights from a saved model folder into the live engine, in place (the
        workers' ``reload_weights``: same engine, same KV cache, no restart). Raises ValueError
        for a bare state-dict file, which vLLM cannot load by path; a failed load leaves the
        old weights and ``policy_version``."""
        if not Path(path).is_dir():
            raise ValueError(f"VLLMBackend.load_weights needs a saved model folder, got {path}")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
        self.llm.collective_rpc("refresh_output_embedding")
        self.llm.reset_prefix_cache()  # its blocks hold keys and values of the old weights
        self._model_dir = str(path)
        self.policy_version = int(version)
