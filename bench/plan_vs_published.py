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
)


def plan_of(row: Published, folder: Path):
    """The planner's plan of the row's setting (model shape written as a Llama config under `folder`)."""
    from transformers import LlamaConfig

    from pretrainer.config import PreTrainingArguments
    from pretrainer.plan.command import plan_for_command

    model = folder / row.shape
    if not (model / "config.json").exists():
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
