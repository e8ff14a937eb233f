"""DeepSpeed: the seeds' JSON configs with "auto" values, and the seed's accelerate launch flow, on 2 CPU ranks."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import EXAMPLES, assert_layout_answers, eval_losses, read_metrics, train_losses
from launch import BIN, pretrainer, run, run_ok
from multi_run import launch_cases
from pretrainer import ConfigError, PreTrainingArguments
from pretrainer.parallel.deepspeed_config import fill_deepspeed_config, load_deepspeed_config, validate_deepspeed_config

SEED_JSON = EXAMPLES / "deepspeed"


def args(**overrides) -> PreTrainingArguments:
    values = dict(num_training_steps=100, micro_batch_size=2, dp=2, gradient_accumulation_steps=4, dtype="bf16",
                  lr=2e-4, adam_beta2=0.98, adam_eps=1e-6, weight_decay=0.05, warmup_steps=10, clip_grad=0.5)
    return PreTrainingArguments(**{**values, **overrides})


def test_seed_zero3_json_every_auto_is_filled_from_the_pretraining_config():
    config, filled = fill_deepspeed_config(load_deepspeed_config(SEED_JSON / "ds_config_zero3.json"), args(),
                                           world_size=2, hidden_size=256)
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["gradient_accumulation_steps"] == 4
    assert config["train_batch_size"] == 16 and config["gradient_clipping"] == 0.5
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
    assert "fp16_opt_level" not in config["fp16"]  # apex-era key that DeepSpeed now rejects
    assert config["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.05}
    assert config["scheduler"]["params"] == {"last_batch_iteration": -1, "total_num_steps": 100, "warmup_min_lr": 0.0,
                                             "warmup_max_lr": 2e-4, "warmup_num_steps": 10}
    zero = config["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (65536, 58982, 2560)
    assert "optimizer.params.lr" in filled and "zero_optimization.reduce_bucket_size" in filled


def test_the_banner_names_only_the_offloads_the_stage_runs():
    from pretrainer.parallel.deepspeed_config import DeepSpeedSettings

    seed_zero2 = DeepSpeedSettings(load_deepspeed_config(SEED_JSON / "ds_config_zero2.json"))
    assert seed_zero2.describe() == "zero_stage=2 offload=offload_optimizer (offload_param ignored below stage 3)"
    everything = DeepSpeedSettings.for_zero(3, True, True)
    assert everything.describe() == "zero_stage=3 offload=offload_optimizer,offload_param"
    assert DeepSpeedSettings.for_zero(1).describe() == "zero_stage=1 offload=none"


def test_commented_json_as_printed_in_the_seed_is_read(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{\n  "zero_optimization": {"stage": 2}, // zero\n  "url": "http://x//y"\n}\n')
    assert load_deepspeed_config(path) == {"zero_optimization": {"stage": 2}, "url": "http://x//y"}


def test_conflicts_and_unfillable_autos_are_errors():
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=8 but the pretraining config gives 4"):
        fill_deepspeed_config({"gradient_accumulation_steps": 8}, args(), 2, 256)
    with pytest.raises(ConfigError, match="sets bf16.enabled=True but the pretraining config gives False"):
        fill_deepspeed_config({"bf16": {"enabled": True}}, args(dtype="fp32"), 2, 256)
    with pytest.raises(ConfigError, match='cannot fill "auto" for zero_optimization.sub_group_size'):
        fill_deepspeed_config({"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}, args(), 2, 256)


SEED_JSONS = ["ds_config_zero2.json", "ds_config_zero3.json"]
# Scheduler blocks with every parameter "auto", one per scheduler type a DeepSpeed JSON may name.
SCHEDULER_PARAMS = {
    "WarmupLR": ["warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"],
    "WarmupDecayLR": ["warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"],
    "WarmupCosineLR": ["total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"],
    "OneCycle": ["cycle_min_lr", "cycle_max_lr", "cycle_first_step_size", "cycle_second_step_size",
                 "decay_lr_rate", "decay_step_size", "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"],
    "LRRangeTest": ["lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                    "lr_range_test_staircase"],
}


def scheduler_json(kind: str) -> dict:
    return {"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
            "scheduler": {"type": kind, "params": dict.fromkeys(SCHEDULER_PARAMS[kind], "auto")}}


def test_deepspeed_json_is_checked_with_deepspeeds_own_models_and_names():
    def check(config: dict) -> None:
        validate_deepspeed_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, **config},
                                  "key 'deepspeed'")

    check({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}, "scheduler": scheduler_json("OneCycle")
           ["scheduler"], "optimizer": {"type": "AdamW"}})  # "auto" left for DeepSpeed's defaults: accepted
    with pytest.raises(ConfigError, match=r"key 'deepspeed': zero_optimization\.stage=7: Input should be 0, 1"):
        check({"zero_optimization": {"stage": 7}})
    with pytest.raises(ConfigError, match=r"bf16\.enabled='maybe': Input should be a valid boolean"):
        check({"bf16": {"enabled": "maybe"}})
    with pytest.raises(ConfigError, match=r"scheduler\.params\.warmup_num_step: not a parameter of WarmupDecayLR"):
        check({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_step": 3}}})
    with pytest.raises(ConfigError, match=r"scheduler\.type='Cosine': not a DeepSpeed scheduler"):
        check({"scheduler": {"type": "Cosine"}})
    with pytest.raises(ConfigError, match=r"optimizer\.type='Adamz': not an optimizer DeepSpeed knows"):
        check({"optimizer": {"type": "Adamz"}})


@pytest.fixture(scope="module")
def deepspeed_runs(tiny_model, small_corpus, tmp_path_factory):
    """One 2-rank job (tests/multi_run.py): each seed JSON with warmup 2 (straight, then stopped at step 3 and
    resumed) and with no warmup; every scheduler type with all-"auto" parameters, warmup 2 and none."""
    root = tmp_path_factory.mktemp("deepspeed")
    base = {"num_training_steps": 6, "micro_batch_size": 2, "dp": 2, "gradient_accumulation_steps": 2,
            "seq_length": 32, "dtype": "fp32", "model_path": str(tiny_model), "train_data": str(small_corpus),
            "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2, "eval_interval": 3, "eval_iters": 2, "save_interval": 3,
            "seed": 7, "write_report": False}
    cases = []
    for seed_json in SEED_JSONS:
        config = {"deepspeed": str(SEED_JSON / seed_json)}
        cases += [{"name": f"{seed_json}-straight", "config": {**config, "save_dir": str(root / seed_json)}},
                  {"name": f"{seed_json}-exit", "config": {**config, "exit_interval": 3,
                                                             "save_dir": str(root / f"{seed_json}-resumed")}},
                  {"name": f"{seed_json}-rerun", "config": {**config, "save_dir": str(root / f"{seed_json}-resumed")}},
                  {"name": f"{seed_json}-no-warmup", "config": {**config, "warmup_steps": 0, "export_hf": False,
                                                                  "save_dir": str(root / f"{seed_json}-no-warmup")}}]
    for kind in SCHEDULER_PARAMS:
        for warmup in (2, 0):
            cases.append({"name": f"{kind}-warmup{warmup}", "config": {
                "deepspeed": scheduler_json(kind), "warmup_steps": warmup, "export_hf": False, "save_interval": 0,
                "eval_interval": 0, "save_dir": str(root / f"{kind}-warmup{warmup}")}})
    done = launch_cases(base, cases, 2, root)
    return root, base, done.stdout + done.stderr


@pytest.mark.parametrize("seed_json", SEED_JSONS)
def test_seed_json_trains_resumes_and_exports_on_two_ranks(deepspeed_runs, seed_json):
    """The seed's own JSONs, unchanged: DeepSpeed's AdamW (CPU Adam under ZeRO-2 offload) and WarmupDecayLR."""
    root, _, output = deepspeed_runs
    assert "DeepSpeed config: filled" in output and "zero_stage=" in output
    assert "is deprecated" not in output  # torch's warnings for the collective names ZeRO calls, per bucket
    straight, resumed = root / seed_json, root / f"{seed_json}-resumed"
    losses = train_losses(straight)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(v) for v in losses.values())
    assert train_losses(resumed) == losses and eval_losses(resumed) == eval_losses(straight)
    assert_layout_answers(straight, 2)  # ZeRO's partitions and buffers as the planner counts them
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(straight / "hf")  # ZeRO-3 shards gathered, not size 0
    assert all(p.numel() > 0 for p in model.parameters())
    assert model.lm_head.weight.shape == (4096, 64)


def deepspeed_schedule(scheduler: dict, lr: float, beta1: float, steps: int) -> list[float]:
    """The learning rate of each update under DeepSpeed's own scheduler class with these parameters."""
    from deepspeed.runtime import lr_schedules

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr, betas=(beta1, 0.95))
    schedule = getattr(lr_schedules, scheduler["type"])(optimizer, **scheduler["params"])
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        schedule.step()
    return lrs


