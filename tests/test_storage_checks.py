"""URLs read in one place, buckets checked before anything trains, and no checkpoint lost to a failed upload.

The URL table runs through `PreTrainingArguments.from_dict` (the checks are at load) and one case through the
real `pretrainer train` command; the bucket cases run against moto's S3 server (tests/conftest.py) through the
real client stack, with bucket policies that refuse what a real bucket can refuse."""

from __future__ import annotations

import json

import pytest

from launch import describe, pretrainer, run
from pretrainer import PreTrainer, PreTrainingArguments
from pretrainer.config import ConfigError
from pretrainer.storage import StorageError
from pretrainer.train.errors import CheckpointError

# (key, value, the line's text after "config: key 'KEY': ")
URL_CASES = [
    ("save_dir", "s3:/bucket/run", "s3:/bucket/run is not a URL (s3: needs two slashes); write s3://bucket/run"),
    ("save_dir", "s3:bucket/run", "s3:bucket/run is not a URL (s3: needs two slashes); write s3://bucket/run"),
    ("save_dir", "s3://", "s3:// names no bucket; write s3://BUCKET/path"),
    ("save_dir", "s3:///run", "s3:///run names no bucket; write s3://BUCKET/path"),
    ("resume", "gs:/bucket/run", "gs:/bucket/run is not a URL (gs: needs two slashes); write gs://bucket/run"),
    ("cooldown_from", "S3:/b/run/checkpoints/step-2", "S3:/b/run/checkpoints/step-2 is not a URL (s3: needs two "
     "slashes); write s3://b/run/checkpoints/step-2"),
    ("train_data", ["data/a.jsonl", "s3:/bucket/b.jsonl"], "s3:/bucket/b.jsonl is not a URL"),
    ("train_data", [{"name": "web", "path": "s3://", "weight": 1.0}], "s3:// names no bucket"),
    ("eval_data", "az:container/x.jsonl", "az:container/x.jsonl is not a URL (az: needs two slashes)"),
    ("downstream_evals", [{"path": "s3:/bucket/task.jsonl"}], "s3:/bucket/task.jsonl is not a URL"),
    ("staging_dir", "s3://bucket/stage", "s3://bucket/stage is a URL (s3://); object storage is read for"),
    ("data_cache_path", "S3://bucket/cache", "S3://bucket/cache is a URL (s3://)"),
    ("model_path", "gs:/models/llama", "gs:/models/llama is not a URL"),
    ("tokenizer_path", "s3://bucket/tok", "s3://bucket/tok is a URL"),
    ("save_dir", "memory://b/run", "memory://b/run: memory:// holds objects only while this process lives"),
    ("resume", "file:///data/run", "file:///data/run: a file:// URL is a local folder; give its path itself"),
    ("save_dir", "file:/data/run", "file:/data/run is not a URL (file: needs three slashes); give the local path "
     "/data/run itself"),
]


@pytest.mark.parametrize("key, value, line", URL_CASES, ids=[f"{k}={v}" for k, v, _ in URL_CASES])
def test_a_malformed_or_misplaced_url_is_refused_at_load_naming_its_key(base_config, key, value, line):
    config = {**base_config, key: value}
    if key == "staging_dir":
        config["save_dir"] = "s3://bucket/run"
    if key == "cooldown_from":
        config["cooldown_tokens"] = 512
    with pytest.raises(ConfigError) as refused:
        PreTrainingArguments.from_dict(config)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"config: key {key!r}: {line}"), message


def test_a_url_scheme_is_read_in_any_case_and_local_names_with_colons_stay_local(base_config, tmp_path):
    args = PreTrainingArguments.from_dict({
        **base_config, "save_dir": "S3://bucket/run", "resume": "Gs://bucket/other/checkpoints/step-2",
        "train_data": [{"name": "web", "path": ["S3://bucket/web/*.jsonl"], "weight": 1.0}],
        "eval_data": str(tmp_path / "run:1" / "held-out.jsonl")})
    assert args.save_dir == args.remote_save_dir == "s3://bucket/run"
    assert args.resume == "gs://bucket/other/checkpoints/step-2"
    assert args.train_data[0]["path"] == ["s3://bucket/web/*.jsonl"]
    assert args.eval_data == str(tmp_path / "run:1" / "held-out.jsonl")


