"""`pretrainer prepare --sharded` and `--ray`: one shard per input file, resumable per file, the one-machine token
stream whoever ran it; a real two-node Ray cluster in a network namespace of its own."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import CORPUS, QUICKSTART_MODEL
from launch import BIN, environment, pretrainer, run, run_ok
from pretrainer.data.token_formats import open_prepared

FILES = 42


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """42 files in five formats (jsonl, jsonl.gz, txt, csv, parquet) cut from the shipped corpus, each long enough
    (about 0.2 s of tokenizing) for a worker to be killed in the middle of one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("corpus")
    texts = [json.loads(line)["text"] for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    for i in range(FILES):
        part = [" ".join([t.replace("\n", " ")] * 8) for t in texts[i * 4:i * 4 + 4]]
        name = folder / f"f{i:02d}"
        kind = i % 5
        if kind == 0:
            name.with_suffix(".jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
        elif kind == 1:
            with gzip.open(name.with_suffix(".jsonl.gz"), "wt") as f:
                f.writelines(json.dumps({"text": t}) + "\n" for t in part)
        elif kind == 2:
            name.with_suffix(".txt").write_text("\n".join(part) + "\n")
        elif kind == 3:
            import csv
            with open(name.with_suffix(".csv"), "w", newline="") as f:
                csv.writer(f).writerows([["text"], *[[t] for t in part]])
        else:
            pq.write_table(pa.table({"text": part}), name.with_suffix(".parquet"))
    return folder


def prepare(corpus: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    return run_ok(pretrainer("prepare", "--input", corpus, "--tokenizer", QUICKSTART_MODEL, "--append-eod",
                             "--output-prefix", out, *flags))


@pytest.fixture(scope="module")
def one_machine(corpus, tmp_path_factory) -> list:
    prefix = tmp_path_factory.mktemp("one") / "c"
    prepare(corpus, prefix)
    return documents(f"{prefix}_text_document")


def documents(path) -> list:
    corpus = open_prepared(path)
    return [corpus[i].tolist() for i in range(corpus.num_documents)]


def counts(done: subprocess.CompletedProcess) -> tuple[int, int]:
    found = re.search(r"files: (\d+) tokenized, (\d+) already complete", done.stdout)
    assert found, done.stdout
    return int(found.group(1)), int(found.group(2))


def test_shards_are_the_one_machine_stream_by_any_route_and_a_rerun_redoes_only_what_is_missing(
        corpus, one_machine, tmp_path):
    out = tmp_path / "s" / "c"
    assert counts(prepare(corpus, out, "--sharded", "--workers", "2")) == (FILES, 0)
    folder = Path(f"{out}_text_document")
    assert documents(folder) == one_machine and len(one_machine) == FILES * 4
    manifest = json.loads((folder / "manifest.json").read_text())
    assert len(manifest["shards"]) == FILES and manifest["documents"] == FILES * 4
    (folder / "shard-00003.done.json").unlink()       # a task that died before its record
    (folder / "shard-00007.bin").write_bytes(b"\0")   # a shard damaged since
    (folder / "manifest.json").unlink()
    assert counts(prepare(corpus, out, "--sharded")) == (2, FILES - 2)
    assert documents(folder) == one_machine
    # two machines, each its part of the files, into one folder: the manifest comes with the last shard
    parts = tmp_path / "parts" / "c"
    first = prepare(corpus, parts, "--sharded", "--shard", "1/2")
    assert counts(first) == (FILES // 2, 0) and "not complete yet" in first.stdout
    assert counts(prepare(corpus, parts, "--sharded", "--shard", "2/2")) == (FILES // 2, 0)
    assert documents(f"{parts}_text_document") == one_machine


RAY_SCRIPT = r"""
set -euo pipefail
ip link set lo up
export RAY_USAGE_STATS_ENABLED=0
RAYTMP=$(mktemp -d /tmp/ray-XXXXXX)  # short: Ray's socket paths must stay under 108 bytes
start_cluster() {
    "$BIN/ray" start --head --node-ip-address=127.0.0.1 --port=$PORT --num-cpus=1 --include-dashboard=false \
        --disable-usage-stats --temp-dir="$RAYTMP" > "$WORK/head.log" 2>&1
    "$BIN/ray" start --address=127.0.0.1:$PORT --node-ip-address=127.0.0.1 --num-cpus=1 --disable-usage-stats \
        > "$WORK/node.log" 2>&1
}
prepare() {
    "$BIN/pretrainer" prepare --input "$CORPUS" --tokenizer "$TOKENIZER" --append-eod --ray 127.0.0.1:$PORT "$@"
}
records() { ls "$1"_text_document/*.done.json 2>/dev/null | wc -l; }
trap '"$BIN/ray" stop --force > /dev/null 2>&1 || true; rm -rf "$RAYTMP"' EXIT
start_cluster
"$BIN/python" -c "import ray; ray.init(address='127.0.0.1:$PORT', logging_level='ERROR'); \
print('nodes', sum(n['Alive'] for n in ray.nodes()))"
prepare --output-prefix "$WORK/plain/c" > "$WORK/plain.out"
# a worker killed mid-job (SIGKILL): Ray runs its task again
prepare --output-prefix "$WORK/killed/c" > "$WORK/killed.out" &
job=$!
until pgrep -f '^ray::tokenize_file' > /dev/null; do sleep 0.02; done
pkill -9 -f '^ray::tokenize_file' && echo "killed a worker"
wait $job
# the driver stopped mid-job (SIGTERM: a background job ignores SIGINT), the cluster restarted, the same command again
prepare --output-prefix "$WORK/again/c" > "$WORK/first.out" &
job=$!
until [ "$(records "$WORK/again/c")" -ge 3 ]; do sleep 0.05; done
kill -TERM $job; wait $job || echo "driver interrupted"
"$BIN/ray" stop --force > /dev/null 2>&1
start_cluster
echo "records before the rerun: $(records "$WORK/again/c")"
prepare --output-prefix "$WORK/again/c" > "$WORK/again.out"
"""


def test_a_two_node_ray_cluster_writes_the_one_machine_stream_through_a_killed_worker_and_a_rerun(
        corpus, one_machine, tmp_path):
    """Two raylets (`ray start --head`, `ray start --address`) in a network namespace of their own."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) for a network namespace")
    env = {**environment(1), "BIN": str(BIN), "PORT": "6391", "WORK": str(tmp_path), "CORPUS": str(corpus),
           "TOKENIZER": str(QUICKSTART_MODEL)}
    done = run(["unshare", "--net", "bash", "-c", RAY_SCRIPT], env=env, timeout=600)
    logs = "".join(path.read_text()[-2000:] for path in sorted(tmp_path.glob("*.log")))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + logs
    assert "nodes 2" in done.stdout and "killed a worker" in done.stdout and "driver interrupted" in done.stdout
    for name in ("plain", "killed", "again"):
        assert documents(tmp_path / name / "c_text_document") == one_machine, name
    before = int(re.search(r"records before the rerun: (\d+)", done.stdout).group(1))
    assert 3 <= before < FILES
    assert counts(subprocess.CompletedProcess([], 0, (tmp_path / "again.out").read_text())) == (FILES - before, before)
