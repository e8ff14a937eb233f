"""`pretrainer prepare --ray ADDRESS`: the input files as Ray tasks on a running cluster (`ray start`), one shard each.

Ray schedules the tasks and retries one whose worker or node died (`max_retries`); a bad record is not retried: it
stops the job with its file and line, as on one machine (or is counted with `--on-error skip`). The driver shows the
whole cluster's progress: files and bytes done, tokens/s and the time left.
"""

from __future__ import annotations

import socket
import time

from tqdm import tqdm

from .readers import DataError

RETRIES = 4  # a task whose worker or node dies is run again this many times


def run_on_ray(work, tasks: list, job, address: str, progress: bool):
    """(task, record) as each `work(task, job)` (one shard) completes on the cluster at `address` (`auto`: the one
    this machine joined)."""
    try:
        import ray
    except ImportError:
        raise DataError("--ray needs Ray on this machine and the cluster's: pip install -e '.[ray]'") from None
    if not tasks:
        return
    _check_reachable(address)
    try:
        # a task holds one CPU of Ray's count: the tokenizer's own thread pool would take every core of the node
        ray.init(address=address, logging_level="ERROR", log_to_driver=False,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise DataError(f"--ray {address}: no Ray cluster answers there ({str(exc).splitlines()[0]}); start one "
                        "with `ray start --head` and give its address (or auto on a machine that joined it)") from None
    try:
        remote = ray.remote(max_retries=RETRIES, retry_exceptions=False)(work)
        shared = ray.put(job)  # the tokenizer once to the object store, not once per task
        pending = {remote.remote(task, shared): task for task in tasks}
        total = sum(t.file.stat().st_size for t in tasks)
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
                   desc=f"{len(tasks)} files on Ray")
        tokens, start = 0, time.perf_counter()
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            task = pending.pop(done[0])
            record = _result(ray, done[0], task)
            tokens += record["tokens"]
            bar.update(record["source_bytes"])
            bar.set_postfix(files=f"{len(tasks) - len(pending)}/{len(tasks)}",
                            tokens_per_s=f"{tokens / max(time.perf_counter() - start, 1e-9):,.0f}", refresh=False)
            yield task, record
        bar.close()
    finally:
        ray.shutdown()


def _check_reachable(address: str) -> None:
    """A HOST:PORT with nothing listening is one line at once (Ray itself retries it for minutes)."""
    if address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise DataError(f"--ray {address}: give the head's HOST:PORT (`ray start --head` prints it), or auto")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise DataError(f"--ray {address}: no Ray cluster answers there ({exc.strerror or exc}); start one with "
                        "`ray start --head` and give its address (or auto on a machine that joined it)") from None


def _result(ray, ref, task) -> dict:
    """The task's record; its own error (a bad record) as the one line it would be on one machine."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, DataError):
            raise DataError(str(cause)) from None
        raise DataError(f"--ray: the task for {task.source} failed ({str(cause or exc).splitlines()[-1]})") from None
    except ray.exceptions.RayError as exc:  # retries exhausted: the worker or node kept dying
        raise DataError(f"--ray: the task for {task.source} was lost {RETRIES + 1} times ({type(exc).__name__}); "
                        "rerun the same command to redo the files that have no shard yet") from None
