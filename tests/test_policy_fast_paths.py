"""The policy's and the local engine's fast paths give the numbers of the straightforward computation.

HFPolicy projects to the vocabulary only at response positions and drops the attention mask of right-padded
batches; LocalEngine samples by inverse CDF and decodes with a fused step (``megaopd.rollout.decode``). Each is
checked here against the plain form: full-sequence logits with the 2D attention mask, ``token_logprobs`` /
``log_softmax`` over every position and the gradients they give (to 1e-6 in fp32), the sampling distribution itself,
and greedy decoding through HF's own DynamicCache with the 2D mask.
"""

from __future__ import annotations

import copy

import pytest
import torch

from megaopd.data.batch import collate
from megaopd.config import ModelConfig, OPDConfig, OptimConfig
from megaopd.data.rows import load_rows
from megaopd.rollout.decode import FusedDecoder, cache_argument
from megaopd.models.hf_policy import HFPolicy
from megaopd.objectives.losses import OPD, clipped_pg_loss, full_vocab_kl
from megaopd.rollout.local import LocalEngine, sample_tokens
from megaopd.teachers.router import TeacherRouter, local_teachers

ATOL = 1e-6  # fp32


def _rows(assets, k=3):
    return (load_rows(assets / "data" / "arith_add" / "train.jsonl")[0][:k]
            + load_rows(assets / "data" / "prog_trace" / "train.jsonl")[0][:k])  # varied prompt lengths


@pytest.fixture(scope="module")
def rollout(assets):
    policy = HFPolicy(ModelConfig(path=str(assets / "models" / "qwen3-tiny")))
    samples = LocalEngine(policy).generate(_rows(assets), 2, 1.0, 1.0, 9, torch.Generator().manual_seed(0))
    for i, s in enumerate(samples):
        s.reward = float(i % 3)
    # Unequal responses too: drop a few tokens from some samples, so the padding differs per row.
    for s in samples[::3]:
        s.response_ids, s.rollout_logprobs = s.response_ids[:5], s.rollout_logprobs[:5]
    return samples, collate(samples, policy.pad_id)


