"""The training loop end to end on a real tiny Llama: resume, accumulation, export, seed API, precision."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from helpers import (
    EXAMPLES,
    cpu_engine,
    eval_losses,
    leaves_no_process_group,
    read_metrics,
    train_losses,
    write_tiny_model,
)
from pretrainer import Callback, ConfigError, DataError, PreTrainer, PreTrainingArguments
from pretrainer.train.checkpoint import find_latest


def run(config: dict, **overrides) -> PreTrainer:
    trainer = PreTrainer(PreTrainingArguments(**{**config, **overrides}))
    trainer.train()
    return trainer


def test_resume_reproduces_the_uninterrupted_run(base_config, tmp_path):
    straight = tmp_path / "straight"
    run(base_config, save_dir=str(straight))
    interrupted = tmp_path / "interrupted"
    first = run(base_config, save_dir=str(interrupted), exit_interval=3)
    assert first.train_state.step == 3 and not (interrupted / "hf").exists()
    run(base_config, save_dir=str(interrupted))  # the same command again: resumes at step 3
    expected, got = train_losses(straight), train_losses(interrupted)
    assert sorted(got) == list(range(1, 7)) == sorted(expected)
    assert got == expected  # exactly the same per-step losses (fp32, same machine)
    assert eval_losses(interrupted) == eval_losses(straight)
    rows = read_metrics(interrupted)
    assert any(r.get("event") == "resume" and r["step"] == 3 for r in rows)  # continued, not truncated
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_checkpoint_layout_and_incomplete_checkpoints_are_skipped(base_config, tmp_path):
    save_dir = tmp_path / "run"
    run(base_config, save_dir=str(save_dir))
    root = save_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-3", "step-6"]
    assert (root / "latest").read_text() == "step-6"
    state = json.loads((root / "step-6" / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["data"] == {"samples": 6 * 2 * 2}
    assert (root / "step-6" / ".metadata").is_file() and (root / "step-6" / "extra_state_rank0.pt").is_file()
    assert PreTrainingArguments.from_yaml(root / "step-6" / "config.yaml").num_training_steps == 6
    # A save interrupted before its state file: never picked for resume.
    (root / "step-6" / "trainer_state.json").unlink()
    assert find_latest(save_dir) == root / "step-3"


def test_metrics_rows_have_the_documented_fields(base_config):
    trainer = run(base_config)
    rows = read_metrics(base_config["save_dir"])
    train_row = next(r for r in rows if "loss" in r)
    assert {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "peak_mem_mb"} <= set(train_row)
    assert 50 < train_row["peak_mem_mb"] < 20_000
    eval_row = next(r for r in rows if "eval_loss" in r)
    assert {"step", "eval_loss", "eval_ppl", "eval_acc"} <= set(eval_row)
    assert math.isclose(eval_row["eval_ppl"], math.exp(eval_row["eval_loss"]), rel_tol=1e-9)
    assert trainer.train_state.tokens == 6 * 2 * 2 * 32  # full windows: every input position has a target


def test_gradient_accumulation_matches_one_big_batch(base_config, tmp_path):
    common = dict(save_dir=None, eval_interval=0, num_training_steps=4)
    big = run(base_config, micro_batch_size=4, gradient_accumulation_steps=1, **common, log_interval=1)
    small = run(base_config, micro_batch_size=2, gradient_accumulation_steps=2, **common, log_interval=1)
    big_losses = [r["loss"] for r in big.log_history if "loss" in r]
    small_losses = [r["loss"] for r in small.log_history if "loss" in r]
    assert len(big_losses) == 4
    assert small_losses == pytest.approx(big_losses, rel=1e-5)


def test_hf_export_loads_and_reproduces_the_training_loss(base_config):
    trainer = run(base_config, eval_interval=0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = Path(base_config["save_dir"]) / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    assert len(tokenizer) == 4096 and (hf / "model.safetensors").is_file()
    final_eval = eval_losses(base_config["save_dir"])[6]
    from pretrainer.train.validation import evaluate

    reloaded = evaluate(model, trainer.eval_dataloader, trainer.engine, base_config["eval_iters"])["eval_loss"]
    assert reloaded == pytest.approx(final_eval, rel=1e-6)
    # and HF's own loss on a window agrees with ours
    window = next(iter(trainer.eval_dataloader))
    ids = torch.cat([window["input_ids"][:1], window["shift_labels"][:1, -1:]], dim=1)
    with torch.no_grad():
        hf_loss = model(input_ids=ids, labels=ids).loss.item()
    ours = evaluate(model, [{"input_ids": window["input_ids"][:1], "shift_labels": window["shift_labels"][:1]}],
                    trainer.engine, 1)["eval_loss"]
    assert hf_loss == pytest.approx(ours, rel=1e-5)


def test_seed_api_with_a_user_dataloader_honours_labels_and_mask(tiny_model, tmp_path):
    """PreTrainer(pretrain_args, train_dataloader=..., eval_dataloader=...) with DataCollatorForSeq2Seq batches."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    records = json.loads((EXAMPLES / "data" / "python_topics_alpaca.json").read_text())[:12]
    features = []
    for rec in records:
        prompt = tokenizer(rec["instruction"])["input_ids"]
        answer = tokenizer(rec["output"][:80], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = (prompt + answer)[:40]
        features.append({"input_ids": ids, "attention_mask": [1] * len(ids),
                         "labels": ([-100] * len(prompt) + answer)[:40]})
    args = PreTrainingArguments(num_training_steps=2, micro_batch_size=4, dp=1, seq_length=48, dtype="fp32",
                                model_path=str(tiny_model), save_dir=str(tmp_path / "run"), eval_interval=1,
                                eval_iters=2, lr=1e-3, seed=3,
                                dataloader_config={"padding": "max_length", "max_length": 48,
                                                   "return_tensors": "pt"})
    collate = DataCollatorForSeq2Seq(tokenizer, **args.get_dataloader_config())
    train_loader = torch.utils.data.DataLoader(features[:8], batch_size=4, shuffle=False, collate_fn=collate)
    eval_loader = torch.utils.data.DataLoader(features[8:], batch_size=4, collate_fn=collate)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model))
    batch = next(iter(train_loader))
    assert (batch["labels"] == -100).sum() > (batch["attention_mask"] == 0).sum()  # prompt masked + padding
    with torch.no_grad():
        expected = model(**batch).loss.item()  # HF's own masked loss on the first batch
    trainer = PreTrainer(pretrain_args=args, model=model, train_dataloader=train_loader,
                         eval_dataloader=eval_loader)
    trainer.train()
    assert train_losses(args.save_dir)[1] == pytest.approx(expected, rel=1e-5)
    assert 1 in eval_losses(args.save_dir)  # the user's eval loader is used
    assert (Path(args.save_dir) / "hf" / "tokenizer.json").is_file()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_runs_and_stays_close_to_fp32(base_config, dtype):
    common = dict(save_dir=None, eval_interval=0, num_training_steps=2, gradient_accumulation_steps=1)
    reference = run(base_config, dtype="fp32", **common)
    mixed = run(base_config, dtype=dtype, **common)
    assert mixed.engine.precision.compute_dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())  # fp32 master weights
    ref_losses = [r["loss"] for r in reference.log_history if "loss" in r]
    mixed_losses = [r["loss"] for r in mixed.log_history if "loss" in r]
    assert mixed_losses == pytest.approx(ref_losses, rel=2e-2)  # same data and init, lower-precision compute
    assert all(torch.isfinite(p).all() for p in mixed.model.parameters())
    if dtype == "fp16":
        assert mixed.engine.precision.scaler is not None


