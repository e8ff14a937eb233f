"""`parametrization: mup | completep`: per-role init and per-group lr, eps and weight decay (config/parametrization.py,
models/parametrization.py); at the base size it is the standard parametrization, step for step."""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import write_tiny_model, write_tiny_moe
from pretrainer import PreTrainer, PreTrainingArguments
from pretrainer.config import ConfigError

MUP = {"parametrization": "mup", "mup_base_hidden_size": 32}  # the tiny model (hidden 64) at twice the base width


def losses(save_dir) -> list:
    rows = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_at_the_base_width_mup_and_completep_are_the_standard_parametrization(base_config, tmp_path):
    runs = {"sp": {}, "mup": {**MUP, "mup_base_hidden_size": 64},
            "completep": {"parametrization": "completep", "mup_base_hidden_size": 64, "mup_base_num_layers": 2}}
    got = {}
    for name, keys in runs.items():
        PreTrainer(PreTrainingArguments(**{**base_config, **keys, "save_dir": str(tmp_path / name)})).train()
        got[name] = losses(tmp_path / name)
    assert len(got["sp"]) == 6 and got["mup"] == got["sp"] and got["completep"] == got["sp"]


def groups_by_parameter(trainer) -> dict:
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return {names[id(p)]: group for group in trainer.optimizer.param_groups for p in group["params"]}


