"""The loop's sequence-length stages (`seq_length_schedule`, config/seq_stages.py): which stage the next update
trains in, its windows (the run's windows cut into shorter ones), and its RoPE, set on the model when a stage
begins, on resume, and where a trained model is loaded or exported (the stage of its last update). Without a
schedule every batch passes through unchanged."""

from __future__ import annotations

import copy
import logging

from ..batch import cut_windows
from ..config import ConfigError
from ..config.sizes import BatchSizes
from ..models.rope import rotary_modules, stage_rope_config, use_rope_config

logger = logging.getLogger("pretrainer")


class LengthStages:
    def __init__(self, sizes: BatchSizes, hf_model, where: str = "the model's config"):
        self.sizes, self.schedule, self.model = sizes, sizes.stages, hf_model
        self.index: int | None = None
        self.seq_length = sizes.seq_length
        # each stage's RoPE from the model's own config (a stage without RoPE keys returns to it)
        self.rope_configs = None
        if self.schedule is not None and self.schedule.sets_rope:
            check_rotates_in_place(hf_model)
            own = copy.deepcopy(hf_model.config)  # the config as built, kept apart from the one each stage sets
            self.rope_configs = [stage_rope_config(own, stage, f"{where}; seq_length_schedule[{index}]")
                                 if stage.sets_rope else own for index, stage in enumerate(self.schedule.stages)]

    def enter(self, step: int, meter=None) -> int:
        """Begin the update numbered `step` (0-based): its stage's length (and RoPE, where it changes)."""
        if self.schedule is None:
            return self.seq_length
        index = self.sizes.stage_at(step)
        if index != self.index:
            stage = self.schedule.stages[index]
            if self.rope_configs is not None:
                use_rope_config(self.model, self.model.config, self.rope_configs[index])
            self.index, self.seq_length = index, stage.seq_length
            if meter is not None:
                meter.use_seq_length(stage.seq_length)
            rope = f", RoPE {_describe_rope(self.rope_configs[index])}" if self.rope_configs is not None else ""
            logger.info("sequence-length stage %d of %d from step %d (token %s): seq_length %d, %d window(s) per "
                        "sequence of %d%s", index + 1, len(self.schedule.stages), step + 1,
                        f"{self.sizes.tokens_before(step):,}", stage.seq_length,
                        self.schedule.windows_per_sequence(index), self.sizes.seq_length, rope)
        return self.seq_length

    def settle(self, steps_done: int, meter=None) -> int:
        """The model as `steps_done` updates left it: the RoPE of the stage of the last of them (of the first
        stage before any), for an export, an evaluation or the rows of a run that is already complete."""
        return self.enter(max(steps_done - 1, 0), meter)

    def cut(self, batch: dict) -> dict:
        """A batch of the run's windows as the current stage's."""
        return cut_windows(batch, self.seq_length) if self.schedule is not None else batch


def check_rotates_in_place(hf_model) -> None:
    """A stage's RoPE is set by rebuilding the model's rotary embeddings from its config: refused, before training,
    for a model whose rotary embeddings are not one kind built from the top-level config."""
    config = hf_model.config
    parameters = getattr(config, "rope_parameters", None)
    nested = isinstance(parameters, dict) and any(isinstance(value, dict) for value in parameters.values())
    if nested or not rotary_modules(hf_model):
        why = "sets RoPE per layer type" if nested else "has no rotary embedding with inv_freq to rebuild"
        raise ConfigError(f"key 'seq_length_schedule': a stage sets rope_theta or rope_scaling, but the model "
                          f"({getattr(config, 'model_type', '?')}) {why}; set RoPE for the whole run instead "
                          "(rope_scaling / rope_theta) or remove it from the stages")


def _describe_rope(config) -> str:
    rope = getattr(config, "rope_parameters", None) or {
        "rope_theta": getattr(config, "rope_theta", None), **(getattr(config, "rope_scaling", None) or {})}
    return ", ".join(f"{key}={value}" for key, value in rope.items())
