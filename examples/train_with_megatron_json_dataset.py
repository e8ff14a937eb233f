"""The seed's `train_with_megatron_json_dataset.py` flow: alpaca JSON records, prompt-masked labels, padded
batches from `DataCollatorForSeq2Seq(**dataloader_config)`, a held-out eval loader, and PreTrainer.

    accelerate launch --config_file examples/accelerate/accelerate_megatron_config.yaml \
        examples/train_with_megatron_json_dataset.py \
        --pretrain_config_file examples/seed_configs/llama2-megatron-json-dataset.yaml

Unlike the seed's Megatron path, the labels (loss on the response and EOS only) and the eval loader
are used as given. Extra `key=value` arguments after the file override config keys.
"""

import json
import random

import torch
from transformers import AutoTokenizer, DataCollatorForSeq2Seq

from pretrainer import PreTrainer, PreTrainingArguments
from pretrainer.utils import parse_pretrain_args

PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
          "Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}")
EVAL_FRACTION = 0.05  # the seed holds out exactly 200 records, which fails on files with fewer


def alpaca_prompt(record: dict) -> str:
    prompt = PROMPT.format(instruction=record["instruction"])
    if record.get("input"):
        prompt += f"\n\n### Input:\n{record['input']}"
    return prompt + "\n\n### Response:\n"


def tokenize(tokenizer, record: dict, max_length: int) -> dict:
    """Prompt and response tokens; labels are -100 on the prompt (the loss is on the response and EOS)."""
    prompt = tokenizer(alpaca_prompt(record), truncation=True, max_length=max_length)["input_ids"]
    response = tokenizer(record.get("output", ""), add_special_tokens=False, truncation=True,
                         max_length=max_length)["input_ids"]
    input_ids = (prompt + response)[:max_length]
    if input_ids[-1] != tokenizer.eos_token_id and len(input_ids) < max_length:
        input_ids.append(tokenizer.eos_token_id)
    labels = [-100] * min(len(prompt), len(input_ids)) + input_ids[len(prompt):]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def main() -> None:
    cli = parse_pretrain_args()
    pretrain_args = PreTrainingArguments.from_yaml(cli.pretrain_config_file, cli.overrides)
    tokenizer = AutoTokenizer.from_pretrained(pretrain_args.tokenizer_path or pretrain_args.openmind_model_path)
    tokenizer.padding_side = "right"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = 0  # what the seed's get_tokenizer sets
    with open(pretrain_args.data_path, encoding="utf-8") as f:
        records = json.load(f)
    features = [tokenize(tokenizer, r, pretrain_args.seq_length) for r in records]
    random.Random(42).shuffle(features)
    held_out = max(1, int(len(features) * EVAL_FRACTION))
    collate = DataCollatorForSeq2Seq(tokenizer, **pretrain_args.get_dataloader_config())
    train_dataloader = torch.utils.data.DataLoader(features[held_out:], batch_size=pretrain_args.micro_batch_size,
                                                   shuffle=True, collate_fn=collate)
    eval_dataloader = torch.utils.data.DataLoader(features[:held_out], batch_size=pretrain_args.micro_batch_size,
                                                  collate_fn=collate)
    PreTrainer(pretrain_args=pretrain_args, train_dataloader=train_dataloader,
               eval_dataloader=eval_dataloader).train()


if __name__ == "__main__":
    main()
