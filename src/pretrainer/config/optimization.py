"""The optimizer's and the learning-rate schedule's settings, read once from the config: the optimizer builder,
the schedule and DeepSpeed's JSON blocks all take these instead of the arguments."""

from __future__ import annotations

from dataclasses import dataclass

OPTIMIZERS = ("adamw", "muon")
MUON_ADJUST_LR = ("match_rms_adamw", "spectral", "original")
MUON_NS_DTYPES = ("auto", "bf16", "fp32")
WSD_DECAY_SHAPES = ("linear", "cosine", "1-sqrt")  # their formulas: optim/schedules.py


@dataclass(frozen=True)
class MuonSettings:
    lr: float                  # the Muon groups' peak (muon_lr, else lr); the schedule scales it as lr's
    momentum: float
    nesterov: bool
    ns_steps: int
    adjust_lr: str             # match_rms_adamw | spectral | original
    ns_dtype: str              # bf16 | fp32 (auto resolved: bf16 for bf16 runs, fp32 otherwise)
    muon_params: tuple = ()    # name globs forced onto Muon
    adamw_params: tuple = ()   # name globs kept on AdamW (these win)

    @staticmethod
    def of(args, dtype: str) -> "MuonSettings":
        ns_dtype = args.muon_ns_dtype if args.muon_ns_dtype != "auto" else ("bf16" if dtype == "bf16" else "fp32")
        # under muP the update's scale is the matrix's shape alone (sqrt(fan_out/fan_in)): it transfers across width
        adjust_lr = args.muon_adjust_lr if args.parametrization == "sp" else "spectral"
        return MuonSettings(args.muon_lr if args.muon_lr is not None else args.lr, args.muon_momentum,
                            args.muon_nesterov, args.muon_ns_steps, adjust_lr, ns_dtype,
                            tuple(args.muon_params or ()), tuple(args.adamw_params or ()))


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    clip_grad: float | None
    name: str = "adamw"                # adamw | muon (Muon for hidden matrices, AdamW for the rest)
    muon: MuonSettings | None = None   # with name muon

    @staticmethod
    def of(args, dtype: str = "fp32") -> "OptimizerSettings":
        muon = MuonSettings.of(args, dtype) if args.optimizer == "muon" else None
        return OptimizerSettings(args.lr, (args.adam_beta1, args.adam_beta2), args.adam_eps, args.weight_decay,
                                 args.clip_grad, args.optimizer, muon)

    def describe(self) -> str:
        if self.muon is None:
            return f"AdamW (betas {self.betas}, weight decay {self.weight_decay:g})"
        m = self.muon
        named = f" and {', '.join(m.muon_params)}" if m.muon_params else ""  # globs that add non-hidden ones
        nesterov = ", nesterov" if m.nesterov else ""
        return (f"Muon for hidden matrices{named} (lr {m.lr:g}, momentum {m.momentum:g}{nesterov}, "
                f"{m.ns_steps} Newton-Schulz steps in {m.ns_dtype}, lr scale {m.adjust_lr}), AdamW for the rest "
                f"(lr {self.lr:g}); weight decay {self.weight_decay:g}")


@dataclass(frozen=True)
class BranchPoint:
    """Where a cooldown branch starts (`cooldown_from`): a checkpoint of a run in its stable phase."""
    checkpoint: str          # the checkpoint folder
    run: str                 # the save_dir of the run that wrote it
    step: int                # the updates it holds
    lr_ratio: float          # the parent's lr multiplier for its next update (1.0 in a stable phase)

    @property
    def lineage(self) -> str:
        return f"{self.run}@step-{self.step}"


@dataclass(frozen=True)
class ScheduleSettings:
    """The schedule in updates. Lengths given in tokens (`warmup_tokens`, `wsd_decay_tokens`) are divided by the
    tokens one update trains, so they may be fractional; the shapes' formulas are in optim/schedules.py."""
    lr: float                # the peak
    min_lr: float
    total_steps: int
    warmup_steps: float
    style: str               # cosine | linear | constant | wsd
    decay_shape: str = "linear"        # wsd: linear | cosine | 1-sqrt
    decay_steps: float | None = None   # wsd: the decay's length; None: wsd_decay_fraction of the post-warmup steps
    wsd_decay_fraction: float = 0.2
    branch: BranchPoint | None = None   # a cooldown branch: decay_steps from branch.step, from its lr

    @staticmethod
    def of(args, sizes=None, branch: BranchPoint | None = None) -> "ScheduleSettings":
        """`sizes` (BatchSizes): tokens per update, for token lengths (through a ramp's smaller first updates). A
        cooldown `branch` decays over `cooldown_tokens` from its step; the run ends with the update finishing them."""
        uses_tokens = args.warmup_tokens is not None or args.wsd_decay_tokens is not None or branch is not None
        if uses_tokens and sizes is None:
            raise ValueError("token lengths need the run's sizes")
        if branch is not None:
            start = sizes.tokens_before(branch.step)
            decay = sizes.steps_for(start + args.cooldown_tokens) - branch.step
            total = sizes.whole_steps_for(start + args.cooldown_tokens, "cooldown_tokens")
            return ScheduleSettings(args.lr, args.min_lr, total, 0.0, "cooldown", args.wsd_decay_shape, decay,
                                    branch=branch)
        warmup = sizes.steps_for(args.warmup_tokens) if args.warmup_tokens is not None else \
            args.warmup_steps_resolved()
        decay = None
        if args.wsd_decay_tokens is not None:  # the decay ends with the run's last token
            total_tokens = sizes.tokens_before(args.num_training_steps)
            decay = args.num_training_steps - sizes.steps_for(max(0.0, total_tokens - args.wsd_decay_tokens))
        return ScheduleSettings(args.lr, args.min_lr, args.num_training_steps, warmup, args.lr_decay_style,
                                args.wsd_decay_shape, decay, args.wsd_decay_fraction)

    @property
    def min_ratio(self) -> float:
        return self.min_lr / self.lr

    def describe(self) -> str:
        style = self.style
        if self.branch is not None:
            return f"{self.lr * self.branch.lr_ratio:g} at step {self.branch.step} ({self.decay_shape} cooldown over " \
                   f"{self.decay_steps:g} steps to min {self.min_lr:g}; branch of {self.branch.lineage})"
        if style == "wsd":
            length = f"{self.decay_steps:g} steps" if self.decay_steps is not None else \
                f"the last {self.wsd_decay_fraction:g} of the steps"
            style = f"wsd, {self.decay_shape} decay over {length}"
        return f"{self.lr:g} ({style}, warmup {self.warmup_steps:g} steps, min {self.min_lr:g})"
