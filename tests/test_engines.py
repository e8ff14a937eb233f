"""Every engine with 2 real processes (torchrun, gloo): the same losses as one process, exact resume, export.

DeepSpeed runs use a DeepSpeed JSON without an optimizer block, so DeepSpeed trains with the run's own AdamW
and schedule and the losses can be compared with the single-process run.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from helpers import (
    assert_layout_answers,
    assert_same_downstream_scores,
    eval_losses,
    grad_norms,
    read_metrics,
    train_losses,
    write_layout_check,
    write_task,
)
from launch import BIN, REPO, environment, listening_port, pretrainer, run, run_ok, torchrun
from multi_run import launch_cases
from pretrainer import PreTrainer, PreTrainingArguments
from pretrainer.config import ConfigError

ENGINES = {
    "ddp": ["engine=ddp"],
    "fsdp": ["engine=fsdp"],
    "fsdp-no-reshard": ["engine=fsdp", "fsdp_reshard_after_forward=false"],
    "fsdp-cpu-offload": ["engine=fsdp", "fsdp_cpu_offload=true"],
    "fsdp-hybrid": ["engine=fsdp", "fsdp_shard_size=1"],  # 2 replicas x 1 shard: the replicate dimension
    "fsdp-activation-checkpointing": ["engine=fsdp", "activation_checkpointing=full"],
    # each micro-batch reduce-scatters (gradients stay sharded): 4 micro-batches of 1 per step on each rank (and
    # 4 eval micro-batches of 1: the same held-out rows)
    "fsdp-sharded-accumulation": ["engine=fsdp", "accumulate_gradients=sharded", "micro_batch_size=1",
                                  "gradient_accumulation_steps=4", "eval_iters=4"],
    "ddp-selective-checkpointing": ["engine=ddp", "activation_checkpointing=selective"],
    "deepspeed-zero1": ["deepspeed={root}/zero1.json"],
    "deepspeed-zero2": ["deepspeed={root}/zero2.json"],
    "deepspeed-zero3": ["deepspeed={root}/zero3.json"],
    "deepspeed-zero2-offload": ["deepspeed={root}/zero2-offload.json"],
    "deepspeed-zero3-offload": ["deepspeed={root}/zero3-offload.json"],
}
DEEPSPEED_JSON = {
    "zero1.json": {"zero_optimization": {"stage": 1}},
    "zero2.json": {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto",
                   "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto"},
    "zero3.json": {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                         "stage3_prefetch_bucket_size": "auto",
                                         "stage3_param_persistence_threshold": "auto"}},
    "zero2-offload.json": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "zero3-offload.json": {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                 "offload_param": {"device": "cpu"}}},
}


def train_on_two_ranks(config: Path, *overrides: str) -> None:
    run_ok(torchrun(2, *pretrainer("train", config, *overrides)))


@pytest.fixture(scope="module")
def setup(tmp_path_factory, request):
    """One config for 2 ranks x micro-batch 2, and the single-process run with micro-batch 4 it must match."""
    from conftest import write_tiny_model

    root = tmp_path_factory.mktemp("engines")
    corpus = root / "docs.jsonl"
    with open(REPO / "examples" / "data" / "python_docs.jsonl", encoding="utf-8") as src:
        corpus.write_text("".join(line for _, line in zip(range(150), src)))
    config = {"num_training_steps": 6, "micro_batch_size": 2, "dp": 2, "gradient_accumulation_steps": 2,
              "seq_length": 32, "dtype": "fp32", "model_path": str(write_tiny_model(root / "model")),
              "train_data": str(corpus), "lr": 1e-3, "warmup_steps": 2, "eval_interval": 3, "eval_iters": 2,
              "save_interval": 3, "seed": 7, "write_report": False,
              "downstream_evals": [write_task(root / "tiny_task.jsonl")]}  # scored by each engine's forward
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    for name, content in DEEPSPEED_JSON.items():
        (root / name).write_text(json.dumps(content))
    single_dir = root / "single"
    torch.set_num_threads(1)
    single = PreTrainer(PreTrainingArguments(**{**config, "dp": 1, "micro_batch_size": 4, "save_dir": str(single_dir)}))
    single.train()
    write_layout_check(single)
    muon = PreTrainer(PreTrainingArguments(**{**config, "dp": 1, "micro_batch_size": 4, "optimizer": "muon",
                                              "save_dir": str(root / "single-muon")}))
    muon.train()
    write_layout_check(muon)
    PreTrainer(PreTrainingArguments(**{**config, "dp": 1, "micro_batch_size": 4, **MUP,
                                       "save_dir": str(root / "single-mup")})).train()
    return root, path, single_dir


def assert_same_run(got: Path, expected: Path, rel: float) -> None:
    want, have = train_losses(expected), train_losses(got)
    assert sorted(have) == sorted(want) == [1, 2, 3, 4, 5, 6]
    assert [have[s] for s in sorted(have)] == pytest.approx([want[s] for s in sorted(want)], rel=rel)
    want_eval, have_eval = eval_losses(expected), eval_losses(got)
    assert sorted(have_eval) == sorted(want_eval) == [3, 6]
    assert [have_eval[s] for s in (3, 6)] == pytest.approx([want_eval[s] for s in (3, 6)], rel=rel)
    # the gradient norm (clipping's input and a logged figure) counts each shard and copy once
    want_norms, have_norms = grad_norms(expected), grad_norms(got)
    assert sorted(have_norms) == sorted(want_norms) and want_norms
    assert [have_norms[s] for s in sorted(have_norms)] == pytest.approx([want_norms[s] for s in sorted(want_norms)],
                                                                        rel=max(rel, 1e-4))
    assert_same_downstream_scores(got, expected, rel=max(rel, 1e-5))


# Variants of an engine whose checkpoint path is the base engine's: equality and export only, to keep the
# suite short (their resume is the base engine's code, tested above them).
SAME_CHECKPOINT_PATH = {"fsdp-no-reshard", "fsdp-hybrid", "fsdp-activation-checkpointing",
                        "ddp-selective-checkpointing", "deepspeed-zero2-offload"}


BF16_ENGINES = {"ddp": ["engine=ddp"], "fsdp": ["engine=fsdp"], "deepspeed-zero2": ["deepspeed={root}/zero2.json"],
                # the 4 rows of the single run's micro-batch on one replica of 2 tensor-parallel ranks
                "megatron-tp2": ["engine=megatron", "plugin_args.tp_degree=2", "dp=1", "micro_batch_size=4"],
                # FSDP2 over dp with its mixed-precision policy (parameters gathered in bf16, no autocast)
                "megatron-dp2-optim-grads-params": ["engine=megatron",
                                                    "plugin_args.data_parallel_sharding_strategy=optim_grads_params"]}
BF16_SHORT_RUN = ["dtype=bf16", "num_training_steps=2", "warmup_steps=1", "eval_interval=0", "export_hf=false"]
# Muon (hidden matrices) with AdamW (the rest): each engine that trains it, straight and stopped-then-resumed
MUON_ENGINES = {"ddp": ["engine=ddp"], "fsdp": ["engine=fsdp"]}
# muP's per-group lrs under ZeRO's flat partitions (the tiny model at twice the base width)
MUP = {"parametrization": "mup", "mup_base_hidden_size": 32}
MUP_ENGINES = {"deepspeed-zero2": ["deepspeed={root}/zero2.json"], "deepspeed-zero3": ["deepspeed={root}/zero3.json"]}


@pytest.fixture(scope="module")
def engine_runs(setup) -> None:
    """Every 2-rank run of this module, as cases of one torchrun job (tests/multi_run.py): the processes
    start once, and DeepSpeed and the torch engines are set up afresh for each case."""
    root, config, _ = setup
    cases = []
    for name in ENGINES:
        options = [option.format(root=root) for option in ENGINES[name]]
        cases.append({"name": name, "overrides": options, "config": {"save_dir": str(root / f"{name}-straight")}})
        if name not in SAME_CHECKPOINT_PATH:  # stop after step 3, then the same command again
            interrupted = {"save_dir": str(root / f"{name}-interrupted")}
            cases += [{"name": f"{name}-exit", "overrides": [*options, "exit_interval=3"], "config": interrupted},
                      {"name": f"{name}-rerun", "overrides": options, "config": interrupted}]
    cases.append({"name": "fsdp-to-single", "overrides": ["engine=fsdp", "exit_interval=3"],
                  "config": {"save_dir": str(root / "fsdp-to-single")}})
    cases.append({"name": "zero2-to-single", "overrides": [f"deepspeed={root}/zero2.json", "exit_interval=3"],
                  "config": {"save_dir": str(root / "zero2-to-single")}})
    for leg in (["exit_interval=3"], []):
        cases.append({"name": "fsdp-async", "overrides": ["engine=fsdp", "async_checkpoint=true", *leg],
                      "config": {"save_dir": str(root / "fsdp-async")}})
    for engine, options in MUON_ENGINES.items():
        for name, leg, folder in (("straight", [], "straight"), ("exit", ["exit_interval=3"], "interrupted"),
                                  ("rerun", [], "interrupted")):
            cases.append({"name": f"muon-{engine}-{name}", "overrides": [*options, "optimizer=muon", *leg],
                          "config": {"save_dir": str(root / f"muon-{engine}-{folder}")}})
    cases.append({"name": "muon-fsdp-to-single", "overrides": ["engine=fsdp", "optimizer=muon", "exit_interval=3"],
                  "config": {"save_dir": str(root / "muon-fsdp-to-single")}})
    for engine, options in MUP_ENGINES.items():
        cases.append({"name": f"mup-{engine}", "overrides": [o.format(root=root) for o in options],
                      "config": {**MUP, "save_dir": str(root / f"mup-{engine}")}})
    for engine, options in BF16_ENGINES.items():
        cases.append({"name": f"bf16-{engine}", "overrides": [*(o.format(root=root) for o in options), *BF16_SHORT_RUN],
                      "config": {"save_dir": str(root / f"bf16-{engine}")}})
    launch_cases(yaml.safe_load(config.read_text()), cases, 2, root)


@pytest.mark.parametrize("name", list(ENGINES))
def test_engine_matches_single_process_resumes_exactly_and_exports(setup, engine_runs, name):
    root, config, single_dir = setup
    straight, interrupted = root / f"{name}-straight", root / f"{name}-interrupted"
    assert_same_run(straight, single_dir, rel=1e-5)
    assert_layout_answers(straight, 2)  # each rank holds what the engine class told the planner

    if name not in SAME_CHECKPOINT_PATH:  # stopped after step 3 (exit_interval), then the same command again
        events = [r for r in read_metrics(interrupted) if "event" in r]
        assert [(e["event"], e["step"]) for e in events] == [("start", 0), ("resume", 3)]
        assert train_losses(interrupted) == train_losses(straight)
        assert eval_losses(interrupted) == eval_losses(straight)

    exported = load_file(straight / "hf" / "model.safetensors")
    reference = load_file(single_dir / "hf" / "model.safetensors")
    assert exported.keys() == reference.keys()
    for key, value in reference.items():
        assert exported[key].shape == value.shape and exported[key].numel() > 0  # never size-0 shards
        torch.testing.assert_close(exported[key], value, rtol=1e-4, atol=1e-5)


def test_deepspeed_checkpoint_on_another_world_size_is_refused(setup, engine_runs):
    root, config, single_dir = setup
    save_dir = root / "zero2-to-single"
    assert sorted(train_losses(save_dir)) == [1, 2, 3]
    done = run(torchrun(1, *pretrainer("train", config, f"deepspeed={root}/zero2.json", "dp=1", "micro_batch_size=4",
                                        f"save_dir={save_dir}")))
    assert done.returncode != 0
    assert "holds DeepSpeed ZeRO shards for 2 process(es); resume it on the same number" in done.stderr


def test_fsdp_checkpoint_resumes_on_one_process(setup, engine_runs):
    """A checkpoint written by 2 FSDP ranks is resharded by DCP onto a single process and continues the run."""
    root, config, single_dir = setup
    save_dir = root / "fsdp-to-single"
    assert sorted(train_losses(save_dir)) == [1, 2, 3]
    args = PreTrainingArguments.from_yaml(config, ["dp=1", "micro_batch_size=4", f"save_dir={save_dir}"])
    PreTrainer(args).train()
    assert_same_run(save_dir, single_dir, rel=1e-5)


@pytest.mark.parametrize("engine", MUON_ENGINES)
def test_muon_on_two_ranks_matches_one_process_and_resumes_exactly(setup, engine_runs, engine):
    """Muon's whole-matrix update from FSDP shards (gathered, orthogonalised, each rank keeping its piece) and
    from DDP replicas equals one process's; its momentum is checkpointed and resumed exactly."""
    root, config, single_dir = setup
    straight, interrupted = root / f"muon-{engine}-straight", root / f"muon-{engine}-interrupted"
    assert_same_run(straight, root / "single-muon", rel=1e-5)
    assert train_losses(straight) != train_losses(single_dir)  # Muon really took the matrices' steps
    assert train_losses(interrupted) == train_losses(straight)
    assert eval_losses(interrupted) == eval_losses(straight)
    assert_layout_answers(straight, 2)  # one momentum buffer per Muon matrix, as the planner counts


