"""Numbers a run cannot compute with (NaN, infinities, lengths beyond its counters), a batch ramp asked about a
huge token count, and text files that are not UTF-8: each is one line naming the key or file, before any
training step."""

from __future__ import annotations

import json
import random
import sys
import textwrap

import pytest

from launch import pretrainer, run
from pretrainer import ConfigError, PreTrainer, PreTrainingArguments
from pretrainer.config import BatchSizes, BranchPoint, ScheduleSettings
from pretrainer.config.sizes import BatchRamp
from pretrainer.parallel.deepspeed_config import load_deepspeed_config
from pretrainer.train.metrics import format_duration

BASE = "num_training_steps: 6\nmicro_batch_size: 2\ndp: 1\ngradient_accumulation_steps: 2\n"
SOURCES = "[{name: web, path: web.jsonl, weight: 0.5}, {name: code, path: code.jsonl, weight: 0.5}]"
NAN = "is NaN (not a number), but a finite number is needed"
INF = "is inf (YAML's .inf, or a number beyond ±1.8e+308), but a finite number is needed"


@pytest.mark.parametrize("overrides, first_line", [
    (["z_loss_coeff=.nan"], f"key 'z_loss_coeff': z_loss_coeff {NAN}"),
    (["z_loss_coeff=nan"], "key 'z_loss_coeff': expected a number, got 'nan' (str); a finite number is needed"),
    (["z_loss_coeff=inf"], "key 'z_loss_coeff': expected a number, got 'inf' (str); a finite number is needed"),
    (["z_loss_coeff=-.inf"], "key 'z_loss_coeff': z_loss_coeff is -inf (YAML's .inf"),
    (["lr=1.0e+400"], f"key 'lr': lr {INF}"),
    (["lr=1e400"], f"key 'lr': lr {INF}"),  # a string YAML leaves alone, read as a number by the loader
    (["lr=1" + "0" * 400], "key 'lr': lr is a whole number of 401 digits, beyond any float"),
    (["seed=.nan"], f"key 'seed': seed {NAN}"),
    (["lr_decay_style=wsd", "wsd_decay_tokens=.nan"], f"key 'wsd_decay_tokens': wsd_decay_tokens {NAN}"),
    (["warmup_tokens=.inf"], f"key 'warmup_tokens': warmup_tokens {INF}"),
    (["cooldown_from=run/checkpoints/step-4", "cooldown_tokens=.nan"], f"key 'cooldown_tokens': cooldown_tokens {NAN}"),
    (["distributed_timeout_minutes=.inf"], f"key 'distributed_timeout_minutes': distributed_timeout_minutes {INF}"),
    (["distributed_timeout_minutes=1.0e+300"], "distributed_timeout_minutes must be > 0 and at most 1.44e+12"),
    ([f"train_data={SOURCES.replace('weight: 0.5}]', 'weight: .nan}]')}"], f"train_data[1].weight {NAN}"),
    ([f"train_data={SOURCES.replace('weight: 0.5},', 'weight: .inf},')}"], f"train_data[0].weight {INF}"),
    ([f"train_data={SOURCES.replace(', weight: 0.5', '')}",
      "mixture_schedule=[{until_tokens: .nan, weights: {web: 1}}, {weights: {code: 1}}]"],
     f"key 'mixture_schedule': mixture_schedule[0].until_tokens {NAN}"),
    ([f"train_data={SOURCES.replace(', weight: 0.5', '')}",
      "mixture_schedule=[{until_tokens: 1.0e+9, weights: {web: .inf}}, {weights: {code: 1}}]"],
     f"mixture_schedule[0].weights.web {INF}"),
    (["batch_size_schedule=[[0, 2], [.nan, 4]]"], f"key 'batch_size_schedule': batch_size_schedule[1][0] {NAN}"),
    (["batch_size_schedule=[[0, .inf], [512, 4]]"], f"batch_size_schedule[0][1] {INF}"),
    (["rope_scaling={rope_type: yarn, factor: .nan}"], f"key 'rope_scaling': rope_scaling.factor {NAN}"),
    (["moe_aux_loss_coeff=.nan"], f"key 'moe_aux_loss_coeff': moe_aux_loss_coeff {NAN}"),
    (["plugin_args={other_megatron_args: {lr: .nan}}"], f"plugin_args.other_megatron_args.lr {NAN}"),
    (["deepspeed={zero_optimization: {stage: .inf}}"], f"deepspeed.zero_optimization.stage {INF}"),
    (["lr=[1, 2"], "override 'lr=[1, 2': the value is not valid YAML"),
    (["gradient_accumulation_steps=2", "batch_size_schedule=[[0, 2], [1.0e+30, 4]]"],
     "batch_size_schedule[1] starts at token 1e+30, beyond what a run's 64-bit token counts reach"),
])
def test_a_number_that_is_not_finite_is_refused_where_keys_are_typed(tmp_path, overrides, first_line):
    path = tmp_path / "c.yaml"
    path.write_text(BASE)
    with pytest.raises(ConfigError) as info:
        PreTrainingArguments.from_yaml(path, overrides)
    message = str(info.value)
    assert first_line in message and "\n" not in message, message
    if "not valid YAML" not in first_line:  # the place named is the command line's, not the file's line
        assert f"c.yaml, override {overrides[-1].split('=')[0]}=...: " in message, message


