"""The megatron engine: tensor (+sequence), pipeline, context and data parallelism and the chunked loss on real
processes (torchrun, gloo),
each mesh's per-step losses equal to one process; resume across meshes; HF export; the seed's plugin_args,
hooks, model-config parser registry and launch flows.

The 2- and 4-rank meshes run as cases of one torchrun job each (tests/multi_run.py), so the suite pays
the process start-up once per job.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers import (
    EXAMPLES,
    assert_layout_answers,
    assert_same_downstream_scores,
    eval_losses,
    grad_norms,
    read_metrics,
    train_losses,
    write_task,
    write_tiny_model,
)
from launch import BIN, describe, environment, pretrainer, run, run_ok, torchrun
from multi_run import launch_cases, run_case
from pretrainer import ConfigError, PreTrainer, PreTrainingArguments

# name -> (config overrides, world size, reference). Reference "one" is a single process with the same
# micro-batch; "one-mbs4" has the two data-parallel replicas' batches in one micro-batch.
MUP = {"parametrization": "mup", "mup_base_hidden_size": 32}  # twice the base width
TWO_RANK = {
    "tp2-sequence-parallel": ({"plugin_args": {"tp_degree": 2, "sequence_parallelism": True}}, "one"),
    # 31 positions do not split over 2 ranks: batches are right-padded to 32 and the padding ignored
    "tp2-sequence-parallel-odd-length": ({"plugin_args": {"tp_degree": 2, "sequence_parallelism": True},
                                          "seq_length": 31}, "one-seq31"),
    "tp2-selective-recompute": ({"plugin_args": {"tp_degree": 2}, "activation_checkpointing": "selective"}, "one"),
    "pp2-gpipe-explicit-split": ({"plugin_args": {"pp_degree": 2, "pipeline_schedule": "gpipe",
                                                  "pipeline_layers": [1, 3]}}, "one"),
    "pp2-1f1b-full-block-recompute": (
        {"plugin_args": {"pp_degree": 2, "other_megatron_args": {
            "recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}}}, "one"),
    "pp2-interleaved-uniform-recompute": (
        {"plugin_args": {"pp_degree": 2, "num_layers_per_virtual_pipeline_stage": 1, "other_megatron_args": {
            "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}}}, "one"),
    "dp2-replicate": ({"dp": 2}, "one-mbs4"),
    "qwen2-tp2-sequence-parallel": ({"plugin_args": {"tp_degree": 2, "sequence_parallelism": True},
                                     "model_path": "{root}/qwen2"}, "qwen2"),  # q/k/v biases
    # weights loaded on every rank; each keeps only its stages' part
    "pp2-from-saved-weights": ({"plugin_args": {"pp_degree": 2}, "model_path": "{root}/weights"}, "weights"),
    "tied-embeddings-tp2-sequence-parallel": ({"plugin_args": {"tp_degree": 2, "sequence_parallelism": True},
                                               "model_path": "{root}/tied"}, "tied"),
    "dp2-distributed-optimizer": ({"dp": 2, "plugin_args": {"use_distributed_optimizer": True}}, "one-mbs4"),
    # the output head computes the loss in chunks: vocab-parallel under tp, on the last stage under pp
    "tp2-sequence-parallel-chunked-loss": ({"plugin_args": {"tp_degree": 2, "sequence_parallelism": True},
                                            "loss_chunk_size": 24}, "one"),
    "pp2-chunked-loss": ({"plugin_args": {"pp_degree": 2}, "loss_chunk_size": 24}, "one"),
    # context parallelism: every sequence split over 2 ranks
    "cp2": ({"context_parallel_degree": 2}, "one"),
    # Muon: tensor-parallel shards gathered whole for the update; whole matrices per stage; FSDP2 shards
    "muon-tp2-sequence-parallel": ({"optimizer": "muon", "plugin_args": {"tp_degree": 2, "sequence_parallelism": True}},
                                   "one-muon"),
    "muon-pp2": ({"optimizer": "muon", "plugin_args": {"pp_degree": 2}}, "one-muon"),
    "muon-dp2-distributed-optimizer": ({"optimizer": "muon", "dp": 2,
                                        "plugin_args": {"use_distributed_optimizer": True}}, "one-muon-mbs4"),
    # the engine names are defaults of one backend: fsdp and ddp split the model too
    "fsdp-tp2-sequence-parallel": ({"engine": "fsdp", "plugin_args": {"tp_degree": 2, "sequence_parallelism": True}},
                                   "one"),
    "ddp-pp2": ({"engine": "ddp", "plugin_args": {"pp_degree": 2}}, "one"),
    # muP: per-role init and per-group lrs on sharded (FSDP2) and tensor-parallel parameters
    "mup-fsdp-dp2": ({"engine": "fsdp", "dp": 2, **MUP}, "one-mup-mbs4"),
    "mup-tp2-sequence-parallel": ({"plugin_args": {"tp_degree": 2, "sequence_parallelism": True}, **MUP}, "one-mup"),
    "mup-pp2": ({"plugin_args": {"pp_degree": 2}, **MUP}, "one-mup"),  # roles read off the stages' view
    # a tied vocabulary-parallel head: the final norm (replicated under sequence parallelism) carries the multiplier
    "mup-tied-embeddings-tp2-sequence-parallel": ({"plugin_args": {"tp_degree": 2, "sequence_parallelism": True},
                                                   "model_path": "{root}/tied", **MUP}, "tied-mup"),
}
FOUR_RANK = {
    "dp2-tp2-sequence-parallel": ({"dp": 2, "plugin_args": {"tp_degree": 2, "sequence_parallelism": True}},
                                  "one-mbs4"),
    "pp2-tp2-sequence-parallel": ({"plugin_args": {"tp_degree": 2, "pp_degree": 2,
                                                   "sequence_parallelism": True}}, "one"),
    "cp2-tp2-sequence-parallel": ({"context_parallel_degree": 2,
                                   "plugin_args": {"tp_degree": 2, "sequence_parallelism": True}}, "one"),
    "cp2-pp2-chunked-loss": ({"context_parallel_degree": 2, "plugin_args": {"pp_degree": 2},
                              "loss_chunk_size": 24}, "one"),
    # FSDP2 over tp: strided shards, each counted once in the gradient norm
    "dp2-tp2-distributed-optimizer": ({"dp": 2, "plugin_args": {"tp_degree": 2, "sequence_parallelism": True,
                                                                "use_distributed_optimizer": True}}, "one-mbs4"),
    "dp2-cp2-distributed-optimizer": ({"dp": 2, "context_parallel_degree": 2,
                                       "plugin_args": {"use_distributed_optimizer": True}}, "one-mbs4"),
    # parameters resharded after forward too (FSDP over dp composed with tp, and with pp)
    "dp2-tp2-optim-grads-params": ({"dp": 2, "plugin_args": {"tp_degree": 2, "sequence_parallelism": True,
                                                             "data_parallel_sharding_strategy": "optim_grads_params"}},
                                   "one-mbs4"),
    "dp2-pp2-optim-grads-params": ({"dp": 2, "plugin_args": {"pp_degree": 2,
                                                             "data_parallel_sharding_strategy": "optim_grads_params"}},
                                   "one-mbs4"),
    # weights read in slices (each rank its tp x dp shard of each tensor) into resharded parameters
    "dp2-tp2-optim-grads-params-from-saved-weights": (
        {"dp": 2, "model_path": "{root}/weights", "plugin_args": {
            "tp_degree": 2, "sequence_parallelism": True, "data_parallel_sharding_strategy": "optim_grads_params"}},
        "weights-mbs4"),
    # every micro-batch reduce-scatters its gradients (they stay sharded while micro-batches accumulate)
    "dp2-tp2-sharded-accumulation": ({"dp": 2, "accumulate_gradients": "sharded",
                                      "plugin_args": {"tp_degree": 2, "sequence_parallelism": True,
                                                      "use_distributed_optimizer": True}}, "one-mbs4"),
}
# 8 ranks: hybrid sharding (replicate 2 x shard 2 over the dp ranks) composed with tp 2, parameters resharded
HYBRID_TP = {"dp": 4, "fsdp_shard_size": 2, "plugin_args": {
    "tp_degree": 2, "sequence_parallelism": True, "data_parallel_sharding_strategy": "optim_grads_params"}}
# stopped after step 3 and run again: the resumed run's losses equal the uninterrupted one's
FOUR_RANK_RESUMED = ("dp2-tp2-optim-grads-params", "dp2-pp2-optim-grads-params")


@pytest.fixture(scope="module")
def base(tmp_path_factory, small_corpus) -> dict:
    root = tmp_path_factory.mktemp("megatron")
    model = write_tiny_model(root / "model", num_hidden_layers=4)
    write_tiny_model(root / "tied", num_hidden_layers=4, tie_word_embeddings=True)
    write_qwen2_model(root / "qwen2")
    write_saved_weights(model, root / "weights")
    return {"num_training_steps": 6, "micro_batch_size": 2, "dp": 1, "gradient_accumulation_steps": 2,
            "seq_length": 32, "dtype": "fp32", "model_path": str(model), "train_data": str(small_corpus),
            "lr": 1e-3, "warmup_steps": 2, "eval_interval": 3, "eval_iters": 2, "save_interval": 3, "seed": 7,
            "write_report": False, "engine": "megatron", "save_dir": str(root / "unused"),
            # scored through each mesh's forward (tp's vocab-parallel head, pipeline stages, cp's shards)
            "downstream_evals": [write_task(root / "tiny_task.jsonl")],
            # With Adam's default eps 1e-8, an element whose gradient is itself ~1e-8 gets an update set by the
            # last bits of that gradient, which a mesh sums in another order than one process: on some CPUs one
            # embedding element in 262,144 then ends 0.4 lr away. eps 1e-6 keeps every update well-determined.
            "adam_eps": 1e-6}


def write_qwen2_model(folder: Path) -> Path:
    from transformers import Qwen2Config

    write_tiny_model(folder, num_hidden_layers=4)
    settings = json.loads((folder / "config.json").read_text())
    Qwen2Config(**{k: settings[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                            "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                            "bos_token_id", "eos_token_id", "pad_token_id")},
                tie_word_embeddings=False).save_pretrained(folder)
    return folder


def write_saved_weights(config_folder: Path, folder: Path) -> Path:
    """An HF folder with weights (model.safetensors) of the config-only model, as `save_pretrained` writes."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_folder)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(config_folder).save_pretrained(folder)
    return folder


