"""Learning-rate schedules, AdamW parameter groups and Muon."""

from __future__ import annotations

import copy as copy_module
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pretrainer import PreTrainingArguments
from pretrainer.config import BatchSizes, ConfigError, OptimizerSettings, ScheduleSettings
from pretrainer.optim import (
    MuonAdamW,
    build_optimizer,
    build_scheduler,
    lr_multiplier,
    orthogonalize,
    parameter_groups,
)


def lrs(style: str, total: int = 10, warmup: int = 2, min_ratio: float = 0.1, **kw) -> list[float]:
    return [lr_multiplier(s, total=total, warmup=warmup, style=style, min_ratio=min_ratio, **kw) for s in range(total)]


def test_warmup_reaches_peak_on_its_last_step_then_each_style_decays_to_min():
    for style in ("cosine", "linear", "wsd"):
        values = lrs(style)
        assert values[:2] == [0.5, 1.0]
        assert values[-1] == pytest.approx(0.1)
        assert all(a >= b for a, b in zip(values[1:], values[2:]))
    assert lrs("constant")[2:] == [1.0] * 8
    assert lrs("cosine")[2 + 7 // 2] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 7)))
    assert lrs("linear")[5] == pytest.approx(0.1 + 0.9 * (1 - 3 / 7))


def test_wsd_is_stable_until_the_decay_fraction():
    values = lrs("wsd", total=22, warmup=2, wsd_decay_fraction=0.25)
    assert values[2:17] == [1.0] * 15
    assert values[17] < 1.0 and values[-1] == pytest.approx(0.1)


def schedule_lrs(tokens_per_step: int = 64, **keys) -> list[float]:
    """The lr of every update of a 1-layer model under the config `keys`, through the scheduler itself."""
    args = PreTrainingArguments(**{"micro_batch_size": 1, "dp": 1, "lr": 1.0, "min_lr": 0.1, **keys})
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0)
    sizes = BatchSizes.of(args, seq_length=tokens_per_step, data_parallel_size=1)  # 1 sequence per update
    scheduler = build_scheduler(optimizer, ScheduleSettings.of(args, sizes))
    seen = []
    for _ in range(args.num_training_steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


WSD_SHAPES = {"linear": lambda p: 1 - p, "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
              "1-sqrt": lambda p: 1 - math.sqrt(p)}


@pytest.mark.parametrize("shape", sorted(WSD_SHAPES))
def test_every_wsd_shape_equals_its_formula_at_every_step_in_steps_and_in_tokens(shape):
    from pretrainer.config.optimization import WSD_DECAY_SHAPES
    from pretrainer.optim.schedules import DECAY_SHAPES
    assert set(WSD_DECAY_SHAPES) == set(DECAY_SHAPES) == set(WSD_SHAPES)
    total, peak, low = 40, 1.0, 0.1
    # in steps: 4 warmup steps, decay over the last 20% of the 35 post-warmup updates (7 updates)
    in_steps = schedule_lrs(num_training_steps=total, warmup_steps=4, lr_decay_style="wsd", wsd_decay_shape=shape)
    # in tokens, 64 per update: warmup over 160 tokens (2.5 updates), decay over the last 640 (10 updates)
    in_tokens = schedule_lrs(num_training_steps=total, warmup_tokens=160, lr_decay_style="wsd",
                             wsd_decay_shape=shape, wsd_decay_tokens=640)
    for k in range(total):
        tokens = (k + 1) * 64   # trained by the end of update k
        expected_steps = (k + 1) / 4 if k + 1 < 4 else \
            low + (peak - low) * WSD_SHAPES[shape](min(1.0, max(0.0, (k + 1 - (total - 7)) / 7)))
        expected_tokens = tokens / 160 if tokens < 160 else \
            low + (peak - low) * WSD_SHAPES[shape](min(1.0, max(0.0, (tokens - (total * 64 - 640)) / 640)))
        assert in_steps[k] == pytest.approx(expected_steps, abs=1e-12), k
        assert in_tokens[k] == pytest.approx(expected_tokens, abs=1e-12), k
    assert in_tokens[29] == 1.0 and in_tokens[30] < 1.0 and in_tokens[-1] == pytest.approx(low)
    assert in_steps[32] == 1.0 and in_steps[33] < 1.0 and in_steps[-1] == pytest.approx(low)


def test_the_scheduler_decays_over_the_configured_wsd_fraction():
    """Through the scheduler, not the formula alone: half of the 98 post-warmup updates decay (49 updates)."""
    values = schedule_lrs(num_training_steps=100, warmup_steps=1, lr_decay_style="wsd", wsd_decay_fraction=0.5)
    assert values[50] == 1.0 and values[51] < 1.0
    assert values[75] == pytest.approx(0.1 + 0.9 * (1 - (76 - 51) / 49))
    assert values[-1] == pytest.approx(0.1)

def test_token_warmup_equals_its_formula_under_cosine():
    values = schedule_lrs(num_training_steps=12, warmup_tokens=96, tokens_per_step=32)  # 3 updates
    assert values[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert values[-1] == pytest.approx(0.1)


@pytest.mark.parametrize("keys, message", [
    ({"warmup_steps": 2, "warmup_tokens": 100}, "warmup_tokens.: set one of warmup_steps, warmup_fraction and "
                                                "warmup_tokens"),
    ({"wsd_decay_shape": "1-sqrt"}, "wsd_decay_shape.: wsd_decay_shape is set but lr_decay_style is 'cosine', so "
                                    "it has no effect"),
    ({"lr_decay_style": "wsd", "wsd_decay_shape": "sqrt"}, "wsd_decay_shape 'sqrt' is not one of linear, cosine, "
                                                            "1-sqrt"),
    ({"lr_decay_style": "wsd", "wsd_decay_tokens": 100, "wsd_decay_fraction": 0.1}, "set wsd_decay_tokens or "
                                                                                    "wsd_decay_fraction"),
    ({"lr_decay_style": "wsd", "wsd_decay_tokens": -5}, r"wsd_decay_tokens must be > 0, got -5.0 \(a number of tokens"),
    ({"spike_window": 64}, "spike_window is set but spike_zscore is None, so it has no effect"),
])
def test_bad_schedule_keys_are_named(keys, message):
    with pytest.raises(ConfigError, match=message):
        PreTrainingArguments(num_training_steps=10, micro_batch_size=1, dp=1, **keys)


def test_scheduler_follows_config_and_steps_once_per_update():
    model = torch.nn.Linear(2, 2)
    args = PreTrainingArguments(num_training_steps=10, micro_batch_size=1, dp=1, lr=1e-3, min_lr=1e-4,
                                warmup_fraction=0.2, lr_decay_style="linear")
    optimizer = build_optimizer(model, OptimizerSettings.of(args), torch.device("cpu"))
    scheduler = build_scheduler(optimizer, ScheduleSettings.of(args))
    seen = []
    for _ in range(10):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen[0] == pytest.approx(5e-4) and seen[1] == pytest.approx(1e-3) and seen[-1] == pytest.approx(1e-4)
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95)


def test_no_weight_decay_on_norms_biases_and_embeddings(tiny_model):
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model))
    decay, no_decay = parameter_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert "model.embed_tokens.weight" in skipped and "model.norm.weight" in skipped
    assert "model.layers.0.input_layernorm.weight" in skipped
    assert "model.layers.0.self_attn.q_proj.weight" in decayed and "lm_head.weight" in decayed
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0


