"""Cooldown branches (`cooldown_from`, `cooldown_tokens`): a branch from a stable-phase checkpoint gives the
losses of the WSD run that decays over the same tokens; its length, folder and lineage; a resume onto a
changed schedule is refused unless override_schedule. The batch-size ramp (`batch_size_schedule`): samples,
schedule, ranks and resume."""

from __future__ import annotations

import json
import math

import pytest

from helpers import leaves_no_process_group, read_metrics, train_losses
from multi_run import launch_cases
from pretrainer import ConfigError, PreTrainer, PreTrainingArguments
from pretrainer.train.report import write_report

TOKENS_PER_STEP = 4 * 32  # base_config: global batch 4 (2 x 2 accumulation) of 32 tokens


def wsd_config(base_config, save_dir, steps: int = 8, decay_steps: int = 4) -> dict:
    return {**base_config, "num_training_steps": steps, "lr_decay_style": "wsd", "wsd_decay_shape": "1-sqrt",
            "wsd_decay_tokens": decay_steps * TOKENS_PER_STEP, "min_lr": 1e-4, "save_interval": 2,
            "eval_interval": 4, "export_hf": False, "save_dir": str(save_dir)}


def test_a_branch_from_the_stable_phase_equals_the_wsd_run_that_decays_over_its_tokens(base_config, tmp_path):
    """A 12-step WSD run is stable to step 8; a branch from its step 4 that cools down over 512 tokens (4 updates,
    1-sqrt) trains steps 5-8 with the lrs, losses and evaluations of the 8-step WSD run whose decay is those 512
    tokens. The parent's config with the two keys added is all it needs (the branch's folder and length are
    derived)."""
    parent, reference = tmp_path / "parent", tmp_path / "reference"
    PreTrainer(PreTrainingArguments(**wsd_config(base_config, parent, steps=12))).train()
    PreTrainer(PreTrainingArguments(**wsd_config(base_config, reference, steps=8))).train()
    stable = {**wsd_config(base_config, parent, steps=12), "cooldown_from": str(parent / "checkpoints" / "step-4"),
              "cooldown_tokens": 4 * TOKENS_PER_STEP}
    branch = PreTrainer(PreTrainingArguments(**stable))
    assert branch.pretrain_args.save_dir == str(parent / "branches" / "cooldown-step-4-512")
    assert branch.total_steps == 8
    branch.train()
    folder = parent / "branches" / "cooldown-step-4-512"
    want, have = read_metrics(reference), read_metrics(folder)
    for key in ("loss", "lr", "grad_norm", "eval_loss"):
        expected = {row["step"]: row[key] for row in want if key in row and row["step"] > 4}
        got = {row["step"]: row[key] for row in have if key in row and row["step"] > 4}
        assert sorted(got) == sorted(expected) and [got[s] for s in sorted(got)] == pytest.approx(
            [expected[s] for s in sorted(expected)], rel=1e-6, abs=1e-12), key
    start = next(row for row in have if row.get("event") == "start")
    assert start["branch_of"] == f"{parent}@step-4" and start["step"] == 4
    # the parent's report draws its branches over it; the branch's names its lineage
    page = write_report(parent).read_text()
    assert "branch cooldown-step-4-512</th><td>from step 4: final eval loss" in page
    assert page.count("the run and its cooldown branches") == 2 and (parent / "report" / "branches_loss.svg").is_file()
    assert f"(cooldown branch of {parent}@step-4)" in write_report(folder).read_text()


