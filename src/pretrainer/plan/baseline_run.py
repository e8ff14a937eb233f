"""The memory a training process takes besides its model: two steps of a tiny model on one process, through
what a run assembles (the resolved run, the engine, the tokenized data, the model, the optimizer), whose peak
RSS the planner uses as the runtime's baseline (plan/device_spec.py measures it once per machine and caches it).

    python -m pretrainer.plan.baseline_run ENGINE   # prints the peak RSS in bytes
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import tempfile
from pathlib import Path

from ..parallel import SingleEngine

WORDS = ("the model reads every token of the corpus once and learns to predict the next one from those before "
         "it while the optimizer moves each weight a little").split()


def tiny_run(folder: Path, engine: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    from ..config import PreTrainingArguments
    from ..parallel import engine_entry

    lines = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 8
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=256, special_tokens=["<s>", "</s>", "<unk>"]))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder / "model")
    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0,
                eos_token_id=1).save_pretrained(folder / "model")
    config = {"num_training_steps": 2, "micro_batch_size": 2, "dp": 1, "seq_length": 32, "dtype": "fp32",
              "model_path": str(folder / "model"), "train_data": str(corpus), "eval_split": 0,
              "data_cache_path": str(folder / "cache"), "engine": engine, "preflight_memory_check": "off",
              "export_hf": False, "write_report": False, "warmup_steps": 0}
    config.update(engine_entry(engine).costs.baseline_overrides)
    train_steps(PreTrainingArguments.from_dict(config))


def train_steps(args) -> None:
    """`num_training_steps` steps of `args`'s run, as `train` assembles it (without its loop's bookkeeping)."""
    from ..batch import count_targets, loss_sum, to_device
    from ..run import launch_world
    from ..run.assembly import assemble_run

    run = assemble_run(args, launch_world(args))
    engine = run.engine
    try:
        for _ in range(args.num_training_steps):
            batch = next(run.data.train)
            scale = engine.mean_weight(max(int(count_targets(batch)), 1))
            engine.forward_backward(run.model, [to_device(batch, engine.device)], loss_sum, scale)
            engine.step(run.model, run.optimizer, args.clip_grad)
            engine.finish_step(run.optimizer, run.scheduler)
    finally:
        engine.close()


if __name__ == "__main__":
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        tiny_run(Path(tmp), sys.argv[1] if len(sys.argv) > 1 else SingleEngine.name)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