@pytest.mark.parametrize("engine", list(MUP_ENGINES))
def test_mup_groups_under_zero_match_one_process(setup, engine_runs, engine):
    root, _, single_dir = setup
    assert_same_run(root / f"mup-{engine}", root / "single-mup", rel=1e-5)
    assert train_losses(root / "single-mup") != train_losses(single_dir)  # the groups really took other lrs


def test_muon_fsdp_checkpoint_resumes_on_one_process(setup, engine_runs):
    root, config, _ = setup
    save_dir = root / "muon-fsdp-to-single"
    assert sorted(train_losses(save_dir)) == [1, 2, 3]
    args = PreTrainingArguments.from_yaml(config, ["dp=1", "micro_batch_size=4", "optimizer=muon",
                                                   f"save_dir={save_dir}"])
    PreTrainer(args).train()
    assert_same_run(save_dir, root / "single-muon", rel=1e-5)


def test_deepspeed_refuses_muon_with_the_reason(setup):
    from pretrainer.parallel import planned_world
    from pretrainer.run import resolve_run

    root, config, _ = setup
    args = PreTrainingArguments.from_yaml(config, [f"deepspeed={root}/zero2.json", "optimizer=muon"])
    with pytest.raises(ConfigError, match="key 'optimizer': optimizer: muon is not available with engine deepspeed: "
                                          "ZeRO hands its optimizer flat fp32 partitions"):
        resolve_run(args, planned_world(2, 1, torch.device("cpu")))


