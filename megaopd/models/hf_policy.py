"""The HF-transformers backend: one process, CPU or one GPU, any HF causal-LM directory.

A policy owns a model, its tokenizer and (when trainable) its optimizer. The trainer talks to it through
``logprobs`` (no grad, micro-batched), ``train_minibatch`` (forward, backward and one optimizer step over
micro-batches with a token-mean loss) and ``save_hf``; a teacher also through ``topk_logprobs``, ``scored_rows``
and ``full_rows``.
The Megatron backend implements the same calls.

Memory: only the response rows are projected to the vocabulary, ``logit_chunk_rows`` rows at a time (checkpointed
per chunk in the update), so no [rows x V] float32 tensor exceeds one chunk (docs/opd.md).

With ``shared_prompt`` every call forwards a group's prompt once (``megaopd.models.shared_prompt``, the attention
``megaopd.models.hf_shared_prompt``): the same values and gradients, less work; ``take_prompt_saving`` says how much.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from megaopd.data.batch import TokenBatch
from megaopd.config import ConfigError, ModelConfig, OptimConfig
from megaopd.errors import ModelError
from megaopd.accounting.flops import HF_CONFIG, ModelShape
from megaopd.models.policy_protocol import TokenizerIds
from megaopd.models.distributions import TAIL_FLOOR, WholeVocab, entropy, nucleus, topk_view
from megaopd.models.hf_shared_prompt import hf_attention, hf_attention_problem
from megaopd.models.shared_prompt import PromptGroups, group_rows, saved_flops

# (logprobs [b, S-1], the vocab term per position [b, S-1] (e.g. the KL to the teacher) or None, micro-batch)
#  -> (per-token loss [b, S-1], per-token metrics)
TokenLossFn = Callable[[torch.Tensor, torch.Tensor | None, TokenBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def sampling_logprobs(logits: torch.Tensor, top_p: float = 1.0) -> torch.Tensor:
    """Log-softmax of (temperature-scaled) logits, cut to the top-p nucleus when top_p < 1 and renormalised: the
    distribution a sampler with these settings draws from. Tokens outside the nucleus get ``TAIL_FLOOR``, not -inf,
    so a realised token the teacher would not have sampled gives a large, finite penalty."""
    full = logits.log_softmax(-1)
    return full if top_p >= 1.0 else nucleus(full, top_p, outside=TAIL_FLOOR)


def realised_logprobs(logits: torch.Tensor, picked: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """log p of the ``picked`` token [c, 1] of each row of float32 logits [c, V] under (temperature, top_p)."""
    logits = logits / temperature if temperature != 1.0 else logits
    if top_p < 1.0:
        return sampling_logprobs(logits, top_p).gather(-1, picked).squeeze(-1)
    return logits.gather(-1, picked).squeeze(-1) - logits.logsumexp(-1)


def attention_kernel(path: str) -> str:
    """SDPA, or the family's eager attention where its class cannot run SDPA: Gemma 2 soft-caps the attention scores,
    which SDPA cannot, and transformers refuses to load it with SDPA."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(AutoConfig.from_pretrained(path)), None)
    return "eager" if model_class is not None and not model_class._supports_sdpa else "sdpa"


