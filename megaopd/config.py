"""Typed run configs: dataclasses with defaults, loaded from YAML and overridden with ``key.sub=value``.

    cfg = load_config("configs/embedded/grpo.yaml", ["train.steps=50", "grpo.clip_high=0.28"])

An unknown key anywhere (file or override) is an error naming the key and the closest valid one; so is a value of
an enumerated setting (a ``Literal`` field) that is not one of its choices, and a number outside the range its code
reads it in (each section's ``__post_init__``: ``check_at_least``, ``check_range``; a command's number flags:
``flag_in_range``). A spelling renamed in the last release (``RENAMED_KEYS``, ``RENAMED_VALUES``) still reads, as
the new one, with one deprecation line naming it. Every run directory gets the resolved config as ``config.yaml`` so
that a run can be repeated exactly.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import dataclasses
import difflib
import logging
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from megaopd.errors import UserError, require_file

# The enumerated settings, each listed once: a field's type is its choices (the loader refuses any other value), and
# ``choices(T)`` gives them to the code that needs the list.
Backend = Literal["hf", "megatron"]
RolloutEngine = Literal["local", "sglang"]
OPDForm = Literal["full_vocab", "topk", "sampled"]  # docs/opd.md
KLDirection = Literal["reverse", "forward"]  # the KL of the full_vocab and topk forms
ISLevel = Literal["none", "token", "sequence"]  # train.tis, train.is_mask: per token or per response
CountsAs = Literal["training", "cold_start", "external"]  # docs/flops.md, "Totals"
DType = Literal["float32", "bfloat16", "float16"]
FP8Recipe = Literal["none", "hybrid", "e4m3"]  # model.megatron.fp8; hybrid: E4M3 forward, E5M2 gradients
# fixed_advantage.scope: the tokens the lowest fraction is taken among
FixedAdvantageScope = Literal["response", "batch"]
# fixed_advantage.scale: one advantage for every selected token (the paper's control), or by its entropy (its OPSA)
FixedAdvantageScale = Literal["none", "entropy"]
StaleTokens = Literal["refuse", "mask"]  # rollout.stale_tokens: tokens past rollout.max_staleness at training time
PartialRollouts = Literal["continue", "requeue"]  # rollout.partial_rollouts: a response an in-flight update interrupts
WeightSync = Literal["disk", "tensor", "distributed"]  # rollout.sglang.sync: megaopd.rollout.serving.weight_sync


def choices(literal: Any) -> tuple:
    """The values an enumerated setting (a ``Literal``) admits."""
    return typing.get_args(literal)


SEED_MAX = 2**32 - 1  # numpy's seeds: every seed setting's top


# Where the mapping being read sits in its file when not at the top: a launch stage's own fields (``stages.grpo.``).
_read_under = contextvars.ContextVar("read_under", default="")


@contextlib.contextmanager
def read_under(where: str):
    """The refusals of the body name their settings under ``where`` (e.g. ``stages.grpo.nodes``)."""
    token = _read_under.set(where)
    try:
        yield
    finally:
        _read_under.reset(token)


def setting(section: str, name: str) -> str:
    """A setting as the user writes it: ``optim.lr``, ``threads`` for a top-level one (a study's, a launch's), and
    under the mapping it is read from (``read_under``)."""
    return _read_under.get() + (f"{section}.{name}" if section else name)


def check_at_least(section: str, settings: Any, least: int, *names: str) -> None:
    """``check_range`` with no upper end, for several counts at once (a step count, a batch size, an interval)."""
    for name in names:
        check_range(section, settings, name, least)


def _shown(value: Any) -> str:
    """A number as an override writes it (a tuple or list as a YAML list)."""
    if isinstance(value, (tuple, list)):
        return f"[{', '.join(_shown(v) for v in value)}]"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _within(value: float, low: float, high: float, low_open: bool, high_open: bool) -> bool:
    """False for NaN, which no comparison admits."""
    return (low < value if low_open else low <= value) and (value < high if high_open else value <= high)


def _span(low: float, high: float, low_open: bool, high_open: bool) -> str:
    if high == math.inf:
        return f"{'>' if low_open else '>='} {_shown(low)}"
    return f"in {'(' if low_open else '['}{_shown(low)}, {_shown(high)}{')' if high_open else ']'}"


def check_range(section: str, settings: Any, name: str, low: float, high: float = math.inf, *, low_open: bool = False,
                high_open: bool = False, means: str = "") -> None:
    """Refuses a number outside [low, high] (an open end excluded; a tuple or list: each of its numbers), NaN
    included: such a value ended in a library's traceback mid-run, or trained something other than asked without a
    word. `means`: what a value at the edge does (e.g. "0: no clipping"), for the line."""
    default = next(f.default if f.default is not dataclasses.MISSING else f.default_factory()
                   for f in dataclasses.fields(settings) if f.name == name)
    check_value(setting(section, name), getattr(settings, name), default, low, high, low_open=low_open,
                high_open=high_open, means=means)


def check_value(key: str, value: Any, default: Any, low: float, high: float = math.inf, *, low_open: bool = False,
                high_open: bool = False, means: str = "") -> None:
    """``check_range`` for a value that is not a field of its own (an entry of a mapping), whose loader did not
    check its type: anything but a number is refused too."""
    several = isinstance(value, (tuple, list))
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) and _within(v, low, high, low_open, high_open)
           for v in (value if several else (value,))):
        return
    raise ConfigError(f"{key} must {'each ' if several else ''}be {_span(low, high, low_open, high_open)}"
                      f"{f' ({means})' if means else ''}, got {_shown(value)}; set one in that range, e.g. "
                      f"{key}={_shown(default)} (the default)")


def flag_in_range(low: float, high: float = math.inf, *, kind: type = int, low_open: bool = False,
                  high_open: bool = False, means: str = "") -> Any:
    """An argparse ``type=`` for a command's number flag, refusing what ``check_range`` refuses: argparse's usage
    error then names the flag as typed (its exit status 2), before the number reaches code that fails on it."""
    def parse(text: str) -> Any:
        value = kind(text)  # not a number: argparse's own "invalid int value" line
        if not _within(value, low, high, low_open, high_open):
            raise argparse.ArgumentTypeError(f"must be {_span(low, high, low_open, high_open)}"
                                             f"{f' ({means})' if means else ''}, got {text}; give one in that range")
        return value

    parse.__name__ = kind.__name__
    return parse


@dataclass
class MegatronConfig:
    """The megatron backend's layout and numerics (model.backend=megatron, launched with torchrun)."""

    tp: int = 1  # tensor-parallel size; data parallel is world_size / (tp * pp)
    pp: int = 1  # pipeline-parallel size (micro-batches: train.micro_batch_size sequences each)
    teacher_tp: int = 0  # frozen teachers' TP (0: the student's); teachers run with pp=1 on their own groups
    fp8: FP8Recipe = "none"  # Transformer Engine FP8 recipe (needs TE and a GPU); none: bf16
    transformer_engine: bool = True  # TE layer spec on GPU; the local spec otherwise (always on CPU)
    distributed_optimizer: bool = True  # shard optimizer state over data parallel (megatron DistributedOptimizer)
    sequence_parallel: bool = True  # with TP > 1 and the TE spec; the local spec cannot (CPU tests)
    adam_eps: float = 1e-8
    vocab_multiple: int = 128  # the vocabulary is padded to a multiple of this * tp (padded rows are masked)
    # Where the student's distributed checkpoints go, shared by all ranks ("" = <run_dir>/megatron_checkpoints).
    checkpoint_dir: str = ""

    def __post_init__(self):
        check_at_least("model.megatron", self, 1, "tp", "pp", "vocab_multiple")
        check_range("model.megatron", self, "teacher_tp", 0, means="0: the student's")
        # 0 divides Adam's first step by zero wherever a gradient is 0 (the padded vocabulary rows): NaN weights
        check_range("model.megatron", self, "adam_eps", 0, low_open=True)


