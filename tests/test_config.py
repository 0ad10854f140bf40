import re

import pytest
import yaml

from megaopd.config import ConfigError, RunConfig, load_config, save_config


def config_file(tmp_path, key: str, value):
    """A config file that sets one dotted key, nested as a user writes it."""
    *parents, leaf = key.split(".")
    doc = {leaf: value}
    for parent in reversed(parents):
        doc = {parent: doc}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_unknown_key_names_key_and_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"'train\.stepz'.*did you mean 'train\.steps'"):
        load_config(None, ["train.stepz=3"])
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"'optim\.lrr'.*'optim\.lr'"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"'trian'.*'train'"):
        load_config(None, ["trian.steps=3"])


def test_a_key_that_did_nothing_is_refused_with_what_to_set(tmp_path):
    """sft.batch_size was parsed and never read (the SFT step takes train.prompts_per_step rows)."""
    with pytest.raises(ConfigError, match=r"'sft\.batch_size' is not used: .*train\.prompts_per_step"):
        load_config(None, ["sft.batch_size=32"])
    path = tmp_path / "c.yaml"
    path.write_text("sft:\n  batch_size: 32\n")
    with pytest.raises(ConfigError, match=r"'sft\.batch_size' is not used"):
        load_config(path)


def test_types_are_checked_and_coerced():
    cfg = load_config(None, ["optim.lr=1e-4", "train.steps=7", "optim.betas=[0.9, 0.95]"])
    assert cfg.optim.lr == pytest.approx(1e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.train.steps == 7 and cfg.optim.betas == (0.9, 0.95)
    with pytest.raises(ConfigError, match="train.steps: expected int"):
        load_config(None, ["train.steps=many"])
    with pytest.raises(ConfigError, match="not of the form"):
        load_config(None, ["train.steps"])


@pytest.mark.parametrize("override, least", [("train.steps=-3", 0), ("train.prompts_per_step=0", 1),
                                             ("train.micro_batch_size=0", 1), ("train.epochs=0", 1),
                                             ("train.minibatches=0", 1), ("rollout.samples_per_prompt=0", 1),
                                             ("rollout.max_new_tokens=0", 1), ("rollout.batch_prompts=0", 1),
                                             ("eval.every=0", 1)])
def test_a_count_below_its_least_is_refused_at_load(override, least):
    """A count that would fail deep in the run (a modulo by zero, an empty batch: tracebacks) is a config error."""
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"^{key} must be >= {least}, got {value}; set one in that range, "
                                         rf"e\.g\. {key}=\d+ \(the default\)$"):
        load_config(None, [override])


# A number outside the range its code reads it in (check_at_least / check_range in megaopd/config.py). Before, each
# ended in a library's traceback (optim.lr, weight_decay, betas; train.seed; eval.max_new_tokens; plan.mfu,
# peak_tflops, prompt_tokens; model.megatron.tp / pp; rollout.sglang.num_servers; verifier.*), or trained or
# planned something other than asked without a word: a negative grad_clip flips the gradient, a negative temperature
# samples the least likely tokens, top_p 0 keeps no token, a window of 0 never plateaus, a negative memory_gib is
# not checked.
OUT_OF_RANGE = [
    "optim.lr=-1", "optim.lr=.nan", "optim.weight_decay=-0.1", "optim.betas=[1.0, 0.99]", "optim.betas=[0.9, -0.5]",
    "optim.betas=[0.9]", "optim.grad_clip=-1", "optim.warmup_steps=-5",
    "grpo.clip_low=-0.2", "grpo.clip_high=-0.1", "grpo.kl_coef=-0.01", "opd.coef=-1", "opd.clip=-0.2",
    "rollout.temperature=-1", "rollout.temperature=.nan", "rollout.top_p=0", "rollout.top_p=1.5",
    "rollout.max_staleness=-1", "rollout.inflight_chunk=0",
    "rollout.sglang.num_servers=0", "rollout.sglang.retries=-1", "rollout.sglang.max_total_tokens=-1",
    "rollout.sglang.startup_timeout_s=0", "rollout.sglang.request_timeout_s=-5", "rollout.sglang.probe_tolerance=-1",
    "model.megatron.tp=0", "model.megatron.pp=0", "model.megatron.teacher_tp=-1", "model.megatron.vocab_multiple=0",
    "model.megatron.adam_eps=0",
    "sft.stop_at_accuracy=1.5", "sft.noise=-0.1", "train.stop.window=0", "train.stop.min_delta=-0.01",
    "train.seed=-1", "train.seed=4294967296",
    "eval.prompts_per_domain=-1", "eval.final_prompts_per_domain=-4", "eval.max_new_tokens=-3",
    "checkpoint.every=-1", "checkpoint.keep=-1",
    "plan.memory_gib=-4", "plan.gpus_per_node=0", "plan.nodes=0", "plan.usable=0", "plan.usable=1.5",
    "plan.peak_tflops=0", "plan.mfu=0", "plan.mfu=1.2", "plan.prompt_tokens=-5",
    "verifier.max_error_share=1.5", "verifier.error_steps=0",
]


@pytest.mark.parametrize("override", OUT_OF_RANGE)
def test_a_number_out_of_its_range_is_refused_at_load_in_one_line(tmp_path, override):
    key, value = override.split("=")
    with pytest.raises(ConfigError) as refused:
        load_config(None, [override])
    line = str(refused.value)
    assert line.startswith(f"{key} must ") and ", got " in line and "; set " in line and "\n" not in line, line
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)} must "):  # the same through a file
        load_config(config_file(tmp_path, key, yaml.safe_load(value)))


