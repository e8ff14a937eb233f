"""The planner's predicted tokens/s per GPU against published bf16 H100 training throughput.

Each row is a publisher's own setting (model shape, GPUs, layout, micro-batch, sequence, recomputation,
torch.compile) and the tokens/s per GPU they measured; the planner plans the same setting on `--device H100`
and the ratio predicted / published is printed, with the median. The shapes are written as Llama configs
(the planner reads the shape, not the weights).

    python bench/plan_vs_published.py            # the table (markdown), as docs/plan.md shows it

Sources (read 2026-12):
- torchtitan, benchmarks/llama3_h100_202412_torchtitan.md: Llama 3.1 8B, FSDP, local batch 2, sequence 8192,
  selective activation checkpointing, with and without torch.compile; 8 GPUs (table 1) and 128 GPUs (table 3).
  Their H100s are 96 GB HBM2e boards at a 500 W limit (peak "between SXM and NVL"), 400 Gb/s per GPU between hosts.
- OLMo-core, README throughput table and src/scripts/train/OLMo-7B.py, OLMo-13B.py: FSDP (bf16 parameters,
  fp32 reduction), torch.compile, no activation checkpointing, sequence 4096, micro-batch 2 (7B) and 1 (13B);
  one 8-GPU node assumed (the 7B script's launch default; the README does not say how many).
- llm-foundry, scripts/train/benchmarking/README.md, "H100 80GB BF16": MPT models (GELU MLP of 4 x d_model,
  flash attention, no compile) under FSDP FULL_SHARD with amp_bf16, each row's sequence, GPUs, micro-batch,
  accumulation and activation checkpointing (full or none); eleven of its rows, 1B to 70B.
- Megatron-LM, README.md "Weak Scaling Results" (images/model_table.png, Megatron-Core r0.8.0): GPT models of 1.7B
  to 462B, vocabulary 131,072, sequence 4,096, data-parallel size 48, tensor and pipeline sizes per row, the
  distributed optimizer with gradient-reduce, parameter-gather and tensor-parallel communication overlapped. The
  table gives TFLOP/s per GPU; tokens/s per GPU is that over Megatron-LM's own count of FLOPs per token,
  72 l h^2 (1 + s / 6h + V / 16 l h). Not stated, and taken here: micro-batch 1 (the batch is 4 x pp sequences
  per replica), no recomputation, no interleaved stages, a GPT-NeoX layer (LayerNorm, GELU MLP of 4h, rotary).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

MPT = {  # llm-foundry's MPT sizes: d_model, n_layers, n_heads (expansion ratio 4, vocabulary 50368)
    "mpt-1b": (2048, 24, 16), "mpt-3b": (2560, 32, 20), "mpt-7b": (4096, 32, 32), "mpt-13b": (5120, 40, 40),
    "mpt-30b": (7168, 48, 64), "mpt-70b": (8192, 80, 64),
}
MEGATRON_GPT = {  # the weak-scaling models: attention heads, hidden size, layers
    "gpt-1.7b": (16, 2048, 24), "gpt-7.1b": (32, 4096, 30), "gpt-16b": (48, 6144, 32), "gpt-32b": (56, 7168, 48),
    "gpt-70b": (64, 8192, 84), "gpt-119b": (80, 10240, 92), "gpt-177b": (96, 12288, 96), "gpt-314b": (128, 16384, 96),
    "gpt-462b": (144, 18432, 112),
}
MEGATRON_VOCAB, MEGATRON_SEQ = 131072, 4096
SHAPES = {  # HF Llama config fields
    "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0),
    "olmo-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                    intermediate_size=11008, vocab_size=100352, max_position_embeddings=4096),
    "olmo-13b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                     intermediate_size=13824, vocab_size=100352, max_position_embeddings=4096),
}


@dataclass(frozen=True)
class Published:
    source: str
    name: str
    shape: str
    gpus: int
    tokens_per_gpu: float       # tokens/s per GPU, as published
    keys: dict = field(default_factory=dict)  # the setting as pretrainer keys
    device: str = "H100"        # `pretrainer plan --device`: the publisher's hardware


def megatron_tokens_per_gpu(shape: str, tflops: float) -> float:
    """Megatron-LM's TFLOP/s per GPU as tokens/s per GPU, by its own FLOPs per token (forward and backward, the
    attention scores counted whole, the output head)."""
    _, h, layers = MEGATRON_GPT[shape]
    per_token = 72 * layers * h * h * (1 + MEGATRON_SEQ / (6 * h) + MEGATRON_VOCAB / (16 * layers * h))
    return tflops * 1e12 / per_token


TORCHTITAN_8B = {"engine": "fsdp", "micro_batch_size": 2, "seq_length": 8192, "activation_checkpointing": "selective"}
GRAND_TETON = "H100 96GB 500W"  # torchtitan's hosts: HBM2e boards at a 500 W limit
OLMO_CORE = {"engine": "fsdp", "seq_length": 4096, "compile": True, "activation_checkpointing": "none"}
ROWS = (
    Published("torchtitan", "8B FSDP, 8 GPUs", "llama-3.1-8b", 8, 5762, TORCHTITAN_8B, GRAND_TETON),
    Published("torchtitan", "8B FSDP + compile, 8 GPUs", "llama-3.1-8b", 8, 6667, {**TORCHTITAN_8B, "compile": True},
              GRAND_TETON),
    Published("torchtitan", "8B FSDP, 128 GPUs", "llama-3.1-8b", 128, 5605, TORCHTITAN_8B, GRAND_TETON),
    Published("torchtitan", "8B FSDP + compile, 128 GPUs", "llama-3.1-8b", 128, 6514,
              {**TORCHTITAN_8B, "compile": True}, GRAND_TETON),
    Published("OLMo-core", "7B FSDP + compile, mb 2", "olmo-7b", 8, 10000, {**OLMO_CORE, "micro_batch_size": 2}),
    Published("OLMo-core", "13B FSDP + compile, mb 1", "olmo-13b", 8, 4500, {**OLMO_CORE, "micro_batch_size": 1}),
    *(Published("llm-foundry", f"MPT-{size.upper()} seq {seq}, mb {mb} x {acc}, {'full' if full else 'no'} recompute",
                f"mpt-{size}", gpus, tokens, {"engine": "fsdp", "seq_length": seq, "micro_batch_size": mb,
                                              "gradient_accumulation_steps": acc,
                                              "activation_checkpointing": "full" if full else "none"})
      for size, seq, gpus, mb, acc, full, tokens in (
          ("70b", 2048, 64, 8, 4, True, 1039), ("70b", 2048, 32, 2, 16, True, 882),
          ("30b", 8192, 8, 1, 21, True, 1384), ("30b", 2048, 32, 14, 3, True, 2308),
          ("30b", 2048, 8, 3, 21, True, 2002), ("13b", 4096, 8, 10, 3, True, 4717),
          ("13b", 2048, 64, 2, 1, False, 4800), ("7b", 8192, 8, 8, 2, True, 6935),
          ("7b", 2048, 8, 6, 1, False, 10643), ("3b", 4096, 8, 5, 6, False, 20964),
          ("1b", 2048, 8, 14, 1, False, 45455))),
    *(Published("Megatron-LM", f"GPT-{size} tp {tp} pp {pp}", f"gpt-{size.lower()}", 48 * tp * pp,
                megatron_tokens_per_gpu(f"gpt-{size.lower()}", tflops),
                {"engine": "megatron", "micro_batch_size": 1, "seq_length": MEGATRON_SEQ,
                 "gradient_accumulation_steps": 4 * pp, "activation_checkpointing": "none",
                 "plugin_args": {"tp_degree": tp, "pp_degree": pp, "sequence_parallelism": tp > 1,
                                 "use_distributed_optimizer": True}})
      for size, tp, pp, tflops in (("1.7B", 1, 1, 408.8), ("7.1B", 2, 1, 465.9), ("16B", 4, 1, 489.1),
                                   ("32B", 8, 1, 459.6), ("70B", 8, 2, 419.7), ("119B", 8, 4, 420.5),
                                   ("177B", 8, 6, 432.8), ("314B", 8, 8, 474.4), ("462B", 8, 16, 459.9))),
)


def plan_of(row: Published, folder: Path):
    """The planner's plan of the row's setting (model shape written as a Llama config under `folder`)."""
    from transformers import LlamaConfig

    from pretrainer.config import PreTrainingArguments
    from pretrainer.plan.command import plan_for_command

    model = folder / row.shape
    if not (model / "config.json").exists():
        if row.shape in MEGATRON_GPT:
            from transformers import GPTNeoXConfig

            heads, h, layers = MEGATRON_GPT[row.shape]
            GPTNeoXConfig(hidden_size=h, num_attention_heads=heads, num_hidden_layers=layers, intermediate_size=4 * h,
                          vocab_size=MEGATRON_VOCAB, max_position_embeddings=MEGATRON_SEQ, rotary_pct=1.0,
                          use_parallel_residual=False, tie_word_embeddings=False).save_pretrained(model)
        elif row.shape in MPT:
            from transformers import MptConfig

            d_model, layers, heads = MPT[row.shape]
            MptConfig(d_model=d_model, n_layers=layers, n_heads=heads, expansion_ratio=4, vocab_size=50368,
                      max_seq_len=65536).save_pretrained(model)
        else:
            LlamaConfig(**SHAPES[row.shape]).save_pretrained(model)
    keys = {"num_training_steps": 10, "dp": row.gpus, "dtype": "bf16", "model_path": str(model),
            "tokenizer_path": str(REPO / "examples" / "models" / "tiny-llama"),
            "preflight_memory_check": "off", **row.keys}
    return plan_for_command(PreTrainingArguments(**keys), row.gpus, min(row.gpus, 8), row.device, None)


def predicted_tokens_per_gpu(row: Published, folder: Path) -> float:
    own = plan_of(row, folder).estimate
    return own.layout.global_batch * own.layout.seq_length / own.step_seconds / row.gpus


def publishers_place(row: Published, folder: Path) -> tuple[int, int]:
    """Where the publisher's layout ranks among every layout the planner considers for the same world (1: first),
    and how many there are."""
    from pretrainer.plan.search import ranked

    plan = plan_of(row, folder)
    order = ranked([plan.estimate, *plan.alternatives])
    return order.index(plan.estimate) + 1, len(order)


def table(rows=ROWS) -> tuple[str, list[float], list[tuple[int, int]]]:
    """The markdown table, the ratios predicted / published, and the publisher's layout's place per row."""
    lines = ["| source | setting | device | GPUs | published tokens/s/GPU | predicted | ratio | publisher's layout "
             "ranked |", "|---|---|---|---:|---:|---:|---:|---:|"]
    ratios, places = [], []
    with tempfile.TemporaryDirectory() as folder:
        for row in rows:
            predicted = predicted_tokens_per_gpu(row, Path(folder))
            ratios.append(predicted / row.tokens_per_gpu)
            places.append(publishers_place(row, Path(folder)))
            lines.append(f"| {row.source} | {row.name} | {row.device} | {row.gpus} | {row.tokens_per_gpu:,.0f} | "
                         f"{predicted:,.0f} | {ratios[-1]:.2f} | {places[-1][0]} of {places[-1][1]} |")
    lines.append(f"\nmedian ratio {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}")
    return "\n".join(lines), ratios, places


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="the ratios as JSON")
    ns = parser.parse_args()
    import logging

    logging.getLogger("pretrainer").setLevel(logging.WARNING)
    text, ratios, places = table()
    print(json.dumps({"ratios": ratios, "places": places}) if ns.json else text)


if __name__ == "__main__":
    main()