def test_seed_yaml_trains_with_overrides_and_reports_its_errors(tmp_path):
    seed_yaml = EXAMPLES / "seed_configs" / "llama2-deepspeed.yaml"
    # As shipped, the seed asks for dp=8 on one process: refused, with the fix in the message.
    with pytest.raises(ConfigError, match="dp=8 does not match"):
        PreTrainer(PreTrainingArguments.from_yaml(seed_yaml))
    # seq_length 4096 exceeds the tiny model's 512 positions: refused before the model is built.
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings"):
        PreTrainer(PreTrainingArguments.from_yaml(seed_yaml, ["dp=1"]))
    args = PreTrainingArguments.from_yaml(seed_yaml, ["dp=1", "seq_length=64", "num_training_steps=2",
                                                      "gradient_accumulation_steps=2", "dtype=fp32",
                                                      f"save_dir={tmp_path / 'seed'}"])
    PreTrainer(args).train()
    assert sorted(train_losses(tmp_path / "seed")) == [1, 2]
    assert (tmp_path / "seed" / "hf" / "config.json").is_file()


def test_bad_inputs_fail_before_heavy_work(base_config, tmp_path):
    def build(**overrides):
        return PreTrainer(PreTrainingArguments(**{**base_config, **overrides}))

    with pytest.raises(ConfigError, match="model_path .* does not exist"):
        build(model_path=str(tmp_path / "nope"))
    with pytest.raises(DataError, match="does not exist"):
        build(train_data=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings"):
        build(seq_length=4096)
    small_vocab = write_tiny_model(tmp_path / "small-vocab", vocab_size=1000)
    with pytest.raises(ConfigError, match=r"has 4,096 tokens but the model has vocab_size=1,000 .*no tokenizer of the "
                                          r"model's own .*allow_tokenizer_mismatch: true"):
        build(model_path=str(small_vocab))
    with pytest.raises(ConfigError, match="dp=2 does not match"):
        build(dp=2)
    with pytest.raises(ConfigError, match="no training data"):
        build(train_data=None)
    (tmp_path / "empty_model").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        build(model_path=str(tmp_path / "empty_model"))
    with pytest.raises(ConfigError, match="resume"):
        build(resume=str(tmp_path / "no-checkpoint-here"))


class Recorder(Callback):
    """Everything a user's callback hears, and a saved counter of its own."""

    def __init__(self):
        self.results, self.rows, self.saves, self.steps_counted = [], [], [], 0
        self.calls = []  # (hook, step) of the loop's after_step / on_stop / at_end

    def after_step(self, result, state, loop) -> None:
        self.calls.append(("after_step", state.step))
        self.steps_counted += 1  # saved with the step: the checkpoint comes after the user's after_step
        if state.step == 2:  # a user's own row, written through the run's log
            loop.log.record({"step": 2, "weights_norm": float(sum(p.detach().float().norm() for p in
                                                                  loop.model.parameters()))})

    def on_stop(self, state, loop) -> None:
        self.calls.append(("on_stop", state.step))

    def at_end(self, state, loop) -> None:
        self.calls.append(("at_end", state.step))

    def register_state(self, state) -> None:
        state.register("recorder", lambda: self.steps_counted, self._load, default=0)

    def _load(self, saved) -> None:
        self.steps_counted = saved

    def end_step(self, result, state) -> None:
        assert state.step == result.step
        self.results.append((result.step, float(result.loss_sum) / float(result.counts[0]), result.applied))

    def on_row(self, row) -> None:
        self.rows.append(row)

    def on_save(self, step, path) -> None:
        self.saves.append((step, Path(path).name))


def test_a_users_callbacks_hear_each_step_row_and_save_and_keep_their_state(base_config):
    first = Recorder()
    trainer = PreTrainer(PreTrainingArguments(**{**base_config, "exit_interval": 3}), callbacks=[first])
    trainer.train()
    assert [step for step, _, _ in first.results] == [1, 2, 3] and all(applied for *_, applied in first.results)
    logged = {row["step"]: row["loss"] for row in read_metrics(base_config["save_dir"]) if "loss" in row}
    assert [loss for _, loss, _ in first.results] == pytest.approx([logged[s] for s in (1, 2, 3)], rel=1e-6)
    assert first.rows == trainer.log_history and first.saves == [(3, "step-3")]
    assert first.calls == [("after_step", 1), ("after_step", 2), ("after_step", 3), ("on_stop", 3)]
    assert [row["weights_norm"] > 0 for row in read_metrics(base_config["save_dir"]) if "weights_norm" in row] == [True]
    again = Recorder()
    PreTrainer(PreTrainingArguments(**base_config), callbacks=[again]).train()
    assert [step for step, _, _ in again.results] == [4, 5, 6] and again.steps_counted == 6  # 3 of them resumed
    assert [step for step, _ in again.saves] == [6]
    assert again.calls == [("after_step", 4), ("after_step", 5), ("after_step", 6), ("at_end", 6)]


def test_one_process_runs_share_the_group_of_one_and_the_last_to_close_destroys_it(base_config, tmp_path,
                                                                                    monkeypatch):
    """A trainer left open keeps training when another in the same process fails to build or closes; a shell's
    leftover MASTER_ADDR / MASTER_PORT are not read by a run of one process; a failed load leaves no group."""
    import torch.distributed as dist

    from pretrainer.train.offline import load_model

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # never dialled (port 1): a group of one meets in memory
    monkeypatch.setenv("MASTER_PORT", "1")
    config = {**base_config, "num_training_steps": 2, "eval_interval": 0, "save_interval": 0}
    with leaves_no_process_group():
        first = PreTrainer(PreTrainingArguments(**{**config, "save_dir": str(tmp_path / "first")}))
        with pytest.raises(ConfigError, match="seq_length"):
            PreTrainer(PreTrainingArguments(**{**config, "save_dir": str(tmp_path / "refused"), "seq_length": 4096}))
        second = PreTrainer(PreTrainingArguments(**{**config, "save_dir": str(tmp_path / "second")}))
        assert first.train()["step"] == 2
        first.close()
        assert dist.is_initialized() and second.train()["step"] == 2
        second.close()
    with leaves_no_process_group(), pytest.raises(ConfigError, match="seq_length"):
        load_model(PreTrainingArguments(**{**config, "seq_length": 4096}), None)


def test_an_evaluation_that_fails_leaves_the_steps_checkpoint(base_config):
    """The checkpoint comes before evaluation at a step where both are due (save_interval = eval_interval = 3)."""
    class BrokenEvalData:
        def __iter__(self):
            raise RuntimeError("the eval data broke")

    with pytest.raises(RuntimeError, match="the eval data broke"):
        with PreTrainer(PreTrainingArguments(**base_config), eval_dataloader=BrokenEvalData()) as trainer:
            trainer.train()
    assert (Path(base_config["save_dir"]) / "checkpoints" / "step-3" / "trainer_state.json").is_file()


def test_callbacks_that_are_not_callbacks_are_refused(base_config):
    with pytest.raises(ConfigError, match=r"callbacks\[1\] is a dict, not a pretrainer.Callback"):
        PreTrainer(PreTrainingArguments(**base_config), callbacks=[Recorder(), {"on_row": print}])
    with pytest.raises(ConfigError, match="callbacks= takes a list of pretrainer.Callback objects, got Recorder"):
        PreTrainer(PreTrainingArguments(**base_config), callbacks=Recorder())


def test_user_optimizer_and_scheduler_step_once_per_update(base_config):
    from transformers import AutoConfig, AutoModelForCausalLM, get_scheduler

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_config["model_path"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=0, num_training_steps=6)
    trainer = PreTrainer(PreTrainingArguments(**base_config), model=model, optimizer=optimizer,
                         lr_scheduler=scheduler)
    trainer.train()
    assert scheduler.last_epoch == 6  # once per optimizer step, not per micro-batch or per process
    lrs = [r["lr"] for r in trainer.log_history if "lr" in r]
    assert lrs == pytest.approx([1e-3 * (1 - s / 6) for s in range(6)])


def test_rerunning_a_finished_run_only_reexports(base_config):
    run(base_config)
    before = read_metrics(base_config["save_dir"])
    again = run(base_config)
    assert again.train_state.step == 6
    after = read_metrics(base_config["save_dir"])
    assert after[:len(before)] == before and len(after) == len(before) + 1  # only a resume row is added
    assert after[-1]["event"] == "resume" and after[-1]["step"] == 6
    assert after[-1]["config_hash"] == PreTrainingArguments(**base_config).config_hash()
    assert after[-1]["engine"] == "single" and after[-1]["world_size"] == 1


def test_small_file_trains_with_an_eval_split(base_config, tmp_path):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("def f(x):\n    return x + 1\nprint(f(2))\n")
    trainer = run(base_config, train_data=str(tiny), micro_batch_size=4, seq_length=8, num_training_steps=3,
                  eval_interval=1)
    assert trainer.train_state.step == 3 and eval_losses(base_config["save_dir"])


def test_launch_mismatches_are_refused(base_config, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="engine: single runs one process, but the launch started 2 processes"):
        PreTrainer(PreTrainingArguments(**{**base_config, "engine": "single"}))
    with pytest.raises(ConfigError, match="MASTER_ADDR is not set"):
        PreTrainer(PreTrainingArguments(**base_config))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError, match="the config asks for 'ddp' but the launcher asked for 'fsdp'"):
        PreTrainer(PreTrainingArguments(**{**base_config, "engine": "ddp"}))
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("ACCELERATE_USE_MEGATRON_LM", "true")
    with pytest.raises(ConfigError, match="the config asks for 'ddp' but the launcher asked for 'megatron'"):
        PreTrainer(PreTrainingArguments(**{**base_config, "engine": "ddp"}))


