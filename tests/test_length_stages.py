"""Sequence-length stages (`seq_length_schedule`): each stage trains at its length over the token stream of the
fixed-length run, resumes mid-stage on other ranks and engines with the uninterrupted losses, sets its RoPE (which
the export carries), is planned stage by stage, and bad stages are refused naming the key."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import CORPUS, QUICKSTART_MODEL, leaves_no_process_group, read_metrics, train_losses
from multi_run import launch_cases
from pretrainer import Callback, ConfigError, PreTrainer, PreTrainingArguments
from pretrainer.train.report import write_report

TOKENS_PER_STEP = 2 * 2 * 256  # micro-batch 2 x 2 accumulation of 256-token sequences
STAGES = [{"until_tokens": 2 * TOKENS_PER_STEP, "seq_length": 64},
          {"until_tokens": 4 * TOKENS_PER_STEP, "seq_length": 128}, {"seq_length": 256}]


def staged_config(base_config, save_dir, **keys) -> dict:
    return {**base_config, "model_path": str(QUICKSTART_MODEL), "seq_length": 256, "seq_length_schedule": STAGES,
            "num_training_steps": 6, "save_interval": 0, "eval_interval": 3, "export_hf": False,
            "save_dir": str(save_dir), **keys}


class Windows(Callback):
    """Each step's micro-batches as the model receives them (after the stage's cut)."""

    def __init__(self):
        self.steps: list[list[dict]] = []

    def begin_step(self, counts, batches) -> None:
        self.steps.append([{key: batch[key].clone() for key in ("input_ids", "shift_labels")} for batch in batches])


def stream_of(windows: Windows, key: str) -> torch.Tensor:
    return torch.cat([batch[key].reshape(-1) for step in windows.steps for batch in step])


def test_three_stages_train_at_their_lengths_over_the_fixed_length_runs_token_stream(base_config, tmp_path):
    """64 -> 128 -> 256 over 6 steps: steps 1-2 cut each 256-token sequence into 4 windows, steps 3-4 into 2; every
    row names its length; the tokens trained and every input and target, in order, are the fixed 256 run's."""
    staged, fixed = Windows(), Windows()
    PreTrainer(PreTrainingArguments(**staged_config(base_config, tmp_path / "staged")), callbacks=[staged]).train()
    PreTrainer(PreTrainingArguments(**staged_config(base_config, tmp_path / "fixed", seq_length_schedule=None)),
               callbacks=[fixed]).train()
    assert [tuple(batch["input_ids"].shape) for step in staged.steps for batch in step] == \
        [(8, 64)] * 4 + [(4, 128)] * 4 + [(2, 256)] * 4
    for key in ("input_ids", "shift_labels"):
        assert torch.equal(stream_of(staged, key), stream_of(fixed, key)), key
    rows = read_metrics(tmp_path / "staged")
    trained = [row for row in rows if "loss" in row]
    assert [(row["step"], row["seq_length"]) for row in trained] == [(1, 64), (2, 64), (3, 128), (4, 128), (5, 256),
                                                                    (6, 256)]
    assert [row["tokens"] for row in trained] == [row["tokens"] for row in read_metrics(tmp_path / "fixed")
                                                  if "loss" in row]
    assert [(row["step"], row["seq_length"]) for row in rows if "eval_loss" in row] == [(3, 128), (6, 256)]
    # shorter windows see less context: the losses differ from the fixed run's until the last stage's
    assert train_losses(tmp_path / "staged")[1] != pytest.approx(train_losses(tmp_path / "fixed")[1], rel=1e-4)
    page = write_report(tmp_path / "staged").read_text()
    assert "sequence-length stages</th><td>64 from logged step 1, then 128 from logged step 3, then 256 from " \
           "logged step 5" in page and (tmp_path / "staged" / "report" / "seq_length.svg").is_file()