def test_twice_the_base_width_scales_each_role_as_mup_prescribes(base_config, tmp_path):
    sp = PreTrainer(PreTrainingArguments(**{**base_config, "save_dir": str(tmp_path / "sp")}))
    mup = PreTrainer(PreTrainingArguments(**{**base_config, **MUP, "adam_eps": 1e-6, "weight_decay": 0.1,
                                             "save_dir": str(tmp_path / "mup")}))
    std = {name: {n: float(p.detach().std()) for n, p in t.model.named_parameters()} for name, t in
           (("sp", sp), ("mup", mup))}
    m = 2.0
    for name, expected in (("model.embed_tokens.weight", 1.0), ("model.layers.0.mlp.up_proj.weight", 1 / math.sqrt(m)),
                           ("model.layers.1.self_attn.q_proj.weight", 1 / math.sqrt(m)),
                           ("model.layers.0.self_attn.o_proj.weight", 1 / math.sqrt(m)), ("lm_head.weight", 1 / m)):
        assert std["mup"][name] / std["sp"][name] == pytest.approx(expected, rel=1e-6), name
    groups = groups_by_parameter(mup)
    lr = base_config["lr"]
    for name, factor, decay, eps in (("model.layers.0.mlp.down_proj.weight", 1 / m, 0.1 * m, 1 / m),
                                     ("lm_head.weight", 1 / m, 0.1 * m, m),  # a folded multiplier 1/m: eps x m
                                     ("model.embed_tokens.weight", 1.0, 0.0, 1.0),
                                     ("model.norm.weight", 1.0, 0.0, 1.0)):
        group = groups[name]
        assert group["initial_lr"] == pytest.approx(lr * factor) and group["weight_decay"] == pytest.approx(decay)
        assert group.get("eps", 1e-6) == pytest.approx(1e-6 * eps), name
    mup.train()  # the logged lr is the schedule's, not a scaled group's
    sp.train()
    rows = [json.loads(line) for line in (tmp_path / "mup" / "metrics.jsonl").read_text().splitlines()]
    expected = [json.loads(line) for line in (tmp_path / "sp" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows if "lr" in r] == [r["lr"] for r in expected if "lr" in r]
    assert losses(tmp_path / "mup") != losses(tmp_path / "sp")


def test_muon_matrices_keep_their_lr_and_take_the_spectral_shape_scale(base_config, tmp_path):
    args = PreTrainingArguments(**{**base_config, **MUP, "optimizer": "muon", "save_dir": str(tmp_path / "m")})
    trainer = PreTrainer(args)
    groups = groups_by_parameter(trainer)
    hidden, head = groups["model.layers.0.mlp.up_proj.weight"], groups["lm_head.weight"]
    assert hidden["muon"] and hidden["adjust_lr"] == "spectral" and hidden["initial_lr"] == pytest.approx(1e-3)
    assert not head["muon"] and head["initial_lr"] == pytest.approx(0.5e-3)


def test_a_wider_head_dim_folds_the_attention_scale_into_the_query_projection(base_config, tmp_path):
    """muP's 1/d_head attention (against the base's 1/sqrt(d_head)): head_dim 16 against a base of 4 is a factor
    sqrt(4/16) = 1/2 on the query's init and lr, on top of the width's."""
    keys = {**base_config, **MUP, "mup_base_head_dim": 4}
    sp = PreTrainer(PreTrainingArguments(**{**base_config, "save_dir": str(tmp_path / "sp")}))
    mup = PreTrainer(PreTrainingArguments(**{**keys, "save_dir": str(tmp_path / "mup")}))
    name = "model.layers.0.self_attn.q_proj.weight"
    ratio = float(dict(mup.model.named_parameters())[name].detach().std()) / \
        float(dict(sp.model.named_parameters())[name].detach().std())
    assert ratio == pytest.approx(0.5 / math.sqrt(2), rel=1e-6)
    groups = groups_by_parameter(mup)
    assert groups[name]["initial_lr"] == pytest.approx(1e-3 * 0.5 / 2)
    assert groups["model.layers.0.self_attn.k_proj.weight"]["initial_lr"] == pytest.approx(1e-3 / 2)


def test_completep_scales_the_residual_branches_by_depth(base_config, tmp_path):
    args = PreTrainingArguments(**{**base_config, "parametrization": "completep", "mup_base_hidden_size": 64,
                                   "mup_base_num_layers": 1, "save_dir": str(tmp_path / "c")})
    groups = groups_by_parameter(PreTrainer(args))  # 2 layers against a 1-layer base: branches x 1/2
    assert groups["model.layers.0.mlp.down_proj.weight"]["initial_lr"] == pytest.approx(0.5e-3)
    assert groups["model.layers.0.self_attn.o_proj.weight"]["initial_lr"] == pytest.approx(0.5e-3)
    assert groups["model.layers.0.mlp.up_proj.weight"]["initial_lr"] == pytest.approx(1e-3)


@pytest.mark.parametrize("keys, message", [
    ({"parametrization": "mup"}, "key 'mup_base_hidden_size': parametrization: mup scales from the width"),
    ({"mup_base_hidden_size": 32}, "mup_base_hidden_size is set but parametrization is 'sp'"),
    ({**MUP, "mup_base_num_layers": 2}, "mup_base_num_layers is set but parametrization is 'mup'"),
    ({"parametrization": "completep", "mup_base_hidden_size": 32}, "key 'mup_base_num_layers'"),
    ({**MUP, "optimizer": "muon", "muon_adjust_lr": "original"}, "breaks mup's width transfer"),
    ({"parametrization": "mu-p"}, "key 'parametrization'"),
])
def test_bad_parametrization_keys_are_one_line(base_config, keys, message):
    with pytest.raises(ConfigError, match=message):
        PreTrainingArguments(**{**base_config, **keys})


def test_a_tied_head_takes_the_logits_multiplier_in_the_final_norm_and_exports_as_trained(base_config, tmp_path):
    """Tied to the input embedding, the head keeps the embedding's init and lr; muP's 1/width logits multiplier is the
    final norm's weight (init 1/m, lr 1/m): the export is a plain tied model with the trained logits."""
    from transformers import AutoModelForCausalLM

    tied = write_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    args = PreTrainingArguments(**{**base_config, **MUP, "model_path": str(tied), "num_training_steps": 2,
                                   "save_dir": str(tmp_path / "r"), "export_hf": True})
    trainer = PreTrainer(args)
    groups = groups_by_parameter(trainer)
    norm = dict(trainer.model.named_parameters())["model.norm.weight"]
    assert torch.all(norm.detach() == 0.5) and groups["model.norm.weight"]["initial_lr"] == pytest.approx(0.5e-3)
    assert groups["model.embed_tokens.weight"]["initial_lr"] == pytest.approx(1e-3)
    trainer.train()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "r" / "hf")
    assert exported.config.tie_word_embeddings
    tokens = torch.arange(3, 19).reshape(2, 8)
    with torch.no_grad():
        assert torch.allclose(exported(input_ids=tokens).logits, trainer.model(input_ids=tokens).logits, atol=1e-5)


