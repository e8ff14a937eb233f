"""HF <-> Megatron-Core weight layouts: exact round trips, tensor-parallel shards, and a real Megatron-Core
GPTModel (built on CPU) that loads the converted weights and computes what the HF modules compute.

Megatron-Core's attention kernel and rotary embedding need CUDA, so on CPU the check covers what the
conversion decides (q/k/v grouping, gate/up fusion, norms, embedding, head) module by module.
"""

from __future__ import annotations

import pytest
import torch

from pretrainer.models.megatron_core_weights import (
    hf_to_mcore,
    mcore_to_hf,
    tensor_parallel_merge,
    tensor_parallel_shard,
)
from pretrainer.models.registry import parse_model_config

SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=64)


def hf_model(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if kind == "qwen2":  # q/k/v biases
        return Qwen2ForCausalLM(Qwen2Config(**SIZES, tie_word_embeddings=False))
    return LlamaForCausalLM(LlamaConfig(**SIZES, tie_word_embeddings=kind == "tied"))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "tied"])
@pytest.mark.parametrize("fused_norms", [False, True], ids=["local-spec", "te-spec"])
def test_round_trip_is_exact(kind, fused_norms):
    model = hf_model(kind)
    shape = parse_model_config(model)
    state = model.state_dict()
    back = mcore_to_hf(hf_to_mcore(state, shape, fused_norms), shape, fused_norms)
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_tensor_parallel_shards_hold_whole_query_groups_and_merge_back():
    model = hf_model("qwen2")
    shape = parse_model_config(model)
    hf = model.state_dict()
    whole = hf_to_mcore(hf, shape)
    shards = [tensor_parallel_shard(whole, shape, rank, 2) for rank in range(2)]
    merged = tensor_parallel_merge(shards)
    assert all(torch.equal(merged[k], whole[k]) for k in whole)
    head, groups, heads = shape.kv_channels, shape.num_query_groups, shape.num_attention_heads
    for rank, shard in enumerate(shards):  # rank r: query heads and KV heads of its query groups only
        q_rows = slice(rank * heads // 2 * head, (rank + 1) * heads // 2 * head)
        kv_rows = slice(rank * groups // 2 * head, (rank + 1) * groups // 2 * head)
        expected = torch.cat([hf["model.layers.0.self_attn.q_proj.weight"][q_rows].reshape(groups // 2, -1, 64),
                              hf["model.layers.0.self_attn.k_proj.weight"][kv_rows].reshape(groups // 2, -1, 64),
                              hf["model.layers.0.self_attn.v_proj.weight"][kv_rows].reshape(groups // 2, -1, 64)],
                             dim=1).reshape(-1, 64)
        assert torch.equal(shard["decoder.layers.0.self_attention.linear_qkv.weight"], expected)
        half = SIZES["intermediate_size"] // 2
        fc1 = shard["decoder.layers.0.mlp.linear_fc1.weight"]
        assert torch.equal(fc1[:half], hf["model.layers.0.mlp.gate_proj.weight"][rank * half:(rank + 1) * half])
        assert torch.equal(fc1[half:], hf["model.layers.0.mlp.up_proj.weight"][rank * half:(rank + 1) * half])


@pytest.fixture
def model_parallel_state():
    pytest.importorskip("megatron.core", reason="megatron-core is in the test extra")
    import torch.distributed as dist
    from megatron.core import parallel_state

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_megatron_core_gptmodel_loads_the_weights_and_computes_what_hf_computes(model_parallel_state, kind):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    hf = hf_model(kind).eval()
    shape = parse_model_config(hf)
    args = shape.megatron_args
    config = TransformerConfig(num_layers=shape.num_layers, hidden_size=shape.hidden_size,
                               num_attention_heads=shape.num_attention_heads,
                               num_query_groups=shape.num_query_groups, ffn_hidden_size=shape.ffn_hidden_size,
                               kv_channels=shape.kv_channels, normalization="RMSNorm",
                               layernorm_epsilon=args["norm_epsilon"], gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False, add_qkv_bias=args["add_qkv_bias"],
                               use_cpu_initialization=True, params_dtype=torch.float32)
    mcore = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=shape.vocab_size, max_sequence_length=64, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False).eval()
    result = mcore.load_state_dict(hf_to_mcore(hf.state_dict(), shape), strict=False)
    assert not result.unexpected_keys
    assert all(key.endswith("_extra_state") for key in result.missing_keys), result.missing_keys

    torch.manual_seed(1)
    hidden = torch.randn(12, 2, shape.hidden_size)  # Megatron's [sequence, batch, hidden]
    theirs, ours = mcore.decoder.layers[1], hf.model.layers[1]
    with torch.no_grad():
        query, key, value = theirs.self_attention.get_query_key_value_tensors(hidden)
        for got, projection in ((query, ours.self_attn.q_proj), (key, ours.self_attn.k_proj),
                                (value, ours.self_attn.v_proj)):
            torch.testing.assert_close(got, projection(hidden).reshape(got.shape))
        torch.testing.assert_close(theirs.mlp(hidden)[0], ours.mlp(hidden))
        torch.testing.assert_close(theirs.input_layernorm(hidden), ours.input_layernorm(hidden))
        torch.testing.assert_close(theirs.pre_mlp_layernorm(hidden), ours.post_attention_layernorm(hidden))
        attention_out = torch.randn(12, 2, shape.num_attention_heads * shape.kv_channels)
        torch.testing.assert_close(theirs.self_attention.linear_proj(attention_out)[0],
                                   ours.self_attn.o_proj(attention_out))
        ids = torch.randint(0, shape.vocab_size, (2, 12))
        torch.testing.assert_close(mcore.embedding(input_ids=ids, position_ids=None),
                                   hf.model.embed_tokens(ids).transpose(0, 1))
        torch.testing.assert_close(mcore.output_layer(hidden)[0], hf.lm_head(hidden))