def test_async_checkpoints_resume_like_synchronous_ones(base_config, tmp_path):
    straight = tmp_path / "straight"
    run(base_config, save_dir=str(straight))
    interrupted = tmp_path / "async"
    run(base_config, save_dir=str(interrupted), async_checkpoint=True, exit_interval=3)
    assert (interrupted / "checkpoints" / "step-3" / "trainer_state.json").is_file()
    run(base_config, save_dir=str(interrupted), async_checkpoint=True)
    assert train_losses(interrupted) == train_losses(straight)
    assert (interrupted / "checkpoints" / "latest").read_text() == "step-6"


def test_a_checkpoint_of_another_model_is_a_clear_error(base_config, tmp_path):
    run(base_config, num_training_steps=3, eval_interval=0)
    other = write_tiny_model(tmp_path / "wider", hidden_size=96)
    with pytest.raises(ConfigError, match=r"step-3 does not fit this run's model and optimizer \(.*[Ss]ize mismatch"):
        PreTrainer(PreTrainingArguments(**{**base_config, "model_path": str(other), "num_training_steps": 4,
                                           "override_schedule": True})).train()
    with pytest.raises(ConfigError, match=r"step-3 does not fit this run's model and optimizer \(RuntimeError: "
                                          r"Missing key in checkpoint state_dict: optimizer\.state\.") as refused:
        PreTrainer(PreTrainingArguments(**{**base_config, "optimizer": "muon", "num_training_steps": 4,
                                           "override_schedule": True})).train()
    assert "{fqn}" not in str(refused.value)  # the message, not the source line that raised it