@dataclass
class ModelConfig:
    path: str = ""  # an HF causal-LM directory: config.json + safetensors + tokenizer
    # hf (one process, CPU or one GPU) | megatron (megatron-core under torchrun, TP/PP/DP)
    backend: Backend = "hf"
    # The compute dtype: the weights the forward, backward and local rollouts use. With bfloat16 the HF backend
    # keeps fp32 master weights and optimizer state beside them (master_dtype), so small updates are not lost.
    dtype: DType = "float32"
    # The optimizer's copy of the weights and its Adam state; = dtype keeps no copy.
    master_dtype: DType = "float32"
    # HF backend: keep only each layer's input for backward and recompute the layer (one more forward per train
    # pass, not billed: the ledger counts model FLOPs); what fits 4k-token responses at micro-batch 8 on one GPU.
    activation_checkpointing: bool = False
    # hf: where the model lives. megatron places each rank's model itself (cuda:LOCAL_RANK, or the CPU in
    # rehearsals): this must name that place (cuda / cpu), or the run stops at start-up.
    device: str = "cpu"
    megatron: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass
class DataConfig:
    train: list[str] = field(default_factory=list)  # JSONL / Parquet files in the common RL row format
    # The test split: what the report judges (curves, targets, verdicts); accuracy is reported per data_source
    eval: list[str] = field(default_factory=list)
    # The validation split: what stops or tunes a run reads (train.stop, train.stop.cover, sft.stop_at_accuracy);
    # evaluated beside the test split (valid/ and final_valid/ metrics). Disjoint from train and eval.
    validation: list[str] = field(default_factory=list)
    strict: bool = False  # stop at the first malformed row instead of skipping and reporting it


