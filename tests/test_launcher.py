"""`pretrainer train --nproc-per-node`: the run checked for its world before any worker starts, a worker's error as
one line and one exit code, plain torchrun's error said once, and the Slurm script run for two machines."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from conftest import fast_config
from helpers import small_corpus_file, train_losses, wait_for_step, write_tiny_model, write_tiny_moe
from launch import BIN, REPO, cli_in_process, describe, environment, listening_port, pretrainer, run, start, torchrun
from pretrainer.config import ConfigError, PreTrainingArguments
from pretrainer.train.launcher import LAUNCHER_FLAGS, check_before_launch, outcome, worker_argv
from pretrainer.train.signals import EXIT_PREEMPTED


def write(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("pretrainer: error:")]


@pytest.fixture
def configs(tmp_path) -> dict:
    corpus = small_corpus_file(tmp_path / "docs.jsonl")
    dense = fast_config(write_tiny_model(tmp_path / "dense"), corpus, tmp_path / "run")
    return {"dense": dense, "corpus": corpus,
            "qwen": fast_config(write_tiny_moe(tmp_path / "qwen", "qwen3_moe"), corpus, tmp_path / "run"),
            "three": fast_config(write_tiny_moe(tmp_path / "three", "qwen3_moe", num_experts=3), corpus,
                                 tmp_path / "run")}


def test_the_parent_refuses_the_issues_examples_for_the_launched_world(configs, tmp_path, capsys):
    """What only shows on several processes is refused by the launcher itself, for the world it would start:
    one line, exit 2, and no worker started (the check runs in this process; a worker would have printed the
    error's line a second time)."""
    cases = [("dense", ["engine=fsdp", "expert_parallel_degree=2"], "describes a dense model"),
             ("three", ["engine=fsdp", "expert_parallel_degree=2"], "2 does not divide the 3 experts"),
             ("qwen", ["engine=fsdp", "expert_parallel_degree=4"], "4 does not divide the 2 data-parallel rank"),
             ("dense", ["dp=3"], "dp=3 does not match the launch: 2 process(es)")]
    for name, overrides, message in cases:
        path = write(tmp_path / f"{name}.yaml", {**configs[name], "dp": 2})
        code, stderr = cli_in_process(capsys, "train", path, *overrides, "--nproc-per-node", 2)
        assert code == 2 and error_lines(stderr) == stderr.strip().splitlines() and message in stderr, stderr
        assert len(stderr.strip().splitlines()) == 1
        args = PreTrainingArguments.from_yaml(path, overrides)
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            check_before_launch(args, world_size=2, local_size=2)


def test_launcher_flags_are_checked_and_stripped_from_the_workers_command(configs, tmp_path, capsys):
    path = write(tmp_path / "c.yaml", configs["dense"])
    for flags, message in ((["--nproc-per-node", 0], "argument --nproc-per-node: expected an integer >= 1, got '0'"),
                           (["--nproc-per-node", 1, "--nnodes", 2], "--nnodes 2: give --rdzv-endpoint"),
                           (["--nproc-per-node", 1, "--nnodes", 2, "--node-rank", 2, "--rdzv-endpoint", "h:1"],
                            "--node-rank 2: machines are numbered 0..1"),
                           (["--nproc-per-node", 1, "--nnodes", 2, "--rdzv-endpoint", "node0"],
                            "--rdzv-endpoint 'node0': expected HOST:PORT")):
        code, stderr = cli_in_process(capsys, "train", path, *flags)
        assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1, (flags, stderr)
    assert worker_argv(["train", "c.yaml", "--nproc-per-node", "2", "lr=1", "--nnodes=1", "--rdzv-id", "x",
                        "--shutdown-timeout", "9", "--rdzv-timeout=5"]) == ["train", "c.yaml", "lr=1"]


def test_flags_are_not_abbreviated_and_the_launchers_flags_need_the_launcher(configs, tmp_path, capsys):
    """An abbreviated flag is refused, the full one suggested: `--nproc 1` once started a launcher in every
    worker (the workers' command line kept it). The launcher's other flags without --nproc-per-node would do
    nothing; a worker that a launcher started may not launch again."""
    path = write(tmp_path / "c.yaml", configs["dense"])
    cases = [(["--nproc", 1], "unrecognized arguments: --nproc; did you mean --nproc-per-node?"),
             (["--nproc=1"], "unrecognized arguments: --nproc; did you mean --nproc-per-node?"),
             (["--nproc-per-node", 1, "--nnode", 1], "unrecognized arguments: --nnode; did you mean --nnodes?"),
             (["--nnodes", 2], "--nnodes 2: only used with --nproc-per-node N"),
             (["--node-rank", 0], "--node-rank 0: only used with --nproc-per-node N"),
             (["--rdzv-endpoint", "h:1"], "--rdzv-endpoint h:1: only used with --nproc-per-node N"),
             (["--rdzv-id", "x"], "--rdzv-id x: only used with --nproc-per-node N"),
             (["--rdzv-timeout", 5], "--rdzv-timeout 5: only used with --nproc-per-node N"),
             (["--shutdown-timeout", 5], "--shutdown-timeout 5: only used with --nproc-per-node N")]
    for flags, message in cases:
        code, stderr = cli_in_process(capsys, "train", path, *flags)
        assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1, (flags, stderr)
    # a command's unknown flag is named before a required one it leaves missing (`--inp` is not `--input`)
    code, stderr = cli_in_process(capsys, "prepare", "--inp", "x", "--output-prefix", tmp_path / "p")
    assert code == 2 and "unrecognized arguments: --inp; did you mean --input?" in stderr, stderr
    os.environ["TORCHELASTIC_RUN_ID"] = "outer"
    try:
        code, stderr = cli_in_process(capsys, "evaluate", tmp_path, "--nproc-per-node", 1)
    finally:
        del os.environ["TORCHELASTIC_RUN_ID"]
    assert code == 2 and "already a worker that a launcher started" in stderr, stderr
    done = run(pretrainer("train", path, "--nproc", 1), timeout=60)  # the console command, as the user typed it
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "pretrainer train: error: unrecognized arguments: --nproc; did you mean --nproc-per-node? (flags are spelled "
        "out in full) (see `pretrainer train --help`)"], describe(done)


