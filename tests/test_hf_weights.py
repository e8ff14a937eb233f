"""Loading an HF checkpoint in slices (models/hf_weights.py): each rank of fsdp and of the megatron engine's
tp/pp reads only what it owns, with the same losses and export as loading the whole model on every rank;
bad checkpoints are clear errors."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch
import yaml

from helpers import cpu_engine, read_metrics, write_tiny_model
from launch import BIN, run_ok, torchrun
from multi_run import launch_cases
from pretrainer import ConfigError, PreTrainingArguments
from pretrainer.models import build_model, materialize, pending_checkpoint, preflight

LAYOUTS = {  # name -> (config keys, model folder)
    "fsdp": ({"engine": "fsdp", "dp": 2}, "untied"),
    "fsdp-full-recompute-tied": ({"engine": "fsdp", "dp": 2, "activation_checkpointing": "full"}, "tied"),
    "tp2-tied": ({"engine": "megatron", "plugin_args": {"tp_degree": 2, "sequence_parallelism": True}}, "tied"),
    "pp2": ({"engine": "megatron", "plugin_args": {"pp_degree": 2}}, "untied"),
    # ZeRO-3: built module by module, each partitioned at once (rank 0's values are kept: every rank reads all)
    "zero3-bf16-tied": ({"deepspeed": "{root}/zero3.json", "dp": 2, "dtype": "bf16"}, "tied"),
}


def write_checkpoint(folder: Path, **overrides) -> Path:
    """A tiny Llama's random weights in bf16, as three safetensors shards with the index json."""
    from transformers import AutoConfig, AutoModelForCausalLM

    write_tiny_model(folder, num_hidden_layers=4, **overrides)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="300KB")
    assert len(list(folder.glob("*.safetensors"))) >= 2
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf-weights")
    write_checkpoint(root / "untied")
    write_checkpoint(root / "tied", tie_word_embeddings=True)
    (root / "zero3.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    return root


def stored_bytes(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            total += sum(torch.Size(handle.get_slice(n).get_shape()).numel() * 2 for n in handle.keys())  # bf16
    return total


def test_two_ranks_read_only_their_slices_with_the_losses_and_export_of_a_whole_load(checkpoints, small_corpus,
                                                                                      tmp_path):
    base = {"num_training_steps": 3, "micro_batch_size": 2, "dp": 1, "gradient_accumulation_steps": 2,
            "seq_length": 32, "dtype": "fp32", "train_data": str(small_corpus), "lr": 1e-3, "warmup_steps": 1,
            "eval_interval": None, "save_interval": None, "seed": 7, "write_report": False, "adam_eps": 1e-6,
            "export_max_shard_size": "300KB"}
    cases = [{"name": f"{name}-{mode}",
              "config": {**{k: v.format(root=checkpoints) if isinstance(v, str) else v for k, v in keys.items()},
                         "model_path": str(checkpoints / folder), "save_dir": str(tmp_path / f"{name}-{mode}"),
                         "sliced_weight_loading": mode == "sliced"}}
             for name, (keys, folder) in LAYOUTS.items() for mode in ("sliced", "whole")]
    done = launch_cases(base, cases, 2, tmp_path)
    assert "weights read: rank 0" in done.stdout + done.stderr
    for name, (_, folder) in LAYOUTS.items():
        sliced, whole = (read_metrics(tmp_path / f"{name}-{mode}") for mode in ("sliced", "whole"))
        losses = [[r["loss"] for r in rows if "loss" in r and "event" not in r] for rows in (sliced, whole)]
        assert losses[0] == losses[1] and len(losses[0]) == 3, name
        start = next(r for r in sliced if r.get("event") == "start")
        read = start["weights_read_bytes"]
        assert 0 < start["weights_loaded_peak_rss_mb"] <= start["model_ready_peak_rss_mb"]
        total = stored_bytes(checkpoints / folder)
        # each rank reads about half: everything is split except norms (replicated under tp) and, under pp,
        # the layers are split but not evenly in bytes (the head and the embedding sit on different stages)
        if name.startswith("zero3"):
            assert read == [total, total], (name, read, total)
        else:
            assert all(0.3 * total < r < 0.7 * total for r in read), (name, read, total)
        if name.startswith("fsdp"):  # every tensor is sharded on its first dimension: nothing is read twice
            assert sum(read) == total, (name, read, total)
        assert "weights_read_bytes" not in next(r for r in whole if r.get("event") == "start")
        exported = [tmp_path / f"{name}-{mode}" / "hf" for mode in ("sliced", "whole")]
        names = sorted(p.name for p in exported[0].iterdir())
        assert names == sorted(p.name for p in exported[1].iterdir())
        assert all(filecmp.cmp(exported[0] / n, exported[1] / n, shallow=False) for n in names), name
        assert len(list(exported[0].glob("*.safetensors"))) >= 2, name  # streamed into several files
        resaved = resave(exported[0], tmp_path / f"{name}-resaved")
        assert all(filecmp.cmp(exported[0] / n, resaved / n, shallow=False) for n in weight_files(resaved)), name

    # `pretrainer export` of the pipeline run's checkpoint, on 2 ranks, streams the same files as the run's end
    case = next(c for c in cases if c["name"] == "pp2-sliced")
    config = tmp_path / "pp2.yaml"
    config.write_text(yaml.safe_dump({**base, **case["config"]}))
    run_ok(torchrun(2, BIN / "pretrainer", "export", config, "--output", tmp_path / "pp2-exported"))
    names = sorted(p.name for p in (tmp_path / "pp2-sliced" / "hf").iterdir())
    assert all(filecmp.cmp(tmp_path / "pp2-sliced" / "hf" / n, tmp_path / "pp2-exported" / n, shallow=False)
               for n in names)


def weight_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("model"))


def resave(folder: Path, target: Path) -> Path:
    """What `save_pretrained` writes for the model in `folder` (same shard size): the streamed export's files
    must be the same bytes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")  # in the dtype its config records
    model.save_pretrained(target, max_shard_size="300KB")
    return target


def test_the_streamed_export_writes_what_save_pretrained_writes(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    from pretrainer.train.export import export_hf

    for folder in ("untied", "tied"):
        model = AutoModelForCausalLM.from_pretrained(checkpoints / folder, dtype=torch.float32)
        with cpu_engine() as engine:
            ours = export_hf(engine, model, None, tmp_path / f"ours-{folder}", "bf16", "300KB")
        model.config.use_cache = True
        theirs = tmp_path / f"theirs-{folder}"
        model.to(torch.bfloat16).save_pretrained(theirs, max_shard_size="300KB")
        names = sorted(p.name for p in theirs.iterdir())
        assert names == sorted(p.name for p in ours.iterdir()) and "model.safetensors.index.json" in names
        assert all(filecmp.cmp(ours / n, theirs / n, shallow=False) for n in names), folder


def laid_out(folder: Path, tmp_path: Path) -> torch.nn.Module:
    """The model `folder` gives, built for an engine that reads slices, materialised on one process."""
    args = PreTrainingArguments.from_dict({"model_path": str(folder), "seq_length": 32, "dtype": "fp32",
                                           "num_training_steps": 1, "micro_batch_size": 1, "dp": 1})
    model = build_model(args, preflight(args), read_slices=True)
    assert pending_checkpoint(model) is not None
    materialize(model, torch.device("cpu"), seed=1)
    return model


def test_a_model_filled_from_the_files_equals_from_pretrained(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    for folder in ("untied", "tied"):
        filled = laid_out(checkpoints / folder, tmp_path)
        loaded = AutoModelForCausalLM.from_pretrained(checkpoints / folder, dtype=torch.float32)
        theirs = dict(loaded.state_dict())
        ours = dict(filled.state_dict())
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), folder
        buffers = dict(loaded.named_buffers())
        assert all(torch.equal(b, buffers[n]) for n, b in filled.named_buffers())  # RoPE's inv_freq
        if folder == "tied":
            assert filled.lm_head.weight is filled.model.embed_tokens.weight


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_an_moe_checkpoint_of_per_expert_tensors_fills_its_stacked_experts(tmp_path, family):
    """Hub MoE files hold one matrix per expert (Mixtral's w1/w3/w2, Qwen's gate/up/down_proj); the model stacks
    them (gate and up concatenated). Filled from the files they equal from_pretrained, saved buffers included
    (DeepSeek-V3's e_score_correction_bias), and saving writes the same tensors back."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from helpers import write_tiny_moe

    folder = write_tiny_moe(tmp_path / family, family)
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    with torch.no_grad():
        for buffer in source.buffers():
            if buffer.is_floating_point() and buffer.dim() == 1 and buffer.numel() == 8:  # the routing bias
                buffer.uniform_(-1, 1)
    source.save_pretrained(folder)
    files = load_file(folder / "model.safetensors")
    assert any(".experts.0." in key for key in files)  # per expert in the files
    filled = laid_out(folder, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ours, theirs = filled.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
    filled.save_pretrained(tmp_path / "again")
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert again.keys() == files.keys() and all(torch.equal(again[k], files[k]) for k in files)


def rewrite_without(folder: Path, target: Path, drop: str) -> Path:
    """A copy of `folder` whose shard holding `drop` no longer has it (the index still lists it)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, target)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    file = target / index["weight_map"][drop]
    tensors = load_file(str(file))
    del tensors[drop]
    save_file(tensors, str(file), metadata={"format": "pt"})
    return target


def test_a_missing_tensor_names_the_tensor(checkpoints, tmp_path):
    folder = rewrite_without(checkpoints / "untied", tmp_path / "damaged", "model.layers.2.mlp.up_proj.weight")
    with pytest.raises(ConfigError, match=r"tensor 'model\.layers\.2\.mlp\.up_proj\.weight' is missing"):
        laid_out(folder, tmp_path)


def test_shapes_that_do_not_match_the_config_name_the_tensor_and_file(checkpoints, tmp_path):
    import shutil

    folder = tmp_path / "other-config"
    shutil.copytree(checkpoints / "untied", folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' in "
                                          r"model-0000\d-of-0000\d\.safetensors has shape \[128, 64\]; the config "
                                          r"gives \[96, 64\].*and \d+ more"):
        laid_out(folder, tmp_path)


def test_a_shard_the_index_lists_but_the_folder_lacks_is_named(checkpoints, tmp_path):
    import shutil

    folder = tmp_path / "incomplete"
    shutil.copytree(checkpoints / "untied", folder)
    missing = sorted(folder.glob("*.safetensors"))[-1]
    missing.unlink()
    with pytest.raises(ConfigError, match=f"lists {missing.name}, which is not in"):
        laid_out(folder, tmp_path)


def test_a_bad_index_or_a_damaged_file_is_named(checkpoints, tmp_path):
    import shutil

    folder = tmp_path / "bad-index"
    shutil.copytree(checkpoints / "untied", folder)
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ConfigError, match=r"model.safetensors.index.json: not a safetensors index.*weight_map"):
        laid_out(folder, tmp_path)
    folder = tmp_path / "cut-short"
    shutil.copytree(checkpoints / "untied", folder)
    shard = sorted(folder.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ConfigError, match=f"{shard.name}: cannot be read as safetensors.*download it again"):
        laid_out(folder, tmp_path)
