"""Rollout throughput: megaopd's LocalEngine vs HF ``model.generate`` on the same model, batch and lengths.

    python bench/rollout_throughput.py          # 7 alternating A/B rounds per setting, 1 thread
    python bench/rollout_throughput.py --smoke  # CI: one tiny round

Both sample at temperature 1, top_p 1 (HF: do_sample=True, top_k=0) from the same fixed-length benchmark model (its EOS
id is outside the vocabulary, so every sample is exactly --max-new tokens) with SDPA attention, in the same process,
alternating LocalEngine / HF call by call. HF generate runs on the left-padded prompts with num_return_sequences=n
(it prefills every copy of a prompt); LocalEngine prefills each prompt once and shares its KV cache across the group.
The "n=1" setting has no group, so it isolates the per-token loop overhead from the prefix sharing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import DEFAULT_ASSETS, machine, prepare_assets, spread, train_files  # noqa: E402

from megaopd.config import ModelConfig  # noqa: E402
from megaopd.data.rows import load_rows  # noqa: E402
from megaopd.models.chat import chat_prompt_ids  # noqa: E402
from megaopd.models.hf_policy import HFPolicy  # noqa: E402
from megaopd.rollout.local import LocalEngine  # noqa: E402


def hf_generate(policy: HFPolicy, rows, n: int, max_new: int, gen_seed: int) -> int:
    tok = policy.tokenizer
    prompts = [chat_prompt_ids(tok, r.prompt) for r in rows]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), policy.pad_id)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    torch.manual_seed(gen_seed)
    with torch.no_grad():
        out = policy.model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                                    top_k=0, max_new_tokens=max_new, num_return_sequences=n,
                                    eos_token_id=policy.eos_id, pad_token_id=policy.pad_id)
    return int(out[:, width:].numel())


def local_generate(engine: LocalEngine, rows, n: int, max_new: int, gen_seed: int) -> int:
    samples = engine.generate(rows, n, 1.0, 1.0, max_new, torch.Generator().manual_seed(gen_seed))
    return sum(len(s.response_ids) for s in samples)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--model", default="qwen3-tiny")
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--assets", default=str(DEFAULT_ASSETS))
    a = p.parse_args(argv)
    settings = [(16, 8), (64, 1)]  # (prompts, samples per prompt): 128 and 64 sequences
    if a.smoke:
        a.rounds, a.max_new, settings = 1, 4, [(2, 2)]
    torch.set_num_threads(a.threads)
    assets = prepare_assets(Path(a.assets), (a.model,), rows=64 if a.smoke else 512)
    policy = HFPolicy(ModelConfig(path=str(assets / "models" / a.model)))
    policy.model.eval()
    engine = LocalEngine(policy)
    rows = load_rows(train_files(assets)[0], False)[0]
    print(f"# Rollout throughput: LocalEngine vs HF generate\n\nmachine: {machine()}\n")
    print(f"model {a.model}, {a.max_new} new tokens per sample (fixed length), {a.threads} thread(s), "
          f"{a.rounds} alternating rounds per setting\n")
    print("| prompts x samples | tokens per call (local / HF) | LocalEngine tok/s | HF generate tok/s | "
          "ratio local/HF (median, spread) |")
    print("|---|---|---|---|---|")
    for prompts, n in settings:
        batch = rows[:prompts]
        local_generate(engine, batch, n, 2, 0)  # warm-up both paths
        hf_generate(policy, batch, n, 2, 0)
        loc, hf, ratios, counts = [], [], [], set()
        for r in range(a.rounds):
            order = ("local", "hf") if r % 2 == 0 else ("hf", "local")
            rates = {}
            for side in order:
                t0 = time.perf_counter()
                tokens = (local_generate(engine, batch, n, a.max_new, r) if side == "local"
                          else hf_generate(policy, batch, n, a.max_new, r))
                rates[side] = tokens / (time.perf_counter() - t0)
                counts.add((side, tokens))
            loc.append(rates["local"])
            hf.append(rates["hf"])
            ratios.append(rates["local"] / rates["hf"])
        tok = "/".join(str(t) for s in ("local", "hf") for side, t in sorted(counts) if side == s)
        print(f"| {prompts} x {n} | {tok} | {statistics.median(loc):.0f} | {statistics.median(hf):.0f} | "
              f"**{statistics.median(ratios):.2f}x** ({spread(ratios)}) |")


if __name__ == "__main__":
    main(sys.argv[1:])
