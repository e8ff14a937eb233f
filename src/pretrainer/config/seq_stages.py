"""Sequence-length stages (`seq_length_schedule`), read once from the config: the window length each part of a run
trains at, and the RoPE settings a stage may set for itself (docs/long-context.md, 'Sequence-length stages').

The data is always cut into windows of the run's `seq_length` (the last stage's); a shorter stage cuts each of
them into `seq_length / length` consecutive windows (`batch.cut_windows`), so the token stream, the data positions a
checkpoint records and the tokens of an update are those of a fixed-length run, and no token is skipped or repeated
when the length changes. A stage's length therefore divides the run's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import key_error
from .sizes import MAX_RUN_TOKENS

KEY = "seq_length_schedule"
STAGE_KEYS = ("until_tokens", "seq_length", "sequences", "rope_theta", "rope_scaling")
EXAMPLE = ("e.g. [{until_tokens: 2e6, seq_length: 64}, {until_tokens: 8e6, seq_length: 128}, {seq_length: 256}] "
           "(the last stage runs to the end at the run's seq_length)")


@dataclass(frozen=True)
class SeqStage:
    until_tokens: int | None          # the stage ends once this many tokens are trained (None: the last, to the end)
    seq_length: int | None            # None: the run's seq_length (the last stage may leave it out)
    sequences: int | None = None      # the global batch in windows of this stage (None: the run's tokens per update)
    rope_theta: float | None = None
    rope_scaling: dict | None = None

    @property
    def sets_rope(self) -> bool:
        return self.rope_theta is not None or self.rope_scaling is not None


@dataclass(frozen=True)
class SeqLengthSchedule:
    stages: tuple[SeqStage, ...]
    seq_length: int = 0               # the run's (the last stage's) length, once resolved (`resolved`)

    def resolved(self, seq_length: int) -> "SeqLengthSchedule":
        """The schedule for a run of `seq_length` tokens per window, each stage's length checked against it."""
        stages = []
        for index, stage in enumerate(self.stages):
            length = stage.seq_length if stage.seq_length is not None else seq_length
            where = f"{KEY}[{index}]"
            if index == len(self.stages) - 1 and length != seq_length:
                raise key_error(KEY, f"{where}: the last stage trains at the run's seq_length ({seq_length}), not "
                                f"{length}; set seq_length: {length} or leave the last stage's seq_length out")
            if seq_length % length:
                raise key_error(KEY, f"{where}: seq_length {length} does not divide the run's seq_length "
                                f"({seq_length}); each stage cuts the run's windows into equal shorter ones, so use "
                                f"a divisor such as {_divisor_near(seq_length, length)}")
            stages.append(SeqStage(stage.until_tokens, length, stage.sequences, stage.rope_theta, stage.rope_scaling))
        return SeqLengthSchedule(tuple(stages), seq_length)

    def index_at(self, tokens: int) -> int:
        """The stage of an update that starts after `tokens` trained tokens."""
        return next(index for index, stage in enumerate(self.stages)
                    if stage.until_tokens is None or tokens < stage.until_tokens)

    def start_tokens(self, index: int) -> int:
        return 0 if index == 0 else self.stages[index - 1].until_tokens

    def windows_per_sequence(self, index: int) -> int:
        """How many of stage `index`'s windows one of the run's windows holds."""
        return self.seq_length // self.stages[index].seq_length

    @property
    def sets_rope(self) -> bool:
        return any(stage.sets_rope for stage in self.stages)

    def describe(self) -> str:
        return " -> ".join(f"{stage.seq_length}" + (f" until token {stage.until_tokens:,}"
                                                    if stage.until_tokens is not None else "")
                           for stage in self.stages)


def _divisor_near(total: int, length: int) -> int:
    divisors = [d for d in range(1, min(total, 2 * length) + 1) if total % d == 0]
    return min(divisors, key=lambda d: (abs(d - length), -d))


def read_seq_length_schedule(raw, rope_types: tuple[str, ...]) -> SeqLengthSchedule | None:
    """The schedule `raw` describes, its form checked (the lengths are checked against the run's in `resolved`)."""
    if raw is None:
        return None
    if not (isinstance(raw, list) and raw and all(isinstance(stage, dict) for stage in raw)):
        raise key_error(KEY, f"{KEY} is a list of stages {{until_tokens, seq_length}}, {EXAMPLE}; got {raw!r}")
    stages, previous = [], 0
    for index, stage in enumerate(raw):
        stages.append(_stage(index, stage, index == len(raw) - 1, previous, rope_types))
        previous = stages[-1].until_tokens or previous
    return SeqLengthSchedule(tuple(stages))


def _stage(index: int, stage: dict, last: bool, previous: int, rope_types: tuple[str, ...]) -> SeqStage:
    where = f"{KEY}[{index}]"
    unknown = sorted(set(stage) - set(STAGE_KEYS))
    if unknown:
        raise key_error(KEY, f"{where} has unknown key(s) {', '.join(map(str, unknown))}; a stage takes "
                        f"{', '.join(STAGE_KEYS)}")
    until = stage.get("until_tokens")
    if last and until is not None:
        raise key_error(KEY, f"{where}: the last stage runs to the end of the run; remove its until_tokens")
    if not last and (not _number(until) or not math.isfinite(until) or until <= previous or until != int(until)):
        raise key_error(KEY, f"{where}: until_tokens must be a whole number of tokens larger than the previous "
                        f"stage's ({previous:,}), got {until!r}; {EXAMPLE}")
    if until is not None and until > MAX_RUN_TOKENS:
        raise key_error(KEY, f"{where}: until_tokens {until:.3g} is beyond what a run's 64-bit token counts reach "
                        f"({MAX_RUN_TOKENS:.3g}); the next stage would never start")
    length = stage.get("seq_length")
    if length is None and not last:
        raise key_error(KEY, f"{where}: give the stage's seq_length (only the last stage may leave it out)")
    if length is not None and not _whole(length, 2):
        raise key_error(KEY, f"{where}: seq_length must be a whole number >= 2, got {length!r}")
    sequences = stage.get("sequences")
    if sequences is not None and not _whole(sequences, 1):
        raise key_error(KEY, f"{where}: sequences (the global batch in this stage's windows) must be a whole "
                        f"number >= 1, got {sequences!r}")
    theta = stage.get("rope_theta")
    if theta is not None and (not _number(theta) or not theta > 0 or not math.isfinite(theta)):
        raise key_error(KEY, f"{where}: rope_theta must be a number > 0, got {theta!r}")
    scaling = stage.get("rope_scaling")
    if scaling is not None:
        _check_scaling(where, scaling, rope_types)
    return SeqStage(int(until) if until is not None else None, int(length) if length is not None else None,
                    int(sequences) if sequences is not None else None, float(theta) if theta is not None else None,
                    dict(scaling) if scaling is not None else None)


def _check_scaling(where: str, scaling, rope_types: tuple[str, ...]) -> None:
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind not in rope_types:
        raise key_error(KEY, f"{where}: rope_scaling needs rope_type, one of {', '.join(rope_types)} (got "
                        f"{kind!r}); e.g. rope_scaling: {{rope_type: yarn, factor: 4.0}}")
    factor = scaling.get("factor")
    if not _number(factor) or not factor >= 1 or not math.isfinite(factor):
        raise key_error(KEY, f"{where}: rope_scaling.factor must be a number >= 1 (the new length over the "
                        f"original), got {factor!r}")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _whole(value, least: int) -> bool:
    return _number(value) and math.isfinite(value) and value == int(value) and value >= least