def _reference_logits(policy: HFPolicy, batch) -> torch.Tensor:
    """The straightforward forward: every position, the 2D attention mask, no cache."""
    return policy.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) at every position, from full-sequence logits."""
    logits = logits[:, :-1].float()
    return logits.gather(-1, input_ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


@pytest.mark.parametrize("preset", ["qwen3-tiny", "llama-tiny"])
def test_logprobs_and_full_logprobs_match_the_full_sequence_computation(assets, rollout, preset):
    samples, batch = rollout
    policy = HFPolicy(ModelConfig(path=str(assets / "models" / preset)))
    assert len({int(m.sum()) for m in batch.attention_mask}) > 1  # really padded
    with torch.no_grad():
        logits = _reference_logits(policy, batch)
    ref_logp = token_logprobs(logits, batch.input_ids) * batch.response_mask
    ref_full = logits[:, :-1].float().log_softmax(-1) * batch.response_mask[..., None]
    for mbs in (64, 5):  # one micro-batch, and several of unequal size
        logp = policy.logprobs(batch, mbs)
        full = policy.full_logprobs(batch, mbs)
        assert logp.shape == batch.response_mask.shape and full.shape == (*batch.response_mask.shape, logits.shape[-1])
        assert torch.allclose(logp, ref_logp, atol=ATOL, rtol=0)
        assert torch.allclose(full, ref_full, atol=ATOL, rtol=0)
        assert bool((full[batch.response_mask == 0] == 0).all())  # documented: zero outside the response


def test_left_padded_batches_keep_their_attention_mask(assets, rollout):
    _, batch = rollout
    policy = HFPolicy(ModelConfig(path=str(assets / "models" / "qwen3-tiny")))
    assert policy._model_inputs(batch)["attention_mask"] is None  # collate right-pads: causal is enough
    left = copy.copy(batch)
    left.attention_mask = batch.attention_mask.flip(-1)
    assert policy._model_inputs(left)["attention_mask"] is not None


def _reference_step(policy: HFPolicy, batch, loss_fn, micro_batch_size: int) -> torch.Tensor:
    """The update as written before the fast paths: full-sequence logits, logprobs and log-softmax everywhere.
    ``loss_fn(logp, full, mb, rows)`` gets the micro-batch's rows of the batch too."""
    policy.optimizer.zero_grad(set_to_none=True)
    total = batch.response_mask.sum()
    loss_sum = torch.zeros(())
    for start in range(0, batch.size, micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        mb = batch.select(rows)
        logits = _reference_logits(policy, mb)
        logp = token_logprobs(logits, mb.input_ids)
        full = logits[:, :-1].float().log_softmax(-1)
        per_token, _ = loss_fn(logp, full, mb, rows)
        loss = (per_token * mb.response_mask).sum() / total
        loss.backward()
        loss_sum += loss.detach()
    return loss_sum


def _grpo_loss(logp, full, mb, rows=None):
    loss, clipped = clipped_pg_loss(logp, mb.old_logprobs, mb.advantages, 0.2, 0.2)
    return loss, {"clip_fraction": clipped}


def _grid_kl_loss(teacher_full: torch.Tensor):
    """The full-vocabulary KL over the whole [b, S-1, V] grid, as the loss was written before the fast paths (the
    objective now gets, and computes on, the response positions only)."""
    def loss(logp, full, mb, rows):
        kl = full_vocab_kl(full, teacher_full[rows], "reverse")
        return kl, {"reverse_kl": kl.detach()}
    return loss


@pytest.mark.parametrize("form", ["grpo", "full_vocab_kl"])
@pytest.mark.parametrize("micro_batch_size", [64, 5])
def test_train_minibatch_matches_the_full_sequence_update(assets, rollout, form, micro_batch_size):
    samples, batch = rollout
    path = str(assets / "models" / "qwen3-tiny")
    policy = HFPolicy(ModelConfig(path=path), OptimConfig(lr=1e-3, grad_clip=1.0))
    batch = copy.copy(batch)
    # Old logprobs a little off the current ones so that the ratio and the clipping are exercised.
    batch.old_logprobs = (batch.rollout_logprobs + 0.3 * torch.randn(batch.rollout_logprobs.shape,
                                                                     generator=torch.Generator().manual_seed(1)))
    batch.old_logprobs *= batch.response_mask
    batch.advantages = torch.linspace(-1, 1, batch.size)[:, None] * batch.response_mask
    if form == "full_vocab_kl":
        teacher_path = str(assets / "models" / "qwen3-tiny-seed1")
        teacher = HFPolicy(ModelConfig(path=teacher_path))
        with torch.no_grad():
            teacher_full = _reference_logits(teacher, batch)[:, :-1].log_softmax(-1)
        # The policy's path: the teacher's rows recomputed per micro-batch and chunk (logit_chunk_rows=7).
        router = TeacherRouter({"*": teacher_path}, local_teachers(ModelConfig(), logit_chunk_rows=7), teacher.tokenizer)
        router.score(batch, samples, "full_vocab", micro_batch_size)
        objective = OPD(OPDConfig(form="full_vocab"), router)
        ref_loss_fn, loss_fn, vocab_term = _grid_kl_loss(teacher_full), objective.token_loss, objective.vocab_term
    else:
        ref_loss_fn, loss_fn, vocab_term = _grpo_loss, _grpo_loss, None
    start = copy.deepcopy(policy.model.state_dict())
    ref_loss = _reference_step(policy, batch, ref_loss_fn, micro_batch_size)
    assert float(ref_loss) != 0
    ref_norm = torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
    ref_grads = {n: p.grad.clone() for n, p in policy.model.named_parameters()}

    fast = HFPolicy(ModelConfig(path=path), OptimConfig(lr=1e-3, grad_clip=1.0), logit_chunk_rows=7)
    fast.model.load_state_dict(start)
    metrics = fast.train_minibatch(batch, loss_fn, micro_batch_size, vocab_term)
    assert abs(metrics["loss"] - float(ref_loss)) < ATOL
    assert abs(metrics["grad_norm"] - float(ref_norm)) < 1e-5 * max(1.0, float(ref_norm))
    for name, param in fast.model.named_parameters():
        # The clipped gradients the optimizer stepped with. (Not the parameters after the step: AdamW's first step
        # is ~ lr * g / (|g| + eps), which turns 1e-9 differences in near-zero gradients into lr-sized ones.)
        assert torch.allclose(param.grad, ref_grads[name], atol=ATOL, rtol=0), name


def test_inverse_cdf_sampling_follows_the_distribution():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.15, 0.05, 0.0]])
    logits = probs.log().expand(20000, -1)
    tokens, logprob = sample_tokens(logits, 1.0, 1.0, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=6).float() / len(tokens)
    assert freq[1] == 0 and freq[5] == 0  # zero-probability tokens are never drawn
    assert torch.allclose(freq, probs[0], atol=0.015)
    assert torch.allclose(logprob, probs[0].log()[tokens], atol=ATOL)
    # Temperature scales before sampling; the logprob is under the sampling distribution.
    tokens, logprob = sample_tokens(logits, 0.5, 1.0, torch.Generator().manual_seed(1))
    tempered = (probs.log() / 0.5).log_softmax(-1)[0]
    freq = torch.bincount(tokens, minlength=6).float() / len(tokens)
    assert torch.allclose(freq, tempered.exp(), atol=0.015)
    assert torch.allclose(logprob, tempered[tokens], atol=ATOL)


