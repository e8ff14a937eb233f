"""`pretrainer plan` and train's memory check before building the model."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers import QUICKSTART_MODEL, read_metrics
from launch import BIN, REPO, cli_in_process, describe, pretrainer, run, run_ok

PLAN_7B = REPO / "examples" / "plan" / "llama-2-7b.yaml"


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path



def layout_of(engine: str, world: int, per_node: int, micro: int, accumulation: int, seq: int, dtype: str,
              settings=None, cp: int = 1, **fields):
    """A planner layout of `engine` with its `settings` on `world` processes, as the engine splits them."""
    from pretrainer.parallel import Layout, engine_entry
    from pretrainer.parallel.megatron_settings import MegatronSettings

    entry = engine_entry(engine)
    cls = entry.cls
    if settings is None and engine == "ddp":  # the torch backend's defaults under that name
        settings = MegatronSettings()
    sequence_parallel, schedule = cls.parallel_style(settings)
    return Layout(entry, cls.parallel_dims(world, cp, settings), micro, accumulation, seq, dtype, per_node,
                  settings=settings, sequence_parallel=sequence_parallel, pipeline_schedule=schedule, **fields)

def plan_json(*args) -> dict:
    """`pretrainer plan ARGS --json`, run by the command's `main` in this process."""
    import contextlib
    import io

    from pretrainer.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["plan", *(str(a) for a in args), "--json"])
    assert code == 0, out.getvalue()[-2000:]
    return json.loads(out.getvalue())


def saved_on_real_tensors(model, seq_length: int) -> tuple[int, torch.Tensor]:
    """(bytes autograd keeps for backward, each storage once and parameters left out; the last hidden state) of the
    decoder's forward over one sequence of `seq_length` real tokens."""
    owned = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in owned:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = model.base_model(input_ids=torch.zeros((1, seq_length), dtype=torch.long),
                                  use_cache=False).last_hidden_state
    return sum(saved.values()), hidden


def test_the_probe_counts_what_a_real_forward_saves_for_backward():
    """The fake-tensor probe and the same forward on real tensors save the same bytes."""
    from transformers import AutoConfig

    from pretrainer.plan import activations

    config = AutoConfig.from_pretrained(QUICKSTART_MODEL / "config.json")
    real = {}

    def saved_by_the_real_forward(config, seq_length, autocast_dtype, param_dtype):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=param_dtype)
        real[config.num_hidden_layers], hidden = saved_on_real_tensors(model, seq_length)
        return real[config.num_hidden_layers], 0, hidden.numel() * hidden.element_size()

    probed = activations.probe(config, 128, "fp32", autocast=False)
    original = activations._saved_bytes
    activations._probe.cache_clear()
    activations._saved_bytes = saved_by_the_real_forward
    try:
        measured = activations.probe(config, 128, "fp32", autocast=False)
    finally:
        activations._saved_bytes = original
        activations._probe.cache_clear()
    assert probed.per_layer == measured.per_layer == real[2] - real[1] > 0
    assert probed.rest == measured.rest