@dataclass
class SGLangConfig:
    """SGLang servers for rollouts (``rollout.engine=sglang``) and teachers (``opd.teacher_engine=sglang``)."""

    # Attach to running servers instead of launching (a multi-node job hands its own over: megaopd.run.environment).
    # Give the workers, not a router: megaopd balances over them itself and must reach each one to sync and verify
    # its weights.
    urls: list[str] = field(default_factory=list)
    num_servers: int = 1  # servers launched for data-parallel rollouts when no URL is given
    # The interpreter of SGLang's own environment (it pins its torch); "": this one.
    python: str = ""
    server_args: list[str] = field(default_factory=list)  # extra `sglang.launch_server` flags, e.g. [--tp-size, 8]
    env: dict[str, str] = field(default_factory=dict)  # extra environment for launched servers
    max_total_tokens: int = 0  # KV-cache cap in tokens; 0 keeps SGLang's default (set it on CPU: the default is GBs)
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    retries: int = 2  # per request, after which a launched server is restarted once, then dropped
    # disk (HF export + /update_weights_from_disk) | tensor (colocated GPU) | distributed (NCCL)
    sync: WeightSync = "disk"
    # sync=distributed: the address at which the servers reach trainer rank 0 for the NCCL group (a multi-node job
    # sets its node's); "": this host's address on the route to the first server.
    sync_address: str = ""
    probe_tolerance: float = 1e-4  # max |server - trainer| logprob on the probe after a sync; loosen for bf16

    def __post_init__(self):
        check_at_least("rollout.sglang", self, 1, "num_servers")
        check_at_least("rollout.sglang", self, 0, "retries")
        check_range("rollout.sglang", self, "max_total_tokens", 0, means="0: SGLang's default")
        for name in ("startup_timeout_s", "request_timeout_s"):
            check_range("rollout.sglang", self, name, 0, low_open=True)
        check_range("rollout.sglang", self, "probe_tolerance", 0)


@dataclass
class RolloutConfig:
    engine: RolloutEngine = "local"  # local (in-process, the trainer's own model) | sglang (HTTP servers)
    samples_per_prompt: int = 8  # the GRPO group size; usually 1 for OPD
    max_new_tokens: int = 64
    # The policy trained is softmax(logits / temperature), the one sampled: every logprob of a step is taken at it
    # (docs/opd.md, "One temperature"; rollout.policy_temperature). 0 samples greedily and trains at 1.
    temperature: float = 1.0
    top_p: float = 1.0
    # Prompts per local-engine generation chunk: the KV cache holds batch_prompts x samples x (prompt + new tokens)
    # at once. `megaopd plan` prints the largest that fits the device.
    batch_prompts: int = 64
    # Bounded staleness: batches for steps k..k+K exist before step k trains, so each trains K weight versions after
    # the one that generated it (0: the synchronous loop). SGLang servers generate ahead while the trainer updates.
    max_staleness: int = 0
    # A response token more than max_staleness versions old when its batch trains (the count includes the time the
    # batch waited: megaopd.rollout.staleness): refuse stops the run, naming the step; mask trains the batch with
    # those tokens' loss terms zeroed (they stay in the token-mean's denominator) and logs their share.
    stale_tokens: StaleTokens = "refuse"
    # In-flight weight updates (max_staleness >= 1): a weight update lands in the middle of the generations ahead, so
    # a response spans several versions, each token stamped with its own (Sample.token_versions). Local engine: the
    # batches generated ahead advance one chunk of inflight_chunk decode steps per training step, the update lands
    # between chunks (their KV caches held across it). SGLang: the sync aborts the requests running and resumes each
    # from its partial response under the new weights (docs/serving.md). Off: each batch is generated whole by one
    # version.
    inflight_updates: bool = False
    inflight_chunk: int = 16
    # What happens to a response an in-flight update interrupts: continue (under the new weights from its prefix, in
    # the same batch; never restarted, never dropped). requeue (cut it, continue its prefix in a later batch) is
    # refused: it would split a GRPO group across batches.
    partial_rollouts: PartialRollouts = "continue"
    sglang: SGLangConfig = field(default_factory=SGLangConfig)

    def __post_init__(self):
        check_at_least("rollout", self, 1, "samples_per_prompt", "max_new_tokens", "batch_prompts")
        # below 0 the sampler divides the logits by a negative number: it draws the least likely tokens
        check_range("rollout", self, "temperature", 0, means="0: greedy")
        # 0 keeps no token (NaN logprobs); above 1 cuts nothing, as 1 does
        check_range("rollout", self, "top_p", 0, 1, low_open=True, means="1: no cut")
        check_range("rollout", self, "max_staleness", 0, means="0: synchronous")
        if self.inflight_updates and self.max_staleness < 1:
            raise ConfigError("rollout.inflight_updates lets weight updates land in the batches generated ahead, and "
                              "rollout.max_staleness=0 generates none: set rollout.max_staleness=1 or more")
        if self.partial_rollouts == "requeue":
            raise ConfigError("rollout.partial_rollouts=requeue would train a GRPO group split across batches (cut "
                              "responses continued in a later one): use rollout.partial_rollouts=continue")
        check_at_least("rollout", self, 1, "inflight_chunk")


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = 1.0  # the largest gradient norm
    warmup_steps: int = 0

    def __post_init__(self):
        if len(self.betas) != 2:
            raise ConfigError(f"optim.betas must be two numbers (Adam's beta1, beta2), got {_shown(self.betas)}; set "
                              "e.g. optim.betas=[0.9, 0.99]")
        # torch's AdamW refuses these mid-start in a traceback; a negative clip flips the gradient
        check_range("optim", self, "lr", 0)
        check_range("optim", self, "weight_decay", 0)
        check_range("optim", self, "betas", 0, 1, high_open=True)
        check_range("optim", self, "grad_clip", 0, means="0: no clipping")
        check_at_least("optim", self, 0, "warmup_steps")


