"""Fill a model built on the meta device straight from an HF checkpoint's safetensors files, slice by slice.

An engine that shards or splits the model (FSDP, the megatron engine's tp/pp) lays it out on the meta device first; each
rank then reads only its part of each tensor (its DTensor shard's rows or columns, at DTensor's own offsets) with
safetensors' sliced reads, cast to the master dtype one tensor at a time: no rank ever holds the whole model, in any
dtype. (DeepSpeed ZeRO-3 reads whole tensors module by module and partitions each module at once: `init.materialize`.) A
vocabulary grown for an extended tokenizer grows the embedding and head as they are read (`grow_vocabulary`).

Names in the laid-out model map to the files' by `parameter_name` (config/names.py: wrapper segments dropped), as for
export. A tied output embedding reads the input embedding's tensor when the files hold only that one. Where transformers
converts tensors as it loads them (per-expert matrices stacked into one MoE parameter: hf_conversions.py), a rank reads
only its experts' rows of each.
"""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ..config import ConfigError
from ..config.names import parameter_name
from .hf_conversions import Conversions, Stacking, conversions_of
from .mtp import SHARED_COPIES, depth_prefixes

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
_ATTRIBUTE = "_pretrainer_checkpoint_tensors"  # on the model until the engine materialises it


@dataclass
class LoadStats:
    bytes_read: int = 0   # bytes of this rank's slices, in the files' dtype
    seconds: float = 0.0
    peak_rss_bytes: int = 0  # the process's peak RSS once every tensor is read (before the engine goes on)
    unused: list = field(default_factory=list)  # tensors in the files that no parameter took