def test_the_compiled_probe_counts_what_inductor_saves_for_backward():
    """With `compile: true` the probe's trace saves what the decoder layers compiled by inductor save on real
    tensors, and less than the eager layer (HF's RMSNorm keeps fp32 copies that the compiled layer recomputes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pretrainer.parallel.activation_checkpoint import decoder_layers
    from pretrainer.plan import activations
    from pretrainer.plan.model_shape import one_layer_config

    config = AutoConfig.from_pretrained(QUICKSTART_MODEL / "config.json")
    seq = 64

    def saved_by_inductor(layers: int) -> int:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(one_layer_config(config, layers), dtype=torch.float32)
        for layer in decoder_layers(model):
            layer.compile(dynamic=False)
        return saved_on_real_tensors(model, seq)[0]

    torch._dynamo.reset()
    compiled_layer = saved_by_inductor(2) - saved_by_inductor(1)
    torch._dynamo.reset()
    probed = activations.probe(config, seq, "fp32", autocast=False, compiled=True)
    eager = activations.probe(config, seq, "fp32", autocast=False)
    assert probed.per_layer == compiled_layer
    assert probed.per_layer < 0.8 * eager.per_layer
    assert (probed.selective_layer, probed.layer_input, probed.rest) == (eager.selective_layer, eager.layer_input,
                                                                         eager.rest)


@pytest.mark.parametrize("name, world, layout_text", [
    ("olmo-2-7b", 8, "engine=fsdp processes=8 dp=8 reshard=True micro_batch=2 accumulation=64 seq=4096"),
    ("mpt-70b", 64, "recompute=full"),
    ("llama-3.1-405b", 128, "sharding=optim_grads_params"),
])
def test_the_anchors_layouts_fit_an_h100(name, world, layout_text):
    """The layouts OLMo-core (7B, compiled), llm-foundry (MPT-70B) and torchtitan (405B) run on 80 GB H100s fit
    in the plan of examples/plan/<name>.yaml (before the planner counted compiled layers and MPT's fused
    attention, the first two did not: 85.3 and 74.6 GiB)."""
    from pretrainer.config import PreTrainingArguments
    from pretrainer.plan.command import plan_for_command

    plan = plan_for_command(PreTrainingArguments.from_yaml(REPO / "examples" / "plan" / f"{name}.yaml", []), world,
                            None, "H100", None)
    own = plan.estimate
    assert layout_text in own.layout.describe()
    assert own.fits, (own.layout.describe(), own.peak / 2**30)


@pytest.mark.parametrize("stage,offload_optimizer,offload_parameters",
                         [(2, False, False), (2, True, False), (3, False, False), (3, True, False), (3, True, True)])
def test_zero_model_states_agree_with_deepspeeds_own_estimators(stage, offload_optimizer, offload_parameters):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    from transformers import AutoConfig

    from pretrainer.parallel.deepspeed_config import DeepSpeedSettings
    from pretrainer.plan import estimate, model_shape
    from pretrainer.plan.device_spec import device_spec

    config = AutoConfig.from_pretrained(REPO / "examples" / "models" / "llama-2-7b" / "config.json")
    shape = model_shape(config)
    layout = layout_of("deepspeed", 16, 8, 1, 4, 512, "bf16",
                       DeepSpeedSettings.for_zero(stage, offload_optimizer, offload_parameters))
    ours = estimate(layout, shape, config, device_spec("bf16", 8, "H100"))
    if stage == 2:
        theirs = estimate_zero2_model_states_mem_needs(shape.parameters, 8, 2, offload_optimizer)[1]  # (cpu, gpu)
    else:
        theirs = estimate_zero3_model_states_mem_needs(shape.parameters, shape.layer_parameters, 8, 2,
                                                       offload_optimizer, offload_parameters)[1]
    assert abs(ours.parameters + ours.gradients + ours.optimizer - theirs) <= 0.10 * theirs


def test_plan_as_json_and_its_layouts_replan_to_what_they_claim():
    plan = plan_json(PLAN_7B, "--device", "H100")
    sizes = plan["per_rank_bytes"]
    assert {"parameters", "gradients", "optimizer", "activations", "runtime", "peak"} <= sizes.keys()
    assert plan["device_memory_bytes"] == int(80 * 2**30 * 0.93)
    assert plan["fits"] == (sizes["peak"] <= plan["device_memory_bytes"])
    assert plan["step_seconds"] > 0 and "TFLOP/s" in plan["assumptions"] and "GB/s between nodes" in plan["assumptions"]
    assert plan["pipeline_stage"] is None
    piped = plan_json(PLAN_7B, "engine=megatron", "dp=1", "plugin_args.pp_degree=8", "--device", "H100")
    assert piped["pipeline_stage"] in ("first", "last")
    layouts = plan["layouts"]
    assert layouts and all(layout["fits"] for layout in layouts)
    times = [layout["step_seconds"] for layout in layouts]  # fastest first, an extra dimension counted as a cost
    from pretrainer.plan.search import EXTRA_DIMENSION_COST

    assert times[0] <= min(times) * (1 + 4 * EXTRA_DIMENSION_COST)
    assert {o.split("=")[1] for layout in layouts for o in layout["overrides"] if o.startswith("engine=")} >= \
        {"megatron", "fsdp"}
    # a listed layout, pasted onto the config, is planned as listed
    for listed in (layouts[0], next(x for x in layouts if "engine=megatron" in x["overrides"])):
        again = plan_json(PLAN_7B, *listed["overrides"], "--device", "H100")
        assert again["per_rank_bytes"]["peak"] == listed["peak_bytes"]
        assert again["step_seconds"] == pytest.approx(listed["step_seconds"])
    # 70B on 8 x 24 GB: nothing fits, and the text says so with the smallest layouts
    done = run_ok(pretrainer("plan", PLAN_7B, "model_path=examples/models/llama-2-70b/config.json", "--device", "A10"))
    assert "does NOT fit" in done.stdout and "no layout of this world fits" in done.stdout


def _refusal_check(rss_limit_mb: float, command: list) -> tuple:
    """Run `command`; its exit code, stderr and the peak RSS of its process tree in MB."""
    wrapper = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:], capture_output=True, text=True);"
               " sys.stderr.write(done.stderr); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024);"
               " sys.exit(done.returncode)")
    done = run([sys.executable, "-c", wrapper, *command], timeout=300)
    return done, float(done.stdout.strip().splitlines()[-1])


def test_a_7b_fp32_run_is_refused_before_allocating(tmp_path):
    from pretrainer.plan.device_spec import available_ram

    budget = [] if available_ram() < 100 * 2**30 else ["device_memory=24GB"]  # machines with more RAM: as here
    done, peak_mb = _refusal_check(2000, pretrainer("train", PLAN_7B, "engine=single", "dp=1", "dtype=fp32",
                                                    f"save_dir={tmp_path / 'run'}", *budget))
    assert done.returncode == 2, describe(done)
    assert "Traceback" not in done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("pretrainer: error: predicted peak memory ") and "exceeds the" in error
    assert "No layout of 1 process(es) fits" in error and "engine=single" in error
    assert "; tensors x1.20 for the CPU heap's overhead)" in error  # every term of the peak is named
    assert peak_mb < 2000  # the 27 GB of fp32 weights were never allocated


def test_the_memory_check_stops_warns_or_stays_silent_as_configured(base_config, tmp_path):
    config = write_config(tmp_path / "c.yaml", {**base_config, "num_training_steps": 2, "eval_interval": None,
                                                 "save_interval": None, "export_hf": False, "write_report": True})
    own = plan_json(config)["per_rank_bytes"]["peak"]
    budget = f"device_memory={int(own * 0.97)}"
    done = run(pretrainer("train", config, budget))
    assert done.returncode == 2, describe(done)
    error = done.stderr.strip().splitlines()[-1]
    assert "predicted peak memory" in error and "(key 'device_memory')" in error
    assert "that fit: engine=single dp=1 micro_batch_size=" in error or "No layout" in error
    assert "preflight_memory_check: warn" in error and "Traceback" not in done.stderr

    done = run_ok(pretrainer("train", config, budget, "preflight_memory_check=warn"))
    assert "predicted peak memory" in done.stdout + done.stderr
    start = next(r for r in read_metrics(base_config["save_dir"]) if r.get("event") == "start")
    assert start["predicted_peak_mem_mb"] == pytest.approx(own / 2**20)  # how close: bench/plan_accuracy.py
    report = (Path(base_config["save_dir"]) / "report" / "report.html").read_text()
    assert "MB predicted before launch" in report

    run_ok(pretrainer("train", config, budget, "preflight_memory_check=off", f"save_dir={tmp_path / 'off'}"))
    start = next(r for r in read_metrics(tmp_path / "off") if r.get("event") == "start")
    assert "predicted_peak_mem_mb" not in start


@pytest.mark.parametrize("override,message", [
    ("seq_length=100000", "key 'seq_length': 100000 exceeds the model's max_position_embeddings"),
    ("seq_lenght=8", "unknown key 'seq_lenght'; did you mean 'seq_length'?"),
    ("preflight_memory_check=maybe", "preflight_memory_check 'maybe' is not one of error, warn, off"),
])
def test_plan_gives_the_same_errors_as_train(base_config, tmp_path, capsys, override, message):
    config = write_config(tmp_path / "c.yaml", base_config)
    (plan_code, plan), (train_code, train) = (cli_in_process(capsys, command, config, override)
                                              for command in ("plan", "train"))
    assert plan_code == train_code == 2
    assert message in plan and plan.strip().splitlines()[-1] == train.strip().splitlines()[-1]
    assert "Traceback" not in plan


def test_plan_for_a_named_device_and_sizes(base_config, tmp_path, capsys):
    config = write_config(tmp_path / "c.yaml", base_config)
    code, stderr = cli_in_process(capsys, "plan", config, "--device", "TPU-9000")
    assert code == 2 and "--device 'TPU-9000': not a device this planner knows" in stderr
    code, stderr = cli_in_process(capsys, "plan", config, "--device", "cpu", "--device-memory", "lots")
    assert code == 2 and "--device-memory 'lots': give a size such as 80GB" in stderr
    small = plan_json(config, "--device", "cpu", "--device-memory", "300MB")
    assert small["device_memory_bytes"] == 300 * 2**20 and not small["fits"]
    assert BIN.exists()


@pytest.mark.parametrize("args,message", [
    (["--world-size", "0"], "argument --world-size: expected an integer >= 1, got '0'"),
    (["--devices-per-node", "0"], "argument --devices-per-node: expected an integer >= 1, got '0'"),
    (["--world-size", "3", "engine=megatron", "plugin_args.tp_degree=2"],
     "3 process(es) cannot be split into groups of tp=2 x pp=1 x context_parallel_degree=1 ranks"),
    (["--world-size", "2", "engine=single"], "engine: single runs one process, but 2 processes are planned"),
    (["--device-memory", "1.2.3GB"], "--device-memory '1.2.3GB': give a size such as 80GB"),
    (["device_memory=lots"], "key 'device_memory': device_memory 'lots': give a size such as 80GB"),
    (["--world-size", "1", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_plan_arguments_are_one_line_errors(base_config, tmp_path, capsys, args, message):
    config = write_config(tmp_path / "c.yaml", base_config)
    code, stderr = cli_in_process(capsys, "plan", config, *args)
    assert code == 2 and message in stderr, stderr
    assert "Traceback" not in stderr


def test_overrides_may_follow_the_options(base_config, tmp_path, capsys):
    config = write_config(tmp_path / "c.yaml", base_config)
    plan = plan_json(config, "--world-size", "2", "engine=fsdp", "micro_batch_size=1")
    assert plan["layout"][:3] == ["engine=fsdp", "dp=2", "micro_batch_size=1"]
    code, stderr = cli_in_process(capsys, "train", config, "device_memory=lots")  # train reads it at load too
    assert code == 2 and "c.yaml, override device_memory=...: key 'device_memory': device_memory 'lots'" in stderr


def test_a_forward_that_cannot_run_on_fake_tensors_falls_back_to_the_formula(monkeypatch, caplog):
    from transformers import AutoConfig

    from pretrainer.plan import activations

    def data_dependent(*args, **kwargs):
        raise RuntimeError("aten._local_scalar_dense.default")

    config = AutoConfig.from_pretrained(QUICKSTART_MODEL / "config.json")
    activations._probe.cache_clear()
    monkeypatch.setattr(activations, "_saved_bytes", data_dependent)
    with caplog.at_level("INFO", logger="pretrainer.plan.activations"):
        profile = activations.probe(config, 256, "fp32", autocast=True)
    activations._probe.cache_clear()
    assert "estimated by formula" in caplog.text and "_local_scalar_dense" in caplog.text
    assert profile.per_layer == 256 * (10 * 256 + 4 * 688 + 2 * 128) * 4 and profile.layer_input == 256 * 256 * 4


def test_loading_counts_one_tensor_where_the_engine_reads_slices_and_the_whole_model_elsewhere(base_config,
                                                                                               tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(base_config["model_path"])
    weights = tmp_path / "weights"
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    model.save_pretrained(weights)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (weights / name).write_bytes((folder / name).read_bytes())
    parameters = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())  # the (untied) embedding or head
    config = write_config(tmp_path / "run.yaml", {**base_config, "model_path": str(weights)})

    def loading(*overrides) -> int:
        return plan_json(config, *overrides, "--world-size", "2")["per_rank_bytes"]["loading"]

    assert loading("engine=fsdp", "dp=2") == 4 * largest
    assert loading("engine=megatron", "dp=1", "plugin_args.tp_degree=2") == 4 * largest
    assert loading("engine=ddp", "dp=2") == 4 * largest  # replicated: built on meta, filled tensor by tensor
    assert loading("engine=fsdp", "dp=2", "sliced_weight_loading=false") == 4 * parameters


def test_cpu_heap_retention_counts_for_engines_that_gather_layers_and_megatron_chunks_its_logits(base_config,
                                                                                                  tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from pretrainer.parallel.fsdp_plan import CPU_GATHER_RETENTION

    config = write_config(tmp_path / "run.yaml", base_config)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_config["model_path"]))
    parameters = sum(p.numel() for p in model.parameters())

    def sizes(*overrides, device=()):
        return plan_json(config, *overrides, "--world-size", "2", *device)["per_rank_bytes"]

    # where the heap keeps freed blocks (host_malloc_reuse: on); by default fsdp's runs return them
    kept = "host_malloc_reuse=on"
    assert sizes("engine=fsdp", "dp=2", kept)["heap_retained"] == int(CPU_GATHER_RETENTION["other"] * 4 * parameters)
    assert sizes("engine=fsdp", "dp=2", kept, "activation_checkpointing=full")["heap_retained"] == \
        int(CPU_GATHER_RETENTION["full"] * 4 * parameters)
    assert sizes("engine=fsdp", "dp=2")["heap_retained"] == 0
    assert sizes("engine=ddp", "dp=2")["heap_retained"] == 0
    assert sizes("engine=fsdp", "dp=2", device=("--device", "H100"))["heap_retained"] == 0  # a CPU heap's only
    # the megatron engine's head computes the loss in chunks of its own vocabulary rows
    whole = sizes("engine=megatron", "dp=1", "plugin_args.tp_degree=2", "loss_chunk_size=0")["logits"]
    chunked = sizes("engine=megatron", "dp=1", "plugin_args.tp_degree=2", "loss_chunk_size=16")["logits"]
    vocab, tokens = model.config.vocab_size, base_config["micro_batch_size"] * base_config["seq_length"]
    assert chunked == 12 * 16 * vocab // 2  # one chunk of this rank's half of the vocabulary
    assert whole == int((12 + 4 + 4 / 2) * tokens * vocab)  # the whole logits, the shard and the gather's buffer


def test_tensor_parallel_layers_recomputed_in_full_count_a_larger_cpu_heap():
    import dataclasses

    from transformers import AutoConfig

    from pretrainer.parallel.megatron_settings import MegatronSettings
    from pretrainer.plan import estimate, model_shape
    from pretrainer.plan.device_spec import device_spec
    from pretrainer.plan.estimate import CPU_HEAP_OVERHEAD, CPU_HEAP_OVERHEAD_TP_RECOMPUTE

    config = AutoConfig.from_pretrained(QUICKSTART_MODEL)
    shape = model_shape(config)

    def planned(device, engine="megatron", tp=1, recompute="none"):
        settings = MegatronSettings(tp=tp) if engine == "megatron" else None
        return estimate(layout_of(engine, 2, 2, 4, 1, 256, "fp32", settings, recompute=recompute), shape, config,
                        device_spec("fp32", 2, device))

    recomputed = planned("cpu", tp=2, recompute="full")
    assert recomputed.heap_overhead == CPU_HEAP_OVERHEAD_TP_RECOMPUTE > CPU_HEAP_OVERHEAD
    assert dataclasses.replace(recomputed, heap_overhead=CPU_HEAP_OVERHEAD).peak < recomputed.peak
    assert planned("cpu", tp=2).heap_overhead == CPU_HEAP_OVERHEAD
    assert planned("cpu", engine="ddp", recompute="full").heap_overhead == CPU_HEAP_OVERHEAD
    assert planned("H100", tp=2, recompute="full").heap_overhead == 1.0  # a CPU heap's only


@pytest.mark.parametrize("tied", [False, True])
def test_the_plan_counts_the_flops_the_run_counts(tied):
    from transformers import AutoConfig, AutoModelForCausalLM

    from pretrainer.perf.flops import flops_per_token
    from pretrainer.plan import model_shape

    config = AutoConfig.from_pretrained(QUICKSTART_MODEL, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config)
    assert model_shape(config).flops(64).per_token == flops_per_token(model, 64).per_token


def test_an_moe_model_is_planned_on_its_active_parameters_as_the_run_counts_them(tmp_path):
    """DeepSeek-V3-shaped (a dense first layer, a shared expert): the plan counts every layer's own parameters
    and FLOPs on the active ones, as the run's banner; DeepSeek-V3's published size is 671B, 37B active."""
    from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config

    from helpers import write_tiny_moe
    from pretrainer.config import expert_shape
    from pretrainer.models import idle_expert_parameters
    from pretrainer.perf.flops import flops_per_token
    from pretrainer.plan import model_shape

    config = AutoConfig.from_pretrained(write_tiny_moe(tmp_path / "deepseek", "deepseek_v3"))
    model = AutoModelForCausalLM.from_config(config)
    shape = model_shape(config)
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    run = flops_per_token(model, 64, idle_expert_parameters(model, expert_shape(config, "config.json")))
    assert shape.flops(64).per_token == run.per_token and run.idle_expert_parameters > 0
    full = model_shape(DeepseekV3Config())
    assert round(full.parameters / 1e9) == 671 and 37 <= (full.parameters - full.idle_expert_parameters) / 1e9 < 38


def test_pipeline_stages_are_estimated_apart_and_the_higher_peak_is_the_plan():
    import dataclasses

    from transformers import AutoConfig

    from pretrainer.config import ParallelDims
    from pretrainer.parallel.megatron_settings import MegatronSettings
    from pretrainer.plan import estimate, model_shape
    from pretrainer.plan.device_spec import device_spec
    from pretrainer.plan.estimate import _estimate_rank, rank_parts

    config = AutoConfig.from_pretrained(QUICKSTART_MODEL)
    shape = model_shape(config)
    layout = layout_of("megatron", 2, 2, 2, 4, 64, "fp32", MegatronSettings(pp=2))
    first, last = rank_parts(layout, shape)
    assert first.parameters + last.parameters == shape.parameters  # the layers split evenly, the rest once
    assert (first.stage, first.in_flight, first.head) == ("first", 2, False)  # 1F1B: pp forwards before a backward
    assert (last.stage, last.in_flight, last.head) == ("last", 1, True)
    assert [p.in_flight for p in rank_parts(dataclasses.replace(layout, pipeline_schedule="gpipe"), shape)] == [4, 4]
    assert [p.stage for p in rank_parts(dataclasses.replace(layout, dims=ParallelDims(2)), shape)] == [""]

    device = device_spec("fp32", 2, "cpu")
    stages = [_estimate_rank(layout, shape, config, device, "all", "none", part) for part in (first, last)]
    assert stages[0].logits == 0 < stages[1].logits
    assert stages[0].activations == 2 * stages[1].activations  # same layers, twice the micro-batches in flight
    planned = estimate(layout, shape, config, device)
    assert planned.peak == max(s.peak for s in stages) and planned.stage == max(stages, key=lambda s: s.peak).stage


def test_plan_and_train_agree_on_the_loss_chunk_with_a_custom_loss(base_config, tmp_path, monkeypatch):
    """A custom loss needs per-token losses: `auto` then keeps the plain loss in the run and in its plan alike;
    without it both chunk the same way."""
    from pretrainer import PreTrainer, PreTrainingArguments
    from pretrainer.models import chunked_loss
    from pretrainer.plan.command import plan_for_command

    monkeypatch.setattr(chunked_loss, "AUTO_LOGITS_BYTES", 1024)  # `auto` chunks even the tiny model's logits

    def masked_mean(loss_mask, output_tensor):
        return (output_tensor * loss_mask).sum() / loss_mask.sum(), {}

    chunks = {}
    for custom in (False, True):
        args = PreTrainingArguments(**{**base_config, "num_training_steps": 1, "warmup_steps": 0, "eval_interval": 0,
                                       "export_hf": False, "save_dir": str(tmp_path / f"custom-{custom}")})
        if custom:
            args.update_distributed_train_args({"custom_loss_function": masked_mean})
        trainer = PreTrainer(args)
        trainer.train()
        chunks[custom] = (plan_for_command(args, None, None, "cpu", None).estimate.layout.loss_chunk,
                          trainer.facts.loss_chunk_size)
    assert chunks[True] == (0, 0) and chunks[False][0] == chunks[False][1] > 0


def test_expert_parallel_layouts_gather_only_their_experts_and_pay_the_exchange(tmp_path):
    """An MoE model on 4 ranks: fsdp and megatron with ep=2 and ep=4 (megatron's also by tp=2 or pp=2) are among the
    alternatives; on fsdp a rank gathers 1/ep of each layer's experts, and the step adds the all-to-all of every
    token's top_k hidden states per MoE layer, four times (more with full recompute)."""
    import dataclasses

    import yaml
    from transformers import AutoConfig

    from helpers import small_corpus_file, write_tiny_moe
    from pretrainer.parallel.fsdp_plan import sharded
    from pretrainer.plan import estimate, model_shape
    from pretrainer.plan.device_spec import device_spec
    from pretrainer.plan.estimate import rank_parts
    from pretrainer.plan.search import candidate_layouts
    from pretrainer.plan.step_time import _collectives

    folder = write_tiny_moe(tmp_path / "qwen", "qwen3_moe")
    config = {"num_training_steps": 1, "micro_batch_size": 2, "dp": 4, "seq_length": 32, "dtype": "fp32",
              "model_path": str(folder), "train_data": str(small_corpus_file(tmp_path / "d.jsonl")),
              "engine": "fsdp", "expert_parallel_degree": 2}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    plan = plan_json(tmp_path / "c.yaml", "--world-size", "4")
    assert "expert_parallel_degree=2" in plan["layout"]
    hf = AutoConfig.from_pretrained(folder)
    shape = model_shape(hf)
    candidates = candidate_layouts(layout_of("fsdp", 4, 2, 1, 1, 32, "fp32", sharded()), shape, lambda micro: 0)
    offered = {(c.engine.name, c.tp, c.dims.ep) for c in candidates}
    assert {("fsdp", 1, 2), ("fsdp", 1, 4), ("megatron", 1, 2), ("megatron", 1, 4), ("megatron", 2, 2)} <= offered
    assert not [c for c in candidates if c.cp > 1]  # whole sequences
    assert ("megatron", 2, 2) in {(c.engine.name, c.pp, c.dims.ep) for c in candidates}
    assert "engine=megatron" in {layout["overrides"][0] for layout in plan["layouts"]}
    assert shape.expert_layers == 2 and shape.expert_parameters == 2 * 3 * 8 * 64 * 64
    ep2 = layout_of("fsdp", 4, 1, 1, 2, 32, "fp32", sharded(reshard_after_forward=False))
    ep2 = dataclasses.replace(ep2, dims=dataclasses.replace(ep2.dims, ep=2))
    ep1 = dataclasses.replace(ep2, dims=dataclasses.replace(ep2.dims, ep=1))
    device = device_spec("fp32", 4, "cpu")
    gathered = {e: estimate(layout, shape, hf, device).parameters for e, layout in ((1, ep1), (2, ep2))}
    assert gathered[1] - gathered[2] == 4 * shape.expert_parameters // 2  # the other half of the experts
    part, bandwidth, experts = rank_parts(ep2, shape)[0], device.bandwidth(False), shape.expert_parameters
    # per step, against ep=1 (2 micro-batches): the all-to-alls, 2 micro x 2 layers x 4 x (32 tokens x top-2 x
    # 64 x fp32) of which half leaves the rank; the experts' gathers (2 x 4 bytes) and reduce-scatter (4 bytes)
    # of 1/2 of them over 2 ranks instead of all of them over 4
    exchange = 2 * 2 * 4 * (32 * 2 * 64 * 4) / 2
    gathers = 2 * 4 * (experts / 2 / 2 - experts * 3 / 4)
    reduce_scatter = 4 * (experts / 2 / 2 - experts * 3 / 4)
    added = sum(_collectives(ep2, shape, device, part)) - sum(_collectives(ep1, shape, device, part))
    assert added == pytest.approx((exchange + gathers + reduce_scatter) / bandwidth, rel=1e-9)


def tiny_family_configs() -> dict:
    """One small config per decoder family whose fields the planner reads (each names them its own way)."""
    import transformers as T

    common = {"vocab_size": 4096}  # the quickstart tokenizer's
    llama_like = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
    return {
        "gpt2": T.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **common),
        "gpt_neox": T.GPTNeoXConfig(**llama_like, **common),
        "falcon": T.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **common),
        "phi": T.PhiConfig(**llama_like, **common),
        "gemma": T.GemmaConfig(**llama_like, num_key_value_heads=2, head_dim=16, **common),
        "olmo": T.OlmoConfig(**llama_like, **common),
        "olmo2": T.Olmo2Config(**llama_like, **common),
        "mixtral": T.MixtralConfig(**llama_like, num_key_value_heads=2, num_local_experts=4, **common),
        "deepseek_v3": T.DeepseekV3Config(
            **llama_like, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
            first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, n_group=1, topk_group=1, **common),
    }


