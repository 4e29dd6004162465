"""The generation worker templates a chat prompt's messages (system turn included) when there are
any, else the prompt text as one user turn, and every Response carries the messages on (real
SmolLM2 tokenizer; a recording engine instead of sampling)."""

from __future__ import annotations

from rollstream.kafka.events import Input, Send
from rollstream.kafka.topics import Topics
from rollstream.policy.model import chat_prompt_ids, load_tokenizer
from rollstream.schemas import decode, encode
from rollstream.inference.engine import Sample, SamplingParams
from rollstream.workers.generation import GenerationWorker

CHAT = [{"role": "system", "content": "You are a terse calculator."}, {"role": "user", "content": "6 * 7?"}]


class Recording:
    """An engine that answers token 42 and records the prompts it was given."""

    policy_version = 0

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def generate(self, prompt_token_ids, n, params):
        self.prompts += prompt_token_ids
        return [[Sample([42], [-0.5], "x", "stop") for _ in range(k)] for k in n]


def request(prompt_id: str, prompt: str, messages: list[dict]) -> Input:
    record = {"prompt_id": prompt_id, "domain": "math", "mode": "train", "prompt": prompt, "ground_truth": "42",
              "messages": messages, "round": 0, "num_return_sequences": 1, "sample_offset": 0, "seed": 1,
              "created_ms": 0}
    value = encode(record, "GenerationRequest")
    return Input("GenerationRequest", decode(value)[1], "generation.requests", 0, 0, prompt_id.encode(), value)


def test_messages_are_templated_as_given_else_the_prompt_as_one_user_turn():
    tokenizer = load_tokenizer()
    engine = Recording()
    worker = GenerationWorker(engine, SamplingParams(max_new_tokens=1), Topics("t."), tokenizer=tokenizer)
    outputs = worker([request("chat", "6 * 7?", CHAT), request("text", "6 * 7?", [])])
    chat_ids, text_ids = chat_prompt_ids(tokenizer, CHAT), chat_prompt_ids(tokenizer, "6 * 7?")
    assert chat_ids != text_ids and "You are a terse calculator." in tokenizer.decode(chat_ids)
    assert engine.prompts == [chat_ids, text_ids]
    responses = [decode(out.value)[1] for out in outputs if isinstance(out, Send)]
    assert [(r["prompt_id"], r["prompt_token_ids"].tolist(), r["messages"]) for r in responses] == [
        ("chat", chat_ids, CHAT), ("text", text_ids, [])]
