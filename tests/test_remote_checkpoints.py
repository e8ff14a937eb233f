"""A run whose save_dir is an S3 URL, on a real S3-compatible server (moto's server mode, tests/conftest.py) through
the real client stack (s3fs, botocore): checkpoints, metrics, report and HF export land in the bucket; a run
resumes from the bucket in a fresh staging folder with the losses of an uninterrupted run; an outage in the
middle of a checkpoint upload (tests/fault_proxy.py) is survived with `checkpoint_failure: warn` (the failed
checkpoint is kept in staging and uploaded again once the server is back) and ends the run in one line with
`fatal`, and a later resume never takes the partial checkpoint. Refusing buckets and URLs: test_storage_checks.py."""

from __future__ import annotations

import json

import pytest

from helpers import read_metrics, train_losses
from multi_run import launch_cases
from pretrainer import ConfigError, PreTrainer, PreTrainingArguments
from pretrainer.train.errors import CheckpointError

URL = "s3://bucket/{}"


def objects(server, run: str) -> dict[str, int]:
    """The run's objects: path under the run -> size."""
    server.fs.invalidate_cache()
    prefix = f"bucket/{run}/"
    return {name[len(prefix):]: info["size"] for name, info in server.fs.find(prefix, detail=True).items()}


def remote_rows(server, run: str) -> list[dict]:
    text = server.fs.cat_file(f"bucket/{run}/metrics.jsonl").decode()
    return [json.loads(line) for line in text.splitlines()]


def remote_losses(server, run: str) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in remote_rows(server, run) if "loss" in row}


def test_two_fsdp_ranks_resume_from_the_bucket_in_a_fresh_staging_folder(s3_server, base_config, tmp_path):
    base = {**base_config, "engine": "fsdp", "dp": 2, "micro_batch_size": 1, "save_interval": 2,
            "eval_interval": 0, "export_hf": True, "write_report": True}
    remote = {"save_dir": URL.format("fsdp"), "async_checkpoint": True}
    cases = [
        {"name": "local, straight", "config": {"save_dir": str(tmp_path / "straight")}},
        {"name": "s3, stopped at step 4", "config": {**remote, "exit_interval": 4,
                                                      "staging_dir": str(tmp_path / "node-a")}},
        {"name": "s3, resumed elsewhere", "config": {**remote, "staging_dir": str(tmp_path / "node-b")}},
    ]
    launch_cases(base, cases, 2, tmp_path)
    straight = train_losses(tmp_path / "straight")
    assert sorted(straight) == [1, 2, 3, 4, 5, 6]
    assert remote_losses(s3_server, "fsdp") == straight  # fp32: the same per-step losses
    starts = [(row["event"], row["step"]) for row in remote_rows(s3_server, "fsdp") if row.get("event")]
    assert starts == [("start", 0), ("resume", 4)]
    stored = objects(s3_server, "fsdp")
    for step in (2, 4, 6):
        assert f"checkpoints/step-{step}/trainer_state.json" in stored
        assert f"checkpoints/step-{step}/manifest.json" in stored
        assert any(name.startswith(f"checkpoints/step-{step}/__1_") for name in stored)  # rank 1's own shards
    assert s3_server.fs.cat_file("bucket/fsdp/checkpoints/latest").decode() == "step-6"
    assert "hf/config.json" in stored and "report/report.html" in stored
    assert not (tmp_path / "node-b" / "checkpoints" / "step-6").exists()  # uploaded, then dropped from staging
    secret = "testing-secret"  # the credentials reach no object
    assert not any(secret in s3_server.fs.cat_file(f"bucket/fsdp/{name}").decode(errors="ignore")
                   for name in stored if name.endswith((".json", ".yaml", ".jsonl")))


def outage_config(base_config, tmp_path, run: str, failure: str) -> dict:
    return {**base_config, "save_dir": URL.format(run), "staging_dir": str(tmp_path / "staging"),
            "save_interval": 2, "eval_interval": 0, "export_hf": False, "checkpoint_failure": failure,
            "storage_retries": 2}