def test_a_finite_config_with_numbers_everywhere_still_loads(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(BASE + "rope_scaling: {rope_type: yarn, factor: 4.0}\nplugin_args: {other_megatron_args: "
                    "{lr: 1e-4}}\ndistributed_timeout_minutes: 1.0e+6\nz_loss_coeff: 0.0\n")
    args = PreTrainingArguments.from_yaml(path, [f"train_data={SOURCES}"])
    assert args.lr == 1e-4 and args.mixture.stages[0].weights == (0.5, 0.5)


def test_weights_near_the_float_limit_are_normalised_not_summed_to_inf(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(BASE)
    huge = SOURCES.replace("0.5", "1.0e+308")
    assert PreTrainingArguments.from_yaml(path, [f"train_data={huge}"]).mixture.stages[0].weights == (0.5, 0.5)


def _walked(stages, seq_length: int, steps: int) -> tuple[list[int], list[int]]:
    """The ramp, update by update (the definition): each update's batch is the stage its tokens have reached."""
    batches, tokens = [], [0]
    for _ in range(steps):
        batch = next(seqs for start, seqs in reversed(stages) if tokens[-1] >= start)
        batches.append(batch)
        tokens.append(tokens[-1] + batch * seq_length)
    return batches, tokens


def test_the_ramp_s_arithmetic_gives_the_update_by_update_walk():
    """Random ramps, including stages shorter than one update (passed over): batches, tokens and the fractional
    updates of any token count are those of the walk, exactly."""
    rng = random.Random(3)
    for _ in range(60):
        seq_length = rng.choice([1, 7, 32])
        starts = sorted(rng.sample(range(1, 3000), rng.randint(0, 4)))
        stages = tuple((start, rng.randint(1, 40)) for start in [0, *starts])
        ramp = BatchRamp(stages, seq_length)
        batches, tokens = _walked(stages, seq_length, 150)
        assert [ramp.sequences(s) for s in range(150)] == batches
        assert [ramp.tokens_before(s) for s in range(151)] == tokens
        for count in [0, 1, *rng.sample(range(2, tokens[-1]), 40), rng.uniform(0, tokens[-1])]:
            step = next(s for s in range(150) if tokens[s + 1] >= count)
            assert ramp.steps_for(count) == step + (count - tokens[step]) / (batches[step] * seq_length)


def test_a_token_length_far_beyond_the_run_costs_no_walk(base_config):
    """warmup_tokens 1e15 through a ramp: the refusal (the warmup is longer than the run) is arithmetic, not a
    walk of 1e9 updates (which grew memory by about 90 MB/s)."""
    from pretrainer.run.resolve import schedule_settings

    args = PreTrainingArguments(**{**base_config, "warmup_steps": None, "warmup_tokens": 1e15,
                                   "batch_size_schedule": [[0, 2], [512, 4]]})
    sizes = BatchSizes.of(args, 32, 1)
    with pytest.raises(ConfigError, match=r"key 'warmup_tokens': warmup_tokens 1e\+15 is longer than the run "
                                          r"\(6 steps, 384 tokens\)"):
        schedule_settings(args, sizes)
    # a walk would never end here (1e298 updates): the answer comes from the stages alone
    assert sizes.ramp.steps_for(1e300) == pytest.approx(1e300 / 128)  # at the full batch of 4 x 32 tokens


@pytest.mark.parametrize("keys, key", [({"num_training_steps": 10**18}, "num_training_steps"),
                                       ({"cooldown_tokens": 1e300}, "cooldown_tokens")])
def test_a_length_beyond_the_run_s_token_counts_is_one_line(base_config, keys, key):
    """Converted to whole steps, 1e300 tokens would overflow in the loop (its ETA, its counters): refused."""
    branch = BranchPoint("run/checkpoints/step-4", "run", 4, 1.0) if "cooldown_tokens" in keys else None
    extra = {"cooldown_from": "run/checkpoints/step-4"} if branch else {}
    args = PreTrainingArguments(**{**base_config, **keys, **extra})
    with pytest.raises(ConfigError, match=rf"key '{key}': the run would train .* tokens, more than its 64-bit "
                                          r"token counts hold \(9\.22e\+18\); give fewer"):
        ScheduleSettings.of(args, BatchSizes.of(args, 32, 1), branch)


def test_a_ramp_stage_larger_than_the_global_batch_is_refused(base_config):
    args = PreTrainingArguments(**{**base_config, "batch_size_schedule": [[0, 2], [64, 1e300], [128, 4]]})
    with pytest.raises(ConfigError, match=r"a stage has 1e\+300 sequences, more than the global batch of 4"):
        BatchSizes.of(args, 32, 1)


def test_an_eta_of_any_length_prints():
    assert format_duration(59) == "00:00:59" and format_duration(90061) == "1d 01:01:01"
    assert " " in format_duration(1e300)  # days, however many: no time struct to overflow


def test_a_refused_branch_leaves_no_folder(base_config, tmp_path):
    """A branch refused once its folder is chosen (here: lengths the run cannot count, or a sequence longer than
    the model's positions, both found while the run is resolved) leaves no RUN/branches/<name> behind."""
    parent = tmp_path / "parent"
    PreTrainer(PreTrainingArguments(**{**base_config, "save_dir": str(parent), "num_training_steps": 2,
                                       "save_interval": 2, "eval_interval": 0, "export_hf": False,
                                       "lr_decay_style": "wsd"})).train()
    branch = {**base_config, "save_dir": str(parent), "num_training_steps": 2, "lr_decay_style": "wsd",
              "cooldown_from": str(parent / "checkpoints" / "step-2")}
    for keys, message in (({"cooldown_tokens": 1e300}, "more than its 64-bit token counts hold"),
                          ({"cooldown_tokens": 256, "seq_length": 4096}, None)):  # any refusal
        with pytest.raises(ConfigError, match=message):
            PreTrainer(PreTrainingArguments(**{**branch, **keys}))
        assert not (parent / "branches").exists()


def test_a_config_that_is_not_utf8_names_the_file_and_place(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(BASE.encode() + b"# caf\xe9\n")
    with pytest.raises(ConfigError) as info:
        PreTrainingArguments.from_yaml(path)
    byte = len(BASE) + len("# caf")
    assert str(info.value) == f"config file {path} is not UTF-8 (line 5, byte {byte}: 0xe9); save it as UTF-8"
    with_bom = tmp_path / "bom.yaml"
    with_bom.write_bytes(b"\xef\xbb\xbf" + BASE.encode())  # a BOM, as some editors write UTF-8
    assert PreTrainingArguments.from_yaml(with_bom).num_training_steps == 6


def test_a_deepspeed_json_that_is_not_utf8_or_not_finite_is_one_line(tmp_path):
    latin1, nan = tmp_path / "latin1.json", tmp_path / "nan.json"
    latin1.write_bytes(b'{"zero_optimization": {"stage": 2},\n "comment": "caf\xe9"}')
    nan.write_text('{"zero_optimization": {"stage": 2, "reduce_bucket_size": NaN}}')
    byte = latin1.read_bytes().index(b"\xe9")
    with pytest.raises(ConfigError, match=rf"key 'deepspeed': {latin1} is not UTF-8 \(line 2, byte {byte}: 0xe9\)"):
        load_deepspeed_config(str(latin1))
    with pytest.raises(ConfigError, match=rf"key 'deepspeed': {nan}: zero_optimization.reduce_bucket_size is NaN"):
        load_deepspeed_config(str(nan))


def test_the_console_refuses_numbers_that_are_not_numbers_in_one_line(base_config, tmp_path):
    """`pretrainer train` and `pretrainer plan`, as a user runs them: exit 2 and one line on stderr, before any
    training step (nothing is written to save_dir). A wrapper reads the command's peak memory: the warmup of
    1e15 tokens through a ramp is refused with the memory of the refusal without a ramp."""
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps(base_config))  # JSON is YAML
    sources = f"[{{name: web, path: {base_config['train_data']}, weight: .nan}}]"
    ramp = ["lr_decay_style=constant", "warmup_steps=null", "warmup_tokens=1e15"]  # read as a number, no note
    cases = [(["train", config, "z_loss_coeff=.nan"], "key 'z_loss_coeff': z_loss_coeff is NaN"),
             (["plan", config, f"train_data={sources}"], "key 'train_data': train_data[0].weight is NaN"),
             (["train", config, *ramp, "batch_size_schedule=[[0, 2], [512, 4]]"], "warmup_tokens 1e+15 is longer"),
             (["train", config, *ramp], "warmup_tokens 1e+15 is longer")]
    peaks = []
    for command, first_line in cases:
        done = run([sys.executable, "-c", PEAK_MEMORY, *pretrainer(*command)], timeout=120)
        *lines, peak = done.stdout.splitlines()
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith("pretrainer: error: ") and first_line in done.stderr, done.stderr
        peaks.append(int(peak))
    assert peaks[2] < peaks[3] + 50_000  # KiB: the ramp's refusal takes no more memory than the plain one's
    assert not [path for path in (tmp_path / "run").rglob("*")]  # the folder is made at most, never written


# Runs the command, passes its stderr and exit code on, and prints its peak resident memory (KiB) last.
PEAK_MEMORY = textwrap.dedent("""
    import resource, subprocess, sys
    done = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(done.stderr)
    print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    sys.exit(done.returncode)
""")


def test_a_ramp_stage_the_run_never_reaches_is_said_once(base_config, pretrainer_log):
    """A shortened trial of a long run's config trains without the ramp's late stages: a warning, not an error."""
    from pretrainer.run.resolve import warn_of_unreached_stages

    args = PreTrainingArguments(**{**base_config, "batch_size_schedule": [[0, 2], [100_000, 4]]})
    warn_of_unreached_stages(BatchSizes.of(args, 32, 1))
    assert "the stage(s) from token 100,000 start after the run's last token (384 in 6 steps) and are never " \
           "reached; the last step trains 2 sequences" in pretrainer_log.take()
    warn_of_unreached_stages(BatchSizes.of(PreTrainingArguments(**{**base_config, "batch_size_schedule": [
        [0, 2], [128, 4]]}), 32, 1))
    assert not pretrainer_log.take()