def test_a_misspelt_pretrainer_argument_is_an_error(base_config):
    with pytest.raises(TypeError, match="train_dataloder"):
        PreTrainer(PreTrainingArguments(**base_config), train_dataloder=None)


def test_resume_none_refuses_a_save_dir_holding_an_earlier_runs_checkpoints(base_config, tmp_path):
    """Starting afresh in a folder of checkpoints would overwrite them step by step: refused, naming the newest, and
    nothing in the folder changes; a new save_dir starts."""
    config = {**base_config, "num_training_steps": 3, "eval_interval": 0, "export_hf": False}
    PreTrainer(PreTrainingArguments(**config)).train()
    root = Path(config["save_dir"]) / "checkpoints"
    before = {path: path.stat().st_mtime_ns for path in root.rglob("*")}
    with pytest.raises(ConfigError, match=rf"key 'resume': none starts the run afresh, but save_dir holds an earlier "
                                          rf"run's checkpoint \({root / 'step-3'}\), .* give a new save_dir"):
        PreTrainer(PreTrainingArguments(**{**config, "resume": "none"}))
    assert {path: path.stat().st_mtime_ns for path in root.rglob("*")} == before
    fresh = PreTrainer(PreTrainingArguments(**{**config, "resume": "none", "save_dir": str(tmp_path / "new")}))
    assert fresh.resume_from is None
    fresh.engine.close()
    shutil.rmtree(tmp_path / "new" / "checkpoints", ignore_errors=True)  # a run that never saved: its metrics stay
    (tmp_path / "new" / "metrics.jsonl").write_text('{"event": "start", "step": 0}\n')
    with pytest.raises(ConfigError, match=r"none starts the run afresh, but save_dir holds an earlier run's metrics"):
        PreTrainer(PreTrainingArguments(**{**config, "resume": "none", "save_dir": str(tmp_path / "new")}))


