"""Multi-token prediction (MTP, DeepSeek-V3's report section 2.2): `mtp_num_layers` (D) modules after the model, depth k
predicting the token k + 1 ahead of each position; what a depth computes: docs/multi-token-prediction.md.

Each depth is a decoder layer of the model's class with its extra modules added, appended after the
`num_hidden_layers` layers HF decoders iterate (so the main forward never runs it): its parameters are named as in
DeepSeek-V3's files, and every engine treats it as a layer (FSDP unit, checkpointing, compile, MoE routing hooks).

The depths run after the output head (a forward hook), only in training forwards whose head was handed a
`batch.HeadCall`, reusing the masks and rotary embeddings the last main layer received. Their weighted loss rides
on the head's output (`AddToBackward`), so every engine runs it inside its own backward, behind the hooks it places
on the model's outputs (FSDP gathers embedding and head there; a pipeline schedule runs each backward itself).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch

from ..batch import HeadCall, HeadOutput, depth_inputs, depth_targets
from ..config import ConfigError
from ..config.names import parameter_name
from .chunked_loss import computes_loss, install_head_call
from .moe_routing import AddToBackward

SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # DeepSeek-V3's files repeat these per depth
CONFIG_KEY = "num_nextn_predict_layers"  # DeepSeek-V3's config.json key for the depths its files hold


class MtpDepth:
    """The forward of a multi-token prediction depth, mixed into the model's decoder-layer class."""

    def forward(self, hidden_states: torch.Tensor, *, mtp_embeds: torch.Tensor, **layer_kwargs):
        """(the depth's hidden state for the next depth, its normalised state for the output head)."""
        joined = torch.cat([self.enorm(mtp_embeds), self.hnorm(hidden_states)], dim=-1)
        out = super().forward(self.eh_proj(joined), **layer_kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return out, self.shared_head.norm(out)


@functools.cache
def depth_class(layer_class: type) -> type:
    """`layer_class` with the MTP forward, under the same name (engines find decoder layers by class name)."""
    return type(layer_class.__name__, (MtpDepth, layer_class), {"__module__": layer_class.__module__})


def decoder_layer_list(model: torch.nn.Module) -> torch.nn.ModuleList | torch.nn.ModuleDict:
    """The container of the model's decoder layers: the HF model's ModuleList (its first `num_hidden_layers`
    entries are the main ones), or a ModuleDict keyed by layer index (the megatron engine's view of its stages)."""
    count = model.config.num_hidden_layers
    names = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) >= count and _is_block(module[0], names):
            return module
    layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, torch.nn.ModuleDict):
        return layers
    raise ConfigError(f"mtp_num_layers: cannot find the decoder layers of {type(model).__name__} (no ModuleList of "
                      "its _no_split_modules blocks); multi-token prediction needs an HF decoder with one")


def _is_block(module: torch.nn.Module, names: set[str]) -> bool:
    """Whether `module` is one of the model's decoder blocks, also once an engine has wrapped it (activation
    checkpointing's wrapper holds it; FSDP2 makes its class a subclass of the block's)."""
    inner = getattr(module, "_checkpoint_wrapped_module", module)
    return any(cls.__name__ in names for cls in type(inner).__mro__)


def _depth_indices(model: torch.nn.Module) -> list[int]:
    """The layer indices of the model's MTP depths (`num_hidden_layers` onwards)."""
    try:
        layers = decoder_layer_list(model)
    except ConfigError:
        return []
    count = model.config.num_hidden_layers
    if isinstance(layers, torch.nn.ModuleDict):
        return sorted(int(key) for key in layers if int(key) >= count)
    return list(range(count, len(layers)))


def depth_prefixes(model: torch.nn.Module) -> list[str]:
    """The parameter-name prefix of each of the model's depths, as the files name them (`model.layers.<L + k - 1>.`)."""
    indices = _depth_indices(model)
    if not indices:
        return []
    layers = decoder_layer_list(model)
    prefix = parameter_name(next(name for name, module in model.named_modules() if module is layers))
    return [f"{prefix}.{i}." for i in indices]


def add_mtp_layers(model: torch.nn.Module, depths: int) -> list[torch.nn.Module]:
    """Append `depths` MTP depths on the meta device (an engine materialises them) to the model's decoder layers,
    and record the count in its config (`num_nextn_predict_layers`, which export writes)."""
    config = model.config
    layers = decoder_layer_list(model)
    _check_forward_runs_main_layers_only(model)
    if len(layers) != config.num_hidden_layers:
        raise ConfigError(f"mtp_num_layers: the model already has {len(layers) - config.num_hidden_layers} layers "
                          "past num_hidden_layers")
    final_norm = _final_norm(model)
    hidden = config.hidden_size
    cls = depth_class(type(layers[0]))
    for k in range(depths):
        with torch.device("meta"):
            layer = cls(_config_for_layer(config, config.num_hidden_layers + k), config.num_hidden_layers + k)
            layer.enorm, layer.hnorm = _norm_like(final_norm), _norm_like(final_norm)
            layer.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
            layer.shared_head = torch.nn.Module()
            layer.shared_head.norm = _norm_like(final_norm)
        layers.append(layer.float())
    setattr(config, CONFIG_KEY, depths)
    return list(layers)[config.num_hidden_layers:]