@dataclass
class GRPOConfig:
    scale_std: bool = True  # False gives Dr.GRPO's unscaled advantages
    clip_low: float = 0.2
    clip_high: float = 0.2  # DAPO uses 0.28
    kl_coef: float = 0.0  # k3 KL to the initial policy; off in most RLVR recipes

    def __post_init__(self):
        for name in ("clip_low", "clip_high"):  # below 0 the clip range excludes the ratio 1 it is centred on
            check_range("grpo", self, name, 0)
        check_range("grpo", self, "kl_coef", 0, means="0: off")  # below 0 it rewards moving away from the reference


ANY_DOMAIN = "*"  # the opd.teachers route that serves every domain


def teacher_route(teachers: dict[str, str], domain: str) -> str | None:
    """The opd.teachers route that serves `domain`: its own, else ANY_DOMAIN; None when neither is there."""
    if domain in teachers:
        return domain
    return ANY_DOMAIN if ANY_DOMAIN in teachers else None


@dataclass
class OPDConfig:
    form: OPDForm = "full_vocab"
    topk: int = 0  # K of form=topk: the teacher's K most likely tokens per response position, plus a tail bucket
    kl: KLDirection = "reverse"
    coef: float = 1.0  # train.algorithm=grpo_opd: weight of the OPD term added to GRPO's group advantage / loss
    # The teacher scores under the rollout's sampling settings: its logits divided by rollout.temperature, as the
    # student's are (and, on the local teacher, its distribution cut to its own top-p nucleus when rollout.top_p < 1).
    # False: temperature 1, no cut; refused unless rollout.temperature is 1 (run.resolve.check_temperature).
    match_sampling: bool = True
    # Routing key -> teacher HF directory. The key is a row's domain (extra_info.domain, else data_source);
    # ANY_DOMAIN ("*") serves every domain. A domain with no teacher fails loudly at start-up.
    teachers: dict[str, str] = field(default_factory=dict)
    # Route -> the tokenizer directory a teacher of another tokenizer than the student's is read with (default: its
    # own directory's). A teacher of another vocabulary, or one named here, scores its own tokens of the response
    # text, aligned to the student's on the text's bytes (megaopd/teachers/cross_tokenizer.py; opd.form=sampled only, docs/opd.md).
    teacher_tokenizer: dict[str, str] = field(default_factory=dict)
    clip: float = 0.2  # clip of the importance ratio in the sampled-token form
    # local (HF forward in the trainer) | sglang (prefill on servers; rollout.sglang settings, sampled or topk form).
    # Teacher servers are launched per teacher, or attached by route from $MEGAOPD_TEACHER_URLS / teacher_urls.
    teacher_engine: RolloutEngine = "local"
    teacher_urls: dict[str, list[str]] = field(default_factory=dict)
    # The teachers' dtype (HF in-process and SGLang teachers); "" = model.dtype. A frozen teacher needs no fp32
    # master: bfloat16 halves a 1.5B teacher beside a float32 student (the memory plan counts it so).
    teacher_dtype: Literal["", DType] = ""
    # Before the first step, measure the teachers and the student on the validation split and refuse a teacher not
    # above its student (megaopd/teachers/check.py); a study sets it on every external-teacher OPD stage.
    check_teacher: bool = False
    allow_weaker_teacher: bool = False  # run a teacher not above its student on purpose (the report marks it)

    def __post_init__(self):
        check_range("opd", self, "coef", 0, means="0: GRPO alone")  # below 0 it trains away from the teacher
        check_range("opd", self, "clip", 0)  # as grpo's clips


