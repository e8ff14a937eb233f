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


def test_a_rank_that_aborts_ends_the_failure_message_with_its_native_and_python_stacks():
    """What a multi_run rank installs (report_native_faults) prints the aborting thread's native stack and every
    thread's Python stack, and describe() puts those lines last, where a log read from its tail keeps them."""
    import sys

    from launch import REPO, describe, run

    done = run([sys.executable, "-c", "import os, sys; sys.path.insert(0, 'tests'); import multi_run; "
                "multi_run.report_native_faults(); os.abort()"], cwd=REPO, timeout=120)
    assert done.returncode != 0
    faults = describe(done).split("--- native faults ---", 1)[1]
    assert "SIGABRT(6), PID" in faults and "Fatal Python error: Aborted" in faults, faults
    assert "--- stdout" not in faults and "--- stderr" not in faults  # the last section
