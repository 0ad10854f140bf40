"""On-policy distillation in one file, without the framework: the student samples responses, a frozen teacher
scores every position of them, and the student takes a step down the reverse KL(student || teacher) summed over
the vocabulary at each of its own tokens (the full-vocabulary form; docs/opd.md).

    python examples/opd.py --steps 20 --out /tmp/megaopd-examples

megaopd is used only to build the tiny embedded models and synthetic data (``megaopd.models.embedded``): the teacher here is
the same architecture from another seed, which is enough to watch the KL fall. Sampling, the teacher's forward, the
loss and the update are written out below in plain PyTorch and transformers; the framework's version (teacher
routing per domain, top-k and sampled-token forms, chunked vocabulary projection, SGLang teachers) is in
megaopd/objectives/losses.py and megaopd/teachers/router.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megaopd.models.embedded import build_data, build_model


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


def response_log_softmax(model, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The model's log-softmax over the vocabulary at each response position, [n, T, V] (with grad when enabled)."""
    seqs = torch.cat([prompt.repeat(len(tokens), 1), tokens], 1)
    return model(seqs).logits[:, len(prompt) - 1:-1].float().log_softmax(-1)


def reverse_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """KL(student || teacher) per position from two log-softmaxes [..., V]: sum_v p_s(v) (log p_s(v) - log p_t(v))."""
    return (student.exp() * (student - teacher)).sum(-1)


def update(student, teacher, optimizer, rollouts: list[dict], grad_clip: float = 1.0) -> dict[str, float]:
    """One optimizer step on the token mean of the KL over every response token of the step. The gradient flows
    through the student's whole distribution at each position; the sampled tokens only choose the positions."""
    total = sum(r["mask"].sum() for r in rollouts)
    optimizer.zero_grad(set_to_none=True)
    kl_sum = 0.0
    for r in rollouts:
        with torch.no_grad():
            teacher_lp = response_log_softmax(teacher, r["prompt"], r["tokens"])
        kl = reverse_kl(response_log_softmax(student, r["prompt"], r["tokens"]), teacher_lp)
        loss = (kl * r["mask"]).sum() / total
        loss.backward()
        kl_sum += loss.item()
    grad_norm = torch.nn.utils.clip_grad_norm_(student.parameters(), grad_clip)
    optimizer.step()
    return {"kl": kl_sum, "grad_norm": float(grad_norm)}


def train(student_dir: Path, teacher_dir: Path, data: Path, steps: int, prompts_per_step: int = 4, samples: int = 2,
          lr: float = 1e-3, max_new_tokens: int = 16, seed: int = 0) -> list[dict]:
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(student_dir)  # OPD needs one tokenizer: the teacher scores our tokens
    optimizer = torch.optim.AdamW(student.parameters(), lr=lr, betas=(0.9, 0.99))
    rows = load_rows(data)
    history = []
    for step in range(steps):
        rollouts = []
        for i in range(prompts_per_step):
            prompt = prompt_ids(tokenizer, rows[(step * prompts_per_step + i) % len(rows)])
            tokens, mask = sample(student, prompt, samples, max_new_tokens, tokenizer.eos_token_id, generator)
            rollouts.append({"prompt": prompt, "tokens": tokens, "mask": mask})
        metrics = update(student, teacher, optimizer, rollouts) | {"step": step}
        print(json.dumps(metrics))
        history.append(metrics)
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/examples"), help="where the models and data are built")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--domain", default="arith_add")
    args = parser.parse_args()
    for name, seed in (("qwen3-tiny", 0), ("qwen3-tiny-teacher", 1)):
        if not (args.out / name / "config.json").exists():
            build_model("qwen3-tiny", args.out / name, seed=seed)
    build_data(args.out / "data", [args.domain], train_rows=200, heldout_rows=20)
    train(args.out / "qwen3-tiny", args.out / "qwen3-tiny-teacher", args.out / "data" / args.domain / "train.jsonl",
          args.steps)


if __name__ == "__main__":
    main()
