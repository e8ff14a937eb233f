"""`pretrainer prepare --ray` on 1 and on 2 Ray nodes of this machine: tokens/s, tokens per CPU-second, peak RSS.

    .venv/bin/python bench/prepare_ray.py [--files 40] [--repeat 8] [--scale 10]

Runs itself inside a network namespace of its own (`unshare --net`, loopback only; needs root or user namespaces),
where it starts a head (`ray start --head`, 1 CPU), prepares the corpus, adds a second node (another raylet, 1 CPU)
and prepares it again. Both nodes share this machine's cores, so compare tokens per CPU-second (the CPU time of the
Ray workers), not wall time. Then the corpus `--scale` times larger (more files of the same size) on both nodes: the
driver's and a worker's peak RSS stay flat, since a task holds one file and the driver only the records; and
`--merge` of each result into one pair, in a process of its own, whose peak RSS stays flat too.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PORT = "6395"


def ray_processes() -> list[Path]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(b"ray::"):
                found.append(proc)
        except OSError:
            continue
    return found


class WorkerSampler:
    """The Ray workers' CPU seconds and peak RSS, read from /proc every 0.1 s while a job runs: a job's workers exit
    with it, so they are read while they live, and each keeps its last reading."""

    def __init__(self):
        self.cpu: dict[str, float] = {}
        self.peak_mib: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> "WorkerSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        ticks = os.sysconf("SC_CLK_TCK")
        while not self._stop.wait(0.1):
            for proc in ray_processes():
                try:
                    fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                    status = (proc / "status").read_text().splitlines()
                except OSError:
                    continue
                self.cpu[proc.name] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
                hwm = [int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM:")]
                self.peak_mib[proc.name] = max(hwm + [self.peak_mib.get(proc.name, 0.0)])


def corpus(folder: Path, files: int, repeat: int) -> Path:
    texts = [json.loads(line)["text"] for line in (REPO / "examples/data/python_docs.jsonl").read_text().splitlines()]
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        docs = [" ".join([texts[(i * 4 + k) % len(texts)]] * repeat) for k in range(4)]
        (folder / f"f{i:05d}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return folder


def ray_start(*flags: str) -> None:
    subprocess.run([BIN / "ray", "start", "--node-ip-address=127.0.0.1", "--num-cpus=1", "--disable-usage-stats",
                    *flags], check=True, capture_output=True)


def measure(name: str, inputs: Path, out: Path) -> None:
    from pretrainer.data.shards import prepare_sharded

    start = time.perf_counter()
    with WorkerSampler() as workers:
        summary = prepare_sharded([str(inputs)], str(REPO / "examples/models/tiny-llama"), str(out), ["text"],
                                  append_eod=True, progress=False, ray_address=f"127.0.0.1:{PORT}")
    seconds, cpu = time.perf_counter() - start, sum(workers.cpu.values())
    driver = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{name}: {summary.files_tokenized} files, {summary.tokens:,} tokens in {seconds:.1f} s: "
          f"{summary.tokens / seconds:,.0f} tokens/s, {summary.tokens / max(cpu, 1e-9):,.0f} per worker CPU-second "
          f"({len(workers.cpu)} workers, {cpu:.1f} CPU-s); peak RSS: driver {driver:.0f} MiB, largest worker "
          f"{max(workers.peak_mib.values(), default=0):.0f} MiB", flush=True)


def merge(name: str, folder: Path) -> None:
    """The shards merged into one pair by a process of its own; its peak RSS and the pair's size."""
    code = ("import resource, sys; from pathlib import Path; from pretrainer.data.merge import merge_shards; "
            "merge_shards(Path(sys.argv[1])); print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, str(folder)], check=True, capture_output=True, text=True)
    size = Path(f"{folder}.bin").stat().st_size / 2**20
    print(f"{name}: --merge of {len(list(folder.glob('*.bin')))} shards into a {size:.0f} MiB pair in "
          f"{time.perf_counter() - start:.1f} s, peak RSS {float(done.stdout.split()[-1]):.0f} MiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=40, help="each document's text repeated this many times")
    parser.add_argument("--scale", type=int, default=10, help="the larger corpus: this many times the files")
    ns = parser.parse_args()
    if os.environ.get("PRETRAINER_BENCH_NAMESPACE") != "1":  # re-run inside a network namespace of its own
        env = {**os.environ, "PRETRAINER_BENCH_NAMESPACE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
        script = f"ip link set lo up && exec {sys.executable} {' '.join(map(str, sys.argv))}"
        sys.exit(subprocess.run(["unshare", "--net", "bash", "-c", script], env=env).returncode)
    work = Path(tempfile.mkdtemp(prefix="ray-bench-"))  # short: Ray's socket paths must stay under 108 bytes
    try:
        ray_start("--head", f"--port={PORT}", "--include-dashboard=false", f"--temp-dir={work / 'r'}")
        small = corpus(work / "small", ns.files, ns.repeat)
        measure("1 node ", small, work / "one" / "c")
        ray_start(f"--address=127.0.0.1:{PORT}")
        measure("2 nodes", small, work / "two" / "c")
        measure(f"2 nodes, {ns.scale}x files", corpus(work / "large", ns.files * ns.scale, ns.repeat),
                work / "large-out" / "c")
        merge("2 nodes", work / "two" / "c_text_document")
        merge(f"2 nodes, {ns.scale}x files", work / "large-out" / "c_text_document")
    finally:
        subprocess.run([BIN / "ray", "stop", "--force"], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
