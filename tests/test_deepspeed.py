"""DeepSpeed: the seeds' JSON configs with "auto" values, and the seed's accelerate launch flow, on 2 CPU ranks."""

from __future__ import annotations

import math

import pytest

from helpers import EXAMPLES, eval_losses, train_losses
from launch import BIN, pretrainer, run, run_ok, torchrun
from pretrainer import ConfigError, PreTrainingArguments
from pretrainer.parallel.deepspeed_config import fill_deepspeed_config, load_deepspeed_config

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


@pytest.mark.parametrize("seed_json", ["ds_config_zero2.json", "ds_config_zero3.json"])
def test_seed_json_trains_resumes_and_exports_on_two_ranks(base_config, tmp_path, seed_json):
    """The seed's own JSONs, unchanged: DeepSpeed's AdamW (CPU Adam under ZeRO-2 offload) and WarmupDecayLR."""
    import yaml

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**base_config, "dp": 2, "deepspeed": str(SEED_JSON / seed_json)}))
    train = torchrun(2, *pretrainer("train", config))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    done = run_ok(train + [f"save_dir={straight}"], timeout=400)
    assert "DeepSpeed config: filled" in done.stdout and "zero_stage=" in done.stdout
    losses = train_losses(straight)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(v) for v in losses.values())
    for command in (train + [f"save_dir={resumed}", "exit_interval=3"], train + [f"save_dir={resumed}"]):
        run_ok(command, timeout=400)
    assert train_losses(resumed) == losses and eval_losses(resumed) == eval_losses(straight)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(straight / "hf")  # ZeRO-3 shards gathered, not size 0
    assert all(p.numel() > 0 for p in model.parameters())
    assert model.lm_head.weight.shape == (4096, 64)


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