def test_a_shorter_branch_reaches_min_lr_at_its_own_end_and_resumes_as_itself(base_config, tmp_path):
    parent = tmp_path / "parent"
    PreTrainer(PreTrainingArguments(**wsd_config(base_config, parent))).train()
    config = {**wsd_config(base_config, parent), "cooldown_from": str(parent / "checkpoints" / "step-2"),
              "cooldown_tokens": 300, "save_dir": str(tmp_path / "short"), "exit_interval": 3}
    first = PreTrainer(PreTrainingArguments(**config))
    assert first.total_steps == 2 + 3  # 300 tokens: 3 updates of 128, the last partly past them
    first.train()  # stops after step 3 (exit_interval), a checkpoint saved
    PreTrainer(PreTrainingArguments(**{**config, "exit_interval": None})).train()
    rows = [row for row in read_metrics(tmp_path / "short") if "lr" in row]
    lrs = {row["step"]: row["lr"] for row in rows}
    # the lr each update used: from the parent's peak at step 2 down along 1 - sqrt(tokens / 300)
    expected = {step: 1e-4 + (1e-3 - 1e-4) * (1 - min(1.0, (step - 2) * 128 / 300) ** 0.5) for step in (3, 4, 5)}
    assert lrs == pytest.approx(expected, rel=1e-9)
    assert sorted(train_losses(tmp_path / "short")) == [3, 4, 5]


def test_a_resume_onto_a_changed_schedule_is_refused_with_the_changed_keys(base_config, tmp_path):
    config = {**base_config, "exit_interval": 3, "export_hf": False}
    PreTrainer(PreTrainingArguments(**config)).train()
    changed = {**config, "exit_interval": None, "lr": 2e-3, "num_training_steps": 8}
    with pytest.raises(ConfigError, match=r"resuming from .*step-3 would change the run's state: lr 0\.001 -> 0\.002, "
                                          r"num_training_steps 6 -> 8 \(the lr would jump at this step; set "
                                          r"override_schedule: true to accept\)"):
        with PreTrainer(PreTrainingArguments(**changed)) as trainer:  # closed: no process group is left
            trainer.train()
    PreTrainer(PreTrainingArguments(**{**changed, "override_schedule": True})).train()
    lrs = {row["step"]: row["lr"] for row in read_metrics(base_config["save_dir"]) if "lr" in row}
    assert max(lrs) == 8 and lrs[4] == pytest.approx(2e-3 * 0.5 * (1 + math.cos(math.pi * 1 / 5)), rel=1e-9)


@pytest.mark.parametrize("keys, message", [
    ({"cooldown_tokens": 100}, "cooldown_tokens needs cooldown_from"),
    ({"cooldown_from": "somewhere"}, "cooldown_from needs cooldown_tokens"),
])
def test_half_a_branch_is_refused(base_config, keys, message):
    with pytest.raises(ConfigError, match=message):
        PreTrainingArguments(**{**base_config, **keys})


def test_a_branch_point_that_is_no_checkpoint_lists_the_run_s_checkpoints(base_config, tmp_path):
    parent = tmp_path / "parent"
    PreTrainer(PreTrainingArguments(**{**wsd_config(base_config, parent), "num_training_steps": 4})).train()
    with pytest.raises(ConfigError, match=r"cooldown_from.*is not a complete checkpoint folder .*this folder's "
                                          r"checkpoints: step-2, step-4"):
        PreTrainer(PreTrainingArguments(**{**base_config, "cooldown_from": str(parent), "cooldown_tokens": 100}))


# ---- the batch-size ramp ----

RAMP = [[0, 8], [512, 16], [1536, 32]]  # tokens of 32-token sequences: 2 steps of 8, 2 of 16, then 32


def ramp_config(base_config, save_dir) -> dict:
    return {**base_config, "num_training_steps": 7, "gradient_accumulation_steps": 16, "batch_size_schedule": RAMP,
            "lr_decay_style": "wsd", "wsd_decay_tokens": 3 * 32 * 32, "min_lr": 1e-4, "save_interval": 0,
            "eval_interval": 0, "export_hf": False, "save_dir": str(save_dir)}


