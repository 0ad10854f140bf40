"""How much token-level truncated IS changes a one-step-off-policy GRPO step (docs/serving.md, "Accuracy at K=1 and
the default correction"): a stage's config runs at rollout.max_staleness=1 without the correction, with a checkpoint
after every step; at each checkpoint s the batch generated ahead (by the weights before step s) is the one step s+1
trains on, and its gradient is taken at the checkpoint's weights with and without the IS weights (no update).

    megaopd study configs/studies/async_expert.yaml "seeds=[1]"    # or any GRPO stage's config.yaml
    python bench/stale_gradient.py runs/async_expert/seed_1/expert_add_k1/config.yaml --at 1,2,3,5,8
    python bench/stale_gradient.py --smoke   # CI: the embedded GRPO config on the bench's tiny assets, one step

Per step: the weights' spread (mean |log w| over the response tokens, and over those the sampling weights gave
p < 0.9), and |g_tis - g_none| / |g_none| with the cosine between the two gradients.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import DEFAULT_ASSETS, REPO, prepare_assets, train_files  # noqa: E402

from megaopd.run import allocator  # noqa: E402
from megaopd.data.batch import collate  # noqa: E402
from megaopd.config import load_config  # noqa: E402
from megaopd.run.evaluate import score_samples  # noqa: E402
from megaopd.run.trainer import Trainer, train  # noqa: E402


def gradient(trainer: Trainer, batch, weights) -> torch.Tensor:
    """The step's flattened gradient with these IS weights (None: uncorrected), the weights left as they are."""
    policy, grads = trainer.policy, []

    def keep() -> torch.Tensor:  # stands in for the optimizer step
        grads.append(torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None]))
        return grads[-1].norm()
    policy._optimizer_step = keep
    batch.is_weights = weights
    policy.train_minibatch(batch, trainer.objective.token_loss, trainer.cfg.train.micro_batch_size)
    return grads[-1]


def measure(config: str, overrides: list[str], run: Path, step: int, work: Path) -> str:
    """The stats of step `step` + 1, from a copy of the run resumed at checkpoint `step`."""
    name = f"step_{step:07d}"
    resumed = work / name
    shutil.copytree(run / "checkpoints" / name, resumed / "checkpoints" / name)
    trainer = Trainer(load_config(config, overrides + [f"run_dir={resumed}", "rollout.max_staleness=1",
                                                       "train.tis=token"]))
    samples = trainer.rollouts.take(step + 1).samples
    score_samples(trainer.policy.tokenizer, samples)
    batch = collate(samples, trainer.policy.pad_id)
    correction = trainer.score_old_logprobs(batch)  # train.tis=token: never None
    trainer.objective.prepare(batch, samples)
    response = batch.response_mask.bool()
    log_w = (batch.sampling_logprobs - batch.rollout_logprobs)[response].abs()
    unsure = batch.rollout_logprobs[response].exp() < 0.9
    plain, weighted = gradient(trainer, batch, None), gradient(trainer, batch, correction.weights)
    trainer.close()
    change = (f"{(weighted - plain).norm() / plain.norm():.3f} | "
              f"{torch.nn.functional.cosine_similarity(weighted, plain, dim=0):.4f}" if plain.norm() > 0 else
              "- | - (every group's rewards equal: no gradient)")
    return (f"| {step + 1} | {samples[0].weight_version} | {log_w.mean():.4f} | {unsure.float().mean():.1%} | "
            f"{log_w[unsure].mean():.3f} | {change} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", help="a GRPO stage's config (YAML); its model, data and seed")
    p.add_argument("--at", default="1,2,3,5,8", help="checkpoints to measure at, comma-separated (step s: step s+1)")
    p.add_argument("--smoke", action="store_true", help="the embedded GRPO config on tiny assets, at step 1")
    p.add_argument("--assets", default=str(DEFAULT_ASSETS), help="with --smoke: where the tiny assets are built")
    args = p.parse_args()
    config, overrides, at = args.config, [], sorted(int(s) for s in args.at.split(","))
    if args.smoke:
        assets = prepare_assets(Path(args.assets), ("qwen3-tiny",), rows=64)
        config, at = str(REPO / "configs/embedded/grpo.yaml"), [1]
        overrides = [f"model.path={assets / 'models/qwen3-tiny'}", f"data.train=[{','.join(train_files(assets))}]",
                     f"data.eval=[{train_files(assets)[0]}]", "train.prompts_per_step=2", "rollout.max_new_tokens=8"]
    elif not config:
        p.error("give a stage's config (or --smoke)")
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cfg = load_config(config, overrides + [
            f"run_dir={run}", "rollout.max_staleness=1", "train.tis=none", f"train.steps={at[-1] + 1}",
            "checkpoint.every=1", f"checkpoint.keep={at[-1] + 1}", f"eval.every={at[-1] + 2}",
            "eval.prompts_per_domain=1", "eval.final_prompts_per_domain=1"])
        allocator.keep_heap_for([cfg.model.device])  # this process's trainers, the run's and measure's
        train(cfg)
        print("| step | sampled by | mean abs log w | p < 0.9 | mean abs log w there | grad change | cosine |")
        print("|---|---|---|---|---|---|---|")
        for step in at:
            print(measure(config, overrides, run, step, Path(tmp)))


if __name__ == "__main__":
    main()