RUNS = [(seed_json, f"{seed_json}{suffix}", warmup) for seed_json in SEED_JSONS
        for suffix, warmup in (("", 2), ("-no-warmup", 0))] + \
       [(kind, f"{kind}-warmup{warmup}", warmup) for kind in SCHEDULER_PARAMS for warmup in (2, 0)]


@pytest.mark.parametrize("source,run_name,warmup", RUNS, ids=[name for _, name, _ in RUNS])
def test_logged_learning_rate_is_the_json_schedulers_with_the_filled_values(deepspeed_runs, source, run_name,
                                                                             warmup):
    """Every step's logged lr is the one it used, and equals DeepSpeed's own formula for the JSON's scheduler
    (which wins over lr_decay_style) with the filled values; no warmup means the first update is at the peak."""
    root, base, _ = deepspeed_runs
    raw = load_deepspeed_config(SEED_JSON / source) if source.endswith(".json") else scheduler_json(source)
    run_args = PreTrainingArguments(**{**base, "warmup_steps": warmup})
    filled, _ = fill_deepspeed_config(raw, run_args, world_size=2, hidden_size=64)
    logged = [row["lr"] for row in read_metrics(root / run_name) if "loss" in row]
    expected = deepspeed_schedule(filled["scheduler"], run_args.lr, run_args.adam_beta1, len(logged))
    assert len(logged) == 6 and logged == pytest.approx(expected, rel=1e-6)
    kind = filled["scheduler"]["type"]
    if warmup == 0 and kind.startswith("Warmup"):
        assert logged[0] == pytest.approx(run_args.lr if kind != "WarmupCosineLR" else 0.0)
    if warmup and kind.startswith("Warmup"):
        assert logged[0] < logged[warmup]