def test_a_resume_names_the_keys_that_changed_and_not_how_it_was_started(base_config, caplog):
    config = {**base_config, "num_training_steps": 3, "eval_interval": 0, "export_hf": False, "resume": "none"}
    PreTrainer(PreTrainingArguments(**config)).train()
    with caplog.at_level("WARNING", logger="pretrainer"):
        PreTrainer(PreTrainingArguments(**{**config, "resume": "auto"})).train()
        assert "differs" not in caplog.text
        PreTrainer(PreTrainingArguments(**{**config, "resume": "auto", "log_interval": 2})).train()
    assert "whose config (its config.yaml) differs from this run's in: log_interval" in caplog.text


def test_resume_refuses_a_checkpoint_of_another_format_or_process_count(base_config, tmp_path):
    """The capabilities an engine declares decide: a DeepSpeed checkpoint (also one written before the format
    was recorded) is refused by a DCP engine; a DCP checkpoint of 2 ranks is resharded."""
    from pretrainer.train.checkpoint import check_resumable

    with cpu_engine() as engine:
        for state in ({"engine": "deepspeed", "world_size": 2},
                      {"engine": "deepspeed", "world_size": 1, "checkpoint_format": "deepspeed"}):
            with pytest.raises(ConfigError, match="was written by engine deepspeed; engine single cannot read it"):
                check_resumable(tmp_path, state, engine)
        check_resumable(tmp_path, {"engine": "fsdp", "world_size": 2, "checkpoint_format": "dcp"}, engine)
        check_resumable(tmp_path, {"engine": "ddp", "world_size": 2}, engine)


