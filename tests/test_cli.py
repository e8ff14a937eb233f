"""The command line and the seed's script contract, run as real processes."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers import CORPUS, QUICKSTART_MODEL, eval_losses, read_metrics, train_losses
from launch import BIN, REPO, cli_in_process, cores_per_worker, pretrainer, run, run_ok, torchrun


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def test_train_command_with_overrides_and_export_command(base_config, tmp_path):
    config = write_config(tmp_path / "c.yaml", base_config)
    done = run_ok(pretrainer("train", config, "num_training_steps=4", "log_interval=2"))
    assert "step: 2 | elapsed time per iteration (ms):" in done.stdout and "| lm loss: " in done.stdout
    assert "validation at step: 3 | eval_loss: " in done.stdout
    assert sorted(train_losses(base_config["save_dir"])) == [2, 4]
    shutil.rmtree(Path(base_config["save_dir"]) / "hf")
    run_ok(pretrainer("export", config, "--output", tmp_path / "exported"))
    assert (tmp_path / "exported" / "model.safetensors").is_file()
    # the same checkpoint exported through the megatron engine's stages (one process, unset seq_length)
    run_ok(pretrainer("export", config, "engine=megatron", "seq_length=null", "--output", tmp_path / "megatron"))
    from safetensors.torch import load_file

    exported, through_stages = (load_file(tmp_path / name / "model.safetensors") for name in ("exported", "megatron"))
    assert exported.keys() == through_stages.keys()
    assert all(torch.equal(exported[key], through_stages[key]) for key in exported)


def test_cli_errors_are_one_clear_line(base_config, tmp_path):
    config = write_config(tmp_path / "c.yaml", {**base_config, "seq_lenght": 4})
    done = run(pretrainer("train", config))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "unknown key 'seq_lenght'; did you mean 'seq_length'?" in done.stderr


@pytest.mark.parametrize("launcher", ["python", "torchrun", "accelerate"])
def test_seed_script_contract_under_each_launcher(base_config, tmp_path, launcher):
    config = write_config(tmp_path / "c.yaml", {**base_config, "num_training_steps": 2, "eval_interval": 2})
    script = [REPO / "examples" / "train.py", "--pretrain_config_file", config]
    command = {
        "python": [sys.executable, *script],
        "torchrun": torchrun(1, *script),
        "accelerate": [BIN / "accelerate", "launch", "--num_processes", "1", "--cpu", "--num_machines", "1",
                       "--mixed_precision", "no", "--dynamo_backend", "no", *script],
    }[launcher]
    run_ok(command)
    assert sorted(train_losses(base_config["save_dir"])) == [1, 2]
    assert 2 in eval_losses(base_config["save_dir"])


def test_quickstart_as_documented(tmp_path):
    """The README's quickstart config, unchanged but for its output folder: eval loss falls, hf/ loads."""
    save_dir = tmp_path / "quickstart"
    run_ok(pretrainer("train", "examples/quickstart.yaml", f"save_dir={save_dir}"), threads=cores_per_worker(),
           timeout=900)
    evals = eval_losses(save_dir)
    steps = sorted(evals)
    assert evals[steps[-1]] < evals[steps[0]] - 1.0, evals  # clearly falling
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(save_dir / "hf")
    tokenizer = AutoTokenizer.from_pretrained(save_dir / "hf")
    prompt = tokenizer("The for statement", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]
    assert [r["step"] for r in read_metrics(save_dir) if "loss" in r][-1] == 240
    # the shipped multiple-choice task, scored every eval_interval: the gold choices' bits per byte fall
    bpb = {r["step"]: r["eval/python_docs_choices/bpb"] for r in read_metrics(save_dir) if "downstream_seconds" in r}
    assert sorted(bpb) == [40, 80, 120, 160, 200, 240] and bpb[240] < bpb[40] - 0.2, bpb
    assert_report_renders(save_dir / "report" / "report.html", tmp_path / "shot.png")


