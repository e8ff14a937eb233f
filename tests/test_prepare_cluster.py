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
def one_machine_pair(corpus, tmp_path_factory) -> str:
    prefix = tmp_path_factory.mktemp("one") / "c"
    prepare(corpus, prefix)
    return f"{prefix}_text_document"


@pytest.fixture(scope="module")
def one_machine(one_machine_pair) -> list:
    return documents(one_machine_pair)


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
    # the two parts at the same time: whichever finishes last sees the other's records and writes the manifest
    together = tmp_path / "together" / "c"
    command = pretrainer("prepare", "--input", corpus, "--tokenizer", QUICKSTART_MODEL, "--append-eod",
                         "--output-prefix", together, "--sharded", "--shard")
    running = [subprocess.Popen([*map(str, command), part], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=environment(1)) for part in ("1/2", "2/2")]
    outputs = [process.communicate(timeout=300) for process in running]
    assert all(process.returncode == 0 for process in running), outputs
    assert sum("wrote " in out and "manifest.json" in out for out, _ in outputs) == 1, outputs
    assert documents(f"{together}_text_document") == one_machine


def test_merge_streams_the_shards_into_the_one_machine_pair_byte_for_byte(corpus, one_machine_pair, tmp_path):
    out = tmp_path / "c"
    merged = prepare(corpus, out, "--sharded", "--merge", "--workers", "2")
    assert counts(merged) == (FILES, 0) and f"wrote {out}_text_document.bin/.idx" in merged.stdout
    for suffix in (".bin", ".idx"):
        assert Path(f"{out}_text_document{suffix}").read_bytes() == Path(one_machine_pair + suffix).read_bytes()
    (tmp_path / "c_text_document" / "shard-00005.bin").write_bytes(b"\0\1")  # damaged after the manifest
    (tmp_path / "c_text_document" / "shard-00005.done.json").touch()
    from pretrainer.data.merge import merge_shards
    from pretrainer.data.readers import DataError
    with pytest.raises(DataError, match="shard-00005.bin changed since its manifest was written"):
        merge_shards(tmp_path / "c_text_document")
    refused = run(pretrainer("prepare", "--input", corpus, "--tokenizer", QUICKSTART_MODEL, "--output-prefix", out,
                             "--merge"))
    assert refused.returncode != 0 and "add --sharded" in refused.stderr.strip().splitlines()[-1]


def test_shards_in_object_storage_resume_and_train_from_their_manifest(corpus, one_machine, s3_server, tmp_path):
    """Input files and shards in a bucket (moto's S3 server through s3fs): no shared file system needed."""
    for path in sorted(corpus.iterdir()):
        s3_server.fs.put_file(str(path), f"bucket/corpus/{path.name}")
    out = "s3://bucket/shards/c"
    assert counts(prepare("s3://bucket/corpus/", out, "--sharded", "--workers", "2")) == (FILES, 0)
    folder = "bucket/shards/c_text_document"
    assert s3_server.fs.isfile(f"{folder}/manifest.json") and s3_server.fs.isfile("bucket/shards/c_summary.json")
    s3_server.fs.rm_file(f"{folder}/shard-00004.done.json")          # a task that died before its record
    s3_server.fs.pipe_file(f"{folder}/shard-00009.bin", b"\0\0")     # a shard replaced since
    s3_server.fs.pipe_file("bucket/corpus/f12.txt", b"changed since\n")  # an input replaced since
    rerun = prepare("s3://bucket/corpus/", out, "--sharded")
    assert counts(rerun) == (3, FILES - 3)
    s3_server.fs.put_file(str(corpus / "f12.txt"), "bucket/corpus/f12.txt")
    assert counts(prepare("s3://bucket/corpus/", out, "--sharded")) == (1, FILES - 1)
    from pretrainer.data.remote import local_prefix
    assert documents(local_prefix(f"{out}_text_document")) == one_machine  # each shard checked against its checksum
    s3_server.fs.pipe_file(f"{folder}/shard-00002.idx", b"\0" * 50)        # replaced after the manifest
    from pretrainer.data.readers import DataError
    with pytest.raises(DataError, match="shard-00002.idx: its checksum is not the one its manifest lists"):
        local_prefix(f"{out}_text_document")
    for flags, message in ((["--merge"], "leave --merge out"), ([], "add --sharded")):
        refused = run(pretrainer("prepare", "--input", corpus, "--tokenizer", QUICKSTART_MODEL, "--output-prefix",
                                 out, *(["--sharded"] if flags else []), *flags))
        assert refused.returncode != 0 and message in refused.stderr.strip().splitlines()[-1]


RAY_SCRIPT = r"""
set -euo pipefail
ip link set lo up
export RAY_USAGE_STATS_ENABLED=0
# an S3 server in the namespace for the last job; the nodes' workers find it through the environment they start in
"$BIN/moto_server" -H 127.0.0.1 -p 5000 > "$WORK/moto.log" 2>&1 &
export AWS_ENDPOINT_URL=http://127.0.0.1:5000 AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing-secret \
    AWS_DEFAULT_REGION=us-east-1
RAYTMP=$(mktemp -d /tmp/ray-XXXXXX)  # short: Ray's socket paths must stay under 108 bytes
start_cluster() {
    "$BIN/ray" start --head --node-ip-address=127.0.0.1 --port=$PORT --num-cpus=1 --include-dashboard=false \
        --disable-usage-stats --temp-dir="$RAYTMP" > "$WORK/head.log" 2>&1
    "$BIN/ray" start --address=127.0.0.1:$PORT --node-ip-address=127.0.0.1 --num-cpus=1 --disable-usage-stats \
        > "$WORK/node.log" 2>&1
}
prepare_from() {
    "$BIN/pretrainer" prepare --input "$1" --tokenizer "$TOKENIZER" --append-eod --ray 127.0.0.1:$PORT "${@:2}"
}
prepare() { prepare_from "$CORPUS" "$@"; }
records() { ls "$1"_text_document/*.done.json 2>/dev/null | wc -l; }
trap '"$BIN/ray" stop --force > /dev/null 2>&1 || true; rm -rf "$RAYTMP"; kill %1 2> /dev/null || true' EXIT
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
# input and output in a bucket: the nodes share no folder
"$BIN/python" -c "import s3fs, pathlib, sys; fs = s3fs.S3FileSystem(); fs.mkdir('bucket'); \
[fs.put_file(str(p), 'bucket/corpus/' + p.name) for p in pathlib.Path(sys.argv[1]).iterdir()]" "$CORPUS"
prepare_from s3://bucket/corpus/ --output-prefix s3://bucket/out/c > "$WORK/s3.out"
"$BIN/python" -c "import s3fs, sys; s3fs.S3FileSystem().get('bucket/out/c_text_document/', sys.argv[1], \
recursive=True)" "$WORK/s3/c_text_document/"
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
    for name in ("plain", "killed", "again", "s3"):
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