def test_document_positions_restart_at_every_short_window(base_config, tmp_path):
    """With reset_position_ids, a short window's positions are those a run at its length computes from its tokens:
    its first document restarts at 0, although the 256-token sequence it was cut from began that document earlier."""
    from pretrainer.data.packing import document_position_ids

    class Positions(Callback):
        batches: list[dict] = []

        def begin_step(self, counts, batches) -> None:
            self.batches.extend({key: batch[key].clone() for key in ("input_ids", "position_ids")} for batch in batches)

    seen = Positions()
    config = staged_config(base_config, tmp_path / "run", reset_position_ids=True, num_training_steps=1,
                           warmup_steps=0, eval_interval=0)
    PreTrainer(PreTrainingArguments(**config), callbacks=[seen]).train()
    eos = 1  # the tiny Llama's
    continued = 0
    for batch in seen.batches:
        assert batch["input_ids"].shape[1] == 64
        assert torch.equal(batch["position_ids"], document_position_ids(batch["input_ids"], eos))
        whole = document_position_ids(batch["input_ids"].reshape(-1, 256), eos).reshape(-1, 64)
        continued += int((whole[:, 0] != 0).sum())
    assert continued > 0  # windows whose first document began in an earlier window


def test_a_run_stopped_mid_stage_resumes_on_two_fsdp_ranks_and_every_engine_with_the_uninterrupted_losses(
        base_config, tmp_path):
    """The staged run on one process is the reference; fsdp on 2 ranks uninterrupted, fsdp stopped at step 3 (the
    middle of the 128 stage) and rerun, ddp, fsdp with context parallelism over the 2 ranks (cp is fixed for the
    run), megatron tp=2 and DeepSpeed ZeRO-2 all give its losses (fp32)."""
    single = tmp_path / "single"
    PreTrainer(PreTrainingArguments(**staged_config(base_config, single))).train()
    two = {"dp": 2, "gradient_accumulation_steps": 1}
    cases = [{"name": name, "config": {**config, "save_dir": str(tmp_path / folder)}}
             for name, folder, config in (
                 ("fsdp", "fsdp", {"engine": "fsdp", **two}),
                 ("stop", "moved", {"engine": "fsdp", **two, "exit_interval": 3, "save_interval": 3}),
                 ("rerun", "moved", {"engine": "fsdp", **two, "save_interval": 3}),
                 ("ddp", "ddp", {"engine": "ddp", **two}),
                 ("cp", "cp", {"engine": "fsdp", "context_parallel_degree": 2}),
                 ("tp", "tp", {"engine": "megatron", "plugin_args": {"tp_degree": 2}}),
                 ("zero2", "zero2", {"engine": "deepspeed", **two, "deepspeed": {"zero_optimization": {"stage": 2}}}))]
    launch_cases(staged_config(base_config, single), cases, 2, tmp_path)
    want = train_losses(single)
    for name in ("fsdp", "moved", "ddp", "cp", "tp", "zero2"):
        have = train_losses(tmp_path / name)
        assert sorted(have) == sorted(want) and [have[s] for s in sorted(want)] == pytest.approx(
            [want[s] for s in sorted(want)], rel=1e-5), name
    starts = [row for row in read_metrics(tmp_path / "moved") if row.get("event") in ("start", "resume")]
    assert [(row["event"], row["step"], row["seq_length"]) for row in starts] == [("start", 0, 64),
                                                                                 ("resume", 3, 128)]


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 2.0}, {"rope_type": "linear", "factor": 4.0}])
def test_a_last_stage_with_rope_scaling_exports_it_with_the_trained_models_logits(base_config, tmp_path, scaling):
    from transformers import AutoConfig, AutoModelForCausalLM

    stages = [*STAGES[:2], {"seq_length": 256, "rope_scaling": scaling, "rope_theta": 20000.0}]
    config = staged_config(base_config, tmp_path / "run", seq_length_schedule=stages, export_hf=True,
                           eval_interval=0)
    trainer = PreTrainer(PreTrainingArguments(**config))
    trainer.train()
    exported = json.loads((tmp_path / "run" / "hf" / "config.json").read_text())
    assert exported["rope_parameters"]["rope_type"] == scaling["rope_type"]
    assert exported["rope_parameters"]["rope_theta"] == 20000.0 and exported["max_position_embeddings"] == \
        512 * scaling["factor"]
    ids = torch.arange(3, 3 + 256).remainder(4000).unsqueeze(0)
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32)
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        # the model's own RoPE gives other logits: the stage's settings are what the export and the run share
        plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(QUICKSTART_MODEL), dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        assert not torch.allclose(plain(input_ids=ids).logits, want, atol=1e-3)
    trainer.close()