# ---- Muon ----

def muon_settings(**keys) -> OptimizerSettings:
    return OptimizerSettings.of(muon_args(**keys))


def muon_args(**keys) -> PreTrainingArguments:
    return PreTrainingArguments(**{"num_training_steps": 10, "micro_batch_size": 1, "dp": 1, "optimizer": "muon",
                                   **keys})


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_update_equals_torch_muon_on_a_matrix(adjust, nesterov):
    """Where torch.optim.Muon applies (a plain 2-D tensor, bf16 iteration) the two take the same steps."""
    torch.manual_seed(0)
    ours, theirs = torch.nn.Parameter(torch.randn(24, 40)), torch.nn.Parameter(torch.randn(24, 40))
    theirs.data.copy_(ours.data)
    mine = MuonAdamW([{"params": [ours], "muon": True}], lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov,
                     ns_steps=5, adjust_lr=adjust, ns_dtype="bf16")
    reference = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov,
                                 adjust_lr_fn=adjust)
    for _ in range(4):
        grad = torch.randn(24, 40)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        mine.step()
        reference.step()
        torch.testing.assert_close(ours.data, theirs.data, rtol=0, atol=0)
    assert not torch.equal(ours.data, torch.randn(24, 40))


def test_orthogonalize_gives_near_unit_singular_values_per_expert_matrix():
    torch.manual_seed(0)
    experts = torch.randn(3, 16, 48) * torch.tensor([1e-3, 1.0, 50.0]).view(3, 1, 1)
    stacked = orthogonalize(experts, 5, torch.float32)
    for e in range(3):
        alone = orthogonalize(experts[e], 5, torch.float32)
        torch.testing.assert_close(stacked[e], alone, rtol=1e-5, atol=1e-6)  # each expert on its own
        singular = torch.linalg.svdvals(alone)
        assert singular.min() > 0.5 and singular.max() < 1.3, singular  # the quintic's band, whatever the scale
    tall = orthogonalize(experts[1].T, 5, torch.float32)
    torch.testing.assert_close(tall, orthogonalize(experts[1], 5, torch.float32).T, rtol=1e-5, atol=1e-6)


