"""The megatron-core backend: the same calls as ``HFPolicy``, on a TP/PP/DP-parallel GPT model.

    torchrun --nproc-per-node 2 -m megaopd.models.megatron.launch cfg.yaml model.backend=megatron model.megatron.tp=2

Every call is collective: all ranks call it with the same global ``TokenBatch`` and get the same result back.
Inside, the batch is padded to a multiple of dp * micro_batch_size with all-masked rows (never counted: the loss
is a token-mean over response tokens and the ledger counts real tokens), split over data-parallel ranks and run
through megatron's pipeline schedule (``get_forward_backward_func``) in micro-batches. Megatron's
``calculate_per_token_loss`` divides the summed gradients by the token count of the whole minibatch, all-reduced
over DP, so gradient accumulation and DP give the token-mean that ``HFPolicy`` computes in one process.

Log-probabilities come from the vocab-parallel logits (``vocab.VocabShard``). The top-k OPD form reads the
student's logprobs at the teacher's K ids and its tail mass through the vocab all-reduces, so its KL is the same
on every TP rank, like the realised-token logprobs. The full-vocabulary form needs the teacher's rows per
micro-batch inside the schedule, which megatron teachers (collective over the global batch) cannot give: use
opd.form=topk (K = vocabulary size is exact). In training the output layer projects a few sequences at a time
(``train.logit_chunk_rows`` positions, at least one sequence), each chunk recomputed in the backward, so the
micro-batch's [b, s, V/tp] fp32 logits and their same-size copies never exist whole (``_train_loss``).
"""

from __future__ import annotations

import contextlib
import logging
import math
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint as recomputed

from megaopd.data.batch import TokenBatch
from megaopd.models.checkpoint import load_state
from megaopd.config import ModelConfig, OptimConfig
from megaopd.accounting.flops import HF_CONFIG, ModelShape, train_flops
from megaopd.models.megatron import bridge as hf_bridge
from megaopd.models.megatron import checkpoint
from megaopd.models.megatron.fp8 import fp8_overrides, use_te_spec
from megaopd.models.megatron.parallel import init_model_parallel, model_device, student_layout, teacher_layout
from megaopd.models.megatron.rollout_copy import RolloutCopy
from megaopd.models.megatron.shared_prompt import shared_forward
from megaopd.models.megatron.vocab import VocabShard
from megaopd.accounting.metrics import device_clock, step_perf
from megaopd.models.policy_protocol import TokenizerIds
from megaopd.models.distributions import topk_view
from megaopd.models.shared_prompt import PromptGroups, saved_flops

log = logging.getLogger(__name__)


def pad_batch(batch: TokenBatch, rows: int, columns: int, pad_id: int) -> TokenBatch:
    """Append all-masked rows and positions so that the batch size is a multiple of `rows` (pipeline shapes are
    fixed) and the sequence length one of `columns` (sequence parallelism splits it over TP; FP8 GEMMs want 16)."""
    extra_rows, extra_cols = -batch.size % rows, -batch.input_ids.shape[1] % columns
    if not extra_rows and not extra_cols:
        return batch
    fields = {}
    for name, value in batch.__dict__.items():
        if isinstance(value, torch.Tensor):
            pad = [0, extra_rows] if value.dim() == 1 else \
                [0, 0] * (value.dim() - 2) + [0, extra_cols, 0, extra_rows]  # last dim first: (vocab,) cols, rows
            value = torch.nn.functional.pad(value, pad, value=pad_id if name == "input_ids" else 0)
        fields[name] = value
    return TokenBatch(**fields)