def test_the_train_command_refuses_a_one_slash_save_dir_before_writing_anything(base_config, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({key: value for key, value in base_config.items() if key != "save_dir"}))
    done = run(pretrainer("train", config, "save_dir=s3:/bucket/run"), cwd=tmp_path, timeout=120)
    assert done.returncode == 2, describe(done)
    assert done.stderr.splitlines() == [f"pretrainer: error: {config}, override save_dir=...: key 'save_dir': "
                                        "s3:/bucket/run is not a URL (s3: needs two slashes); write s3://bucket/run"], \
        describe(done)
    assert not (tmp_path / "s3:").exists()


# ---------------------------------------------------------------- buckets (moto)
def s3_config(base_config, tmp_path, save_dir: str, **extra) -> dict:
    return {**base_config, "num_training_steps": 4, "save_interval": 2, "eval_interval": 0, "export_hf": False,
            "save_dir": save_dir, "staging_dir": str(tmp_path / "staging"), "storage_retries": 1, **extra}


def deny(bucket: str, action: str, keys: str | None) -> None:
    """A bucket policy that refuses `action` on `keys` (a pattern under the bucket; None: the bucket itself) to
    everyone; moto's server enforces it as S3 does."""
    import boto3

    resource = f"arn:aws:s3:::{bucket}" + (f"/{keys}" if keys is not None else "")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Deny", "Principal": "*", "Action": action,
                                                      "Resource": resource}]}
    boto3.client("s3").put_bucket_policy(Bucket=bucket, Policy=json.dumps(policy))


@pytest.fixture
def guarded_bucket(s3_server):
    """A bucket of its own (its policy applies to the whole bucket), removed with what is in it."""
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket="guarded")
    yield "guarded"
    client.delete_bucket_policy(Bucket="guarded")
    s3_server.fs.invalidate_cache()
    s3_server.fs.rm("guarded", recursive=True)


BUCKET_REFUSALS = [
    ("s3://no-such-bucket/run", None, "key 'save_dir': s3://no-such-bucket/run: no such bucket (no-such-bucket); "
     "create it or correct the URL"),
    ("s3://guarded/run", ("s3:PutObject", "*"), "key 'save_dir': s3://guarded/run: access denied: cannot write "
     "s3://guarded/run/.pretrainer-write-check (PermissionError"),
    ("s3://guarded/run", "list", "key 'save_dir': s3://guarded/run: cannot list it (listing s3://guarded/run "
     "failed after 1 attempt(s)"),
]


@pytest.mark.parametrize("save_dir, refusal, line", BUCKET_REFUSALS, ids=["no bucket", "no write", "no list"])
def test_a_bucket_that_cannot_hold_the_run_is_refused_before_any_step(
        guarded_bucket, fault_relay, base_config, tmp_path, save_dir, refusal, line):
    if refusal == "list":  # moto does not enforce a policy on listings: the relay fails them instead
        fault_relay.fail_from(r"^GET /guarded\?list-type=2")
    elif refusal is not None:
        deny(guarded_bucket, *refusal)
    config = s3_config(base_config, tmp_path, save_dir, checkpoint_failure="warn")
    with pytest.raises(StorageError) as refused:
        PreTrainer(PreTrainingArguments(**config))
    assert str(refused.value).startswith(line), refused.value
    assert not (tmp_path / "staging" / "metrics.jsonl").exists() and not (tmp_path / "staging" / "checkpoints").exists()


def test_the_train_command_exits_4_for_a_missing_bucket(s3_server, base_config, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(s3_config(base_config, tmp_path, "s3://no-such-bucket/run")))
    done = run(pretrainer("train", config), cwd=tmp_path, timeout=180)
    assert done.returncode == 4, describe(done)
    errors = [line for line in done.stderr.splitlines() if line.startswith("pretrainer: error:")]
    assert errors == ["pretrainer: error: key 'save_dir': s3://no-such-bucket/run: no such bucket (no-such-bucket); "
                      "create it or correct the URL"], describe(done)


def test_warn_against_a_bucket_refusing_checkpoints_keeps_every_one_in_staging_and_fails_the_run(
        s3_server, guarded_bucket, base_config, tmp_path, pretrainer_log):
    """The write check passes (the policy refuses only `checkpoints/`), every checkpoint upload is refused:
    each stays in the staging folder, the end names them, and the run ends with CheckpointError (exit 4)."""
    deny(guarded_bucket, "s3:PutObject", "run/checkpoints/*")
    config = s3_config(base_config, tmp_path, "s3://guarded/run", checkpoint_failure="warn",
                       keep_last_checkpoints=1)
    with pytest.raises(CheckpointError) as failed:
        PreTrainer(PreTrainingArguments(**config)).train()
    staged = [tmp_path / "staging" / "checkpoints" / f"step-{step}" for step in (2, 4)]
    assert str(failed.value).startswith("no checkpoint of this run reached s3://guarded/run/checkpoints: every "
                                        "upload failed"), failed.value
    assert str(failed.value).endswith(f"kept in the staging folder: {staged[0]}, {staged[1]}")
    for folder in staged:  # complete, loadable checkpoints
        assert (folder / "trainer_state.json").is_file() and (folder / "manifest.json").is_file()
    log = pretrainer_log.take()
    assert f"exist only in the staging folder, not in s3://guarded/run/checkpoints: {staged[0]}, {staged[1]}" in log


