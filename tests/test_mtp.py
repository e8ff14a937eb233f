"""Multi-token prediction (`mtp_num_layers`, models/mtp.py): each depth's targets and loss against the formula,
every engine against one process (Llama- and DeepSeek-V3-shaped models), resume, DeepSeek-V3's MTP weights in
and out of HF folders, and the keys' checks."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from helpers import read_metrics, write_tiny_model, write_tiny_moe
from launch import cli_in_process
from multi_run import launch_cases
from pretrainer import ConfigError, PreTrainer, PreTrainingArguments
from pretrainer.batch import IGNORE, depth_targets, forward_head
from pretrainer.models.init import materialize_modules
from pretrainer.models.mtp import MtpForward, add_mtp_layers

DEPTHS = 2
# what DeepSeek-V3's own files hold for its MTP layer (model.layers.61.*) besides the decoder block: its
# model.safetensors.index.json lists these names
DEEPSEEK_V3_MTP_NAMES = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "embed_tokens.weight",
                         "shared_head.norm.weight", "shared_head.head.weight"}


def step_rows(save_dir) -> list[dict]:
    return [row for row in read_metrics(save_dir) if "loss" in row and "step" in row]


def mtp_columns(rows: list[dict], depths: int = DEPTHS) -> list[float]:
    """Step by step: the main loss, the MTP loss and each depth's loss and accuracy."""
    keys = ["loss", "mtp_loss", *(f"mtp_{what}/{k}" for k in range(1, depths + 1) for what in ("loss", "acc"))]
    return [row[key] for row in rows for key in keys]


def test_a_depth_targets_the_main_target_k_ahead_within_the_window_and_the_document():
    targets = torch.arange(10, 20).view(1, 10)
    batch = {"input_ids": targets - 1, "shift_labels": targets}
    assert depth_targets(batch, 0).tolist() == targets.tolist()
    assert depth_targets(batch, 2).tolist() == [[12, 13, 14, 15, 16, 17, 18, 19, IGNORE, IGNORE]]
    # packed documents (positions restart at 0): positions 0-3 and 4-9
    batch["position_ids"] = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    assert depth_targets(batch, 1).tolist() == [[11, 12, 13, IGNORE, 15, 16, 17, 18, 19, IGNORE]]
    assert depth_targets(batch, 2).tolist() == [[12, 13, IGNORE, IGNORE, 16, 17, 18, 19, IGNORE, IGNORE]]
    batch["shift_labels"] = targets.masked_fill(targets == 15, IGNORE)  # an ignored main target stays ignored
    assert depth_targets(batch, 1)[0, 4].item() == IGNORE


def tiny_llama_with_depths(seed: int = 3):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, use_cache=False)
    model = LlamaForCausalLM(config).float()
    layers = add_mtp_layers(model, DEPTHS)
    materialize_modules(model, layers, torch.device("cpu"), seed)
    return model


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_each_depth_loss_equals_the_formula_from_the_models_hidden_states_and_weights():
    """Depth k: h_k = block_k(W_k [norm(emb(t_{i+k})); norm(h_{k-1})]), loss = sum over i of -log softmax(head(
    norm(h_k)))[t_{i+k+1}], computed here by hand from the model's final hidden state and the depth's weights
    (the block through its decoder-layer class's own forward)."""
    model = tiny_llama_with_depths()
    model.train()
    forward = MtpForward(model)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (2, 12), generator=generator)
    batch = {"input_ids": ids, "shift_labels": F.pad(ids[:, 1:], (0, 1), value=IGNORE)}
    forward_head(model, batch, takes_call=True)
    (results,) = forward.take_results()
    assert len(results) == DEPTHS
    eps = model.config.rms_norm_eps
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        positions = torch.arange(12).unsqueeze(0)
        for k in range(1, DEPTHS + 1):
            layer = model.model.layers[1 + k]
            ahead = torch.cat([ids[:, k:], torch.zeros_like(ids[:, :k])], dim=1)
            joined = torch.cat([rms_norm(model.model.embed_tokens.weight[ahead], layer.enorm.weight, eps),
                                rms_norm(hidden, layer.hnorm.weight, eps)], dim=-1)
            block = type(layer).__mro__[2]  # the model's own LlamaDecoderLayer
            assert block.__name__ == "LlamaDecoderLayer" and block is not type(layer)
            hidden = block.forward(layer, joined @ layer.eh_proj.weight.T,
                                   position_embeddings=model.model.rotary_emb(joined, positions))
            logits = rms_norm(hidden, layer.shared_head.norm.weight, eps) @ model.lm_head.weight.T
            want = sum(-torch.log_softmax(logits[row, i], dim=-1)[ids[row, i + k + 1]]
                       for row in range(2) for i in range(12 - k - 1))
            assert results[k - 1].loss_sum.item() == pytest.approx(want.item(), rel=1e-6)
    model.eval()  # evaluation forwards run the main head only
    forward_head(model, batch, takes_call=True)
    assert forward.take_results() == []


