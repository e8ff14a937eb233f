"""The training loop and its parts. `PreTrainer` is loaded on first use, so the light modules here
(signals, for the command line) import without torch."""


def __getattr__(name: str):
    if name == "PreTrainer":
        from .trainer import PreTrainer

        return PreTrainer
    raise AttributeError(f"module 'pretrainer.train' has no attribute {name!r}")


__all__ = ["PreTrainer"]
