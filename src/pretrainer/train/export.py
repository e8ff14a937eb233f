"""Hugging Face export: `config.json`, safetensors weights and tokenizer files in one folder."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from ..config import torch_dtype as dtype_to_torch
from ..config.names import parameter_name
from ..models import mtp_shared_copies, tied_output_names
from .errors import CheckpointError

logger = logging.getLogger(__name__)


@contextmanager
def deepspeed_left_unimported():
    """`save_pretrained` unwraps the model through accelerate, which imports DeepSpeed (0.2 s and a log line) only to
    test `isinstance(model, DeepSpeedEngine)`: pointless unless DeepSpeed is already imported, so skipped then."""
    if "deepspeed" in sys.modules:
        yield
        return
    try:
        import accelerate.utils.other as accelerate_other
    except ImportError:
        yield
        return
    original = accelerate_other.is_deepspeed_available
    accelerate_other.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        accelerate_other.is_deepspeed_available = original


def export_hf(engine, model: torch.nn.Module, tokenizer, out_dir: str | Path, dtype: str,
              max_shard_size: str | int) -> Path | None:
    """Write an HF folder from the engine's model (all ranks call; the main rank writes and gets its path, others None),
    streamed tensor by tensor (docs/loading.md, 'Export without gathering')."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    torch_dtype = dtype_to_torch(dtype)
    hf_model = engine.unwrap(model)
    layout = _saved_layout(hf_model, torch_dtype, max_shard_size) if engine.exports_tensor_by_tensor else None
    if engine.is_main and tmp.exists():
        shutil.rmtree(tmp)
    copies = mtp_shared_copies(hf_model)
    if layout is not None:
        tensors = _with_copies(engine.export_tensors(model), copies)
        if not engine.is_main:
            for _ in tensors:  # take part in gathering every tensor
                pass
            return None
        with _failed_writes_explained(out_dir, tmp, tensors):
            with _no_progress_bar():  # it "writes" one empty weights file
                _save_pretrained(hf_model, tmp, torch_dtype, {}, max_shard_size)  # the config files
            for leftover in tmp.glob("*.safetensors"):
                leftover.unlink()
            _write_streamed(tensors, layout, hf_model, tmp, torch_dtype)
    else:  # every tensor whole on the main rank (empty elsewhere), tensor by tensor where the engine can (which
        # also brings other pipeline stages' tensors), else as its full state dict
        state = {name: tensor for name, tensor in engine.export_tensors(model) if tensor is not None} \
            if engine.exports_tensor_by_tensor else engine.full_state_dict(model)
        if not engine.is_main:
            return None
        state.update({name: state[source].clone() for name, source in copies.items()})
        state = {k: v.to(torch_dtype) if v.is_floating_point() else v for k, v in state.items()}
        with _failed_writes_explained(out_dir, tmp, ()):
            _save_pretrained(hf_model, tmp, torch_dtype, state, max_shard_size)
    with _failed_writes_explained(out_dir, tmp, ()):
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
            _copy_sentencepiece_model(tokenizer, tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    logger.info("exported Hugging Face model (%s) to %s", dtype, out_dir)
    return out_dir


@contextmanager
def _failed_writes_explained(out_dir: Path, tmp: Path, unread_tensors):
    """A failed write (no space, a file-size limit, a failing disk) ends the export with one line, no half-written
    folder. Tensors still to come are read first: the other ranks gather them with us and would fail in a collective."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as exc:
        for _ in unread_tensors:
            pass
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"writing the Hugging Face export {out_dir} failed ({exc}); the run's checkpoints "
                              "are untouched: free space, then write it again with `pretrainer export <config>` "
                              "(--output for another folder)") from None


def _with_copies(tensors, copies: dict[str, str]):
    """The engine's (name, tensor) stream, then the multi-token prediction depths' copies of the embedding and
    head (`mtp_shared_copies`), each of a tensor the stream carried (None on ranks other than the main one)."""
    kept = {}
    for name, tensor in tensors:
        if name in copies.values():
            kept[name] = tensor
        yield name, tensor
    for name, source in copies.items():  # a copy of its own: safetensors refuses tensors that share memory
        yield name, kept[source].clone() if kept[source] is not None else None


@contextmanager
def _no_progress_bar():
    from transformers.utils import logging as transformers_logging

    enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            transformers_logging.enable_progress_bar()


def _save_pretrained(hf_model: torch.nn.Module, folder: Path, torch_dtype: torch.dtype, state: dict,
                     max_shard_size) -> None:
    previous_dtype = hf_model.config.dtype
    hf_model.config.use_cache = True  # the exported model is for inference
    try:
        with deepspeed_left_unimported():
            hf_model.save_pretrained(folder, state_dict=state, safe_serialization=True, max_shard_size=max_shard_size)
        # save_pretrained records the dtype of the parameters it was handed the model with (fp32 masters), not
        # that of the files; `dtype: auto` readers would load a bf16 export in fp32.
        hf_model.config.dtype = torch_dtype
        hf_model.config.save_pretrained(folder)
    finally:
        hf_model.config.dtype = previous_dtype
        hf_model.config.use_cache = False


def _saved_layout(hf_model: torch.nn.Module, torch_dtype: torch.dtype, max_shard_size):
    """Each tensor's file as `save_pretrained` picks it: no tied output head, transformers' saving order (its reverse
    conversion on meta tensors), huggingface_hub's split. None if saving converts tensors (names the model lacks)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    tied = set(tied_output_names(hf_model))
    parameters = dict(hf_model.named_parameters(remove_duplicate=False))
    sizes = {}
    for name, tensor in hf_model.state_dict().items():
        shape = getattr(parameters.get(name), "ds_shape", tensor.shape)  # a ZeRO-3 parameter's own shape
        name = parameter_name(name)
        if name not in tied:
            dtype = torch_dtype if tensor.is_floating_point() else tensor.dtype
            sizes[name] = torch.empty(shape, dtype=dtype, device="meta")
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # older transformers: saved in state-dict order, unconverted
        ordered = sizes
    else:
        ordered = revert_weight_conversion(hf_model, dict(sizes))
    if set(ordered) != set(sizes):
        return None
    for name, source in mtp_shared_copies(hf_model).items():  # after the tensors they copy, as DeepSeek-V3's files
        ordered[name] = sizes[source]
    return split_torch_state_dict_into_shards(ordered, filename_pattern="model{suffix}.safetensors",
                                              max_shard_size=max_shard_size)


def _write_streamed(tensors, layout, hf_model, folder: Path, torch_dtype: torch.dtype) -> None:
    """Consume (name, whole tensor) pairs into `layout`'s files, writing each file as its last tensor arrives
    (save_pretrained's files hold consecutive tensors, so about one file is held at a time)."""
    from safetensors.torch import save_file

    waiting = {file: set(names) for file, names in layout.filename_to_tensors.items()}
    pending: dict[str, dict] = {file: {} for file in waiting}
    for name, tensor in tensors:
        file = layout.tensor_to_filename.get(name)
        if file is None:  # a tied output head
            continue
        pending[file][name] = (tensor.to(torch_dtype) if tensor.is_floating_point() else tensor).contiguous()
        waiting[file].discard(name)
        if not waiting[file]:
            save_file(pending.pop(file), str(folder / file), metadata={"format": "pt"})
    missing = sorted(name for names in waiting.values() for name in names)
    if missing:
        raise RuntimeError(f"export: the engine gave no tensor for {', '.join(missing[:5])}")
    if layout.is_sharded:
        # parameters counted as `num_parameters` does (each once), with ZeRO-3's partitioned ones (empty placeholders)
        total = sum(getattr(p, "ds_numel", p.numel()) for p in hf_model.parameters())
        index = {"metadata": {"total_parameters": total, **layout.metadata},
                 "weight_map": layout.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _copy_sentencepiece_model(tokenizer, folder: Path) -> None:
    """A SentencePiece `tokenizer.model` beside the tokenizer goes along: slow tokenizers (`use_fast=False`)
    and older transformers load it, and a fast tokenizer's save does not always write it."""
    source = Path(getattr(tokenizer, "name_or_path", "") or "")
    model_file = (source if source.is_dir() else source.parent) / "tokenizer.model"
    if model_file.is_file() and not (folder / "tokenizer.model").exists():
        shutil.copy(model_file, folder / "tokenizer.model")
