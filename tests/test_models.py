"""Model building: random init from a config on the meta device, materialised once; weights loaded from HF folders."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from helpers import write_tiny_model
from launch import run_ok
from pretrainer import PreTrainingArguments
from pretrainer.models import build_model, materialize, preflight


def test_random_init_peak_memory_is_one_copy_of_the_weights(tmp_path):
    """A 98M-parameter config: building it raises peak RSS by about one fp32 copy, never two."""
    model_dir = write_tiny_model(tmp_path / "m", hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                 num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=256)
    script = textwrap.dedent(f"""
        import resource, torch
        from pretrainer import PreTrainingArguments
        from pretrainer.models import build_model, materialize, preflight, count_parameters
        args = PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1, model_path={str(model_dir)!r})
        spec = preflight(args)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        model = build_model(args, spec)
        materialize(model, torch.device("cpu"), seed=0)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(after - before, 4 * count_parameters(model))
    """)
    done = run_ok([sys.executable, "-c", script])
    growth, weight_bytes = map(int, done.stdout.split()[-2:])
    assert weight_bytes > 350e6
    assert growth < 1.3 * weight_bytes, (growth, weight_bytes)


def test_init_is_seeded_and_uses_init_method_std(tmp_path):
    model_dir = write_tiny_model(tmp_path / "m")
    args = PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1, model_path=str(model_dir),
                                init_method_std=0.05)
    spec = preflight(args)
    model = build_model(args, spec)
    assert model.model.layers[0].self_attn.q_proj.weight.is_meta  # nothing allocated before the engine places it
    materialize(model, torch.device("cpu"), seed=0)
    weight = model.model.layers[0].self_attn.q_proj.weight
    assert abs(weight.std().item() - 0.05) < 0.005
    assert model.model.layers[0].input_layernorm.weight.eq(1).all()
    rotary = model.model.rotary_emb.inv_freq
    assert torch.isfinite(rotary).all() and rotary[0] == 1.0  # buffers computed, not left uninitialised


def test_init_depends_on_the_seed_only(tmp_path):
    args = PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1,
                                model_path=str(write_tiny_model(tmp_path / "m")))
    models = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed * 7)  # the global RNG plays no part
        model = build_model(args, preflight(args))
        materialize(model, torch.device("cpu"), seed=seed)
        models.append(model.state_dict())
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])
    assert not torch.equal(models[0]["model.embed_tokens.weight"], models[2]["model.embed_tokens.weight"])


def test_folder_with_weights_is_loaded_not_reinitialised(tmp_path):
    model_dir = write_tiny_model(tmp_path / "m")
    args = PreTrainingArguments(num_training_steps=1, micro_batch_size=1, dp=1, model_path=str(model_dir))
    original = build_model(args, preflight(args))
    materialize(original, torch.device("cpu"), seed=1)
    original.save_pretrained(model_dir)
    spec = preflight(args)
    assert spec.has_weights
    loaded = build_model(args, spec)
    for (name, a), b in zip(original.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert loaded.config.use_cache is False


@pytest.mark.parametrize("family, fields, expected", [
    ("GPT2Config", dict(n_embd=64, n_head=4, n_layer=2), dict(intermediate=256, kv_heads=4, head_dim=16, tied=True)),
    ("GPTNeoXConfig", dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=96),
     dict(intermediate=96, kv_heads=4, tied=False)),
    ("FalconConfig", dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, multi_query=True,
                          new_decoder_architecture=False), dict(kv_heads=1, intermediate=256)),
    ("FalconConfig", dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, new_decoder_architecture=True,
                          num_kv_heads=2), dict(kv_heads=2)),
    ("PhiConfig", dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128),
     dict(intermediate=128, kv_heads=4)),
    ("GemmaConfig", dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128,
                         num_key_value_heads=1, head_dim=32), dict(kv_heads=1, head_dim=32, tied=True)),
    ("OlmoConfig", dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128),
     dict(intermediate=128)),
    ("MixtralConfig", dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128,
                           num_key_value_heads=2), dict(kv_heads=2, tied=False)),
    ("DeepseekV3Config", dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128),
     dict(intermediate=128)),
])
def test_every_family_reads_into_one_architecture(family, fields, expected):
    """Each family's own field names (GPT-2's n_inner, Falcon's multi_query and num_kv_heads, ...) read into the
    one shape that the planner, the megatron parser and the FLOPs count use."""
    import transformers

    from pretrainer.config.architecture import Architecture

    arch = Architecture.of(getattr(transformers, family)(**fields))
    assert (arch.layers, arch.hidden, arch.heads) == (2, 64, 4)
    assert {key: getattr(arch, key) for key in expected} == expected