def test_muon_takes_hidden_matrices_and_adamw_the_rest(tiny_model, caplog):
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model))
    optimizer = build_optimizer(model, muon_settings(lr=1e-3, muon_lr=2e-3), torch.device("cpu"))
    names = {id(p): n for n, p in model.named_parameters()}
    muon, decay, no_decay = optimizer.param_groups
    assert muon["muon"] and muon["lr"] == 2e-3 and decay["lr"] == no_decay["lr"] == 1e-3
    on_muon = {names[id(p)] for p in muon["params"]}
    assert "model.layers.0.self_attn.q_proj.weight" in on_muon and "model.layers.1.mlp.down_proj.weight" in on_muon
    assert {names[id(p)] for p in decay["params"]} == {"lm_head.weight"}  # the head: AdamW, decayed
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert "model.embed_tokens.weight" in skipped and "model.norm.weight" in skipped
    matrices = [n for n, p in model.named_parameters() if p.dim() == 2]
    assert len(on_muon) == len(matrices) - 2  # every matrix but the embedding and the head

    with caplog.at_level("WARNING", logger="pretrainer"):
        moved = build_optimizer(model, muon_settings(muon_params=["lm_head.*"], adamw_params=["*.mlp.*"]),
                                torch.device("cpu"))
    assert "muon_params 'lm_head.*' moves lm_head.weight onto Muon" in caplog.text
    assert muon_settings(muon_params=["lm_head.*"]).describe().startswith("Muon for hidden matrices and lm_head.* (")
    on_muon = {names[id(p)] for p in moved.param_groups[0]["params"]}
    assert "lm_head.weight" in on_muon and not any(".mlp." in n for n in on_muon)
    with pytest.raises(ConfigError, match=r"adamw_params: pattern 'nothing\.\*' matches no trained parameter"):
        build_optimizer(model, muon_settings(adamw_params=["nothing.*"]), torch.device("cpu"))
    with pytest.raises(ConfigError, match="muon_params: .*norm.* is not a matrix"):
        build_optimizer(model, muon_settings(muon_params=["model.norm.*"]), torch.device("cpu"))


def test_muon_steps_every_group_and_resumes_from_its_state_dict(tiny_model):
    """Both halves move the model; a copy loaded from the state dict takes the same next step."""
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(tiny_model)
    model, copy = AutoModelForCausalLM.from_config(config), AutoModelForCausalLM.from_config(config)
    copy.load_state_dict(model.state_dict())
    settings = muon_settings(lr=1e-3)
    optimizer = build_optimizer(model, settings, torch.device("cpu"))
    ids = torch.randint(0, config.vocab_size, (2, 16))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == set(before)
    assert set(optimizer.state[model.model.layers[0].self_attn.q_proj.weight]) == {"momentum_buffer", "step"}
    assert {"exp_avg", "exp_avg_sq"} <= set(optimizer.state[model.lm_head.weight])

    copy.load_state_dict(model.state_dict())
    resumed = build_optimizer(copy, settings, torch.device("cpu"))
    resumed.load_state_dict(copy_module.deepcopy(optimizer.state_dict()))  # a loaded state holds its own tensors
    for m in (model, copy):
        m(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    resumed.step()
    for (name, a), b in zip(model.named_parameters(), copy.parameters()):
        assert torch.equal(a, b), name


def test_muon_keys_are_checked():
    for keys, message in (({"optimizer": "lion"}, "optimizer 'lion' is not one of adamw, muon"),
                          ({"muon_adjust_lr": "rms"}, "muon_adjust_lr 'rms' is not one of"),
                          ({"muon_momentum": 1.0}, r"muon_momentum must be in \[0, 1\)"),
                          ({"muon_ns_steps": 0}, "muon_ns_steps must be in"),
                          ({"muon_params": "lm_head"}, "key 'muon_params': expected a list"),
                          ({"adamw_params": [""]}, "adamw_params is a list of glob patterns")):
        with pytest.raises(ConfigError, match=message):
            muon_args(**keys)
    settings = muon_settings(dtype="bf16")
    assert settings.muon.ns_dtype == "fp32"  # auto follows the resolved dtype, passed by resolve_run
    assert OptimizerSettings.of(muon_args(), "bf16").muon.ns_dtype == "bf16"
