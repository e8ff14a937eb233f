"""An lm-evaluation-harness model (`--model pretrainer`) that scores a run's newest checkpoint, or an HF
folder, through a pretrainer engine: no conversion to an HF folder first.

    python -m pretrainer.train.harness --model pretrainer --model_args path=runs/quickstart --tasks hellaswag

Importing this module registers the model (for `lm_eval.simple_evaluate` too); `model_args`, what is scored and
what is not: docs/downstream-eval.md, 'lm-evaluation-harness'. Needs `pip install lm_eval`.
"""

from __future__ import annotations

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from .offline import evaluation_args, load_model
from .scoring import Request, encode_request, prefix_token, score_requests


@register_model("pretrainer")
class PretrainerLM(LM):
    def __init__(self, path: str, batch_size: int | str | None = None, device: str | None = None,
                 max_batch_size: int | None = None, **config):
        """`config`: key=value overrides of the run's config; `batch_size` (an integer) sets micro_batch_size, `device`
        the device key (not the harness's default cuda:0 on a machine without CUDA: `device: auto` picks)."""
        import torch

        super().__init__()
        overrides = [f"{key}={value}" for key, value in config.items()]
        if isinstance(batch_size, int) or (isinstance(batch_size, str) and batch_size.isdigit()):
            overrides.append(f"micro_batch_size={batch_size}")
        if device and not (device.startswith("cuda") and not torch.cuda.is_available()):
            overrides.append(f"device={device}")
        args, checkpoint = evaluation_args(path, [*overrides, "loss_chunk_size=0"])
        self.loaded = load_model(args, checkpoint)
        self.tokenizer = self.loaded.resolved.tokenizer
        if self.tokenizer is None:
            raise ValueError(f"{path}: the model has no tokenizer; pass tokenizer_path=FOLDER in model_args")
        self.max_length = self.loaded.resolved.sizes.seq_length
        self.batch_tokens = self.loaded.resolved.sizes.micro_batch_tokens

    def _score(self, requests: list[Request]) -> tuple:
        return score_requests(self.loaded.model, self.loaded.engine, requests, self.batch_tokens, greedy=True)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        encoded = [encode_request(self.tokenizer, context, continuation, self.max_length)
                   for context, continuation in (request.args for request in requests)]
        sums, greedy = self._score(encoded)
        return [(float(s), bool(g)) for s, g in zip(sums, greedy)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's whole log-likelihood, in the harness's disjoint windows of at most seq_length inputs."""
        prefix = prefix_token(self.tokenizer)
        windows, owner = [], []
        for index, request in enumerate(requests):
            tokens = self.tokenizer.encode(request.args[0], add_special_tokens=False)
            for pair in get_rolling_token_windows(tokens, prefix, self.max_length, context_len=1):
                context, continuation = make_disjoint_window(pair)
                windows.append(Request(tuple(context + continuation), len(context)))
                owner.append(index)
        sums, _ = self._score(windows)
        totals = [0.0] * len(requests)
        for index, value in zip(owner, sums):
            totals[index] += float(value)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError("the pretrainer model scores log-likelihood tasks only; for generation tasks "
                                  "use the run's HF export: --model hf --model_args pretrained=SAVE_DIR/hf")


if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
