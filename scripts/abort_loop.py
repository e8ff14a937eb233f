"""Launch 2-rank runs many times, under load, and count the ranks that abort (SIGABRT, a native fault, a core).

Each case is a short 2-rank job of the kind a rank once aborted in at exit ("terminate called without an
active exception", docs/checkpoints-and-faults.md#ending-cleanly):

- `resume`: ddp, resuming from a step-2 checkpoint to step 4 with asynchronous checkpoints (the resumed run
  of the fault tests);
- `cp-yarn`: fsdp with context_parallel_degree 2 and yarn-scaled RoPE (test_long_context's case);
- `kill`: ddp, rank 1 SIGKILLed in step 3 (its peer's collective fails, torchrun stops it): every rank must
  end with a documented code.

`--jobs N` runs N launches at once (each rank has 1 thread), so every job runs beside others on a loaded
machine. Every launch has faulthandler on and TORCH_SHOW_CPP_STACKTRACES=1 and may dump a core in its own
folder (ulimit -c unlimited); a launch that aborts keeps its folder, and gdb's backtrace of every thread of
each core is written beside it. Prints one line per case: launches, aborts, other failures, median seconds.

    .venv/bin/python scripts/abort_loop.py [--runs 200] [--jobs 2] [--cases resume,cp-yarn,kill] [--keep DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

ABORTED = ("SIGABRT", "Signal 6", "terminate called", "Fatal Python error", "core dumped")
# how a rank of the kill case may end: killed, its collective failing (exit 5), or stopped by torchrun
KILL_CODES = {-9, 5, -15}


def prepare(work: Path) -> dict[str, list[str]]:
    """The cases' configs (and the checkpoint the resume case starts from); case -> command after torchrun."""
    import yaml

    from helpers import small_corpus_file, write_tiny_model

    model, corpus = write_tiny_model(work / "model"), small_corpus_file(work / "docs.jsonl")
    base = {"num_training_steps": 4, "micro_batch_size": 1, "dp": 2, "gradient_accumulation_steps": 2,
            "seq_length": 32, "dtype": "fp32", "model_path": str(model), "train_data": str(corpus), "lr": 1e-3,
            "warmup_steps": 1, "save_interval": 2, "eval_interval": 0, "export_hf": False, "seed": 7,
            "write_report": False, "distributed_timeout_minutes": 0.5, "engine": "ddp"}
    configs = {"resume": {**base, "async_checkpoint": True},
               "cp-yarn": {**base, "engine": "fsdp", "context_parallel_degree": 2, "dp": 1, "micro_batch_size": 2,
                           "seq_length": 64, "rope_scaling": {"rope_type": "yarn", "factor": 2}, "save_interval": 0},
               "kill": base}
    for name, config in configs.items():
        (work / f"{name}.yaml").write_text(yaml.safe_dump(config))
    seed_run = work / "resume-seed"  # a run stopped after step 2: each resume launch starts from a copy
    done = subprocess.run(torchrun(work / "resume.yaml", f"save_dir={seed_run}", "exit_interval=2"),
                          capture_output=True, text=True, env=environment(), cwd=REPO)
    if done.returncode:
        sys.exit(f"could not prepare the resume case:\n{done.stderr[-3000:]}")
    fault_run = str(REPO / "tests" / "fault_run.py")
    return {"resume": ["-m", "pretrainer.cli", "train", str(work / "resume.yaml")],
            "cp-yarn": ["-m", "pretrainer.cli", "train", str(work / "cp-yarn.yaml")],
            "kill": [fault_run, str(work / "kill.yaml"), "--fault", "kill", "--step", "3"]}


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def torchrun(*args) -> list[str]:
    """`pretrainer train ARGS` on 2 ranks."""
    return [*TORCHRUN, "-m", "pretrainer.cli", "train", *map(str, args)]


def environment() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_SHOW_CPP_STACKTRACES": "1", "PYTHONFAULTHANDLER": "1",
            "PYTHONPATH": str(REPO / "src") + os.pathsep + str(REPO / "tests")}


def allow_cores() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def launch(case: str, command: list[str], work: Path, index: int) -> dict:
    folder = work / f"{case}-{index}"
    folder.mkdir()
    overrides = [f"save_dir={folder / 'run'}"]
    if case == "resume":
        shutil.copytree(work / "resume-seed", folder / "run")
    if case == "kill":
        overrides.append(f"--record={folder / 'record'}")
    full = [*TORCHRUN, *command, *overrides]
    start = time.perf_counter()
    done = subprocess.run(full, capture_output=True, text=True, env=environment(), cwd=folder,
                          preexec_fn=allow_cores, timeout=600)
    seconds = time.perf_counter() - start
    output = done.stdout + done.stderr
    cores = sorted(folder.glob("core*"))
    aborted = bool(cores) or any(sign in output for sign in ABORTED)
    if case == "kill":
        codes = {int(code) for code in re.findall(r"exitcode\s*:\s*(-?\d+)", output)}
        failed = done.returncode == 0 or -9 not in codes or not codes <= KILL_CODES
    else:
        failed = done.returncode != 0
    if aborted or failed:
        (folder / "output.txt").write_text(output)
        for core in cores:
            trace = subprocess.run(["gdb", "-batch", "-ex", "thread apply all bt", sys.executable, str(core)],
                                   capture_output=True, text=True)
            (folder / f"{core.name}.backtrace.txt").write_text(trace.stdout + trace.stderr)
    else:
        shutil.rmtree(folder)
    return {"case": case, "aborted": aborted, "failed": failed and not aborted, "seconds": seconds,
            "folder": str(folder)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="launches per case")
    parser.add_argument("--jobs", type=int, default=2, help="launches at once")
    parser.add_argument("--cases", default="resume,cp-yarn,kill")
    parser.add_argument("--keep", type=Path, help="folder for the launches (default: a temporary one)")
    ns = parser.parse_args()
    work = ns.keep or Path(tempfile.mkdtemp(prefix="abort-loop-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        run_loop(ns, work)
    finally:
        if ns.keep is None:  # the launches' runs are only kept where asked (--keep)
            shutil.rmtree(work, ignore_errors=True)


def run_loop(ns, work: Path) -> None:
    commands = prepare(work)
    cases = [c for c in ns.cases.split(",") if c]
    order = [(case, index) for index in range(ns.runs) for case in cases]  # the cases interleaved
    results: list[dict] = []
    with concurrent.futures.ThreadPoolExecutor(ns.jobs) as pool:
        futures = [pool.submit(launch, case, commands[case], work, index) for case, index in order]
        for future in concurrent.futures.as_completed(futures):
            result = future.result()
            results.append(result)
            if result["aborted"] or result["failed"]:
                print(json.dumps(result), flush=True)
    print(f"{'case':8} {'launches':>8} {'aborted':>8} {'failed':>7} {'median s':>9}   ({ns.jobs} at once, {work})")
    for case in cases:
        rows = [r for r in results if r["case"] == case]
        print(f"{case:8} {len(rows):8d} {sum(r['aborted'] for r in rows):8d} {sum(r['failed'] for r in rows):7d} "
              f"{statistics.median(r['seconds'] for r in rows):9.1f}")


if __name__ == "__main__":
    main()