@pytest.mark.parametrize("family", list(tiny_family_configs()))
def test_every_decoder_family_plans_with_and_without_tensor_parallelism(family, tmp_path):
    from pretrainer import PreTrainingArguments
    from pretrainer.plan.activations import shard_reference
    from pretrainer.plan.command import plan_for_command

    config = tiny_family_configs()[family]
    config.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(QUICKSTART_MODEL / name, tmp_path / name)
    base = {"num_training_steps": 1, "micro_batch_size": 1, "dp": 1, "seq_length": 128, "model_path": str(tmp_path)}
    whole = plan_for_command(PreTrainingArguments(**base), 8, None, "H100", None)
    assert whole.estimate.peak > 0 and whole.alternatives  # the search probes tp alternatives too
    split = plan_for_command(PreTrainingArguments(**base, engine="megatron", plugin_args={
        "tp_degree": 2, "sequence_parallelism": True}), 8, None, "H100", None)
    assert 0 < split.estimate.activations < whole.estimate.activations, family
    # A family whose config cannot describe its shard is split as a Llama layer of its shape: GPT-2's and
    # GPT-NeoX's fused attention keeps its width whatever the heads, Falcon derives head_dim from them, and
    # DeepSeek-V3's latent projections are not divided by the heads.
    reference, shard = shard_reference(config, 2)
    stand_in = ("gpt2", "gpt_neox", "falcon", "deepseek_v3")
    assert (reference is config) == (family not in stand_in), (family, type(reference).__name__)
    from pretrainer.plan.model_shape import model_shape

    halves = (model_shape(c).layer_parameters for c in (reference, shard))
    assert next(halves) == pytest.approx(2 * next(halves), rel=0.1)


