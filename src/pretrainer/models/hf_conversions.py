"""How transformers turns a checkpoint's tensors into a model's, where it does (the experts of MoE models in
transformers 5), read so that each rank can read its own slice of a converted tensor from the files.

Hub checkpoints of Mixtral, Qwen2/3-MoE, OLMoE and DeepSeek-V3 hold one matrix per expert
(`mlp.experts.3.gate_proj.weight`); the model holds every expert of a layer in one 3-D parameter
(`mlp.experts.gate_up_proj` [experts, 2 x intermediate, hidden]). transformers describes this per model type
(`conversion_mapping.get_checkpoint_conversion_mapping`) as renamings (a substring of the name changed) and
converters: source patterns with `*` for the expert index, stacked over the experts (`MergeModulelist`,
dim 0), then the sources concatenated (`Concatenate`, dim 1). Those two operations are all a slice reader needs
to know; a model type whose mapping uses any other is read whole by `from_pretrained` instead.
"""

from __future__ import annotations

from dataclasses import dataclass

STACK, CONCATENATE = ("MergeModulelist", 0), ("Concatenate", 1)


@dataclass(frozen=True)
class Renaming:
    model: str  # the substring in the model's names
    files: str  # what it is in the files


@dataclass(frozen=True)
class Stacking:
    target: str                # the model's name ends in this (`mlp.experts.gate_up_proj`)
    sources: tuple[str, ...]   # the files' names for expert `*`, concatenated in this order (dim 1 of the stack)

    def file_names(self, name: str, expert: int) -> list[str]:
        """The files' names of `expert`'s parts of the model's tensor `name`."""
        stem = name[:-len(self.target)]
        return [stem + source.replace("*", str(expert)) for source in self.sources]


@dataclass(frozen=True)
class Conversions:
    entries: tuple = ()  # (transformers' own entry, its Renaming or Stacking); saving reverts the used ones

    def stacking(self, name: str) -> Stacking | None:
        return next((rule for _, rule in self.entries if isinstance(rule, Stacking) and name.endswith(rule.target)),
                    None)

    def file_candidates(self, name: str) -> list[str]:
        """`name` as the files may spell it: itself, then with each renaming reversed."""
        return [name] + [name.replace(r.model, r.files) for _, r in self.entries
                         if isinstance(r, Renaming) and r.model in name]

    def used(self, file_names) -> list:
        """transformers' entries that these files need (what from_pretrained records for saving)."""
        names = list(file_names)
        used = []
        for entry, rule in self.entries:
            patterns = [rule.files] if isinstance(rule, Renaming) else [source.split("*")[0] for source in rule.sources]
            if any(pattern in name for name in names for pattern in patterns):
                used.append(entry)
        return used


def conversions_of(config) -> Conversions | None:
    """The conversions transformers applies when loading this model type (empty: none), or None when they use
    an operation a slice reader does not know."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # a transformers release without conversions
        return Conversions()
    entries = []
    for entry in get_checkpoint_conversion_mapping(getattr(config, "model_type", "")) or []:
        sources, targets = list(entry.source_patterns), list(entry.target_patterns)
        operations = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(entry, "operations", [])]
        if type(entry).__name__ == "WeightRenaming" and len(sources) == len(targets) == 1 and not operations:
            entries.append((entry, Renaming(model=targets[0], files=sources[0])))
        elif (type(entry).__name__ == "WeightConverter" and len(targets) == 1
              and all(source.count("*") == 1 for source in sources)
              and operations in ([STACK], [STACK, CONCATENATE])):
            entries.append((entry, Stacking(target=targets[0], sources=tuple(sources))))
        else:
            return None
    return Conversions(tuple(entries))