class CheckpointTensors:
    """The tensors of one HF folder's safetensors files: where each lives, its shape, and sliced reads."""

    def __init__(self, folder: Path, files: dict[str, Path], shapes: dict[str, tuple], prefix: str,
                 aliases: dict[str, str], conversions: Conversions | None = None):
        self.folder = folder
        self.files = files          # tensor name -> file
        self.shapes = shapes        # tensor name -> shape in the file
        self.prefix = prefix        # the model's base_model_prefix ("model"): a base-model checkpoint omits it
        self.aliases = aliases      # tied output embedding -> input embedding name
        self.conversions = conversions or Conversions()
        # model names read from per-expert tensors, with the spelling of the model's name in the files (locate)
        self._stacked: dict[str, tuple[Stacking, str]] = {}
        self.stats = LoadStats()
        self._taken: set[str] = set()
        self.grower = None          # vocab_growth.RowGrower when the model's vocabulary is larger than the files'
        self.grown: list[str] = []  # the names (in the files) of the matrices it grows, in the model's order

    def grow_vocabulary(self, grower, model: torch.nn.Module) -> None:
        """The input embedding and an untied output head have `grower.growth.new_size` rows; the files hold
        the old ones. Each is read whole, grown as `grow_embeddings` grows a loaded model, then sliced."""
        self.grower = grower
        self.grown = [name for name in dict.fromkeys(_embedding_names(model)) if name and name in self.files]

    @classmethod
    def open(cls, folder: str | Path, model: torch.nn.Module) -> CheckpointTensors:
        """The folder's safetensors tensors (`reads_checkpoint_in_slices` has seen that it has some)."""
        from safetensors import safe_open

        folder = Path(folder)
        index = folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"{index}: not a safetensors index ({exc}); it needs a \"weight_map\" of "
                                  "tensor name -> file") from None
            paths = [folder / file for file in dict.fromkeys(weight_map.values())]
        else:
            paths = sorted(folder.glob("*.safetensors"))
        if not paths:
            raise ConfigError(f"model_path {folder}: no safetensors files to read; set sliced_weight_loading: false")
        files, shapes = {}, {}
        for path in paths:
            if not path.is_file():
                raise ConfigError(f"{index}: lists {path.name}, which is not in {folder}; download it again "
                                  "or fix the index")
            try:
                with safe_open(str(path), framework="pt") as handle:
                    for name in handle.keys():
                        files[name] = path
                        shapes[name] = tuple(handle.get_slice(name).get_shape())
            except Exception as exc:  # safetensors raises its own error types for damaged files
                raise ConfigError(f"{path}: cannot be read as safetensors ({str(exc)[:200]}); the file may be "
                                  "cut short: download it again") from None
        return cls(folder, files, shapes, getattr(model, "base_model_prefix", "") or "", _tied_aliases(model),
                   conversions_of(model.config))

    # ------------------------------------------------------------ names
    def locate(self, name: str) -> str | None:
        """The name in the files of the model's parameter `name`, or None when the files lack it. A tensor the
        files hold per expert (the model stacks them) is located by the model's own name."""
        name = parameter_name(name)
        candidates = [name, self.aliases.get(name)]
        if self.prefix and name.startswith(self.prefix + "."):  # saved from the base model (no head)
            candidates.append(name[len(self.prefix) + 1:])
        spelt = [spelling for c in candidates if c for spelling in self.conversions.file_candidates(c)]
        found = next((c for c in spelt if c in self.files), None)
        if found is not None:
            return found
        stacking = self.conversions.stacking(name)
        if stacking is not None:
            for spelling in self.conversions.file_candidates(name):
                if all(part in self.files for part in stacking.file_names(spelling, 0)):
                    self._stacked[name] = (stacking, spelling)
                    return name
        return None

    def check(self, model: torch.nn.Module, within: tuple[str, ...] = ("",)) -> None:
        """Every parameter (whose name starts with one of `within`) is in the files with the shape the config
        gives, before anything is read; multi-token prediction depths may be missing (they are initialised)."""
        problems = []
        optional = tuple(depth_prefixes(model))  # MTP depths the files may lack: initialised (models/mtp.py)
        for name, parameter in model.named_parameters():
            if not parameter_name(name).startswith(within):
                continue
            found = self.locate(name)
            if found is None and parameter_name(name).startswith(optional):
                continue
            if found is None:
                problems.append(f"tensor '{parameter_name(name)}' is missing from the checkpoint")
            elif found in self._stacked:
                problems += self._check_stacked(found, tuple(parameter.shape))
            elif tuple(self.shapes[found]) != self._stored_shape(found, tuple(parameter.shape)):
                problems.append(f"tensor '{found}' in {self.files[found].name} has shape "
                                f"{list(self.shapes[found])}; the config gives "
                                f"{list(self._stored_shape(found, tuple(parameter.shape)))}")
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise ConfigError(f"model_path {self.folder}: the weights do not match the model's config.json: "
                              + "; ".join(problems[:5]) + more + ". Check that config.json belongs to these "
                              "weight files (same model size and vocabulary)")

    def _check_stacked(self, name: str, shape: tuple) -> list[str]:
        """Every expert's parts are in the files, and stacked and concatenated they make `shape`."""
        stacking, spelling = self._stacked[name]
        parts = [stacking.file_names(spelling, expert) for expert in range(shape[0])]
        missing = [part for names in parts for part in names if part not in self.files]
        if missing:
            return [f"tensor '{missing[0]}' is missing from the checkpoint ({len(missing)} expert tensor(s) of "
                    f"'{name}')"]
        first = [self.shapes[part] for part in parts[0]]
        stacked = (shape[0], sum(s[0] for s in first), *first[0][1:])
        if stacked != shape or any(self.shapes[part] != first[i] for names in parts for i, part in enumerate(names)):
            return [f"the per-expert tensors '{parts[0][0]}', ... stack to {list(stacked)}; the config gives "
                    f"{list(shape)} for '{name}'"]
        return []

    def _stored_shape(self, name: str, shape: tuple) -> tuple:
        """The shape the files should hold for a parameter of `shape` (a grown matrix: the old rows)."""
        return (self.grower.growth.old_size, *shape[1:]) if name in self.grown else shape

    # ------------------------------------------------------------ reads
    @torch.no_grad()
    def fill(self, target: torch.Tensor, name: str) -> None:
        """Copy this rank's part of tensor `name` (a name in the files) into `target`, cast to its dtype."""
        from safetensors import safe_open

        start = time.perf_counter()
        local = target.to_local() if isinstance(target, DTensor) else target
        # One file open per tensor: its pages are unmapped again at once, so they never add up in RSS.
        if name in self._stacked:
            data = self._read_stacked(name, target)
        elif name in self.grown:
            data = self._grown_matrix(name)
            if isinstance(target, DTensor):
                data = distribute_tensor(data, target.device_mesh, target.placements, src_data_rank=None).to_local()
        else:
            with safe_open(str(self.files[name]), framework="pt") as handle:
                stored = handle.get_slice(name)
                index = _local_index(target) if isinstance(target, DTensor) else None
                if index is None and isinstance(target, DTensor):  # a layout without plain offsets: split here
                    data = distribute_tensor(stored[:], target.device_mesh, target.placements,
                                             src_data_rank=None).to_local()
                else:
                    data = stored[index] if index is not None else stored[:]
        if local.numel():
            local.copy_(data)
        self.stats.bytes_read += data.numel() * data.element_size()
        self.stats.seconds += time.perf_counter() - start
        self._taken.add(name)

    def _read_stacked(self, name: str, target: torch.Tensor) -> torch.Tensor:
        """This rank's part of a tensor the files hold per expert: its experts, and of each its rows of the
        concatenated parts and its columns, read slice by slice."""
        from safetensors import safe_open

        stacking, spelling = self._stacked[name]
        index = _local_index(target) if isinstance(target, DTensor) else None
        whole = index is None
        if whole:
            index = tuple(slice(0, size) for size in target.shape)
        experts, rows, columns = index[0], index[1], index[2:]
        shape = [len(range(s.start, s.stop)) for s in index]
        data = torch.empty(shape, dtype=self._dtype(stacking.file_names(spelling, 0)[0]))
        with contextlib.ExitStack() as files:
            handles = {}
            for held, expert in enumerate(range(experts.start, experts.stop)):
                offset, filled = 0, 0
                for part in stacking.file_names(spelling, expert):
                    height = self.shapes[part][0]
                    start, stop = max(rows.start - offset, 0), min(rows.stop - offset, height)
                    if start < stop:
                        path = self.files[part]
                        if path not in handles:
                            handles[path] = files.enter_context(safe_open(str(path), framework="pt"))
                        data[held, filled:filled + stop - start] = \
                            handles[path].get_slice(part)[(slice(start, stop), *columns)]
                        filled += stop - start
                    offset += height
                    self._taken.add(part)
        if whole and isinstance(target, DTensor):  # a layout without plain offsets: split here
            data = distribute_tensor(data, target.device_mesh, target.placements, src_data_rank=None).to_local()
        return data

    def _dtype(self, name: str) -> torch.dtype:
        """The files' dtype of tensor `name` (an empty read)."""
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as handle:
            return handle.get_slice(name)[:0].dtype

    def _grown_matrix(self, name: str) -> torch.Tensor:
        """The grown fp32 matrix `name`. Growing draws random rows from one generator, input embedding first: a
        head is grown after growing the input embedding again, as a whole load would, so the draws agree."""
        from safetensors import safe_open

        if self.grower.draws:
            self.grower.restart()
            names = self.grown[:self.grown.index(name) + 1]
        else:
            names = [name]
        for each in names:
            with safe_open(str(self.files[each]), framework="pt") as handle:
                grown = self.grower.grow(handle.get_tensor(each).float())
        return grown

    def finish(self) -> LoadStats:
        self.stats.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.stats.unused = sorted(set(self.files) - self._taken)
        return self.stats


