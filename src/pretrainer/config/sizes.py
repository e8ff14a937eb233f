"""The run's sizes: sequence length, micro-batch, accumulation, replicas, steps, and what follows from them
(the global batch, the samples a run and an evaluation read). Each has one definition, here; the resolved run
(`pretrainer.run`) holds them as `BatchSizes`, which the data builders and the loop read."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError


def resolve_seq_length(seq_length: int | None, model_config, where: str) -> int:
    """The run's sequence length: `seq_length`, or the model's `max_position_embeddings` when unset; never
    longer than the model's positions. `where` names the model config in messages."""
    max_positions = model_positions(model_config)
    resolved = seq_length or max_positions
    if resolved is None:
        raise ConfigError("seq_length is not set and the model config has no max_position_embeddings; set seq_length")
    if max_positions is not None and resolved > max_positions:
        factor = -(-resolved // max_positions)
        raise ConfigError(f"key 'seq_length': {resolved} exceeds the model's max_position_embeddings "
                          f"({max_positions}, {where}); lower seq_length, or extend the positions with "
                          f"rope_scaling, e.g. rope_scaling: {{rope_type: yarn, factor: {factor}}} (or linear, "
                          "dynamic, llama3; see the long-context docs)")
    return int(resolved)


def model_positions(model_config) -> int | None:
    """The positions a model config covers: `max_position_embeddings`, times the factor of a `dynamic` (NTK)
    RoPE scaling, which rescales past it at run time (other scalings set max_position_embeddings)."""
    positions = getattr(model_config, "max_position_embeddings", None)
    rope = getattr(model_config, "rope_parameters", None) or getattr(model_config, "rope_scaling", None) or {}
    if positions is not None and isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type")) == "dynamic":
        return int(positions * rope.get("factor", 1.0))
    return positions


def global_batch_size(micro_batch_size: int, gradient_accumulation_steps: int, data_parallel_size: int) -> int:
    """Sequences per optimizer step, over all data-parallel replicas."""
    return micro_batch_size * gradient_accumulation_steps * data_parallel_size


@dataclass(frozen=True)
class BatchSizes:
    """How much each step and the whole run read: sequences, micro-batches, replicas, steps."""
    seq_length: int                  # tokens per sample (inputs; a sample reads seq_length + 1 tokens)
    micro_batch_size: int            # sequences per forward on one replica
    gradient_accumulation_steps: int  # micro-batches per optimizer step
    data_parallel_size: int          # replicas that read different data
    num_training_steps: int
    eval_iters: int                  # micro-batches one evaluation reads on each replica

    @staticmethod
    def of(args, seq_length: int, data_parallel_size: int) -> "BatchSizes":
        return BatchSizes(seq_length, args.micro_batch_size, args.gradient_accumulation_steps, data_parallel_size,
                          args.num_training_steps, args.eval_iters)

    @property
    def global_batch_size(self) -> int:
        return global_batch_size(self.micro_batch_size, self.gradient_accumulation_steps, self.data_parallel_size)

    @property
    def micro_batch_tokens(self) -> int:
        """Input tokens of one micro-batch on one replica (also what one batch of scoring may hold)."""
        return self.micro_batch_size * self.seq_length

    @property
    def train_samples(self) -> int:
        """Samples the whole run reads, over all replicas."""
        return self.num_training_steps * self.global_batch_size

    @property
    def eval_samples(self) -> int:
        """Samples one evaluation reads, over all replicas."""
        return self.eval_iters * self.micro_batch_size * self.data_parallel_size

    def describe(self) -> str:
        return (f"seq_length={self.seq_length} global_batch={self.global_batch_size} "
                f"({self.micro_batch_size} x {self.gradient_accumulation_steps} accumulation x "
                f"{self.data_parallel_size} replica(s))")
