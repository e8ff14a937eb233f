"""`pretrainer` command line: `train`, `plan`, `prepare`, `export`, `evaluate`, `report`, `mup-check` and
`tokenizer`."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from .config import ON_ERROR, ConfigError, PreTrainingArguments, check_writable_folder
from .config.fault_tolerance import GROUP_ENV
from .config.loading import int_at_least
from .data.readers import DataError
from .storage import StorageError, is_url
from .train.errors import CheckpointError, CollectiveFailure, OutputError, TrainingDiverged
from .train.launcher import LaunchPlan, add_launcher_flags, launch_plan, record_worker_status
from .vocab.commands import add_tokenizer_commands, tokenizer_command

logger = logging.getLogger("pretrainer")

EXIT_USAGE = 2
EXIT_DIVERGED = 3
EXIT_CHECKPOINT = 4
EXIT_COLLECTIVE = 5


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # argparse leaves over `key=value` overrides that follow a command's options (`plan CONFIG --world-size 8 dp=8`).
    ns, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(ns, "overrides") or any(item.startswith("-") or "=" not in item for item in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        ns.overrides = [*ns.overrides, *extra]
    commands = {"prepare": prepare_command, "tokenizer": tokenizer_command, "report": report_command,
                "plan": plan_command, "train": train_command, "export": export_command,
                "evaluate": evaluate_command, "mup-check": mup_check_command, "lighthouse": lighthouse_command}
    if getattr(ns, "replica_group", None) is not None:  # a launcher's workers inherit it with the environment
        os.environ[GROUP_ENV] = str(ns.replica_group)
    try:
        plan = launch_plan(ns)
        if plan is not None:
            return launch_command(ns, plan, sys.argv[1:] if argv is None else argv)
        return commands[ns.command](ns)
    except Exception as exc:
        code = exit_code(exc)
        if code is None:
            raise
        report_error(exc, code)
        return code


def report_error(exc: Exception, code: int) -> None:
    """The error's one line, said once per launch (docs/commands.md, 'Launching' and 'Under plain torchrun')."""
    line = f"pretrainer: error: {exc}"
    if record_worker_status(code, str(exc), consequence=isinstance(exc, CollectiveFailure)):
        return
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:  # torchrun's summary prints the record as the failure's message and traceback: the line alone
        record = {"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                              "timestamp": str(int(time.time()))}}}
        Path(path).write_text(json.dumps(record))
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 or code != EXIT_USAGE:
        print(line if rank == 0 else f"pretrainer: error: rank {rank}: {exc}", file=sys.stderr)


def launch_command(ns, plan: LaunchPlan, argv: list[str]) -> int:
    """`train`/`evaluate` with `--nproc-per-node`: check the run for its whole world here, then start its workers."""
    from .train.launcher import check_before_launch, launch, worker_argv

    if ns.command == "train":
        args = PreTrainingArguments.from_yaml(ns.config, ns.overrides)
        level = logger.level
        logger.setLevel(logging.ERROR)  # the workers log what the check finds (setLevel also clears the level cache)
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints as it is imported
                check_before_launch(args, plan.world_size, plan.nproc_per_node)
        finally:
            logger.setLevel(level)
    elif ns.output:
        check_writable_folder(Path(ns.output).absolute().parent, "--output")
    return launch(plan, worker_argv(argv))


def exit_code(exc: BaseException) -> int | None:
    """The documented exit code of an error that ends a run (None: a bug, shown with its traceback)."""
    codes = {ConfigError: EXIT_USAGE, DataError: EXIT_USAGE, TrainingDiverged: EXIT_DIVERGED,
             CheckpointError: EXIT_CHECKPOINT, OutputError: EXIT_CHECKPOINT, StorageError: EXIT_CHECKPOINT,
             CollectiveFailure: EXIT_COLLECTIVE}
    return next((code for kind, code in codes.items() if isinstance(exc, kind)), None)


class OneLineErrors(argparse.ArgumentParser):
    """A usage error as one line, like every other error. Flags are never abbreviated: an abbreviation would reach
    a launched worker's command line, which keeps everything but the launcher's own flags."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def parse_known_args(self, args=None, namespace=None):
        # What is left over may be `key=value` overrides (main takes those); a flag is this parser's to name.
        if self._subparsers is None:  # a command's own parser: an unknown flag is named before a missing one
            flags = [item.split("=", 1)[0] for item in (sys.argv[1:] if args is None else args)]
            unknown = next((flag for flag in flags if flag.startswith("--") and flag != "--"
                            and flag not in self._option_string_actions), None)
            if unknown is not None:
                self.error(f"unrecognized arguments: {unknown}{self.suggestion(unknown)}")
        ns, extra = super().parse_known_args(args, namespace)
        unknown = next((item for item in extra if item.startswith("--") and item != "--"), None)
        if unknown is not None:
            self.error(f"unrecognized arguments: {unknown}{self.suggestion(unknown.split('=', 1)[0])}")
        return ns, extra

    def suggestion(self, flag: str) -> str:
        """The flags `flag` abbreviates, else the nearest ones: what the user most likely meant."""
        import difflib

        flags = [option for option in self._option_string_actions if option.startswith("--")]
        meant = [option for option in flags if option.startswith(flag)] or difflib.get_close_matches(flag, flags)
        return f"; did you mean {' or '.join(meant)}? (flags are spelled out in full)" if meant else ""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="pretrainer", description="Pretrain causal language models.")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train from a YAML config")
    train.add_argument("config", help="YAML config file")
    train.add_argument("overrides", nargs="*", help="key=value overrides (dotted keys for nested ones)")
    train.add_argument("--replica-group", type=int_at_least(0), metavar="I",
                       help="with fault_tolerance: this command's processes are replica group I (0..R-1)")
    add_launcher_flags(train)
    add_lighthouse_command(commands)

    plan = commands.add_parser("plan", help="predict per-rank memory and step time of a config's layout, and list "
                               "the layouts that fit")
    plan.add_argument("config", help="YAML config file")
    plan.add_argument("overrides", nargs="*", help="key=value overrides")
    plan.add_argument("--world-size", type=int_at_least(1),
                      help="processes (default: what the config describes: dp x tp x pp x cp)")
    plan.add_argument("--devices-per-node", type=int_at_least(1),
                      help="processes per machine (default: 8 on GPUs, all on CPU)")
    plan.add_argument("--device", help="the device to plan for: a GPU name (H100, A100-40GB, ...) or cpu "
                      "(default: this machine's)")
    plan.add_argument("--device-memory", help="memory per device, e.g. 80GB (default: the device's)")
    plan.add_argument("--host-memory", help="host RAM per machine for offloaded state and checkpoint loading "
                      "(default: this machine's with its GPU, else 3x the GPUs' memory)")
    plan.add_argument("--intra-node-bandwidth", metavar="RATE",
                      help="bandwidth one way between GPUs of a machine, e.g. 450GB/s (default: the device table's)")
    plan.add_argument("--inter-node-bandwidth", metavar="RATE",
                      help="one GPU's network bandwidth one way between machines, e.g. 400Gb/s or 50GB/s (default: "
                           "the device table's)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")

    export = commands.add_parser("export", help="write an HF folder from a checkpoint")
    export.add_argument("config", help="the run's YAML config")
    export.add_argument("overrides", nargs="*", help="key=value overrides")
    export.add_argument("--checkpoint", help="checkpoint folder or its URL (default: the latest in save_dir)")
    export.add_argument("--output", help="output folder or URL (default: save_dir/hf)")

    evaluate = commands.add_parser("evaluate", help="score multiple-choice tasks on a run's newest checkpoint or an "
                                   "HF folder")
    evaluate.add_argument("target", help="a run's save_dir, a folder or a URL (its newest checkpoint and config), or "
                          "an HF model folder")
    evaluate.add_argument("overrides", nargs="*", help="key=value overrides (seq_length, micro_batch_size, dtype, ...)")
    evaluate.add_argument("--tasks", action="append", metavar="FILE[,FILE...]",
                          help="task files, comma-separated or the flag repeated (default: the run's "
                          "downstream_evals); see docs/downstream-eval.md")
    evaluate.add_argument("--limit", type=int_at_least(1), help="score at most this many records of each task")
    evaluate.add_argument("--num-fewshot", type=int_at_least(0), help="solved examples before each context")
    evaluate.add_argument("--output", help="also write the scores to this JSON file")
    add_launcher_flags(evaluate)

    add_report_command(commands)

    # The deepspeed launcher passes --local_rank=N right after the program (the environment's LOCAL_RANK says the same).
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    add_prepare_command(commands)
    add_tokenizer_commands(commands)
    add_mup_check_command(commands)
    return parser


def add_report_command(commands) -> None:
    report = commands.add_parser("report", help="write SAVE_DIR/report/report.html and SVG charts from a run")
    report.add_argument("save_dir", help="the run's save_dir with metrics.jsonl: a folder, or a URL (then uploaded)")
    report.add_argument("--branch", action="append", metavar="DIR",
                        help="a cooldown branch's save_dir to draw over the run (repeatable; default: the folders "
                             "under SAVE_DIR/branches)")


def add_lighthouse_command(commands) -> None:
    lighthouse = commands.add_parser("lighthouse", help="torchft's lighthouse for a fault-tolerant run's replica "
                                                        "groups (fault_tolerance)")
    lighthouse.add_argument("--bind", required=True, metavar="HOST:PORT", help="where to listen, e.g. 0.0.0.0:29510")
    lighthouse.add_argument("--min-replicas", type=int_at_least(1), required=True, metavar="M",
                            help="the fewest replica groups a step may go on with")
    lighthouse.add_argument("--join-timeout-ms", type=int_at_least(0), default=60000, metavar="MS",
                            help="how long a quorum waits for a live group to join (default 60000)")
    lighthouse.add_argument("--heartbeat-timeout-ms", type=int_at_least(1), default=5000, metavar="MS",
                            help="a group without a heartbeat this long is gone from the quorum (default 5000)")


def add_mup_check_command(commands) -> None:
    check = commands.add_parser("mup-check", help="coordinate check: train the config's model a few steps at several "
                                "widths and compare the mean |activation| of its embedding, attention, MLP and logits")
    check.add_argument("config", help="YAML config file")
    check.add_argument("overrides", nargs="*", help="key=value overrides")
    check.add_argument("--widths", required=True, help="hidden sizes, comma-separated multiples of head_dim, e.g. "
                       "64,128,256,512")
    check.add_argument("--steps", type=int_at_least(1), default=10, help="training steps at each width (default 10)")
    check.add_argument("--json", action="store_true", help="print the whole record (per width, step and module) as "
                       "JSON")
    check.add_argument("--output", metavar="PAGE.html", help="the HTML page with the table and charts (default: "
                       "SAVE_DIR/mup-check.html, or a temporary folder's without a local save_dir)")


def add_prepare_command(commands) -> None:
    prep = commands.add_parser("prepare", help="tokenize a corpus into Megatron-compatible .bin/.idx files")
    prep.add_argument("--input", nargs="+", required=True,
                      help="files, globs or folders (json, jsonl, csv, txt, parquet; .gz/.zst too)")
    prep.add_argument("--tokenizer", "--tokenizer-model", dest="tokenizer",
                      help="HF tokenizer folder (with tokenizer.json) or the file")
    prep.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx (with --sharded: "
                      "the folder PREFIX_{key}_document/, which may be in object storage: s3://...)")
    prep.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenize, one output each")
    prep.add_argument("--append-eod", action="store_true", help="append the EOS token to every document")
    prep.add_argument("--workers", type=int_at_least(1), default=1, help="tokenizer worker processes")
    prep.add_argument("--txt-mode", choices=["line", "file"], default="line", help=".txt: a document per line/file")
    prep.add_argument("--shard", metavar="K/N", help="prepare only the K-th of N parts of the input files (K from 1; "
                      "files dealt round-robin), so N machines each write a part; train on the parts as a blend")
    prep.add_argument("--sharded", action="store_true", help="one shard per input file in PREFIX_{key}_document/ "
                      "with a manifest; a rerun redoes only the files without a complete shard")
    prep.add_argument("--ray", metavar="ADDRESS", help="run the files as tasks on a Ray cluster (host:port of "
                      "`ray start --head`, or auto); implies --sharded")
    prep.add_argument("--merge", action="store_true", help="with --sharded: once every shard is there, stream them "
                      "into one PREFIX_{key}_document.bin/.idx pair (flat memory)")
    prep.add_argument("--on-error", choices=ON_ERROR, default="fail",
                      help="a bad record: stop with its file:line (fail), or leave it out and count it (skip)")
    # Megatron-LM preprocess_data.py flags, so its command lines run unchanged.
    megatron = prep.add_argument_group("Megatron-LM preprocess_data.py compatibility")
    megatron.add_argument("--tokenizer-type", help="HuggingFaceTokenizer (the only kind: a tokenizer.json)")
    megatron.add_argument("--partitions", type=int_at_least(1), default=1,
                          help="accepted; the input is streamed in one pass")
    megatron.add_argument("--log-interval", type=int_at_least(1), help="accepted; the progress bar shows live rates")
    megatron.add_argument("--keep-sequential-samples", action="store_true", help="accepted; order is always kept")
    megatron.add_argument("--split-sentences", action="store_true", help=argparse.SUPPRESS)


def train_command(ns) -> int:
    from .train import PreTrainer

    with PreTrainer(PreTrainingArguments.from_yaml(ns.config, ns.overrides)) as trainer:
        trainer.train()
    return 0


def lighthouse_command(ns) -> int:
    from .train.lighthouse import serve

    return serve(ns.bind, ns.min_replicas, ns.join_timeout_ms, ns.heartbeat_timeout_ms)


def export_command(ns) -> int:
    from .train.metrics import setup_logging
    from .train.offline import export_checkpoint

    setup_logging()
    export_checkpoint(PreTrainingArguments.from_yaml(ns.config, ns.overrides), ns.checkpoint, ns.output)
    return 0


def evaluate_command(ns) -> int:
    from .train.metrics import setup_logging
    from .train.offline import evaluate, write_scores

    setup_logging()
    if ns.output:  # before any scoring: a bad path is a one-line error, not one after minutes of work
        check_writable_folder(Path(ns.output).absolute().parent, "--output")
    tasks = [path for item in ns.tasks or [] for path in item.split(",") if path]
    scores = evaluate(ns.target, tasks, ns.overrides, ns.limit, ns.num_fewshot)
    if int(os.environ.get("RANK", "0")) == 0:
        for name, values in scores.items():
            print(f"{name}: acc {values['acc']:.4f}  acc_norm {values['acc_norm']:.4f}  bpb {values['bpb']:.4f}  "
                  f"({values['records']} records)")
        if ns.output:
            print(f"scores: {write_scores(scores, ns.output)}")
    return 0


def prepare_command(ns) -> int:
    from .data.prepare import prepare, write_summary

    if not ns.tokenizer:
        raise DataError("prepare: give the tokenizer with --tokenizer PATH (or Megatron's --tokenizer-model PATH)")
    if ns.tokenizer_type and ns.tokenizer_type != "HuggingFaceTokenizer":
        raise DataError(f"--tokenizer-type {ns.tokenizer_type}: only HuggingFaceTokenizer is supported (a folder "
                        "with tokenizer.json); convert other tokenizers with transformers' AutoTokenizer first")
    if ns.split_sentences:
        raise DataError("--split-sentences is not supported: documents are written whole (one sequence each)")

    sharded = ns.sharded or ns.ray is not None
    if is_url(ns.output_prefix) and not sharded:
        raise DataError(f"--output-prefix {ns.output_prefix}: only --sharded (or --ray) writes to object storage, a "
                        "shard at a time; add --sharded")
    if ns.merge and (not sharded or is_url(ns.output_prefix)):
        raise DataError("--merge streams the shards of --sharded (or --ray) into one local .bin/.idx pair: "
                        + ("add --sharded" if not sharded else f"{ns.output_prefix} is in object storage, where "
                           "training reads the shards through their manifest; leave --merge out"))
    if sharded:
        from .data.shards import prepare_sharded

        summary = prepare_sharded(ns.input, ns.tokenizer, ns.output_prefix, ns.json_keys, ns.append_eod, ns.workers,
                                  ns.txt_mode, sys.stderr.isatty(), ns.on_error, ns.shard, ns.ray, ns.merge)
    else:
        summary = prepare(ns.input, ns.tokenizer, ns.output_prefix, ns.json_keys, ns.append_eod, ns.workers,
                          ns.txt_mode, progress=sys.stderr.isatty(), on_error=ns.on_error, shard=ns.shard)
    for line in summary.lines():
        print(line)
    print(f"summary: {write_summary(summary, ns.output_prefix)}")
    return 0


def plan_command(ns) -> int:
    from .plan.command import plan_for_command
    from .plan.render import as_json, text

    args = PreTrainingArguments.from_yaml(ns.config, ns.overrides)
    with contextlib.redirect_stdout(sys.stderr):  # the plan is the output (DeepSpeed prints as it is imported)
        plan = plan_for_command(args, ns.world_size, ns.devices_per_node, ns.device, ns.device_memory,
                                ns.host_memory, (ns.intra_node_bandwidth, ns.inter_node_bandwidth))
    print(json.dumps(as_json(plan), indent=1) if ns.json else text(plan))
    return 0


def mup_check_command(ns) -> int:
    import tempfile

    from .train.metrics import setup_logging
    from .train.mup_check import coordinate_check, parse_widths
    from .train.mup_page import text, write_page

    widths = parse_widths(ns.widths)
    args = PreTrainingArguments.from_yaml(ns.config, ns.overrides)
    local_save_dir = args.save_dir and not is_url(args.save_dir)
    page = Path(ns.output) if ns.output else Path(args.save_dir) / "mup-check.html" if local_save_dir else None
    if page is not None:  # before any training: a bad path is one line at once
        check_writable_folder(page.absolute().parent, "--output" if ns.output else "key 'save_dir'")
    setup_logging()
    level = logger.level
    logger.setLevel(logging.WARNING)  # each width's run is told in one line; the output is the table
    try:
        with contextlib.redirect_stdout(sys.stderr):
            record = coordinate_check(args, ns.config, ns.overrides, widths, ns.steps,
                                      say=lambda line: print(line, file=sys.stderr))
    finally:
        logger.setLevel(level)
    page = page or Path(tempfile.mkdtemp(prefix="pretrainer-mup-check-")) / "mup-check.html"
    record["page"] = str(write_page(record, page))
    print(json.dumps(record, indent=1) if ns.json else f"{text(record)}\npage: {record['page']}")
    return 0


def report_command(ns) -> int:
    from .train.report import ReportError, write_report
    from .train.run_files import write_remote_report

    if not is_url(ns.save_dir) and (Path(ns.save_dir) / "metrics.jsonl").is_file():
        check_writable_folder(Path(ns.save_dir) / "report", "SAVE_DIR")
    try:
        page = write_remote_report(ns.save_dir, ns.branch) if is_url(ns.save_dir) else \
            write_report(ns.save_dir, ns.branch)
    except (ReportError, StorageError) as exc:
        raise DataError(str(exc)) from None
    print(f"report: {page}")
    return 0


def run() -> None:
    """The console entry point: `main`, then exit without the interpreter's teardown, which would free every module,
    tensor and extension one by one (about 0.8 s after a short CPU run); threads and atexit handlers end first."""
    try:
        code = main()
    except SystemExit as exc:  # a stop request's checkpoint (exit 75), argparse's usage error
        record_worker_status(exc.code if isinstance(exc.code, int) else int(exc.code is not None))
        raise
    record_worker_status(code)
    # What the interpreter does first at exit, in its order: threading's exit hooks (they stop executor worker threads,
    # such as torch.compile's), then join the remaining non-daemon threads, then atexit.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
