"""Users' own prompts into a run: a plain {question, answer} JSONL and a verl-style
parquet (chat messages with a system turn) go through `rollstream produce-prompts --file` to the
RLVR stages on the real broker with the real model; the prompt the model sees is the templated
chat, and the chat travels on to the decided groups."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from rollstream.app.cli import app
from rollstream.app.stages import Stage
from rollstream.policy.model import chat_prompt_ids, load_tokenizer
from rollstream.tools.readback import read_values

from .harness import start_stages, wait_for, write_config

pytestmark = pytest.mark.integration

SYSTEM = {"role": "system", "content": "You are a careful solver. Reply with the number only."}
QUESTIONS = {"qa-00000": "What is 2 + 3?", "qa-00001": "What is 7 - 4?"}
CHATS = {"7": [SYSTEM, {"role": "user", "content": "What is 6 * 7?"}],
         "8": [SYSTEM, {"role": "user", "content": "What is 9 + 10?"}]}


def test_a_jsonl_and_a_verl_parquet_go_through_produce_prompts_into_a_run(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory(partitions=1)
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in zip(QUESTIONS.values(), "53")))
    verl = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "openai/gsm8k", "prompt": messages, "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"split": "train", "index": int(pid)}}
        for (pid, messages), truth in zip(CHATS.items(), ["42", "19"])]), verl)
    config = write_config(
        tmp_path, topics, 1, rollout_batch_size=4, num_return_sequences_in_group=2, max_prompts_per_batch=8,
        actor_infer={"max_batch": 4, "generating_args": {"max_new_tokens": 2}},
        rewards={"math": {"reward_type": "gsm8k", "query_filter_config": {"type": "no_filter"},
                          "response_filter_config": {"type": "default", "filter_args": {"reject_truncated": False}}}})
    stages = start_stages(config, kafka_broker, tmp_path / "logs", Stage.admission, Stage.generation, Stage.reward,
                          Stage.aggregator)
    runner = CliRunner()
    try:
        base = ["produce-prompts", "-c", str(config), "-b", kafka_broker, "--domain", "math"]
        first = runner.invoke(app, [*base, "--file", str(qa), "--prompt-key", "question", "--ground-truth-key",
                                    "answer", "--no-end"])
        assert (first.exit_code, first.output.strip()) == (0, "produced 2 prompts"), first.output
        second = runner.invoke(app, [*base, "--file", str(verl), "--messages-key", "prompt", "--ground-truth-key",
                                     "reward_model.ground_truth", "--id-key", "extra_info.index"])
        assert (second.exit_code, second.output.strip()) == (0, "produced 2 prompts, then the end-of-data marker")

        on_prompts = read_values(kafka_broker, topics.prompts)
        assert [p.get("prompt_id") for p in on_prompts] == ["qa-00000", "qa-00001", "7", "8", None]
        assert (on_prompts[-1]["prompts"], on_prompts[-1]["producer"]) == (2, "produce-prompts")  # the PromptsEnd

        wait_for(lambda: len(read_values(kafka_broker, topics.groups_accepted)) == 4, timeout=400,
                 what="4 accepted groups", stages=stages)
        tokenizer = load_tokenizer()
        expected = {**{pid: chat_prompt_ids(tokenizer, q) for pid, q in QUESTIONS.items()},
                    **{pid: chat_prompt_ids(tokenizer, m) for pid, m in CHATS.items()}}
        assert SYSTEM["content"] in tokenizer.decode(expected["7"])
        seen = {}
        for response in read_values(kafka_broker, topics.responses):
            seen.setdefault(response["prompt_id"], []).append(response["prompt_token_ids"].tolist())
            assert response["messages"] == CHATS.get(response["prompt_id"], [])
        assert seen == {pid: [ids, ids] for pid, ids in expected.items()}
        groups = {g["prompt_id"]: g for g in read_values(kafka_broker, topics.groups_accepted)}
        assert {pid: (g["prompt"], g["messages"], g["ground_truth"]) for pid, g in groups.items()} == {
            "qa-00000": ("What is 2 + 3?", [], "5"), "qa-00001": ("What is 7 - 4?", [], "3"),
            "7": ("What is 6 * 7?", CHATS["7"], "42"), "8": ("What is 9 + 10?", CHATS["8"], "19")}
        # the group carries the chat once: its members' copies are cut out
        assert all(m["response"]["messages"] == [] and m["response"]["prompt"] == ""
                   for g in groups.values() for m in g["responses"])
    finally:
        stages.close()
