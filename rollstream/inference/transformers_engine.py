"""The transformers engine: batched sampling with ``model.generate`` on a CPU or one GPU, seeded
per sample so a sample depends only on its own request."""

from __future__ import annotations

import logging
import os
from typing import Sequence

import torch
from transformers import GenerationConfig, LogitsProcessorList

from rollstream.inference.engine import Sample, SamplingParams, check_args, error_samples
from rollstream.policy.model import load_model, load_weights_into, resolve_device
from rollstream.runtime import now_ms
from rollstream.schemas.records import FINISH_LENGTH, FINISH_STOP

log = logging.getLogger(__name__)


def _row_seed(seed: int, index: int) -> int:
    """Independent 63-bit seed for sample ``index`` of a request seeded ``seed`` (splitmix64)."""
    x = (seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, both ``(len(prompts), width)`` int64 with ``width`` the
    longest prompt: left padding with ``pad_id``, so the last prompt token of every row is at the
    edge, for ``generate`` to extend every row at once."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        input_ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attention[r, width - len(p):] = 1
    return input_ids, attention


class _SeededSampler:
    """A logits processor that does the sampling itself, one torch.Generator per row.

    model.generate runs greedy (do_sample=False) and this processor turns the scores into a
    one-hot on the token it drew, so argmax picks it. Per-row generators make a sample depend
    only on its own request (prompt, params, seed, sample index), not on which other requests
    shared its batch. Temperature/top-p are applied here, so HF's own warpers are not used;
    ``output_logits`` still returns the raw logits for the logprobs.

    Sampling is Gumbel-max: argmax(logits/T + G) ~ softmax(logits/T). Unlike inverting a CDF
    over ~49k near-equal tail tokens, the argmax barely moves when logits shift by fp noise
    (e.g. other left padding), so samples stay stable across batch compositions.

    It also records, per step, the raw log-probability of the token it drew (``logprobs``, one
    ``(rows,)`` float32 tensor per step), so generate never has to keep every step's
    ``(rows, vocab)`` logits (``output_logits``: rows x steps x vocab floats, 6 GB for 64 rows
    of 512 tokens), and large engine batches fit.
    """

    def __init__(self, rows: list[tuple[float, float, int]], device: torch.device) -> None:
        # rows: (temperature, top_p, seed) per batch row
        self.temperature = torch.tensor([max(t, 0.0) for t, _, _ in rows], dtype=torch.float32)
        self.top_p = torch.tensor([p for _, p, _ in rows], dtype=torch.float32, device=device)
        self.greedy = (self.temperature <= 0.0).to(device)
        self.any_greedy = bool(self.greedy.any())
        self.nucleus = bool((self.top_p < 1.0).any())  # skip the vocab sort when unused
        # CPU generators: device-independent streams, so a seed means the same on CPU and GPU.
        self.generators = [torch.Generator(device="cpu").manual_seed(s) for _, _, s in rows]
        self._noise: torch.Tensor | None = None  # reused (rows, vocab) buffer: no per-step allocs
        self.logprobs: list[torch.Tensor] = []
        self.first_token_ms: int | None = None  # epoch ms when the first token was drawn (after prefill)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # ``scores``: this step's raw logits (no processor runs before this one); read only.
        if self.first_token_ms is None:
            self.first_token_ms = now_ms()
        if self._noise is None or self._noise.shape != scores.shape:
            self._noise = torch.empty(scores.shape, dtype=torch.float32)
        noise = self._noise
        for row, gen in enumerate(self.generators):
            noise[row].uniform_(generator=gen)  # drawn for greedy rows too: fixed stream layout
        noise.clamp_(min=1e-20, max=1.0 - 1e-7).log_().neg_().log_().neg_()  # Gumbel(0, 1)
        noise = noise.to(scores.device)
        # argmax(l/T + G) == argmax(l + T*G) for T > 0; saves dividing the logits.
        noise.mul_(self.temperature.to(scores.device)[:, None]).add_(scores.float())
        if self.nucleus:
            # Keep the smallest prefix (by prob) whose mass reaches top_p; top token always kept.
            temp = torch.where(self.greedy, torch.ones_like(self.top_p), self.temperature.to(scores.device))
            probs = torch.softmax(scores.float() / temp[:, None], dim=-1)
            sorted_p, order = torch.sort(probs, dim=-1, descending=True)
            drop_sorted = ((torch.cumsum(sorted_p, dim=-1) - sorted_p) >= self.top_p[:, None]) & (
                self.top_p[:, None] < 1.0
            )
            noise.masked_fill_(torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted), float("-inf"))
        chosen = noise.argmax(dim=-1)
        if self.any_greedy:
            chosen = torch.where(self.greedy, scores.argmax(dim=-1), chosen)
        raw = scores.float()
        self.logprobs.append(raw.gather(-1, chosen[:, None]).squeeze(-1) - torch.logsumexp(raw, dim=-1))
        # HF keeps no processed scores (output_scores is off), so the buffer can be the result.
        noise.fill_(float("-inf")).scatter_(1, chosen[:, None], 0.0)
        return noise


