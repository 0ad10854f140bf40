"""GRPO in one file, without the framework: sample a group of responses per prompt, score them with the verifier,
normalise the rewards within each group, and take one PPO-clipped policy-gradient step.

    python examples/grpo.py --steps 20 --out /tmp/megaopd-examples

megaopd is used only to build the tiny embedded model and synthetic data (``megaopd.models.embedded``) and for the synthetic
domains' exact-answer verifier; sampling, advantages, the loss and the update are written out below in plain PyTorch
and transformers. The framework runs the same algorithm at scale (KV-cache or SGLang rollouts, micro-batching,
Megatron, the FLOP ledger): megaopd/run/trainer.py and megaopd/objectives/losses.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megaopd.models.embedded import build_data, build_model
from megaopd.verifiers.synthetic import score_exact


def load_rows(path: Path) -> list[dict]:
    """The common RL row format: chat ``prompt`` messages and ``reward_model.ground_truth``."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def prompt_ids(tokenizer, row: dict) -> torch.Tensor:
    text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False))


@torch.no_grad()
def sample(model, prompt: torch.Tensor, n: int, max_new_tokens: int, eos_id: int, generator: torch.Generator):
    """n responses to one prompt at temperature 1. No KV cache: the whole sequence is re-run per token (fine at this
    size). Returns tokens [n, T] and the response mask [n, T]: 1 up to and including each row's first EOS."""
    seqs = prompt.repeat(n, 1)
    for _ in range(max_new_tokens):
        probs = model(seqs).logits[:, -1].float().softmax(-1)
        seqs = torch.cat([seqs, torch.multinomial(probs, 1, generator=generator)], 1)
        if (seqs[:, len(prompt):] == eos_id).any(1).all():
            break
    tokens = seqs[:, len(prompt):]
    eos = (tokens == eos_id).int()
    return tokens, (eos.cumsum(1) - eos == 0).float()  # no EOS strictly before this position


def response_logprobs(model, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(response token | everything before it), [n, T] (with grad when enabled)."""
    seqs = torch.cat([prompt.repeat(len(tokens), 1), tokens], 1)
    logits = model(seqs).logits[:, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - group mean) / (group std + eps); all zero when every response scored the same (no signal)."""
    std = rewards.std(unbiased=False)
    return (rewards - rewards.mean()) / (std + eps) if std > 0 else torch.zeros_like(rewards)


def grpo_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                    clip: float = 0.2) -> torch.Tensor:
    """PPO's clipped surrogate per token, -min(ratio * A, clip(ratio) * A), each sample's advantage on its tokens."""
    ratio = (logp - old_logp).exp()
    adv = advantages[:, None]
    return -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)


def rollout(model, tokenizer, rows: list[dict], group: int, max_new_tokens: int, generator) -> list[dict]:
    """One group per prompt: tokens, mask, verifier rewards and the behaviour policy's logprobs."""
    groups = []
    for row in rows:
        prompt = prompt_ids(tokenizer, row)
        tokens, mask = sample(model, prompt, group, max_new_tokens, tokenizer.eos_token_id, generator)
        texts = [tokenizer.decode(t[m.bool()], skip_special_tokens=True) for t, m in zip(tokens, mask)]
        truth = row["reward_model"]["ground_truth"]
        rewards = torch.tensor([score_exact(text, truth, {}) for text in texts])
        with torch.no_grad():
            old = response_logprobs(model, prompt, tokens)
        groups.append({"prompt": prompt, "tokens": tokens, "mask": mask, "rewards": rewards, "old": old})
    return groups


def update(model, optimizer, groups: list[dict], grad_clip: float = 1.0) -> dict[str, float]:
    """One optimizer step on the token mean of the loss over every response token of the step."""
    total = sum(g["mask"].sum() for g in groups)
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for g in groups:  # one backward per group: gradients accumulate, the normaliser is the whole step's count
        logp = response_logprobs(model, g["prompt"], g["tokens"])
        loss = (grpo_token_loss(logp, g["old"], group_advantages(g["rewards"])) * g["mask"]).sum() / total
        loss.backward()
        loss_sum += loss.item()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return {"loss": loss_sum, "grad_norm": float(grad_norm)}


def train(model_dir: Path, data: Path, steps: int, prompts_per_step: int = 4, group: int = 8, lr: float = 1e-3,
          max_new_tokens: int = 16, seed: int = 0) -> list[dict]:
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99))
    rows = load_rows(data)
    history = []
    for step in range(steps):
        batch = [rows[(step * prompts_per_step + i) % len(rows)] for i in range(prompts_per_step)]
        groups = rollout(model, tokenizer, batch, group, max_new_tokens, generator)
        metrics = update(model, optimizer, groups)
        metrics |= {"step": step, "reward": float(torch.cat([g["rewards"] for g in groups]).mean())}
        print(json.dumps(metrics))
        history.append(metrics)
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/examples"), help="where the model and data are built")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--domain", default="arith_add")
    args = parser.parse_args()
    model_dir = args.out / "qwen3-tiny"
    if not (model_dir / "config.json").exists():
        build_model("qwen3-tiny", model_dir, seed=0)
    build_data(args.out / "data", [args.domain], train_rows=200, heldout_rows=20)
    train(model_dir, args.out / "data" / args.domain / "train.jsonl", args.steps)


if __name__ == "__main__":
    main()