class MegatronPolicy(TokenizerIds):
    def __init__(self, cfg: ModelConfig, optim: OptimConfig | None = None, tp: int | None = None, seed: int = 0,
                 checkpoint_dir: str | Path | None = None, keep: int = 2, logit_chunk_rows: int = 1024,
                 shared_prompt: bool = False):
        from transformers import AutoTokenizer

        mcfg = cfg.megatron
        if not (Path(cfg.path) / HF_CONFIG).exists():
            raise FileNotFoundError(f"model.path={cfg.path!r} is not an HF model directory (no config.json)")
        overrides = fp8_overrides(mcfg)  # fails here, before any process group, if FP8 cannot run
        init_model_parallel(mcfg.tp, mcfg.pp, seed)
        tp = tp or mcfg.tp
        if optim is not None and tp != mcfg.tp:
            raise ValueError("only frozen models (teachers) may use a TP other than model.megatron.tp")
        self.layout = student_layout() if tp == mcfg.tp else teacher_layout(tp)
        self.path, self.device = cfg.path, model_device(cfg.device)  # refuses a device megatron does not use
        self.dtype = getattr(torch, cfg.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.path)
        use_te = use_te_spec(mcfg)
        lay = self.layout
        overrides |= dict(
            # On CPU (tests) the CUDA RNG tracker megatron binds at import cannot run; weights come from HF anyway.
            use_cpu_initialization=not torch.cuda.is_available(),
            sequence_parallel=bool(mcfg.sequence_parallel and use_te and lay.tp > 1),
            variable_seq_lengths=False, masked_softmax_fusion=False, bias_activation_fusion=False,
            gradient_accumulation_fusion=False, apply_rope_fusion=False, calculate_per_token_loss=True,
            attention_softmax_in_fp32=True)
        self.bridge = hf_bridge.make_bridge(cfg.path, self.dtype, lay.parallel_states(), use_te, mcfg.vocab_multiple,
                                     **overrides)
        self.seq_multiple = (lay.tp if self.bridge.config.sequence_parallel else 1) * (16 if mcfg.fp8 != "none" else 1)
        self.shape = ModelShape.from_hf_config(self.bridge.hf_config)
        self.vocab_size = self.bridge.hf_config.vocab_size
        chunks = hf_bridge.build_models(self.bridge, lay.pg_collection)
        self.bridge.load_weights(chunks, cfg.path)
        self.config = self.bridge.config
        self.module = chunks[0]  # unwrapped, for export and dist checkpoints
        self.optimizer = None
        self.optim = optim
        self.steps = 0
        self._version = 0  # bumped by every weight change; the rollout copy refreshes when it moves
        self._rollout_copy = RolloutCopy(self.bridge, self.dtype, self.device)
        self.checkpoint_dir, self.keep = (Path(checkpoint_dir) if checkpoint_dir else None), keep
        if logit_chunk_rows < 1:
            raise ValueError(f"train.logit_chunk_rows must be >= 1, got {logit_chunk_rows}")
        self.logit_chunk_rows = logit_chunk_rows  # positions per output-layer chunk in training (whole sequences)
        self.shared_prompt = shared_prompt  # each micro-batch as megaopd.models.shared_prompt's flat layout
        self.shared_groups: list[tuple[int, list[int], int]] = []  # (prompt length, response lengths, passes) run
        self._active: PromptGroups | None = None  # the layout of the forward running now
        if optim is None:
            self.module.eval().requires_grad_(False)
            self.model_chunks = chunks
        else:
            self.model_chunks = [self._wrap(chunk, mcfg) for chunk in chunks]
            self.optimizer = self._build_optimizer(optim, mcfg)

    # ---- construction ----
    def _wrap(self, chunk, mcfg):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.transformer.module import Float16Module

        if self.config.bf16:
            chunk = Float16Module(self.config, chunk)  # fp32 logits, bf16 weights; the optimizer keeps fp32 masters
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=mcfg.distributed_optimizer)
        ddp = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=chunk)
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = ddp.no_sync
        return ddp

    def _build_optimizer(self, optim: OptimConfig, mcfg):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = OptimizerConfig(optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay,
                                 adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_eps=mcfg.adam_eps,
                                 clip_grad=optim.grad_clip, use_distributed_optimizer=mcfg.distributed_optimizer,
                                 bf16=self.config.bf16, params_dtype=self.dtype)
        return get_megatron_optimizer(config, self.model_chunks)

    # ---- the HFPolicy interface ----
    @torch.no_grad()
    def logprobs(self, batch: TokenBatch, micro_batch_size: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0) -> torch.Tensor:
        """Per-token logprob of each realised token, [B, S-1], masked to the response (at a teacher's temperature)."""
        return self.logprobs_under(batch, micro_batch_size, [(temperature, top_p)])[0]

    @torch.no_grad()
    def logprobs_under(self, batch: TokenBatch, micro_batch_size: int, settings: list[tuple[float, float]],
                       with_entropy: bool = False) -> list[torch.Tensor]:
        """``logprobs`` at each (temperature, top_p = 1) of ``settings`` from one forward and one projection (and,
        ``with_entropy``, each position's entropy at the first temperature: ``HFPolicy.logprobs_under``)."""
        for _, top_p in settings:
            self._check_top_p(top_p)
        packed = self._forward_only(batch, micro_batch_size, "token", temperatures=[t for t, _ in settings],
                                    with_entropy=with_entropy)
        return [packed[..., i] * batch.response_mask for i in range(packed.shape[-1])]

    @torch.no_grad()
    def topk_logprobs(self, batch: TokenBatch, k: int, micro_batch_size: int = 64, temperature: float = 1.0,
                      top_p: float = 1.0) -> dict[str, torch.Tensor]:
        """As ``HFPolicy.topk_logprobs``: per micro-batch the vocabulary is gathered over TP, cut to its top-K."""
        self._check_top_p(top_p)
        packed = self._forward_only(batch, micro_batch_size, "topk", temperatures=[temperature], k=k)
        mask = batch.response_mask
        return {"realised": packed[..., 0] * mask, "topk": packed[..., 1:k + 1] * mask[..., None],
                "topk_ids": (packed[..., k + 1:2 * k + 1] * mask[..., None]).long(),
                "tail": packed[..., -1] * mask}

    def _check_top_p(self, top_p: float) -> None:
        if top_p < 1.0:
            raise ValueError("megatron teachers score at temperature only, without a top-p cut: set rollout.top_p=1 "
                             "(run.resolve.check_temperature refuses such a run at start-up)")

    @torch.no_grad()
    def full_logprobs(self, batch: TokenBatch, micro_batch_size: int = 64) -> torch.Tensor:
        """Log-softmax over the vocabulary, [B, S-1, V]: gathered over TP because the TokenBatch carries it."""
        return self._forward_only(batch, micro_batch_size, "full")

    @torch.no_grad()
    def logits(self, batch: TokenBatch, micro_batch_size: int = 64) -> torch.Tensor:
        """Raw logits [B, S, V] without the padded vocabulary rows (for checks against HF; gathered over TP)."""
        return self._forward_only(batch, micro_batch_size, "logits")

    def train_minibatch(self, batch: TokenBatch, loss_fn, micro_batch_size: int,
                        vocab_term=None, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step on `batch` with the token-mean of `loss_fn` over all its response tokens, its logprobs
        of softmax(logits / ``temperature``) (``HFPolicy.train_minibatch``)."""
        assert self.optimizer is not None, "this policy was built frozen (no optimizer)"
        t0 = device_clock()
        micro, width = self._local_micro_batches(batch, micro_batch_size)
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self._lr(self.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with self._output_layer_input() as taken:
            loss = partial(self._train_loss, loss_fn, vocab_term, temperature, taken)
            store = self._schedule(micro, width, micro[0].size, loss, forward_only=False)
        grad_norm = self._optimizer_step()
        sums = self._reduce_metrics(store)
        total = float(batch.response_mask.sum().clamp(min=1.0))
        metrics = {**{k: v / total for k, v in sums.items()}, "grad_norm": grad_norm, "lr": self._lr(self.steps)}
        if torch.cuda.is_available():  # MFU of this update in the ledger's convention (docs/flops.md): real tokens,
            # the LM head at the response positions (the prompt rows' head output is hardware work, like padding)
            model_flops = sum(train_flops(self.shape, int(n), head_positions=int(r))
                              for n, r in zip(batch.attention_mask.sum(1), batch.response_mask.sum(1)))
            metrics |= step_perf(model_flops, device_clock() - t0, dist.get_world_size())
        return metrics

    def _optimizer_step(self) -> float:
        """megatron-core's optimizer step, held back where the gradient norm it would clip by is not finite, so that
        a non-finite update never reaches the weights (the trainer names it, then stops or skips: train.nonfinite).
        The norm is read first (one more reduction of it); the step then prepares the same gradients again, which
        copies them again unchanged in fp32 and bf16. A step held back moves neither the learning-rate schedule nor
        the weight version, as on the HF backend. Returns the gradient norm."""
        opt = self.optimizer
        grad_norm = math.inf if opt.prepare_grads() else float(opt.get_grad_norm())
        if not math.isfinite(grad_norm):
            return grad_norm
        _, grad_norm, _ = opt.step()
        self.steps += 1
        self._version += 1
        return float(grad_norm)

    def _lr(self, step: int) -> float:
        warmup = self.optim.warmup_steps  # the HF backend's linear warmup, step for step
        return self.optim.lr * (min(1.0, (step + 1) / warmup) if warmup else 1.0)

    # ---- batching and the pipeline schedule ----
    def _local_micro_batches(self, batch: TokenBatch, mbs: int) -> tuple[list[TokenBatch], int]:
        lay = self.layout
        mbs = min(mbs, math.ceil(batch.size / lay.dp))
        padded = pad_batch(batch, lay.dp * mbs, self.seq_multiple, self.pad_id)
        per_rank = padded.size // lay.dp
        local = padded.select(slice(lay.dp_rank * per_rank, (lay.dp_rank + 1) * per_rank))
        return [local.select(slice(i, i + mbs)) for i in range(0, per_rank, mbs)], padded.input_ids.shape[1]

    def _schedule(self, micro: list[TokenBatch], width: int, mbs: int, loss_func, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        layouts = self._layouts(micro, forward_only)
        if layouts[0] is not None:  # one flat sequence per micro-batch, all of one length (pipeline shapes are fixed)
            width = -max(g.length for g in layouts) // self.seq_multiple * -self.seq_multiple
            mbs = 1

        def forward_step(data_iterator, model):
            mb, groups = next(data_iterator)
            if groups is None:
                ids = mb.input_ids.to(self.device)
                positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
                # Right-padded rows need no mask beyond the causal one: padding only follows real tokens.
                return model(ids, positions, None), partial(loss_func, mb)
            ids = torch.nn.functional.pad(groups.input_ids, (0, width - groups.length), value=self.pad_id)
            positions = torch.nn.functional.pad(groups.positions, (0, width - groups.length))
            self._active = groups
            try:
                with shared_forward(model, groups, positions):
                    output = model(ids[None], positions[None], None)
            finally:
                self._active = None
            if self.layout.pp_rank == self.layout.pp - 1 and output.shape[0]:  # the logits, [1, T, V/tp]
                output = output[0][groups.source]  # each row's own, [b, S, V/tp]
            return output, partial(loss_func, mb)

        if self.layout.pg_collection is not None:  # a teacher on its own groups: pp=1, plain forward
            store = []
            for item in zip(micro, layouts):
                output, finish = forward_step(iter([item]), self.model_chunks[0])
                store.append(finish(output)[2])
            return store
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(zip(micro, layouts)), model=self.model_chunks,
            num_microbatches=len(micro), seq_length=width, micro_batch_size=mbs, forward_only=forward_only)

    def _layouts(self, micro: list[TokenBatch], forward_only: bool) -> list[PromptGroups | None]:
        """Each micro-batch's shared-prompt layout (all None without shared prompts), counted for
        ``take_prompt_saving``."""
        if not self.shared_prompt:
            return [None] * len(micro)
        layouts = [PromptGroups.of(mb.input_ids, mb.attention_mask, mb.response_mask, self.pad_id, always=True)
                   .to(self.device) for mb in micro]
        passes = 1 if forward_only else 3
        self.shared_groups += [(p, r, passes) for groups in layouts for p, r in groups.sizes()]
        return layouts

    def take_prompt_saving(self, causal: bool = True) -> int:
        """The FLOPs the shared-prompt passes since the last call did not run, over every data-parallel rank
        (collective; ``HFPolicy.take_prompt_saving``)."""
        total = torch.tensor(saved_flops(self.shape, self.shared_groups, causal), dtype=torch.int64, device=self.device)
        self.shared_groups = []
        if self.layout.dp > 1:
            dist.all_reduce(total, group=self.layout.dp_group)
        return int(total.item())

    @contextlib.contextmanager
    def _output_layer_input(self):
        """While open, the last stage's output layer hands its input (and weight) to ``taken`` and projects none of
        it: the loss projects it chunk by chunk (the HF backend's pre-hook, on megatron's ColumnParallelLinear)."""
        taken: dict = {}
        layer = getattr(self.module, "output_layer", None)  # only the last pipeline stage has one

        def take(module, args, kwargs):
            hidden = args[0] if self._active is None else \
                args[0][:, 0][self._active.source].transpose(0, 1).contiguous()  # each row's own: [S, b, H]
            taken["hidden"], taken["weight"] = hidden, kwargs.get("weight")  # [s(/tp under SP), b, H]
            return (args[0][:, :0], *args[1:]), kwargs  # no sequences: the model's forward projects nothing
        handle = layer.register_forward_pre_hook(take, with_kwargs=True) if layer is not None else None
        try:
            yield taken
        finally:
            if handle is not None:
                handle.remove()

    def _shard(self, logits: torch.Tensor) -> VocabShard:
        return VocabShard(logits[:, :-1], self.vocab_size, self.layout.tp_group)

    def _train_loss(self, loss_fn, vocab_term, temperature: float, taken: dict, mb: TokenBatch,
                    output: torch.Tensor):
        """``output`` is the model's (empty) logits; the output layer's input is in ``taken``."""
        mb = mb.to(output.device)
        hidden, weight = taken.pop("hidden"), taken.pop("weight")
        layer = self.module.output_layer
        rows = max(1, self.logit_chunk_rows // mb.input_ids.shape[1])  # whole sequences per chunk
        row_term = vocab_term.sequences(mb) if vocab_term is not None else None

        def terms(h: torch.Tensor, start: int) -> tuple[torch.Tensor, ...]:
            """Realised-token logprobs (and the objective's vocabulary term) of sequences [start, start + c) from
            their hidden states."""
            logits, _ = layer.forward(h, weight=weight)  # .forward: past the pre-hook that empties its input
            shard = self._shard(logits.transpose(0, 1) / temperature if temperature != 1.0 else logits.transpose(0, 1))
            index = slice(start, start + h.shape[1])
            logp = shard.logprobs_of(mb.input_ids[index, 1:])
            return (logp,) if row_term is None else (logp, row_term(shard, index))
        recompute = hidden.shape[1] > rows  # one chunk holds no more than the bound: no recomputation then
        parts = [recomputed(terms, hidden[:, i:i + rows], i, use_reentrant=False) if recompute
                 else terms(hidden[:, i:i + rows], i) for i in range(0, hidden.shape[1], rows)]
        logp, *vocab = (torch.cat(column) for column in zip(*parts))
        mask = mb.response_mask
        per_token, metrics = loss_fn(logp, vocab[0] if vocab else None, mb)
        backprop = (per_token * mask).sum() / self.layout.tp  # the same on every TP rank: each rank owns 1/tp
        sums = torch.stack([(v.detach() * mask).sum() for v in (per_token, *metrics.values())])
        return backprop, mask.sum().to(torch.int), {"names": ["loss", *metrics], "sums": sums}

    def _reduce_metrics(self, store: list) -> dict[str, float]:
        """Sums over micro-batches and DP ranks, sent from the last pipeline stage to every rank."""
        lay = self.layout
        result = [None]
        if lay.pp_rank == lay.pp - 1:
            sums = torch.stack([item["sums"] for item in store]).sum(0)
            if lay.dp > 1:
                dist.all_reduce(sums, group=lay.dp_group)
            result = [dict(zip(store[0]["names"], sums.tolist()))]
        if lay.pp > 1:
            dist.broadcast_object_list(result, src=dist.get_global_rank(lay.pp_group, lay.pp - 1),
                                       group=lay.pp_group)
        return result[0]

    def _forward_only(self, batch: TokenBatch, mbs: int, what: str, temperatures: list[float] = (1.0,),
                      k: int = 0, with_entropy: bool = False) -> torch.Tensor:
        """Per-token logprobs at each of ``temperatures`` ("token", [..., len(temperatures)], then the entropy at the
        first one ``with_entropy``), full log-softmax
        ("full"), logits ("logits"), or the top-k view packed as [realised, K logprobs, K ids, tail] ("topk", at the
        first temperature), on every rank."""
        lay = self.layout
        micro, width = self._local_micro_batches(batch, mbs)
        for chunk in self.model_chunks:
            chunk.eval()

        def collect(mb, logits):
            scaled = [logits / t if t != 1.0 else logits for t in temperatures]
            logits = scaled[0]
            if what == "topk":  # one micro-batch's vocabulary at a time, never the whole batch's
                full = _gather_vocab(self._shard(logits).log_softmax.float(), logits.shape[-1], self.vocab_size,
                                     lay.tp_group)
                realised = full.gather(-1, mb.input_ids[:, 1:, None].to(full.device))
                top, ids, tail = topk_view(full, k)
                out = torch.cat([realised, top, ids.float(), tail[..., None]], dim=-1)
            elif what == "logits":
                out = _gather_vocab(logits.float(), logits.shape[-1], self.vocab_size, lay.tp_group)
            elif what == "full":
                out = _gather_vocab(self._shard(logits).log_softmax.float(), logits.shape[-1], self.vocab_size,
                                    lay.tp_group)
            else:
                targets = mb.input_ids[:, 1:].to(logits.device)
                shards = [self._shard(each) for each in scaled]
                out = torch.stack([shard.logprobs_of(targets) for shard in shards] +
                                  ([shards[0].entropy()] if with_entropy else []), -1)
            return torch.zeros((), device=logits.device), torch.zeros((), dtype=torch.int), {"out": out}

        store = self._schedule(micro, width, micro[0].size, collect, forward_only=True)
        for chunk in self.model_chunks:
            chunk.train(self.optimizer is not None)
        rows = len(micro) * micro[0].size
        shape = {"token": (rows, width - 1, len(temperatures) + with_entropy),
                 "full": (rows, width - 1, self.vocab_size), "logits": (rows, width, self.vocab_size),
                 "topk": (rows, width - 1, 2 * k + 2)}[what]
        # Collectives on the device (NCCL has no CPU tensors), the result to the CPU at the end.
        last = lay.pp_rank == lay.pp - 1
        local = torch.cat([item["out"] for item in store]) if last else torch.empty(shape, device=self.device)
        if lay.pp > 1:
            dist.broadcast(local, src=dist.get_global_rank(lay.pp_group, lay.pp - 1), group=lay.pp_group)
        if lay.dp > 1:
            parts = [torch.empty_like(local) for _ in range(lay.dp)]
            dist.all_gather(parts, local.contiguous(), group=lay.dp_group)
            local = torch.cat(parts)
        width = batch.input_ids.shape[1] - (what != "logits")
        return local[: batch.size, :width].cpu()

    # ---- export, rollout copy, checkpoints ----
    def export_hf_state(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """The full HF state dict on every rank that `keep`s it, {} on the others (collective)."""
        return hf_bridge.export_state_dict(self.bridge, [self.module], keep)

    def hf_named_tensors(self):
        """(HF name, tensor) pairs of the current weights, for weight sync to rollout servers (collective)."""
        return self.export_hf_state().items()

    def save_hf(self, out_dir: str | Path) -> None:
        state = self.export_hf_state(keep=dist.get_rank() == 0)  # rank 0 writes: the others need no copy
        Path(out_dir).mkdir(parents=True, exist_ok=True)  # on every rank: callers add files beside the model
        if dist.get_rank() == 0:
            hf_bridge.hf_model_from_state(self.bridge, state, self.dtype).save_pretrained(out_dir)
            self.tokenizer.save_pretrained(out_dir)
        dist.barrier()

    @property
    def model(self):
        """An HF copy of the current weights for the local rollout engine (``rollout_copy``; collective when stale)."""
        return self._rollout_copy.current(self._version, self.export_hf_state)

    def sharded_state_dict(self, is_loading: bool = False) -> dict:
        # fully_reshardable: the optimizer state is saved per parameter, so a checkpoint loads at any TP/PP/DP.
        metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
        state = {"model": self.module.sharded_state_dict(metadata=metadata)}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.sharded_state_dict(state["model"], is_loading=is_loading,
                                                                   metadata=metadata)
        return state

    def save_checkpoint(self, directory: str | Path) -> None:
        """Megatron's distributed checkpoint (model + optimizer), loadable at another TP/PP (collective)."""
        checkpoint.save(self.sharded_state_dict(), directory)
        if dist.get_rank() == 0:
            torch.save({"steps": self.steps}, Path(directory) / "megaopd_policy.pt")
        dist.barrier()

    def load_checkpoint(self, directory: str | Path) -> None:
        from megatron.core import dist_checkpointing

        if self.optimizer is not None and self.steps == 0:
            # A fresh torch Adam has no per-parameter state (nor 'step') to load into; megatron's own remedy is a
            # zero-gradient step, whose values the checkpoint then overwrites.
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                if hasattr(opt, "_init_optimizer_states_with_dummy_values"):
                    opt._init_optimizer_states_with_dummy_values()
        state = dist_checkpointing.load(self.sharded_state_dict(is_loading=True), str(directory))
        self.module.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.steps = load_state(Path(directory) / "megaopd_policy.pt")["steps"]  # data only, never code
        self._version += 1

    def state_dict(self) -> dict:
        """For the trainer's checkpoint: writes a distributed checkpoint (collective) and returns where it is.

        The trainer's own state file then only references it; the last `keep` distributed checkpoints are kept.
        """
        if self.checkpoint_dir is None:
            raise ValueError("this MegatronPolicy has no checkpoint_dir (build_policy sets one per run)")
        directory = self.checkpoint_dir / f"step_{self.steps:07d}"
        self.save_checkpoint(directory)
        if dist.get_rank() == 0:
            checkpoint.keep_newest(self.checkpoint_dir, self.keep)
        return {"dist_checkpoint": str(directory), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.load_checkpoint(state["dist_checkpoint"])


def _gather_vocab(shard: torch.Tensor, width: int, vocab_size: int, group) -> torch.Tensor:
    """All TP slices side by side, [..., vocab_size]: each slice padded to the per-rank `width`, then trimmed."""
    if dist.get_world_size(group) == 1:
        return shard[..., :vocab_size]
    padded = torch.nn.functional.pad(shard, (0, width - shard.shape[-1]))
    parts = [torch.empty_like(padded) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat(parts, dim=-1)[..., :vocab_size]


def megatron_teachers(model_cfg: ModelConfig):
    """Frozen Megatron teachers for ``TeacherRouter``: (route, path) -> policy at model.megatron.teacher_tp."""
    def load(route: str, path: str) -> MegatronPolicy:
        cfg = ModelConfig(path=path, backend="megatron", dtype=model_cfg.dtype, device=model_cfg.device,
                          megatron=model_cfg.megatron)
        return MegatronPolicy(cfg, tp=model_cfg.megatron.teacher_tp or None)
    return load