def test_an_outage_during_an_upload_with_warn_goes_on_and_the_failed_checkpoint_is_uploaded_again(
        s3_server, fault_relay, base_config, tmp_path, pretrainer_log):
    # down at the third object of step-4's upload (two are in), up again when step-6's upload starts
    fault_relay.fail_from(r"^PUT /bucket/warn/checkpoints/step-4/", nth=3,
                          recover_on=r"/bucket/warn/checkpoints/step-6/")
    config = {**outage_config(base_config, tmp_path, "warn", "warn"), "keep_last_checkpoints": 2}
    PreTrainer(PreTrainingArguments(**config)).train()
    log = pretrainer_log.take()
    assert "checkpoint s3://bucket/warn/checkpoints/step-4 was not saved" in log and "run goes on" in log
    # step-6's commit: retention deletes the partial step-4 in the bucket; then the staged step-4 is uploaded
    # again, whole, and the newest two (4 and 6) are kept
    assert "deleted checkpoint s3://bucket/warn/checkpoints/step-4" in log, fault_relay.requests[-20:]
    staged = tmp_path / "staging" / "checkpoints"
    assert f"uploading checkpoint {staged / 'step-4'} again" in log
    assert "deleted checkpoint s3://bucket/warn/checkpoints/step-2" in log
    stored = objects(s3_server, "warn")
    assert {name.split("/")[1] for name in stored if name.endswith("/trainer_state.json")} == {"step-4", "step-6"}
    assert not any(name.startswith("checkpoints/step-2/") for name in stored)
    assert s3_server.fs.cat_file("bucket/warn/checkpoints/latest").decode() == "step-6"  # not the re-upload
    assert not list(staged.glob("step-*")) and "exist only in the staging folder" not in log
    assert sorted(remote_losses(s3_server, "warn")) == [1, 2, 3, 4, 5, 6]


def test_an_outage_during_an_upload_with_fatal_stops_in_one_line_and_resume_skips_the_partial_checkpoint(
        s3_server, fault_relay, base_config, tmp_path, pretrainer_log):
    straight = {**base_config, "save_dir": str(tmp_path / "straight"), "save_interval": 2, "eval_interval": 0,
                "export_hf": False}
    PreTrainer(PreTrainingArguments(**straight)).train()
    fault_relay.fail_from(r"^PUT /bucket/fatal/checkpoints/step-4/", nth=3)
    config = outage_config(base_config, tmp_path, "fatal", "fatal")
    with pytest.raises(CheckpointError) as failure:
        PreTrainer(PreTrainingArguments(**config)).train()
    message = str(failure.value)
    assert "\n" not in message and "s3://bucket/fatal/checkpoints/step-4 was not saved" in message, message
    assert "failed after 2 attempt(s)" in message
    fault_relay.restore()
    stored = objects(s3_server, "fatal")
    assert any(n.startswith("checkpoints/step-4/") for n in stored)
    assert "checkpoints/step-4/trainer_state.json" not in stored
    pretrainer_log.take()
    fresh = {**config, "staging_dir": str(tmp_path / "elsewhere")}
    PreTrainer(PreTrainingArguments(**fresh)).train()
    log = pretrainer_log.take()
    assert "skipping checkpoint s3://bucket/fatal/checkpoints/step-4: incomplete" in log
    assert "resuming from s3://bucket/fatal/checkpoints/step-2" in log
    losses = remote_losses(s3_server, "fatal")  # steps 3-4 trained twice: the second time from step-2
    assert losses == train_losses(tmp_path / "straight")
    assert read_metrics(tmp_path / "elsewhere")[-1]["step"] == 6


def test_export_evaluate_and_report_read_a_run_from_its_url(s3_server, base_config, tmp_path, capsys):
    """`pretrainer evaluate s3://...` scores the bucket's newest checkpoint as the loop did; `pretrainer export`
    writes an HF folder from it to another URL, the same tensors as the run's own export; `pretrainer report URL`
    uploads the report. keep_last_checkpoints deletes older checkpoints in the bucket."""
    from safetensors.torch import load_file

    from helpers import TASK_RECORDS, write_task
    from pretrainer.train.offline import evaluate, export_checkpoint

    task = write_task(tmp_path / "tiny_task.jsonl", TASK_RECORDS)
    config = {**base_config, "save_dir": URL.format("offline"), "staging_dir": str(tmp_path / "staging"),
              "downstream_evals": [task], "micro_batch_size": 1, "keep_last_checkpoints": 1}
    PreTrainer(PreTrainingArguments(**config)).train()
    stored = objects(s3_server, "offline")  # retention deleted step-3 in the bucket once step-6 was committed
    assert {name.split("/")[1] for name in stored if name.startswith("checkpoints/step-")} == {"step-6"}
    in_loop = [row for row in remote_rows(s3_server, "offline") if "eval/tiny_task/acc" in row][-1]
    scores = evaluate(URL.format("offline"), [task], [])["tiny_task"]
    for key in ("acc", "acc_norm", "bpb"):
        assert scores[key] == pytest.approx(in_loop[f"eval/tiny_task/{key}"], abs=1e-6), key
    args = PreTrainingArguments(**{**config, "staging_dir": str(tmp_path / "export-staging")})
    assert export_checkpoint(args, None, URL.format("exported")) == URL.format("exported")
    for name in ("run", "exported"):
        s3_server.fs.get(f"bucket/{'offline/hf' if name == 'run' else 'exported'}/model.safetensors",
                         str(tmp_path / f"{name}.safetensors"))
    run, exported = (load_file(tmp_path / f"{name}.safetensors") for name in ("run", "exported"))
    assert run.keys() == exported.keys() and all(run[k].equal(exported[k]) for k in run)
    assert "exported/tokenizer.json" in {n.split("bucket/", 1)[1] for n in s3_server.fs.find("bucket/exported")}
    from launch import cli_in_process

    code, _ = cli_in_process(capsys, "report", URL.format("offline"))  # drawn from the bucket's metrics
    assert code == 0 and "report/report.html" in objects(s3_server, "offline")
    with pytest.raises(ConfigError, match=r"key 'resume': none starts the run afresh, but save_dir holds an earlier "
                                          r"run's checkpoint \(s3://bucket/offline/checkpoints/step-6\)"):
        PreTrainer(PreTrainingArguments(**{**config, "resume": "none"}))


