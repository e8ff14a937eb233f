"""A mixture at corpus scale: three generated sources of very different document lengths, on 2 ranks: time to
the first step cold (tokenizing every source into the cache) and warm, and memory per rank, next to
`pretrainer prepare` of the same files and a run that reads the same files as one plain source.

    .venv/bin/python bench/mixture_scale.py [--megabytes 1000] [--nproc 2] [--workers 2]

The sources (jsonl of generated English-like text, kept in --folder): `long` (half the bytes, documents of
2,000-4,000 words), `short` (three tenths, 10-40 words), `medium` (a fifth, 100-400 words), weighted 0.5 / 0.3
/ 0.2. `prepare` = `pretrainer prepare --workers W` of each file, summed; `startup` = a 1-step run on a tiny
prepared corpus; `cold` = a 1-step run of the mixture with an empty cache; `warm` = the same again;
`one source` = a 1-step run of `train_data: [the three files]`, cold then warm. Each run is `torchrun
--nproc_per_node N pretrainer train` of the quickstart model with 1 step, no eval, no export; peak RSS is the
largest rank's (`peak_mem_mb`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from train_data_cache import BIN, REPO, WORDS, peak_mb, timed

SOURCES = {"long": (0.5, 2000, 4000), "short": (0.3, 10, 40), "medium": (0.2, 100, 400)}  # bytes share, words


def write_source(path: Path, megabytes: float, low: int, high: int, seed: int) -> None:
    rng = random.Random(seed)
    target, written = megabytes * 1_000_000, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            line = json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))}) + "\n"
            f.write(line)
            written += len(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=1000)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--folder", default=str(Path(tempfile.gettempdir()) / "pretrainer-bench-mixture"))
    ns = parser.parse_args()
    folder = Path(ns.folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = REPO / "examples" / "models" / "tiny-llama"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    files = {}
    for seed, (name, (share, low, high)) in enumerate(SOURCES.items()):
        files[name] = folder / f"{name}-{ns.megabytes}mb.jsonl"
        if not files[name].exists():
            write_source(files[name], share * ns.megabytes, low, high, seed)
    prepare = sum(timed([BIN / "pretrainer", "prepare", "--input", path, "--tokenizer", tokenizer, "--output-prefix",
                         folder / f"prepared-{path.stem}", "--append-eod", "--workers", ns.workers], env)
                  for path in files.values())
    train = [BIN / "torchrun", "--standalone", "--nproc_per_node", ns.nproc, BIN / "pretrainer", "train",
             REPO / "examples" / "quickstart.yaml", f"dp={ns.nproc}", "num_training_steps=1", "warmup_steps=0",
             "eval_interval=0", "eval_split=0", "export_hf=false", "write_report=false", "save_interval=0",
             "downstream_evals=null", f"tokenize_workers={ns.workers}"]
    mixture = "train_data=[" + ", ".join(f"{{name: {name}, path: '{path}', weight: {SOURCES[name][0]}}}"
                                         for name, path in files.items()) + "]"
    plain = "train_data=[" + ", ".join(f"'{path}'" for path in files.values()) + "]"
    runs, cache = folder / "runs", folder / "cache"
    shutil.rmtree(runs, ignore_errors=True)
    prefix = folder / f"prepared-{files['medium'].stem}_text_document"
    startup = timed([*train, "train_data=null", "megatron_dataset_flag=true", f"data_path={prefix}",
                     f"save_dir={runs / 'startup'}"], env)
    results = {}
    for label, data in (("mixture", mixture), ("one source", plain)):
        shutil.rmtree(cache, ignore_errors=True)
        data_env = {**env, "PRETRAINER_CACHE_DIR": str(cache)}
        cold = timed([*train, data, f"save_dir={runs / (label + ' cold')}"], data_env)
        warm = timed([*train, data, f"save_dir={runs / (label + ' warm')}"], data_env)
        results[label] = (cold, warm, peak_mb(runs / (label + " cold")), peak_mb(runs / (label + " warm")))
    print(f"{ns.megabytes} MB in 3 sources, {ns.nproc} rank(s), {ns.workers} tokenizer worker(s), {os.cpu_count()} "
          f"core(s); prepare {prepare:.1f} s; start-up of a 1-step run on prepared data {startup:.1f} s")
    print(f"{'run':<11} {'cold s':>7} {'cold/(prepare+startup)':>23} {'warm s':>7} {'peak RSS cold MB':>16} "
          f"{'peak RSS warm MB':>16}")
    for label, (cold, warm, rss_cold, rss_warm) in results.items():
        print(f"{label:<11} {cold:>7.1f} {cold / (prepare + startup):>22.2f}x {warm:>7.1f} {rss_cold:>16,.0f} "
              f"{rss_warm:>16,.0f}")


if __name__ == "__main__":
    main()