def _local_index(target: DTensor) -> tuple | None:
    """The slices of the global tensor this rank's shard holds, or None for a layout other than plain
    Shard/Replicate placements (strided shards of FSDP over tp), which is then split after a full read."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not all(type(p) in (Shard, Replicate) for p in target.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    if tuple(shape) != tuple(target.to_local().shape):
        return None
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def _embedding_names(model: torch.nn.Module) -> tuple[str | None, str | None]:
    """The weight names of the input embedding and the output head (None where the model has none)."""
    modules = {id(module): parameter_name(name) for name, module in model.named_modules()}
    found = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        name = modules.get(id(module)) if module is not None else None
        found.append(f"{name}.weight" if name is not None else None)
    return tuple(found)


def _tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{output embedding weight: input embedding weight} when the model ties them."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return {}
    source, tied = _embedding_names(model)
    return {tied: source} if source and tied else {}


def mtp_shared_copies(model: torch.nn.Module) -> dict[str, str]:
    """{name in the files: the model's tensor it copies} for the embedding and head copies each multi-token
    prediction depth carries (docs/multi-token-prediction.md, 'HF folders in and out'); loading ignores them."""
    embedding, head = _embedding_names(model)
    head = head if head and head not in _tied_aliases(model) else embedding
    return {prefix + copy: source for prefix in depth_prefixes(model)
            for copy, source in zip(SHARED_COPIES, (embedding, head))}


def tied_output_names(model: torch.nn.Module) -> list[str]:
    """Parameters that are another one under a second name (a tied output head): HF files leave them out."""
    return list(_tied_aliases(model))


def attach_checkpoint(model: torch.nn.Module, tensors: CheckpointTensors) -> None:
    """Leave the files' reader on a meta model for the engine's materialisation to fill it from."""
    object.__setattr__(model, _ATTRIBUTE, tensors)


def carry_checkpoint(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """A model rebuilt from another (the megatron engine's stage view) takes over its pending reader."""
    tensors = take_checkpoint(source)
    if tensors is not None:
        attach_checkpoint(target, tensors)


def take_checkpoint(model: torch.nn.Module) -> CheckpointTensors | None:
    return model.__dict__.pop(_ATTRIBUTE, None)


def pending_checkpoint(model: torch.nn.Module) -> CheckpointTensors | None:
    return model.__dict__.get(_ATTRIBUTE)
