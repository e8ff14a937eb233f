"""Mixture-of-Experts models (Mixtral, Qwen3-MoE, DeepSeek-V3 shapes: 8 experts, top-2, fp32): routing counts and
balancing losses against an outside computation, every data-parallel engine equal to one process (losses,
gradient norms, routing metrics), exact resume, the export, aux-loss-free balancing, and bad input."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import fast_config
from helpers import (
    assert_layout_answers,
    grad_norms,
    read_metrics,
    small_corpus_file,
    train_losses,
    write_tiny_model,
    write_tiny_moe,
)
from launch import REPO, cli_in_process, describe, pretrainer, run, torchrun
from multi_run import launch_cases
from pretrainer import PreTrainer, PreTrainingArguments
from pretrainer.config import ConfigError, MoeSettings
from pretrainer.models import MoeRouting

MOE_KEYS = ("moe_load_imbalance", "moe_dead_experts", "moe_aux_loss", "moe_z_loss")
BALANCED = {"moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001}


def moe_rows(save_dir) -> dict[int, dict]:
    return {r["step"]: {k: r[k] for k in MOE_KEYS} for r in read_metrics(save_dir) if "loss" in r}


def assert_same_moe_run(got, expected, rel: float = 1e-5) -> None:
    want, have = train_losses(expected), train_losses(got)
    assert sorted(have) == sorted(want) == [1, 2, 3, 4, 5, 6]
    assert [have[s] for s in want] == pytest.approx([want[s] for s in want], rel=rel)
    want_norms, have_norms = grad_norms(expected), grad_norms(got)
    assert [have_norms[s] for s in want_norms] == pytest.approx([want_norms[s] for s in want_norms], rel=1e-5)
    want_moe, have_moe = moe_rows(expected), moe_rows(got)
    for step, row in want_moe.items():  # the same tokens went to the same experts; the losses to float precision
        assert have_moe[step]["moe_dead_experts"] == row["moe_dead_experts"]
        assert have_moe[step] == pytest.approx(row, rel=1e-5), step


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """Tiny MoE models, one process's runs (micro-batch 4) and every 2-rank run (micro-batch 2) in one job."""
    root = tmp_path_factory.mktemp("moe")
    corpus = small_corpus_file(root / "docs.jsonl")
    models = {family: write_tiny_moe(root / family, family) for family in ("mixtral", "qwen3_moe", "deepseek_v3")}
    base = {**fast_config(models["qwen3_moe"], corpus, root / "unused"), "dp": 2, "eval_interval": 0, **BALANCED}
    (root / "zero3.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    (root / "zero2.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    variants = {  # name: (config changes, overrides)
        "qwen3": ({}, []),
        "mixtral": ({"model_path": str(models["mixtral"]), "moe_aux_loss_type": "micro_batch",
                     "moe_capacity_factor": 1.0, "moe_token_drop_policy": "position"}, []),
        "deepseek-bias": ({"model_path": str(models["deepseek_v3"]), "moe_expert_bias_update_rate": 0.01}, []),
        "mixtral-dropless": ({"model_path": str(models["mixtral"])}, []),
        "qwen3-seq31": ({"seq_length": 31}, []),
    }
    torch.set_num_threads(1)
    for name, (changes, _) in variants.items():
        single = {**base, **changes, "dp": 1, "micro_batch_size": 4, "save_dir": str(root / f"single-{name}")}
        if name == "mixtral":  # micro_batch balancing: the same micro-batches as the 2 ranks' (2 x 2 x 2 rows)
            single.update(micro_batch_size=2, gradient_accumulation_steps=4)
        trainer = PreTrainer(PreTrainingArguments(**single))
        trainer.train()
        if name == "qwen3":
            ids = torch.randint(3, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
            trainer.model.eval()
            with torch.no_grad():
                torch.save(trainer.model(input_ids=ids).logits, root / "single-qwen3-logits.pt")
            torch.save(ids, root / "ids.pt")
        trainer.close()
    trained = root / "single-qwen3" / "hf"  # HF in: a folder with per-expert weights, on one process and on fsdp
    from_hf = {"model_path": str(trained), "num_training_steps": 2, "warmup_steps": 1, "export_hf": False,
               "save_interval": 0}
    with PreTrainer(PreTrainingArguments(**{**base, **from_hf, "dp": 1, "micro_batch_size": 4,
                                            "save_dir": str(root / "single-from-hf")})) as trainer:
        trainer.train()
    cases = [{"name": "qwen3-fsdp-from-hf", "overrides": ["engine=fsdp"],
              "config": {**from_hf, "save_dir": str(root / "fsdp-from-hf")}},
             {"name": "qwen3-ddp", "overrides": ["engine=ddp"], "config": {"save_dir": str(root / "ddp")}},
             {"name": "qwen3-fsdp", "overrides": ["engine=fsdp"], "config": {"save_dir": str(root / "fsdp")}},
             {"name": "qwen3-fsdp-recompute", "overrides": ["engine=fsdp", "activation_checkpointing=full"],
              "config": {"save_dir": str(root / "fsdp-recompute")}},
             {"name": "qwen3-zero3", "overrides": [f"deepspeed={root}/zero3.json"],
              "config": {"save_dir": str(root / "zero3")}},
             {"name": "qwen3-ddp-exit", "overrides": ["engine=ddp", "exit_interval=3"],
              "config": {"save_dir": str(root / "ddp-resumed")}},
             {"name": "qwen3-ddp-rerun", "overrides": ["engine=ddp"],
              "config": {"save_dir": str(root / "ddp-resumed")}},
             {"name": "mixtral-ddp", "overrides": ["engine=ddp"],
              "config": {**variants["mixtral"][0], "save_dir": str(root / "mixtral-ddp")}},
             {"name": "deepseek-bias-exit", "overrides": ["engine=fsdp", "exit_interval=3"],
              "config": {**variants["deepseek-bias"][0], "save_dir": str(root / "deepseek-bias-fsdp")}},
             {"name": "deepseek-bias-rerun", "overrides": ["engine=fsdp"],
              "config": {**variants["deepseek-bias"][0], "save_dir": str(root / "deepseek-bias-fsdp")}}]
    ep2 = ["engine=fsdp", "expert_parallel_degree=2"]
    cases += [{"name": "qwen3-ep2", "overrides": ep2, "config": {"save_dir": str(root / "ep2")}},
              {"name": "qwen3-ep2-recompute", "overrides": [*ep2, "activation_checkpointing=full"],
               "config": {"save_dir": str(root / "ep2-recompute")}},
              {"name": "qwen3-ep2-exit", "overrides": [*ep2, "exit_interval=3"],
               "config": {"save_dir": str(root / "ep2-resumed")}},
              {"name": "qwen3-ep2-rerun", "overrides": ep2, "config": {"save_dir": str(root / "ep2-resumed")}},
              {"name": "qwen3-fsdp-exit", "overrides": ["engine=fsdp", "exit_interval=3"],
               "config": {"save_dir": str(root / "fsdp-to-ep2")}},
              {"name": "qwen3-ep2-from-fsdp", "overrides": ep2, "config": {"save_dir": str(root / "fsdp-to-ep2")}},
              {"name": "qwen3-ep2-from-hf", "overrides": ep2,
               "config": {**from_hf, "save_dir": str(root / "ep2-from-hf")}},
              {"name": "mixtral-ep2", "overrides": ep2,
               "config": {**variants["mixtral"][0], "save_dir": str(root / "mixtral-ep2")}},
              # Mixtral dropless (per-sequence balancing): fsdp, ZeRO-3, ep=2
              *[{"name": f"mixtral-dropless-{name}", "overrides": overrides,
                 "config": {**variants["mixtral-dropless"][0], "save_dir": str(root / f"mixtral-dropless-{name}")}}
                for name, overrides in (("fsdp", ["engine=fsdp"]), ("zero3", [f"deepspeed={root}/zero3.json"]),
                                        ("ep2", ep2))],
              {"name": "deepseek-bias-ep2", "overrides": ep2,
               "config": {**variants["deepseek-bias"][0], "save_dir": str(root / "deepseek-bias-ep2")}}]
    # the megatron engine: tp=2 (sequence parallel: each tp rank routes its own tokens), ep=2 over the dp ranks
    tp2 = ["engine=megatron", "plugin_args.tp_degree=2", "plugin_args.sequence_parallelism=true"]
    megatron_ep2 = ["engine=megatron", "expert_parallel_degree=2"]
    cases += [{"name": "qwen3-megatron-tp2", "overrides": [*tp2, "dp=1", "micro_batch_size=4"],
               "config": {"save_dir": str(root / "megatron-tp2")}},
              {"name": "qwen3-megatron-ep2", "overrides": megatron_ep2,
               "config": {"save_dir": str(root / "megatron-ep2")}},
              # DeepSeek-V3 (attention whole: pp, dp and ep only) with bias updates, ep=2
              {"name": "deepseek-bias-megatron-ep2", "overrides": megatron_ep2,
               "config": {**variants["deepseek-bias"][0], "save_dir": str(root / "deepseek-bias-megatron-ep2")}},
              {"name": "qwen3-zero2", "overrides": [f"deepspeed={root}/zero2.json"],
               "config": {"save_dir": str(root / "zero2")}},
              # 31 positions: each row right-padded to 32 for tp=2, the padding routed but counted nowhere
              {"name": "qwen3-megatron-tp2-seq31", "overrides": [*tp2, "dp=1", "micro_batch_size=4"],
               "config": {**variants["qwen3-seq31"][0], "save_dir": str(root / "megatron-tp2-seq31")}},
              # pipeline stages: the balancing losses ride on the routing weights; recomputation replays them
              {"name": "qwen3-megatron-pp2-recompute",
               "overrides": ["engine=megatron", "plugin_args.pp_degree=2", "dp=1", "micro_batch_size=4",
                             "activation_checkpointing=full"],
               "config": {"save_dir": str(root / "megatron-pp2-recompute")}}]
    launch_cases(base, cases, 2, root)
    # 4 ranks. fsdp dp=2 x ep=2: the experts split over pairs of ranks and each half sharded over the other pair.
    # megatron tp=2 x ep=2 (dp=2), also stopped at step 3 and resumed; dp=2 x ep=2 with the distributed optimizer
    tp2_ep2 = [*tp2, *megatron_ep2[1:]]
    launch_cases(base, [{"name": "qwen3-dp2-ep2", "overrides": [*ep2, "dp=4", "micro_batch_size=1"],
                         "config": {"save_dir": str(root / "dp2-ep2")}},
                        {"name": "mixtral-dropless-dp2-ep2", "overrides": [*ep2, "dp=4", "micro_batch_size=1"],
                         "config": {**variants["mixtral-dropless"][0],
                                    "save_dir": str(root / "mixtral-dropless-dp2-ep2")}},
                        {"name": "qwen3-megatron-tp2-ep2", "overrides": tp2_ep2,
                         "config": {"save_dir": str(root / "megatron-tp2-ep2")}},
                        {"name": "qwen3-megatron-tp2-ep2-exit", "overrides": [*tp2_ep2, "exit_interval=3"],
                         "config": {"save_dir": str(root / "megatron-tp2-ep2-resumed")}},
                        {"name": "qwen3-megatron-tp2-ep2-rerun", "overrides": tp2_ep2,
                         "config": {"save_dir": str(root / "megatron-tp2-ep2-resumed")}},
                        {"name": "mixtral-megatron-tp2-ep2", "overrides": tp2_ep2,
                         "config": {**variants["mixtral-dropless"][0],
                                    "save_dir": str(root / "mixtral-megatron-tp2-ep2")}},
                        {"name": "qwen3-megatron-tp2-ep2-from-hf", "overrides": tp2_ep2,
                         "config": {**from_hf, "save_dir": str(root / "megatron-tp2-ep2-from-hf")}},
                        {"name": "qwen3-megatron-pp2-ep2", "overrides": [*megatron_ep2, "plugin_args.pp_degree=2"],
                         "config": {"save_dir": str(root / "megatron-pp2-ep2")}},
                        {"name": "qwen3-megatron-dp2-ep2-distributed-optimizer",
                         "overrides": [*megatron_ep2, "dp=4", "micro_batch_size=1",
                                       "plugin_args.use_distributed_optimizer=true"],
                         "config": {"save_dir": str(root / "megatron-dp2-ep2-distopt")}}], 4, root)
    return root, models


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_routing_counts_and_balancing_losses_equal_a_computation_from_hf_router_logits(tmp_path, family):
    """One training forward: the hooked counts are the top-k of the router logits transformers returns, and
    the per-sequence balance loss is transformers' load_balancing_loss_func on each sequence over top_k (ours is
    1.0 when even, HF's top_k); the z-loss is the mean squared logsumexp."""
    from transformers import AutoModelForCausalLM
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    config_folder = write_tiny_moe(tmp_path / family, family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(json_config(config_folder)).train()
    args = PreTrainingArguments(num_training_steps=1, micro_batch_size=2, dp=1, model_path=str(config_folder),
                                **BALANCED)
    settings = MoeSettings.of(args, model.config, "config.json")
    routing = MoeRouting(model, settings)
    routing.begin_step(1.0)
    ids = torch.randint(3, 4096, (3, 16), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids, output_router_logits=True)
    added = routing.take_losses()
    routing.end_step(lambda t: t, applied=True)
    row = routing.interval_row(lambda t: t)

    layers = [logits.detach() for logits in out.router_logits]
    assert len(layers) == 2 and routing.layers == 2
    counts = torch.stack([torch.bincount(logits.softmax(-1).topk(2, dim=-1).indices.flatten(), minlength=8)
                          for logits in layers]).double()
    assert row["moe_load_imbalance"] == pytest.approx(float((counts.max(-1).values / counts.mean(-1)).max()))
    assert row["moe_dead_experts"] == int((counts == 0).sum())
    aux = [float(load_balancing_loss_func((logits[s * 16:(s + 1) * 16],), 8, 2)) / 2 for logits in layers
           for s in range(3)]
    z = [float(torch.logsumexp(logits[s * 16:(s + 1) * 16].float(), -1).square().mean()) for logits in layers
         for s in range(3)]
    assert row["moe_aux_loss"] == pytest.approx(sum(aux) / 6, rel=1e-6)
    assert row["moe_z_loss"] == pytest.approx(sum(z) / 6, rel=1e-6)
    assert float(added) == pytest.approx(0.01 * sum(aux) + 0.001 * sum(z), rel=1e-6)  # unit weight 1


def test_padding_counts_nowhere_in_the_routing(tmp_path):
    """A right-padded micro-batch (the loop's forward): the counts, the per-sequence balance loss and the z-loss
    take the tokens only, as transformers' load_balancing_loss_func with the attention mask does; a capacity
    gives padding no place."""
    from transformers import AutoModelForCausalLM
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from pretrainer.batch import forward_head

    folder = write_tiny_moe(tmp_path / "qwen", "qwen3_moe")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(json_config(folder)).train()
    args = PreTrainingArguments(num_training_steps=1, micro_batch_size=3, dp=1, model_path=str(folder), **BALANCED)
    routing = MoeRouting(model, MoeSettings.of(args, model.config, "config.json"))
    routing.begin_step(1.0)
    ids = torch.randint(3, 4096, (3, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 16, dtype=torch.long)
    mask[0, 11:] = 0
    mask[2, 7:] = 0
    forward_head(model, {"input_ids": ids, "attention_mask": mask}, takes_call=False)
    added = routing.take_losses()
    routing.end_step(lambda t: t, applied=True)
    row = routing.interval_row(lambda t: t)
    with torch.no_grad():
        layers = [logits.float() for logits in model(input_ids=ids, attention_mask=mask,
                                                     output_router_logits=True).router_logits]
    tokens = mask.reshape(-1).bool()
    counts = torch.stack([torch.bincount(logits[tokens].softmax(-1).topk(2, dim=-1).indices.flatten(), minlength=8)
                          for logits in layers]).double()
    assert counts.sum() == 2 * 2 * int(mask.sum())  # 2 layers x top-2 x the 34 tokens
    assert row["moe_layer_imbalance"] == pytest.approx((counts.max(-1).values / counts.mean(-1)).tolist(), rel=1e-4)
    aux = [float(load_balancing_loss_func((logits[s * 16:(s + 1) * 16],), 8, 2, mask[s:s + 1])) / 2
           for logits in layers for s in range(3)]
    z = [float(torch.logsumexp(logits[s * 16:(s + 1) * 16][mask[s].bool()], -1).square().mean())
         for logits in layers for s in range(3)]
    assert row["moe_aux_loss"] == pytest.approx(sum(aux) / 6, rel=1e-6)
    assert row["moe_z_loss"] == pytest.approx(sum(z) / 6, rel=1e-6)
    assert float(added) == pytest.approx(0.01 * sum(aux) + 0.001 * sum(z), rel=1e-6)

    from pretrainer.models.moe_routing import capacity_mask
    weights = layers[0].softmax(-1).topk(2, dim=-1)
    kept = capacity_mask(weights.values, weights.indices, 8, 1.0, "position", tokens)
    assert not kept[~tokens].any()  # padding is never kept
    per_expert = torch.bincount(weights.indices[kept], minlength=8)
    capacity = -(-34 * 2 // 8)  # from the 34 tokens, not the 48 positions
    assert int(per_expert.max()) == capacity
    wanted = torch.bincount(weights.indices[tokens].flatten(), minlength=8)
    assert int(kept.sum()) == int(wanted.clamp(max=capacity).sum())


def test_a_recomputed_router_uses_its_own_forwards_padding_when_other_forwards_ran_between(tmp_path):
    """As a pipeline schedule runs them: two micro-batches with different padding forwarded, then both
    backwards. With full activation checkpointing each layer's replay inside backward computes the balancing
    losses again, with the mask of its own forward, not the last one: the gradients equal those without
    recomputation."""
    from transformers import AutoModelForCausalLM

    from pretrainer.batch import forward_head
    from pretrainer.config.names import parameter_name
    from pretrainer.parallel.activation_checkpoint import RecomputeSettings, apply_activation_checkpointing

    folder = write_tiny_moe(tmp_path / "qwen", "qwen3_moe")
    ids = torch.randint(3, 4096, (2, 2, 16), generator=torch.Generator().manual_seed(1))
    masks = torch.ones(2, 2, 16, dtype=torch.long)
    masks[0, 0, 9:] = 0
    masks[1, 1, 4:] = 0
    grads = {}
    for recompute in ("none", "full"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(json_config(folder)).train()
        apply_activation_checkpointing(model, RecomputeSettings(recompute))
        args = PreTrainingArguments(num_training_steps=1, micro_batch_size=2, dp=1, model_path=str(folder),
                                    **BALANCED)
        routing = MoeRouting(model, MoeSettings.of(args, model.config, "config.json"))
        routing.begin_step(1.0)
        losses = []
        for micro in range(2):
            forward_head(model, {"input_ids": ids[micro], "attention_mask": masks[micro]}, takes_call=False)
            losses.append(routing.take_losses())
        for loss in losses:
            loss.backward()
        grads[recompute] = {parameter_name(name): p.grad.clone() for name, p in model.named_parameters()
                            if p.grad is not None}
    assert grads["full"].keys() == grads["none"].keys() and any("mlp.gate" in name for name in grads["none"])
    for name, grad in grads["none"].items():
        torch.testing.assert_close(grads["full"][name], grad, rtol=1e-5, atol=1e-8, msg=name)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_a_capacity_factor_drops_what_a_count_outside_the_model_says(tmp_path, policy):
    """Capacity 1.0 of 3 x 16 tokens, top-2 of 8: each expert takes 12 assignments per micro-batch. The dropped
    fraction equals the overflow counted from transformers' router logits, the kept assignments are the first
    12 of each expert in the policy's order (a plain loop), and the logits change; a capacity of E / k drops
    nothing and leaves the logits as dropless."""
    import math

    from transformers import AutoModelForCausalLM

    from pretrainer.models.moe_routing import capacity_mask

    folder = write_tiny_moe(tmp_path / "qwen", "qwen3_moe")
    ids = torch.randint(3, 4096, (3, 16), generator=torch.Generator().manual_seed(1))
    results = {}
    for factor in (None, 1.0, 4.0):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(json_config(folder)).train()
        args = PreTrainingArguments(num_training_steps=1, micro_batch_size=3, dp=1, moe_capacity_factor=factor,
                                    moe_token_drop_policy=policy if factor else None)
        routing = MoeRouting(model, MoeSettings.of(args, model.config, "config.json"))
        routing.begin_step(1.0)
        out = model(input_ids=ids, output_router_logits=True)
        routing.take_losses()
        routing.end_step(lambda t: t, applied=True)
        results[factor] = out.logits.detach(), routing.interval_row(lambda t: t), out.router_logits
    _, row, router_logits = results[1.0]
    overflow = 0
    for logits in router_logits:
        weights, chosen = logits.detach().softmax(-1).topk(2, dim=-1)
        counts = torch.bincount(chosen.flatten(), minlength=8)
        overflow += int((counts - 12).clamp(min=0).sum())
        order = sorted(range(96), key=lambda a: -float(weights.flatten()[a])) if policy == "probs" else range(96)
        taken, expected = [0] * 8, torch.zeros(96, dtype=torch.bool)
        for a in order:
            expert = int(chosen.flatten()[a])
            expected[a] = taken[expert] < 12
            taken[expert] += 1
        assert torch.equal(capacity_mask(weights, chosen, 8, 1.0, policy).flatten(), expected)
    assert overflow > 0 and row["moe_dropped_fraction"] == pytest.approx(overflow / (2 * 96))
    assert not torch.allclose(results[1.0][0], results[None][0])
    assert results[4.0][1]["moe_dropped_fraction"] == 0
    torch.testing.assert_close(results[4.0][0], results[None][0], rtol=0, atol=0)
    assert "moe_dropped_fraction" not in results[None][1] and math.isfinite(row["moe_load_imbalance"])


@pytest.mark.parametrize("family,overrides", [("qwen2_moe", {}), ("olmoe", {}), ("gpt_oss", {}),
                                              ("qwen3_moe", {"mlp_only_layers": [0]})])
def test_each_moe_family_trains_with_its_routing_metrics_and_exports_its_logits(tmp_path, family, overrides):
    """Qwen2-MoE (a gated shared expert), OLMoE, GPT-OSS (router bias, weights over all experts, sliding
    attention) and Qwen3-MoE with a dense first layer: 3 steps with balancing and a capacity, the routing metrics
    of the MoE layers only, and an export that transformers loads with the loop's logits."""
    from transformers import AutoModelForCausalLM

    folder = write_tiny_moe(tmp_path / family, family, **overrides)
    corpus = small_corpus_file(tmp_path / "docs.jsonl")
    config = {**fast_config(folder, corpus, tmp_path / "run"), "num_training_steps": 3, "eval_interval": 0,
              "save_interval": 0, **BALANCED, "moe_capacity_factor": 1.5}
    with PreTrainer(PreTrainingArguments(**config)) as trainer:
        trainer.train()
        layers = trainer.callbacks[0].routing.layers
        ids = torch.randint(3, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
        trainer.model.eval()
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits
    assert layers == (1 if overrides else 2)
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 3 and all(len(r["moe_layer_imbalance"]) == layers and r["moe_aux_loss"] > 0 for r in rows)
    assert all(0 <= r["moe_dropped_fraction"] < 0.5 for r in rows)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, logits, rtol=1e-5, atol=1e-5)


def test_the_expert_parallel_exchange_equals_every_expert_on_every_rank(tmp_path):
    """2 ranks holding 2 of 4 experts each: tokens sent at uneven splits (also none) with all-to-all, run by
    their experts and sent back weighted give the outputs and the gradients (hidden states, routing weights,
    expert weights summed over ranks) of each rank running all experts on its own tokens."""
    done = run(torchrun(2, REPO / "tests" / "expert_exchange_run.py", tmp_path), timeout=300)
    assert done.returncode == 0, describe(done)
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(results) == 6 and any(0 in r["sent"] for r in results.values())
        for case, result in results.items():
            assert max(result[k] for k in ("forward", "hidden_grad", "gate_grad", "expert_grad")) < 1e-5, case


def json_config(folder):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


@pytest.mark.parametrize("name", ["ddp", "fsdp", "fsdp-recompute", "zero2", "zero3"])
def test_qwen3_moe_on_two_ranks_matches_one_process(moe, name):
    """Losses, gradient norms and routing metrics of every engine equal one process's; recomputation
    (activation checkpointing) replays the routers without counting them twice."""
    root, _ = moe
    assert_same_moe_run(root / name, root / "single-qwen3")


@pytest.mark.parametrize("name", ["ep2", "ep2-recompute", "dp2-ep2"])
def test_expert_parallel_qwen3_moe_matches_one_process(moe, name):
    """Each rank holding 4 of the 8 experts (ep=2 on 2 ranks; dp=2 x ep=2 on 4, the expert halves sharded
    again over the ranks holding them), tokens exchanged all-to-all: losses, gradient norms and routing metrics
    equal one process's; with full recompute the exchange is replayed in backward."""
    root, _ = moe
    assert_same_moe_run(root / name, root / "single-qwen3")
    ranks = 4 if name.startswith("dp2") else 2
    assert [check["held"]["expert_ranks"] for check in assert_layout_answers(root / name, ranks)] == [2] * ranks


@pytest.mark.parametrize("name,family,ranks", [
    ("megatron-tp2", "qwen3", 2), ("megatron-ep2", "qwen3", 2), ("megatron-tp2-ep2", "qwen3", 4),
    ("mixtral-megatron-tp2-ep2", "mixtral", 4), ("megatron-dp2-ep2-distopt", "qwen3", 4),
    ("megatron-pp2-recompute", "qwen3", 2), ("megatron-pp2-ep2", "qwen3", 4),
    ("megatron-tp2-seq31", "qwen3-seq31", 2)])
def test_the_megatron_engine_trains_moe_with_tensor_and_expert_parallelism_as_one_process(moe, name, family, ranks):
    """Qwen3-MoE and Mixtral (8 experts, top-2, dropless) on the megatron engine: tp=2 (each tp rank routes its
    half of every sequence; the balancing losses from the whole sequences' counts), ep=2 over the dp ranks, tp=2 x
    ep=2, dp=2 x ep=2 with the distributed optimizer, pp=2 (with full recompute), pp=2 x ep=2, and tp=2 on
    31-position rows (padded to 32 for tp, the padding counted in no routing figure): losses, gradient norms and
    routing metrics equal one process's, each rank holds what the planner says (tp leaves the MoE blocks whole, ep
    halves the experts), and the export has one process's weights."""
    root, _ = moe
    single = root / {"qwen3": "single-qwen3", "mixtral": "single-mixtral-dropless"}.get(family, f"single-{family}")
    assert_same_moe_run(root / name, single)
    checks = assert_layout_answers(root / name, ranks)
    assert [check["held"]["expert_ranks"] for check in checks] == [2 if "ep2" in name else 1] * ranks
    want, have = load_file(single / "hf" / "model.safetensors"), load_file(root / name / "hf" / "model.safetensors")
    assert sorted(have) == sorted(want)
    for key, tensor in want.items():  # Adam turns tiny gradient differences into updates of up to lr: compare
        torch.testing.assert_close(have[key], tensor, rtol=1e-3, atol=2e-4)  # at a fraction of one step


def test_a_megatron_tensor_and_expert_parallel_run_resumes_exactly(moe):
    root, _ = moe
    resumed = root / "megatron-tp2-ep2-resumed"
    assert [(r["event"], r["step"]) for r in read_metrics(resumed) if "event" in r] == [("start", 0), ("resume", 3)]
    assert train_losses(resumed) == pytest.approx(train_losses(root / "megatron-tp2-ep2"), rel=1e-6)
    want = moe_rows(root / "megatron-tp2-ep2")
    assert {step: pytest.approx(row, rel=1e-6) for step, row in want.items()} == moe_rows(resumed)


@pytest.mark.parametrize("name", ["fsdp", "zero3", "ep2", "dp2-ep2"])
def test_dropless_mixtral_matches_one_process_on_fsdp_zero3_and_expert_parallel(moe, name):
    """Mixtral (8 experts, top-2, dropless, per-sequence balancing) on fsdp, ZeRO-3, fsdp ep=2 (2 ranks) and
    dp=2 x ep=2 (4 ranks): losses, gradient norms and routing metrics equal one process's."""
    root, _ = moe
    assert_same_moe_run(root / f"mixtral-dropless-{name}", root / "single-mixtral-dropless")


@pytest.mark.parametrize("family,single", [("mixtral-ep2", "single-mixtral"),
                                           ("deepseek-bias-ep2", "single-deepseek-bias"),
                                           ("deepseek-bias-megatron-ep2", "single-deepseek-bias")])
def test_expert_parallel_mixtral_capacity_and_deepseek_bias_match_one_process(moe, family, single):
    """Mixtral with per-micro-batch balancing and a capacity (drops by position) and DeepSeek-V3 (sigmoid grouped
    routing, a shared expert, a dense first layer, bias updates; on fsdp and on the megatron engine, its
    multi-head latent attention whole) on ep=2 train as one process; the dropped fraction and the moved bias are
    the same."""
    root, _ = moe
    assert_same_moe_run(root / family, root / single)
    if family.startswith("mixtral"):
        dropped = [r["moe_dropped_fraction"] for r in read_metrics(root / single) if "loss" in r]
        assert [r["moe_dropped_fraction"] for r in read_metrics(root / family) if "loss" in r] == \
            pytest.approx(dropped, rel=1e-6)
    else:
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        torch.testing.assert_close(load_file(root / family / "hf" / "model.safetensors")[bias],
                                   load_file(root / single / "hf" / "model.safetensors")[bias])


@pytest.mark.parametrize("resumed", ["ep2-resumed", "fsdp-to-ep2"])
def test_an_expert_parallel_run_resumes_exactly_also_from_another_layout(moe, resumed):
    """Stopped at step 3 and resumed on ep=2, from an ep=2 checkpoint or from a plain fsdp one (each expert
    tensor is whole in the checkpoint): the run the uninterrupted ep=2 one."""
    root, _ = moe
    events = [(r["event"], r["step"]) for r in read_metrics(root / resumed) if "event" in r]
    assert events == [("start", 0), ("resume", 3)]
    assert train_losses(root / resumed) == pytest.approx(train_losses(root / "ep2"), rel=1e-6)
    want = moe_rows(root / "ep2")
    assert {step: pytest.approx(row, rel=1e-6) for step, row in want.items()} == moe_rows(root / resumed)


@pytest.mark.parametrize("name", ["fsdp-from-hf", "ep2-from-hf", "megatron-tp2-ep2-from-hf"])
def test_a_trained_moe_folder_continues_on_fsdp_as_on_one_process(moe, name):
    """An HF folder with one tensor per expert, read in slices: each rank reads only its part of every tensor,
    its experts' rows included (fsdp: half of everything, the ep=2 experts' half too; megatron tp=2 x ep=2:
    half of attention and half of the experts), and trains as one process that loaded it whole."""
    root, _ = moe
    want, have = train_losses(root / "single-from-hf"), train_losses(root / name)
    assert sorted(have) == sorted(want) == [1, 2]
    assert [have[s] for s in want] == pytest.approx([want[s] for s in want], rel=1e-5)
    assert want[1] < train_losses(root / "single-qwen3")[1] - 0.01  # it starts from the trained weights
    files = load_file(root / "single-qwen3" / "hf" / "model.safetensors")
    total = sum(t.numel() * t.element_size() for t in files.values())
    experts = sum(t.numel() * t.element_size() for key, t in files.items() if ".experts." in key)
    read = next(r for r in read_metrics(root / name) if r.get("event") == "start")["weights_read_bytes"]
    if name.startswith("megatron"):  # tp halves all but the MoE blocks (router whole), ep halves the experts
        assert len(read) == 4 and max(read) < (total - experts) / 2 + experts / 2 + 0.02 * total
    else:  # every byte read once, half on each rank
        assert len(read) == 2 and sum(read) == pytest.approx(total, rel=1e-3) and max(read) < 0.52 * total


def test_a_stopped_moe_run_resumes_exactly(moe):
    root, _ = moe
    events = [(r["event"], r["step"]) for r in read_metrics(root / "ddp-resumed") if "event" in r]
    assert events == [("start", 0), ("resume", 3)]
    assert train_losses(root / "ddp-resumed") == train_losses(root / "ddp")
    assert moe_rows(root / "ddp-resumed") == moe_rows(root / "ddp")


def test_mixtral_micro_batch_balancing_and_capacity_match_one_process_with_the_same_micro_batches(moe):
    """Per-micro-batch balancing and a capacity of 1.0 (drops by position) depend on which sequences share a
    micro-batch; with the same micro-batches, 2 ddp ranks drop and train as one process."""
    root, _ = moe
    assert_same_moe_run(root / "mixtral-ddp", root / "single-mixtral")
    dropped = {r["step"]: r["moe_dropped_fraction"] for r in read_metrics(root / "single-mixtral") if "loss" in r}
    assert min(dropped.values()) > 0
    assert {r["step"]: r["moe_dropped_fraction"] for r in read_metrics(root / "mixtral-ddp") if "loss" in r} == \
        pytest.approx(dropped, rel=1e-6)


def test_expert_bias_updates_match_one_process_and_resume_with_the_bias(moe):
    """DeepSeek-V3's aux-loss-free balancing on fsdp, stopped at step 3 and resumed: the bias moves from the
    counts of both ranks (as one process's), and the checkpoint carries it."""
    root, _ = moe
    assert_same_moe_run(root / "deepseek-bias-fsdp", root / "single-deepseek-bias")
    single = load_file(root / "single-deepseek-bias" / "hf" / "model.safetensors")
    fsdp = load_file(root / "deepseek-bias-fsdp" / "hf" / "model.safetensors")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert bias in single and single[bias].abs().max() > 0  # 6 updates of 0.01 moved it
    torch.testing.assert_close(fsdp[bias], single[bias])


def test_the_export_loads_in_transformers_with_the_trained_logits(moe):
    """The per-expert keys transformers writes for hub checkpoints; from_pretrained gives the loop's logits."""
    from transformers import AutoModelForCausalLM

    root, _ = moe
    keys = load_file(root / "fsdp" / "hf" / "model.safetensors").keys()
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in keys
    for name in ("single-qwen3", "ep2"):  # ep=2: every expert gathered from the rank holding it
        model = AutoModelForCausalLM.from_pretrained(root / name / "hf", dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(input_ids=torch.load(root / "ids.pt")).logits
        torch.testing.assert_close(logits, torch.load(root / "single-qwen3-logits.pt"), rtol=1e-5, atol=1e-5)
    for name in ("fsdp", "ep2", "dp2-ep2"):
        exported = load_file(root / name / "hf" / "model.safetensors")
        for key, value in load_file(root / "single-qwen3" / "hf" / "model.safetensors").items():
            torch.testing.assert_close(exported[key], value, rtol=1e-4, atol=1e-5)


def test_expert_bias_updates_lower_the_load_imbalance_of_a_skewed_router(tmp_path):
    """A DeepSeek-V3 router whose bias sends nearly every token to experts 0 and 1: after 100 steps, the last
    interval's imbalance with bias updates is far below the one without."""
    from transformers import AutoModelForCausalLM

    folder = write_tiny_moe(tmp_path / "skewed", "deepseek_v3")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(json_config(folder))
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias[:2] = 0.5
    model.save_pretrained(folder)
    corpus = small_corpus_file(tmp_path / "docs.jsonl")
    imbalance = {}
    for rate in (0.0, 0.01):
        config = {**fast_config(folder, corpus, tmp_path / f"rate-{rate}"), "num_training_steps": 100,
                  "micro_batch_size": 4, "gradient_accumulation_steps": 1, "eval_interval": 0, "save_interval": 0,
                  "export_hf": False, "log_interval": 10, "moe_aux_loss_coeff": 0.0,
                  "moe_expert_bias_update_rate": rate, "write_report": bool(rate)}
        trainer = PreTrainer(PreTrainingArguments(**config))
        trainer.train()
        trainer.close()
        imbalance[rate] = [r["moe_load_imbalance"] for r in read_metrics(tmp_path / f"rate-{rate}") if "loss" in r]
    print("moe_load_imbalance per interval of 10 steps:", imbalance)
    assert imbalance[0.0][0] > 3.5  # 8 experts, top-2: 4.0 when every token picks experts 0 and 1
    assert imbalance[0.01][-1] < 2.0 < imbalance[0.0][-1]
    report = tmp_path / "rate-0.01" / "report"  # the routing charts: one heatmap column per logged step
    assert {"moe_imbalance.svg", "moe_dead_experts.svg", "moe_layers.svg"} <= {p.name for p in report.iterdir()}
    assert (report / "moe_layers.svg").read_text().count("<rect x=") == 10 + 1  # 10 rows x 1 MoE layer + frame


def test_bad_moe_input_is_one_line_with_exit_2(tmp_path, capsys):
    """A moe_* key on a dense model, bias updates for a router without a bias, an engine that does not train
    experts, a top-k above the experts: one line naming the key or file (exit 2 from the command line)."""
    corpus = small_corpus_file(tmp_path / "docs.jsonl")
    dense = fast_config(write_tiny_model(tmp_path / "dense"), corpus, tmp_path / "run")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(dense))
    qwen = write_tiny_moe(tmp_path / "qwen", "qwen3_moe")
    code, stderr = cli_in_process(capsys, "train", path, "moe_aux_loss_coeff=0.01")
    assert code == 2 and "moe_aux_loss_coeff is set but" in stderr and "describes a dense model" in stderr, stderr
    # the megatron engine joins a process group first: its own process
    done = run(pretrainer("train", path, f"model_path={qwen}", "engine=megatron", "plugin_args.tp_degree=2"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "a Mixture-of-Experts model with tp_degree > 1 needs sequence parallelism" in done.stderr
    too_many = write_tiny_moe(tmp_path / "topk", "qwen3_moe", num_experts_per_tok=9)
    with pytest.raises(ConfigError, match="num_experts_per_tok 9 must be between 1 and the 8 experts"):
        PreTrainer(PreTrainingArguments(**{**dense, "model_path": str(too_many)}))
    with pytest.raises(ConfigError, match="Qwen3MoeTopKRouter has no per-expert routing bias"):
        PreTrainer(PreTrainingArguments(**{**dense, "model_path": str(qwen), "moe_expert_bias_update_rate": 0.01}))


def test_key_checks_refuse_bad_values_before_any_model_is_read():
    base = {"num_training_steps": 1, "micro_batch_size": 1, "dp": 1}
    with pytest.raises(ConfigError, match="moe_aux_loss_type 'global' is not one of seq, micro_batch"):
        PreTrainingArguments(**base, moe_aux_loss_type="global")
    with pytest.raises(ConfigError, match="moe_z_loss_coeff must be >= 0"):
        PreTrainingArguments(**base, moe_z_loss_coeff=-1.0)
    with pytest.raises(ConfigError, match="moe_capacity_factor must be > 0"):
        PreTrainingArguments(**base, moe_capacity_factor=0.0)
    with pytest.raises(ConfigError, match="moe_token_drop_policy is set but moe_capacity_factor is None"):
        PreTrainingArguments(**base, moe_token_drop_policy="position")
    with pytest.raises(ConfigError, match="moe_experts_implementation 'fast' is not one of auto, eager"):
        PreTrainingArguments(**base, moe_experts_implementation="fast")


def test_bad_expert_parallel_input_names_the_key(tmp_path, capsys):
    """expert_parallel_degree that does not divide the experts or the data-parallel ranks, on a dense model, or
    with hybrid sharding; megatron's tp without sequence parallelism for an MoE
    model: refused while the run is resolved (before any process group or model), one line from the command
    line."""
    from pretrainer.parallel import planned_world
    from pretrainer.run import resolve_run

    corpus = small_corpus_file(tmp_path / "docs.jsonl")
    qwen = fast_config(write_tiny_moe(tmp_path / "qwen", "qwen3_moe"), corpus, tmp_path / "run")
    dense = fast_config(write_tiny_model(tmp_path / "dense"), corpus, tmp_path / "run")

    def resolve(config: dict, world: int, **keys):
        args = PreTrainingArguments(**{**config, "dp": world, "engine": "fsdp", **keys})
        return resolve_run(args, planned_world(world, world, torch.device("cpu")))

    assert resolve(qwen, 4, expert_parallel_degree=2).dims.ep == 2
    replicated = resolve(qwen, 2, expert_parallel_degree=2, engine="ddp")  # ddp's stages split the experts too
    assert replicated.dims.ep == 2 and replicated.engine.name == "ddp"
    assert replicated.engine.cls.supports_expert_parallel
    cases = [(qwen, 6, {"expert_parallel_degree": 3}, "3 does not divide the 8 experts"),
             (qwen, 3, {"expert_parallel_degree": 2}, "2 does not divide the 3 data-parallel rank"),
             (dense, 2, {"expert_parallel_degree": 2}, "describes a dense model \\(no experts to split\\)"),
             (qwen, 4, {"expert_parallel_degree": 2, "fsdp_shard_size": 2}, "hybrid sharding with expert_parallel"),
             (qwen, 4, {"engine": "megatron", "plugin_args": {"tp_degree": 2}}, "needs sequence parallelism"),
             (qwen, 4, {"engine": "megatron", "expert_parallel_degree": 4,
                        "plugin_args": {"tp_degree": 2, "sequence_parallelism": True}},
              "4 does not divide the 2 data-parallel rank")]
    for config, world, keys, message in cases:
        with pytest.raises(ConfigError, match=message):
            resolve(config, world, **keys)
    # what the model rules out comes before any layout message (whose advice would lead nowhere)
    for config, keys, message in ((dense, {"expert_parallel_degree": 2}, "describes a dense model"),
                                  (qwen, {"expert_parallel_degree": 3}, "3 does not divide the 8 experts")):
        with pytest.raises(ConfigError, match=message):
            resolve(config, 1, **keys, engine="single")
    with pytest.raises(ConfigError, match="expert_parallel_degree must be >= 1"):
        PreTrainingArguments(**qwen, expert_parallel_degree=0)
    path = tmp_path / "q.yaml"
    path.write_text(yaml.safe_dump(qwen))
    code, stderr = cli_in_process(capsys, "train", path, "expert_parallel_degree=2")
    assert code == 2 and "key 'expert_parallel_degree'" in stderr and len(stderr.strip().splitlines()) == 1, stderr
