"""Replica fault tolerance (`fault_tolerance`, torchft): replica groups of a run, each its own `pretrainer train
--replica-group I` launch, kept in step by `pretrainer lighthouse`. One group is SIGKILLed mid-run; the other goes on
without stopping; the killed one is started again by its launcher, heals from its peer and from then on holds
bitwise the peer's parameters. Every run is inside a network namespace of its own (every address is 127.0.0.1)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from helpers import CORPUS, QUICKSTART_MODEL, write_tiny_moe
from pretrainer import ConfigError, PreTrainingArguments
from pretrainer.config.fault_tolerance import GROUP_ENV

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent
GROUP_SAMPLES = 2  # micro-batch 2, no accumulation, one rank per group

pytestmark = pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")


def config(folder: Path, port: int, steps: int, **keys) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "ft.yaml"
    path.write_text(yaml.safe_dump({
        "num_training_steps": steps, "micro_batch_size": GROUP_SAMPLES, "dp": 1, "gradient_accumulation_steps": 1,
        "seq_length": 64, "dtype": "fp32", "model_path": str(QUICKSTART_MODEL), "train_data": str(CORPUS),
        "lr": 1e-3, "warmup_steps": 5, "seed": 7, "save_dir": str(folder / "run"), "save_interval": 25,
        "eval_interval": 50, "eval_iters": 4, "log_interval": 1, "write_report": False, "export_hf": False,
        "fault_tolerance": {"replica_groups": 2, "lighthouse": f"127.0.0.1:{port}", "min_replicas": 1,
                            "timeout_seconds": 20, "params_digest_interval": 1}, **keys}))
    return path


def replica_run(folder: Path, port: int, steps: int, *extra: str, codes=(0, 0), **keys) -> dict:
    """The lighthouse and two groups in a network namespace of their own; the driver's summary."""
    path = config(folder, port, steps, **keys)
    done = subprocess.run(["unshare", "--net", str(BIN / "python"), str(HERE / "replica_run.py"), str(path),
                           "--groups", str(len(codes)), "--port", str(port), "--out", str(folder / "out"),
                           "--save-dir", str(folder / "run"), *extra], capture_output=True, text=True, timeout=600)
    logs = "".join(p.read_text()[-3000:] for p in sorted((folder / "out").glob("*.log")))
    assert done.returncode == 0, done.stderr[-3000:] + logs
    summary = json.loads((folder / "out" / "summary.json").read_text())
    assert summary["returncodes"] == list(codes), logs
    return summary


def rows(folder: Path, group: int) -> list[dict]:
    return [json.loads(line) for line in (folder / "run" / f"replica-{group}" / "metrics.jsonl").read_text()
            .splitlines()]


def by_step(folder: Path, group: int) -> dict[int, dict]:
    return {row["step"]: row for row in rows(folder, group) if "loss" in row}  # a restart's rows replace the old


