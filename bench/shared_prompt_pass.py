"""One GRPO update pass with shared prompts on and off, at any shape, on any device: what forwarding a group's prompt
once buys where prompts are long (issue 44; the step benches measure it at 36-token prompts on CPU).

    python bench/shared_prompt_pass.py                      # CPU, qwen3-tiny, 2 groups of 8, prompts 256, responses 64
    python bench/shared_prompt_pass.py --preset qwen3-0.6b --device cuda --dtype bfloat16 \\
        --prompt 2048 --response 512 --groups 2 --group 8   # a GPU, a real width (random weights)
    python bench/shared_prompt_pass.py --smoke              # CI: tiny, times nothing

Both sides are HFPolicy on the same random-initialised model (megaopd.models.embedded.build_model: a tiny preset or a real
shape such as qwen3-0.6b); the batch is G groups of n random responses to random prompts, lengths cut by up to an
eighth per prompt and per response so that rows pad. A pass is ``train_minibatch`` with the GRPO loss in one
micro-batch at lr 0 (the weights stay, so every timed pass does the same work), alternated shared / unshared.
Printed per side: the median pass, peak device memory, and the work executed against the ledger's billed FLOPs
(docs/flops.md, "Shared work"); then the speed-up and the largest |logprob| difference between the sides at this
size and dtype (the exactness tests/test_shared_prompt.py asserts in fp32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaopd.data.batch import Sample, collate  # noqa: E402
from megaopd.config import GRPOConfig, ModelConfig, OptimConfig  # noqa: E402
from megaopd.models.embedded import build_model  # noqa: E402
from megaopd.accounting.flops import scoring_flops  # noqa: E402
from megaopd.models.hf_policy import HFPolicy  # noqa: E402
from megaopd.objectives.losses import GRPO  # noqa: E402


def random_batch(groups: int, n: int, prompt: int, response: int, vocab: int, pad_id: int, seed: int):
    """G groups of n samples: random prompt and response tokens (never the pad id), each length cut by up to 1/8."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(length: int) -> list[int]:
        cut = int(torch.randint(0, max(length // 8, 1), (1,), generator=gen))
        ids = torch.randint(0, vocab - 1, (length - cut,), generator=gen)
        return (ids + (ids >= pad_id).long()).tolist()  # skip the pad id

    samples = []
    for g in range(groups):
        prompt_ids = tokens(prompt)
        for _ in range(n):
            response_ids = tokens(response)
            samples.append(Sample(row=None, group=g, prompt_ids=prompt_ids, response_ids=response_ids,
                                  rollout_logprobs=[0.0] * len(response_ids), finish_reason="length",
                                  weight_version=0))
    batch = collate(samples, pad_id)
    batch.advantages = torch.randn(batch.size, 1, generator=gen).sign() * batch.response_mask
    return samples, batch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-tiny", help="a tiny preset or a real shape (megaopd.accounting.shapes)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens (before the cut)")
    p.add_argument("--response", type=int, default=64, help="response tokens (before the cut)")
    p.add_argument("--passes", type=int, default=5, help="timed passes per side, after one warm-up each")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing on both sides")
    p.add_argument("--out", default="", help="also write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny, one pass: checks the script runs (CI)")
    a = p.parse_args(argv)
    if a.smoke:
        a.groups, a.group, a.prompt, a.response, a.passes = 2, 3, 24, 8, 1
    torch.set_num_threads(a.threads)

    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(a.preset, Path(tmp) / a.preset)
        cfg = ModelConfig(path=str(path), dtype=a.dtype, device=a.device,
                          activation_checkpointing=a.checkpointing)
        sides = {name: HFPolicy(cfg, OptimConfig(lr=0.0, grad_clip=1.0), shared_prompt=shared)
                 for name, shared in (("unshared", False), ("shared", True))}
    sides["shared"].model.load_state_dict(sides["unshared"].model.state_dict())
    plain = sides["unshared"]
    vocab = min(plain.model.config.vocab_size, len(plain.tokenizer))
    samples, batch = random_batch(a.groups, a.group, a.prompt, a.response, vocab, plain.pad_id, seed=0)
    mbs = batch.size
    loss = GRPO(GRPOConfig(), a.group).token_loss  # the trainer's clipped surrogate, its defaults

    logprobs = {name: policy.logprobs(batch, mbs) for name, policy in sides.items()}
    batch.old_logprobs = logprobs["unshared"]
    gap = float(((logprobs["shared"] - logprobs["unshared"]).abs() * batch.response_mask).max())

    shape = plain.shape
    in_group = [samples[g * a.group:(g + 1) * a.group] for g in range(a.groups)]
    groups = [(len(group[0].prompt_ids), [len(s.response_ids) for s in group]) for group in in_group]
    billed = sum(3 * scoring_flops(shape, [prompt], responses, len(responses)) for prompt, responses in groups)
    times = {name: [] for name in sides}
    peak = {}
    for policy in sides.values():
        policy.take_prompt_saving()
    for i in range(a.passes + 1):  # the first pass of each side warms up
        for name, policy in sides.items():
            if a.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            sync(a.device)
            start = time.perf_counter()
            policy.train_minibatch(batch, loss, mbs)
            sync(a.device)
            if i:
                times[name].append(time.perf_counter() - start)
            if a.device.startswith("cuda"):
                peak[name] = torch.cuda.max_memory_allocated() / 2**30
    saved = sides["shared"].take_prompt_saving() / (a.passes + 1)
    median = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "preset": a.preset, "device": a.device, "dtype": a.dtype, "groups": a.groups, "group": a.group,
        "prompt_tokens": [g[0] for g in groups], "response_tokens_mean": sum(len(s.response_ids) for s in samples) /
        len(samples), "passes": a.passes, "median_s": median, "peak_gib": peak or None,
        "billed_flops": billed, "executed_flops": {"unshared": billed, "shared": billed - saved},
        "speedup": median["unshared"] / median["shared"], "executed_share": (billed - saved) / billed,
        "max_logprob_gap": gap,
    }
    print(f"# one GRPO update pass, {a.preset} {a.dtype} on {a.device}: {a.groups} groups x {a.group} samples, prompts "
          f"{result['prompt_tokens']} tokens, responses {result['response_tokens_mean']:.0f} on average, one "
          f"micro-batch, median of {a.passes}")
    print("| | unshared | shared |\n|---|---|---|")
    print(f"| pass (s) | {median['unshared']:.4f} | {median['shared']:.4f} |")
    print(f"| executed / billed FLOPs | 1.000 | {result['executed_share']:.3f} |")
    if peak:
        print(f"| peak device memory (GiB) | {peak['unshared']:.2f} | {peak['shared']:.2f} |")
    print(f"speed-up {result['speedup']:.2f}x; largest |logprob| difference {gap:.2e}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
