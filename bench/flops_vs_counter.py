"""Analytic FLOPs (megaopd.accounting.flops, the ledger's formulas) vs torch.utils.flop_counter.FlopCounterMode, per model family.

    python bench/flops_vs_counter.py          # every embedded preset
    python bench/flops_vs_counter.py --smoke  # CI: one preset, short sequences

FlopCounterMode counts matmuls only (as the ledger does) but it sees what is executed: eager attention is two dense
S x S matmuls, so the comparison uses the analytic ``causal=False`` form (the ledger itself bills the causal 1/2
discount), and SDPA on CPU is counted as 0, so the models here run with attn_implementation="eager".
Rows:
* forward / forward+backward: teacher-forced batch of random tokens, vs forward_flops / train_flops (causal=False);
* generate (KV cache): prefill (logits at the last prompt position) + R-1 single-token decode steps with a
  DynamicCache, vs generation_flops;
* LocalEngine group: megaopd's own sampler on 1 prompt x n samples (prefill once, cache shared by the group, the
  fused decode step), vs generation_flops(prefix_cached=True) with the real prompt and response lengths;
* trainer steps: one real GRPO step (with reference KL; and with train.shared_prompt, the group's prompt forwarded
  once: vs the shared passes' formula, where the ledger bills the unshared ones) and one full-vocabulary OPD step
  through ``Trainer.rl_step``, each component's calls counted on their own and the whole step under one counter
  (``megaopd.run.flop_audit``), vs the ledger's components for that step and their sum.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from megaopd.rollout.decode import cache_argument  # noqa: E402
from megaopd.accounting.flops import ModelShape, forward_flops, generation_flops, train_flops  # noqa: E402


def measure(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def rows_for(preset: str, model_dir: Path, batch: int, seq: int, gen_p: int, gen_r: int, group: int) -> list[tuple]:
    from transformers import AutoModelForCausalLM, DynamicCache

    from megaopd.config import ModelConfig
    from megaopd.data.rows import Row
    from megaopd.models.hf_policy import HFPolicy
    from megaopd.rollout.local import LocalEngine

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    shape = ModelShape.from_hf_config(model.config)
    vocab = shape.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    out = []

    def fwd():
        with torch.no_grad():
            model(ids)

    out.append((preset, f"forward {batch}x{seq}", measure(fwd), batch * forward_flops(shape, seq, causal=False)))

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    out.append((preset, f"forward+backward {batch}x{seq}", measure(fwd_bwd), batch * train_flops(shape, seq, causal=False)))

    prompts = torch.randint(0, vocab, (batch, gen_p), generator=gen)
    def generate():
        with torch.no_grad():
            cache = cache_argument(model, DynamicCache(config=model.config))
            o = model(prompts, **cache, use_cache=True, logits_to_keep=1)
            tok = o.logits[:, -1:].argmax(-1)
            for _ in range(gen_r - 1):  # the last token is sampled, never fed back
                o = model(tok, **cache, use_cache=True)
                tok = o.logits[:, -1:].argmax(-1)

    out.append((preset, f"generate (KV cache) {batch}x(P={gen_p}, R={gen_r})", measure(generate),
                batch * generation_flops(shape, gen_p, gen_r, samples=1, causal=False)))

    # megaopd's sampler, attention switched to eager so that the counter sees it
    policy = HFPolicy(ModelConfig(path=str(model_dir)))
    policy.model.set_attn_implementation("eager")
    engine = LocalEngine(policy)
    row = Row("arith_add", [{"role": "user", "content": "What is 12 + 30? Answer with the number." * 2}], "42")
    samples = []
    measured = measure(lambda: samples.extend(engine.generate([row], group, 1.0, 1.0, gen_r, gen)))
    p = len(samples[0].prompt_ids)
    lens = [len(s.response_ids) for s in samples]
    out.append((preset, f"LocalEngine 1 prompt x {group} (P={p}, R={lens[0]}), as the ledger books it", measured,
                generation_flops(shape, p, lens, prefix_cached=True, causal=False)))
    return out


def trainer_rows(preset: str, model_dir: Path, teacher_dir: Path, data: Path, run_dir: Path, group: int,
                 max_new: int) -> list[tuple]:
    from megaopd.config import load_config
    from megaopd.run.flop_audit import audit_step

    out = []
    for name, algorithm, extra in [("grpo", "grpo", ["grpo.kl_coef=0.01"]),
                                   ("grpo shared-prompt", "grpo", ["grpo.kl_coef=0.01", "train.shared_prompt=true"]),
                                   ("opd", "opd", [f"opd.teachers.*={teacher_dir}", "opd.form=full_vocab"])]:
        cfg = load_config(None, [
            f"run_dir={run_dir / name.replace(' ', '_')}", f"model.path={model_dir}", f"train.algorithm={algorithm}",
            f"data.train=[{data / 'arith_add' / 'train.jsonl'}]", f"data.eval=[{data / 'arith_add' / 'test.jsonl'}]",
            "train.prompts_per_step=1", f"rollout.samples_per_prompt={group}", f"rollout.max_new_tokens={max_new}",
            "train.recompute_old_logprobs=true", *extra])
        audit = audit_step(cfg)
        for component, row in audit.items():
            if row.executed_form:
                # the analytic side: the billed passes plus the teacher's recomputation (hardware work)
                out.append((preset, f"{name} step ({group} x R={max_new}): {component}", row.measured,
                            row.executed_form + row.recomputed))
        # one counter over the whole step: a pass outside every component's calls shows here
        out.append((preset, f"{name} step ({group} x R={max_new}): whole step", audit.measured, audit.executed))
    return out


def main(argv: list[str]) -> None:
    from common import machine

    from megaopd.models.embedded import PRESETS, build_data, build_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--presets", nargs="*", default=sorted(PRESETS))
    a = p.parse_args(argv)
    batch, seq, gen_p, gen_r, group = (2, 64, 24, 16, 4)
    if a.smoke:
        a.presets, batch, seq, gen_p, gen_r, group = ["qwen3-tiny"], 1, 16, 8, 4, 2
    torch.set_num_threads(1)
    print(f"# Analytic FLOPs vs FlopCounterMode\n\nmachine: {machine()}\n")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_flops_") as tmp:
        tmp = Path(tmp)
        build_data(tmp / "data", ["arith_add"], train_rows=20, heldout_rows=4)
        for preset in a.presets:
            model_dir = build_model(preset, tmp / preset)
            rows += rows_for(preset, model_dir, batch, seq, gen_p, gen_r, group)
            # OPD's teacher: the next size of the family where there is one (same embedded tokenizer)
            teacher_preset = {"qwen3-tiny": "qwen3-small", "llama-tiny": "llama-small"}.get(preset, preset)
            teacher = build_model(teacher_preset, tmp / f"{preset}-teacher", seed=1)
            rows += trainer_rows(preset, model_dir, teacher, tmp / "data", tmp / f"runs-{preset}", group, gen_r)
    print("| model | measurement | FlopCounterMode | analytic (causal=False) | measured / analytic |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for preset, what, measured, analytic in rows:
        ratio = measured / analytic
        worst = max(worst, abs(ratio - 1))
        print(f"| {preset} | {what} | {measured:.4e} | {analytic:.4e} | {ratio:.5f} |")
    print(f"\nlargest deviation: {worst:.3%} (goal: within 2%)")


if __name__ == "__main__":
    main(sys.argv[1:])