def logged_at(line: str) -> float:
    return datetime.strptime(re.search(r"\]\[([\d-]+ [\d:,]+)\]", line).group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_a_killed_group_leaves_the_quorum_rejoins_heals_and_ends_equal_to_its_peer(tmp_path):
    """100 steps, group 1 SIGKILLed once its step-30 row is out. Group 0 commits every step to 100, its quorum down
    to 1 group within seconds of the kill; group 1's launcher starts it again, it resumes its own checkpoint, heals
    from group 0 and from then on both hold bitwise-equal parameters at every step. Each row says how many groups
    took part, and the samples trained and dropped add up to what the steps read. The final eval loss is within 2%
    of an uninterrupted 2-group run's."""
    killed = replica_run(tmp_path / "killed", 29710, 100, "--kill-group", "1", "--kill-step", "30")
    assert replica_run(tmp_path / "whole", 29711, 100)["killed_at"] is None
    survivor, healed = by_step(tmp_path / "killed", 0), by_step(tmp_path / "killed", 1)
    assert sorted(survivor) == list(range(1, 101))
    groups = [survivor[step]["replica_groups"] for step in range(1, 101)]
    left, back = groups.index(1) + 1, len(groups) - groups[::-1].index(1) + 1  # the first alone, the first again
    assert killed["killed_at"] < left <= killed["killed_at"] + 2 and set(groups[left - 1:back - 1]) == {1}
    assert set(groups[:left - 1]) == {2} and set(groups[back - 1:]) == {2}
    log = (tmp_path / "killed" / "out" / "group0.log").read_text()
    change = next(line for line in log.splitlines() if "1 of 2 take part; group00001 left" in line)
    assert f"replica groups at step {left}:" in change and logged_at(change) - killed["kill_time"] < 10
    assert "healed from a live group" in (tmp_path / "killed" / "out" / "group1.log").read_text()
    assert set(healed) == {*range(1, killed["killed_at"] + 1), *range(back, 101)}  # no row while it was away
    for step in [*range(1, left), *range(back, 101)]:  # bitwise equal wherever both took part
        assert survivor[step]["params_sha256"] == healed[step]["params_sha256"], step
    retried = log.count("was not committed")
    last = survivor[100]
    assert last["samples_trained"] + last["samples_dropped"] == (100 + retried) * 2 * GROUP_SAMPLES
    assert last["samples_dropped"] == ((back - left) + retried) * GROUP_SAMPLES + retried * GROUP_SAMPLES
    assert whole_rows_say_two_groups(tmp_path / "whole")
    final = [row["eval_loss"] for row in rows(tmp_path / "killed", 0) if "eval_loss" in row][-1]
    reference = [row["eval_loss"] for row in rows(tmp_path / "whole", 0) if "eval_loss" in row][-1]
    print(f"final eval loss: killed run {final:.4f}, uninterrupted {reference:.4f} "
          f"({100 * (final / reference - 1):+.2f}%), {back - left} steps with one group")
    assert abs(final / reference - 1) < 0.02


def test_two_groups_of_two_fsdp_ranks_go_on_without_the_killed_one_and_heal_it(tmp_path):
    """Each group is 2 fsdp ranks (its own layout inside); a worker of group 1 is SIGKILLed at step 20, its launcher
    starts both its ranks again, each rank heals from its counterpart in group 0 (the same shard), and the whole
    parameters of both groups are bitwise equal at every step from then on."""
    killed = replica_run(tmp_path, 29712, 60, "--kill-group", "1", "--kill-step", "20", "--nproc", "2",
                         engine="fsdp", dp=2)
    survivor, healed = by_step(tmp_path, 0), by_step(tmp_path, 1)
    assert sorted(survivor) == list(range(1, 61))
    back = min(step for step in healed if step > killed["killed_at"])
    # the survivor trains alone until the restarted group is back (none, where it is back within the heartbeat
    # timeout: the quorum then waits for it)
    assert back < 60 and {survivor[step]["replica_groups"] for step in range(killed["killed_at"] + 2, back)} <= {1}
    for step in [*range(1, killed["killed_at"] + 1), *range(back, 61)]:
        assert survivor[step]["params_sha256"] == healed[step]["params_sha256"], step
    assert survivor[60]["replica_groups"] == 2


DILOCO = {"replica_groups": 2, "min_replicas": 1, "timeout_seconds": 20, "params_digest_interval": 1,
          "mode": "diloco", "sync_every": 8}


def test_a_short_last_interval_ends_on_the_groups_average_not_a_momentum_step(tmp_path):
    """DiLoCo's last sync after fewer than sync_every inner steps averages the groups' parameters: for one group
    (sync_every 16, 12 steps: that sync is the only one) the run ends on its inner steps' parameters, so its final
    eval loss is that of the same run without fault tolerance (an outer momentum step would move it)."""
    summary = replica_run(tmp_path / "ft", 29721, 12, codes=(0,), eval_interval=12, fault_tolerance={
        **DILOCO, "replica_groups": 1, "sync_every": 16, "lighthouse": "127.0.0.1:29721"})
    assert summary["returncodes"] == [0]
    path = config(tmp_path / "plain", 1, 12, eval_interval=12)
    done = subprocess.run([str(BIN / "pretrainer"), "train", str(path), "fault_tolerance=null"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    plain = [json.loads(line) for line in (tmp_path / "plain" / "run" / "metrics.jsonl").read_text().splitlines()]
    expected = [row["eval_loss"] for row in plain if "eval_loss" in row][-1]
    assert [row["eval_loss"] for row in rows(tmp_path / "ft", 0) if "eval_loss" in row][-1] == \
        pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("layout, port", [
    ({"engine": "megatron", "plugin_args": {"pp_degree": 2}}, 29718),
    ({"engine": "megatron", "plugin_args": {"tp_degree": 2, "sequence_parallelism": True}}, 29719),
    ({"engine": "fsdp", "expert_parallel_degree": 2, "dp": 2, "model_path": "moe"}, 29724)],
    ids=["pp2", "tp2-sp", "moe-ep2"])
def test_two_groups_of_two_ranks_heal_each_stage_or_shard_from_its_counterpart(tmp_path, layout, port):
    """Each group is 2 ranks: two pipeline stages, two tensor-parallel shards, or an MoE model's experts split over
    2 expert-parallel ranks; group 1 is killed at step 8 and started again (with min_replicas 2, group 0 waits for
    it), and each of its ranks heals from the rank of group 0 holding the same stage or shard: the digests of the
    whole model (gathered over the stages and shards) are bitwise equal at every step, and every step was trained
    by both groups."""
    if layout.get("model_path") == "moe":
        layout = {**layout, "model_path": str(write_tiny_moe(tmp_path / "moe", "qwen3_moe"))}
    killed = replica_run(tmp_path, port, 24, "--kill-group", "1", "--kill-step", "8", "--nproc", "2",
                         gradient_accumulation_steps=2, **layout, fault_tolerance={
                             "replica_groups": 2, "lighthouse": f"127.0.0.1:{port}", "min_replicas": 2,
                             "timeout_seconds": 60, "params_digest_interval": 1})
    survivor, healed = by_step(tmp_path, 0), by_step(tmp_path, 1)
    assert sorted(survivor) == sorted(healed) == list(range(1, 25))
    assert "healed from a live group: step 0 -> " in (tmp_path / "out" / "group1.log").read_text()
    assert "1 of the 2 needed are in the quorum at step" in (tmp_path / "out" / "group0.log").read_text()
    for step in range(1, 25):
        assert survivor[step]["params_sha256"] == healed[step]["params_sha256"], step
        assert survivor[step]["replica_groups"] == 2, step
    assert killed["killed_at"] >= 8  # every step trained by both groups: 2 accumulated micro-batches a data rank
    assert survivor[24]["samples_trained"] == healed[24]["samples_trained"] == \
        24 * 2 * 2 * GROUP_SAMPLES * layout.get("dp", 1)


def test_diloco_survives_the_kill_and_its_groups_agree_at_every_sync(tmp_path):
    """`mode: diloco`, H = 8 over 100 steps: each group steps on its own gradients, the outer Nesterov step every 8
    steps (and at the last, step 100) averages them. Group 1 is killed at step 30 and heals at a later sync; at every
    sync step both took part in, the groups' parameters are bitwise equal, and the samples trained and dropped add up
    to every step's read. The final eval loss is printed beside the synchronous run's (the first test)."""
    killed = replica_run(tmp_path, 29713, 100, "--kill-group", "1", "--kill-step", "30",
                         fault_tolerance={**DILOCO, "lighthouse": "127.0.0.1:29713"})
    survivor, healed = by_step(tmp_path, 0), by_step(tmp_path, 1)
    assert sorted(survivor) == list(range(1, 101))
    syncs = [*range(8, 100, 8), 100]
    both = [step for step in syncs if step in healed and survivor[step]["replica_groups"] == 2]
    assert both[0] == 8 and both[-1] == 100 and any(step > killed["killed_at"] for step in both)
    for step in both:
        assert survivor[step]["params_sha256"] == healed[step]["params_sha256"], step
    alone = [step for step in syncs if survivor[step]["replica_groups"] == 1]
    assert alone and survivor[100]["samples_dropped"] >= 8 * GROUP_SAMPLES * len(alone)
    assert survivor[100]["samples_trained"] + survivor[100]["samples_dropped"] == 100 * 2 * GROUP_SAMPLES
    final = [row["eval_loss"] for row in rows(tmp_path, 0) if "eval_loss" in row][-1]
    print(f"diloco (H=8) final eval loss with a kill: {final:.4f}")


@pytest.mark.parametrize("mode, port", [("diloco", 29716), ("sync", 29722)])
def test_groups_resumed_from_their_checkpoints_equal_the_uninterrupted_run(tmp_path, mode, port):
    """Both groups stop at step 12 (exit_interval) and are started again from their checkpoints. Under diloco that
    is 4 steps past the sync at 8: the resumed run takes its next syncs (16, and 20 at the end) with the saved outer
    momentum and last-sync parameters. Every later step's loss and the final parameters equal the uninterrupted
    run's."""
    block = {**DILOCO, "mode": mode}
    whole = tmp_path / "whole"
    replica_run(whole, port, 20, fault_tolerance={**block, "lighthouse": f"127.0.0.1:{port}"})
    split = tmp_path / "split"
    replica_run(split, port + 1, 20, fault_tolerance={**block, "lighthouse": f"127.0.0.1:{port + 1}"},
                exit_interval=12)
    assert max(by_step(split, 0)) == 12
    replica_run(split, port + 1, 20, fault_tolerance={**block, "lighthouse": f"127.0.0.1:{port + 1}"})
    for group in (0, 1):
        expected, resumed = by_step(whole, group), by_step(split, group)
        for step in range(13, 21):
            assert resumed[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5, abs=1e-6), (group, step)
        assert resumed[20]["params_sha256"] == expected[20]["params_sha256"], group
        assert resumed[20]["samples_trained"] == expected[20]["samples_trained"] == 20 * 2 * GROUP_SAMPLES


FAKE_SRUN = """#!/bin/bash
# srun of one task: its options dropped, the command run here; SIGTERM passed to it, as srun does
while [[ $1 != /* ]]; do shift; done
"$@" &
task=$!
trap 'kill -TERM $task' TERM
wait $task; code=$?
while kill -0 $task 2>/dev/null; do wait $task; code=$?; done
exit $code
"""


def test_the_slurm_template_stops_every_group_at_the_time_limit_and_the_requeued_job_finishes(tmp_path):
    """examples/slurm/pretrain_ft.sbatch on two machines (both this one, in a network namespace): the lighthouse and
    one step per group; SIGTERM to the batch shell (--signal=B:TERM) reaches the groups only, each writes a
    checkpoint and exits 75, and the job is requeued; the requeued job's groups resume and finish, equal."""
    fake = tmp_path / "slurm"
    fake.mkdir()
    (fake / "srun").write_text(FAKE_SRUN)
    (fake / "scontrol").write_text("#!/bin/bash\nif [ \"$1\" = show ]; then printf '127.0.0.1\\n127.0.0.1\\n'; "
                                   f"else echo \"$@\" >> {fake}/calls; fi\n")
    for name in ("srun", "scontrol"):
        (fake / name).chmod(0o755)
    path = config(tmp_path, 29720, 40, save_interval=0, eval_interval=0)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "GPUS_PER_NODE": "1",
           "SLURM_JOB_NODELIST": "node[0-1]", "PRETRAINER": str(BIN / "pretrainer"), "LIGHTHOUSE_PORT": "29720",
           "MAX_RESTARTS": "1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    job = ["unshare", "--net", "bash", "-c", 'ip link set lo up && exec bash "$0" "$@"',
           str(HERE.parent / "examples" / "slurm" / "pretrain_ft.sbatch"), str(path)]
    with open(tmp_path / "job.log", "w") as log:
        process = subprocess.Popen(job, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 240
        while not any(row.get("step", 0) >= 4 for row in rows_if_any(tmp_path, 0)):
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "job.log").read_text()[-3000:]
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=180) == 75, (tmp_path / "job.log").read_text()[-3000:]
    assert (fake / "calls").read_text().split() == ["requeue", "4242"]
    stopped = [max(by_step(tmp_path, group)) for group in (0, 1)]
    assert all(step < 40 for step in stopped)
    requeued = subprocess.run(job, capture_output=True, text=True, env=env, timeout=300)
    assert requeued.returncode == 0, requeued.stdout[-3000:]
    for group in (0, 1):
        assert sorted(by_step(tmp_path, group)) == list(range(1, 41))
    assert by_step(tmp_path, 0)[40]["params_sha256"] == by_step(tmp_path, 1)[40]["params_sha256"]


def rows_if_any(folder: Path, group: int) -> list[dict]:
    path = folder / "run" / f"replica-{group}" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def whole_rows_say_two_groups(folder: Path) -> bool:
    steps = by_step(folder, 0)
    return all(row["replica_groups"] == 2 and row["samples_dropped"] == 0 for row in steps.values()) and \
        steps[100]["params_sha256"] == by_step(folder, 1)[100]["params_sha256"]


@pytest.mark.parametrize("block, message", [
    ({"replica_groups": 2}, r"fault_tolerance.lighthouse must be HOST:PORT"),
    ({"replica_groups": 2, "lighthouse": "[::1]:29510"}, r"an IPv4 address, PORT 1-65535\), .* got '\[::1\]:29510'"),
    ({"replica_groups": 2, "lighthouse": "node0:99999"}, r"PORT 1-65535\), .* got 'node0:99999'"),
    ({"replica_groups": 0, "lighthouse": "h:1"}, r"fault_tolerance.replica_groups must be a whole number >= 1"),
    ({"replica_groups": 2, "lighthouse": "h:1", "min_replicas": 3}, r"min_replicas must be a whole number from 1 "
                                                                    r"to replica_groups \(2\)"),
    ({"replica_groups": 2, "lighthouse": "h:1", "mode": "async"}, r"fault_tolerance.mode is one of sync, diloco"),
    ({"replica_groups": 2, "lighthouse": "h:1", "replicas": 2}, r"unknown key\(s\) replicas in fault_tolerance"),
    ("2", r"key .fault_tolerance.: expected a mapping or null"),
])
def test_a_bad_fault_tolerance_block_is_refused_naming_the_key(tmp_path, block, message):
    with pytest.raises(ConfigError, match=message):
        PreTrainingArguments(**{"num_training_steps": 1, "micro_batch_size": 1, "dp": 1, "fault_tolerance": block})


def test_spike_rules_are_refused_with_replica_groups():
    with pytest.raises(ConfigError, match=r"spike_zscore with fault_tolerance is not available"):
        PreTrainingArguments(**{"num_training_steps": 1, "micro_batch_size": 1, "dp": 1, "spike_zscore": 6,
                                "fault_tolerance": {"replica_groups": 2, "lighthouse": "h:1"}})


def test_a_missing_lighthouse_and_a_group_started_twice_end_in_one_line(tmp_path):
    """No lighthouse: each group stops after timeout_seconds naming where it looked (its launcher's restart too).
    Two launches of --replica-group 0: both are refused at their first quorum."""
    replica_run(tmp_path / "alone", 29714, 10, "--no-lighthouse", codes=(2,), fault_tolerance={
        "replica_groups": 2, "lighthouse": "127.0.0.1:29714", "timeout_seconds": 3})
    assert "no lighthouse answered at 127.0.0.1:29714 within timeout_seconds (3 s)" in \
        (tmp_path / "alone" / "out" / "group0.log").read_text()
    replica_run(tmp_path / "twice", 29715, 10, "--group-ids", "0,0", codes=(2, 2))
    for index in (0, 1):
        assert "group00000 is in the quorum twice: two launches were given the same --replica-group" in \
            (tmp_path / "twice" / "out" / f"group{index}.log").read_text()


def test_a_group_index_and_the_block_go_together(tmp_path, monkeypatch):
    from pretrainer.config.fault_tolerance import read_fault_tolerance, replica_group

    settings = read_fault_tolerance({"replica_groups": 2, "lighthouse": "127.0.0.1:1"})
    monkeypatch.delenv(GROUP_ENV, raising=False)
    with pytest.raises(ConfigError, match=r"start each replica group with `pretrainer train CONFIG --nproc-per-node N "
                                          r"--replica-group I` \(I from 0 to 1\)"):
        replica_group(settings)
    monkeypatch.setenv(GROUP_ENV, "2")
    with pytest.raises(ConfigError, match=r"--replica-group 2: groups are numbered 0..1"):
        replica_group(settings)
    with pytest.raises(ConfigError, match=r"--replica-group 2: the config has no fault_tolerance block"):
        replica_group(None)
    done = subprocess.run([str(BIN / "pretrainer"), "train", str(config(tmp_path, 1, 10)), "fault_tolerance=null",
                           "--replica-group", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--replica-group 0: the config has no fault_tolerance block" in done.stderr
    done = subprocess.run([str(BIN / "pretrainer"), "lighthouse", "--bind", "nowhere", "--min-replicas", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--bind 'nowhere': expected HOST:PORT" in done.stderr