@pytest.mark.parametrize("preset", ["qwen3-tiny", "llama-tiny"])
@pytest.mark.parametrize("fused", [True, False])
def test_local_engine_decoding_matches_hf_dynamic_cache_decoding(assets, monkeypatch, preset, fused):
    """Greedy decoding through LocalEngine (shared group prefill, left padding, the fused decode step or the
    model's own forward) gives the tokens and logprobs of a plain per-prompt loop over HF's DynamicCache."""
    from transformers import DynamicCache

    policy = HFPolicy(ModelConfig(path=str(assets / "models" / preset)), OptimConfig(lr=1e-3))  # train mode
    assert FusedDecoder.supports(policy.model)
    steps = []
    if fused:
        step = FusedDecoder.step
        monkeypatch.setattr(FusedDecoder, "step", lambda self, *a: steps.append(a[2]) or step(self, *a))
    else:
        monkeypatch.setattr(FusedDecoder, "supports", classmethod(lambda cls, model: False))
    rows = _rows(assets, 2)
    samples = LocalEngine(policy).generate(rows, 2, 0.0, 1.0, 10, torch.Generator().manual_seed(0))
    assert policy.model.training  # restored after the rollout
    assert bool(steps) == fused
    policy.model.eval()
    for i, row in enumerate(rows):
        ids = torch.tensor([samples[2 * i].prompt_ids])
        cache, mask, out_tokens, out_lp = DynamicCache(), torch.ones_like(ids), [], []
        with torch.no_grad():
            out = policy.model(input_ids=ids, attention_mask=mask, use_cache=True,
                               **cache_argument(policy.model, cache))
            for _ in range(10):
                logits = out.logits[:, -1]
                token = logits.argmax(-1)
                out_tokens.append(int(token))
                out_lp.append(float(logits.log_softmax(-1)[0, token]))
                mask = torch.cat([mask, torch.ones((1, 1), dtype=mask.dtype)], dim=1)
                out = policy.model(input_ids=token[:, None], attention_mask=mask, use_cache=True,
                                   **cache_argument(policy.model, cache))
        for s in samples[2 * i: 2 * i + 2]:
            n = len(s.response_ids)  # the engine stops at EOS; the plain loop runs on
            assert s.response_ids == out_tokens[:n] and (n == 10 or out_tokens[n - 1] == policy.eos_id)
            assert torch.allclose(torch.tensor(s.rollout_logprobs), torch.tensor(out_lp[:n]), atol=1e-5)
    # The chunk's batched tokenisation is chat_prompt_ids of each row.
    from megaopd.models.chat import chat_prompt_ids

    assert [s.prompt_ids for s in samples[::2]] == [chat_prompt_ids(policy.tokenizer, r.prompt) for r in rows]