def process_tree(root: int) -> dict[int, tuple[int, list[str]]]:
    """`root`'s descendants (pid: parent pid, command line), read from /proc."""
    parents, commands = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                commands[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except (OSError, IndexError, ValueError):  # the process ended while it was read
                continue
    tree, grown = {root}, True
    while grown:
        grown = False
        for pid, parent in parents.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grown = True
    return {pid: (parents[pid], commands[pid]) for pid in tree - {root} if pid in commands}


def test_a_launch_starts_one_launcher_and_its_workers_only(configs, tmp_path):
    """A real training through `--nproc-per-node=1`, its process tree read until it ends: the launcher starts one
    worker; no process below it has a launcher flag, and none starts pretrainer anew (a process that runs
    pretrainer below the worker is a fork of it, with its command line)."""
    path = write(tmp_path / "c.yaml", {**configs["dense"], "num_training_steps": 2, "eval_interval": 0,
                                       "save_interval": 0, "export_hf": False})
    process = subprocess.Popen([str(BIN / "pretrainer"), "train", str(path), "--nproc-per-node=1"], cwd=REPO,
                               env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[int, tuple[int, list[str]]] = {}
    while process.poll() is None:
        seen.update((pid, (parent, command)) for pid, (parent, command) in process_tree(process.pid).items()
                    if command != [""])  # a process between fork and exec, or a zombie
        time.sleep(0.05)
    stdout, stderr = process.communicate()
    assert process.returncode == 0, stderr[-3000:]
    runs_pretrainer = {pid: (parent, command) for pid, (parent, command) in seen.items()
                       if "pretrainer.cli" in command}
    workers = [pid for pid, (parent, _) in runs_pretrainer.items() if parent == process.pid]
    assert len(workers) == 1, seen
    assert not [command for _, command in seen.values() if any(
        item.split("=", 1)[0] in LAUNCHER_FLAGS or item.startswith("--nproc") for item in command)], seen
    assert all(parent == process.pid or command == seen.get(parent, (0, None))[1]
               for parent, command in runs_pretrainer.values()), seen
    assert sorted(train_losses(tmp_path / "run")) == [1, 2]


def watch(process: subprocess.Popen) -> tuple[str, bool, str, int]:
    """A process's first stderr line, whether it was still running 2 s later (its timeout is 6 s: a loaded
    machine's scheduling delay does not decide), the rest of its stderr, and its exit code."""
    first = process.stderr.readline()
    time.sleep(2)
    running = process.poll() is None
    rest = process.stderr.read()
    return first, running, rest, process.wait(timeout=60)


def test_a_rendezvous_says_what_it_waits_for_and_ends_with_one_line(configs, tmp_path):
    """Two machines, only one started: node 1 with no node 0, and node 0 with no node 1 (each on a port of its
    own). Each says at once what it waits for and how long, and at --rdzv-timeout ends with one line, exit 5."""
    path = write(tmp_path / "c.yaml", {**configs["dense"], "dp": 2})
    nodes = {rank: subprocess.Popen(
        [str(BIN / "pretrainer"), "train", str(path), "--nproc-per-node", "1", "--nnodes", "2", "--node-rank",
         str(rank), "--rdzv-endpoint", f"127.0.0.1:{listening_port() + rank}", "--rdzv-timeout", "6"], cwd=REPO,
        env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)}
    waits_for = {0: "for node 1 to join the rendezvous this machine hosts at 127.0.0.1:",
                 1: "for node 0 at 127.0.0.1:"}
    with ThreadPoolExecutor(2) as pool:
        watched = dict(zip(nodes, pool.map(watch, nodes.values())))
    for rank, (first, told_while_waiting, rest, code) in watched.items():
        assert first.startswith(f"pretrainer: node {rank} of 2: waiting up to 6 s (--rdzv-timeout) "
                                f"{waits_for[rank]}") and told_while_waiting, first
        assert code == 5 and rest.splitlines() == [rest.strip()] and rest.startswith(
            f"pretrainer: error: node {rank} of 2: the machines did not all meet at 127.0.0.1:"), rest
        assert "within --rdzv-timeout 6 s" in rest and "Traceback" not in rest


def test_the_outcome_names_root_causes_first_and_crashed_ranks(capsys):
    """Causes first, each once, and the exit code the first cause documents; a rank that torch's agent ended
    with SIGTERM because another rank had failed is not a cause."""
    lost = {"code": 5, "message": "rank 0: a collective failed", "consequence": True}
    cases = [  # statuses, failures (rank: exit code), failed_at, exit code, lines
        ({0: lost, 1: {"code": 2, "message": "train_data: file x does not exist"}}, {0: 5, 1: 2}, {}, 2,
         ["rank 1: train_data: file x does not exist", "rank 0: rank 0: a collective failed"]),
        ({0: {"code": 75, "message": None}, 1: {"code": 75, "message": None}}, {}, {}, 75, []),
        ({0: lost}, {0: 5, 1: -9}, {}, 128 + 9,
         ["rank 1 was killed by signal 9 (its output is above)", "rank 0: a collective failed"]),
        ({}, {0: 1}, {}, 1, ["rank 0 exited with code 1 (its output is above)"]),
        # both crashed: rank 1 first (exit 1), rank 0 then ended by the agent's SIGTERM
        ({}, {0: -15, 1: 1}, {0: 11, 1: 10}, 1,
         ["rank 1 exited with code 1 (its output is above); the other ranks were stopped"]),
        ({}, {0: 1, 1: -11}, {0: 11, 1: 10}, 128 + 11,
         ["rank 1 was killed by signal 11 (its output is above)", "rank 0 exited with code 1 (its output is above)"]),
        ({}, {0: 1, 1: 1, 2: -15}, {0: 10, 1: 10, 2: 10}, 1,
         ["ranks 0, 1 exited with code 1 (their output is above); the other ranks were stopped"]),
        ({}, {0: -15, 1: -15}, {}, 128 + 15, ["ranks 0, 1 were killed by signal 15 (their output is above)"]),
        ({1: {"code": 2, "message": "bad data"}}, {0: -15, 1: 2}, {}, 2, ["bad data"]),
    ]
    for statuses, failures, failed_at, code, lines in cases:
        capsys.readouterr()
        assert outcome(statuses, failures, failed_at) == code, (statuses, failures)
        assert capsys.readouterr().err.splitlines() == [f"pretrainer: error: {line}" for line in lines], failures


# A launched worker of a fault (python -c WORKER MODE): rank 1 is killed or crashes at once; rank 0 waits for a
# peer that never comes, then, stopped by the agent, says its collective failed (as pretrainer's workers do) or
# dies of the SIGTERM.
WORKER = """
import os, signal, sys, time
from pretrainer.train.launcher import record_worker_status
rank, mode = int(os.environ["RANK"]), sys.argv[1]
if rank == 1:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL) if mode == "kill" else sys.exit(1)
if mode == "kill":
    def lost_peer(signum, frame):
        record_worker_status(5, "rank 0: a collective failed: another rank died", consequence=True)
        os._exit(5)
    signal.signal(signal.SIGTERM, lost_peer)
time.sleep(60)
"""


@pytest.mark.parametrize("mode, code, lines", [
    ("kill", 128 + 9, ["rank 1 was killed by signal 9 (its output is above)",
                       "rank 0: a collective failed: another rank died"]),
    ("crash", 1, ["rank 1 exited with code 1 (its output is above); the other ranks were stopped"])])
def test_the_launcher_names_the_rank_that_failed_first(mode, code, lines):
    """Real workers under torch's agent: the rank that failed first is named first, and its code is the
    launch's; the other rank, stopped by the agent's SIGTERM, is a consequence (its line follows, or none)."""
    launcher = ("import sys; from pretrainer.train.launcher import LaunchPlan, launch; "
                f"sys.exit(launch(LaunchPlan(2, 1, 0, None, 'faults', 30), ['-c', {WORKER!r}, {mode!r}], ()))")
    done = run([sys.executable, "-c", launcher], timeout=120)
    assert done.returncode == code, describe(done)
    assert error_lines(done.stderr) == [f"pretrainer: error: {line}" for line in lines], describe(done)


def test_a_workers_error_is_one_line_from_the_launcher_and_once_under_torchrun(configs, tmp_path):
    """A file only the workers open (the parent does not read data): the launcher prints the line the two ranks
    agree on once and exits 2; under plain torchrun the line appears once (rank 0's), torchrun's summary around
    it."""
    path = write(tmp_path / "c.yaml", {**configs["dense"], "dp": 2, "train_data": str(tmp_path / "missing.jsonl")})
    done = run(pretrainer("train", path, "--nproc-per-node", 2), timeout=240)
    assert done.returncode == 2 and "Traceback" not in done.stderr, describe(done)
    assert done.stderr.strip().splitlines() == [f"pretrainer: error: train_data: file {tmp_path}/missing.jsonl "
                                                "does not exist"], describe(done)
    done = run(torchrun(2, *pretrainer("train", path)), timeout=240)
    assert done.returncode != 0 and len(error_lines(done.stderr)) == 1, describe(done)


def fake_slurm(folder: Path, nodes: int) -> dict:
    """`srun` that runs its command once per machine of the allocation (all on this one, SLURM_NODEID set), and
    `scontrol` that names this machine and records a requeue: the two Slurm commands the script calls."""
    folder.mkdir()
    scripts = {
        # each machine's task in a session of its own, its pid (= its group) listed: the job step Slurm signals
        "srun": ("#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\npids=()\n"
                 f"for node in $(seq 0 {nodes - 1}); do SLURM_NODEID=$node SLURM_PROCID=$node setsid \"$@\" & "
                 f"pids+=($!); echo $! >> {folder}/tasks; done\n"
                 "code=0\nfor pid in \"${pids[@]}\"; do wait $pid; c=$?; [ $c -ne 0 ] && code=$c; done\n"
                 "exit $code\n"),
        "scontrol": f"#!/bin/bash\nif [ \"$1\" = show ]; then echo 127.0.0.1; else echo \"$@\" >> {folder}/calls; fi\n",
    }
    for name, text in scripts.items():
        (folder / name).write_text(text)
        (folder / name).chmod(stat.S_IRWXU)
    return environment(PATH=f"{folder}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_NNODES=str(nodes),
                       SLURM_JOB_NODELIST="node[0-1]", GPUS_PER_NODE="1", RDZV_PORT=str(listening_port()),
                       PRETRAINER=str(BIN / "pretrainer"))


def test_the_slurm_script_trains_on_two_machines_and_requeues_after_a_stop(configs, tmp_path):
    """examples/slurm/pretrain.sbatch's body for two machines of one process each: SIGTERM to the job step (as
    --signal=TERM@300 sends it) ends in a checkpoint, exit 75 and a requeue; the requeued job resumes from it on
    the same 2-rank world and trains every step once (that a resumed run's losses are an uninterrupted run's is
    tested in test_faults.py)."""
    config = write(tmp_path / "c.yaml", {**configs["dense"], "dp": 2, "num_training_steps": 30, "eval_interval": 0,
                                         "save_interval": 0, "export_hf": False})
    env = fake_slurm(tmp_path / "slurm", nodes=2)
    script = ["bash", REPO / "examples" / "slurm" / "pretrain.sbatch", config, f"save_dir={tmp_path / 'run'}"]
    process = start(script, tmp_path / "job.log", env=env)
    wait_for_step(tmp_path / "run", 4, process)
    for task in (tmp_path / "slurm" / "tasks").read_text().split():  # the step's processes, not the batch shell
        os.killpg(int(task), signal.SIGTERM)
    assert process.wait(timeout=180) == EXIT_PREEMPTED, (tmp_path / "job.log").read_text()[-3000:]
    assert (tmp_path / "slurm" / "calls").read_text().split() == ["requeue", "4242"]
    stopped_at = max(train_losses(tmp_path / "run"))
    requeued = run(script, env=env, timeout=300)
    assert requeued.returncode == 0 and f"step-{stopped_at} at step {stopped_at}" in requeued.stdout, describe(requeued)
    assert sorted(train_losses(tmp_path / "run")) == list(range(1, 31))
    state = json.loads(next((tmp_path / "run" / "checkpoints").glob("step-30/trainer_state.json")).read_text())
    assert state["world_size"] == 2


def test_evaluate_through_the_launcher_on_two_processes(tmp_path):
    """`pretrainer evaluate HF_FOLDER --nproc-per-node 2`: the folder has no layout, so both processes are data-parallel
    replicas (no dp= needed); the scores are printed once and written where --output says."""
    scores = tmp_path / "scores.json"
    done = run(pretrainer("evaluate", REPO / "examples" / "models" / "tiny-llama", "--tasks",
                          REPO / "examples" / "tasks" / "python_docs_choices.jsonl", "--limit", 8, "dtype=fp32",
                          "--output", scores, "--nproc-per-node", 2), timeout=240)
    assert done.returncode == 0, describe(done)
    assert done.stdout.count("python_docs_choices: acc ") == 1 and json.loads(scores.read_text())[
        "python_docs_choices"]["records"] == 8