@dataclass
class FixedAdvantageConfig:
    """train.algorithm=fixed_advantage, OPD's control without the teacher (docs/opd.md): the student's own
    lowest-logprob tokens pushed down by a fixed advantage, no teacher, no reward, no reference. Defaults: the paper's
    fixed-negative control; scale=entropy: the paper's OPSA."""

    fraction: float = 0.2  # the lowest-logprob share of the tokens that get the advantage: max(1, floor(f * N))
    advantage: float = -0.5  # the fixed advantage of those tokens (the others: 0)
    # response: the lowest of each response's tokens (the paper's text); batch: of all the step's response tokens
    # pooled (the paper's code pools a data-parallel rank's batch; here the step's whole batch, any layout)
    scope: FixedAdvantageScope = "response"
    clip: float = 0.2  # clip of the importance ratio in the policy-gradient surrogate
    # none: `advantage` on every selected token (the paper's fixed-negative control). entropy: the paper's OPSA,
    # linear in the selected tokens' min-max normalised entropy (the policy's before the step, at the run's
    # temperature; min and max over the selected tokens of the scope's pool): `advantage` at the lowest entropy,
    # `entropy_advantage` at the highest (all equal: `entropy_advantage`, as the paper's code)
    scale: FixedAdvantageScale = "none"
    entropy_advantage: float = -1.0


@dataclass
class SFTConfig:
    # The rows of one SFT step are train.prompts_per_step (sft.batch_size is refused: REMOVED_KEYS).
    # Cold start: stop once validation accuracy of every domain reaches `stop_at_accuracy` (checked at each eval)
    # so that the base student is weak but not hopeless. 0 disables the early stop.
    stop_at_accuracy: float = 0.0
    noise: float = 0.0  # share of targets corrupted (a character substituted or dropped, or the answer cut off)

    def __post_init__(self):
        # an accuracy above 1 is never reached (no early stop, without a word); a share outside [0, 1] is 0 or 1
        check_range("sft", self, "stop_at_accuracy", 0, 1, means="0: no early stop")
        check_range("sft", self, "noise", 0, 1)


@dataclass
class CoverConfig:
    """A stage this one is compared with (train.stop.cover, docs/budgets.md): the plateau rule does not end this
    stage before its smoothed validation accuracy on `domain` reaches the partner's target (the last point of the
    partner's smoothed validation curve) or its stage FLOPs reach (1 + margin) x the partner's FLOPs-to-target."""

    run: str = ""  # the partner stage's run directory (finished before this stage starts)
    domain: str = "mean"  # a domain of data.validation, or the mean over them
    # Slack for the partner's FLOPs-to-target measured on validation where the report measures it on test
    # (docs/budgets.md, "Budgets that cover each other")
    margin: float = 0.25


@dataclass
class StopConfig:
    """When a stage ends (megaopd/run/stopping.py, docs/budgets.md): train.steps is always the cap."""

    # steps: run train.steps; plateau: stop once the watched metric, smoothed as in the report, has not improved
    # by min_delta over the last `window` evals
    rule: Literal["steps", "plateau"] = "steps"
    # What the stage watches (greedy validation accuracy): a domain, "mean" (of the domains), or "teacher_gap" (OPD:
    # the mean over its training domains of how far it is below its teacher's final validation accuracy there).
    metric: str = "mean"
    window: int = 3  # evals (eval.every steps apart)
    min_delta: float = 0.01  # absolute accuracy
    # The stages this one is compared with: the plateau rule waits until each is covered (by target or budget)
    cover: list[CoverConfig] = field(default_factory=list)

    def __post_init__(self):
        check_at_least("train.stop", self, 1, "window")  # a window of no evals never plateaus
        check_range("train.stop", self, "min_delta", 0)  # below 0 it stops only once accuracy has fallen


