"""The run's sizes: sequence length, micro-batch, accumulation, replicas, steps, and what follows from them
(the global batch, the samples a run and an evaluation read). Each has one definition, here; the resolved run
(`pretrainer.run`) holds them as `BatchSizes`, which the data builders and the loop read."""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

from .errors import ConfigError, key_error

if TYPE_CHECKING:
    from .seq_stages import SeqLengthSchedule


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


# A run counts its tokens in 64-bit integers (metrics, checkpoints, the data's sample positions): a length in
# tokens or steps beyond them is refused at load instead of overflowing somewhere in the loop.
MAX_RUN_TOKENS = 2**63 - 1


def check_run_tokens(tokens: float, key: str) -> None:
    """One line naming `key` when a run of `tokens` tokens is longer than its token counts can hold."""
    if tokens > MAX_RUN_TOKENS:
        raise key_error(key, f"the run would train {tokens:.3g} tokens, more than its 64-bit token counts hold "
                        f"({MAX_RUN_TOKENS:.3g}); give fewer")


def global_batch_size(micro_batch_size: int, gradient_accumulation_steps: int, data_parallel_size: int) -> int:
    """Sequences per optimizer step, over all data-parallel replicas."""
    return micro_batch_size * gradient_accumulation_steps * data_parallel_size


@dataclass(frozen=True)
class BatchRamp:
    """`batch_size_schedule` (docs/optimization.md, 'Batch-size ramp'). Every question is answered by arithmetic over
    the stages (at most one segment of equal updates each), so 1e15 tokens cost what 1e3 do."""
    stages: tuple[tuple[int, int], ...]  # (first token, sequences per step), the first at token 0
    seq_length: int
    # (first update, tokens before it, sequences per step)
    _segments: tuple = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_segments", _segments(self.stages, self.seq_length))

    def _segment_of_step(self, step: int) -> tuple[int, int, int]:
        return self._segments[bisect.bisect_right([first for first, _, _ in self._segments], step) - 1]

    def sequences(self, step: int) -> int:
        """The global batch of the update numbered `step` (0-based)."""
        return self._segment_of_step(step)[2]

    def tokens_before(self, step: int) -> int:
        first, tokens, seqs = self._segment_of_step(max(step, 0))
        return tokens + (step - first) * seqs * self.seq_length

    def steps_for(self, tokens: float) -> float:
        """The (fractional) number of updates after which `tokens` have been trained: the update `step` that
        trains the `tokens`-th token, plus the share of it trained by then."""
        index = max(0, bisect.bisect_left([before for _, before, _ in self._segments], tokens) - 1)
        first, before, seqs = self._segments[index]
        per_step = seqs * self.seq_length
        step = first + max(0, math.ceil((Fraction(tokens) - before) / per_step) - 1)  # exact for 1e15 as for 1e3
        return step + (tokens - self.tokens_before(step)) / per_step

    def describe(self) -> str:
        return " -> ".join(f"{seqs} from token {start:,}" for start, seqs in self.stages)


