"""Hugging Face export: `config.json`, safetensors weights and tokenizer files in one folder."""

from __future__ import annotations

import logging
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from ..config import torch_dtype as dtype_to_torch

logger = logging.getLogger(__name__)



@contextmanager
def deepspeed_left_unimported():
    """`save_pretrained` unwraps the model through accelerate, which imports DeepSpeed (0.2 s and a log
    line) only to test `isinstance(model, DeepSpeedEngine)`; no such engine exists unless DeepSpeed was
    already imported, so the check is skipped then."""
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


def export_hf(model: torch.nn.Module, state_dict: dict, tokenizer, out_dir: str | Path, dtype: str) -> Path:
    """Write `save_pretrained` output from a full CPU state dict; the folder appears only when complete."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    torch_dtype = dtype_to_torch(dtype)
    state = {k: v.to(torch_dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    previous_dtype = model.config.dtype
    model.config.dtype = torch_dtype
    model.config.use_cache = True  # the exported model is for inference
    try:
        with deepspeed_left_unimported():
            model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    finally:
        model.config.dtype = previous_dtype
        model.config.use_cache = False
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
        _copy_sentencepiece_model(tokenizer, tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    logger.info("exported Hugging Face model (%s) to %s", dtype, out_dir)
    return out_dir


def _copy_sentencepiece_model(tokenizer, folder: Path) -> None:
    """A SentencePiece `tokenizer.model` beside the tokenizer goes along: slow tokenizers (`use_fast=False`)
    and older transformers load it, and a fast tokenizer's save does not always write it."""
    source = Path(getattr(tokenizer, "name_or_path", "") or "")
    model_file = (source if source.is_dir() else source.parent) / "tokenizer.model"
    if model_file.is_file() and not (folder / "tokenizer.model").exists():
        shutil.copy(model_file, folder / "tokenizer.model")