def test_unreadable_weights_are_a_config_error_naming_the_folder(base_config, tmp_path):
    folder = write_tiny_model(tmp_path / "cut-short")
    (folder / "model.safetensors").write_bytes(b"\x00" * 100)  # a download cut short
    with pytest.raises(ConfigError, match=f"model_path {folder}: its weights cannot be loaded"):
        PreTrainer(PreTrainingArguments(**{**base_config, "model_path": str(folder)}))


def test_a_checkpoint_written_before_saved_state_became_components_resumes_exactly(tmp_path):
    """tests/data/checkpoint-bf69caf: step 3 of a 6-step run, saved by the code before saved state was registered
    components (tests/stored_checkpoint.py made it). Resumed now, steps 4-6 give the losses that code gave, and
    the losses of an uninterrupted run of today's code."""
    from stored_checkpoint import SAVED_AT, STORED, stored_run_config

    config = stored_run_config(tmp_path, tmp_path / "resumed")
    shutil.copytree(STORED / "checkpoints", tmp_path / "resumed" / "checkpoints")
    run(config)
    resumed = train_losses(tmp_path / "resumed")
    assert sorted(resumed) == [4, 5, 6]  # it started from step 3
    then = {int(step): loss for step, loss in json.loads((STORED / "resumed_losses.json").read_text()).items()}
    assert resumed == pytest.approx(then, rel=1e-5)
    run(config, save_dir=str(tmp_path / "straight"))
    straight = train_losses(tmp_path / "straight")
    assert {step: straight[step] for step in resumed} == pytest.approx(resumed, rel=1e-5)
    assert SAVED_AT == 3


