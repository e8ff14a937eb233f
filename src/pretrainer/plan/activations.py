"""Activation memory of one decoder layer and of the rest of the model, measured on fake tensors
(docs/plan.md, 'How the prediction is made').

Every tensor autograd saves for backward is counted once (by storage). Parameters are not activations; neither are
the weight copies autocast keeps in the compute dtype (the estimate counts those with the parameters). With
`compile: true` what inductor's partitioner saves is counted; nothing is generated or run, the trace is on fake
tensors. Tensor parallelism is probed on the shard's own config; what stays whole on every rank is divided by tp
again under sequence parallelism.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
from dataclasses import dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..config import expert_shape
from ..config.architecture import Architecture
from ..models import mpt_attention
from ..parallel.activation_checkpoint import SELECTIVE_SAVED_OPS, decoder_layers
from .model_shape import model_shape, one_layer_config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActivationProfile:
    """Bytes for one sequence of the probed length."""
    per_layer: int         # saved for backward by one decoder layer
    selective_layer: int   # what `selective` keeps of one layer (matmul and attention outputs, the input)
    layer_input: int       # one layer's input (what `full` keeps)
    rest: int              # embedding output, final norm, rotary tables


class _MatmulOutputs(TorchDispatchMode):
    """Sums the output bytes of the ops `selective` recomputation keeps."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in SELECTIVE_SAVED_OPS:
            first = out[0] if isinstance(out, (tuple, list)) else out
            self.bytes += first.numel() * first.element_size()
        return out


@contextlib.contextmanager
def as_on_real_tensors():
    """transformers takes fake tensors for a compiler's trace: it then cannot read the positions to rule out packed
    sequences, nor the offset that lets it skip the mask, and builds an explicit causal mask (repeating GQA keys) where
    a real forward runs the mask-free causal kernel. A probe tells it what real tensors show: no packed sequences, a
    readable offset (tests/test_plan.py compares with real tensors, catching transformers changes)."""
    from transformers import masking_utils

    saved = {name: getattr(masking_utils, name, None) for name in ("is_tracing", "find_packed_sequence_indices")}
    if None in saved.values():
        yield
        return
    tracing = saved["is_tracing"]
    masking_utils.is_tracing = lambda tensor=None: tracing() if tensor is None or tensor.dim() == 0 else tracing(tensor)
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(masking_utils, name, value)


def _partition_only():
    """A `torch.compile` backend that splits each traced layer into forward and backward as inductor does, and
    runs the two graphs as traced (no code generation): what the forward saves is then what a compiled run saves."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def as_traced(graph_module, example_inputs):
        return graph_module.forward
    return aot_autograd(fw_compiler=as_traced, bw_compiler=as_traced,
                        partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))


def _saved_bytes(config, seq_length: int, autocast_dtype, param_dtype, compiled: bool = False
                 ) -> tuple[int, int, int]:
    """(saved bytes, kept-by-selective bytes, hidden-state bytes) of the decoder of `config` for one sequence;
    `compiled`: each decoder layer compiled (kept-by-selective is then not measured: 0)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef
    from transformers import AutoModelForCausalLM

    with FakeTensorMode():
        model = AutoModelForCausalLM.from_config(config, dtype=param_dtype)
        mpt_attention.install(model, announce=False)  # as models/build.py builds it
        parameters = list(model.parameters())
        owned = {StorageWeakRef(p.untyped_storage()) for p in parameters}
        weight_shapes = {tuple(p.shape) for p in parameters if p.dim() >= 2}
        saved: dict = {}

        def pack(tensor):
            ref = StorageWeakRef(tensor.untyped_storage())
            is_weight_copy = autocast_dtype is not None and tensor.dim() >= 2 and tuple(tensor.shape) in weight_shapes
            if ref not in owned and not is_weight_copy:
                saved[ref] = tensor.untyped_storage().nbytes()
            return tensor

        if compiled:
            torch._dynamo.reset()  # a fresh trace per probe: cached graphs of other shapes would turn dynamic
            backend = _partition_only()
            for layer in decoder_layers(model):
                layer.compile(backend=backend, dynamic=False)
        ids = torch.zeros((1, seq_length), dtype=torch.long)
        cast = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
        # dynamo does not trace under a dispatch mode: compiled layers are not counted by op
        kept = contextlib.nullcontext(_MatmulOutputs()) if compiled else _MatmulOutputs()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast, kept as counted, as_on_real_tensors():
            hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
        return sum(saved.values()), counted.bytes, hidden.numel() * hidden.element_size()