@pytest.mark.parametrize(("overrides", "message"), [
    ({"mtp_num_layers": -1}, "mtp_num_layers must be a whole number >= 0"),
    ({"mtp_num_layers": 1, "mtp_loss_coeff": 0}, "mtp_loss_coeff must be > 0"),
    ({"mtp_loss_coeff": 0.3}, "mtp_loss_coeff is set but mtp_num_layers is 0"),
])
def test_bad_keys_are_refused_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        PreTrainingArguments(num_training_steps=2, micro_batch_size=1, dp=1, **overrides)


def test_bad_input_is_one_line_with_exit_2(base_config, tmp_path, capsys):
    split = {"mtp_num_layers": 1, "engine": "fsdp", "context_parallel_degree": 2}
    for command, extra, message in (
            (["train"], {"mtp_num_layers": 32}, "leaves no target in a window of seq_length 32"),
            (["train"], {"mtp_num_layers": 1, "dtype": "fp16"}, "multi-token prediction with dtype fp16"),
            (["plan", "--world-size", "2"], split, "with context_parallel_degree > 1 is not available")):
        config = tmp_path / "bad.yaml"
        config.write_text(json.dumps({**base_config, **extra}))
        code, err = cli_in_process(capsys, *command, config)
        assert code == 2, err
        assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.fixture(scope="module")
def deepseek_model(tmp_path_factory):
    return write_tiny_moe(tmp_path_factory.mktemp("deepseek-v3"), "deepseek_v3")


