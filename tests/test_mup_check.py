"""`pretrainer mup-check`: the quickstart's tiny Llama at widths 64 to 512 under the standard parametrization, its
JSON record and page, and the bad inputs' one-line errors."""

from __future__ import annotations

import json
import math
import re

import pytest

from helpers import write_tiny_moe
from launch import cli_in_process, pretrainer, run_ok

QUICKSTART = "examples/quickstart.yaml"
FAST = ["micro_batch_size=4", "seq_length=64", "warmup_steps=0"]
KINDS = ["embedding", "attention", "mlp", "logits"]


def test_sp_logits_grow_with_width_on_the_tiny_llama(tmp_path):
    page = tmp_path / "page.html"
    done = run_ok(pretrainer("mup-check", QUICKSTART, "--widths", "64,128,256,512", "--output", page, *FAST),
                  timeout=240)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("mean |activation| at step 10 (parametrization sp"), done.stdout
    assert lines[1].split() == ["module", "width", "64", "width", "128", "width", "256", "width", "512", "spread"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:6]}
    assert list(rows) == KINDS
    logits = [float(value) for value in rows["logits"][:4]]
    assert logits == sorted(logits), logits
    grown = re.search(r"logits grow with width \((\d+\.\d)x from 64 to 512\)", done.stdout)
    assert grown and float(grown.group(1)) > 1.5, done.stdout
    assert "embedding grow" not in done.stdout  # the embedding's output does not depend on the width
    assert f"page: {page}" in done.stdout and page.read_text().count("<svg") == 4
    for width in (64, 128, 256, 512):
        assert f"mup-check: width {width} (" in done.stderr


def test_under_mup_no_module_grows_with_width(tmp_path):
    """The issue's check: at widths 64 to 512 (4 layers), after 10 steps, every module's mean |activation| varies at
    most 1.5x across the widths under `parametrization: mup` (the standard one's logits vary 6.8x, above)."""
    done = run_ok(pretrainer("mup-check", QUICKSTART, "--widths", "64,128,256,512", "--json", *FAST,
                             "parametrization=mup", "mup_base_hidden_size=64", f"save_dir={tmp_path}"), timeout=240)
    record = json.loads(done.stdout)
    assert record["parametrization"] == "mup"
    last = {run["model"]["hidden_size"]: run["steps"][-1] for run in record["runs"]}
    for kind in KINDS:
        values = [last[width][kind] for width in (64, 128, 256, 512)]
        assert max(values) / min(values) <= 1.5, (kind, values)


def test_json_record_has_every_width_step_and_module(tmp_path):
    done = run_ok(pretrainer("mup-check", QUICKSTART, "--widths", "128,64", "--steps", "2", "--json",
                             f"save_dir={tmp_path}", *FAST), timeout=180)
    record = json.loads(done.stdout)
    assert record["widths"] == [64, 128] and record["modules"] == KINDS and record["parametrization"] == "sp"
    shapes = [run["model"] for run in record["runs"]]
    assert [(s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"],
             s["intermediate_size"]) for s in shapes] == [(64, 1, 1, 64, 176), (128, 2, 1, 64, 344)]
    for run in record["runs"]:
        assert [step["step"] for step in run["steps"]] == [1, 2]
        for step in run["steps"]:
            assert all(math.isfinite(step[kind]) and step[kind] > 0 for kind in KINDS), step
    assert record["page"] == str(tmp_path / "mup-check.html") and "<svg" in (tmp_path / "mup-check.html").read_text()


@pytest.mark.parametrize("flags, message", [
    (["--widths", "64,abc"], "pretrainer: error: --widths 64,abc: expected whole numbers separated by commas"),
    (["--widths", "64"], "pretrainer: error: --widths 64: give at least two different widths to compare"),
    (["--widths", "64,100"], "pretrainer: error: --widths: width 100 is not a multiple of head_dim 64"),
    (["--widths", "64,128", "--steps", "0"], "argument --steps: expected an integer >= 1, got '0'"),
])
def test_bad_arguments_are_one_line(capsys, tmp_path, flags, message):
    code, stderr = cli_in_process(capsys, "mup-check", QUICKSTART, *flags, "--output", tmp_path / "p.html")
    assert code == 2 and stderr.strip().splitlines() == [stderr.strip()] and message in stderr, stderr
    assert not (tmp_path / "p.html").exists()


def test_a_model_without_the_hooked_modules_is_named(capsys, tmp_path):
    model = write_tiny_moe(tmp_path / "mixtral", "mixtral")  # experts instead of mlp.down_proj
    code, stderr = cli_in_process(capsys, "mup-check", QUICKSTART, "--widths", "32,64", "--steps", "1",
                                  "--output", tmp_path / "p.html", f"model_path={model}", *FAST)
    assert code == 2 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1].startswith("pretrainer: error: mup-check: the model "
                                                      "(MixtralForCausalLM) has no module named *mlp.down_proj")


def test_widths_keep_head_dim_and_the_key_value_ratio():
    from pretrainer import ConfigError
    from pretrainer.train.mup_check import width_config

    config = {"hidden_size": 768, "num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 2048}
    wide = width_config(config, 1536, "config.json")
    assert (wide["head_dim"], wide["num_attention_heads"], wide["num_key_value_heads"],
            wide["intermediate_size"]) == (64, 24, 8, 4096)
    assert width_config(config, 64, "config.json")["num_key_value_heads"] == 1
    with pytest.raises(ConfigError, match="width 320 has 5 heads, which 3 key-value heads"):
        width_config({**config, "num_key_value_heads": 8}, 320, "config.json")  # 5 heads x 8/12 -> 3


def test_log_log_chart_has_round_ticks_on_both_axes():
    from pretrainer.train.svg_plot import line_chart

    svg = line_chart("logits", "mean |activation|", [("step 1", [(64, 0.13), (128, 0.18), (512, 0.36)])],
                     xlabel="width", log=True)
    labels = re.findall(r'text-anchor="(?:middle|end)">([^<]+)</text>', svg)
    assert {"50", "100", "200", "500", "1,000"} <= set(labels) and {"0.1", "0.2", "0.5"} <= set(labels), labels
    assert svg.count("<circle") == 3


def test_a_config_at_its_own_width_is_unchanged_also_with_a_decoupled_head_dim():
    from pretrainer import ConfigError
    from pretrainer.train.mup_check import width_config

    config = {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
              "intermediate_size": 3072, "num_hidden_layers": 28}
    assert width_config(config, 1024, "config.json") == config
    assert width_config(config, 256, "config.json")["num_attention_heads"] == 4
    with pytest.raises(ConfigError, match=r"width 96 is not a multiple of 64 \(hidden_size / num_attention_heads; "
                                          "head_dim 128 is kept\\)"):
        width_config(config, 96, "config.json")