def model_root(base: dict) -> str:
    return str(Path(base["model_path"]).parent)


def case_config(base: dict, config: dict) -> dict:
    return {k: v.format(root=model_root(base)) if isinstance(v, str) else v for k, v in config.items()}


@pytest.fixture(scope="module")
def references(base, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("references")
    out = {}
    models = {name: {"model_path": f"{model_root(base)}/{name}"} for name in ("qwen2", "tied", "weights")}
    models["weights-mbs4"] = {**models["weights"], "micro_batch_size": 4}
    models["tied-mup"] = {**models["tied"], **MUP}
    for name, extra in {"one": {}, "one-mbs4": {"micro_batch_size": 4}, "one-mbs8": {"micro_batch_size": 8},
                        "one-seq31": {"seq_length": 31},
                        "one-muon": {"optimizer": "muon"},
                        "one-muon-mbs4": {"optimizer": "muon", "micro_batch_size": 4},
                        "one-mup": MUP, "one-mup-mbs4": {**MUP, "micro_batch_size": 4}, **models}.items():
        PreTrainer(PreTrainingArguments(**{**base, **extra, "engine": "single", "save_dir": str(root / name)})).train()
        out[name] = root / name
    hooks = root / "hooks"
    run_case(base, {"hooks": True, "config": {"engine": "single", "save_dir": str(hooks)}})
    out["hooks"] = hooks
    return out


@pytest.fixture(scope="module")
def two_rank(base, tmp_path_factory) -> Path:
    """Every 2-rank mesh; a pipeline run stopped at step 3 and resumed on a tensor-parallel mesh; a
    distributed-optimizer run stopped and resumed on the same mesh; the four hooks on tp=2."""
    root = tmp_path_factory.mktemp("two-rank")
    cases = [{"name": n, "config": {**case_config(base, c), "save_dir": str(root / n)}}
             for n, (c, _) in TWO_RANK.items()]
    pipeline, distributed = TWO_RANK["pp2-gpipe-explicit-split"][0], TWO_RANK["dp2-distributed-optimizer"][0]
    cases += [
        {"name": "pp-exit", "config": {**pipeline, "exit_interval": 3, "save_dir": str(root / "pp-then-tp")}},
        {"name": "tp-resume", "config": {**TWO_RANK["tp2-sequence-parallel"][0], "save_dir": str(root / "pp-then-tp")}},
        {"name": "dp-exit", "config": {**distributed, "exit_interval": 3, "save_dir": str(root / "dp-resumed")}},
        {"name": "dp-resume", "config": {**distributed, "save_dir": str(root / "dp-resumed")}},
        {"name": "cp-exit", "config": {**TWO_RANK["cp2"][0], "exit_interval": 3,
                                       "save_dir": str(root / "cp-then-tp")}},
        {"name": "cp-then-tp", "config": {**TWO_RANK["tp2-sequence-parallel"][0],
                                          "save_dir": str(root / "cp-then-tp")}},
        {"name": "hooks", "hooks": True, "config": {"plugin_args": {"tp_degree": 2}, "save_dir": str(root / "hooks")}},
        {"name": "muon-pp-exit", "config": {**TWO_RANK["muon-pp2"][0], "exit_interval": 3,
                                            "save_dir": str(root / "muon-pp-then-tp")}},
        {"name": "muon-pp-then-tp", "config": {**TWO_RANK["muon-tp2-sequence-parallel"][0],
                                               "save_dir": str(root / "muon-pp-then-tp")}},
    ]
    done = launch_cases(base, cases, 2, root)
    (root / "launch.log").write_text(done.stdout + done.stderr)
    return root


@pytest.fixture(scope="module")
def four_rank(base, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("four-rank")
    cases = [{"name": n, "config": {**case_config(base, c), "save_dir": str(root / n)}}
             for n, (c, _) in FOUR_RANK.items()]
    for name in FOUR_RANK_RESUMED:
        resumed = {**FOUR_RANK[name][0], "save_dir": str(root / f"{name}-resumed")}
        cases += [{"name": f"{name}-exit", "config": {**resumed, "exit_interval": 3}},
                  {"name": f"{name}-rerun", "config": resumed}]
    cases.append({"name": "padded-vocabulary",
                  "config": {**padded_vocabulary_case(root), "save_dir": str(root / "pad")}})
    done = launch_cases(base, cases, 4, root)
    (root / "launch.log").write_text(done.stdout + done.stderr)
    return root


def test_known_harmless_warnings_stay_out_of_the_logs(two_rank, four_rank):
    """FSDP2's "returned a view tensor" warning (every rank, on meshes whose stage returns a view: cp x tp) is
    silenced with its reason (parallelize.WRAPPED_VIEW_WARNING): the 2- and 4-rank jobs' logs hold none."""
    for root in (two_rank, four_rank):
        log = (root / "launch.log").read_text()
        assert "returned a view tensor" not in log, root


def padded_vocabulary_case(root: Path) -> dict:
    """tp=2 x cp=2 with a tokenizer (4,096 tokens) larger than the model's 4,000 rows, padded to a multiple of 3:
    the rows are a multiple of 3 and of tp (4,098), not of tp x cp (4,104); chunks of 24 tokens."""
    model = write_tiny_model(root / "small-vocab", vocab_size=4000, num_hidden_layers=4)
    tokenizer = write_tiny_model(root / "tokenizer", num_hidden_layers=4)
    return {"model_path": str(model), "tokenizer_path": str(tokenizer), "allow_tokenizer_mismatch": True,
            "pad_vocab_to_multiple_of": 3, "context_parallel_degree": 2, "loss_chunk_size": 24,
            "plugin_args": {"tp_degree": 2, "sequence_parallelism": True}, "num_training_steps": 2,
            "eval_interval": 0, "save_interval": 0}


def assert_same_losses(got: Path, expected: Path) -> None:
    assert sorted(train_losses(got)) == [1, 2, 3, 4, 5, 6]
    assert train_losses(got) == pytest.approx(train_losses(expected), rel=1e-5)
    assert eval_losses(got) == pytest.approx(eval_losses(expected), rel=1e-5)
    # the gradient norm (the clipping's input) sums each shard once over the mesh, and sequence-parallel norms'
    # gradients over tp
    assert grad_norms(got) and grad_norms(got) == pytest.approx(grad_norms(expected), rel=1e-5)
    assert_same_downstream_scores(got, expected, rel=1e-5)


@pytest.mark.parametrize("name", TWO_RANK)
def test_two_rank_mesh_matches_one_process(two_rank, references, name):
    assert_same_losses(two_rank / name, references[TWO_RANK[name][1]])
    assert_layout_answers(two_rank / name, 2)  # each rank holds what the engine class told the planner


def test_fsdp_splits_the_model_under_the_launcher(base, references, tmp_path):
    """`pretrainer train --nproc-per-node 2` with engine=fsdp and tensor parallelism: FSDP's name lays out the
    split model (no refusal, no other engine named), with one process's per-step losses."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**base, "engine": "fsdp", "save_dir": str(tmp_path / "run"),
                                      "plugin_args": {"tp_degree": 2, "sequence_parallelism": True}}))
    done = run_ok(pretrainer("train", config, "--nproc-per-node", 2))
    assert "engine=fsdp world_size=2" in done.stdout + done.stderr
    assert_same_losses(tmp_path / "run", references["one"])


@pytest.mark.parametrize("name", FOUR_RANK)
def test_four_rank_mesh_matches_one_process_and_exports_the_same_model(four_rank, references, name):
    from safetensors.torch import load_file

    assert_same_losses(four_rank / name, references[FOUR_RANK[name][1]])
    assert_layout_answers(four_rank / name, 4)
    got = load_file(four_rank / name / "hf" / "model.safetensors")
    expected = load_file(references[FOUR_RANK[name][1]] / "hf" / "model.safetensors")
    assert got.keys() == expected.keys()
    for key in expected:
        # Adam turns tiny gradient differences into updates of up to lr: compare at a fraction of one step
        torch.testing.assert_close(got[key], expected[key], rtol=1e-3, atol=2e-4)


@pytest.fixture(scope="module")
def eight_rank(base, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eight-rank")
    resumed = {**HYBRID_TP, "save_dir": str(root / "resumed")}
    launch_cases(base, [{"name": "hybrid-tp", "config": {**HYBRID_TP, "save_dir": str(root / "straight")}},
                        {"name": "hybrid-tp-exit", "config": {**resumed, "exit_interval": 3}},
                        {"name": "hybrid-tp-rerun", "config": resumed}], 8, root)
    return root


def test_eight_ranks_replicate_2_x_shard_2_x_tp_2_match_one_process_resume_and_export(eight_rank, references):
    """HSDP x TP (fsdp_shard_size 2 of dp 4, tp 2, parameters resharded after forward), as the anchors run
    above one node: losses equal one process, each rank holds the shard the planner counts, resume exact, the
    export the same model."""
    from safetensors.torch import load_file

    straight = eight_rank / "straight"
    assert_same_losses(straight, references["one-mbs8"])
    (check, *_) = assert_layout_answers(straight, 8)
    assert check["held"]["shard_ranks"] == 2 and check["held"]["gradient_ranks"] == 4
    resumed = eight_rank / "resumed"
    assert [(r["event"], r["step"]) for r in read_metrics(resumed) if "event" in r] == [("start", 0), ("resume", 3)]
    assert train_losses(resumed) == train_losses(straight)
    got = load_file(straight / "hf" / "model.safetensors")
    expected = load_file(references["one-mbs8"] / "hf" / "model.safetensors")
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-3, atol=2e-4)


def test_resharded_parameters_are_read_in_tp_x_dp_slices(four_rank, base):
    """dp=2 x tp=2 with optim_grads_params from an HF folder: each rank reads about a quarter of the weights (its tp
    shard's dp shard of each tensor; norms are whole over tp), and trains as one process that loaded them whole
    (test_four_rank_mesh_matches_one_process...)."""
    name = "dp2-tp2-optim-grads-params-from-saved-weights"
    read = next(r for r in read_metrics(four_rank / name) if r.get("event") == "start")["weights_read_bytes"]
    total = (Path(model_root(base)) / "weights" / "model.safetensors").stat().st_size
    assert len(read) == 4 and all(0.15 * total < r < 0.35 * total for r in read), (read, total)


@pytest.mark.parametrize("name", FOUR_RANK_RESUMED)
def test_four_rank_sharded_layouts_resume_exactly(four_rank, name):
    resumed = four_rank / f"{name}-resumed"
    events = [(r["event"], r["step"]) for r in read_metrics(resumed) if "event" in r]
    assert events == [("start", 0), ("resume", 3)]
    assert train_losses(resumed) == train_losses(four_rank / name)
    assert eval_losses(resumed) == eval_losses(four_rank / name)


def test_plan_and_train_agree_on_the_padded_vocabulary_and_the_loss_chunk(four_rank, tmp_path):
    """Both resolve the run once, with the same functions: `pretrainer plan` for 4 ranks says what the 4-rank
    run trained (its exported embedding, the chunk its head was given)."""
    from safetensors.torch import load_file

    config = {**json.loads((four_rank / "cases.json").read_text())["base"], **padded_vocabulary_case(four_rank)}
    path = tmp_path / "padded.yaml"
    path.write_text(yaml.safe_dump(config))
    planned = json.loads(run_ok(pretrainer("plan", path, "--world-size", "4", "--json")).stdout)
    start = json.loads((four_rank / "pad" / "metrics.jsonl").read_text().splitlines()[0])
    exported = load_file(four_rank / "pad" / "hf" / "model.safetensors")["model.embed_tokens.weight"]
    assert planned["vocab_size"] == start["vocab_size"] == exported.shape[0] == 4098
    assert planned["loss_chunk_size"] == start["loss_chunk_size"] == 24


def test_pipeline_and_context_parallel_checkpoints_resume_on_other_meshes(two_rank, references, tmp_path):
    assert_same_losses(two_rank / "pp-then-tp", references["one"])
    assert_same_losses(two_rank / "dp-resumed", references["one-mbs4"])
    assert_same_losses(two_rank / "cp-then-tp", references["one"])  # cp=2 to cp=1 (and tp=2)
    # the tensor-parallel checkpoint of step 3 continues on a single process
    moved = tmp_path / "moved"
    shutil.copytree(two_rank / "pp-then-tp" / "checkpoints" / "step-3", moved / "checkpoints" / "step-3")
    config = json.loads((two_rank / "cases.json").read_text())["base"]
    PreTrainer(PreTrainingArguments(**{**config, "engine": "single", "save_dir": str(moved)})).train()
    expected = train_losses(references["one"])
    assert train_losses(moved) == pytest.approx({s: expected[s] for s in (4, 5, 6)}, rel=1e-5)


def test_muon_momentum_resumes_on_another_mesh_and_on_one_process(two_rank, references, tmp_path):
    """Muon's state written by a pipeline mesh continues on a tensor-parallel one, and on a single process."""
    assert_same_losses(two_rank / "muon-pp-then-tp", references["one-muon"])
    assert train_losses(references["one-muon"]) != train_losses(references["one"])
    moved = tmp_path / "moved"
    shutil.copytree(two_rank / "muon-pp-then-tp" / "checkpoints" / "step-3", moved / "checkpoints" / "step-3")
    config = json.loads((two_rank / "cases.json").read_text())["base"]
    PreTrainer(PreTrainingArguments(**{**config, "engine": "single", "optimizer": "muon",
                                       "save_dir": str(moved)})).train()
    expected = train_losses(references["one-muon"])
    assert train_losses(moved) == pytest.approx({s: expected[s] for s in (4, 5, 6)}, rel=1e-5)


def test_the_four_hooks_run_on_a_tensor_parallel_mesh(two_rank, references):
    assert_same_losses(two_rank / "hooks", references["hooks"])
    for rank in (0, 1):
        calls = json.loads((two_rank / "hooks" / f"hook_calls_rank{rank}.json").read_text())
        assert calls["model"] == 1 and calls["datasets"] == 1
        assert calls["get_batch"] == 6 * 2  # one per micro-batch
        assert calls["loss"] >= 6 * 2
    # the batch hook's mask reached the loss: 4 of each row's 32 targets are dropped
    rows = [json.loads(line) for line in (two_rank / "hooks" / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in rows if "tokens" in r][-1] == 6 * 2 * 2 * (32 - 4)


# ------------------------------------------------------------------------------ the seed's interface
def test_seed_megatron_yaml_maps_to_engine_settings_and_reports_what_it_ignores(tiny_model):
    from transformers import AutoConfig

    from pretrainer.parallel.megatron_settings import read_settings, unused_keys

    args = PreTrainingArguments.from_yaml(EXAMPLES / "seed_configs" / "llama2-megatron.yaml")
    settings = read_settings(args, num_layers=32)
    assert (settings.tp, settings.pp, settings.sequence_parallel, settings.num_micro_batches) == (8, 1, True, 8)
    assert (settings.recompute_granularity, settings.recompute_method, settings.recompute_num_layers) == \
        ("full", "block", 32)
    assert (args.lr, args.min_lr, args.lr_decay_style, args.warmup_fraction, args.clip_grad) == \
        (1e-5, 1e-6, "cosine", 0.01, 1.0)
    messages = "\n".join(unused_keys(args, AutoConfig.from_pretrained(tiny_model), settings))
    assert "other_megatron_args.use_flash_attn: ignored, attention runs through" in messages
    assert "other_megatron_args.ffn_hidden_size=11008: ignored, the model's config.json defines the network " \
           "(ffn_hidden_size=128)" in messages
    assert "swiglu" not in messages and "normalization" not in messages  # they agree with the model


@pytest.mark.parametrize("plugin, extra, message", [
    ({"num_micro_batches": 4}, {}, "plugin_args.num_micro_batches=4 differs from gradient_accumulation_steps=2"),
    ({"pp_degree": 2, "pipeline_schedule": "1f1b"}, {"gradient_accumulation_steps": 1},
     "needs at least 2 micro-batches per step"),
    ({"pp_degree": 2, "num_layers_per_virtual_pipeline_stage": 3}, {}, "must give each rank a multiple of it"),
    ({"pp_degree": 2, "pipeline_layers": [1, 2]}, {}, "sums to 3, the model has 4 decoder layers"),
    ({"tp_degree": 2, "other_megatron_args": {"tensor_model_parallel_size": 4}}, {}, "disagree; set one of them"),
    ({"pipeline_schedule": "zero_bubble"}, {}, "is not one of gpipe, 1f1b, interleaved_1f1b"),
    ({"data_parallel_sharding_strategy": "optim"}, {}, "is not offered: FSDP2 reduce-scatters gradients"),
    ({"data_parallel_sharding_strategy": "full"}, {}, "'full' is not one of no_shard, optim_grads, optim_grads_params"),
    ({"data_parallel_sharding_strategy": "optim_grads", "use_distributed_optimizer": False}, {},
     "use_distributed_optimizer=False and data_parallel_sharding_strategy=optim_grads disagree"),
    ({}, {"fsdp_shard_size": 2}, "key 'fsdp_shard_size': the data-parallel ranks shard their state only with a "
                                 "sharding strategy"),
])
def test_bad_plugin_args_are_clear_errors(plugin, extra, message):
    from pretrainer.parallel.megatron_settings import read_settings

    args = PreTrainingArguments(**{"num_training_steps": 4, "micro_batch_size": 1, "dp": 1,
                                   "gradient_accumulation_steps": 2, "plugin_args": plugin, **extra})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        read_settings(args, num_layers=4)


def test_sharding_strategies_read_into_settings():
    from pretrainer.parallel.megatron_settings import read_settings
    from pretrainer.parallel.torch_plan import TorchTraits

    def settings(plugin, **extra):
        return read_settings(PreTrainingArguments(num_training_steps=4, micro_batch_size=1, dp=4,
                                                  plugin_args=plugin, **extra), num_layers=4)

    assert settings({}).sharding_strategy == "no_shard"
    assert settings({"use_distributed_optimizer": True}).sharding_strategy == "optim_grads"
    ogp = settings({"data_parallel_sharding_strategy": "optim_grads_params"}, fsdp_shard_size=2)
    assert (ogp.distributed_optimizer, ogp.reshard_parameters, ogp.shard_size) == (True, True, 2)
    dims = TorchTraits.parallel_dims(8, 1, ogp)
    assert (dims.dp, dims.shard, dims.replicate) == (8, 2, 4)
    with pytest.raises(ConfigError, match="key 'fsdp_shard_size': 3 does not divide the 8 ranks"):
        TorchTraits.parallel_dims(8, 1, settings({"use_distributed_optimizer": True}, fsdp_shard_size=3))


def test_model_config_parser_registry(tiny_model):
    from transformers import AutoConfig, AutoModelForCausalLM

    from pretrainer import add_model_config_to_megatron_parser, parse_llama_config
    from pretrainer.models.registry import MODEL_CONFIGS_TO_MEGATRON_PARSERS, parse_model_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model))
    shape = parse_model_config(model)
    assert (shape.num_layers, shape.num_attention_heads, shape.num_query_groups, shape.ffn_hidden_size,
            shape.kv_channels, shape.untied_embeddings, shape.parallel_split) == (2, 4, 2, 128, 16, True, "llama")
    assert shape.megatron_args["swiglu"] and shape.megatron_args["normalization"] == "RMSNorm"
    with pytest.raises(ConfigError, match="tp_degree=4 does not divide the model's num_key_value_heads"):
        shape.check_tensor_parallel(4)

    model.config.model_type = "my_model"  # a model type nobody registered
    with pytest.raises(ConfigError, match=r"add_model_config_to_megatron_parser\('my_model'\)"):
        parse_model_config(model)
    seen = []

    @add_model_config_to_megatron_parser("my_model")
    def parse_mine(megatron_lm_plugin, model, batch_data):  # the seed's parser signature
        seen.append(batch_data)
        parse_llama_config(megatron_lm_plugin, model, batch_data)
        megatron_lm_plugin.seq_length = 16

    try:
        shape = parse_model_config(model, batch_data={"input_ids": torch.zeros(1, 16)})
        assert len(seen) == 1 and shape.seq_length == 16 and shape.num_layers == 2
    finally:
        MODEL_CONFIGS_TO_MEGATRON_PARSERS.pop("my_model")


def test_seed_json_dataset_flow_through_accelerate_megatron_launch_honours_labels_and_eval(tmp_path):
    """accelerate launch --config_file <seed Megatron accelerate config> <the seed's JSON-dataset script> with
    the seed's llama2-megatron-json-dataset.yaml (tp 2 here), and the script on 2 pipeline stages: the same
    losses as the script on one process, so the prompt-masked labels and the held-out eval loader are used
    as given. 76 training records in batches of 3: the 1-row batch at the end of the epoch (step 13) goes
    through the pipeline too."""
    overrides = ["seq_length=160", "dataloader_config.max_length=160", "dataloader_config.pad_to_multiple_of=160",
                 "dtype=fp32", "num_training_steps=14", "gradient_accumulation_steps=2", "micro_batch_size=3",
                 "plugin_args.num_micro_batches=2", "eval_interval=14", "plugin_args.other_megatron_args.eval_iters=2",
                 "save_interval=0", "export_hf=false"]
    script = [EXAMPLES / "train_with_megatron_json_dataset.py", "--pretrain_config_file",
              EXAMPLES / "seed_configs" / "llama2-megatron-json-dataset.yaml", *overrides]
    launched = run_ok([BIN / "accelerate", "launch", "--config_file",
                       EXAMPLES / "accelerate" / "accelerate_megatron_config.yaml", *script,
                       "plugin_args.tp_degree=2", f"save_dir={tmp_path / 'tp2'}"])
    assert "engine=megatron world_size=2" in launched.stdout + launched.stderr
    # one process: engine single, without the megatron engine's recompute settings (it refuses keys it does not read)
    unread = [f"plugin_args.other_megatron_args.recompute_{key}=null"
              for key in ("granularity", "method", "num_layers")]
    run_ok([sys.executable, *script, "engine=single", "plugin_args.tp_degree=1", *unread,
            f"save_dir={tmp_path / 'one'}"])
    run_ok(torchrun(2, *script, "engine=megatron", "plugin_args.tp_degree=1", "plugin_args.pp_degree=2",
                    f"save_dir={tmp_path / 'pp2'}"))
    for layout in ("tp2", "pp2"):
        assert train_losses(tmp_path / layout) == pytest.approx(train_losses(tmp_path / "one"), rel=1e-5)
        assert eval_losses(tmp_path / layout) == pytest.approx(eval_losses(tmp_path / "one"), rel=1e-5)
    assert 0 < train_losses(tmp_path / "one")[1] < 20


def test_seed_megatron_yaml_with_prepared_data_selected_by_the_accelerate_variable(tmp_path):
    """The seed's llama2-megatron.yaml (.bin/.idx data) on 2 ranks; ACCELERATE_USE_MEGATRON_LM=true picks the
    engine, as `accelerate launch` with distributed_type MEGATRON_LM does."""
    prefix = tmp_path / "data" / "docs"
    run_ok(pretrainer("prepare", "--input", EXAMPLES / "data" / "python_docs.jsonl", "--tokenizer",
                      EXAMPLES / "models" / "tiny-llama", "--output-prefix", prefix, "--workers", "1", "--append-eod"))
    done = run(torchrun(2, EXAMPLES / "train.py", "--pretrain_config_file",
                        EXAMPLES / "seed_configs" / "llama2-megatron.yaml", f"data_path={prefix}_text_document",
                        "dataloader_config.split=98,2,0", "plugin_args.tp_degree=2", "seq_length=64",
                        "micro_batch_size=1", "dtype=fp32", "num_training_steps=2", "eval_interval=2",
                        "plugin_args.other_megatron_args.eval_iters=1", f"save_dir={tmp_path / 'run'}"),
               env=environment(ACCELERATE_USE_MEGATRON_LM="true"))
    assert done.returncode == 0, describe(done)
    output = done.stdout + done.stderr
    assert "mesh=(dp=1 x pp=1 x tp=2)" in output and "recompute=full/block/32" in output
    assert "other_megatron_args.use_flash_attn: ignored" in output
    assert sorted(train_losses(tmp_path / "run")) == [1, 2] and 2 in eval_losses(tmp_path / "run")


def test_pipeline_refuses_tied_embeddings():
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pretrainer.models.registry import parse_model_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=2, hidden_size=64,
                                                             intermediate_size=128, num_attention_heads=4,
                                                             tie_word_embeddings=True))
    with pytest.raises(ConfigError, match="tied input/output embeddings"):
        parse_model_config(model).check_pipeline(2)
    parse_model_config(model).check_pipeline(1)  # one stage keeps both ends together