def _segments(stages: tuple[tuple[int, int], ...], seq_length: int) -> tuple[tuple[int, int, int], ...]:
    """The ramp as runs of equal updates: (first update, tokens trained before it, sequences per update). An update
    takes the batch of the last stage the tokens before it reach, so it may pass over a short stage."""
    segments, step, tokens = [], 0, 0
    while True:
        current = max(index for index, (start, _) in enumerate(stages) if tokens >= start)
        seqs = stages[current][1]
        segments.append((step, tokens, seqs))
        if current == len(stages) - 1:
            return tuple(segments)
        updates = -(-(stages[current + 1][0] - tokens) // (seqs * seq_length))  # until the next stage's token
        step, tokens = step + updates, tokens + updates * seqs * seq_length


@dataclass(frozen=True)
class BatchSizes:
    """How much each step and the whole run read: sequences, micro-batches, replicas, steps."""
    seq_length: int                  # tokens per sample (inputs; a sample reads seq_length + 1 tokens)
    micro_batch_size: int            # sequences per forward on one replica
    gradient_accumulation_steps: int  # micro-batches per optimizer step
    data_parallel_size: int          # replicas that read different data
    num_training_steps: int
    eval_iters: int                  # micro-batches one evaluation reads on each replica
    ramp: BatchRamp | None = None    # batch_size_schedule: a smaller global batch in the first stages
    stages: "SeqLengthSchedule | None" = None  # seq_length_schedule: shorter windows in the first stages

    @staticmethod
    def of(args, seq_length: int, data_parallel_size: int) -> "BatchSizes":
        stages = args.seq_stages
        sizes = BatchSizes(seq_length, args.micro_batch_size, args.gradient_accumulation_steps, data_parallel_size,
                           args.num_training_steps, args.eval_iters,
                           stages=stages.resolved(seq_length) if stages is not None else None)
        sizes = sizes.with_steps(args.num_training_steps, sizes.ramp_schedule(args.batch_size_schedule))
        check_run_tokens(sizes.train_samples * seq_length, "num_training_steps")
        return sizes

    def ramp_schedule(self, batch_size_schedule: list | None) -> list | None:
        """The batch ramp: `batch_size_schedule`, or the one the sequence-length stages that name `sequences` make
        (a stage's windows counted in the run's sequences, from the stage's first token)."""
        stages = self.stages
        if stages is None or all(stage.sequences is None for stage in stages.stages):
            return batch_size_schedule
        per_round, ramp = self.micro_batch_size * self.data_parallel_size, []
        for index, stage in enumerate(stages.stages):
            where = f"seq_length_schedule[{index}]"
            windows = stages.windows_per_sequence(index)
            sequences = self.global_batch_size if stage.sequences is None else stage.sequences / windows
            if sequences != int(sequences) or sequences % per_round or sequences > self.global_batch_size:
                raise key_error("seq_length_schedule", f"{where}: {stage.sequences} windows of {stage.seq_length} "
                                f"are {sequences:g} of the run's {self.seq_length}-token sequences; give a multiple "
                                f"of {windows * per_round} windows (micro_batch_size x dp = {per_round} sequences), "
                                f"at most the global batch ({self.global_batch_size * windows} windows)")
            if index == len(stages.stages) - 1 and sequences != self.global_batch_size:
                raise key_error("seq_length_schedule", f"{where}: the last stage trains the config's global batch "
                                f"({self.global_batch_size} sequences), not {stage.sequences}; remove its sequences")
            ramp.append([stages.start_tokens(index), int(sequences)])
        return ramp

    def stage_at(self, step: int) -> int:
        """The sequence-length stage of the update numbered `step` (0 without stages)."""
        return self.stages.index_at(self.tokens_before(step)) if self.stages is not None else 0

    def seq_length_at(self, step: int) -> int:
        """The window length the update numbered `step` trains at."""
        return self.stages.stages[self.stage_at(step)].seq_length if self.stages is not None else self.seq_length

    def with_steps(self, num_training_steps: int, schedule: list | None) -> "BatchSizes":
        """These sizes over `num_training_steps`, the ramp `schedule` ([[tokens, sequences], ...]) checked: each stage a
        whole number of micro-batches per replica, none above the global batch, the last equal to it."""
        ramp = None
        if schedule:
            per_round = self.micro_batch_size * self.data_parallel_size
            for start, seqs in schedule:
                if seqs % per_round:
                    raise key_error("batch_size_schedule", f"the stage from token {start:g} has {seqs} sequences, not "
                                    f"a multiple of micro_batch_size x dp = {per_round}")
            if schedule[-1][1] != self.global_batch_size:
                raise key_error("batch_size_schedule", f"the last stage has {schedule[-1][1]} sequences, but the "
                                f"global batch is {self.global_batch_size} ({self.micro_batch_size} x "
                                f"{self.gradient_accumulation_steps} accumulation x {self.data_parallel_size} "
                                "replica(s)); the ramp ends at the config's global batch")
            larger = [seqs for _, seqs in schedule if seqs > self.global_batch_size]
            if larger:  # a stage of 1e300 sequences would accumulate micro-batches for ever
                raise key_error("batch_size_schedule", f"a stage has {larger[0]:.6g} sequences, more than the global "
                                f"batch of {self.global_batch_size} that the ramp grows to")
            ramp = BatchRamp(tuple((int(start), int(seqs)) for start, seqs in schedule), self.seq_length)
        return dataclasses.replace(self, num_training_steps=num_training_steps, ramp=ramp)

    def accumulation(self, step: int) -> int:
        """Micro-batches per replica in the update numbered `step` (0-based)."""
        if self.ramp is None:
            return self.gradient_accumulation_steps
        return self.ramp.sequences(step) // (self.micro_batch_size * self.data_parallel_size)

    def tokens_per_step(self) -> int:
        """Input tokens of one update at the full global batch."""
        return self.global_batch_size * self.seq_length

    def tokens_before(self, step: int) -> int:
        """Input tokens trained before the update numbered `step` (through a ramp's smaller first updates)."""
        return self.ramp.tokens_before(step) if self.ramp is not None else step * self.tokens_per_step()

    def steps_for(self, tokens: float) -> float:
        """The (fractional) number of updates that train `tokens` (through the ramp's smaller first batches)."""
        return self.ramp.steps_for(tokens) if self.ramp is not None else tokens / self.tokens_per_step()

    def whole_steps_for(self, tokens: float, key: str) -> int:
        """The whole number of updates that train `tokens` (the last one finishes them), refused in one line
        naming `key` beyond what the run's token counts hold (so a huge length never overflows a conversion)."""
        check_run_tokens(tokens, key)
        return math.ceil(self.steps_for(tokens) - 1e-9)

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
        return self.tokens_before(self.num_training_steps) // self.seq_length

    @property
    def eval_samples(self) -> int:
        """Samples one evaluation reads, over all replicas."""
        return self.eval_iters * self.micro_batch_size * self.data_parallel_size

    def describe(self) -> str:
        ramp = f" ramp=({self.ramp.describe()})" if self.ramp is not None else ""
        ramp += f" seq_length_stages=({self.stages.describe()})" if self.stages is not None else ""
        return (f"seq_length={self.seq_length} global_batch={self.global_batch_size} "
                f"({self.micro_batch_size} x {self.gradient_accumulation_steps} accumulation x "
                f"{self.data_parallel_size} replica(s)){ramp}")