def test_an_out_of_range_line_names_the_range_and_what_to_set():
    with pytest.raises(ConfigError, match=r"^optim\.lr must be >= 0, got -1; set one in that range, e\.g\. "
                                          r"optim\.lr=0\.001 \(the default\)$"):
        load_config(None, ["optim.lr=-1"])
    with pytest.raises(ConfigError, match=r"^optim\.betas must each be in \[0, 1\), got \[0\.9, 1\]; .* "
                                          r"optim\.betas=\[0\.9, 0\.99\] \(the default\)$"):
        load_config(None, ["optim.betas=[0.9, 1]"])
    with pytest.raises(ConfigError, match=r"^rollout\.top_p must be in \(0, 1\] \(1: no cut\), got 0; "):
        load_config(None, ["rollout.top_p=0"])


def test_the_edges_the_code_gives_a_meaning_load():
    """The values at a range's edge that the code reads as something (0: off, all, greedy; inf: a fault the tests
    inject on purpose, tests/test_faults.py) are not refused."""
    cfg = load_config(None, [
        "optim.lr=0", "optim.grad_clip=0", "optim.betas=[0, 0.999]", "optim.weight_decay=0", "rollout.temperature=0",
        "rollout.top_p=1", "grpo.clip_low=1.5", "grpo.kl_coef=.inf", "opd.coef=0", "checkpoint.every=0",
        "checkpoint.keep=0", "eval.prompts_per_domain=0", "eval.max_new_tokens=0", "model.megatron.teacher_tp=0",
        "verifier.max_error_share=1", "sft.stop_at_accuracy=0", "sft.noise=1", "plan.memory_gib=0",
        "plan.prompt_tokens=0", "plan.usable=1", "train.seed=4294967295", "rollout.sglang.retries=0",
        "rollout.sglang.max_total_tokens=0", "rollout.sglang.probe_tolerance=0", "train.stop.min_delta=0"])
    assert cfg.grpo.kl_coef == float("inf") and cfg.rollout.temperature == 0 and cfg.train.seed == 2**32 - 1


def test_free_form_mapping_and_override_on_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 5\nopd:\n  teachers:\n    arith_add: /a\n")
    cfg = load_config(path, ["opd.teachers.prog_trace=/b", "train.steps=9"])
    assert cfg.opd.teachers == {"arith_add": "/a", "prog_trace": "/b"}
    assert cfg.train.steps == 9


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["train.steps=3", "opd.teachers.*=/t"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg and isinstance(again, RunConfig)
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["steps"] == 3


@pytest.mark.parametrize("override, closest", [
    ("opd.form=top_k", "topk"), ("opd.kl=revers", "reverse"),
    ("rollout.engine=sglng", "sglang"), ("opd.teacher_engine=lcoal", "local"), ("model.backend=megatorn", "megatron"),
    ("train.tis=tokens", "token"), ("model.megatron.fp8=e4m4", "e4m3"), ("rollout.sglang.sync=tensors", "tensor"),
    ("counts_as=cold-start", "cold_start"), ("model.dtype=bfloat61", "bfloat16")])
def test_misspelled_enumerated_value_is_rejected_at_load(tmp_path, override, closest):
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"^{key}: '{value}' is not one of .*; did you mean '{closest}'\?$"):
        load_config(None, [override])
    with pytest.raises(ConfigError, match=rf"did you mean '{closest}'"):  # the same through a file, at any depth
        load_config(config_file(tmp_path, key, value))


def test_a_misspelled_algorithm_is_refused_by_the_method_table_before_any_stage_runs(tmp_path):
    """The algorithm names are the rows of ``megaopd.objectives.methods.METHODS`` (listed once): ``method`` refuses any other
    in the loader's words, and a study refuses it when it loads its stages, before the first one trains."""
    from megaopd.objectives.methods import method
    from megaopd.run.study import StageConfig, StudyConfig, stage_config

    with pytest.raises(ConfigError, match=r"^train.algorithm: 'gpro' is not one of 'sft', .*; did you mean 'grpo'\?$"):
        method(load_config(None, ["train.algorithm=gpro"]).train.algorithm)
    config = tmp_path / "stage.yaml"
    config.write_text("train:\n  algorithm: gpro\n")
    study = StudyConfig(out=str(tmp_path / "study"), stages=[StageConfig(name="s", config=str(config))])
    with pytest.raises(ConfigError, match="did you mean 'grpo'"):
        stage_config(study, study.stages[0])


def test_enumerated_values_load_and_a_far_miss_lists_the_choices():
    cfg = load_config(None, ["train.algorithm=grpo_opd", "opd.form=topk", "model.megatron.fp8=hybrid"])
    assert (cfg.train.algorithm, cfg.opd.form, cfg.model.megatron.fp8) == ("grpo_opd", "topk", "hybrid")
    with pytest.raises(ConfigError,
                       match=r"^train\.tis: 'xyz' is not one of 'auto', 'none', 'token', 'sequence'; set one of them$"):
        load_config(None, ["train.tis=xyz"])
    with pytest.raises(ConfigError, match=r"model\.megatron\.fp8: True is not one of"):
        load_config(None, ["model.megatron.fp8=true"])  # YAML's bool, not a string


def test_every_shipped_config_loads():
    from pathlib import Path

    from megaopd.launch.slurm import load_launch

    paths = sorted(Path(__file__).parents[1].glob("configs/**/*.yaml"))
    assert paths
    for path in paths:
        if path.name.startswith("launch"):  # a launch file (megaopd submit / rehearse --launch)
            load_launch(path)
        elif "studies" not in path.parts:
            load_config(path)