@pytest.mark.parametrize("engine", BF16_ENGINES)
def test_bf16_on_two_ranks_tracks_fp32(setup, engine_runs, engine):
    """bf16 (autocast for DDP and whole megatron stages, FSDP's mixed-precision policy with fp32 reduce for fsdp
    and megatron's sharded data parallelism, DeepSpeed's bf16) for 2 steps."""
    root, config, single_dir = setup
    save_dir = root / f"bf16-{engine}"
    got, want = train_losses(save_dir), train_losses(single_dir)
    assert sorted(got) == [1, 2]
    assert got[1] == pytest.approx(want[1], rel=2e-2)  # same init and data, bf16 compute
    assert_layout_answers(save_dir, 2)  # autocast (or the engine's own casting) as the planner counts it


def test_one_process_holds_what_the_planner_counts(setup):
    root, _, single_dir = setup
    (check,) = assert_layout_answers(single_dir, 1)
    assert check["held"]["gradient_ranks"] == check["held"]["shard_ranks"] == 1
    (muon,) = assert_layout_answers(root / "single-muon", 1)
    # One buffer, not two, per hidden matrix (the planner's own count of it is held equal just above; in this
    # tiny model the embeddings, which stay on AdamW, hold most of the state).
    assert muon["held"]["optimizer"] < check["held"]["optimizer"]