def test_a_ramp_reads_its_sum_decays_to_min_lr_and_trains_alike_on_two_ranks_and_after_a_stop(base_config,
                                                                                             tmp_path):
    """8 -> 16 -> 32 sequences by accumulation: 144 samples in 7 steps; the wsd decay over the last 3072 tokens
    is the last 3 steps, ending at min_lr; ddp and fsdp on 2 ranks (micro-batch 2 x 8 accumulation at the end)
    and a run stopped at step 3, inside the ramp, give the uninterrupted per-step losses."""
    single = tmp_path / "single"
    trainer = PreTrainer(PreTrainingArguments(**ramp_config(base_config, single)))
    assert [trainer.resolved.sizes.accumulation(step) for step in range(7)] == [4, 4, 8, 8, 16, 16, 16]
    trainer.train()
    rows = [row for row in read_metrics(single) if "loss" in row]
    assert [row["tokens"] for row in rows] == [32 * n for n in (8, 16, 32, 48, 80, 112, 144)]
    lrs = [row["lr"] for row in rows]
    assert lrs[3] == 1e-3 and 1e-4 < lrs[4] < lrs[3] and lrs[-1] == pytest.approx(1e-4)
    saved = json.loads((single / "checkpoints" / "step-7" / "trainer_state.json").read_text())
    assert saved["data"]["samples"] == 144 == sum((8, 8, 16, 16, 32, 32, 32))
    cases = [{"name": name, "config": {"engine": engine, "dp": 2, "gradient_accumulation_steps": 8,
                                       "save_dir": str(tmp_path / name), **extra}}
             for name, engine, extra in (("ddp", "ddp", {}), ("fsdp", "fsdp", {}),
                                         ("stop", "fsdp", {"exit_interval": 3, "save_dir": str(tmp_path / "moved")}),
                                         ("rerun", "fsdp", {"save_dir": str(tmp_path / "moved")}))]
    launch_cases(ramp_config(base_config, single), cases, 2, tmp_path)
    want = train_losses(single)
    for name in ("ddp", "fsdp", "moved"):
        have = train_losses(tmp_path / name)
        assert sorted(have) == sorted(want) and [have[s] for s in sorted(want)] == pytest.approx(
            [want[s] for s in sorted(want)], rel=1e-5), name


@pytest.mark.parametrize("keys, message", [
    ({"batch_size_schedule": [[0, 8], [512, 16]]}, "the last stage has 16 sequences, but the global batch is 32"),
    ({"batch_size_schedule": [[0, 7], [512, 32]]}, "the stage from token 0 has 7 sequences, not a multiple of "
                                                  "micro_batch_size x dp = 2"),
    ({"batch_size_schedule": [[100, 8], [512, 32]]}, "the stages' tokens must start at 0 and increase"),
    ({"batch_size_schedule": [[0, 8], [2000, 32]], "deepspeed": {"zero_optimization": {"stage": 1}}},
     "batch_size_schedule is not available here: engine deepspeed fixes the number of micro-batches per step"),
])
def test_a_bad_ramp_is_refused_naming_the_key(base_config, keys, message):
    config = {**base_config, "gradient_accumulation_steps": 16, **keys}
    with leaves_no_process_group(), pytest.raises(ConfigError, match=message):  # a failed construction closes
        PreTrainer(PreTrainingArguments(**config))


def test_the_plan_gives_each_ramp_stage_its_step_time_and_memory(base_config):
    from pretrainer.plan.command import plan_for_command
    from pretrainer.plan.render import as_json

    plan = plan_for_command(PreTrainingArguments(**{**base_config, "gradient_accumulation_steps": 16,
                                                    "batch_size_schedule": RAMP}), None, None, "cpu", None)
    stages = as_json(plan)["ramp_stages"]
    assert [(s["from_tokens"], s["sequences"], s["accumulation"]) for s in stages] == [(0, 8, 4), (512, 16, 8),
                                                                                       (1536, 32, 16)]
    times = [s["step_seconds"] for s in stages]
    assert times[0] < times[1] < times[2] and stages[2]["step_seconds"] == pytest.approx(plan.estimate.step_seconds)