@dataclass
class TrainConfig:
    # A row of the algorithm table, ``megaopd.objectives.methods.METHODS``, which checks the name where a run starts (sft, grpo,
    # opd, grpo_opd: GRPO's advantage plus opd.coef times the OPD term; fixed_advantage: OPD's control without the
    # teacher; opsa, its old name, reads as fixed_advantage for one release: RENAMED_VALUES)
    algorithm: str = "grpo"
    steps: int = 100
    prompts_per_step: int = 16
    micro_batch_size: int = 64  # sequences per forward/backward; gradients accumulate over the rest
    epochs: int = 1  # optimisation passes over each step's rollouts
    minibatches: int = 1  # optimizer steps per pass: the step's rollouts split into this many minibatches
    # Recompute with the trainer instead of trusting rollout logprobs (false needs rollout logprobs without a top-p
    # cut: they become the PPO ratio's old logprobs, which must be the loss's own distribution).
    recompute_old_logprobs: bool = True
    # Corrections of the train/rollout mismatch (e.g. SGLang kernels vs the trainer's) and of stale rollouts, on the
    # ratio p_trainer / p_rollout of each sampled token (the trainer's recomputed at training time; the rollout's of
    # whichever version sampled the token), both under the rollout's sampling distribution (docs/serving.md). The
    # policy-gradient terms are weighted by the token's own ratio: GRPO's surrogate, OPD's sampled form. OPD's KL
    # forms (full_vocab, topk; in opd and grpo_opd) weight each position's KL by the weight of the token before it,
    # whose draw decided the position (docs/opd.md, "Stale samples").
    # Truncated IS: weight min(ratio, tis_cap), per token or per sequence (the product over the response).
    # auto: token where rollouts can be stale (rollout.max_staleness >= 1) and the trainer recomputes the logprobs,
    # else none. At K=1 without it the embedded GRPO expert trailed K=0 (docs/serving.md).
    tis: Literal["auto", ISLevel] = "auto"
    tis_cap: float = 2.0
    # Two-sided mask (IcePop; verl's rollout_rs): a token (token) or a whole response (sequence: the product)
    # whose ratio lies outside [is_mask_low, is_mask_high] gets weight 0. The defaults are IcePop's.
    is_mask: ISLevel = "none"
    is_mask_low: float = 0.5
    is_mask_high: float = 5.0
    seed: int = 0
    # Response rows per vocabulary-projection chunk ([rows x V] float32 at most); 0: the memory plan picks
    # (unchunked where the budget allows, plan.chunk_rows).
    logit_chunk_rows: int = 0
    # Forward a group's prompt once in the policy's and the reference's passes (docs/shared_prompt.md): the same
    # logprobs and gradients, less work. Off, with the reason logged, with one sample per prompt or an attention the
    # layout cannot express. The ledger bills the same either way (docs/flops.md); perf/hardware_flops shows the work.
    shared_prompt: bool = False
    # A non-finite loss or gradient norm (a teacher's NaN logprobs among the causes) is never applied to the weights:
    # stop names the step and the quantity in one line and ends the run (its checkpoints are all finite); skip
    # leaves that update out and counts it in train/nonfinite_skipped, as large-scale trainers do.
    nonfinite: Literal["stop", "skip"] = "stop"
    stop: StopConfig = field(default_factory=StopConfig)

    def __post_init__(self):
        check_at_least("train", self, 0, "steps")
        check_at_least("train", self, 1, "prompts_per_step", "micro_batch_size", "epochs", "minibatches")
        check_range("train", self, "seed", 0, SEED_MAX)


@dataclass
class EvalConfig:
    every: int = 10
    prompts_per_domain: int = 64  # a fixed held-out subset during training
    final_prompts_per_domain: int = 0  # at the end; 0 means all held-out prompts
    sampled: bool = True  # also report accuracy at temperature 1 (greedy is always reported)
    max_new_tokens: int = 0  # 0 means rollout.max_new_tokens

    def __post_init__(self):
        check_at_least("eval", self, 1, "every")
        for name in ("prompts_per_domain", "final_prompts_per_domain"):
            check_range("eval", self, name, 0, means="0: all held-out prompts")
        check_range("eval", self, "max_new_tokens", 0, means="0: rollout.max_new_tokens")


@dataclass
class CheckpointConfig:
    every: int = 10  # steps between checkpoints
    keep: int = 2  # the newest checkpoints kept

    def __post_init__(self):
        check_range("checkpoint", self, "every", 0, means="0: only at an early stop or a preemption")
        check_range("checkpoint", self, "keep", 0, means="0: all")


@dataclass
class PlanConfig:
    """The device a run is planned for (`megaopd plan`, and the trainer's check before step 1)."""

    memory_gib: float = 0.0  # memory per GPU; 0 = the device's own (CUDA: its total; CPU: not checked)
    gpus_per_node: int = 8
    nodes: int = 1  # trainer nodes (rollout / teacher server nodes are planned per server)
    usable: float = 0.92  # share of memory_gib the plan may fill (CUDA context, allocator fragmentation)
    peak_tflops: float = 989.0  # dense bf16 peak per GPU (H100 / H200 SXM) for the step-time estimate
    mfu: float = 0.35  # assumed model-FLOPs utilisation for the step-time estimate
    prompt_tokens: int = 512  # assumed prompt length (the config knows only max_new_tokens)
    check: bool = True  # refuse at start-up a run that does not fit

    def __post_init__(self):
        check_range("plan", self, "memory_gib", 0, means="0: the device's own")
        check_at_least("plan", self, 1, "gpus_per_node", "nodes")
        # shares of memory and of peak; the step time divides by peak_tflops x mfu
        check_range("plan", self, "usable", 0, 1, low_open=True)
        check_range("plan", self, "mfu", 0, 1, low_open=True)
        check_range("plan", self, "peak_tflops", 0, low_open=True)
        check_at_least("plan", self, 0, "prompt_tokens")