def tensor_parallel_config(config, tp: int):
    """The config of one tensor-parallel shard: heads, kv heads and ffn width divided by `tp`."""
    shard, arch = copy.deepcopy(config), Architecture.of(config)
    shard.head_dim = arch.head_dim
    shard.num_attention_heads = arch.heads // tp
    shard.num_key_value_heads = max(1, arch.kv_heads // tp)
    shard.intermediate_size = arch.intermediate // tp
    return shard


def shard_reference(config, tp: int):
    """(reference, shard): `config` and its tensor-parallel shard where the family builds the shard's layer from the
    divided heads and width (its matrices then hold 1/tp of the whole layer's); else a Llama layer of the same shape and
    its shard, from which the share tensor parallelism splits is taken. GPT-2's fused attention keeps its full width
    whatever the heads, and Falcon's head_dim follows hidden / heads, so their configs cannot describe a shard."""
    try:
        shard = tensor_parallel_config(config, tp)
        whole_layer, shard_layer = (model_shape(c).layer_parameters for c in (config, shard))
        if abs(shard_layer * tp - whole_layer) <= 0.1 * whole_layer:
            return config, shard
    except (AttributeError, TypeError, ValueError):  # a field the family derives (a property without a setter)
        pass
    stand_in = llama_of_shape(Architecture.of(config))
    return stand_in, tensor_parallel_config(stand_in, tp)


def llama_of_shape(arch: Architecture):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=arch.hidden, num_hidden_layers=arch.layers, num_attention_heads=arch.heads,
                       num_key_value_heads=arch.kv_heads, head_dim=arch.head_dim, intermediate_size=arch.intermediate,
                       vocab_size=arch.vocab, max_position_embeddings=arch.max_positions or 4096,
                       tie_word_embeddings=arch.tied)


