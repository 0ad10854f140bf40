"""megaopd.models.distributions against their definitions, written out token by token on random distributions: the
nucleus is the smallest set of most likely tokens whose mass reaches top_p, renormalised; the top-k view is the K
most likely tokens and the log of the mass left outside them."""

from __future__ import annotations

import math

import pytest
import torch

from megaopd.models.distributions import nucleus, topk_tail, topk_view


def random_logprobs(rows: int = 64, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * 2).log_softmax(-1)


def nucleus_by_hand(row: list[float], top_p: float) -> set[int]:
    kept, mass = set(), 0.0
    for token in sorted(range(len(row)), key=lambda t: -row[t]):
        kept.add(token)
        mass += math.exp(row[token])
        if mass >= top_p:
            return kept
    return kept


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.7, 0.95, 1.0])
def test_the_nucleus_is_the_smallest_top_set_reaching_top_p(top_p):
    logprobs = random_logprobs()
    cut = nucleus(logprobs, top_p)
    for row, out in zip(logprobs.tolist(), cut):
        kept = nucleus_by_hand(row, top_p)
        assert set(torch.isfinite(out).nonzero().flatten().tolist()) == kept
        mass = sum(math.exp(row[t]) for t in kept)
        for token in kept:
            assert out[token].item() == pytest.approx(row[token] - math.log(mass), abs=1e-12)


def test_the_top_k_view_and_its_tail():
    logprobs = random_logprobs(vocab=30)
    for k in (1, 5, 29, 30):
        top, ids, tail = topk_view(logprobs, k)
        for row, row_top, row_ids, row_tail in zip(logprobs.tolist(), top, ids, tail):
            best = sorted(range(len(row)), key=lambda t: -row[t])[:k]
            assert row_ids.tolist() == best and row_top.tolist() == [row[t] for t in best]
            outside = sum(math.exp(row[t]) for t in range(len(row)) if t not in best)
            assert row_tail.item() == (pytest.approx(math.log(outside), abs=1e-9) if outside else -math.inf)
        if k < 30:  # a server answers the K values only: the same tail from them alone (float32 out)
            assert torch.allclose(topk_tail(top), tail.float(), rtol=1e-5, atol=1e-5)
