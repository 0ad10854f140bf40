"""Plan a run's memory per GPU rank and the cost of one step before it starts (the trainer's check before step 1,
and `megaopd plan`, whose command and study-level planning are in ``megaopd.run.study_plan``).

A model is read from its directory's config.json, or, when the directory is not on this machine, from the real-shape
preset its name starts with (``/models/Qwen3-1.7B`` -> ``qwen3-1.7b``; a study stage's ``{out}/<stage>/final`` has
the shape of that stage's model). Memory is planned per phase, since the rollout's KV cache and the training
activations never exist at once; what persists (weights, masters, optimizer state, frozen models) counts in every
phase. The formulas, per rank (b = bytes of model.dtype):

* parameters and optimizer tensors: exact element counts of the HF architecture; Adam keeps two tensors per weight
  and one fp32 step counter per tensor; masters (fp32) only when model.master_dtype differs from model.dtype.
* activations per micro-batch: what the HF Qwen3 / Llama forward saves for backward with the SDPA (flash) kernel,
  read off the code and checked on CPU against autograd's saved tensors (tests/test_plan.py); with
  model.activation_checkpointing the layer inputs plus one layer's. With train.shared_prompt, over the micro-batch's
  flat sequence (whole groups: each prompt once), with each response's keys and values over its prompt beside it.
  The Megatron backend uses the same per-token figure divided by TP, with PP micro-batches in flight on the first
  stage (an estimate: TE kernels differ).
* logits / KL workspace: a chunk of train.logit_chunk_rows response rows x V (0, the default: the most rows that fit
  beside the rest of the train phase, so the whole micro-batch unchunked wherever it fits; on CPU, without a device
  budget, the most that fit in CPU_CHUNK_BYTES) (Megatron: whole sequences, at least
  one, every position, x V/tp), at the peak of its backward: the fp32 log-softmax and its gradient, with the head's
  output and its gradient's cast (2b + 8 bytes per entry), or in fp32 the logits themselves (12); Megatron's
  vocab-parallel log-softmax keeps the shifted logits and their exponential instead (16, measured in fp32 only);
  a KL over the vocabulary adds 8 (the full form: the teacher's chunk and the student's exponential; the top-k
  form: the student's probabilities and the tail's mask or scatter). Measured on CPU
  (tests/test_plan_workspace.py: fp32 and bf16; tests/test_megatron_device.py).
* full-vocabulary OPD teacher rows (HF backend): every response row's [H] hidden state of its teacher's one forward,
  kept from scoring to the end of the update (b bytes each, the widest teacher's H). Where they do not fit and the
  run fits without them, ``check_run`` plans the teacher re-run per micro-batch instead (``Plan.teacher_recompute``;
  hardware work the ledger does not bill, ``flops.teacher_passes``).
* rollout KV cache (local engine): rollout.batch_prompts x samples x (plan.prompt_tokens + max_new_tokens)
  positions, plus the prefill cache the fused decoder is seeded from and its packed weight copies.
Step FLOPs are the method's (``megaopd.objectives.methods``) with every prompt plan.prompt_tokens long, every response at
max_new_tokens and every prompt routed to the costliest teacher (an upper bound), and the time assumes plan.mfu of
plan.peak_tflops on every trainer GPU for them plus the teachers' forced re-runs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

from megaopd.accounting import flops
from megaopd.config import ConfigError, RunConfig, TrainConfig
from megaopd.errors import ModelError, UserError
from megaopd.objectives.methods import method
from megaopd.accounting.shapes import REAL_SHAPES, real_model_config, real_shape

log = logging.getLogger(__name__)
GIB = 2**30
CPU_CHUNK_BYTES = GIB  # without a device budget (CPU): the room one logits/KL chunk may take
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# The families whose forward ``Arch.activation_bytes`` is read off and checked against (autograd's saved tensors,
# tests/test_plan.py). Others keep more (measured on tiny ones: Phi-3 12%, OLMo 2 14-30%, Gemma 3 28-44%, Gemma 2's
# eager attention 35-84% and growing with the sequence), so for them the figure is a lower bound.
ACTIVATIONS_READ_OFF = ("llama", "mistral", "qwen2", "qwen3")


class PlanError(UserError):
    """A run that does not fit: names the phase, the component and the setting to change."""

    what = "plan error"


@dataclass(frozen=True)
class Arch:
    """What memory depends on (Qwen2/Qwen3/Llama dense decoders): the model's shape as ``flops.ModelShape`` reads it
    from an HF config.json (the one reader of a model's shape), and the parameters the matmul count leaves out."""

    shape: flops.ModelShape
    tied: bool
    qk_norm: bool  # Qwen3's per-head q/k RMSNorm
    attn_bias: bool  # Qwen2's q/k/v biases
    family: str  # the config's model_type

    @classmethod
    def from_hf(cls, c: dict) -> "Arch":
        return cls(flops.ModelShape.from_hf_config(c), bool(c.get("tie_word_embeddings", False)),
                   c.get("model_type") == "qwen3", bool(c.get("attention_bias", c.get("model_type") == "qwen2")),
                   c.get("model_type", ""))

    @property
    def layers(self) -> int:
        return self.shape.n_layers

    @property
    def hidden(self) -> int:
        return self.shape.d_model

    @property
    def heads(self) -> int:
        return self.shape.n_heads

    @property
    def kv_heads(self) -> int:
        return self.shape.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.shape.head_dim

    @property
    def ffn(self) -> int:
        return self.shape.d_ff

    @property
    def vocab(self) -> int:
        return self.shape.vocab_size

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        d = self.hidden
        attn = d * (self.q + 2 * self.kv) + self.q * d + (self.q + 2 * self.kv) * self.attn_bias
        return attn + 2 * self.head_dim * self.qk_norm + 3 * d * self.ffn + 2 * d  # + two RMSNorms

    def params(self, layers: int | None = None) -> int:
        layers = self.layers if layers is None else layers
        return layers * self.layer_params() + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def tensors(self) -> int:
        per_layer = 4 + 3 * self.attn_bias + 2 * self.qk_norm + 3 + 2
        return self.layers * per_layer + 2 + (0 if self.tied else 1)

    def activation_bytes(self, tokens: int, seq: int, b: int, layers: int | None = None) -> int:
        """Saved-for-backward bytes of the body forward over ``tokens`` tokens in rows of ``seq`` positions."""
        layers = self.layers if layers is None else layers
        d, q, kv = self.hidden, self.q, self.kv
        norm = (4 + 2 * b) * d + 4  # fp32 input and rsqrt, the cast, the scaled output
        attn = 2 * b * (q + kv) + 4 * self.heads  # SDPA keeps q, k, v, its output and the fp32 logsumexp
        if self.qk_norm:
            attn += (4 + b) * (q + kv) + 4 * (self.heads + self.kv_heads)
        per_layer = 2 * norm + attn + 4 * b * self.ffn  # gate, silu(gate), up, and their product
        overhead = 8 + (4 + b) * d + 4  # the token ids and the final norm
        return tokens * (layers * per_layer + overhead) + seq * 2 * self.head_dim * b  # + RoPE cos / sin

    def checkpointed_activation_bytes(self, tokens: int, seq: int, b: int, layers: int | None = None) -> int:
        """With each layer recomputed in backward: the layer inputs, plus one layer's saved tensors at a time."""
        layers = self.layers if layers is None else layers
        one_layer = self.activation_bytes(tokens, seq, b, 1) - self.activation_bytes(tokens, seq, b, 0)
        return self.activation_bytes(tokens, seq, b, 0) + tokens * layers * self.hidden * b + one_layer

    def shared_activation_bytes(self, groups: int, samples: int, prompt: int, response: int, b: int,
                                layers: int | None = None, checkpointed: bool = False, per_group: bool = False) -> int:
        """The same over a shared-prompt micro-batch (``megaopd.models.shared_prompt``, the HF backend): the flat sequence of
        groups x prompt + samples x response tokens, and beyond its per-token tensors, per layer the joined attention
        output and each response's keys and values over prompt + response (its KV heads), and the responses' mask:
        in the one masked call (CPU) one additive row block per sample, a tensor that every layer shares; where the
        responses go by group (``per_group``: a GPU's, whose FlashAttention takes no mask, so there it is a bound)
        one per group in each layer. Checkpointed: one layer's extra at a time. A micro-batch's groups are taken
        equal (a GRPO group, or one part of it): groups of unequal size also keep each sample's group index (8 bytes
        a sample) for the gather that repeats the prompt's keys (``PromptGroups.response_keys``)."""
        layers = self.layers if layers is None else layers
        tokens = groups * prompt + samples * response
        mask_rows = response * (prompt + response) * b
        per_layer = (tokens * self.q + 2 * samples * (prompt + response) * self.kv) * b \
            + (groups * mask_rows if per_group else 0)
        shared_mask = 0 if per_group else samples * mask_rows
        saved = self.checkpointed_activation_bytes if checkpointed else self.activation_bytes
        return saved(tokens, tokens, b, layers) + (1 if checkpointed else layers) * per_layer + shared_mask

    def kv_bytes(self, positions: int, b: int) -> int:
        return positions * self.layers * 2 * self.kv * b

    def flop_shape(self) -> flops.ModelShape:
        return self.shape


def resolve_arch(path: str, aliases: dict[str, str] | None = None) -> Arch:
    path = (aliases or {}).get(path.rstrip("/"), path)
    if (Path(path) / flops.HF_CONFIG).exists():
        try:
            return Arch.from_hf(flops.read_hf_config(path))
        except ModelError as e:  # an architecture megaopd cannot bill: name the model (a teacher's, maybe)
            raise ModelError(f"{path}: {e}") from None
    name = Path(path.rstrip("/")).name.lower()
    shape = real_shape(name)
    if shape is None:
        matches = [k for k in REAL_SHAPES if name.startswith(k)]
        if not matches:
            raise PlanError(f"cannot plan model {path!r}: no config.json there, and its name starts with no known "
                            f"shape ({', '.join(sorted(REAL_SHAPES))}); give a model directory, or a name that "
                            "starts with one of them")
        shape = REAL_SHAPES[max(matches, key=len)]
    return Arch.from_hf(real_model_config(shape, 0, 0, 0).to_dict())


@dataclass
class Item:
    component: str
    phase: str  # all | rollout | score | train
    bytes: float
    setting: str  # what to change when this is what does not fit
    knob: tuple[str, int] | None = None  # (integer setting, its value) to search for the largest that fits


@dataclass
class Plan:
    title: str
    layout: str
    budget: float | None  # usable bytes per GPU; None: not checked (CPU)
    items: list[Item]
    step_flops: int
    step_tokens: int
    step_seconds: float
    servers: list[str]  # lines about GPUs outside the trainer's (SGLang rollout / teacher servers)
    cfg: RunConfig | None = None  # what it was built from, to search a knob's value that fits
    aliases: dict[str, str] | None = None
    teacher_recompute: bool = False  # the full form's teacher rows re-run per micro-batch instead of kept
    chunk_rows: int = 0  # most response rows per vocabulary projection (train.logit_chunk_rows, or what fits)

    def totals(self) -> dict[str, float]:
        fixed = sum(i.bytes for i in self.items if i.phase == "all")
        phases = ("rollout", "score", "train")
        return {p: fixed + sum(i.bytes for i in self.items if i.phase == p) for p in phases}

    def problem(self) -> str | None:
        if self.budget is None:
            return None
        phase, total = max(self.totals().items(), key=lambda kv: kv[1])
        if total <= self.budget:
            return None
        worst = max((i for i in self.items if i.phase in (phase, "all")), key=lambda i: i.bytes)
        advice = worst.setting
        if worst.knob and self.cfg is not None:
            fits = _largest_fitting(self.cfg, self.aliases, self.budget, *worst.knob, phase)
            advice += f" (now {worst.knob[1]}; {fits} fits)" if fits else f" (now {worst.knob[1]}; even 1 does not fit)"
        return (f"{self.title}: the {phase} phase needs {total / GIB:.1f} GiB per GPU, more than the "
                f"{self.budget / GIB:.1f} GiB usable; its largest component is {worst.component} "
                f"({worst.bytes / GIB:.1f} GiB): {advice}")

    def table(self) -> str:
        lines = [f"== {self.title}: {self.layout}", f"{'component':<44}{'phase':>8}{'GiB/rank':>11}  setting"]
        for i in self.items:
            lines.append(f"{i.component:<44}{i.phase:>8}{i.bytes / GIB:>11.2f}  {i.setting}")
        budget = f"{self.budget / GIB:.1f} GiB usable" if self.budget else "not checked (no device memory given)"
        lines.append("peak by phase: " + ", ".join(f"{p} {v / GIB:.1f}" for p, v in self.totals().items())
                     + f" GiB of {budget}")
        lines += self.servers
        lines.append(f"one step: {self.step_tokens:,} tokens, {self.step_flops:.3e} FLOPs, "
                     f"~{self.step_seconds:.0f} s at the assumed MFU")
        problem = self.problem()
        lines.append(f"DOES NOT FIT: {problem}" if problem else "fits")
        return "\n".join(lines)


def _largest_fitting(cfg: RunConfig, aliases, budget, setting: str, current: int, phase: str) -> int:
    """The largest value < current of an integer setting (halving) with which ``phase`` fits; 0 if none does."""
    section, key = setting.split(".")
    value = current // 2
    while value >= 1:
        trial = replace(cfg, **{section: replace(getattr(cfg, section), **{key: value})})
        if build_plan(trial, aliases, budget).totals()[phase] <= budget:
            return value
        value //= 2
    return 0


def build_plan(cfg: RunConfig, aliases: dict[str, str] | None = None, budget: float | None = None,
               title: str = "", teacher_recompute: bool = False) -> Plan:
    """The per-rank memory plan of one run config; ``budget``: usable bytes per GPU (None: not checked);
    ``teacher_recompute``: plan the full form's teacher rows re-run per micro-batch instead of kept for the step."""
    p, t, r, m = cfg.plan, cfg.train, cfg.rollout, cfg.model
    spec = method(t.algorithm)
    n = spec.samples_per_prompt(cfg.rollout)
    arch = resolve_arch(m.path, aliases)
    b = BYTES[m.dtype]
    megatron = m.backend == "megatron"
    tp, pp = (m.megatron.tp, m.megatron.pp) if megatron else (1, 1)
    world = p.nodes * p.gpus_per_node if megatron else 1
    dp = max(world // (tp * pp), 1)
    layers = math.ceil(arch.layers / pp)
    # A rank's share of the parameters: its layers and the embedding (and untied head) split over TP.
    local = (layers * arch.layer_params() + arch.vocab * arch.hidden * (1 if arch.tied else 2)) / tp \
        if megatron else arch.params()
    mixed = m.master_dtype != m.dtype or (megatron and b != 4)
    master_b = 4 if megatron else BYTES[m.master_dtype]
    shard = dp if megatron and m.megatron.distributed_optimizer else 1
    layout = (f"megatron tp={tp} pp={pp} dp={dp} on {world} GPUs ({p.nodes} node(s) x {p.gpus_per_node})"
              if megatron else f"hf backend, one GPU ({m.device})")
    fits_more = "model.backend=megatron with model.megatron.tp/pp" if not megatron else "raise model.megatron.tp/pp"

    items = [Item(f"weights ({m.dtype})", "all", local * b, fits_more)]
    if mixed:
        items.append(Item("master weights (fp32)", "all", local * master_b / shard, fits_more))
    steps = 0 if megatron else arch.tensors() * 4
    items.append(Item("optimizer state (Adam, 2 moments)", "all", 2 * local * master_b / shard + steps,
                      "model.megatron.distributed_optimizer=true" if megatron else fits_more))
    grad_b = 4 if megatron else (master_b if mixed else b)
    items.append(Item("gradients", "all", local * grad_b, fits_more))  # kept from one update to the next

    seq = p.prompt_tokens + r.max_new_tokens
    rows_per_mb = min(t.micro_batch_size, t.prompts_per_step * n)
    tokens = rows_per_mb * seq
    in_flight = min(pp, math.ceil(t.prompts_per_step * n / (rows_per_mb * dp))) if megatron else 1
    checkpointed = m.activation_checkpointing and not megatron
    # whole groups per micro-batch (a group larger than one: in parts)
    if t.shared_prompt and spec.shares_prompts(cfg.rollout):
        groups = max(1, rows_per_mb // n)
        rows_per_mb = min(groups * n, rows_per_mb)
        tokens = groups * p.prompt_tokens + rows_per_mb * r.max_new_tokens
        from megaopd.models.hf_shared_prompt import responses_per_group

        acts = arch.shared_activation_bytes(groups, rows_per_mb, p.prompt_tokens, r.max_new_tokens, b, layers,
                                            checkpointed, responses_per_group(m.device))
        shape = f"shared prompts: {groups} x {p.prompt_tokens} + {rows_per_mb} x {r.max_new_tokens} tokens"
    else:
        saved = arch.checkpointed_activation_bytes if checkpointed else arch.activation_bytes
        acts, shape = saved(tokens, seq, b, layers), f"{rows_per_mb} x {seq} tokens"
    if arch.family not in ACTIVATIONS_READ_OFF:
        log.warning("%s: its activations are planned as a Llama's, a lower bound for a %s model (it keeps more for "
                    "backward); leave room, or set model.activation_checkpointing=true", m.path, arch.family)
        shape += f", a lower bound for {arch.family}"
    items.append(Item(f"activations ({shape})", "train", acts * in_flight / tp,
                      "lower train.micro_batch_size" + ("" if m.activation_checkpointing or megatron
                                                         else ", or model.activation_checkpointing=true"),
                      ("train.micro_batch_size", t.micro_batch_size)))
    workspace_at = len(items)  # the logits chunk is sized last, from the room everything else leaves

    if r.engine == "local" and not megatron:
        prompts = min(r.batch_prompts, t.prompts_per_step)
        rows = prompts * n
        kv = arch.kv_bytes(rows * seq, b) + arch.kv_bytes(rows * p.prompt_tokens, b)
        knob = ("rollout.batch_prompts", prompts)
        items.append(Item(f"rollout KV cache ({rows} x {seq})", "rollout", kv, "lower rollout.batch_prompts", knob))
        packed = arch.layers * arch.hidden * (arch.q + 2 * arch.kv + 2 * arch.ffn) * b
        items.append(Item("rollout packed decode weights", "rollout", packed, "rollout.engine=sglang"))
        items.append(Item("rollout sampling workspace", "rollout", rows * arch.vocab * (b + 16),
                          "lower rollout.batch_prompts", knob))
    servers = []
    if r.engine == "sglang" or spec.teacher_servers(cfg.opd):
        colocated = r.engine == "sglang" and r.sglang.sync == "tensor"
        share = _mem_fraction(r.sglang.server_args) if colocated else 0.0
        total = budget / p.usable if budget else 0.0
        items.append(Item("SGLang servers' share", "all", share * total,
                          "lower --mem-fraction-static in rollout.sglang.server_args" if colocated
                          else "servers on their own GPUs"))
        servers.append(f"SGLang servers: weights {arch.params() * b / GIB:.1f} GiB each, the rest of their GPUs "
                       f"for the KV cache ({'colocated with the trainer' if colocated else 'own GPUs'})")

    teacher_tp = (m.megatron.teacher_tp or tp) if megatron else 1
    teacher_b = BYTES[cfg.opd.teacher_dtype or m.dtype]
    for route, path in sorted(spec.local_teachers(cfg.opd).items()):
        teacher = resolve_arch(path, aliases)
        items.append(Item(f"teacher {route} ({teacher.params() / 1e9:.2f}B) {cfg.opd.teacher_dtype or m.dtype}",
                          "all", teacher.params() * teacher_b / teacher_tp,
                          "opd.teacher_engine=sglang (sampled form)" if not megatron
                          else "raise model.megatron.teacher_tp"))
    if spec.uses_reference(cfg.grpo):
        items.append(Item("reference model", "all", local * b, fits_more))
    keeps_rows = keeps_teacher_rows(cfg) and not teacher_recompute
    if keeps_rows:
        rows = t.prompts_per_step * n * r.max_new_tokens
        hidden = max(resolve_arch(v, aliases).hidden for v in spec.teachers(cfg.opd).values())
        items.append(Item(f"teacher rows kept for the update ({rows} x {hidden})", "train", rows * hidden * teacher_b,
                          "re-run per micro-batch when they do not fit (automatic)"))

    unit = seq if megatron else 1  # positions per chunk unit: Megatron's output layer projects whole sequences
    units = rows_per_mb if megatron else rows_per_mb * r.max_new_tokens  # one chunk: the micro-batch unchunked
    per_entry = (16 if megatron else 2 * b + 8 if b < 4 else 12) + (8 if spec.vocab_kl(cfg.opd) else 0)
    per_unit = unit * (arch.vocab * per_entry / tp + arch.hidden * b)
    if t.logit_chunk_rows:  # the override
        bound = max(1, t.logit_chunk_rows // unit) * unit
    else:  # the most rows that fit beside the rest of the train phase: the micro-batch unchunked where it fits
        room = budget - sum(i.bytes for i in items if i.phase in ("all", "train")) if budget else CPU_CHUNK_BYTES
        bound = max(1, int(room // per_unit)) * unit
    # The plan's own micro-batch takes `chunk` rows; the policy splits only past `bound`, so responses longer than
    # rollout.max_new_tokens (SFT targets) still project in one chunk while they fit.
    chunk = min(bound, units * unit)
    chunk_setting = "set train.logit_chunk_rows lower than the plan's pick"
    items[workspace_at:workspace_at] = [
        Item(f"logits/KL workspace ({chunk} rows x {arch.vocab})", "train", chunk // unit * per_unit, chunk_setting),
        Item("forward workspace (no grad)", "score",
             tokens * 3 * arch.ffn * b / tp + chunk * arch.vocab * (b + 8) / tp, chunk_setting)]

    prompt_lens = [p.prompt_tokens] * t.prompts_per_step
    response_lens = [r.max_new_tokens] * (t.prompts_per_step * n)
    # Every prompt routed to the costliest teacher: an upper bound, like the lengths.
    shapes = [resolve_arch(v, aliases).flop_shape() for v in spec.teachers(cfg.opd).values()]
    teachers = [max(shapes, key=lambda s: s.matmul_params)] * t.prompts_per_step if shapes else None
    parts = spec.step_flops(t, r, cfg.grpo, arch.flop_shape(), teachers, prompt_lens, response_lens)
    step = sum(parts.values())
    reruns = flops.teacher_passes(cfg.opd.form, t.epochs, recompute=not keeps_rows) - 1 if spec.teacher_term else 0
    seconds = (step + reruns * parts["teacher"]) / (world * p.peak_tflops * 1e12 * p.mfu)
    return Plan(title or cfg.run_dir, layout, budget, items, step, t.prompts_per_step * n * seq,
                seconds, servers, cfg, aliases, teacher_recompute, bound)


def keeps_teacher_rows(cfg: RunConfig) -> bool:
    """Whether the run's teachers keep their full-vocabulary rows for the step (HF in-process teachers)."""
    return (method(cfg.train.algorithm).local_teachers(cfg.opd) != {} and cfg.opd.form == "full_vocab"
            and cfg.model.backend == "hf")


def _mem_fraction(server_args: list[str]) -> float:
    """--mem-fraction-static from the server flags; SGLang's own default on a large GPU otherwise."""
    for i, arg in enumerate(server_args):
        if arg.startswith("--mem-fraction-static"):
            return float(arg.split("=", 1)[1] if "=" in arg else server_args[i + 1])
    return 0.88


def device_budget(cfg: RunConfig) -> float | None:
    """Usable bytes per GPU: plan.memory_gib, else the CUDA device's own memory, else None (CPU: not checked)."""
    gib = cfg.plan.memory_gib
    if gib <= 0 and cfg.model.device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            gib = torch.cuda.get_device_properties(torch.device(cfg.model.device)).total_memory / GIB
    return gib * GIB * cfg.plan.usable if gib > 0 else None


def check_chunk_rows(train: TrainConfig) -> None:
    if train.logit_chunk_rows < 0:
        raise ConfigError(f"train.logit_chunk_rows must be >= 0 (0: the memory plan picks), got "
                          f"{train.logit_chunk_rows}; set 0 or a positive number of rows")


def chunk_rows(cfg: RunConfig, plan: Plan | None = None) -> int:
    """The run's rows per vocabulary-projection chunk: train.logit_chunk_rows (``check_chunk_rows``), else the plan's
    pick (``plan``, or one built for the run's device)."""
    if cfg.train.logit_chunk_rows or plan is not None:
        return cfg.train.logit_chunk_rows or plan.chunk_rows
    try:
        return build_plan(cfg, budget=device_budget(cfg)).chunk_rows
    except KeyError as e:  # an architecture the planner cannot read: the bound of a 150k vocabulary in a GiB
        log.warning("not planning %s (its config.json has no %s): logit chunks of 1024 rows", cfg.model.path, e)
        return 1024


def check_run(cfg: RunConfig) -> Plan | None:
    """The trainer's start-up check: raises PlanError when the run cannot fit the device it is planned for."""
    budget = device_budget(cfg)
    if not cfg.plan.check or budget is None:
        return None
    try:
        plan = build_plan(cfg, budget=budget)
    except KeyError as e:  # an architecture whose config.json lacks a key the planner reads: not planned
        log.warning("not planning %s: its config.json has no %s", cfg.model.path, e)
        return None
    problem = plan.problem()
    if problem and keeps_teacher_rows(cfg):  # the teacher rows may be what does not fit: re-run them instead
        rerun = build_plan(cfg, budget=budget, teacher_recompute=True)
        if rerun.problem() is None:
            log.info("%s: the full-vocabulary teacher rows do not fit beside the update; the teacher re-runs per "
                     "micro-batch (hardware FLOPs, not billed)", cfg.run_dir)
            return rerun
    if problem:
        log.error("the plan of %s:\n%s", cfg.run_dir, plan.table())
        raise PlanError(f"refusing to start: {problem}")
    return plan