def test_the_step_time_matches_published_h100_throughput_and_ranks_the_publishers_layout_high(tmp_path):
    """bench/plan_vs_published.py's rows: every torchtitan and OLMo-core prediction within 0.8-1.25x of the published
    tokens/s per GPU, llm-foundry's within 0.75-1.3x, Megatron-LM's within 0.6-1.0x (pretrainer's megatron engine
    runs HF's layers and leaves its tensor-parallel collectives exposed, where Megatron-LM fuses and overlaps
    them), the median of all within 0.9-1.1, and torchtitan's FSDP layout for Llama 3.1 8B on 8 and on 128 GPUs
    among the planner's first three."""
    import statistics

    sys.path.insert(0, str(REPO / "bench"))
    import plan_vs_published as published

    folder = tmp_path
    ratios = [published.predicted_tokens_per_gpu(row, folder) / row.tokens_per_gpu for row in published.ROWS]
    bounds = {"torchtitan": (0.8, 1.25), "OLMo-core": (0.8, 1.25), "llm-foundry": (0.75, 1.3),
              "Megatron-LM": (0.6, 1.0)}
    assert all(bounds[row.source][0] <= r <= bounds[row.source][1] for row, r in zip(published.ROWS, ratios)), ratios
    assert 0.9 <= statistics.median(ratios) <= 1.1, ratios
    places = [published.publishers_place(row, folder) for row in published.ROWS
              if row.source == "torchtitan" and not row.keys.get("compile")]
    assert len(places) == 2 and all(position <= 3 for position, _ in places), places


