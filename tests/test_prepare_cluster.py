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


def test_training_from_the_shards_gives_the_losses_of_the_one_machine_pair(corpus, base_config, tmp_path):
    from pretrainer import PreTrainer, PreTrainingArguments

    prepare(corpus, tmp_path / "one" / "c")
    prepare(corpus, tmp_path / "sharded" / "c", "--sharded", "--workers", "2")

    def losses(data_path: Path, name: str) -> list:
        args = PreTrainingArguments(**{**base_config, "train_data": None, "megatron_dataset_flag": True,
                                       "data_path": str(data_path), "dataloader_config": {"split": "90,10,0"},
                                       "num_training_steps": 3, "eval_interval": 0, "save_interval": 0,
                                       "save_dir": str(tmp_path / name)})
        PreTrainer(args).train()
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if "loss" in r]

    expected = losses(tmp_path / "one" / "c_text_document", "run-one")
    assert len(expected) == 3
    assert losses(tmp_path / "sharded" / "c_text_document", "run-sharded") == expected


def test_a_bad_record_stops_its_file_or_is_counted_and_no_documents_at_all_is_refused(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    (tmp_path / "in" / "b.jsonl").write_text('{"text": "three"}\n{"txt": "four"}\n')
    failed = run(pretrainer("prepare", "--input", tmp_path / "in", "--tokenizer", QUICKSTART_MODEL, "--sharded",
                            "--append-eod", "--output-prefix", tmp_path / "out" / "c"))
    assert failed.returncode == 2 and "b.jsonl:2" in failed.stderr, failed.stderr
    assert (tmp_path / "out" / "c_text_document" / "shard-00000.done.json").is_file()  # a.jsonl's shard stays
    skipped = prepare(tmp_path / "in", tmp_path / "out" / "c", "--sharded", "--on-error", "skip")
    assert counts(skipped) == (1, 1) and "skipped: 1 bad record(s)" in skipped.stdout
    assert len(documents(tmp_path / "out" / "c_text_document")) == 3
    refail = run(pretrainer("prepare", "--input", tmp_path / "in", "--tokenizer", QUICKSTART_MODEL, "--sharded",
                            "--append-eod", "--output-prefix", tmp_path / "out" / "c"))  # b's shard lacks a record
    assert refail.returncode == 2 and "b.jsonl:2" in refail.stderr, refail.stderr
    (tmp_path / "in" / "b.jsonl").write_text('{"text": "three"}\n{"text": "four"}\n')
    other = run_ok(pretrainer("prepare", "--input", tmp_path / "in", "--tokenizer", QUICKSTART_MODEL, "--sharded",
                              "--output-prefix", tmp_path / "out" / "c"))  # without --append-eod: all redone
    assert counts(other) == (2, 0) and len(documents(tmp_path / "out" / "c_text_document")) == 4
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.jsonl").write_text('{"txt": "x"}\n')
    refused = run(pretrainer("prepare", "--input", tmp_path / "empty", "--tokenizer", QUICKSTART_MODEL, "--sharded",
                             "--on-error", "skip", "--output-prefix", tmp_path / "none" / "c"))
    assert refused.returncode == 2 and "no documents to write for key 'text' (every record was skipped)" in \
        refused.stderr, refused.stderr


@pytest.mark.parametrize("address, message", [
    ("127.0.0.1:1", "--ray 127.0.0.1:1: no Ray cluster answers there (Connection refused); start one with `ray start"),
    ("head-node", "--ray head-node: give the head's HOST:PORT"),
])
def test_a_ray_address_where_no_cluster_answers_is_one_line_at_once(corpus, tmp_path, address, message):
    done = run(pretrainer("prepare", "--input", corpus, "--tokenizer", QUICKSTART_MODEL, "--ray", address,
                          "--output-prefix", tmp_path / "c"), timeout=120)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