def test_the_megatron_engine_recomputes_the_depths_under_activation_checkpointing(base_config, tmp_path):
    """Its stages recompute their main layers themselves (full) or wrap them (selective); the depths, run from the
    head's hook, are wrapped either way, and the losses stay those of no recomputation."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    config = {**base_config, "mtp_num_layers": DEPTHS, "engine": "megatron", "num_training_steps": 3,
              "eval_interval": 0, "save_interval": 0, "export_hf": False, "log_interval": 1}
    losses = {}
    for mode in ("none", "full", "selective"):
        with PreTrainer(PreTrainingArguments(**{**config, "activation_checkpointing": mode,
                                                "save_dir": str(tmp_path / mode)})) as trainer:
            depths = list(trainer.engine.unwrap(trainer.model).model.layers)[2:]
            assert len(depths) == DEPTHS and all(isinstance(d, CheckpointWrapper) for d in depths) is (mode != "none")
            trainer.train()
        losses[mode] = mtp_columns(step_rows(tmp_path / mode))
    assert losses["full"] == pytest.approx(losses["none"], rel=1e-6)
    assert losses["selective"] == pytest.approx(losses["none"], rel=1e-6)


def test_pipelines_of_four_ranks_train_the_depths_as_one_process(base_config, tmp_path):
    """4 ranks: pp=2 x tp=2 (sequence parallel; the last stage's embedding copy split over tp as the first's),
    and pp=4 on a 4-layer Llama (the embedding summed over the first and last of four stages only), give one
    process's per-step main loss, MTP loss and each depth's loss and accuracy (fp32, 1e-5)."""
    four = write_tiny_model(tmp_path / "four-layers", num_hidden_layers=4)
    config = {**base_config, "mtp_num_layers": DEPTHS, "export_hf": False, "log_interval": 1, "eval_interval": 0,
              "save_interval": 0, "gradient_accumulation_steps": 4, "micro_batch_size": 1}
    references = {}
    for name, extra in (("two", {}), ("four", {"model_path": str(four)})):
        references[name] = tmp_path / f"single-{name}"
        with PreTrainer(PreTrainingArguments(**{**config, **extra, "save_dir": str(references[name])})) as trainer:
            trainer.train()
    pp2_tp2 = {"pp_degree": 2, "tp_degree": 2, "sequence_parallelism": True}
    cases = [{"name": "pp2-tp2", "config": {"engine": "megatron", "loss_chunk_size": 24, "plugin_args": pp2_tp2,
                                            "save_dir": str(tmp_path / "pp2-tp2")}},
             {"name": "pp4", "config": {"engine": "megatron", "model_path": str(four), "plugin_args": {"pp_degree": 4},
                                        "save_dir": str(tmp_path / "pp4")}}]
    launch_cases(config, cases, 4, tmp_path)
    for name, reference in (("pp2-tp2", "two"), ("pp4", "four")):
        assert mtp_columns(step_rows(tmp_path / name)) == pytest.approx(
            mtp_columns(step_rows(references[reference])), rel=1e-5), name


def exported_mtp_tensors(folder, depth_layer: int) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), "pt") as files:
        return {name: files.get_tensor(name) for name in files.keys()
                if name.startswith(f"model.layers.{depth_layer}.")}


def test_every_engine_trains_the_depths_as_one_process(base_config, deepseek_model, tmp_path):
    """Llama- and DeepSeek-V3-shaped models with two depths give one process's per-step main loss, MTP loss and
    each depth's loss and accuracy (fp32, 1e-5) on: ddp (chunked head; Llama also compiled), fsdp (activation
    checkpointing), DeepSpeed ZeRO-3, the megatron engine (Llama: tp=2 with sequence parallelism and the
    vocabulary-parallel chunked head, tp=2 on whole sequences, pp=2 with whole logits and with the chunked head;
    DeepSeek-V3: pp=2 and dp=2), and fsdp and pp=2 stopped at step 3 and resumed. Without depths the losses
    differ (the depths train the shared model). The DeepSeek-V3 run's export, read by fsdp in slices with a
    third depth and continued one step at a learning rate of 1e-12, exports the same tensors for the two depths
    it held, and the third."""
    config = {**base_config, "mtp_num_layers": DEPTHS, "export_hf": False, "log_interval": 1}
    zero3 = tmp_path / "zero3.json"
    zero3.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    deepseek = {"model_path": str(deepseek_model)}
    references = {}
    for family, extra in (("llama", {}), ("deepseek", {**deepseek, "export_hf": True}), ("without", {})):
        references[family] = tmp_path / f"single-{family}"
        depths = {"mtp_num_layers": 0} if family == "without" else {}
        with PreTrainer(PreTrainingArguments(**{**config, **extra, **depths, "loss_chunk_size": 0,
                                                "save_dir": str(references[family])})) as trainer:
            trainer.train()
    cases = []
    for family, extra in (("llama", {}), ("deepseek", deepseek)):
        cases += [
            {"name": f"{family}-ddp", "config": {**extra, "engine": "ddp", "dp": 2, "micro_batch_size": 1,
                                                 "loss_chunk_size": 24, "save_dir": str(tmp_path / f"{family}-ddp")}},
            {"name": f"{family}-fsdp", "config": {**extra, "engine": "fsdp", "dp": 2, "micro_batch_size": 1,
                                                  "activation_checkpointing": "full",
                                                  "save_dir": str(tmp_path / f"{family}-fsdp")}},
            {"name": f"{family}-zero3", "overrides": [f"deepspeed={zero3}"],
             "config": {**extra, "dp": 2, "micro_batch_size": 1, "save_dir": str(tmp_path / f"{family}-zero3")}}]
    cases.append({"name": "llama-ddp-compile", "config": {"engine": "ddp", "dp": 2, "micro_batch_size": 1,
                                                          "compile": True,
                                                          "save_dir": str(tmp_path / "llama-ddp-compile")}})
    tp2 = {"engine": "megatron", "plugin_args": {"tp_degree": 2, "sequence_parallelism": True}, "loss_chunk_size": 24}
    cases += [{"name": "llama-tp2", "config": {**tp2, "save_dir": str(tmp_path / "llama-tp2")}},
              {"name": "llama-tp2-whole-sequence",
               "config": {**tp2, "plugin_args": {"tp_degree": 2}, "loss_chunk_size": 0,
                          "save_dir": str(tmp_path / "llama-tp2-whole-sequence")}},
              {"name": "llama-pp2", "config": {"engine": "megatron", "plugin_args": {"pp_degree": 2},
                                               "save_dir": str(tmp_path / "llama-pp2")}},
              {"name": "llama-pp2-chunked", "config": {"engine": "megatron", "plugin_args": {"pp_degree": 2},
                                                       "loss_chunk_size": 24,
                                                       "save_dir": str(tmp_path / "llama-pp2-chunked")}},
              {"name": "deepseek-pp2", "config": {**deepseek, "engine": "megatron", "plugin_args": {"pp_degree": 2},
                                                  "save_dir": str(tmp_path / "deepseek-pp2")}},
              {"name": "deepseek-megatron-dp2", "config": {**deepseek, "engine": "megatron", "dp": 2,
                                                            "micro_batch_size": 1,
                                                            "save_dir": str(tmp_path / "deepseek-megatron-dp2")}}]
    resumed = {"engine": "fsdp", "dp": 2, "micro_batch_size": 1, "save_dir": str(tmp_path / "llama-resumed")}
    from_hf = {"engine": "fsdp", "dp": 2, "micro_batch_size": 1, "model_path": str(references["deepseek"] / "hf"),
               "mtp_num_layers": 3, "num_training_steps": 1, "warmup_steps": 0, "lr": 1e-12, "export_hf": True,
               "save_interval": 0,
               "eval_interval": 0, "save_dir": str(tmp_path / "deepseek-fsdp-from-hf")}
    pp2_resumed = {"engine": "megatron", "plugin_args": {"pp_degree": 2}, "save_dir": str(tmp_path / "pp2-resumed")}
    cases += [{"name": "llama-fsdp-exit", "config": {**resumed, "exit_interval": 3}},
              {"name": "llama-fsdp-rerun", "config": resumed},
              {"name": "llama-pp2-exit", "config": {**pp2_resumed, "exit_interval": 3}},
              {"name": "llama-pp2-rerun", "config": {**pp2_resumed, "export_hf": True}},
              {"name": "deepseek-fsdp-from-hf", "config": from_hf}]
    done = launch_cases(config, cases, 2, tmp_path)
    assert "multi-token prediction: 2 depth(s), loss weight 0.1" in done.stdout + done.stderr
    assert "each rank reading only what it holds" in done.stdout + done.stderr  # the export read in slices
    for family in ("llama", "deepseek"):
        want = mtp_columns(step_rows(references[family]))
        assert len(want) == 6 * 6 and all(value > 0 for value in want[1::6])
        engines = ("ddp", "fsdp", "zero3", *(("tp2", "tp2-whole-sequence", "pp2", "pp2-chunked", "ddp-compile")
                                             if family == "llama" else ("pp2", "megatron-dp2")))
        for engine in engines:
            have = mtp_columns(step_rows(tmp_path / f"{family}-{engine}"))
            assert have == pytest.approx(want, rel=1e-5), f"{family}-{engine}"
    main_losses = [row["loss"] for row in step_rows(references["llama"])]
    assert main_losses[0] == pytest.approx(step_rows(references["without"])[0]["loss"], rel=1e-6)  # same start
    assert main_losses[1:] != pytest.approx([row["loss"] for row in step_rows(references["without"])][1:],
                                            rel=1e-4)  # the depths' gradient moves the shared model
    for resumed_dir in ("llama-resumed", "pp2-resumed"):
        rows = step_rows(tmp_path / resumed_dir)
        assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
        assert mtp_columns(rows) == pytest.approx(mtp_columns(step_rows(references["llama"])), rel=1e-5), resumed_dir
    # pp=2: the first stage's embedding and the last stage's copy stayed one tensor, exported once
    with safe_open(str(tmp_path / "pp2-resumed" / "hf" / "model.safetensors"), "pt") as files:
        embedding = files.get_tensor("model.embed_tokens.weight")
        assert torch.equal(files.get_tensor("model.layers.2.embed_tokens.weight"), embedding)
    for layer in (2, 3):
        given = exported_mtp_tensors(references["deepseek"] / "hf", layer)
        exported = exported_mtp_tensors(tmp_path / "deepseek-fsdp-from-hf" / "hf", layer)
        assert set(exported) == set(given) and len(given) > 10
        for name, tensor in given.items():
            assert torch.allclose(exported[name], tensor, rtol=0, atol=1e-8), name
    assert exported_mtp_tensors(tmp_path / "deepseek-fsdp-from-hf" / "hf", 4)  # the third depth, initialised


def test_deepseek_v3_mtp_weights_load_and_export_unchanged(base_config, deepseek_model, tmp_path, pretrainer_log):
    """A DeepSeek-V3-shaped folder with one MTP depth (its files in DeepSeek-V3's layout): continued for one step
    at a learning rate of 1e-12, the export holds the same MTP tensors (1e-8) under the same names, the shared
    embedding and head copies beside them, and num_nextn_predict_layers; asked for two depths, the second is
    initialised, and the log says which; asked for none, a warning says the depth is dropped, and the export
    holds no depth."""
    source = tmp_path / "source"
    config = {**base_config, "model_path": str(deepseek_model), "mtp_num_layers": 1, "num_training_steps": 2,
              "save_interval": 0, "eval_interval": 0}
    with PreTrainer(PreTrainingArguments(**{**config, "save_dir": str(source)})) as trainer:
        trainer.train()
    folder = source / "hf"
    assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 1
    given = exported_mtp_tensors(folder, 2)
    assert {name[len("model.layers.2."):] for name in given} >= DEEPSEEK_V3_MTP_NAMES
    assert any(".mlp.experts.0." in name for name in given)  # the MTP block is an MoE block, per expert on disk
    pretrainer_log.take()
    for depths in (1, 2, 0):
        out = tmp_path / f"continued-{depths}"
        with PreTrainer(PreTrainingArguments(**{**config, "model_path": str(folder), "mtp_num_layers": depths,
                                                "num_training_steps": 1, "warmup_steps": 0, "lr": 1e-12,
                                                "save_dir": str(out)})) as trainer:
            trainer.train()
        log = pretrainer_log.take()
        exported = exported_mtp_tensors(out / "hf", 2)
        assert json.loads((out / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == depths
        if depths == 0:
            assert not exported and "holds multi-token prediction weights for 1 depth(s)" in log
            continue
        for name, tensor in given.items():
            assert torch.allclose(exported[name], tensor, rtol=0, atol=1e-8), name
        if depths == 2:
            assert "depth(s) 1 read from" in log and "depth(s) 2 initialised" in log
            assert {f"model.layers.3.{name}" for name in DEEPSEEK_V3_MTP_NAMES} <= set(exported_mtp_tensors(
                out / "hf", 3))


@pytest.mark.parametrize("tied", [False, True])
def test_the_plan_counts_the_depths_parameters_and_flops_as_the_run(tied):
    """Each depth: its layer's parameters (a decoder layer, eh_proj, three norms), one more layer of attention and
    one more pass through the head, in the planner's model shape as in the run's count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from helpers import QUICKSTART_MODEL
    from pretrainer.models import count_parameters
    from pretrainer.perf.flops import flops_per_token
    from pretrainer.plan import model_shape

    config = AutoConfig.from_pretrained(QUICKSTART_MODEL, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config)
    without = flops_per_token(model, 64).per_token
    layers = add_mtp_layers(model, DEPTHS)
    materialize_modules(model, layers, torch.device("cpu"), 0)
    shape = model_shape(config, mtp_depths=DEPTHS)
    assert shape.parameters == count_parameters(model)
    assert shape.flops(64).per_token == flops_per_token(model, 64, mtp_depths=DEPTHS).per_token
    head = config.vocab_size * config.hidden_size
    added = DEPTHS * (6 * (shape.mtp_layer_parameters + head) + 12 * shape.heads * shape.head_dim * 64)
    assert shape.flops(64).per_token == without + added


def test_a_decoder_that_runs_every_layer_of_its_list_is_refused():
    """The depths are layers past num_hidden_layers, which HF decoders that slice their list never run; one that
    runs the whole list (GPT-NeoX) would run them as main layers."""
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(GPTNeoXConfig(num_hidden_layers=2, hidden_size=32,
                                                               num_attention_heads=4, intermediate_size=64,
                                                               vocab_size=100))
    with pytest.raises(ConfigError, match="GPTNeoXModel's forward runs every layer of its list"):
        add_mtp_layers(model, 1)


def test_the_planner_offers_only_layouts_that_run_the_depths():
    """With depths, the search offers no context parallelism (a depth reads tokens ahead that another rank
    holds), and still megatron's tp and pp (the quickstart model's 4 layers on 8 ranks)."""
    from transformers import AutoConfig

    from helpers import QUICKSTART_MODEL
    from pretrainer.parallel import Layout, engine_entry
    from pretrainer.parallel.fsdp_plan import sharded
    from pretrainer.plan import model_shape
    from pretrainer.plan.search import candidate_layouts

    settings = sharded()
    layout = Layout(engine_entry("fsdp"), engine_entry("fsdp").cls.parallel_dims(8, 1, settings), 1, 8, 8192,
                    "fp32", 8, settings=settings)  # long enough for the search to split sequences
    config = AutoConfig.from_pretrained(QUICKSTART_MODEL)
    for depths in (0, DEPTHS):
        candidates = candidate_layouts(layout, model_shape(config, mtp_depths=depths), lambda micro: 0)
        assert any(c.cp > 1 for c in candidates) is (depths == 0), depths
        assert any(c.pp == 4 and c.tp == 2 for c in candidates), depths
