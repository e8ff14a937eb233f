"""`pretrainer train --nproc-per-node`: the run checked for its world before any worker starts, a worker's error as
one line and one exit code, plain torchrun's error said once, and the Slurm script run for two machines."""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

import pytest
import yaml

from conftest import fast_config
from helpers import small_corpus_file, train_losses, wait_for_step, write_tiny_model, write_tiny_moe
from launch import BIN, REPO, cli_in_process, describe, environment, listening_port, pretrainer, run, start, torchrun
from pretrainer.config import ConfigError, PreTrainingArguments
from pretrainer.train.launcher import check_before_launch, outcome, worker_argv
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
                        "--shutdown-timeout", "9"]) == ["train", "c.yaml", "lr=1"]


def test_the_outcome_names_root_causes_first_and_crashed_ranks():
    statuses = {0: {"code": 5, "message": "rank 0: a collective failed", "consequence": True},
                1: {"code": 2, "message": "train_data: file x does not exist", "consequence": False}}
    assert outcome(statuses, {1: 2}) == 2
    assert outcome({0: {"code": 75, "message": None}, 1: {"code": 75, "message": None}}, {}) == 75
    assert outcome({0: {"code": 5, "message": "lost a peer", "consequence": True}}, {1: -9}) == 128 + 9
    assert outcome({}, {0: 1}) == 1


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