def test_a_stage_rope_is_set_again_on_resume(base_config, tmp_path):
    """Stopped in the last stage, the rerun's model rotates with that stage's RoPE from its first step."""
    stages = [STAGES[0], {"seq_length": 256, "rope_theta": 40000.0}]
    uninterrupted = tmp_path / "whole"
    PreTrainer(PreTrainingArguments(**staged_config(base_config, uninterrupted, seq_length_schedule=stages,
                                                    eval_interval=0))).train()
    moved = staged_config(base_config, tmp_path / "moved", seq_length_schedule=stages, eval_interval=0,
                          save_interval=3)
    PreTrainer(PreTrainingArguments(**{**moved, "exit_interval": 3})).train()
    PreTrainer(PreTrainingArguments(**moved)).train()
    want, have = train_losses(uninterrupted), train_losses(tmp_path / "moved")
    assert [have[s] for s in sorted(want)] == pytest.approx([want[s] for s in sorted(want)], rel=1e-6)


def test_the_plan_prints_each_stage_and_refuses_a_stage_that_does_not_fit(base_config, tmp_path):
    from pretrainer.plan.command import plan_for_command
    from pretrainer.plan.render import as_json, text

    config = staged_config(base_config, tmp_path / "run")
    plan = plan_for_command(PreTrainingArguments(**config), None, None, "cpu", None)
    lines = [line for line in text(plan).splitlines() if "stage" in line and "seq_length " in line]
    assert [line.split(":")[0].strip() for line in lines] == [
        "stage 1 of 3 (seq_length 64, tokens 0 to 2,048)", "stage 2 of 3 (seq_length 128, tokens 2,048 to 4,096)",
        "stage 3 of 3 (seq_length 256, from token 4,096 to the end)"]
    stages = as_json(plan)["length_stages"]
    assert [s["micro_batch"] for s in stages] == [8, 4, 2]
    assert stages[2]["peak_bytes"] == plan.estimate.peak
    # windows of every length hold the same tokens a micro-batch; where nothing fits, the first stage is named
    limit = min(s["peak_bytes"] for s in stages) - 2**20
    with leaves_no_process_group(), pytest.raises(ConfigError, match=r"seq_length_schedule stage 1 of 3 \(seq_length "
                                                                      r"64, tokens 0 to 2,048\) \(and stage\(s\) 2, "
                                                                      r"3\): predicted peak memory .* exceeds"):
        PreTrainer(PreTrainingArguments(**{**config, "device_memory": limit}))


@pytest.mark.parametrize("keys, message", [
    ({"seq_length_schedule": [{"until_tokens": 100, "seq_length": 48}, {"seq_length": 256}]},
     r"seq_length_schedule\[0\]: seq_length 48 does not divide the run's seq_length \(256\)"),
    ({"seq_length_schedule": [{"until_tokens": 100, "seq_length": 64}, {"seq_length": 128}]},
     r"seq_length_schedule\[1\]: the last stage trains at the run's seq_length \(256\), not 128"),
    ({"seq_length_schedule": [{"until_tokens": 100, "seq_length": 64}, {"until_tokens": 50, "seq_length": 128},
                              {"seq_length": 256}]},
     r"seq_length_schedule\[1\]: until_tokens must be a whole number of tokens larger than the previous"),
    ({"seq_length_schedule": [{"until_tokens": 100, "length": 64}, {"seq_length": 256}]},
     r"seq_length_schedule\[0\] has unknown key\(s\) length"),
    ({"seq_length_schedule": [{"seq_length": 64, "until_tokens": 100}, {"seq_length": 256, "until_tokens": 200}]},
     r"the last stage runs to the end of the run; remove its until_tokens"),
    ({"seq_length_schedule": [{"until_tokens": 100, "seq_length": 64}, {"seq_length": 256, "rope_theta": 1e5}],
      "rope_theta": 5e4}, r"rope_theta is set for the whole run and seq_length_schedule's stages set RoPE too"),
    ({"seq_length_schedule": [{"until_tokens": 100, "seq_length": 64}, {"seq_length": 1024}], "seq_length": 1024},
     r"seq_length_schedule\[1\] trains windows of 1024 tokens, more than the 512 positions the model .* has with "
     r"this stage's RoPE; give the stage rope_scaling, e.g. \{rope_type: yarn, factor: 2\}"),
    ({"seq_length_schedule": [{"until_tokens": 100, "seq_length": 64}, {"seq_length": 256, "rope_scaling":
                                                                       {"rope_type": "yarn", "factor": 0.5}}]},
     r"seq_length_schedule\[1\]: rope_scaling.factor must be a number >= 1"),
    ({"seq_length_schedule": [{"until_tokens": 100, "seq_length": 64, "sequences": 6}, {"seq_length": 256}]},
     r"seq_length_schedule\[0\]: 6 windows of 64 are 1.5 of the run's 256-token sequences"),
    ({"seq_length_schedule": [{"until_tokens": 100, "seq_length": 64}, {"seq_length": 256, "rope_scaling":
                                                                       {"rope_type": "llama3", "factor": 2.0}}]},
     r"key 'seq_length_schedule': a stage's rope_scaling: .*low_freq_factor.*seq_length_schedule\[1\]"),
    ({"seq_length_schedule": [{"until_tokens": 100, "seq_length": 2}, {"seq_length": 256}], "mtp_num_layers": 2},
     r"depth 2 leaves no target in a window of seq_length 2 tokens"),
    ({"seq_length_schedule": [{"until_tokens": 100, "seq_length": 64, "sequences": 8}, {"seq_length": 256}],
      "deepspeed": {"zero_optimization": {"stage": 1}}},
     r"seq_length_schedule: a stage names sequences, which changes the micro-batches per step, and engine "
     r"deepspeed fixes them"),
])
def test_a_bad_stage_is_refused_naming_the_key(base_config, tmp_path, keys, message):
    config = {**staged_config(base_config, tmp_path / "run"), **keys}
    with leaves_no_process_group(), pytest.raises(ConfigError, match=message):
        PreTrainer(PreTrainingArguments(**config))


