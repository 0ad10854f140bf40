"""One temperature (docs/opd.md): the behaviour policy, the student's old logprobs, the loss's logprobs and the
teachers' scores are all of softmax(logits / rollout.temperature), on both backends, and a setting that would break
it is refused in one line before any model loads.

The probe (tests/step_probe.py) runs one real step of self-distillation (the teacher is the student's own
directory) at rollout.temperature=0.5: every logprob the step hands on is then one number, 0 apart up to float32
(measured ~1e-6 on HF, ~1e-5 on Megatron against the HF rollout copy). Any one of them taken at temperature 1
moves its gap to ~0.1-1 (the negative controls in the report of the commit that added this file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megaopd.config import ConfigError, save_config
from megaopd.objectives.methods import method
from megaopd.run.resolve import check_is_correction, check_temperature
from tests.conftest import run_config
from tests.step_probe import step_gaps

TOL = 1e-4
WORKER = Path(__file__).parent / "step_worker.py"


def self_distillation(assets, run_dir, form: str, **overrides):
    return run_config(assets, run_dir, "opd", **{
        "opd.teachers.*": assets / "models" / "qwen3-tiny", "opd.form": form, "opd.topk": 8,
        "rollout.temperature": 0.5, "rollout.samples_per_prompt": 1, "train.prompts_per_step": 4,
        "train.micro_batch_size": 2, "rollout.max_new_tokens": 8, **overrides})


def check(gaps: dict[str, float], form: str) -> None:
    print(form, {k: f"{v:.2g}" for k, v in gaps.items()})
    for what in ("behaviour", "teacher", "loss") + ("kl",) * (form == "topk"):
        assert gaps[what] < TOL, f"{form}: the {what} logprobs are {gaps[what]:.3g} from the old ones ({gaps})"


@pytest.mark.parametrize("form", ["sampled", "topk"])
def test_one_temperature_on_the_hf_backend(assets, tmp_path, form):
    from megaopd.run.trainer import Trainer

    check(step_gaps(Trainer(self_distillation(assets, tmp_path / form, form))), form)


@pytest.mark.slow
def test_one_temperature_on_the_megatron_backend(assets, tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install -e '.[megatron]')")
    pytest.importorskip("mbridge", reason="mbridge not installed (pip install -e '.[megatron]')")
    forms = ("sampled", "topk")
    for form in forms:
        save_config(self_distillation(assets, tmp_path / form, form), tmp_path / f"{form}.yaml")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
           str(tmp_path), *forms]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode:
        pytest.fail("step worker failed:\n" + "\n".join(proc.stderr.splitlines()[-60:]))
    for form in forms:
        check(json.loads((tmp_path / f"{form}.json").read_text()), form)


@pytest.mark.parametrize("overrides, message", [
    ({"opd.match_sampling": False},
     r"^opd\.match_sampling=false scores the teachers at temperature 1, but the student's logprobs are taken at "
     r"rollout\.temperature=0\.5: set opd\.match_sampling=true$"),
    ({"opd.teacher_engine": "sglang"},
     r"^opd\.teacher_engine=sglang scores at temperature 1 without a top-p cut, but the rollout samples at "
     r"rollout\.temperature=0\.5 rollout\.top_p=1: roll out at 1 / 1, or use opd\.teacher_engine=local$"),
    ({"opd.teacher_engine": "sglang", "rollout.temperature": 1.0, "rollout.top_p": 0.9},
     r"^opd\.teacher_engine=sglang .* rollout\.temperature=1 rollout\.top_p=0\.9: "),
    ({"model.backend": "megatron", "rollout.engine": "sglang", "rollout.top_p": 0.9},
     r"^model\.backend=megatron teachers score at a temperature without a top-p cut, and opd\.match_sampling asks "
     r"for rollout\.top_p=0\.9's: set rollout\.top_p=1$"),
])
def test_a_teacher_at_another_temperature_is_refused_in_one_line(assets, tmp_path, overrides, message):
    cfg = self_distillation(assets, tmp_path, "sampled", **overrides)
    with pytest.raises(ConfigError, match=message):
        check_temperature(cfg, method("opd"))


@pytest.mark.parametrize("overrides", [
    {},  # the run of the tests above
    {"opd.teacher_engine": "sglang", "rollout.temperature": 1.0},
    {"opd.teacher_engine": "sglang", "rollout.temperature": 0.0},  # greedy rollouts train at 1
    {"opd.match_sampling": False, "rollout.temperature": 1.0, "rollout.top_p": 0.9},  # the teacher uncut, at 1
    {"opd.match_sampling": False, "rollout.temperature": 1.0, "rollout.top_p": 0.9, "model.backend": "megatron",
     "rollout.engine": "sglang"},
    # The engine's logprobs at T without a cut are the loss's own: they may stand in for the old logprobs.
    {"train.recompute_old_logprobs": False},
])
def test_settings_that_keep_one_temperature_pass(assets, tmp_path, overrides):
    cfg = self_distillation(assets, tmp_path, "sampled", **overrides)
    check_temperature(cfg, method("opd"))
    check_is_correction(cfg, method("opd"))