def test_fatal_names_no_earlier_checkpoint_when_there_is_none_and_keeps_the_staged_one(
        s3_server, guarded_bucket, base_config, tmp_path):
    deny(guarded_bucket, "s3:PutObject", "run/checkpoints/*")
    config = s3_config(base_config, tmp_path, "s3://guarded/run")
    with pytest.raises(CheckpointError) as failed:
        PreTrainer(PreTrainingArguments(**config)).train()
    message, staged = str(failed.value), tmp_path / "staging" / "checkpoints" / "step-2"
    assert "\n" not in message and message.startswith("checkpoint s3://guarded/run/checkpoints/step-2 was not "
                                                      "saved: uploading"), message
    assert "No complete checkpoint is in s3://guarded/run/checkpoints; this checkpoint is kept in the staging " \
           f"folder {staged}" in message and "intact" not in message
    assert (staged / "trainer_state.json").is_file()


def test_a_run_of_which_some_checkpoints_reached_the_bucket_ends_well_and_names_the_staged_one(
        s3_server, guarded_bucket, base_config, tmp_path, pretrainer_log):
    """step-2 is refused, step-4 is not: the run (stopped at step 4) ends normally (the bucket's newest is
    usable), step-2 is uploaded again after step-4's commit and refused again, so it stays in staging and the end
    names it; with `fatal`, a later failure names the newest complete checkpoint in the bucket."""
    deny(guarded_bucket, "s3:PutObject", "run/checkpoints/step-2/*")
    config = s3_config(base_config, tmp_path, "s3://guarded/run", checkpoint_failure="warn", num_training_steps=6)
    PreTrainer(PreTrainingArguments(**{**config, "exit_interval": 4})).train()
    staged = tmp_path / "staging" / "checkpoints" / "step-2"
    log = pretrainer_log.take()
    assert f"uploading checkpoint {staged} again" in log
    assert f"exist only in the staging folder, not in s3://guarded/run/checkpoints: {staged}" in log
    assert (staged / "trainer_state.json").is_file()
    assert not (tmp_path / "staging" / "checkpoints" / "step-4").exists()  # uploaded, so dropped from staging
    s3_server.fs.invalidate_cache()
    assert s3_server.fs.isfile("guarded/run/checkpoints/step-4/trainer_state.json")
    assert s3_server.fs.cat_file("guarded/run/checkpoints/latest").decode() == "step-4"

    deny(guarded_bucket, "s3:PutObject", "run/checkpoints/step-6/*")  # the next run: step-6 refused
    resumed = {**config, "checkpoint_failure": "fatal"}
    with pytest.raises(CheckpointError, match="The newest complete checkpoint there, "
                       "s3://guarded/run/checkpoints/step-4, is intact"):
        PreTrainer(PreTrainingArguments(**resumed)).train()
    assert (staged / "trainer_state.json").is_file()  # the earlier run's staged checkpoint is kept


def test_a_resume_url_that_holds_no_checkpoint_is_refused_like_a_missing_folder(s3_server, base_config, tmp_path):
    config = s3_config(base_config, tmp_path, str(tmp_path / "run"), staging_dir=None,
                       resume="s3://bucket/missing")
    with pytest.raises(ConfigError) as refused:
        PreTrainer(PreTrainingArguments(**config))
    message = str(refused.value)
    assert "\n" not in message and message.startswith("key 'resume': s3://bucket/missing holds no complete "
                                                      "checkpoint"), message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_refused_resume_from_the_bucket_names_the_checkpoint_s_url(s3_server, base_config, tmp_path):
    """The checkpoint is downloaded to staging first; the message names it as the user knows it."""
    config = s3_config(base_config, tmp_path, "s3://bucket/shown", num_training_steps=2, save_interval=2)
    PreTrainer(PreTrainingArguments(**config)).train()
    with pytest.raises(ConfigError, match=r"^resuming from s3://bucket/shown/checkpoints/step-2 would change the "
                                          r"run's state: lr 0\.001 -> 0\.002"):
        PreTrainer(PreTrainingArguments(**{**config, "lr": 2e-3}))