class HFPolicy(TokenizerIds):
    def __init__(self, cfg: ModelConfig, optim: OptimConfig | None = None, logit_chunk_rows: int = 1024,
                 shared_prompt: bool = False):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not (Path(cfg.path) / HF_CONFIG).exists():
            raise ModelError(f"model.path={cfg.path!r} is not an HF model directory (no config.json); point it at one "
                             "(megaopd make-embedded --out DIR builds tiny ones)")
        self.device = torch.device(cfg.device)
        compute, master = getattr(torch, cfg.dtype), getattr(torch, cfg.master_dtype)
        mixed = optim is not None and master != compute
        # Loaded at the master precision when it differs, so the masters hold the checkpoint's own values.
        self.model, info = AutoModelForCausalLM.from_pretrained(
            cfg.path, dtype=master if mixed else compute, attn_implementation=attention_kernel(cfg.path),
            output_loading_info=True)
        self.model.to(self.device)
        # transformers fills a missing weight with random values and only warns: a policy or teacher must be whole.
        if problems := {k: v for k, v in info.items() if v}:  # missing, unexpected, mismatched keys, errors
            raise ModelError(f"model.path={cfg.path!r} does not hold every weight of its architecture: {problems}; "
                             "point it at a complete HF model directory")
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.path)
        self.shape = ModelShape.from_hf_config(self.model.config)
        self.path = cfg.path
        self._check_projection()
        if logit_chunk_rows < 1:
            raise ConfigError(f"train.logit_chunk_rows must be >= 1, got {logit_chunk_rows}; set a positive number")
        self.logit_chunk_rows = logit_chunk_rows  # response rows per [rows x V] vocabulary projection
        if shared_prompt and (problem := hf_attention_problem(self.model.config)):
            raise ModelError(f"{cfg.path}: train.shared_prompt cannot run this model: {problem}; set "
                             "train.shared_prompt=false")
        self.shared_prompt = shared_prompt
        self.shared_groups: list[tuple[int, list[int], int]] = []  # (prompt length, response lengths, passes) run
        self.optimizer = self.scheduler = None
        self.masters: list[torch.Tensor] = []  # the optimizer's weights when they differ from the model's (mixed)
        self.grad_clip = 0.0
        if optim is None:
            self.model.eval().requires_grad_(False)
        else:
            self.model.train()
            if cfg.activation_checkpointing:
                self.model.gradient_checkpointing_enable({"use_reentrant": False})
            weights = list(self.model.parameters())
            if mixed:
                self.masters = [p.detach().clone() for p in weights]
                self.model.to(compute)
                for param, copy in zip(weights, self.masters):
                    param.register_post_accumulate_grad_hook(self._accumulate_into(copy))
                weights = self.masters
            adamw = dict(lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)
            try:  # the fused kernel (one op for all parameters; what HF Trainer / TRL default to); else the loop
                self.optimizer = torch.optim.AdamW(weights, **adamw, fused=True)
            except (RuntimeError, ValueError):
                self.optimizer = torch.optim.AdamW(weights, **adamw)
            warmup = optim.warmup_steps
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
            self.grad_clip = optim.grad_clip

    def _model_inputs(self, batch: TokenBatch) -> dict:
        """Forward kwargs. A right-padded batch (every row's mask is ones then zeros, as ``collate`` builds it) needs
        no attention mask: under the causal mask a real token only ever sees earlier, real tokens, so the plain
        causal kernel gives the real positions the same values without building and applying a [b, 1, S, S] mask.
        (Padding positions then attend to the row's tokens instead of being masked; nothing reads them.)"""
        mask = batch.attention_mask
        right_padded = bool((mask[:, 1:] <= mask[:, :-1]).all()) and bool(mask[:, 0].all())
        return {"input_ids": batch.input_ids.to(self.device),
                "attention_mask": None if right_padded else mask.to(self.device), "use_cache": False}

    @contextlib.contextmanager
    def _response_rows(self, batch: TokenBatch):
        """Yields the output layer's input at the response target positions only, [N, H], and their (row, column) in
        the [b, S-1] grid. A pre-hook on the model's own output layer takes those rows and hands the layer nothing, so
        the model's forward never projects to the vocabulary; ``_project`` then does it chunk by chunk. With shared
        prompts the forward runs the batch's flat layout, and its attention stays routed until the block ends (a
        checkpointed layer re-runs its forward in the backward: keep the backward inside)."""
        where = batch.response_mask.to(self.device).nonzero(as_tuple=True)
        head = self._output_layer()
        groups = PromptGroups.of(batch.input_ids, batch.attention_mask, batch.response_mask, self.pad_id) \
            if self.shared_prompt else None
        if groups is None:
            inputs, rows, routed = self._model_inputs(batch), where, contextlib.nullcontext({})
        else:
            groups = groups.to(self.device)
            inputs = {"input_ids": groups.input_ids[None], "use_cache": False}
            rows, routed = (0, groups.source[where]), hf_attention(self.model, groups)
            self.shared_groups += [(p, r, 3 if torch.is_grad_enabled() else 1) for p, r in groups.sizes()]
        taken = []

        def take_rows(module, args):
            taken.append(args[0][rows])
            return (taken[0][:0], *args[1:])
        with routed as extra:
            handle = head.register_forward_pre_hook(take_rows)
            try:
                self.model(**inputs, **extra)
            finally:
                handle.remove()
            yield taken[0], where

    def _output_layer(self) -> torch.nn.Module:
        head = self.model.get_output_embeddings()
        if head is None:
            raise ModelError(f"{self.path}: the model has no output layer to project response rows with; "
                             "use a causal LM")
        return head

    @torch.no_grad()
    def _check_projection(self) -> None:
        """The policy projects the output layer's input itself (``_project``), so it skips what the family's forward
        does to the logits after that layer; ``_project`` redoes Gemma 2's soft-capping, but Granite's
        ``logits_scaling`` or Cohere's ``logit_scale`` were scored wrong with no error. The two must agree at the last
        of a few tokens (to bf16 rounding; one row of V, as prefill projects), or the model is refused."""
        taken = []
        handle = self._output_layer().register_forward_pre_hook(lambda module, args: taken.append(args[0]))
        try:
            ids = torch.arange(min(8, self.shape.vocab_size), device=self.device)[None]
            logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits.float()
        finally:
            handle.remove()
        gap = float((self._project(taken[0]) - logits).abs().max())
        if gap > 0.02 * float(logits.abs().max()):
            raise ModelError(f"{self.path}: its forward changes the logits after the output layer in a way megaopd's "
                             f"scoring does not (largest gap {gap:.3g}; e.g. Granite's logits_scaling, Cohere's "
                             "logit_scale), so its logprobs would be wrong; use a model of another family")

    def take_prompt_saving(self, causal: bool = True) -> int:
        """The FLOPs the shared-prompt passes since the last call did not run (``shared_prompt.saved_flops``); 0
        without shared prompts."""
        saved = saved_flops(self.shape, self.shared_groups, causal)
        self.shared_groups = []
        return saved

    def _project(self, hidden: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Float32 logits of some response rows; the family's logit soft-capping (Gemma 2) as its forward does it."""
        logits = self.model.get_output_embeddings()(hidden).float()
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits / temperature if temperature != 1.0 else logits

    def _chunked(self, hidden: torch.Tensor, fn, grad: bool) -> list[torch.Tensor]:
        """``fn(hidden_rows, start) -> tensors with one row per hidden row``, over ``logit_chunk_rows`` rows at a
        time, concatenated. With ``grad`` and more than one chunk, each chunk is checkpointed: its [c, V] logits are
        freed after the forward and recomputed in the backward, so the graph holds one chunk's at a time, not all of
        them (one chunk holds no more than the bound: no recomputation then)."""
        parts = []
        recompute = grad and hidden.shape[0] > self.logit_chunk_rows
        for start in range(0, hidden.shape[0], self.logit_chunk_rows):
            rows = hidden[start:start + self.logit_chunk_rows]
            out = checkpoint(fn, rows, start, use_reentrant=False) if recompute else fn(rows, start)
            parts.append(out if isinstance(out, tuple) else (out,))
        if not parts:  # no response rows: empty results of the right trailing shape
            out = fn(hidden[:0], 0)
            parts.append(out if isinstance(out, tuple) else (out,))
        return [torch.cat(column) for column in zip(*parts)]

    def _micro_batches(self, batch: TokenBatch, micro_batch_size: int):
        """Slices of ``micro_batch_size`` rows; with shared prompts, of whole groups (as many as fit, or a part of
        one larger than a micro-batch), so that a group's prompt is forwarded once."""
        cuts = range(0, batch.size, micro_batch_size)
        found = group_rows(batch.input_ids, batch.attention_mask, batch.response_mask) if self.shared_prompt else None
        if found is not None:
            cuts = _group_cuts(found[0].tolist(), micro_batch_size)
        for start, end in zip(cuts, [*cuts[1:], batch.size]):
            yield batch.select(slice(start, end))

    @staticmethod
    def _targets(batch: TokenBatch, where, device) -> torch.Tensor:
        return batch.input_ids.to(device)[where[0], where[1] + 1]

    @staticmethod
    def _scatter(values: torch.Tensor, where, grid: tuple[int, ...]) -> torch.Tensor:
        """Response-position values into a zero-filled grid ([b, S-1] or [b, S-1, K]); differentiable in values.
        In place into the fresh zeros (the out-of-place ``index_put`` would copy the whole grid once more)."""
        return values.new_zeros(grid).index_put_(where, values)

    @torch.no_grad()
    def logprobs(self, batch: TokenBatch, micro_batch_size: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0, keep: list | None = None) -> torch.Tensor:
        """Per-token logprob of each realised token, [B, S-1], masked to the response (0 elsewhere); a teacher
        passes the rollout's temperature / top-p to score under the student's sampling settings. ``keep``: a list
        that gets each micro-batch's response rows [n, H] (``scored_rows``)."""
        return self.logprobs_under(batch, micro_batch_size, [(temperature, top_p)], keep)[0]

    @torch.no_grad()
    def logprobs_under(self, batch: TokenBatch, micro_batch_size: int, settings: list[tuple[float, float]],
                       keep: list | None = None, with_entropy: bool = False) -> list[torch.Tensor]:
        """``logprobs`` under each (temperature, top_p) of ``settings``, from one forward and one vocabulary
        projection: the settings differ only after the projection (the division by the temperature, the
        log-softmax, the nucleus), so a second setting costs no matmul. ``with_entropy``: one more grid, each
        response position's entropy at the first setting's temperature over the whole vocabulary, from the same
        logits (elementwise work, no matmul)."""
        parts = []
        for mb in self._micro_batches(batch, micro_batch_size):
            with self._response_rows(mb) as (hidden, where):
                if keep is not None:
                    keep.append(hidden)
                targets = self._targets(mb, where, self.device)

                def realised(rows, start):
                    logits = self._project(rows)
                    picked = targets[start:start + rows.shape[0], None]
                    out = tuple(realised_logprobs(logits, picked, temperature, top_p)
                                for temperature, top_p in settings)
                    if not with_entropy:
                        return out
                    first = settings[0][0]
                    return *out, entropy((logits / first if first != 1.0 else logits).log_softmax(-1))
                parts.append([self._scatter(values, where, mb.response_mask.shape)
                              for values in self._chunked(hidden, realised, False)])
        # One transfer (a host sync) per setting for the batch, not one per micro-batch.
        return [torch.cat(column).cpu() for column in zip(*parts)]

    @torch.no_grad()
    def topk_logprobs(self, batch: TokenBatch, k: int, micro_batch_size: int = 64, temperature: float = 1.0,
                      top_p: float = 1.0) -> dict[str, torch.Tensor]:
        """The teacher's view of each response position under the given sampling settings, without keeping [N, V]:
        ``realised`` [B, S-1] (logprob of each realised token), ``topk_ids`` / ``topk`` [B, S-1, K] (the K most likely
        tokens and their logprobs) and ``tail`` [B, S-1] (log of the mass outside them); 0 off the response."""
        names = ("realised", "topk_ids", "topk", "tail")
        grids = {name: [] for name in names}
        for mb in self._micro_batches(batch, micro_batch_size):
            with self._response_rows(mb) as (hidden, where):
                targets = self._targets(mb, where, self.device)

                def view(rows, start):
                    full = sampling_logprobs(self._project(rows, temperature), top_p)
                    realised = full.gather(-1, targets[start:start + rows.shape[0], None]).squeeze(-1)
                    topk, ids, tail = topk_view(full, k)
                    return realised, ids, topk, tail
                values = self._chunked(hidden, view, False)
            for name, value in zip(names, values):
                grid = (*mb.response_mask.shape, *value.shape[1:])
                grids[name].append(self._scatter(value, where, grid).cpu())
        return {name: torch.cat(parts) for name, parts in grids.items()}

    @torch.no_grad()
    def full_rows(self, batch: TokenBatch, temperature: float = 1.0, top_p: float = 1.0):
        """The log-softmax at a batch's response rows, on demand: returns ``rows(index) -> [len(index), V]`` (rows in
        ``response_mask.nonzero()`` order). One forward now ([N, H] kept); the vocabulary projection per call."""
        with self._response_rows(batch) as (hidden, _):
            return self._rows_lookup(hidden, temperature, top_p)

    @torch.no_grad()
    def scored_rows(self, batch: TokenBatch, micro_batch_size: int = 64, temperature: float = 1.0,
                    top_p: float = 1.0):
        """``logprobs`` and, from the same forward, ``full_rows``'s lookup over the whole batch's response rows:
        (realised [B, S-1], rows(index) -> [len(index), V]). The full OPD form's one teacher forward per sample per
        step: the [N, H] rows are kept, each call projects its rows again."""
        kept = []
        realised = self.logprobs(batch, micro_batch_size, temperature, top_p, keep=kept)
        return realised, self._rows_lookup(torch.cat(kept), temperature, top_p)

    def _rows_lookup(self, hidden: torch.Tensor, temperature: float, top_p: float):
        return lambda index: sampling_logprobs(self._project(hidden[index], temperature), top_p)

    @torch.no_grad()
    def full_logprobs(self, batch: TokenBatch, micro_batch_size: int = 64) -> torch.Tensor:
        """Log-softmax over the vocabulary at every response target position, [B, S-1, V] (tests and small checks:
        the trainer never builds this grid); zero at every other position."""
        parts = []
        for mb in self._micro_batches(batch, micro_batch_size):
            with self._response_rows(mb) as (hidden, where):
                full = self._chunked(hidden, lambda rows, start: self._project(rows).log_softmax(-1), False)[0]
            parts.append(self._scatter(full, where, (*mb.response_mask.shape, full.shape[-1])).cpu())
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def train_minibatch(self, batch: TokenBatch, loss_fn: TokenLossFn, micro_batch_size: int,
                        vocab_term=None, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step on `batch`: token-mean loss over all its response tokens, whatever the micro-batching.

        Each micro-batch's summed token loss is divided by the token count of the whole minibatch, so gradient
        accumulation gives the same gradient as one big batch (the recurring TRL / verl aggregation bug).
        ``loss_fn`` gets logprobs [b, S-1] computed at the response positions only and zero elsewhere (the loss is
        masked to the response anyway), and with a ``vocab_term`` (``objectives.VocabTerm``) its value per response
        position [b, S-1], e.g. the KL to the teacher, computed chunk by chunk on the student's log-softmax. Both
        are of softmax(logits / ``temperature``): the rollout's (``rollout.policy_temperature``).
        """
        assert self.optimizer is not None, "this policy was built frozen (no optimizer)"
        total_tokens = batch.response_mask.sum().clamp(min=1.0)
        sums: dict[str, float] = {}
        self.optimizer.zero_grad(set_to_none=True)
        for mb in self._micro_batches(batch, micro_batch_size):
            with self._response_rows(mb) as (hidden, where):  # open through the backward
                mb = mb.to(self.device)  # the loss meets the logprobs on the device
                mask = mb.response_mask
                targets = self._targets(mb, where, self.device)
                row_term = vocab_term.rows(mb) if vocab_term is not None else None

                def per_row(rows, start):
                    full = self._project(rows, temperature).log_softmax(-1)
                    index = slice(start, start + rows.shape[0])
                    logp = full.gather(-1, targets[index, None])
                    # One output per chunk: with two, the backward reaches a chunk's log-softmax through each at a
                    # different time and holds its [rows x V] gradient meanwhile, for every chunk of the micro-batch.
                    return torch.cat((logp, row_term(WholeVocab(full), index)[:, None]), -1) \
                        if row_term is not None else logp
                values = self._chunked(hidden, per_row, torch.is_grad_enabled())[0]
                logp = self._scatter(values[:, 0], where, mask.shape)
                vocab = self._scatter(values[:, 1], where, mask.shape) if row_term is not None else None
                per_token, metrics = loss_fn(logp, vocab, mb)
                loss = (per_token * mask).sum() / total_tokens
                loss.backward()
            for name, value in {"loss": per_token, **metrics}.items():
                sums[name] = sums.get(name, 0.0) + (value.detach() * mask).sum() / total_tokens
        weights = self.masters or list(self.model.parameters())
        grad_norm = torch.nn.utils.clip_grad_norm_(weights, self.grad_clip or math.inf)
        # One host sync per step for all the metrics, not one per micro-batch and metric: before the optimizer step,
        # so that a non-finite loss or gradient norm never reaches the weights (the trainer names it, then stops or
        # skips the step: train.nonfinite).
        values = torch.stack([*sums.values(), grad_norm]).tolist() if sums else [float(grad_norm)]
        metrics = {**dict(zip(sums, values)), "grad_norm": values[-1]}
        if all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm") if k in metrics):
            self._optimizer_step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        return metrics | {"lr": self.scheduler.get_last_lr()[0]}

    @staticmethod
    def _accumulate_into(master: torch.Tensor):
        """A hook that moves a compute-dtype gradient into its master's (accumulated in the master's precision
        over micro-batches) and frees it, so the low-precision gradient never outlives one backward."""
        def hook(param: torch.Tensor) -> None:
            grad = param.grad.to(master.dtype)
            master.grad = grad if master.grad is None else master.grad.add_(grad)
            param.grad = None
        return hook

    def _optimizer_step(self) -> None:
        """Step the optimizer on the clipped gradients (on the masters when mixed) and round the masters into the
        compute weights. The clipped gradients stay until the next minibatch (tests and diagnostics read them)."""
        self.optimizer.step()
        self.scheduler.step()
        if self.masters:
            with torch.no_grad():
                torch._foreach_copy_(list(self.model.parameters()), self.masters)

    def state_dict(self) -> dict:
        state = {"model": self.model.state_dict()}
        if self.optimizer is not None:
            state |= {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.masters:
            state["masters"] = self.masters
        return state

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        if self.masters:
            with torch.no_grad():
                torch._foreach_copy_(self.masters, state["masters"])
                torch._foreach_copy_(list(self.model.parameters()), self.masters)

    def save_hf(self, out_dir: str | Path) -> None:
        self.model.save_pretrained(out_dir)
        self.tokenizer.save_pretrained(out_dir)

    def hf_named_tensors(self):
        """(HF parameter name, tensor) pairs, for weight sync to servers without a trip through the disk."""
        return self.model.state_dict().items()


def _group_cuts(group_of: list[int], size: int) -> list[int]:
    """Micro-batch starts: whole groups, as many as fit in ``size`` rows; a group larger than ``size`` in parts."""
    starts = [i for i in range(len(group_of)) if i == 0 or group_of[i] != group_of[i - 1]] + [len(group_of)]
    cuts = [0]
    for start, end in zip(starts, starts[1:]):  # group [start, end)
        if end - cuts[-1] > size and start > cuts[-1]:  # it would overflow the micro-batch: it begins the next
            cuts.append(start)
        while end - cuts[-1] > size:
            cuts.append(cuts[-1] + size)
    return cuts