def test_links_come_from_the_device_table_or_the_flags(capsys, base_config, tmp_path):
    from pretrainer.plan.device_spec import device_spec

    h100, a100 = device_spec("bf16", 8, "H100"), device_spec("bf16", 8, "A100")
    assert (h100.intra_node_bandwidth, h100.inter_node_bandwidth) == (450e9, 50e9)
    assert (a100.intra_node_bandwidth, a100.inter_node_bandwidth, a100.memory_bandwidth) == (300e9, 25e9, 2039e9)
    given = device_spec("bf16", 8, "H100", links=("900GB/s", "400Gb/s"))
    assert (given.intra_node_bandwidth, given.inter_node_bandwidth) == (900e9, 50e9)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(base_config))
    code, stderr = cli_in_process(capsys, "plan", path, "--device", "H100", "--inter-node-bandwidth", "fast")
    assert code == 2 and "--inter-node-bandwidth 'fast': give a bandwidth such as 450GB/s" in stderr, stderr


def test_the_step_time_moves_as_a_real_step_does(tmp_path):
    """Smaller micro-batches run smaller GEMMs (slower per token), compile fuses the element-wise ops (faster), and
    a slow network shows once the collectives no longer hide behind the compute (2 GB/s per card: 16 GB/s for
    the 8 ranks of a machine)."""
    import dataclasses

    sys.path.insert(0, str(REPO / "bench"))
    import plan_vs_published as published

    base = published.ROWS[2]  # torchtitan's Llama 3.1 8B on 128 GPUs

    def tokens_per_gpu(**keys) -> float:
        return published.predicted_tokens_per_gpu(dataclasses.replace(base, keys={**base.keys, **keys}), tmp_path)

    small, large = tokens_per_gpu(micro_batch_size=1, seq_length=2048), tokens_per_gpu(micro_batch_size=8,
                                                                                      seq_length=2048)
    assert large > 1.15 * small
    assert tokens_per_gpu(compile=True) > 1.1 * tokens_per_gpu()
    plan = published.plan_of(base, tmp_path).estimate
    assert plan.hidden_seconds > 0 and plan.communication_seconds < 0.05 * plan.compute_seconds  # FSDP overlaps
    from pretrainer.config import PreTrainingArguments
    from pretrainer.plan.command import plan_for_command

    keys = {"num_training_steps": 10, "dp": 128, "dtype": "bf16", "model_path": str(tmp_path / base.shape),
            "tokenizer_path": str(QUICKSTART_MODEL), "preflight_memory_check": "off", **base.keys}
    slow = plan_for_command(PreTrainingArguments(**keys), 128, 8, base.device, None, links=(None, "2GB/s")).estimate
    assert slow.communication_seconds > 0.5 * plan.compute_seconds and slow.step_seconds > 1.5 * plan.step_seconds


