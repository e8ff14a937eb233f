"""Replica fault tolerance on CPU: what a step costs with two replica groups (sync and DiLoCo) beside one process
alone, and what a killed group costs the run.

    .venv/bin/python bench/replicas.py [--steps 100] [--kill-step 30] [--folder runs/bench/replicas]

Each run is the quickstart model at seq_length 64, micro-batch 2 per group, fp32, one thread per process, on this
machine (the groups share its cores), inside a network namespace of its own (`tests/replica_run.py` starts the
lighthouse and the groups, and kills group 1's worker once its rows reach --kill-step). Printed per run: group 0's
median step time, the steps it trained with one group, the samples dropped, and its final eval loss (DiLoCo syncs
every sync_every = 8 steps and at the last); for a kill, the seconds from the kill to the log line of the quorum
without the group.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from common import REPO, metrics, pretrainer

BIN = Path(sys.executable).parent
BASE = {"num_training_steps": 100, "micro_batch_size": 2, "dp": 1, "gradient_accumulation_steps": 1, "seq_length": 64,
        "dtype": "fp32", "model_path": str(REPO / "examples/models/tiny-llama"),
        "train_data": str(REPO / "examples/data/python_docs.jsonl"), "lr": 1e-3, "warmup_steps": 5, "seed": 7,
        "save_interval": 25, "eval_interval": 50, "eval_iters": 4, "log_interval": 1, "write_report": False,
        "export_hf": False}


def ft_block(port: int, mode: str) -> dict:
    return {"replica_groups": 2, "lighthouse": f"127.0.0.1:{port}", "min_replicas": 1, "timeout_seconds": 20,
            "mode": mode, "sync_every": 8}


def run_groups(folder: Path, port: int, mode: str, steps: int, kill: int | None) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "config.json"  # JSON is YAML
    config.write_text(json.dumps({**BASE, "num_training_steps": steps, "save_dir": str(folder / "run"),
                                  "fault_tolerance": ft_block(port, mode)}))
    kill_args = ["--kill-group", "1", "--kill-step", str(kill)] if kill else []
    subprocess.run(["unshare", "--net", str(BIN / "python"), str(REPO / "tests" / "replica_run.py"), str(config),
                    "--groups", "2", "--port", str(port), "--out", str(folder / "out"), "--save-dir",
                    str(folder / "run"), "--heartbeat-timeout-ms", "1000", *kill_args], check=True, timeout=900)
    summary = json.loads((folder / "out" / "summary.json").read_text())
    rows = metrics(folder / "run" / "replica-0")
    figures = figures_of(rows)
    if kill:
        line = next(line for line in (folder / "out" / "group0.log").read_text().splitlines()
                    if "take part" in line and ("left" in line or " 1 of 2" in line))
        when = datetime.strptime(re.search(r"\]\[([\d-]+ [\d:,]+)\]", line).group(1), "%Y-%m-%d %H:%M:%S,%f")
        figures["quorum_change_s"] = round(when.timestamp() - summary["kill_time"], 2)
    return figures


def figures_of(rows: list[dict]) -> dict:
    train = {row["step"]: row for row in rows if "loss" in row}
    return {"step_ms": round(statistics.median(row["elapsed_ms"] for row in train.values()), 1),
            "alone_steps": sum(1 for row in train.values() if row.get("replica_groups") == 1),
            "samples_dropped": train[max(train)].get("samples_dropped", 0),
            "eval_loss": round([row["eval_loss"] for row in rows if "eval_loss" in row][-1], 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--kill-step", type=int, default=30)
    parser.add_argument("--folder", type=Path, default=REPO / "runs" / "bench" / "replicas")
    args = parser.parse_args()
    shutil.rmtree(args.folder, ignore_errors=True)
    args.folder.mkdir(parents=True)
    one = args.folder / "one.json"
    one.write_text(json.dumps({**BASE, "num_training_steps": args.steps, "save_dir": str(args.folder / "one")}))
    pretrainer("train", one, "resume=none")
    results = {"one process, no replica groups": figures_of(metrics(args.folder / "one"))}
    for port, (name, mode, kill) in enumerate((("sync", "sync", None), ("sync, group 1 killed", "sync", True),
                                               ("diloco H=8", "diloco", None),
                                               ("diloco H=8, group 1 killed", "diloco", True)), start=29810):
        results[name] = run_groups(args.folder / name.replace(" ", "-").replace(",", ""), port, mode, args.steps,
                                   args.kill_step if kill else None)
    print(f"{'run':<32}{'step ms':>9}{'alone':>7}{'dropped':>9}{'eval loss':>11}{'quorum change':>15}")
    for name, figures in results.items():
        change = f"{figures['quorum_change_s']} s" if "quorum_change_s" in figures else ""
        print(f"{name:<32}{figures['step_ms']:>9}{figures['alone_steps']:>7}{figures['samples_dropped']:>9}"
              f"{figures['eval_loss']:>11}{change:>15}")
    (args.folder / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
