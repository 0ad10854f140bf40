"""The HF trainer (GRPO, both OPD forms, SFT, eval) on a fake accelerator (see tests/fake_device.py; the megatron
policy's step: tests/test_megatron_device.py): no op mixes device and host tensors, every random draw uses a
generator on the device of what it fills, nothing on the device goes through numpy or float64, and host syncs stay
bounded per step."""

import pytest

from conftest import run_config
from fake_device import FAKE, fake_device
from megaopd.run.trainer import train

STEPS = 2
UPDATE_PATH = ("hf_policy.py", "objectives.py", "trainer.py", "teachers.py", "batch.py")
RUNS = {
    "grpo": ("grpo", {}),
    "opd_full_vocab": ("opd", {"opd.form": "full_vocab", "rollout.samples_per_prompt": 1}),
    "opd_sampled": ("opd", {"opd.form": "sampled", "rollout.samples_per_prompt": 1}),
    "sft": ("sft", {}),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", RUNS)
def test_hf_trainer_keeps_every_tensor_on_its_device(assets, tmp_path, monkeypatch, name):
    algorithm, overrides = RUNS[name]
    if algorithm == "opd":
        overrides = {**overrides, "opd.teachers.*": assets / "models" / "qwen3-tiny-seed1"}
    cfg = run_config(assets, tmp_path / name, algorithm, **{
        "model.device": str(FAKE), "train.steps": STEPS, "train.prompts_per_step": 2, "train.micro_batch_size": 2, "rollout.max_new_tokens": 6,
        "eval.every": 2, "eval.prompts_per_domain": 2, "eval.final_prompts_per_domain": 2, "eval.sampled": True,
        **overrides})
    with fake_device(monkeypatch) as seen:
        summary = train(cfg)
    assert summary["final"], "the run evaluated its final model"
    assert seen.violations == [], "\n".join(seen.violations[:20])
    # The update path syncs with the host a bounded number of times per step, not per micro-batch or metric (4
    # micro-batches here); the decoder's per-token syncs (its stop test) are its own and not bounded here.
    update = {site: n for site, n in seen.syncs.items() if site.split(":")[0] in UPDATE_PATH}
    assert all(n <= 2 * STEPS for n in update.values()), update


def test_a_model_loaded_on_the_fake_device_holds_what_the_host_loads(assets, monkeypatch):
    """transformers builds a model on the meta device, which it tells by a new tensor's device, and initialises what
    the checkpoint lacks (RoPE's inv_freq) once the model is off it. A fake device that read meta as the host made
    it initialise on meta, so that buffer kept uninitialised memory: the runs above trained without rotary
    embeddings, or with NaN ones, at random."""
    import torch
    from transformers import AutoModelForCausalLM

    path = assets / "models" / "qwen3-tiny"
    host = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with fake_device(monkeypatch):
        fake = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(FAKE)
    expected = {**dict(host.named_parameters()), **dict(host.named_buffers())}  # non-persistent buffers too
    got = {**dict(fake.named_parameters()), **dict(fake.named_buffers())}
    assert got.keys() == expected.keys()
    assert [name for name in expected if not torch.equal(got[name], expected[name])] == []