def test_a_last_stage_may_extend_the_positions_with_its_rope_scaling(base_config, tmp_path):
    """A 1024-token last stage past the model's 512 positions trains once that stage's YaRN extends them."""
    stages = [{"until_tokens": 4096, "seq_length": 256}, {"seq_length": 1024,
                                                          "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}]
    config = staged_config(base_config, tmp_path / "run", seq_length=1024, seq_length_schedule=stages,
                           micro_batch_size=1, gradient_accumulation_steps=1, num_training_steps=6, eval_interval=0)
    PreTrainer(PreTrainingArguments(**config)).train()
    assert [row["seq_length"] for row in read_metrics(tmp_path / "run") if "loss" in row] == [256] * 4 + [1024] * 2


def test_a_stage_naming_sequences_trains_that_many_windows_per_update(base_config, tmp_path):
    """A first stage of 8 windows of 64 per update (2 of the run's sequences, a quarter of its tokens) ramps to
    the global batch of 4 sequences of 256: the tokens per step follow."""
    stages = [{"until_tokens": 1024, "seq_length": 64, "sequences": 8}, {"seq_length": 256}]
    config = staged_config(base_config, tmp_path / "run", seq_length_schedule=stages, micro_batch_size=1,
                           gradient_accumulation_steps=4, num_training_steps=4, eval_interval=0)
    trainer = PreTrainer(PreTrainingArguments(**config))
    assert [trainer.resolved.sizes.accumulation(step) for step in range(4)] == [2, 2, 4, 4]
    trainer.train()
    rows = [row for row in read_metrics(tmp_path / "run") if "loss" in row]
    assert [(row["seq_length"], row["tokens"]) for row in rows] == [(64, 512), (64, 1024), (256, 2048), (256, 3072)]


def test_a_user_dataloader_and_pipeline_stages_are_refused(base_config, tmp_path):
    config = staged_config(base_config, tmp_path / "run")
    loader = torch.utils.data.DataLoader([{"input_ids": torch.zeros(256, dtype=torch.long)}] * 4, batch_size=2)
    for name, article in (("train_dataloader", "a"), ("eval_dataloader", "an")):
        with leaves_no_process_group(), pytest.raises(ConfigError, match=f"{article} {name} was given, whose "
                                                                         "batches keep their own length"):
            PreTrainer(PreTrainingArguments(**config), **{name: loader})
    from pretrainer.parallel.registry import ENGINES
    from pretrainer.run.rules import check_rules  # pp needs 2 processes to be chosen; the rule itself is read here

    megatron = next(entry for entry in ENGINES if entry.name == "megatron")
    args = PreTrainingArguments(**{**config, "engine": "megatron", "plugin_args": {"pp_degree": 2}})
    settings = megatron.cls.read_settings(args, None, 2, "fp32")
    with pytest.raises(ConfigError, match=r"seq_length_schedule is not available with pipeline parallelism"):
        check_rules(args, megatron, settings, 2)


def test_a_mixture_draws_the_same_blend_at_every_length(base_config, tmp_path):
    """Two sources whose weights change at a mixture stage inside the first length stage: the staged run reads the
    fixed run's windows, so each source's tokens at every logged step, and the stream itself, are the same."""
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    (tmp_path / "even.jsonl").write_text("\n".join(lines[::2]) + "\n", encoding="utf-8")
    (tmp_path / "odd.jsonl").write_text("\n".join(lines[1::2]) + "\n", encoding="utf-8")
    mixture = {"train_data": [{"name": name, "path": str(tmp_path / f"{name}.jsonl")} for name in ("even", "odd")],
               "mixture_schedule": [{"until_tokens": TOKENS_PER_STEP, "weights": {"even": 0.8, "odd": 0.2}},
                                    {"weights": {"even": 0.2, "odd": 0.8}}], "log_interval": 1}
    staged, fixed = Windows(), Windows()
    PreTrainer(PreTrainingArguments(**staged_config(base_config, tmp_path / "staged", **mixture)),
               callbacks=[staged]).train()
    PreTrainer(PreTrainingArguments(**staged_config(base_config, tmp_path / "fixed", seq_length_schedule=None,
                                                    **mixture)), callbacks=[fixed]).train()
    assert torch.equal(stream_of(staged, "input_ids"), stream_of(fixed, "input_ids"))

    def sources(folder):
        return [{k: v for k, v in row.items() if k.startswith("source_tokens/")} for row in read_metrics(folder)
                if "loss" in row]

    assert sources(tmp_path / "staged") == sources(tmp_path / "fixed") and sources(tmp_path / "fixed")[0]
    def losses(folder):  # a source's loss where the step trained it: the same sources, the windows' rows followed
        return [sorted(k for k in row if k.startswith("source_loss/")) for row in read_metrics(folder) if "loss" in row]

    assert losses(tmp_path / "staged") == losses(tmp_path / "fixed") and ["source_loss/even", "source_loss/odd"] in \
        losses(tmp_path / "staged")


def test_a_cooldown_branch_may_start_the_long_context_stage(base_config, tmp_path):
    """The annealing recipe: a parent trains at 64 (its long stage set past its end); a cooldown branch from its
    step 4 moves the stage's start to the branch point, so its decay trains at 256 with a larger RoPE base."""
    parent = tmp_path / "parent"
    wsd = {"lr_decay_style": "wsd", "wsd_decay_tokens": 2 * TOKENS_PER_STEP, "min_lr": 1e-4, "save_interval": 2,
           "eval_interval": 0, "num_training_steps": 8}
    PreTrainer(PreTrainingArguments(**staged_config(base_config, parent, seq_length_schedule=[
        {"until_tokens": 10**12, "seq_length": 64}, {"seq_length": 256}], **wsd))).train()
    branch = PreTrainer(PreTrainingArguments(**staged_config(base_config, parent, seq_length_schedule=[
        {"until_tokens": 4 * TOKENS_PER_STEP, "seq_length": 64}, {"seq_length": 256, "rope_theta": 40000.0}],
        cooldown_from=str(parent / "checkpoints" / "step-4"), cooldown_tokens=2 * TOKENS_PER_STEP, **wsd)))
    branch.train()
    rows = [row for row in read_metrics(branch.pretrain_args.save_dir) if "loss" in row]
    assert [(row["step"], row["seq_length"]) for row in rows] == [(5, 256), (6, 256)]
    assert branch.engine.unwrap(branch.model).config.rope_parameters["rope_theta"] == 40000.0
    branch.close()


def test_a_batch_of_short_windows_is_padded_to_whole_windows():
    """A corpus's last window is shorter than the run's: cut to 256, a 520-token batch gives windows 0-255 and
    256-511 and a third of 8 tokens padded (its targets ignored); a row's padding alone makes no window."""
    from pretrainer.batch import IGNORE, cut_windows

    ids = torch.arange(2 * 520).reshape(2, 520)
    mask = torch.ones_like(ids)
    mask[1, 200:] = 0
    batch = {"input_ids": ids, "shift_labels": ids + 1, "attention_mask": mask,
             "position_ids": torch.arange(520).expand(2, 520).clone()}
    cut = cut_windows(batch, 256)
    assert cut["input_ids"].shape == (4, 256)  # row 0: 3 windows; row 1: one (the rest is its padding)
    assert torch.equal(cut["input_ids"][2, :8], ids[0, 512:]) and (cut["shift_labels"][2, 8:] == IGNORE).all()
    assert torch.equal(cut["input_ids"][3], ids[1, :256]) and (cut["position_ids"][:, 0] == 0).all()
    assert cut_windows({"input_ids": ids[:, :200], "shift_labels": ids[:, :200]}, 256)["input_ids"].shape == (2, 200)


def test_the_stage_rope_reaches_a_complete_runs_rerun_and_an_export_from_its_checkpoint(base_config, tmp_path):
    """A stage's RoPE is the model's wherever it is loaded: the rerun of a complete run re-exports it, and
    `pretrainer export` from the checkpoint writes it too."""
    from pretrainer.train.offline import export_checkpoint

    stages = [STAGES[0], {"seq_length": 256, "rope_theta": 20000.0}]
    config = staged_config(base_config, tmp_path / "run", seq_length_schedule=stages, export_hf=True,
                           eval_interval=0, num_training_steps=3, save_interval=3)
    PreTrainer(PreTrainingArguments(**config)).train()
    (tmp_path / "run" / "hf" / "config.json").unlink()
    PreTrainer(PreTrainingArguments(**config)).train()  # complete: exports again
    assert json.loads((tmp_path / "run" / "hf" / "config.json").read_text())["rope_parameters"]["rope_theta"] == 2e4
    out = export_checkpoint(PreTrainingArguments(**config), str(tmp_path / "run" / "checkpoints" / "step-3"),
                            str(tmp_path / "exported"))
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["rope_parameters"]["rope_theta"] == 2e4, out


def test_a_model_whose_rope_is_set_per_layer_type_refuses_stage_rope(base_config, tmp_path):
    """Gemma 3 holds a RoPE per layer type (sliding and full attention): a stage cannot rebuild it in place."""
    from transformers import AutoTokenizer, Gemma3TextConfig

    folder = tmp_path / "gemma3"
    Gemma3TextConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                     sliding_window=64).save_pretrained(folder)
    AutoTokenizer.from_pretrained(QUICKSTART_MODEL).save_pretrained(folder)
    config = staged_config(base_config, tmp_path / "run", model_path=str(folder), seq_length_schedule=[
        STAGES[0], {"seq_length": 256, "rope_theta": 20000.0}])
    with leaves_no_process_group(), pytest.raises(ConfigError, match=r"a stage sets rope_theta or rope_scaling, but "
                                                                      r"the model \(gemma3_text\) sets RoPE per "
                                                                      r"layer type"):
        PreTrainer(PreTrainingArguments(**config))


def test_a_resume_onto_other_stages_is_refused_and_a_branch_may_not_change_their_sequences(base_config, tmp_path):
    config = staged_config(base_config, tmp_path / "run", exit_interval=3, save_interval=3, eval_interval=0)
    PreTrainer(PreTrainingArguments(**config)).train()
    # the same stages spelled otherwise (the last stage's length left out) resume
    same = [*STAGES[:2], {}]
    PreTrainer(PreTrainingArguments(**{**config, "seq_length_schedule": same, "exit_interval": 4})).close()
    moved = [STAGES[0], {**STAGES[1], "until_tokens": 5 * TOKENS_PER_STEP}, STAGES[2]]
    with leaves_no_process_group(), pytest.raises(ConfigError, match=r"seq_length_schedule .* -> .*the steps from "
                                                                      r"here on would train at other window lengths"):
        PreTrainer(PreTrainingArguments(**{**config, "seq_length_schedule": moved}))
    parent = tmp_path / "parent"
    ramp = [{"until_tokens": 4096, "seq_length": 64, "sequences": 16}, {"seq_length": 256}]
    PreTrainer(PreTrainingArguments(**staged_config(base_config, parent, seq_length_schedule=ramp, save_interval=2,
                                                    eval_interval=0, num_training_steps=4))).train()
    branch = {**staged_config(base_config, parent, seq_length_schedule=[{"until_tokens": 4096, "seq_length": 64},
                                                                        {"seq_length": 256}], eval_interval=0),
              "cooldown_from": str(parent / "checkpoints" / "step-2"), "cooldown_tokens": 2048}
    with leaves_no_process_group(), pytest.raises(ConfigError, match=r"seq_length_schedule sequences"):
        PreTrainer(PreTrainingArguments(**branch))