class TransformersBackend:
    """Batched sampling with transformers ``model.generate`` (CPU or a single GPU).

    Each prompt is expanded ``n`` times into rows; rows are grouped by ``max_new_tokens``,
    sorted by prompt length (less padding) and run ``max_num_seqs`` rows per ``generate`` call,
    left-padded (config ``actor_infer.max_num_seqs``). The rows of a call that share a prompt
    share one prefill pass over it (``share_prefill``; ``_prefill``). Decoding reads every
    weight once per step whatever the rows, so bigger calls pay: on 2 CPU cores 64 rows of
    SmolLM2 (16 tokens) took about 19 s at 8 rows per call, 12.5 s at 16 and 9 s at 32 before
    the shared prefill, 6 s at 32 with it (benchmarks/generation_batch.py).
    An exception inside a chunk turns that chunk's rows into error samples.

    ``model_dir``: a model folder or a hub id in the local cache (None: the bundled model);
    ``device``: ``cpu``, ``cuda`` or ``auto`` (rollstream.policy.model.resolve_device). eos and
    pad are the model's (rollstream.policy.model.load_tokenizer). Raises ConfigError for a
    missing or incomplete model folder or an unusable device.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_num_seqs: int = 32,
        share_prefill: bool = True,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        device = resolve_device(device) if isinstance(device, str) else device
        self.tokenizer, self.model = load_model(dtype=dtype, device=device, model_dir=model_dir)
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        self.share_prefill = share_prefill
        self.policy_version = 0
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id
        self.first_token_ms: int | None = None  # epoch ms of the first token this backend drew

    # -- generation ---------------------------------------------------------------------

    def generate(
        self, prompt_token_ids: list[list[int]], n: list[int], params: list[SamplingParams]
    ) -> list[list[Sample]]:
        """See GenerationBackend.generate. Token ids are ints < vocab size; logprobs float32
        values widened to Python floats."""
        check_args(prompt_token_ids, n, params)
        out: list[list[Sample | None]] = [[None] * max(int(k), 0) for k in n]
        # rows: (prompt index, sample index)
        rows = [(i, j) for i, k in enumerate(n) for j in range(max(int(k), 0))]
        rows.sort(key=lambda r: (params[r[0]].max_new_tokens, len(prompt_token_ids[r[0]])))
        chunks: list[list[tuple[int, int]]] = []
        for r in rows:
            if chunks and len(chunks[-1]) < self.max_num_seqs and (
                params[chunks[-1][0][0]].max_new_tokens == params[r[0]].max_new_tokens
            ):
                chunks[-1].append(r)
            else:
                chunks.append([r])
        for chunk in chunks:
            try:
                samples = self._generate_chunk(
                    [prompt_token_ids[i] for i, _ in chunk],
                    [(params[i], j) for i, j in chunk],
                )
            except Exception as exc:  # OOM, bad ids, anything: report, never raise
                log.exception("generation chunk of %d rows failed", len(chunk))
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()  # give an OOM'd allocator a chance on the next chunk
                samples = error_samples(len(chunk), f"{type(exc).__name__}: {exc}"[:2000])
            for (i, j), s in zip(chunk, samples):
                out[i][j] = s
        return out  # type: ignore[return-value]

    def _generate_chunk(
        self, prompts: list[list[int]], row_params: list[tuple[SamplingParams, int]]
    ) -> list[Sample]:
        max_new = row_params[0][0].max_new_tokens
        if max_new < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        input_ids, attention = left_padded(prompts, self.pad_id)
        width = input_ids.shape[1]
        distinct: dict[tuple[int, ...], int] = {}  # a prompt's tokens -> its row in the prefill
        row_of = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
        cache = None
        if self.share_prefill and width > 1 and len(distinct) < len(prompts):  # a request's samples
            cache = self._prefill(*left_padded(list(distinct), self.pad_id))  # the same width: the same longest prompt
            cache.batch_select_indices(torch.tensor(row_of, device=self.device))
        sampler = _SeededSampler(
            [(sp.temperature, sp.top_p, _row_seed(sp.seed, j)) for sp, j in row_params], self.device
        )
        # An explicit config, so generation_config.json defaults (top_k, penalties) never apply.
        config = GenerationConfig(
            max_new_tokens=max_new,
            do_sample=False,
            num_beams=1,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
        )
        with torch.inference_mode():
            sequences = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention.to(self.device),
                past_key_values=cache,
                generation_config=config,
                logits_processor=LogitsProcessorList([sampler]),
            )
            new_tokens = sequences[:, width:].cpu()
            # one entry per step: the drawn token of a live row is the one generate emitted
            # (rows that finished are cut at their eos below)
            lp = torch.stack(sampler.logprobs, dim=1).cpu()
        if self.first_token_ms is None:
            self.first_token_ms = sampler.first_token_ms
        samples = []
        for r in range(len(prompts)):
            ids = new_tokens[r].tolist()
            if self.eos_id in ids:
                # generate pads a finished row, so everything after its first eos is padding
                end = ids.index(self.eos_id) + 1
                reason = FINISH_STOP
            else:
                end = len(ids)
                reason = FINISH_LENGTH
            ids = ids[:end]
            samples.append(
                Sample(
                    token_ids=ids,
                    logprobs=lp[r, :end].tolist(),
                    text=self.tokenizer.decode(ids, skip_special_tokens=True),
                    finish_reason=reason,
                )
            )
        return samples

    def _prefill(self, input_ids: torch.Tensor, attention: torch.Tensor):
        """The KV cache of every token but the last of each distinct prompt (``(prompts, width)``
        left-padded), for ``generate`` to extend: it feeds the rows' last prompt tokens itself.
        Rows of one request then share one prompt pass instead of one each (on 2 CPU cores the
        prefill of 8 samples of a 43-token prompt was over half of their generation). Positions
        follow generate's own rule (the attention mask's running count), so a shared prefill
        gives the rows the cache they would have built alone."""
        input_ids, attention = input_ids[:, :-1].to(self.device), attention[:, :-1].to(self.device)
        positions = (attention.cumsum(-1) - 1).masked_fill_(attention == 0, 1)
        with torch.inference_mode():
            out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                             use_cache=True, logits_to_keep=1)
        return out.past_key_values

    # -- weights --------------------------------------------------------------------------

    def load_weights(self, path: str, version: int) -> None:
        """Load new weights (model folder, or a ``.safetensors``/``.pt`` state dict) into the
        live model and set ``policy_version``. A bad file leaves the old weights in place.
        Raises FileNotFoundError, or RollstreamError on a key/shape mismatch
        (see rollstream.policy.model.load_weights_into)."""
        load_weights_into(self.model, path)
        self.policy_version = int(version)