@pytest.mark.parametrize("fused", [True, False])
def test_the_rollout_cache_reaches_a_forward_that_names_it_past_key_values(assets, monkeypatch, fused):
    """transformers 5.2x names the forward's cache ``cache``; 5.17 (the H200 image's) names it ``past_key_values``
    and takes a ``cache=`` into its kwargs unread, building a cache of its own: the rollout then decoded from an
    empty one (the first H200 run's IndexError in the fused decoder). A model of the older naming must decode the
    tokens the current one does."""
    policy = HFPolicy(ModelConfig(path=str(assets / "models" / "qwen3-tiny")))
    if not fused:
        monkeypatch.setattr(FusedDecoder, "supports", classmethod(lambda cls, model: False))
    rows, greedy = _rows(assets, 2), lambda: torch.Generator().manual_seed(0)
    expected = LocalEngine(policy).generate(rows, 2, 0.0, 1.0, 8, greedy())
    current = type(policy.model)

    class OlderNaming(current):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=None, logits_to_keep=0, **kwargs):
            kwargs.pop("cache", None)  # unread, as 5.17's forward leaves it
            return current.forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                   position_ids=position_ids, cache=past_key_values, use_cache=use_cache,
                                   logits_to_keep=logits_to_keep, **kwargs)

    monkeypatch.setattr(policy.model, "__class__", OlderNaming)
    older = LocalEngine(policy).generate(rows, 2, 0.0, 1.0, 8, greedy())
    assert [s.response_ids for s in older] == [s.response_ids for s in expected]
    assert torch.allclose(torch.tensor([lp for s in older for lp in s.rollout_logprobs]),
                          torch.tensor([lp for s in expected for lp in s.rollout_logprobs]), atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
def test_fused_decode_step_matches_the_model_forward(family):
    """One FusedDecoder step against the model's forward over the same cache, for each family it accepts, with
    biases (Llama ``attention_bias`` / ``mlp_bias``, Qwen2's q/k/v bias), untrained norm weights and left padding."""
    from transformers import (DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    config_cls, model_cls, extra = {
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"tie_word_embeddings": True}),
        "llama": (LlamaConfig, LlamaForCausalLM, {"attention_bias": True, "mlp_bias": True}),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    }[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, intermediate_size=128, vocab_size=128, **extra)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(0.1 * torch.randn_like(param))
    batch, width, new = 3, 7, 5
    ids = torch.randint(0, 128, (batch, width))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        cache = DynamicCache()
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    **cache_argument(model, cache))
        decoder = FusedDecoder(model, cache, width + new)
        additive = torch.zeros((batch, 1, 1, width + new))
        additive[:, 0, 0, :width].masked_fill_(mask == 0, -torch.inf)
        token, position = out.logits[:, -1].argmax(-1), positions[:, -1] + 1
        for t in range(new):
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype)], 1)
            expected = model(input_ids=token[:, None], attention_mask=mask, position_ids=position[:, None],
                             use_cache=True, **cache_argument(model, cache)).logits[:, -1]
            assert torch.allclose(decoder.step(token, position, width + t, additive), expected, atol=1e-5)
            token, position = expected.argmax(-1), position + 1


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
     "original_max_position_embeddings": 16}])
def test_the_fused_decoder_declines_rope_whose_frequencies_follow_the_length(rope):
    """Dynamic NTK and LongRoPE change their frequencies as the sequence grows past the model's original length: the
    fused decoder's one table for the whole generation gave logits 2e-3 (dynamic) and 8e-3 (LongRoPE) from the model's
    own forward over a 40-token decode past a tiny Llama's 16 positions. It declines them; a fixed scaling (yarn) it
    keeps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def model(rope_scaling):
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                                            intermediate_size=128, vocab_size=128, max_position_embeddings=64,
                                            rope_scaling={**rope_scaling, "rope_theta": 10000.0}))
    assert not FusedDecoder.supports(model(rope))
    assert FusedDecoder.supports(model({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}))


def test_micro_batch_without_response_tokens(assets, rollout):
    _, batch = rollout
    empty = copy.copy(batch)
    empty.response_mask = torch.zeros_like(batch.response_mask)
    empty.old_logprobs = empty.advantages = torch.zeros_like(batch.response_mask)
    policy = HFPolicy(ModelConfig(path=str(assets / "models" / "qwen3-tiny")), OptimConfig(lr=1e-3))
    assert bool((policy.logprobs(empty) == 0).all()) and bool((policy.full_logprobs(empty) == 0).all())
    metrics = policy.train_minibatch(empty, _grpo_loss, 4)
    assert metrics["loss"] == 0 and metrics["grad_norm"] == 0
