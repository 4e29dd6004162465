"""Your own training loop on rollstream's accepted groups (rollstream.trainer.RolloutStream).

A complete loop: a model of your own (here a tiny random Llama built in place, or any Hugging
Face causal LM folder with ``--model``), your own loss (REINFORCE with the stream's advantages,
token-mean over the batch), a checkpoint per step that the generation workers can load, and
``batch.commit(checkpoint=...)``, which publishes it as the next policy version. A restart with
the same ``--run-dir`` continues after the last committed batch, from the newest checkpoint.

Run it in place of rollstream's own trainer, next to the pipeline's other stages started with
``rollstream worker <stage>`` (admission, aggregator, generation, reward; not ``rollstream run``,
which trains itself), or on its own with ``--demo-groups N``, which first publishes N accepted
groups of made-up responses (what the pipeline's aggregator would write)::

    python examples/own_trainer.py --bootstrap localhost:9092 --run-dir runs/own --demo-groups 4

Data-parallel: ``torchrun --nproc_per_node 2 examples/own_trainer.py ...`` shards each batch by
group over the ranks; the gradients are summed with ``Ranks.sum_gradients`` after dividing each
rank's loss by the whole batch's token count, so every rank takes the single-process step.
Prints one JSON line (rank 0): the outcome, the steps committed and the last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from rollstream.kafka.clients import make_producer
from rollstream.kafka.payloads import PayloadWriter
from rollstream.kafka.topics import Topics
from rollstream.schemas import encode
from rollstream.schemas.records import response_summary
from rollstream.trainer import RolloutStream
from rollstream.trainer.distributed import process_group_from_env

VOCAB = 64  # the tiny model's vocabulary; demo tokens stay below it
STATE_FILE = "trainer_state.json"  # saved with each checkpoint: what RolloutStream(resume=...) needs


def publish_demo_groups(bootstrap: str, prefix: str, count: int, seed: int = 0) -> list[str]:
    """Publish ``count`` accepted RLVR groups of 4 responses each, as rollstream's aggregator
    does: each Response on ``responses``, then the Group naming them by PayloadRef on
    ``groups.accepted``. Sample 0 of each group is rewarded 1, the others 0. Returns the keys."""
    rng = random.Random(seed)
    topics = Topics(prefix)
    producer = make_producer(bootstrap)
    keys = []
    try:
        writer = PayloadWriter(producer)
        for g in range(count):
            key = f"demo-{seed}-{g}"
            prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 6))]
            responses = []
            for i in range(4):
                tokens = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 5))]
                responses.append({"prompt_id": key, "domain": "demo", "prompt": "demo", "round": 0,
                                  "sample_index": i, "prompt_token_ids": prompt, "response_token_ids": tokens,
                                  "infer_logprobs": [-2.0] * len(tokens), "finish_reason": "stop"})
            refs = writer.write((topics.responses, key, encode(r, "Response")) for r in responses)
            group = {"group_key": key, "prompt_id": key, "domain": "demo", "accepted": True, "reason": "accepted",
                     "responses": [{"response": response_summary(r), "response_level_reward": float(r["sample_index"] == 0),
                                    "payload": ref} for r, ref in zip(responses, refs)]}
            producer.send(topics.groups_accepted, key=key.encode(), value=encode(group, "Group"))
            keys.append(key)
        producer.flush()
    finally:
        producer.close()
    return keys


def load_or_build_model(model: str | None, checkpoint: Path | None) -> torch.nn.Module:
    """The newest checkpoint if there is one, else ``model`` (a folder), else a tiny random Llama."""
    if checkpoint is not None or model is not None:
        return AutoModelForCausalLM.from_pretrained(checkpoint or model, torch_dtype=torch.float32)
    torch.manual_seed(0)  # every data-parallel rank builds the same weights
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True))


def latest_checkpoint(root: Path) -> Path | None:
    done = sorted(p for p in root.glob("v*") if (p / STATE_FILE).is_file())
    return done[-1] if done else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--prefix", default="rollstream.", help="the run's kafka.topic_prefix")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--model", help="a Hugging Face causal LM folder (default: a tiny random Llama)")
    parser.add_argument("--groups-per-batch", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--adv-estimator", default="grpo", choices=["grpo", "dr_grpo", "rloo"])
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--demo-groups", type=int, default=0, help="publish this many accepted groups first")
    args = parser.parse_args()

    with process_group_from_env("cpu") as ranks:
        if args.demo_groups and ranks.is_main:
            publish_demo_groups(args.bootstrap, args.prefix, args.demo_groups)
        checkpoints = args.run_dir / "checkpoints"
        latest = latest_checkpoint(checkpoints)
        model = load_or_build_model(args.model, latest)
        # generation workers load a checkpoint folder by path: it needs the tokenizer too
        tokenizer = AutoTokenizer.from_pretrained(args.model) if args.model else None
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        resume = None
        if latest is not None:  # a batch checkpointed but never committed is recorded, not redelivered
            resume = {**json.loads((latest / STATE_FILE).read_text()), "checkpoint": str(latest)}
        saved = None
        with RolloutStream(args.bootstrap, args.run_dir, groups_per_batch=args.groups_per_batch,
                           max_steps=args.max_steps, topic_prefix=args.prefix, adv_estimator=args.adv_estimator,
                           resume=resume, ranks=ranks) as stream:
            for batch in stream:
                # REINFORCE, token-mean over the whole batch: this rank's sum / every rank's tokens
                tokens = ranks.sum([float(batch.response_mask.sum())])[0]
                model.train()
                optimizer.zero_grad()
                loss = torch.zeros(())
                if batch.num_rows:  # an empty shard still joins sum_gradients below
                    log_probs = batch.log_probs(model, grad=True)
                    loss = -(batch.advantages * log_probs * batch.response_mask).sum() / max(tokens, 1.0)
                    loss.backward()
                ranks.sum_gradients(model.parameters())
                optimizer.step()
                saved = checkpoints / f"v{batch.step + 1:06d}"
                if ranks.is_main:
                    model.save_pretrained(saved)
                    if tokenizer is not None:
                        tokenizer.save_pretrained(saved)
                    # written last: a folder with it is complete
                    (saved / STATE_FILE).write_text(json.dumps(batch.trainer_state))
                batch.commit(checkpoint=saved, report={"loss": round(ranks.sum([float(loss)])[0], 6)})
        if ranks.is_main:
            last = stream.result.last
            print(json.dumps({"outcome": stream.result.outcome, "steps": stream.result.steps,
                              "last_step": last["step"] if last is not None else None,
                              "checkpoint": str(saved) if saved else None}))


if __name__ == "__main__":
    main()