@dataclass
class SandboxConfig:
    """The code sandbox of this process (megaopd.verifiers.sandbox; docs/verifiers.md has the two modes)."""

    # Accept the fallback mode (root without namespaces: uid drop, seccomp, Landlock where the kernel has them)
    # when namespaces do not work here; without it such a machine refuses at start-up.
    allow_fallback: bool = False
    namespaces: bool = True  # False: the fallback mode even where namespaces work (as root), asked for, so accepted
    # The interpreter the sandbox runs programs with ("": this one, else a system python3): one the sandbox uid can
    # run, installed in a world-readable place (not, say, a pyenv under /root).
    python: str = ""


@dataclass
class VerifierConfig:
    # A broken verifier stops the run: a share of samples above max_error_share whose verifier failed (scored 0),
    # error_steps steps in a row, stops it before that step's update. max_error_share=1 never stops.
    max_error_share: float = 0.2
    error_steps: int = 2
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    def __post_init__(self):
        check_range("verifier", self, "max_error_share", 0, 1, means="1: never stops")
        check_at_least("verifier", self, 1, "error_steps")


@dataclass
class RunConfig:
    run_dir: str = "runs/default"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    opd: OPDConfig = field(default_factory=OPDConfig)
    fixed_advantage: FixedAdvantageConfig = field(default_factory=FixedAdvantageConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    # What this run's FLOPs count as when a later run builds on its model: cold_start | training | external.
    counts_as: CountsAs = "training"


class ConfigError(UserError):
    what = "config error"


# Keys that once parsed but did nothing: a config that sets one is refused with what to set instead.
REMOVED_KEYS = {"sft.batch_size": "the rows of one SFT step are train.prompts_per_step"}


# Spellings renamed, read for one release as the new ones: a config (its file, an override, a study's stage
# overrides, a run directory's config.yaml) that uses one loads as if it had the new spelling, with one deprecation
# line (logging.warning) naming it. Keys: (dataclass, old key) -> new key; values: (dataclass, key, old) -> new.
RENAMED_KEYS: dict[tuple[str, str], str] = {
    ("RunConfig", "opsa"): "fixed_advantage",  # the section of the control below
    ("StageConfig", "method"): "role",  # a study stage's label: what the stage is in the study, not a method
}
RENAMED_VALUES: dict[tuple[str, str, Any], Any] = {
    # the paper's fixed-advantage control, which is not its OPSA (that is fixed_advantage.scale=entropy)
    ("TrainConfig", "algorithm", "opsa"): "fixed_advantage",
    # a study stage's label (megaopd.run.study.STAGE_LABELS): the control of OPD, named for its role
    ("StageConfig", "role", "teacher_free"): "control",
}

log = logging.getLogger(__name__)
_pending: list[str] | None = None  # while load_config runs: its deprecation lines, logged once each at its end


def _deprecated(line: str) -> None:
    if _pending is None:
        log.warning(line)
    elif line not in _pending:
        _pending.append(line)


def renamed_value(cls: str, key: str, value: Any) -> Any:
    """The current spelling of a value of ``cls``'s ``key`` (itself where it was not renamed); no deprecation line:
    for what a finished run recorded (its summary.json), read back by the report."""
    try:
        return RENAMED_VALUES.get((cls, key, value), value)
    except TypeError:  # an unhashable value (a list, a mapping) was never renamed
        return value


def _new_key(cls: type, key: str, where: str) -> str:
    new = RENAMED_KEYS.get((cls.__name__, key))
    if new is None:
        return key
    _deprecated(f"config key {where + key!r} is deprecated, renamed {where + new!r}: write {where + new!r} (the old "
                "name is read for one release)")
    return new


def _new_value(cls: type, key: str, value: Any, where: str) -> Any:
    new = renamed_value(cls.__name__, key, value)
    if new is not value:  # not !=: NaN differs from itself
        _deprecated(f"{where + key}={value} is deprecated, renamed {where + key}={new}: write {where + key}={new} "
                    "(the old name is read for one release)")
    return new


def _adopt_renamed(node: dict[str, Any], cls: type, where: str) -> dict[str, Any]:
    """``node`` (a mapping read for ``cls``) with its renamed keys under their new names; where both spellings are
    there (an old config.yaml, an override in the new one) the new one's settings win, key by key."""
    for (owner, old), new in RENAMED_KEYS.items():
        if owner != cls.__name__ or old not in node:
            continue
        value = node.pop(old)
        _new_key(cls, old, where)
        if isinstance(value, dict) and isinstance(node.get(new), dict):
            value = {**value, **node[new]}
        elif new in node:
            value = node[new]
        node[new] = value
    return node


def _unknown_key(key: str, valid: list[str], where: str) -> ConfigError:
    if where + key in REMOVED_KEYS:
        return ConfigError(f"config key {where + key!r} is not used: {REMOVED_KEYS[where + key]}")
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean {where + close[0]!r}?" if close else f"; valid keys: {', '.join(sorted(valid))}"
    return ConfigError(f"unknown config key {where + key!r}{hint}")


def unknown_choice(value: Any, valid_values: tuple, where: str) -> ConfigError:
    """The error for a value outside an enumerated setting's choices: them, and the closest one."""
    close = difflib.get_close_matches(str(value), [str(c) for c in valid_values], n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else "; set one of them"
    valid = ", ".join(repr(c) for c in valid_values)
    return ConfigError(f"{where.rstrip('.')}: {value!r} is not one of {valid}{hint}")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        valid = choices(tp)
        if value not in valid or isinstance(value, bool) != isinstance(valid[0], bool):
            raise unknown_choice(value, valid, where)
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where.rstrip('.')}: expected a mapping, got {value!r}; write it as key: value pairs")
        return from_dict(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            value = [value]
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        items = [_coerce(v, item_tp, where) for v in value]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where.rstrip('.')}: expected a mapping, got {value!r}; write it as key: value pairs")
        return {str(k): v for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        return value
    if tp is float and not isinstance(value, bool):
        try:
            return float(value)  # YAML reads "1e-4" (no dot) as a string
        except (TypeError, ValueError):
            raise ConfigError(f"{where.rstrip('.')}: expected float, got {value!r}; give a number") from None
    if tp in (int, str, bool) and not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{where.rstrip('.')}: expected {tp.__name__}, got {value!r}; give a value of that type")
    return value


def from_dict(cls: type, data: dict[str, Any], where: str = "") -> Any:
    """Build dataclass `cls` from a nested dict, checking every key and type."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in _adopt_renamed(dict(data), cls, where).items():
        if key not in hints:
            raise _unknown_key(key, names, where)
        kwargs[key] = _coerce(_new_value(cls, key, value, where), hints[key], f"{where}{key}.")
    return cls(**kwargs)


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def apply_override(data: dict[str, Any], override: str, cls: type = RunConfig) -> None:
    """Apply ``a.b.c=value`` (value parsed as YAML) to a nested dict, checking the path against `cls`."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} is not of the form key.sub=value; write it so")
    dotted, raw = override.split("=", 1)
    value = yaml.safe_load(raw) if raw != "" else ""
    parts = dotted.strip().split(".")
    node, tp, where = data, cls, ""
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if dataclasses.is_dataclass(tp):
            hints = typing.get_type_hints(tp)
            _adopt_renamed(node, tp, where)  # an old spelling already in the mapping moves under the new one
            part = _new_key(tp, part, where)
            if part not in hints:
                raise _unknown_key(part, list(hints), where)
            tp = hints[part]
        elif typing.get_origin(tp) is dict:
            tp = Any  # free-form mapping (e.g. opd.teachers.<domain>)
        else:
            raise ConfigError(f"cannot set {dotted!r}: {where.rstrip('.')} is not a mapping; set one of its own keys")
        if last:
            node[part] = value
        else:
            node = node.setdefault(part, {})
        where += part + "."


def load_config(path: str | Path | None, overrides: list[str] = (), cls: type = RunConfig) -> Any:
    global _pending
    outer, _pending = _pending, []
    try:
        return _load(path, overrides, cls)
    finally:
        lines, _pending = _pending, outer
        for line in lines:
            _deprecated(line)


def _load(path: str | Path | None, overrides: list[str], cls: type) -> Any:
    data: dict[str, Any] = {}
    if path:
        require_file(path, "config file", ConfigError)
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML ({' '.join(str(e).split())}); fix the file") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a config file must be a YAML mapping (key: value lines); fix the file")
    for override in overrides:
        apply_override(data, override, cls)
    return from_dict(cls, data)


def to_dict(cfg: Any) -> dict[str, Any]:
    return _plain(dataclasses.asdict(cfg))


def save_config(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
