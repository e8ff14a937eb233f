"""A resume or a cooldown branch that would change what its checkpoint's state means is refused before anything is
built, in one line naming each change (train/resume_keys.py): the schedule, the lineage of a branch, the MTP
depths; an `override_*` key accepts the change where one exists. The mixture's case is in test_mixture.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import read_metrics
from pretrainer import ConfigError, PreTrainer, PreTrainingArguments
from pretrainer.train.resume_keys import RECORD


def run(config: dict) -> None:
    with PreTrainer(PreTrainingArguments(**config)) as trainer:
        trainer.train()


def wsd(base_config, save_dir: Path, **extra) -> dict:
    return {**base_config, "lr_decay_style": "wsd", "wsd_decay_fraction": 0.5, "save_interval": 2, "eval_interval": 0,
            "export_hf": False, "save_dir": str(save_dir), **extra}


@pytest.fixture
def parent(base_config, tmp_path) -> dict:
    """A finished 6-step WSD run with checkpoints at steps 2, 4 and 6."""
    config = wsd(base_config, tmp_path / "parent")
    run(config)
    return config


def branch(parent: dict, **extra) -> dict:
    return {**parent, "cooldown_from": f"{parent['save_dir']}/checkpoints/step-2", "cooldown_tokens": 256, **extra}


def test_a_branch_with_another_peak_lr_is_refused_before_anything_is_built_unless_overridden(parent, pretrainer_log):
    with pytest.raises(ConfigError, match=r"^the cooldown branch from .*step-2 would change the run's state: lr 0\.001 "
                                          r"-> 0\.005 \(the lr would jump at this step; set override_schedule: true "
                                          r"to accept\)\. Keep the parent's values"):
        PreTrainer(PreTrainingArguments(**branch(parent, lr=5e-3)))
    assert "building" not in pretrainer_log.take()  # refused before the model
    run(branch(parent, lr=5e-3, override_schedule=True))
    rows = [r for r in read_metrics(Path(parent["save_dir"]) / "branches" / "cooldown-step-2-256") if "lr" in r]
    assert rows[0]["lr"] == pytest.approx(5e-3 / 2, rel=1e-6)  # linear over 2 steps from the new peak, as asked for


def test_a_branch_pointed_at_another_run_s_checkpoints_is_refused_naming_its_parent(parent, base_config, tmp_path):
    other = wsd(base_config, tmp_path / "other", seed=3)
    run({**other, "num_training_steps": 2})
    parent_run = Path(parent["save_dir"]).resolve()
    expected = (rf"^resuming from .*other/checkpoints/step-2: the checkpoint belongs to a run that is no cooldown "
                rf"branch, not to this cooldown branch of {parent_run}@step-2; give a branch a save_dir of its own")
    for where in ({"resume": f"{other['save_dir']}/checkpoints/step-2"}, {"save_dir": other["save_dir"]}):
        with pytest.raises(ConfigError, match=expected):
            PreTrainer(PreTrainingArguments(**branch(parent, **where)))
    # the branch's own checkpoints resume it, whatever the spelling of its parent's folder
    config = branch(parent, exit_interval=1)
    run(config)
    relative = {**config, "exit_interval": None,
                "cooldown_from": str(Path(parent["save_dir"]) / ".." / "parent" / "checkpoints" / "step-2")}
    run(relative)
    branch_dir = Path(parent["save_dir"]) / "branches" / "cooldown-step-2-256"
    assert [r["step"] for r in read_metrics(branch_dir) if r.get("event") == "resume"] == [3]
    saved = json.loads((branch_dir / "checkpoints" / "step-4" / "trainer_state.json").read_text())[RECORD]
    assert saved["lineage"]["branch_of"] == f"{parent_run}@step-2"


def test_mtp_depths_removed_need_override_mtp_and_added_ones_are_refused(base_config, tmp_path):
    config = {**base_config, "mtp_num_layers": 2, "export_hf": False, "exit_interval": 3}
    run(config)
    with pytest.raises(ConfigError, match=r"mtp_num_layers 2 -> 1 \(a trained prediction depth's weights would be "
                                          r"dropped; set override_mtp: true to accept\)"):
        PreTrainer(PreTrainingArguments(**{**config, "mtp_num_layers": 1}))
    with pytest.raises(ConfigError, match=r"mtp_num_layers 2 -> 3: the checkpoint holds no weights for the added "
                                          r"depths; resume with mtp_num_layers: 2"):
        PreTrainer(PreTrainingArguments(**{**config, "mtp_num_layers": 3, "override_mtp": True}))
    run({**config, "mtp_num_layers": 1, "override_mtp": True, "exit_interval": None})
    rows = [r for r in read_metrics(config["save_dir"]) if "mtp_loss/1" in r]
    assert rows[-1]["step"] == 6 and "mtp_loss/2" not in rows[-1]


def test_every_change_is_named_in_one_line_and_a_checkpoint_without_the_record_is_checked_on_its_schedule(
        base_config):
    config = {**base_config, "export_hf": False, "exit_interval": 3}
    run(config)
    changed = {**config, "lr": 2e-3, "mtp_num_layers": 1}
    with pytest.raises(ConfigError) as refused:
        PreTrainer(PreTrainingArguments(**changed))
    message = str(refused.value)
    assert "\n" not in message
    assert "lr 0.001 -> 0.002 (the lr would jump" in message and "mtp_num_layers 0 -> 1: the checkpoint" in message
    state_file = Path(config["save_dir"]) / "checkpoints" / "step-3" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["schedule"] = state.pop(RECORD)["schedule"]  # as a checkpoint written before the other groups were kept
    state_file.write_text(json.dumps(state))
    with pytest.raises(ConfigError, match=r"lr 0\.001 -> 0\.002 .*set override_schedule") as refused:
        PreTrainer(PreTrainingArguments(**changed))
    assert "mtp" not in str(refused.value)  # not recorded there: not compared
    state["run_keys"] = "garbage"  # a hand-edited file
    state_file.write_text(json.dumps(state))
    with pytest.raises(ConfigError, match=r"step-3: its trainer_state\.json holds no readable 'run_keys'"):
        PreTrainer(PreTrainingArguments(**changed))
