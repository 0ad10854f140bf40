"""The HF-transformers backend: one process, CPU or one GPU, any HF causal-LM directory.

A policy owns a model, its tokenizer and (when trainable) its optimizer. The trainer talks to it through four
calls: ``logprobs`` / ``full_logprobs`` (no grad, micro-batched), ``train_minibatch`` (forward, backward and
one optimizer step over micro-batches with a token-mean loss) and ``save_hf``. The Megatron backend implements
the same calls.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch

from megaopd.batch import TokenBatch
from megaopd.config import ModelConfig, OptimConfig
from megaopd.flops import ModelShape

# (logprobs [b, S-1], full log-softmax [b, S-1, V] or None, micro-batch) -> (per-token loss, per-token metrics)
TokenLossFn = Callable[[torch.Tensor, torch.Tensor | None, TokenBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Prompt tokens through the tokenizer's own chat template, ending with the assistant header."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) for every position, without materialising the full log-softmax twice."""
    logits = logits[:, :-1].float()
    targets = input_ids[:, 1:].unsqueeze(-1)
    return logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)


class HFPolicy:
    def __init__(self, cfg: ModelConfig, optim: OptimConfig | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not (Path(cfg.path) / "config.json").exists():
            raise FileNotFoundError(f"model.path={cfg.path!r} is not an HF model directory (no config.json)")
        self.device = torch.device(cfg.device)
        self.model = AutoModelForCausalLM.from_pretrained(
            cfg.path, dtype=getattr(torch, cfg.dtype), attn_implementation="sdpa").to(self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.path)
        self.shape = ModelShape.from_hf_config(self.model.config)
        self.path = cfg.path
        self.optimizer = self.scheduler = None
        self.grad_clip = 0.0
        if optim is None:
            self.model.eval().requires_grad_(False)
        else:
            self.model.train()
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, betas=tuple(optim.betas),
                                               weight_decay=optim.weight_decay)
            warmup = max(optim.warmup_steps, 0)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
            self.grad_clip = optim.grad_clip

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    def _logits(self, batch: TokenBatch) -> torch.Tensor:
        return self.model(input_ids=batch.input_ids.to(self.device),
                          attention_mask=batch.attention_mask.to(self.device)).logits

    def _micro_batches(self, batch: TokenBatch, micro_batch_size: int):
        for start in range(0, batch.size, micro_batch_size):
            yield batch.select(slice(start, start + micro_batch_size))

    @torch.no_grad()
    def logprobs(self, batch: TokenBatch, micro_batch_size: int = 64) -> torch.Tensor:
        """Per-token logprob of each realised token, [B, S-1], masked to the response."""
        parts = [token_logprobs(self._logits(mb), mb.input_ids.to(self.device)).cpu() * mb.response_mask
                 for mb in self._micro_batches(batch, micro_batch_size)]
        return torch.cat(parts)

    @torch.no_grad()
    def full_logprobs(self, batch: TokenBatch, micro_batch_size: int = 64) -> torch.Tensor:
        """Log-softmax over the vocabulary at every target position, [B, S-1, V]."""
        return torch.cat([self._logits(mb)[:, :-1].float().log_softmax(-1).cpu()
                          for mb in self._micro_batches(batch, micro_batch_size)])

    def train_minibatch(self, batch: TokenBatch, loss_fn: TokenLossFn, micro_batch_size: int,
                        full_vocab: bool = False) -> dict[str, float]:
        """One optimizer step on `batch`: token-mean loss over all its response tokens, whatever the micro-batching.

        Each micro-batch's summed token loss is divided by the token count of the whole minibatch, so gradient
        accumulation gives the same gradient as one big batch (the recurring TRL / verl aggregation bug).
        """
        assert self.optimizer is not None, "this policy was built frozen (no optimizer)"
        total_tokens = batch.response_mask.sum().clamp(min=1.0)
        sums: dict[str, float] = {}
        self.optimizer.zero_grad(set_to_none=True)
        for mb in self._micro_batches(batch, micro_batch_size):
            logits = self._logits(mb)
            mask = mb.response_mask.to(self.device)
            logp = token_logprobs(logits, mb.input_ids.to(self.device))
            full = logits[:, :-1].float().log_softmax(-1) if full_vocab else None
            per_token, metrics = loss_fn(logp, full, mb)
            loss = (per_token * mask).sum() / total_tokens
            loss.backward()
            for name, value in {"loss": per_token, **metrics}.items():
                sums[name] = sums.get(name, 0.0) + float((value.detach() * mask).sum() / total_tokens)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip or math.inf)
        self.optimizer.step()
        self.scheduler.step()
        return {**sums, "grad_norm": float(grad_norm), "lr": self.scheduler.get_last_lr()[0]}

    def state_dict(self) -> dict:
        state = {"model": self.model.state_dict()}
        if self.optimizer is not None:
            state |= {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])

    def save_hf(self, out_dir: str | Path) -> None:
        self.model.save_pretrained(out_dir)
        self.tokenizer.save_pretrained(out_dir)