def _check_forward_runs_main_layers_only(model: torch.nn.Module) -> None:
    """The depths are appended to the layer list: the decoder's forward must run its first `num_hidden_layers`
    layers only, as the HF decoders do that slice `self.layers[: self.config.num_hidden_layers]`."""
    import inspect

    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    try:
        source = inspect.getsource(type(base).forward)
    except (TypeError, OSError):
        source = ""
    if "[: self.config.num_hidden_layers]" not in source:
        raise ConfigError(f"mtp_num_layers: {type(base).__name__}'s forward runs every layer of its list (it does "
                          "not stop at num_hidden_layers), so multi-token prediction depths cannot be added to it; "
                          "Llama, Qwen, Mistral, Mixtral, OLMo and DeepSeek-V3 decoders can")


def _final_norm(model: torch.nn.Module) -> torch.nn.Module:
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    norm = getattr(base, "norm", None) or getattr(base, "final_layernorm", None) or getattr(base, "ln_f", None)
    if norm is None:
        raise ConfigError(f"mtp_num_layers: cannot find the final norm of {type(model).__name__} (model.norm); "
                          "multi-token prediction normalises with the model's own norm class")
    return norm


def _norm_like(norm: torch.nn.Module) -> torch.nn.Module:
    """A new norm of the same class and size (its values set when the depth is materialised)."""
    return copy.deepcopy(norm).to("meta")


def _config_for_layer(config, index: int):
    """The config a layer of index `index` past the main ones is built from: per-layer lists (attention types)
    get the last main layer's entry for it."""
    per_layer = getattr(config, "layer_types", None)
    if not isinstance(per_layer, list) or index < len(per_layer):
        return config
    extended = copy.copy(config)
    extended.layer_types = per_layer + [per_layer[-1]] * (index + 1 - len(per_layer))
    return extended


@dataclass
class DepthResult:
    """One depth's part of a forward: its summed cross-entropy (with gradient) and correct predictions."""
    loss_sum: torch.Tensor
    correct: torch.Tensor


class MtpForward:
    """Runs the depths after the output head in training forwards (see the module docstring); `take_results()`
    hands the loop the last forward's per-depth sums."""

    def __init__(self, model: torch.nn.Module):
        self._indices = _depth_indices(model)
        if not self._indices:
            raise ConfigError("mtp_num_layers: the model has no MTP depths")
        self.depths = len(self._indices)
        # read at each forward: the depths run the wrappers an engine may put on its entries (activation checkpointing)
        self._container = decoder_layer_list(model)
        install_head_call(model)  # the head is handed each batch's tokens and targets
        self.embeddings = model.get_input_embeddings()
        self.head = model.get_output_embeddings()
        self._layer_kwargs: dict | None = None
        self._head_input: torch.Tensor | None = None
        self._results: list[list[DepthResult]] = []  # per training forward not yet taken
        self._running = False
        # factor of each depth's summed loss in the backward (set by the loop each step; None: measured, not trained)
        self.loss_weights: torch.Tensor | None = None
        self._container[model.config.num_hidden_layers - 1].register_forward_pre_hook(
            self._keep_layer_kwargs, with_kwargs=True)
        # the head's input as the model hands it over, before an engine's hooks lay it out for the head (the
        # megatron engine's tensor parallelism gathers it): the depths take the layers' layout
        self.head.register_forward_pre_hook(self._keep_head_input)
        self.head.register_forward_hook(self._after_head, with_kwargs=True)

    def _keep_layer_kwargs(self, module, args, kwargs):
        self._layer_kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}

    def _keep_head_input(self, module, args):
        if not self._running:
            self._head_input = args[0]

    def _wanted(self, call: HeadCall | None) -> bool:
        return (self.head.training and torch.is_grad_enabled() and not self._running and call is not None
                and not call.per_token and not call.shapes_only and call.input_ids is not None)

    def _after_head(self, head, inputs, kwargs, output):
        call = kwargs.get("call")
        if not self._wanted(call):
            return None
        self._running = True
        try:
            results = self._run_depths(self._head_input, call)
        finally:
            self._running = False
            self._head_input = None
        self._results.append(results)
        if self.loss_weights is None:
            return None
        weighted = (self.loss_weights * torch.stack([r.loss_sum for r in results]).double()).sum()
        return AddToBackward.apply(output, weighted.to(torch.float32))

    def _run_depths(self, hidden: torch.Tensor, call: HeadCall) -> list[DepthResult]:
        results = []
        input_ids = call.input_ids
        batch = {"shift_labels": call.targets, **({"position_ids": call.position_ids}
                                                  if call.position_ids is not None else {})}
        for k, index in enumerate(self._indices, start=1):
            layer = self._container[index]
            embeds = self.embeddings(depth_inputs(input_ids, k))
            hidden, normed = layer(hidden, mtp_embeds=embeds, **(self._layer_kwargs or {}))
            depth = HeadCall(depth_targets(batch, k).to(input_ids.device))  # per-source losses are the main head's
            output = HeadOutput.of(self.head(normed, call=depth), computes_loss(self.head), depth)
            results.append(_depth_result(output, depth.targets))
        return results

    def take_results(self) -> list[list[DepthResult]]:
        """The depths' results of each training forward since the last take (a pipeline schedule runs several
        before the loop sees any), in order."""
        results, self._results = self._results, []
        return results


def _depth_result(output: HeadOutput, targets: torch.Tensor) -> DepthResult:
    output = output.whole()  # a tensor-parallel head's replicated result
    with torch.no_grad():
        correct = output.correct_count(targets)
    return DepthResult(output.loss_sum(targets), correct.detach())