def test_the_pipeline_bubble_shrinks_with_interleaved_stages():
    """1F1B idles (pp - 1) slots per accumulation window; with v virtual stages per rank, v times fewer (the
    Megatron-LM paper's (p - 1) / (v m))."""
    from transformers import AutoConfig

    from pretrainer.parallel.megatron_settings import MegatronSettings
    from pretrainer.plan import model_shape
    from pretrainer.plan.device_spec import device_spec
    from pretrainer.plan.elementwise import LayerTraffic
    from pretrainer.plan.estimate import rank_parts
    from pretrainer.plan.step_time import micro_batch_seconds, step_time

    config = AutoConfig.from_pretrained(REPO / "examples" / "models" / "llama-2-7b" / "config.json")
    shape, device = model_shape(config), device_spec("bf16", 8, "H100")
    traffic = LayerTraffic(forward=1e5, backward=2e5)

    def compute(virtual: int) -> tuple[float, float]:
        settings = MegatronSettings(tp=1, pp=4, virtual_stages=virtual,
                                    schedule="interleaved_1f1b" if virtual > 1 else "1f1b")
        layout = layout_of("megatron", 8, 8, 1, 8, 2048, "bf16", settings)
        part = rank_parts(layout, shape, "all")[0]
        return step_time(layout, shape, device, part, 0, 1.0, traffic).compute, \
            layout.accumulation * micro_batch_seconds(layout, shape, device, part.matmul, traffic)

    (plain, work), (interleaved, same_work) = compute(1), compute(4)
    assert work == pytest.approx(same_work)
    assert plain == pytest.approx(work * (1 + 3 / 8)) and interleaved == pytest.approx(work * (1 + 3 / (8 * 4)))


def test_the_search_offers_sharded_data_parallelism_with_tp_and_sharded_accumulation():
    """Sharded data parallelism beside tensor parallelism is among the candidates: megatron tp x pp with the data
    ranks replicating, sharding state, or parameters too; and, where gradients are sharded, accumulating them
    sharded or whole."""
    from transformers import AutoConfig

    from pretrainer.parallel.fsdp_plan import sharded
    from pretrainer.plan import model_shape
    from pretrainer.plan.search import candidate_layouts

    shape = model_shape(AutoConfig.from_pretrained(QUICKSTART_MODEL))
    candidates = candidate_layouts(layout_of("fsdp", 8, 8, 1, 4, 256, "bf16", sharded()), shape, lambda m: 0)
    megatron = {(c.tp, c.settings.sharding_strategy) for c in candidates if c.engine.name == "megatron"}
    assert {(2, "no_shard"), (2, "optim_grads"), (2, "optim_grads_params")} <= megatron
    fsdp = {c.accumulate for c in candidates if c.engine.name == "fsdp" and c.accumulation > 1}
    assert fsdp == {"sharded", "unsharded"}
    assert all(c.accumulate == "unsharded" for c in candidates if c.engine.name in ("ddp", "deepspeed"))