def test_continued_pretraining_under_mup_starts_from_the_checkpoint_s_function(base_config, tiny_model, tmp_path):
    """Weights read from an HF checkpoint are used as they are (nothing was folded into them to undo): the first
    step's loss is the checkpoint's under sp and under mup; only the updates differ."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(3)
    weights = tmp_path / "weights"
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model)).save_pretrained(weights)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(weights)
    got = {}
    for name, keys in (("sp", {}), ("mup", MUP)):
        PreTrainer(PreTrainingArguments(**{**base_config, **keys, "model_path": str(weights), "log_interval": 1,
                                           "num_training_steps": 3, "save_dir": str(tmp_path / name)})).train()
        got[name] = losses(tmp_path / name)
    assert got["mup"][0] == got["sp"][0] and got["mup"][1:] != got["sp"][1:]


def test_a_deepspeed_optimizer_block_is_refused(base_config):
    pytest.importorskip("deepspeed")
    deepspeed = {"zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    with pytest.raises(ConfigError, match="optimizer block .* builds one group"):
        PreTrainer(PreTrainingArguments(**{**base_config, **MUP, "engine": "deepspeed", "deepspeed": deepspeed}))


def test_an_export_is_the_trained_model(base_config, tmp_path):
    """No forward multipliers: the HF export of a muP run loads as the same class with the trained logits."""
    from transformers import AutoModelForCausalLM

    args = PreTrainingArguments(**{**base_config, **MUP, "num_training_steps": 2, "save_dir": str(tmp_path / "r"),
                                   "export_hf": True})
    trainer = PreTrainer(args)
    trainer.train()
    exported = AutoModelForCausalLM.from_pretrained(next((tmp_path / "r").glob("**/config.json")).parent)
    tokens = torch.arange(3, 19).reshape(2, 8)
    with torch.no_grad():
        expected = trainer.model(input_ids=tokens).logits
        assert torch.allclose(exported(input_ids=tokens).logits, expected, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_experts_are_hidden_matrices_and_the_router_is_scaled_as_the_head(family, base_config, tmp_path):
    """Experts are hidden matrices of their own width (the down projection a residual branch's last), the router maps
    the width to a fixed count as the head does; a muP MoE run trains and its loss falls."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pretrainer.models.parametrization import parameter_roles

    folder = write_tiny_moe(tmp_path / family, family)
    roles = parameter_roles(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)))
    experts = {role for name, role in roles.items() if ".experts." in name}
    routers = {role for name, role in roles.items()
               if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))}
    assert experts == {"hidden", "branch_out"} and routers == {"output"}, roles
    args = PreTrainingArguments(**{**base_config, **MUP, "model_path": str(folder), "num_training_steps": 4,
                                   "save_interval": 0, "eval_interval": 0, "log_interval": 1,
                                   "save_dir": str(tmp_path / "run")})
    PreTrainer(args).train()
    got = losses(tmp_path / "run")
    assert len(got) == 4 and all(math.isfinite(x) for x in got)


def test_multi_token_prediction_depths_train_under_mup(base_config, tmp_path):
    args = PreTrainingArguments(**{**base_config, **MUP, "mtp_num_layers": 1, "num_training_steps": 3,
                                   "save_interval": 0, "eval_interval": 0, "log_interval": 1,
                                   "save_dir": str(tmp_path / "run")})
    trainer = PreTrainer(args)
    groups = groups_by_parameter(trainer)
    mtp = {name: group for name, group in groups.items()  # the depth is decoder layer 2 of the 2-layer model
           if name.startswith("model.layers.2.") and name.endswith("proj.weight")}
    assert "model.layers.2.eh_proj.weight" in mtp, list(groups)
    assert all(group["initial_lr"] == pytest.approx(0.5e-3) for group in mtp.values()), list(mtp)
    trainer.train()
    assert len(losses(tmp_path / "run")) == 3


def meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_roles_of_other_families_and_the_folds_they_refuse():
    """Qwen2's query bias takes the query's lr multiplier; Phi's attention `dense` is a branch's last projection; a
    router on Muon keeps its lr (Muon's shape scale shrinks with the width already); Gemma's (1 + w) final norm and
    Qwen3's q_norm cannot carry a folded multiplier and are refused in one line."""
    from transformers import GemmaConfig, PhiConfig, Qwen2Config, Qwen3Config

    from pretrainer.config import Parametrization
    from pretrainer.models.parametrization import check_folds, parameter_roles

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2)
    qwen2 = parameter_roles(meta_model(Qwen2Config(**small)))
    assert qwen2["model.layers.0.self_attn.q_proj.bias"] == "query_bias"
    assert qwen2["model.layers.0.self_attn.k_proj.bias"] == "vector"
    phi = parameter_roles(meta_model(PhiConfig(**small)))
    assert phi["model.layers.0.self_attn.dense.weight"] == "branch_out"
    wide = Parametrization("mup", 4.0, head_dim_ratio=4.0, tied=True)
    assert wide.scale("query_bias").lr == pytest.approx(0.5) and wide.scale("output", muon=True).lr == 1.0
    gemma = meta_model(GemmaConfig(**small, head_dim=16, tie_word_embeddings=True))
    with pytest.raises(ConfigError, match=r"scales by \(1 \+ weight\)"):
        check_folds(gemma, parameter_roles(gemma, tied=True), wide)
    qwen3 = meta_model(Qwen3Config(**small, head_dim=16))
    with pytest.raises(ConfigError, match="normalises its queries"):
        check_folds(qwen3, parameter_roles(qwen3), Parametrization("mup", 2.0, head_dim_ratio=2.0))


def test_a_deepspeed_scheduler_block_is_refused(base_config):
    pytest.importorskip("deepspeed")
    deepspeed = {"zero_optimization": {"stage": 1}, "scheduler": {"type": "WarmupLR", "params": {}}}
    with pytest.raises(ConfigError, match="scheduler block .* sets one lr for every group"):
        PreTrainer(PreTrainingArguments(**{**base_config, **MUP, "engine": "deepspeed", "deepspeed": deepspeed}))
