import pytest
import yaml

from megaopd.config import ConfigError, RunConfig, load_config, save_config


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
    with pytest.raises(ConfigError, match=rf"^{key} must be >= {least}, got {value}; set a count of at least {least}$"):
        load_config(None, [override])


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
    # the same through a file, at any depth
    *parents, leaf = key.split(".")
    doc = {leaf: value}
    for parent in reversed(parents):
        doc = {parent: doc}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=rf"did you mean '{closest}'"):
        load_config(path)


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
