"""`train_data` at corpus scale: time to the first step and memory per rank, cold (tokenizing into the cache) and
warm (reusing it), next to `pretrainer prepare` on the same corpus.

    .venv/bin/python bench/train_data_cache.py [--megabytes 100 1000] [--nproc 2] [--workers 2]

For each size, a jsonl corpus of generated English-like text is written (kept in --folder), then:
`prepare` = `pretrainer prepare --workers W`; `startup` = a 1-step run on a tiny prepared corpus (the model's
and the processes' start-up, no tokenizing); `cold` = a 1-step run on `train_data` with an empty cache;
`warm` = the same run again with another save_dir. Each run is `torchrun --nproc_per_node N pretrainer train`
of the quickstart model with 1 step, no eval, no export. Peak RSS is the largest process's, from the run's own
metrics row (`peak_mem_mb`, the maximum over ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there been one all we their has would when if so no will more what up can out some "
         "time could into only do then other about them now these may like first over such our even most made "
         "after also did many before must through back years where much your way well down should because each "
         "just those people how too little state good very make world still own see men work long get here "
         "between both life being under never day same another know while last might us great old year off come "
         "since against go came right used take three").split()


def write_corpus(path: Path, megabytes: int) -> None:
    rng = random.Random(0)
    target = megabytes * 1_000_000
    with open(path, "w", encoding="utf-8") as f:
        written = 0
        while written < target:
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 400)))
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line)


def timed(command: list, env: dict) -> float:
    start = time.perf_counter()
    done = subprocess.run([str(c) for c in command], cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"failed: {' '.join(map(str, command))}\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def peak_mb(save_dir: Path) -> float:
    rows = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    return max(row.get("peak_mem_mb", 0) for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--folder", default=str(Path(tempfile.gettempdir()) / "pretrainer-bench-corpus"))
    ns = parser.parse_args()
    folder = Path(ns.folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = REPO / "examples" / "models" / "tiny-llama"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    train = [BIN / "torchrun", "--standalone", "--nproc_per_node", ns.nproc, BIN / "pretrainer", "train",
             REPO / "examples" / "quickstart.yaml", f"dp={ns.nproc}", "num_training_steps=1", "warmup_steps=0",
             "eval_interval=0", "eval_split=0", "export_hf=false", "write_report=false", "save_interval=0",
             f"tokenize_workers={ns.workers}"]
    small = folder / "small.jsonl"
    write_corpus(small, 1)
    timed([BIN / "pretrainer", "prepare", "--input", small, "--tokenizer", tokenizer, "--output-prefix",
           folder / "small", "--append-eod"], env)
    runs = folder / "runs"
    shutil.rmtree(runs, ignore_errors=True)
    startup = timed([*train, "train_data=null", "megatron_dataset_flag=true",
                     f"data_path={folder / 'small_text_document'}", f"save_dir={runs / 'startup'}"], env)
    print(f"{ns.nproc} rank(s), {ns.workers} tokenizer worker(s), {os.cpu_count()} core(s); start-up of a 1-step "
          f"run on prepared data: {startup:.1f} s, peak RSS {peak_mb(runs / 'startup'):,.0f} MB")
    print(f"{'corpus MB':>9} {'prepare s':>9} {'cold s':>7} {'cold/(prepare+startup)':>23} {'warm s':>7} "
          f"{'peak RSS cold MB':>16} {'peak RSS warm MB':>16}")
    for megabytes in ns.megabytes:
        corpus = folder / f"corpus-{megabytes}mb.jsonl"
        if not corpus.exists():
            write_corpus(corpus, megabytes)
        prepare = timed([BIN / "pretrainer", "prepare", "--input", corpus, "--tokenizer", tokenizer,
                         "--output-prefix", folder / f"prepared-{megabytes}", "--append-eod", "--workers",
                         ns.workers], env)
        cache = folder / f"cache-{megabytes}"
        shutil.rmtree(cache, ignore_errors=True)
        data_env = {**env, "PRETRAINER_CACHE_DIR": str(cache)}
        cold = timed([*train, f"train_data={corpus}", f"save_dir={runs / f'cold-{megabytes}'}"], data_env)
        warm = timed([*train, f"train_data={corpus}", f"save_dir={runs / f'warm-{megabytes}'}"], data_env)
        print(f"{megabytes:>9} {prepare:>9.1f} {cold:>7.1f} {cold / (prepare + startup):>22.2f}x {warm:>7.1f} "
              f"{peak_mb(runs / f'cold-{megabytes}'):>16,.0f} {peak_mb(runs / f'warm-{megabytes}'):>16,.0f}")


if __name__ == "__main__":
    main()
