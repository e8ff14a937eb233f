"""Shared fixtures: a tiny real Llama (config + the shipped BPE tokenizer), a small real corpus, a base config.
Helpers that tests import live in helpers.py (and launching commands in launch.py)."""

from __future__ import annotations

import ast
import atexit
import inspect
import logging
import os
import shutil
import subprocess as subprocess_module
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from helpers import small_corpus_file, write_tiny_model

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tokenized stores of train_data go to a cache of this test session (shared by the processes it starts), not
# to the user's ~/.cache; removed when the session ends.
if "PRETRAINER_CACHE_DIR" not in os.environ:
    os.environ["PRETRAINER_CACHE_DIR"] = tempfile.mkdtemp(prefix="pretrainer-test-cache-")
    atexit.register(shutil.rmtree, os.environ["PRETRAINER_CACHE_DIR"], ignore_errors=True)
# DeepSpeed's ops are built once into the environment by scripts/build_deepspeed_ops.py (make test).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


# `make test` runs pytest in two workers (pytest-xdist) whose launches overlap: a test that starts processes and
# waits for them, or runs on one core, leaves a core to the other worker. A module's tests stay together on one
# worker, so a module-scoped fixture (a shared torchrun job) runs once. `accelerate launch` and the `deepspeed`
# launcher bind port 29500 unless told otherwise, and the seeds' commands are run as they are, so the modules
# that run them share one worker and never launch at the same time.
SHARED_WORKER = {"test_deepspeed": "fixed-port-launchers", "test_megatron": "fixed-port-launchers"}
# The longest groups (measured, one worker) start first, so no long one is left to run alone at the end; this
# only orders the queue: a group not named here runs after them, in file order.
LONGEST_FIRST = ("test_cli", "fixed-port-launchers", "test_faults", "test_moe", "test_replicas", "test_engines")


def worker_group(module_path: str) -> str:
    stem = Path(module_path.split("::", 1)[0]).stem
    return SHARED_WORKER.get(stem, stem)


# Two tiers. A test that starts processes (torchrun, the console entry, accelerate, a shared torchrun job) is
# marked `processes`, found from its source: it, a fixture it uses or a function of tests/ they call reaches
# `subprocess` (launch.py's run/run_ok/start do). `make test-fast` runs the others: in-process tests only.
TESTS = Path(__file__).parent


def _starts_processes(function, seen: set) -> bool:
    if not inspect.isfunction(function) or function in seen:
        return False
    seen.add(function)
    source_file = inspect.getsourcefile(function)
    if source_file is None or Path(source_file).parent != TESTS:
        return False
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    scope = function.__globals__
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if {"subprocess", "launch", "multi_run"} & set(names):
                return True
        elif isinstance(node, ast.Name):
            target = scope.get(node.id)
            if target is subprocess_module or _starts_processes(target, seen):
                return True
    return False


def _uses_processes(item: pytest.Item) -> bool:
    seen: set = set()
    definitions = getattr(item, "_fixtureinfo", None)
    fixtures = [d.func for defs in (definitions.name2fixturedefs.values() if definitions else ()) for d in defs]
    return any(_starts_processes(f, seen) for f in [getattr(item, "function", None), *fixtures])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _uses_processes(item):
            item.add_marker(pytest.mark.processes)
    rank = {group: index for index, group in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(worker_group(item.nodeid), len(rank)))  # stable: modules keep order


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "processes: starts processes (torchrun, the CLI, launchers); "
                            "`make test-fast` leaves these out")


# The whole suite's folders (tiny checkpoints, corpora, tokenized stores) at their largest, measured with
# pyproject's retention policy; a disk that fills mid-run fails dozens of tests with errors that hide the cause.
SUITE_DISK_GIB = 4


def pytest_sessionstart(session) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller has checked
        return
    root = Path(session.config.option.basetemp or tempfile.gettempdir())
    while not root.exists():
        root = root.parent
    free = shutil.disk_usage(root).free / 2**30
    if free < SUITE_DISK_GIB:
        raise pytest.UsageError(f"the test suite needs about {SUITE_DISK_GIB} GiB free under {root} and "
                                f"{free:.1f} GiB are free: free space there, or point TMPDIR (or --basetemp) "
                                f"at a larger disk")


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without xdist, pytest runs one process
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class WorkerGroups(LoadScopeScheduling):
        """Whole groups (worker_group) to a worker, in the order collected."""

        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    config.option.loadscopereorder = False  # keep LONGEST_FIRST's order, not xdist's largest-count-first
    return WorkerGroups(config, log)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    return small_corpus_file(tmp_path_factory.mktemp("corpus") / "docs.jsonl")


@pytest.fixture
def base_config(tiny_model, small_corpus, tmp_path) -> dict:
    return fast_config(tiny_model, small_corpus, tmp_path / "run")


def fast_config(model: Path, corpus: Path, save_dir: Path) -> dict:
    """A fast native config: fp32, seq 32, 2 x 2 micro-batches, 6 steps."""
    return {
        "num_training_steps": 6, "micro_batch_size": 2, "dp": 1, "gradient_accumulation_steps": 2,
        "seq_length": 32, "dtype": "fp32", "model_path": str(model), "train_data": str(corpus),
        "save_dir": str(save_dir), "lr": 1e-3, "warmup_steps": 2, "eval_interval": 3, "eval_iters": 2,
        "save_interval": 3, "seed": 7, "write_report": False,  # the report has its own tests
    }


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def take(self) -> str:
        """The lines logged since the last take."""
        text, self.lines = "\n".join(self.lines), []
        return text


@pytest.fixture
def pretrainer_log():
    """The `pretrainer` logger's INFO lines, whatever handlers and propagation earlier runs left it with."""
    logger, handler = logging.getLogger("pretrainer"), _Lines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


class S3Server:
    """moto's S3 server on 127.0.0.1 (a process of its own) and a client of it (s3fs, the real stack)."""

    def __init__(self, port: int):
        self.port, self.endpoint = port, f"http://127.0.0.1:{port}"
        self.fs = None


S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
                  "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server on a free local port, for the module, with a bucket named `bucket`; the environment
    points the clients (this process's and the runs it starts) at it."""
    s3fs = pytest.importorskip("s3fs", reason="the s3 extra (s3fs) is part of make setup-test")
    from launch import listening_port

    server = S3Server(listening_port())
    process = subprocess_module.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p",
                                       str(server.port)], stdout=subprocess_module.DEVNULL,
                                      stderr=subprocess_module.DEVNULL)
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {"AWS_ENDPOINT_URL": server.endpoint, **S3_CREDENTIALS}.items():
            patch.setenv(key, value)
        server.fs = s3fs.S3FileSystem(skip_instance_cache=True)
        for _ in range(100):  # until it answers
            try:
                server.fs.mkdir("bucket")
                break
            except Exception:
                time.sleep(0.1)
        else:
            process.kill()
            pytest.fail(f"moto_server did not start on {server.endpoint}")
        yield server
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture
def fault_relay(s3_server, monkeypatch):
    """The clients (this process's and the runs it starts) go through a relay in front of the S3 server that can
    refuse chosen requests or take the server down (tests/fault_proxy.py)."""
    from fault_proxy import FaultProxy

    proxy = FaultProxy(s3_server.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    yield proxy
    proxy.close()