def test_bad_deepspeed_json_and_unwritable_save_dir_are_one_line_errors(base_config, tmp_path):
    import yaml

    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 7, "offload_optimizer": {"device": "gpu"}}}')
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**base_config, "deepspeed": str(bad)}))
    done = run(pretrainer("train", config))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    message = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(message) == 1 and f"key 'deepspeed' ({bad})" in message[0]
    assert "zero_optimization.stage=7: Input should be 0, 1, 2" in message[0]
    assert "zero_optimization.offload_optimizer.device='gpu': Input should be 'none', 'cpu' or 'nvme'" in message[0]
    done = run(pretrainer("train", config, "deepspeed=null", "save_dir=/proc/nope/run"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "key 'save_dir': /proc/nope/run cannot be created or written (No such file or directory)" in done.stderr


def test_seed_accelerate_deepspeed_flow_on_two_cpu_processes(tmp_path):
    """accelerate launch --config_file <seed accelerate DeepSpeed config> <seed-style script> --pretrain_config_file
    <seed llama2-deepspeed.yaml>: two processes, ZeRO-2, the accelerate config's accumulation and clipping."""
    save_dir = tmp_path / "run"
    command = [BIN / "accelerate", "launch", "--config_file",
               EXAMPLES / "accelerate" / "accelerate_deepspeed_config.yaml", EXAMPLES / "train.py",
               "--pretrain_config_file", EXAMPLES / "seed_configs" / "llama2-deepspeed.yaml",
               "dp=2", "seq_length=64", "num_training_steps=3", "dtype=fp32", f"save_dir={save_dir}"]
    done = run_ok(command, timeout=400)
    assert "engine=deepspeed world_size=2" in done.stdout and "zero_stage=2" in done.stdout
    assert sorted(train_losses(save_dir)) == [1, 2, 3]
    assert (save_dir / "hf" / "model.safetensors").is_file()
    # The accelerate config says gradient_accumulation_steps: 8; a YAML that disagrees is refused.
    done = run(command[:-1] + ["gradient_accumulation_steps=4", f"save_dir={tmp_path / 'conflict'}"], timeout=400)
    assert done.returncode != 0
    assert "gradient_accumulation_steps=8 but the pretraining config gives 4" in done.stderr


def test_deepspeed_launcher_runs_the_cli(base_config, tmp_path):
    """`deepspeed --num_accelerators 2 pretrainer train ...` (the launcher passes --local_rank=N)."""
    import yaml

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**base_config, "dp": 2, "num_training_steps": 2, "warmup_steps": 1,
                                      "deepspeed": {"zero_optimization": {"stage": 1}}, "eval_interval": 0,
                                      "save_dir": str(tmp_path / "run")}))
    done = run_ok([BIN / "deepspeed", "--num_accelerators", "2", *pretrainer("train", config)], timeout=400)
    assert "engine=deepspeed world_size=2" in done.stdout + done.stderr
    assert sorted(train_losses(tmp_path / "run")) == [1, 2]


def test_py_cpuinfo_is_asked_once_a_process():
    """DeepSpeed's CPU ops ask py-cpuinfo for the CPU's flags again and again, and each answer costs a Python
    process; the engine keeps the first answer (DeepSpeedEngine.setup)."""
    import cpuinfo

    from pretrainer.parallel.deepspeed import ask_cpuinfo_once

    ask_cpuinfo_once()
    ask_cpuinfo_once()  # a second engine in the same process does not wrap it again
    first = cpuinfo.get_cpu_info()
    assert cpuinfo.get_cpu_info() is first and "flags" in first
    assert cpuinfo.get_cpu_info.cache_info().misses == 1 and not hasattr(cpuinfo.get_cpu_info.__wrapped__,
                                                                         "cache_info")