def test_accumulation_micro_batches_hold_their_gradients_back_unless_sharded(base_config, tmp_path):
    """Under no_sync (a micro-batch that is not its step's last) ddp and fsdp's `unsharded` hold the gradient
    back (no all-reduce or reduce-scatter has put it in any parameter's .grad); fsdp's `sharded` has reduce-scattered
    it into every shard. The step's last micro-batch reduces everything. A model each rank built from its own seed
    starts as rank 0's on every rank, under ddp and fsdp alike."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**base_config, "dp": 2, "save_dir": None, "eval_interval": 0}))
    out = tmp_path / "seen.json"
    run_ok(torchrun(2, REPO / "tests" / "accumulation_run.py", config, out), env=environment())
    seen = json.loads(out.read_text())
    for name in ("ddp", "fsdp-unsharded"):
        assert not any(seen[name]["after_no_sync"]), name
    assert all(seen["fsdp-sharded"]["after_no_sync"])
    assert all(all(seen[name]["after_last"]) for name in ("ddp", "fsdp-unsharded", "fsdp-sharded")), seen
    for name in ("ddp", "fsdp-unsharded"):
        case = seen[f"{name}-own-seeds"]
        assert case["after"] == pytest.approx([case["rank0_before"]] * 2, rel=1e-9), case


def test_two_ranks_share_one_tokenization_of_train_data(setup, tmp_path):
    """Rank 0 tokenizes train_data into the cache while rank 1 waits; both train from the one store."""
    root, config, single_dir = setup
    cache = tmp_path / "cache"

    def train(save_dir: Path):
        command = pretrainer("train", config, "engine=ddp", "num_training_steps=2", "eval_interval=0",
                             f"save_dir={save_dir}")
        return run_ok(torchrun(2, *command), env=environment(PRETRAINER_CACHE_DIR=str(cache)))

    done = train(tmp_path / "run")
    assert (done.stdout + done.stderr).count("train_data: tokenized") == 1
    manifests = list(cache.glob("*/manifest.json"))
    assert len(manifests) == 1 and json.loads(manifests[0].read_text())["built_by"]["rank"] == 0
    again = train(tmp_path / "again")
    assert "train_data: reusing the tokenized store" in again.stdout + again.stderr
    assert train_losses(tmp_path / "again") == train_losses(tmp_path / "run")


def test_multi_node_rendezvous(setup, tmp_path):
    """Two torchrun 'nodes' (one process each) meeting through c10d rendezvous, as on a cluster."""
    root, config, single_dir = setup
    port = listening_port()
    save_dir = tmp_path / "two-nodes"
    caches = [tmp_path / f"node-{rank}-cache" for rank in range(2)]  # node-local token caches
    nodes = [subprocess.Popen([str(BIN / "torchrun"), "--nnodes", "2", "--nproc_per_node", "1", "--node_rank",
                               str(rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                               "--rdzv-id", "pretrainer-test", str(BIN / "pretrainer"), "train", str(config),
                               "engine=fsdp", f"save_dir={save_dir}"],
                              cwd=REPO, env=environment(PRETRAINER_CACHE_DIR=str(caches[rank])),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert all(node.returncode == 0 for node in nodes), outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert_same_run(save_dir, single_dir, rel=1e-5)
    # Each machine that does not see rank 0's store tokenizes its own (local rank 0), after rank 0.
    built_by = [[json.loads(m.read_text())["built_by"]["rank"] for m in cache.glob("*/manifest.json")]
                for cache in caches]
    assert built_by == [[0], [1]]
    keys = [[m.parent.name for m in cache.glob("*/manifest.json")] for cache in caches]
    assert keys[0] == keys[1]


def test_ranks_waiting_for_a_tokenization_longer_than_the_timeout_say_what_they_waited_for(setup, tmp_path):
    import gzip

    root, config, single_dir = setup
    endless = tmp_path / "huge.jsonl.gz"  # ~2 GB of text in 4 MB: gzip members one after another
    member = gzip.compress(b'{"text": "the same short document, many times over"}\n' * 20_000)
    endless.write_bytes(member * 2_000)
    done = run(torchrun(2, *pretrainer("train", config, "engine=ddp", f"train_data={endless}", "eval_split=0",
                                       "tokenize_workers=1", "distributed_timeout_minutes=0.1",
                                       f"save_dir={tmp_path / 'run'}")),
               env=environment(PRETRAINER_CACHE_DIR=str(tmp_path / "cache")))
    assert done.returncode != 0
    assert "train_data: waiting for rank 0 to tokenize into" in done.stderr, done.stderr[-3000:]
    assert "raise it, or tokenize beforehand with `pretrainer prepare`" in done.stderr


def test_async_checkpoint_on_two_ranks(setup, engine_runs):
    root, config, single_dir = setup
    save_dir = root / "fsdp-async"
    assert_same_run(save_dir, single_dir, rel=1e-5)
    assert sorted(p.name for p in (save_dir / "checkpoints").iterdir()) == ["latest", "step-3", "step-6"]


def test_prepared_blend_on_two_ranks_matches_one_process_and_resumes_on_one(setup, tmp_path):
    """Prepared data: rank 0 builds the sample indices while rank 1 waits, both map them; 2 ranks train on
    the batches of 1 process; a checkpoint from 2 ranks continues on 1 with the next samples."""
    from pretrainer.data.indexed import IndexedDatasetWriter

    root, config, single_dir = setup
    tokens = torch.Generator().manual_seed(0)
    prefixes = []
    for name in ("web", "code"):
        writer = IndexedDatasetWriter(tmp_path / name)
        for _ in range(30):
            writer.add_document(torch.randint(3, 4000, (int(torch.randint(5, 120, (1,), generator=tokens)),),
                                              generator=tokens).tolist() + [1])
        writer.finalize()
        prefixes.append(str(tmp_path / name))
    data = ["train_data=null", "megatron_dataset_flag=true", f"data_path=0.6 {prefixes[0]} 0.4 {prefixes[1]}",
            "dataloader_config={split: '90,10,0'}"]
    args = PreTrainingArguments.from_yaml(config, [*data, "dp=1", "micro_batch_size=4",
                                                   f"save_dir={tmp_path / 'single'}"])
    PreTrainer(args).train()
    cache = tmp_path / "cache" / "pretrainer_indices"
    built = sorted(p.name for p in cache.iterdir())
    train_on_two_ranks(config, "engine=ddp", *data, f"save_dir={tmp_path / 'two'}")
    assert sorted(p.name for p in cache.iterdir()) == built  # same parameters: the cached indices are reused
    assert_same_run(tmp_path / "two", tmp_path / "single", rel=1e-5)
    for p in cache.iterdir():
        p.unlink()
    train_on_two_ranks(config, "engine=ddp", *data, f"save_dir={tmp_path / 'moved'}", "exit_interval=3")
    assert sorted(p.name for p in cache.iterdir()) == built  # built afresh, by one rank, identically
    args = PreTrainingArguments.from_yaml(config, [*data, "dp=1", "micro_batch_size=4",
                                                   f"save_dir={tmp_path / 'moved'}"])
    PreTrainer(args).train()
    assert_same_run(tmp_path / "moved", tmp_path / "single", rel=1e-5)


