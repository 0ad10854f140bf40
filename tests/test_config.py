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


def test_types_are_checked_and_coerced():
    cfg = load_config(None, ["optim.lr=1e-4", "train.steps=7", "optim.betas=[0.9, 0.95]"])
    assert cfg.optim.lr == pytest.approx(1e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.train.steps == 7 and cfg.optim.betas == (0.9, 0.95)
    with pytest.raises(ConfigError, match="train.steps: expected int"):
        load_config(None, ["train.steps=many"])
    with pytest.raises(ConfigError, match="not of the form"):
        load_config(None, ["train.steps"])


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