def test_a_cooldown_branch_from_a_checkpoint_in_the_bucket_writes_under_its_parent_url(
        s3_server, base_config, tmp_path):
    """cooldown_from by URL: the branch point is read from the bucket, the checkpoint downloaded, and the branch
    (RUN/branches/cooldown-step-4-512 under the parent's URL) equals the 8-step WSD run that decays over its
    512 tokens, as a local branch does (tests/test_cooldown.py)."""
    def wsd(save_dir: str, steps: int) -> dict:
        return {**base_config, "num_training_steps": steps, "lr_decay_style": "wsd", "wsd_decay_shape": "1-sqrt",
                "wsd_decay_tokens": 512, "min_lr": 1e-4, "save_interval": 2, "eval_interval": 0,
                "export_hf": False, "save_dir": save_dir,
                **({"staging_dir": str(tmp_path / "staging")} if save_dir.startswith("s3://") else {})}
    PreTrainer(PreTrainingArguments(**wsd(URL.format("parent"), 12))).train()
    PreTrainer(PreTrainingArguments(**wsd(str(tmp_path / "reference"), 8))).train()
    branch = {**wsd(URL.format("parent"), 12), "cooldown_from": URL.format("parent/checkpoints/step-4"),
              "cooldown_tokens": 512, "staging_dir": str(tmp_path / "branch-staging")}
    trainer = PreTrainer(PreTrainingArguments(**branch))
    assert trainer.pretrain_args.save_dir == URL.format("parent/branches/cooldown-step-4-512")
    trainer.train()
    want = {step: loss for step, loss in train_losses(tmp_path / "reference").items() if step > 4}
    assert remote_losses(s3_server, "parent/branches/cooldown-step-4-512") == pytest.approx(want, rel=1e-6)


def test_two_nodes_with_their_own_staging_disks_upload_their_own_shards_and_resume(s3_server, base_config,
                                                                                   tmp_path):
    """Two torchrun "nodes" of one rank each, whose staging folders differ (XDG_CACHE_HOME per node, as on two
    machines): each node's first process uploads the shards its node wrote, the main rank's manifest lists
    both; stopped at step 4 and resumed, the per-step losses are one process's."""
    from launch import BIN, REPO, environment, listening_port, start

    base = {**base_config, "engine": "fsdp", "dp": 2, "micro_batch_size": 1, "save_interval": 2,
            "eval_interval": 0, "export_hf": False, "save_dir": URL.format("nodes")}
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps({"base": base, "cases": [{"name": "stopped", "config": {"exit_interval": 4}},
                                                          {"name": "resumed", "config": {}}]}))
    port = listening_port()
    launch = [BIN / "torchrun", "--nnodes", 2, "--nproc_per_node", 1, "--master_addr", "127.0.0.1", "--master_port",
              port]
    nodes = [start([*launch, "--node_rank", node, REPO / "tests" / "multi_run.py", spec], tmp_path / f"{node}.log",
                   env=environment(1, XDG_CACHE_HOME=str(tmp_path / f"node-{node}"))) for node in (0, 1)]
    for node, process in enumerate(nodes):
        assert process.wait(timeout=600) == 0, (tmp_path / f"{node}.log").read_text()[-6000:]
    PreTrainer(PreTrainingArguments(**{**base_config, "save_interval": 2, "eval_interval": 0, "export_hf": False,
                                       "save_dir": str(tmp_path / "one")})).train()
    assert remote_losses(s3_server, "nodes") == pytest.approx(train_losses(tmp_path / "one"), rel=1e-5)
    listed = json.loads(s3_server.fs.cat_file("bucket/nodes/checkpoints/step-6/manifest.json"))["files"]
    assert {"__0_0.distcp", "__1_0.distcp", "extra_state_rank0.pt", "extra_state_rank1.pt"} <= set(listed)
    for node in (0, 1):  # each node staged its own files, and keeps none once uploaded
        staged = tmp_path / f"node-{node}" / "pretrainer" / "staging" / "s3" / "bucket" / "nodes" / "checkpoints"
        assert staged.is_dir() and not list(staged.glob("step-*")), list(staged.iterdir())
