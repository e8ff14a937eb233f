"""Bytes the element-wise kernels of one decoder layer move, measured on fake tensors.

Everything in a layer that is not a matmul or the attention kernel (norms, rotary, activations, residual adds, casts,
copies, their backward) reads and writes its tensors once per kernel, and on an accelerator runs at memory speed. Those
bytes depend on the family's own code (HF's eager RMSNorm upcasts to fp32 and makes about 16 passes over a hidden row
per norm; MPT has no rotary, a fused LayerNorm and an ungated GELU MLP), so they are counted, not assumed: the model's
forward and backward run under `FakeTensorMode` with one and with two decoder layers, and a dispatch mode adds up the
input and output bytes of every op but matmuls, attention, the embedding, views and allocations. The difference is one
layer. Forward and backward are kept apart: recomputation runs the forward's again.

Tensor parallelism is measured on the shard as the activation probe does (activations.py): what the shard moves beside
the whole layer gives the part tensor parallelism splits and the part every rank repeats (norms, residual adds), which
sequence parallelism splits too. A Mixture-of-Experts layer (its routing reads token values), or a layer that does not
run on fake tensors, is counted by a Llama-layer formula of its widths.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..config import expert_shape
from ..config.architecture import Architecture
from ..models import mpt_attention
from .activations import active_ffn_width, as_on_real_tensors, on_tensor_parallel_rank, shard_reference, with_plain_rope
from .model_shape import one_layer_config

logger = logging.getLogger(__name__)

# ops whose time is not memory traffic (matmuls, attention: timed by their FLOPs) or that move nothing
_NOT_ELEMENTWISE = {
    "mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "embedding", "embedding_dense_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand", "slice", "select",
    "unsqueeze", "squeeze", "detach", "alias", "as_strided", "split", "split_with_sizes", "unbind", "lift_fresh",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like", "new_zeros",
    "ones", "ones_like", "full", "arange", "scalar_tensor", "device",
}
# When the layer cannot be measured: an eager Llama layer's rows of hidden and ffn width read or written per token,
# forward and backward, 30% of them in forward (Llama 3.1 8B's layer measures 5% below these and 30%)
FORMULA_ROWS = {"hidden": 120, "ffn": 36}
FORMULA_FORWARD_SHARE = 0.3


@dataclass(frozen=True)
class LayerTraffic:
    """Bytes one token moves through one decoder layer's element-wise kernels on one rank."""
    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward


class _ElementwiseBytes(TorchDispatchMode):
    """Adds up the input and output bytes of the element-wise ops that run under it."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket.__name__ not in _NOT_ELEMENTWISE:  # tensors in lists too (cat's inputs)
            self.bytes += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs or {}, out))
                              if isinstance(t, torch.Tensor))
        return out


def decoder_traffic(model, seq_length: int, autocast_dtype=None) -> tuple[int, int]:
    """(forward, backward) bytes `model`'s decoder element-wise ops move per sequence (fake or real tensors alike)."""
    ids = torch.zeros((1, seq_length), dtype=torch.long)
    cast = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    with as_on_real_tensors():
        with cast, _ElementwiseBytes() as forward:
            hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
        with _ElementwiseBytes() as backward:
            hidden.backward(torch.ones_like(hidden))
    return forward.bytes, backward.bytes


def _model_traffic(config, seq_length: int, autocast_dtype, param_dtype) -> tuple[int, int]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    with FakeTensorMode():
        model = AutoModelForCausalLM.from_config(config, dtype=param_dtype)
        mpt_attention.install(model, announce=False)  # as models/build.py builds it
        return decoder_traffic(model, seq_length, autocast_dtype)


@functools.lru_cache(maxsize=256)
def _measure(config_json: str, seq_length: int, autocast_name: str | None, param_name: str) -> LayerTraffic:
    from transformers import AutoConfig

    from ..config import torch_dtype

    config = with_plain_rope(AutoConfig.for_model(**json.loads(config_json)))
    autocast_dtype = torch_dtype(autocast_name) if autocast_name else None
    if expert_shape(config, "the model config") is not None:  # as the activation probe: routing reads token values
        return _formula(config, autocast_name or param_name)
    try:
        one, two = (_model_traffic(one_layer_config(config, n), seq_length, autocast_dtype, torch_dtype(param_name))
                    for n in (1, 2))
    except Exception as exc:  # a forward that reads tensor values (routing), or another failure
        logger.info("element-wise traffic of %s counted by formula: its layer does not run on fake tensors (%s)",
                    config.model_type, str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        return _formula(config, autocast_name or param_name)
    return LayerTraffic((two[0] - one[0]) / seq_length, (two[1] - one[1]) / seq_length)


def _formula(config, dtype_name: str) -> LayerTraffic:
    size = 4 if dtype_name == "fp32" else 2
    total = (FORMULA_ROWS["hidden"] * Architecture.of(config).hidden + FORMULA_ROWS["ffn"] * active_ffn_width(config)
             ) * size
    return LayerTraffic(total * FORMULA_FORWARD_SHARE, total * (1 - FORMULA_FORWARD_SHARE))


def layer_traffic(config, seq_length: int, dtype: str, autocast: bool, tp: int = 1,
                  sequence_parallel: bool = False) -> LayerTraffic:
    """Element-wise bytes per token of one decoder layer on one rank (dtypes as `activations.probe` takes them)."""
    low = dtype != "fp32"
    measure = functools.partial(_measure, seq_length=seq_length, autocast_name=dtype if autocast and low else None,
                                param_name="fp32" if autocast or not low else dtype)
    whole = measure(config.to_json_string())
    if tp == 1:
        return whole
    reference, shard_config = shard_reference(config, tp)
    ref = whole if reference is config else measure(reference.to_json_string())
    shard = measure(shard_config.to_json_string())
    scale = whole.total / ref.total if ref.total else 1.0  # the family's own layer, split as its stand-in's is
    return LayerTraffic(*(on_tensor_parallel_rank(getattr(ref, part), getattr(shard, part), tp, sequence_parallel)
                          * scale for part in ("forward", "backward")))
