#!/usr/bin/env bash
# One-GPU check: bf16 MFU of a ~1B Llama at seq 4096 in one process, tokens/s/GPU and peak memory, with and
# without `compile: true`, plus bf16-vs-fp32 loss agreement on a small model, and the MoE experts'
# implementations (bench/moe.py). Installs nothing: it runs the
# working tree (PYTHONPATH=src) with the python, torch and transformers the machine already has, and
# finishes in well under 8 minutes on an H100/H200.
#
#   bash bench/gpu_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-runs/gpu_check}}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
"$PY" - <<'PY' | tee "$OUT/environment.txt"
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)
print("device", torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
PY

# A Llama-3.2-1B-shaped model (hidden 2048, 16 layers, GQA 32/8, FFN 8192) with a 32k vocabulary.
"$PY" - "$OUT" <<'PY'
import json, shutil, sys
from pathlib import Path
out = Path(sys.argv[1])
model = out / "llama-1b"
model.mkdir(parents=True, exist_ok=True)
config = json.loads(Path("examples/models/tiny-llama/config.json").read_text())
config.update(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
              num_key_value_heads=8, max_position_embeddings=4096, vocab_size=32000, tie_word_embeddings=False)
(model / "config.json").write_text(json.dumps(config, indent=2))
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(Path("examples/models/tiny-llama") / name, model / name)
PY
"$PY" -m pretrainer.cli prepare --input examples/data/python_docs.jsonl --tokenizer examples/models/tiny-llama \
    --output-prefix "$OUT/corpus" --append-eod --workers 4 | tail -2

run() {  # name, then key=value overrides
  local name=$1; shift
  "$PY" -m pretrainer.cli train examples/quickstart.yaml model_path="$OUT/llama-1b" train_data=null \
      megatron_dataset_flag=true data_path="$OUT/corpus_text_document" "dataloader_config={split: '100,0,0'}" \
      dtype=bf16 seq_length=4096 micro_batch_size=2 gradient_accumulation_steps=1 num_training_steps=25 \
      warmup_steps=5 log_interval=5 eval_interval=0 save_interval=0 export_hf=false resume=none \
      save_dir="$OUT/$name" "$@" > "$OUT/$name.log" 2>&1 || { tail -30 "$OUT/$name.log"; return 1; }
  "$PY" - "$OUT/$name" "$name" <<'PY'
import json, sys
every = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
rows = [r for r in every if "loss" in r]
last = rows[-2:]  # steady state: the last 10 steps
tps = sum(r["tokens_per_s_per_device"] for r in last) / len(last)
mfu = sum(r["mfu"] for r in last) / len(last)
reserved = rows[-1].get("peak_reserved_mb", 0)
print(f"{sys.argv[2]:14} tokens/s/GPU {tps:9,.0f}  MFU {100 * mfu:5.1f}%  peak allocated {rows[-1]['peak_mem_mb']:8,.0f} MB"
      f"  reserved {reserved:8,.0f} MB  loss {rows[-1]['loss']:.4f}")
# the plan made before the run (the model of `pretrainer plan`) against the allocator's peak
predicted = next((r["predicted_peak_mem_mb"] for r in every if r.get("event") == "start"), None)
if predicted and reserved:
    print(f"{'':14} planned peak {predicted:8,.0f} MB: {predicted / reserved - 1:+.1%} of reserved, "
          f"{predicted / rows[-1]['peak_mem_mb'] - 1:+.1%} of allocated (the plan adds ~1 GiB of CUDA context)")
PY
}
{
  echo "~1B Llama, seq 4096, micro-batch 2, bf16, one GPU (MFU against the rated dense bf16 peak):"
  run eager
  run compiled compile=true
} | tee "$OUT/summary.txt"

# Mixture-of-Experts: the experts' implementations of transformers (eager loop, batched_mm, grouped_mm) on one GPU.
"$PY" bench/moe.py --steps 12 --seq 1024 --micro 16 --engines '' --dtype bf16 | tee "$OUT/moe.txt"