@pytest.mark.parametrize("name", ["dense", "moe", "mixture"])
def test_a_checkpoint_written_before_the_engines_became_one_backend_resumes_exactly(name, tmp_path):
    """tests/data/checkpoint-1544acc/NAME: step 3 of a 6-step run (dense, Qwen3-MoE with its balancing losses, a
    two-source mixture) saved by main at 1544acc (tests/stored_checkpoint.py made them). Resumed now, steps 4-6
    give the losses that code gave, and the mixture's source counts carry on from the checkpoint's."""
    from stored_checkpoint import ONE_BACKEND, one_backend_run_config

    config = one_backend_run_config(name, tmp_path, tmp_path / "resumed")
    shutil.copytree(ONE_BACKEND / name / "checkpoints", tmp_path / "resumed" / "checkpoints")
    run(config)
    resumed = train_losses(tmp_path / "resumed")
    then = {int(step): loss for step, loss in json.loads((ONE_BACKEND / name / "resumed_losses.json").read_text())
            .items()}
    assert sorted(resumed) == [4, 5, 6] and resumed == pytest.approx(then, rel=1e-5)
    if name == "mixture":
        rows = [row for row in read_metrics(tmp_path / "resumed") if "loss" in row]
        assert all(sum(v for k, v in row.items() if k.startswith("source_tokens/")) == row["tokens"] for row in rows)


def test_optimizer_state_keyed_by_position_is_read_by_its_metadata(base_config, tmp_path):
    """Checkpoints from before pipeline ranks needed per-name optimizer groups keyed optimizer state by group
    position; the checkpoint's metadata says which layout it holds, and either loads."""
    import torch.distributed.checkpoint as dcp

    from pretrainer.train import checkpoint_io

    config = {**base_config, "num_training_steps": 2, "save_dir": None, "eval_interval": 0, "save_interval": 0}
    trained = run(config)
    for options, name in ((checkpoint_io.KEYED_BY_POSITION, "by-position"), (checkpoint_io.KEYED_BY_NAME, "by-name")):
        dcp.save(checkpoint_io._state(trained.model, trained.optimizer, options), checkpoint_id=str(tmp_path / name))
        fresh = PreTrainer(PreTrainingArguments(**config))
        checkpoint_io.load_state(fresh.engine, tmp_path / name, fresh.model, fresh.optimizer)
        for (key, a), b in zip(trained.model.state_dict().items(), fresh.model.state_dict().values()):
            assert torch.equal(a, b), (name, key)
        moments = [(trained.optimizer.state[p]["exp_avg"], fresh.optimizer.state[q]["exp_avg"])
                   for p, q in zip(trained.model.parameters(), fresh.model.parameters())]
        assert moments and all(torch.equal(a, b) for a, b in moments), name


def test_the_log_follows_stdout_when_a_caller_replaces_it(monkeypatch, capsys):
    """The `pretrainer` logger writes to sys.stdout as it is at each line: after a caller has replaced and closed
    the stream it was set up with (a notebook cell, a test's capture), lines reach the new one, and no
    'Logging error' from a closed file lands on stderr."""
    import io
    import logging

    from pretrainer.train.metrics import setup_logging

    logger = logging.getLogger("pretrainer")
    saved = logger.handlers[:]
    for handler in saved:
        logger.removeHandler(handler)
    first = io.StringIO()
    try:
        monkeypatch.setattr(sys, "stdout", first)
        setup_logging()
        logger.warning("one")
        first.close()
        second = io.StringIO()
        monkeypatch.setattr(sys, "stdout", second)
        logger.warning("two")
        assert second.getvalue().endswith("]: two\n")
        assert "Logging error" not in capsys.readouterr().err
    finally:
        for handler in logger.handlers[:]:
            logger.removeHandler(handler)
        for handler in saved:
            logger.addHandler(handler)