@functools.lru_cache(maxsize=256)
def _probe(config_json: str, seq_length: int, autocast_name: str | None, param_name: str,
           compiled: bool = False) -> ActivationProfile:
    from transformers import AutoConfig

    from ..config import torch_dtype

    config = with_plain_rope(AutoConfig.for_model(**json.loads(config_json)))
    autocast_dtype, param_dtype = (torch_dtype(autocast_name) if autocast_name else None), torch_dtype(param_name)
    if expert_shape(config, "the model config") is not None:  # routing reads token values: no fake-tensor run
        logger.info("activations of %s estimated by formula (a Mixture-of-Experts layer's tokens per expert are "
                    "known only on real data; counted at an even load)", config.model_type)
        return _formula(config, seq_length, autocast_name or param_name, param_name)
    try:
        one, two = (_saved_bytes(one_layer_config(config, n), seq_length, autocast_dtype, param_dtype) for n in (1, 2))
    except Exception as exc:  # a forward that reads tensor values (fake tensors have none), or another failure
        logger.info("activations of %s estimated by formula: its forward does not run on fake tensors (%s)",
                    config.model_type, str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        return _formula(config, seq_length, autocast_name or param_name, param_name)
    per_layer = two[0] - one[0]
    eager = ActivationProfile(per_layer=per_layer, selective_layer=(two[1] - one[1]) + one[2], layer_input=one[2],
                              rest=max(one[0] - per_layer, 0))
    if not compiled:
        return eager
    # the layer's saved bytes as the compiled layer saves them (what `selective` keeps is chosen by its policy, not by
    # the compiler: it stays as measured eagerly)
    try:
        one, two = (_saved_bytes(one_layer_config(config, n), seq_length, autocast_dtype, param_dtype, compiled=True)
                    for n in (1, 2))
    except Exception as exc:  # a layer the tracer cannot take: the eager count is the upper bound
        logger.info("activations of compiled %s layers counted as eager ones: the trace failed (%s)",
                    config.model_type, str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        return eager
    return replace(eager, per_layer=two[0] - one[0])


def with_plain_rope(config):
    """The config with its RoPE scaling removed: scaling changes the rotary values, not the shapes, and dynamic
    (NTK) scaling reads the positions, which fake tensors do not have."""
    if hasattr(config, "rope_parameters"):  # transformers 5 (rope_scaling is another name for it)
        parameters = config.rope_parameters
        if isinstance(parameters, dict) and parameters.get("rope_type", "default") != "default":
            config.rope_parameters = {"rope_type": "default", "rope_theta": parameters.get("rope_theta", 10000.0)}
    elif getattr(config, "rope_scaling", None):
        config.rope_scaling = None
    return config


def active_ffn_width(config) -> int:
    """The MLP width a token goes through: the dense MLP's, or an MoE layer's top_k and shared experts (even load)."""
    ffn = Architecture.of(config).intermediate
    shape = expert_shape(config, "the model config")
    if shape is None:
        return ffn
    expert_ffn = getattr(config, "moe_intermediate_size", None) or ffn
    shared = (getattr(config, "n_shared_experts", None) or 0) * expert_ffn \
        + (getattr(config, "shared_expert_intermediate_size", None) or 0)
    return shape.top_k * expert_ffn + shared


def _formula(config, seq_length: int, compute: str, param: str) -> ActivationProfile:
    """Saved bytes of a Llama-like layer per sequence when the probe cannot run (an MoE layer: its top_k experts
    and shared experts), in the compute dtype."""
    arch = Architecture.of(config)
    hidden, kv_width, ffn = arch.hidden, arch.kv_heads * arch.head_dim, active_ffn_width(config)
    shape = expert_shape(config, "the model config")
    routing = 0 if shape is None else 2 * shape.experts + 2 * shape.top_k  # logits, probabilities, top-k
    per_token = 10 * hidden + 4 * ffn + 2 * kv_width + routing
    size = 4 if compute == "fp32" else 2
    layer_input = seq_length * hidden * (4 if param == "fp32" else 2)
    per_layer = seq_length * per_token * size
    return ActivationProfile(per_layer=per_layer, selective_layer=per_layer // 2, layer_input=layer_input,
                             rest=2 * layer_input)


def on_tensor_parallel_rank(whole: float, shard: float, tp: int, sequence_parallel: bool) -> float:
    """One tensor-parallel rank's share of a layer's figure, from the whole layer's and its shard's: whole = R + S
    and shard = R + S / tp, where S is what tensor parallelism splits and R what every rank repeats (norms,
    residual adds), which sequence parallelism splits too."""
    split = (whole - shard) * tp / (tp - 1)
    repeated = whole - split
    return shard - (repeated - repeated / tp if sequence_parallel else 0)


def probe(config, seq_length: int, dtype: str, autocast: bool, tp: int = 1,
          sequence_parallel: bool = False, compiled: bool = False) -> ActivationProfile:
    """Activation bytes of one sequence of `seq_length` tokens on one rank. `autocast`: fp32 parameters computed in
    `dtype` under autocast (the residual stream stays fp32); otherwise the parameters themselves are in `dtype`
    (DeepSpeed, FSDP mixed precision). `compiled`: the layers run compiled."""
    low = dtype != "fp32"
    measure = functools.partial(_probe, seq_length=seq_length, autocast_name=dtype if autocast and low else None,
                                param_name="fp32" if autocast or not low else dtype, compiled=compiled)
    whole = measure(config.to_json_string())
    if tp == 1:
        return whole
    reference, shard_config = shard_reference(config, tp)
    ref = whole if reference is config else measure(reference.to_json_string())
    shard = measure(shard_config.to_json_string())
    per_layer = on_tensor_parallel_rank(ref.per_layer, shard.per_layer, tp, sequence_parallel)
    layer_input = whole.layer_input // tp if sequence_parallel else whole.layer_input
    selective = shard.selective_layer - whole.layer_input + layer_input
    scale = whole.per_layer / ref.per_layer  # the family's own layer, split as its stand-in's is
    return ActivationProfile(per_layer=round(per_layer * scale), selective_layer=round(selective * scale),
                             layer_input=layer_input, rest=whole.rest)