def assert_report_renders(report, shot) -> None:
    """The run report opened in headless Chromium: the screenshot shows the plots' lines."""
    from PIL import Image

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "chromium is not installed (scripts/setup_system.sh installs it)"
    assert report.read_text().count("<svg") == 6  # loss, lr, tokens/s, MFU, memory, the downstream task
    run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--screenshot={shot}",
         "--window-size=1280,1400", report.as_uri()], timeout=120)
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 1400)
    pixels = list(image.getdata())
    blue = sum(1 for r, g, b in pixels if b > 150 and r < 100 and g < 160)  # the first series' colour
    orange = sum(1 for r, g, b in pixels if r > 200 and 90 < g < 160 and b < 60)  # the eval-loss line
    assert blue > 500 and orange > 50, (blue, orange)


def test_output_folders_that_cannot_be_written_are_one_line_errors(base_config, tmp_path, capsys):
    from pretrainer import PreTrainer, PreTrainingArguments

    save_dir = tmp_path / "run"
    PreTrainer(PreTrainingArguments(**{**base_config, "num_training_steps": 1, "warmup_steps": 0,
                                       "eval_interval": 0, "export_hf": False})).train()
    config = write_config(tmp_path / "c.yaml", base_config)
    (save_dir / "report").write_text("a file where the report folder goes")
    for command, message in [
            (("export", config, "--output", "/proc/nope/hf"), "--output: /proc/nope cannot be created"),
            (("report", save_dir), f"SAVE_DIR: {save_dir / 'report'} cannot be created or written"),
            (("prepare", "--input", CORPUS, "--tokenizer", QUICKSTART_MODEL, "--output-prefix", "/proc/nope/docs"),
             "--output-prefix: /proc/nope cannot be created")]:
        code, stderr = cli_in_process(capsys, *command)
        assert code == 2 and "Traceback" not in stderr and message in stderr, stderr[-2000:]


def test_export_of_a_missing_checkpoint_is_a_clear_error(base_config, tmp_path, capsys):
    config = write_config(tmp_path / "c.yaml", base_config)
    code, stderr = cli_in_process(capsys, "export", config, "--checkpoint", tmp_path / "nowhere")
    assert code == 2 and "Traceback" not in stderr
    assert "is not a complete checkpoint folder" in stderr


# `main` stand-ins for the console entry: a thread pool left running (torch.compile leaves one), a
# non-daemon thread still writing, and an atexit handler; `run` must end the process with main's code
# only after the thread's and the handler's output are out.
EXIT_PROGRAM = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pretrainer import cli

POOL = ThreadPoolExecutor(2)  # module-level, as compile workers are: never collected

def main():
    POOL.submit(lambda: None).result()
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread done", flush=True))).start()
    atexit.register(lambda: print("atexit ran"))
    return 3

cli.main = main
cli.run()
"""


def test_console_entry_exits_with_mains_code_after_threads_and_atexit():
    done = run([sys.executable, "-c", EXIT_PROGRAM], timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout.split("\n")[:2] == ["thread done", "atexit ran"]


@pytest.mark.parametrize("workers", ["0", "-3"])
def test_integer_flags_are_range_checked(capsys, tmp_path, workers):
    code, stderr = cli_in_process(capsys, "prepare", "--input", CORPUS, "--tokenizer", QUICKSTART_MODEL,
                                  "--output-prefix", tmp_path / "p", "--workers", workers)
    assert code == 2 and f"argument --workers: expected an integer >= 1, got '{workers}'" in stderr
    assert not list(tmp_path.iterdir())  # nothing was tokenized
    code, stderr = cli_in_process(capsys, "tokenizer", "train", "--input", CORPUS, "--vocab-size", "500",
                                  "--workers", workers, "--output", tmp_path / "tok")
    assert code == 2 and f"argument --workers: expected an integer >= 1, got '{workers}'" in stderr


def test_export_names_the_flag_it_was_given(base_config, tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(base_config))
    code, stderr = cli_in_process(capsys, "export", config, "--checkpoint", tmp_path / "BAD")
    assert code == 2 and "--checkpoint: " in stderr and "is not a complete checkpoint folder" in stderr
    assert "key 'resume'" not in stderr


def test_evaluate_checks_its_output_path_before_any_work(capsys, tmp_path):
    code, stderr = cli_in_process(capsys, "evaluate", tmp_path / "no-run", "--tasks", tmp_path / "t.jsonl",
                                  "--output", "/proc/nope/scores.json")
    assert code == 2 and "--output: /proc/nope cannot be created or written" in stderr, stderr
    assert "no-run" not in stderr  # the target was not even looked at
