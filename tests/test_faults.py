"""Faults: SIGTERM mid-run (one process and two ranks) then a rerun, a second signal, non-finite gradients."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers import files_limited_to, read_metrics, train_losses, wait_for_step
from launch import REPO, describe, pretrainer, run, run_ok, start, torchrun
from pretrainer import PreTrainer, PreTrainingArguments
from pretrainer.train.errors import TrainingDiverged
from pretrainer.train.signals import EXIT_PREEMPTED


@pytest.fixture
def long_config(base_config, tmp_path) -> Path:
    config = {**base_config, "num_training_steps": 40, "eval_interval": 0, "save_interval": 0, "export_hf": False,
              "warmup_steps": 2}
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_sigterm_checkpoints_exits_75_and_the_rerun_matches_an_uninterrupted_run(long_config, tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    command = pretrainer("train", long_config)
    run_ok([*command, f"save_dir={straight}"])
    process = start([*command, f"save_dir={stopped}"], tmp_path / "stopped.log")
    wait_for_step(stopped, 5, process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == EXIT_PREEMPTED, (tmp_path / "stopped.log").read_text()[-3000:]
    log = (tmp_path / "stopped.log").read_text()
    assert "SIGTERM received: finishing this step" in log and "rerun the same command to continue" in log
    saved = sorted(int(p.name.split("-")[1]) for p in (stopped / "checkpoints").glob("step-*"))
    assert len(saved) == 1 and 5 <= saved[0] < 40
    assert max(train_losses(stopped)) == saved[0]  # stopped right after the step it saved
    run_ok([*command, f"save_dir={stopped}"])
    assert train_losses(stopped) == train_losses(straight)


ENGINE_OPTIONS = {"ddp": ["dp=2"], "fsdp": ["dp=2", "engine=fsdp"],
                  "deepspeed-zero2": ["dp=2", 'deepspeed={"zero_optimization": {"stage": 2}}'],
                  "megatron-pp2": ["dp=1", "engine=megatron", "plugin_args.pp_degree=2"]}


@pytest.mark.parametrize("engine", ENGINE_OPTIONS)
def test_sigterm_on_two_ranks_stops_both_after_the_same_step(long_config, tmp_path, engine):
    save_dir = tmp_path / "two"
    options = [*ENGINE_OPTIONS[engine], "micro_batch_size=1"]
    train = pretrainer("train", long_config, *options, f"save_dir={save_dir}")
    # ddp through pretrainer's own launcher (which then exits 75 itself), the others under torchrun
    command = [*train, "--nproc-per-node", 2] if engine == "ddp" else torchrun(2, *train)
    process = start(command, tmp_path / "two.log")
    wait_for_step(save_dir, 4, process)
    os.killpg(process.pid, signal.SIGTERM)  # what a scheduler does: the whole job gets the signal
    code = process.wait(timeout=120)
    log = (tmp_path / "two.log").read_text()
    assert engine != "ddp" or code == EXIT_PREEMPTED, log[-3000:]
    assert log.count("SIGTERM received") >= 1, log[-3000:]
    saved = sorted((save_dir / "checkpoints").glob("step-*"))
    assert len(saved) == 1, log[-3000:]
    state = json.loads((saved[0] / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and len(list(saved[0].glob("extra_state_rank*.pt"))) == 2
    run_ok(command)
    assert sorted(train_losses(save_dir)) == list(range(1, 41))


def test_a_repeat_within_the_window_is_the_same_stop_and_a_later_signal_aborts_at_once(tmp_path):
    script = ("import os, signal, time\nfrom pretrainer.train.signals import REPEAT_WINDOW_S, StopRequests\n"
              "s = StopRequests(); s.install()\nos.kill(os.getpid(), signal.SIGTERM)\n"
              "os.kill(os.getpid(), signal.SIGTERM)\nprint('repeat ignored', flush=True)\n"
              "time.sleep(REPEAT_WINDOW_S + 0.5)\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(5)\n"
              "print('not reached')\n")
    done = run([sys.executable, "-c", script], timeout=60)
    assert done.returncode == -signal.SIGTERM and "repeat ignored" in done.stdout and "not reached" not in done.stdout


def nan_logits_on(calls: set):
    """A forward hook that turns the logits of the given forward calls (1-based) into NaN."""
    count = [0]

    def hook(module, inputs, output):
        count[0] += 1
        if count[0] in calls:
            output.logits = output.logits * float("nan")  # keeps the graph: NaN gradients follow
        return output
    return hook


def test_a_nan_loss_skips_the_update_and_the_run_goes_on(base_config, tmp_path):
    config = {**base_config, "eval_interval": 0, "save_dir": str(tmp_path / "run")}
    trainer = PreTrainer(PreTrainingArguments(**config))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.model.register_forward_hook(nan_logits_on({3}))  # step 2's first micro-batch (2 per step)
    trainer.train()
    rows = read_metrics(tmp_path / "run")
    skipped = [r for r in rows if r.get("skipped_update")]
    assert [r["step"] for r in skipped] == [2] and skipped[0]["grad_norm"] != skipped[0]["grad_norm"]  # NaN
    losses = train_losses(tmp_path / "run")
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and losses[2] != losses[2]  # the NaN is logged as it was
    assert all(losses[s] == losses[s] for s in (1, 3, 4, 5, 6))
    assert trainer.skips.total == 1
    assert all(torch.isfinite(v).all() for v in trainer.model.state_dict().values())
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_too_many_skipped_updates_in_a_row_stop_the_run(base_config, tmp_path):
    config = {**base_config, "eval_interval": 0, "save_interval": 0, "max_skipped_updates": 2,
              "save_dir": str(tmp_path / "run")}
    trainer = PreTrainer(PreTrainingArguments(**config))
    trainer.model.register_forward_hook(nan_logits_on(set(range(3, 100))))
    with pytest.raises(TrainingDiverged,
                       match=r"2 updates in a row were skipped \(last at step 3: non-finite gradient norm\)"):
        trainer.train()
    assert not (tmp_path / "run" / "checkpoints").exists()


def run_cli(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    return run(pretrainer("train", config, *overrides))


@pytest.mark.parametrize("damage", ["truncate", "flip a byte"])
def test_a_damaged_checkpoint_is_skipped_with_a_message_naming_it(base_config, tmp_path, damage):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**base_config, "eval_interval": 0, "export_hf": False}))
    save_dir = tmp_path / "run"
    assert run_cli(config, f"save_dir={save_dir}").returncode == 0
    straight = train_losses(save_dir)
    manifest = json.loads((save_dir / "checkpoints" / "step-6" / "manifest.json").read_text())
    assert manifest["step"] == 6 and manifest["world_size"] == 1 and manifest["config_hash"]
    shard = save_dir / "checkpoints" / "step-6" / "__0_0.distcp"
    assert manifest["files"]["__0_0.distcp"]["bytes"] == shard.stat().st_size
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        shard.write_bytes(data[:100])
    else:
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(data)
    rerun = run_cli(config, f"save_dir={save_dir}", "num_training_steps=6")
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    expected = "is 100 bytes, its manifest says" if damage == "truncate" else "does not match its checksum"
    assert f"skipping checkpoint {save_dir / 'checkpoints' / 'step-6'}: __0_0.distcp {expected}" in rerun.stdout
    assert "resumed from" in rerun.stdout and "step-3 at step 3" in rerun.stdout
    assert train_losses(save_dir) == straight  # steps 4-6 trained again, identically


def test_retention_keeps_the_last_k_and_every_mth(base_config, tmp_path):
    config = {**base_config, "num_training_steps": 9, "save_interval": 1, "eval_interval": 0, "export_hf": False,
              "keep_last_checkpoints": 2, "keep_checkpoints_every": 4, "save_dir": str(tmp_path / "run")}
    PreTrainer(PreTrainingArguments(**config)).train()
    kept = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert kept == [4, 8, 9]


def test_too_little_space_is_a_clear_error_that_keeps_the_previous_checkpoint(base_config, tmp_path, monkeypatch):
    from pretrainer.train import checkpoint as ckpt

    config = {**base_config, "eval_interval": 0, "export_hf": False, "save_dir": str(tmp_path / "run")}
    trainer = PreTrainer(PreTrainingArguments(**config))
    real_usage = ckpt.shutil.disk_usage
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: real_usage(path)._replace(free=1000))
    with pytest.raises(ckpt.CheckpointError, match=r"not enough disk space .* the previous checkpoint is intact"):
        trainer.train()  # step-3 fits (nothing to compare with); step-6 does not
    monkeypatch.undo()
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text() == "step-3" and ckpt.verify_checkpoint(root / "step-3") is None


@pytest.mark.parametrize("async_checkpoint", [False, True], ids=["sync", "async"])
def test_a_checkpoint_whose_writes_fail_is_a_clear_error_that_keeps_the_previous_one(base_config, tmp_path,
                                                                                      async_checkpoint):
    from pretrainer.train import checkpoint as ckpt

    config = {**base_config, "eval_interval": 0, "export_hf": False, "save_dir": str(tmp_path / "run"),
              "async_checkpoint": async_checkpoint, "exit_interval": 3}
    PreTrainer(PreTrainingArguments(**config)).train()  # step-3, and the corpus tokenized into the cache
    config["exit_interval"] = None
    trainer = PreTrainer(PreTrainingArguments(**config))  # resumes at step 3
    with files_limited_to(64 * 1024), pytest.raises(ckpt.CheckpointError) as failure:  # the shards are larger
        trainer.train()
    root = tmp_path / "run" / "checkpoints"
    assert re.fullmatch(rf"writing checkpoint {root / 'step-6'} failed \(.*(File too large|short write).*\); the "
                        rf"previous checkpoint {root / 'step-3'} is intact", str(failure.value)), failure.value
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-3"]  # no half-written .step-6.tmp


def test_a_tokenized_store_whose_writes_fail_is_one_line_that_says_what_to_do(base_config, tmp_path):
    from pretrainer.data.errors import DataError

    config = {**base_config, "data_cache_path": str(tmp_path / "cache")}
    with files_limited_to(16 * 1024), pytest.raises(DataError) as failure:  # the corpus's tokens are larger
        PreTrainer(PreTrainingArguments(**config)).train()
    assert re.fullmatch(r"train_data: tokenizing into .*/cache/tokenized/\w+ failed \(\[Errno 27\] File too "
                        r"large\); free space there, or set data_cache_path to a folder on a larger disk",
                        str(failure.value))
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []  # the partial store was removed


def test_metrics_whose_writes_fail_are_one_line_and_keep_whole_rows_only(base_config, tmp_path):
    from pretrainer.train.errors import OutputError

    warm = {**base_config, "num_training_steps": 2, "save_interval": 0, "eval_interval": 0, "export_hf": False,
            "save_dir": str(tmp_path / "warm")}
    PreTrainer(PreTrainingArguments(**warm)).train()  # the corpus tokenized before writes are limited
    config = {**base_config, "eval_interval": 0, "save_interval": 0, "save_dir": str(tmp_path / "run")}
    with files_limited_to(2048), pytest.raises(OutputError) as failure:  # a few rows fit, not the run's
        PreTrainer(PreTrainingArguments(**config)).train()
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert re.fullmatch(rf"writing {metrics} failed \(a short write, \d+ of \d+ bytes: the disk is probably full\); "
                        r"free space there, then rerun the same command: it resumes from the last checkpoint, if "
                        r"there is one", str(failure.value)), failure.value
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]  # every line whole
    assert rows and metrics.read_text().endswith("\n")


def test_a_report_whose_writes_fail_keeps_the_previous_one_whole(base_config, tmp_path):
    import logging

    from pretrainer.train.report import ReportWriteError, write_report, write_report_logged

    config = {**base_config, "eval_interval": 0, "write_report": True, "save_dir": str(tmp_path / "run")}
    PreTrainer(PreTrainingArguments(**config)).train()
    page = tmp_path / "run" / "report" / "report.html"
    before = page.read_text()
    with files_limited_to(4096):  # the charts fit, the page does not
        with pytest.raises(ReportWriteError, match=rf"writing the run report into {page.parent} failed \(.*File too "
                                                   r"large\)"):
            write_report(tmp_path / "run")
        warnings = logging.Handler(logging.WARNING)
        warnings.emit = lambda record: warned.append(record.getMessage())
        warned: list[str] = []
        logging.getLogger("pretrainer").addHandler(warnings)
        try:
            write_report_logged(tmp_path / "run")  # at the end of a run: a warning, not an error
        finally:
            logging.getLogger("pretrainer").removeHandler(warnings)
    assert [w.split(" failed")[0] for w in warned] == [f"no run report: writing the run report into {page.parent}"]
    assert page.read_text() == before
    assert sorted(p.name for p in page.parent.iterdir() if ".tmp-" in p.name) == []


def test_only_failed_writes_are_taken_for_a_failed_checkpoint_write():
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from pretrainer.train.checkpoint import write_failure

    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    lost_peer = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:33668")
    assert write_failure(OSError(28, "No space left on device")) == "[Errno 28] No space left on device"
    assert write_failure(short).endswith("unexpected pos 704 vs 598): the disk is probably full")
    assert write_failure(lost_peer) is None  # the loop reports a collective's failure as such
    assert write_failure(CheckpointException("save", {0: _wrap_exception(short)})).startswith("a short write")
    assert write_failure(CheckpointException("save", {0: _wrap_exception(short), 1: _wrap_exception(lost_peer)})) \
        is None


def test_an_export_whose_writes_fail_is_a_clear_error_that_leaves_no_folder(base_config, tmp_path):
    from pretrainer.train.errors import CheckpointError
    from pretrainer.train.offline import export_checkpoint

    config = {**base_config, "eval_interval": 0, "export_hf": False, "save_dir": str(tmp_path / "run")}
    PreTrainer(PreTrainingArguments(**config)).train()
    with files_limited_to(64 * 1024), pytest.raises(CheckpointError) as failure:  # the weights file is larger
        export_checkpoint(PreTrainingArguments(**config), None, None)
    assert str(failure.value).startswith(f"writing the Hugging Face export {tmp_path / 'run' / 'hf'} failed (")
    assert "File too large" in str(failure.value) and "pretrainer export <config>" in str(failure.value)
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if "hf" in p.name) == []  # no hf/, no .hf.tmp-*
    export_checkpoint(PreTrainingArguments(**config), None, None)  # room again: the same export succeeds
    assert (tmp_path / "run" / "hf" / "model.safetensors").stat().st_size > 64 * 1024


def test_a_failed_export_write_still_reads_the_tensors_the_other_ranks_gather():
    from pretrainer.train.errors import CheckpointError
    from pretrainer.train.export import _failed_writes_explained

    def stream():
        yield from ((f"layer.{i}", torch.zeros(1)) for i in range(5))

    tensors = stream()
    with pytest.raises(CheckpointError, match="No space left"):
        with _failed_writes_explained(Path("out"), Path("tmp-unused"), tensors):
            next(tensors)
            raise OSError(28, "No space left on device")
    assert next(tensors, None) is None  # the other four were read

def trained_samples(record: Path) -> dict[int, list[str]]:
    """Per step, the samples of the last launch that trained it (a relaunch redoes steps after its checkpoint)."""
    launches: list[dict] = []
    for line in record.read_text().splitlines():
        row = json.loads(line)
        if row.get("start"):
            launches.append({})
        else:
            launches[-1].setdefault(row["step"], []).append(row["sample"])
    final: dict[int, list[str]] = {}
    for launch in launches:
        final.update(launch)
    return final


def fault_run(config: Path, save_dir: Path, record: Path, *fault: str, timeout: int = 300, restarts: int = 0):
    return run(torchrun(2, REPO / "tests" / "fault_run.py", config, f"save_dir={save_dir}", "--record", record,
                        *fault, restarts=restarts), timeout=timeout)


@pytest.fixture(scope="module")
def two_rank_reference(tmp_path_factory):
    """An uninterrupted 2-rank run of 8 steps (checkpoints every 2), with its per-rank sample record."""
    from conftest import small_corpus_file, write_tiny_model

    root = tmp_path_factory.mktemp("faults")
    config = root / "c.yaml"
    config.write_text(yaml.safe_dump({
        "num_training_steps": 8, "micro_batch_size": 1, "dp": 2, "gradient_accumulation_steps": 2,
        "seq_length": 32, "dtype": "fp32", "model_path": str(write_tiny_model(root / "model")),
        "train_data": str(small_corpus_file(root / "docs.jsonl")), "lr": 1e-3, "warmup_steps": 2,
        "save_interval": 2, "eval_interval": 0, "export_hf": False, "seed": 7, "distributed_timeout_minutes": 0.25,
        "write_report": False}))
    straight = fault_run(config, root / "straight", root / "straight-record")
    assert straight.returncode == 0, straight.stderr[-3000:]
    return config, root


ABORTED = ("SIGABRT", "Signal 6", "terminate called", "Fatal Python error", "core dumped")
# How a rank of a failed job may end: killed (the fault itself), its collective failing (`pretrainer train`'s
# exit code 5), or stopped by torchrun's SIGTERM once another rank has died.
FAILED_RANK_CODES = {-9, 5, -15}


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_rank_killed_or_hung_mid_step_then_a_restart_loses_and_repeats_no_sample(two_rank_reference, tmp_path,
                                                                                     fault):
    """SIGKILL of rank 1 (torchrun stops the job), or rank 1 hanging (rank 0's collective times out naming
    the rank and step); the same command then resumes from the last complete checkpoint and every step
    trains on exactly the samples of an uninterrupted run."""
    config, root = two_rank_reference
    failed = fault_run(config, tmp_path / "faulty", tmp_path / "faulty-record", "--fault", fault, "--step", "5")
    output = failed.stdout + failed.stderr
    assert failed.returncode != 0 and not any(sign in output for sign in ABORTED), output[-4000:]
    codes = {int(code) for code in re.findall(r"exitcode\s*:\s*(-?\d+)", output)}
    assert codes and codes <= FAILED_RANK_CODES, output[-4000:]  # every rank ends with a documented code
    if fault == "hang":  # the waiting rank names itself and the step (its collective then fails, or the job ends)
        assert "rank 0: step 5 has run for 14 s, 90% of distributed_timeout_minutes" in failed.stdout + failed.stderr
    assert sorted(p.name for p in (tmp_path / "faulty" / "checkpoints").glob("step-*")) == ["step-2", "step-4"]
    resumed = fault_run(config, tmp_path / "faulty", tmp_path / "faulty-record")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for rank in (0, 1):
        want = trained_samples(root / "straight-record" / f"rank{rank}.jsonl")
        got = trained_samples(tmp_path / "faulty-record" / f"rank{rank}.jsonl")
        assert sorted(got) == list(range(1, 9)) and got == want
    assert train_losses(tmp_path / "faulty") == train_losses(root / "straight")


@pytest.mark.parametrize("at", ["save", "teardown"])
def test_a_rank_killed_mid_async_save_or_in_teardown_ends_every_rank_cleanly_and_resumes(two_rank_reference,
                                                                                          tmp_path, at):
    """SIGKILL of rank 1 while its asynchronous checkpoint of step 4 is being written, or once training has
    returned while rank 0 tears down: no rank aborts, every rank that fails exits with a documented code, and
    the same command resumes from the last complete checkpoint (step 2; after teardown the run is complete)
    with the samples and losses of an uninterrupted run."""
    config, root = two_rank_reference
    save_dir, record = tmp_path / "faulty", tmp_path / "faulty-record"
    failed = fault_run(config, save_dir, record, "async_checkpoint=true", "--fault", "kill", "--at", at,
                       "--step", "4")
    output = failed.stdout + failed.stderr
    assert failed.returncode != 0 and not any(sign in output for sign in ABORTED), output[-4000:]
    codes = {int(code) for code in re.findall(r"exitcode\s*:\s*(-?\d+)", output)}
    assert -9 in codes and codes <= FAILED_RANK_CODES, output[-4000:]
    complete = sorted(p.name for p in (save_dir / "checkpoints").glob("step-*"))
    assert complete == (["step-2"] if at == "save" else ["step-2", "step-4", "step-6", "step-8"])
    resumed = fault_run(config, save_dir, record, "async_checkpoint=true")
    assert resumed.returncode == 0 and not any(sign in resumed.stdout + resumed.stderr for sign in ABORTED), \
        resumed.stderr[-3000:]
    for rank in (0, 1):
        want = trained_samples(root / "straight-record" / f"rank{rank}.jsonl")
        assert trained_samples(record / f"rank{rank}.jsonl") == want
    assert train_losses(save_dir) == train_losses(root / "straight")


def test_torchrun_restarts_the_job_after_a_rank_dies_and_the_restart_resumes(two_rank_reference, tmp_path):
    """`torchrun --max-restarts 1`: rank 1 is SIGKILLed in step 5; torchrun stops rank 0 and starts both again
    (a fault-free launch), which resume from step 4: one command, exit 0, every step on the same samples."""
    config, root = two_rank_reference
    done = fault_run(config, tmp_path / "elastic", tmp_path / "elastic-record", "--fault", "kill", "--step", "5",
                     restarts=1)
    assert done.returncode == 0, describe(done)
    rows = (tmp_path / "elastic-record" / "rank0.jsonl").read_text().splitlines()
    assert sum(json.loads(row).get("start", False) for row in rows) == 2  # the first launch and the restart
    for rank in (0, 1):
        want = trained_samples(root / "straight-record" / f"rank{rank}.jsonl")
        got = trained_samples(tmp_path / "elastic-record" / f"rank{rank}.jsonl")
        assert sorted(got) == list(range(1, 9)) and got == want
    assert train_losses(tmp_path / "elastic") == train_losses(root / "straight")


def test_loss_spike_rule_skips_a_step_far_above_the_running_mean(base_config, tmp_path):
    config = {**base_config, "num_training_steps": 9, "eval_interval": 0, "save_interval": 0, "export_hf": False,
              "loss_spike_factor": 2.0, "save_dir": str(tmp_path / "run")}
    trainer = PreTrainer(PreTrainingArguments(**config))
    count = [0]

    def scale_logits(module, inputs, output):  # step 8 (forwards 15 and 16): a loss several times the mean
        count[0] += 1
        if count[0] in (15, 16):
            output.logits = output.logits * 60.0
        return output
    trainer.model.register_forward_hook(scale_logits)
    trainer.train()
    rows = read_metrics(tmp_path / "run")
    skipped = [r for r in rows if r.get("skipped_update")]
    assert [(r["step"], r["reason"].split(":")[0]) for r in skipped] == [(8, "loss spike")]
    assert "is above 2 x the mean of the last 7 accepted steps" in skipped[0]["reason"]
    losses = train_losses(tmp_path / "run")
    assert losses[8] > 2 * sum(losses[s] for s in range(3, 8)) / 5 and losses[9] < losses[8] / 2
    assert trainer.skips.total == 1


def test_zscore_rule_skips_a_loss_spike_and_a_gradient_norm_spike_and_keeps_its_windows(base_config, tmp_path):
    """spike_zscore 6 over a window of 6: step 8's loss (logits x 60) and step 10's gradient norm (one weight's
    gradient x 1000, the loss as usual) are each far above their window; both updates are skipped with their
    reason, and the windows come back from a checkpoint."""
    config = {**base_config, "num_training_steps": 12, "eval_interval": 0, "save_interval": 6, "export_hf": False,
              "spike_zscore": 6.0, "spike_window": 6, "save_dir": str(tmp_path / "run")}
    trainer = PreTrainer(PreTrainingArguments(**config))
    forwards = [0]

    def scale_logits(module, inputs, output):  # step 8: forwards 15 and 16
        forwards[0] += 1
        if forwards[0] in (15, 16):
            output.logits = output.logits * 60.0
        return output

    def scale_gradient(grad):  # step 10: the backwards of forwards 19 and 20
        return grad * 1000.0 if forwards[0] in (19, 20) else grad
    trainer.model.register_forward_hook(scale_logits)
    trainer.model.get_input_embeddings().weight.register_hook(scale_gradient)
    trainer.train()
    skipped = [r for r in read_metrics(tmp_path / "run") if r.get("skipped_update")]
    assert [(r["step"], r["reason"].split(":")[0]) for r in skipped] == [(8, "loss spike"),
                                                                          (10, "gradient norm spike")]
    assert all("standard deviations above the mean" in r["reason"] for r in skipped)
    assert skipped[1]["grad_norm"] > 100
    guard = trainer.spike_guard
    assert len(guard.losses) == 10 and len(guard.norms) == 6  # accepted steps only (12 - 2; the window)
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step-12" / "trainer_state.json").read_text())
    assert saved["loss_history"] == {"loss": list(guard.losses), "grad_norm": list(guard.norms)}


def test_report_command_rebuilds_the_report_of_a_run(base_config, tmp_path):
    save_dir = tmp_path / "run"
    PreTrainer(PreTrainingArguments(**{**base_config, "save_dir": str(save_dir), "write_report": False})).train()
    assert not (save_dir / "report").exists()
    done = run(pretrainer("report", save_dir))
    assert done.returncode == 0 and "report.html" in done.stdout
    page = (save_dir / "report" / "report.html").read_text()
    assert page.count("<svg") == 5 and "final eval loss / ppl / acc" in page
    assert "engine</th><td>single on 1 process(es), device cpu, dtype fp32" in page
    assert sorted(p.name for p in (save_dir / "report").glob("*.svg")) == ["loss.svg", "lr.svg", "memory.svg",
                                                                          "mfu.svg", "tokens_per_s.svg"]
    missing = run(pretrainer("report", tmp_path / "nowhere"))
    assert missing.returncode == 2 and "metrics.jsonl does not exist" in missing.stderr
