"""The launch environment enters a run's config in one place (megaopd.run.environment), where train() starts it; no other
module of the package, and no benchmark script, reads a MEGAOPD_ variable."""

import ast
import re
from pathlib import Path

import pytest

from megaopd.run import environment
from megaopd.run import trainer
from megaopd.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
JOB = {"MEGAOPD_ROLLOUT_URLS": "http://10.0.0.3:30000,http://10.0.0.4:30000",
       "MEGAOPD_TEACHER_URLS": "*=http://10.0.0.5:30000,code=http://10.0.0.6:30000",
       "MEGAOPD_SYNC_ADDR": "10.0.0.2", "MEGAOPD_SGLANG_PYTHON": "/opt/sglang/bin/python",
       "MEGAOPD_SANDBOX_NAMESPACES": "0", "MEGAOPD_SANDBOX_PYTHON": "/usr/bin/python3"}


def test_a_jobs_variables_fill_the_config_once():
    cfg = environment.apply(load_config(None, ["opd.teacher_urls={code: [http://10.0.0.9:30000]}"]), JOB)
    sglang, sandbox = cfg.rollout.sglang, cfg.verifier.sandbox
    assert sglang.urls == ["http://10.0.0.3:30000", "http://10.0.0.4:30000"]
    assert (sglang.sync_address, sglang.python) == ("10.0.0.2", "/opt/sglang/bin/python")
    assert cfg.opd.teacher_urls == {"code": ["http://10.0.0.9:30000", "http://10.0.0.6:30000"],
                                    "*": ["http://10.0.0.5:30000"]}
    assert (sandbox.namespaces, sandbox.python) == (False, "/usr/bin/python3")
    assert environment.apply(cfg, JOB) == cfg  # twice: nothing added again
    assert environment.apply(load_config(None), {}) == load_config(None)  # no variables: the config as it was


def test_what_the_config_sets_wins():
    cfg = load_config(None, ["rollout.sglang.urls=[http://mine:1]", "rollout.sglang.sync_address=1.2.3.4",
                             "rollout.sglang.python=/my/python", "verifier.sandbox.python=/my/sandbox/python"])
    sglang, sandbox = environment.apply(cfg, JOB).rollout.sglang, environment.apply(cfg, JOB).verifier.sandbox
    assert (sglang.urls, sglang.sync_address, sglang.python) == (["http://mine:1"], "1.2.3.4", "/my/python")
    assert sandbox.python == "/my/sandbox/python"


def test_a_malformed_teacher_entry_is_a_config_error():
    with pytest.raises(ConfigError, match="MEGAOPD_TEACHER_URLS: 'http://10.0.0.5:30000' is not ROUTE=URL"):
        environment.apply(load_config(None), {"MEGAOPD_TEACHER_URLS": "http://10.0.0.5:30000"})


def test_train_hands_the_trainer_the_config_with_the_environment(tmp_path, monkeypatch):
    seen = []

    class Recording:
        def __init__(self, cfg):
            seen.append(cfg)

        def fit(self):
            return {}

    monkeypatch.setattr(trainer, "Trainer", Recording)
    for name, value in JOB.items():
        monkeypatch.setenv(name, value)
    trainer.train(load_config(None, [f"run_dir={tmp_path}"]))
    assert seen == [environment.apply(load_config(None, [f"run_dir={tmp_path}"]), JOB)]


def _variable_names(tree: ast.AST) -> list[str]:
    """The MEGAOPD_ variable names a module spells as a string of their own (what a lookup takes; a message that
    mentions one is a longer string)."""
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and re.fullmatch(r"MEGAOPD_[A-Z0-9_]+", node.value)]


def test_only_the_environment_module_names_megaopd_variables():
    named = {str(path.relative_to(REPO)): names for folder in ("megaopd", "bench")
             for path in sorted((REPO / folder).rglob("*.py")) if (names := _variable_names(ast.parse(path.read_text())))}
    assert named.pop("megaopd/run/environment.py")  # the one reader
    assert named == {}, ("read the config field megaopd.run.environment fills instead (or its reader, "
                         "environment.sglang_python()); a script's own setting is a command-line flag")
