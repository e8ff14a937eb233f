"""The test launch helpers themselves: a failing case of a multi-case torchrun job is named."""

from __future__ import annotations

import pytest

from multi_run import launch_cases


def test_a_failing_multi_run_case_is_named(base_config, tmp_path):
    cases = [{"name": "fine", "config": {"num_training_steps": 1, "warmup_steps": 0, "eval_interval": 0,
                                         "save_dir": None}},
             {"name": "misspelt", "config": {"num_training_step": 1}}]
    with pytest.raises(AssertionError, match=r"failed case\(s\): misspelt \(rank 0\)") as failure:
        launch_cases(base_config, cases, nproc=1, folder=tmp_path)
    assert "unknown key 'num_training_step'" in str(failure.value)