def test_left_padded_batches_are_refused_with_the_fix(base, tmp_path):
    """Stages run causal attention without a padding mask: a left-padded DataLoader is a clear error."""
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[:, :3] = 0  # padding before the tokens
    batch = {"input_ids": torch.randint(3, 4096, (2, 16)), "attention_mask": mask}
    args = PreTrainingArguments(**{**base, "train_data": None, "eval_interval": 0, "save_dir": str(tmp_path)})
    trainer = PreTrainer(args, train_dataloader=torch.utils.data.DataLoader([batch], batch_size=None))
    try:
        with pytest.raises(ConfigError, match="need right-padded batches.*padding_side='right'"):
            trainer.train()
    finally:
        trainer.engine.close()  # the engine started a process group of one in this process: end it


def test_a_seed_megatron_layout_is_refused_where_engine_auto_would_drop_it(tiny_model, caplog):
    """The seed's llama2-megatron YAML on one process: engine auto picks the one-process engine, which would train
    without tp_degree 8 and the recompute settings; it is refused, naming the keys and both ways out. With another
    engine chosen by the config, the settings it would not read are refused too (run/rules.py)."""
    from pretrainer.parallel import planned_world
    from pretrainer.run import resolve_run

    overrides = [f"openmind_model_path={tiny_model}", "seq_length=64"]
    args = PreTrainingArguments.from_yaml(EXAMPLES / "seed_configs" / "llama2-megatron.yaml", overrides)
    with pytest.raises(ConfigError, match=r"plugin_args.tp_degree lays out a model split over ranks, which engine "
                                          r"single does not do; use engine megatron, ddp or fsdp and launch dp x tp x "
                                          r"pp processes, or remove it "
                                          r"\(engine: auto chose single for 1 process\(es\)\)"):
        resolve_run(args, planned_world(1, 1, torch.device("cpu")))
    chosen = PreTrainingArguments.from_yaml(EXAMPLES / "seed_configs" / "llama2-megatron.yaml",
                                            [*overrides, "engine=single"])
    with pytest.raises(ConfigError, match="llama2-megatron.yaml, line 15: plugin_args.tp_degree lays out a model split "
                                          "over ranks"):
        resolve_run(chosen, planned_world(1, 1, torch.device("cpu")))
