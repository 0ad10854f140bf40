"""A run's settings derived and refused in one place: ``resolve_run`` turns a loaded config into the run that
``megaopd train`` does (``config.yaml`` holds its config). ``megaopd plan``, ``megaopd submit`` and ``megaopd study``
resolve every stage too, so a config the trainer would refuse is refused before it is queued, in the same line.

A refusal that reads the config only runs everywhere. One that reads the run's inputs (its data files and the splits
the stop rule reads, a teacher's or a cover partner's finished run, the model directory and the device the memory
plan checks, the tokenizers that tell a teacher of another vocabulary) runs where they exist (``inputs_exist``: the
trainer): a study's later stages start from the models and data that its assets job and its earlier stages make,
so at submission they are not there yet.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from megaopd.accounting.flops import HF_CONFIG
from megaopd.models.hf_shared_prompt import hf_attention_problem
from megaopd.teachers.cross_tokenizer import alignment_tokenizers
from megaopd.config import ConfigError, DataConfig, RunConfig
from megaopd.data.rows import Row, load_split
from megaopd.errors import DataError, ModelError, UserError, require_file
from megaopd.objectives.methods import Method, method
from megaopd.objectives.losses import check_fixed_advantage, check_opd
from megaopd.rollout.local import policy_temperature, reported_sampling
from megaopd.run.plan import Plan, check_chunk_rows, check_run, chunk_rows
from megaopd.run.stopping import StopRule, check_stop

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Splits:
    train: list[Row]
    validation: list[Row]
    eval: list[Row]


@dataclass(frozen=True)
class ResolvedRun:
    cfg: RunConfig  # what the run does
    method: Method
    aligned: dict[str, str]  # route -> tokenizer directory of each teacher of another tokenizer
    # Read from the run's inputs (None without them):
    splits: Splits | None = None
    stop: StopRule | None = None
    plan: Plan | None = None  # the memory plan checked against the device (None on CPU too)


def resolve_run(cfg: RunConfig, *, inputs_exist: bool = True) -> ResolvedRun:
    """The run ``cfg`` describes, or the first refusal (a ``UserError``) of what it asks for; with
    ``inputs_exist=False`` the checks that read the run's inputs are left to the run."""
    spec = method(cfg.train.algorithm)
    cfg = resolve_shared_prompt(resolve_tis(cfg, spec), spec)
    check_is_correction(cfg, spec)
    check_temperature(cfg, spec)
    aligned = alignment_tokenizers(cfg.model.path, cfg.opd, inputs_exist) if spec.teacher_term else {}
    if spec.teacher_term:
        check_opd(cfg.opd, cfg.model.backend, aligned)
    if spec.self_term:
        check_fixed_advantage(cfg.fixed_advantage, cfg.train.recompute_old_logprobs)
    check_stop(cfg.train.stop, spec.teachers(cfg.opd))
    check_chunk_rows(cfg.train)
    if not inputs_exist:
        return ResolvedRun(cfg, spec, aligned)
    splits = read_splits(cfg.data)
    check_model_dirs(cfg, spec)
    train_domains = sorted({r.domain for r in splits.train})
    stop = StopRule(cfg.train.stop, cfg.train.steps, spec.teachers(cfg.opd), train_domains,
                    sorted({r.domain for r in splits.validation}), 0.0 if spec.rollouts else cfg.sft.stop_at_accuracy)
    # Refuses a run that cannot fit the device it is planned for; sizes the logit chunks.
    plan = check_run(cfg)
    cfg = replace(cfg, train=replace(cfg.train, logit_chunk_rows=chunk_rows(cfg, plan)))
    return ResolvedRun(cfg, spec, aligned, splits, stop, plan)


def resolve_stage(cfg: RunConfig, stage: str, hint: str = "") -> ResolvedRun:
    """A study stage's run before its upstream stages have made its inputs; a refusal names the stage (and ends with
    ``hint``: what the launcher added that could be dropped instead)."""
    try:
        return resolve_run(cfg, inputs_exist=False)
    except UserError as e:
        raise type(e)(f"stage {stage}: {e}{hint}") from None


def resolve_shared_prompt(cfg: RunConfig, spec: Method) -> RunConfig:
    """``train.shared_prompt`` as the run will do it: off, with the reason logged once, where it cannot apply
    (``shared_prompt_problem``). Before the config is saved: config.yaml holds what the run does."""
    if not cfg.train.shared_prompt:
        return cfg
    reason = shared_prompt_problem(cfg, spec)
    if reason is None:
        return cfg
    log.info("train.shared_prompt: off: %s", reason)
    return replace(cfg, train=replace(cfg.train, shared_prompt=False))


def shared_prompt_problem(cfg: RunConfig, spec: Method) -> str | None:
    """Why ``train.shared_prompt`` cannot apply to the run ``cfg`` describes, ``spec`` its algorithm's row (None: it
    can): one sample per prompt; the Transformer Engine layer spec; an HF model whose attention the layout cannot
    express (``megaopd.models.hf_shared_prompt.hf_attention_problem``)."""
    if not spec.shares_prompts(cfg.rollout):
        return "one sample per prompt, so no prompt is shared"
    if cfg.model.backend == "megatron":
        from megaopd.models.megatron.fp8 import use_te_spec

        if use_te_spec(cfg.model.megatron):
            return ("the Transformer Engine layer spec: its fused attention is not routed per segment (use "
                    "model.megatron.transformer_engine=false)")
    config = Path(cfg.model.path) / HF_CONFIG
    if config.exists():
        from transformers import AutoConfig

        return hf_attention_problem(AutoConfig.from_pretrained(config.parent))
    return None


def resolve_tis(cfg: RunConfig, spec: Method) -> RunConfig:
    """``train.tis=auto`` made concrete: token-level truncated IS when the rollouts can be one or more weight versions
    old (rollout.max_staleness >= 1) and the trainer recomputes the logprobs the ratio needs; none otherwise (K=0: the
    behaviour policy is the trainer's own, today's synchronous loop bit for bit; without the recomputation the PPO
    ratio is against the behaviour logprobs already)."""
    if cfg.train.tis != "auto":
        return cfg
    stale = spec.rollouts and cfg.rollout.max_staleness >= 1 and cfg.train.recompute_old_logprobs
    return replace(cfg, train=replace(cfg.train, tis="token" if stale else "none"))


def check_is_correction(cfg: RunConfig, spec: Method) -> None:
    """Refuses, before any model loads, IS settings that would weigh nothing, ill-formed, or compare unlike logprobs;
    ``cfg``'s train.tis resolved (``resolve_tis``)."""
    train = cfg.train
    for name in ("tis", "is_mask"):
        level = getattr(train, name)
        # (auto resolves to none there: resolve_tis)
        if level not in ("none", "auto") and spec.rollouts and not train.recompute_old_logprobs:
            raise ConfigError(f"train.{name}={level} weights by p_trainer / p_rollout, and "
                              "train.recompute_old_logprobs=false takes the rollout's logprobs for the trainer's, so "
                              f"every weight would be 1: set train.recompute_old_logprobs=true, or train.{name}=none")
    if train.tis != "none" and not train.tis_cap > 0:
        raise ConfigError(f"train.tis_cap must be > 0 (the largest IS weight), got {train.tis_cap:g}; set e.g. 2")
    if train.is_mask != "none" and not 0 <= train.is_mask_low < 1 < train.is_mask_high:
        raise ConfigError(f"train.is_mask keeps ratios in [train.is_mask_low, train.is_mask_high], which must hold 1 "
                          f"(0 <= low < 1 < high), got [{train.is_mask_low:g}, {train.is_mask_high:g}]; set e.g. "
                          "train.is_mask_low=0.5 train.is_mask_high=5 (IcePop's)")
    if not spec.rollouts:
        return
    rollout = cfg.rollout
    reported = reported_sampling(rollout.engine, rollout.temperature, rollout.top_p)
    loss = policy_temperature(rollout.temperature)
    if not train.recompute_old_logprobs and reported != (loss, 1.0):
        raise ConfigError(f"train.recompute_old_logprobs=false makes the rollout logprobs the PPO ratio's old "
                          f"logprobs, but at rollout.temperature={rollout.temperature:g} rollout.top_p="
                          f"{rollout.top_p:g} they are of the sampling distribution, not the loss's (temperature "
                          f"{loss:g}, no top-p cut); set train.recompute_old_logprobs=true, or rollout.top_p=1")
    if train.recompute_old_logprobs and cfg.model.backend == "megatron" and reported[1] < 1.0:
        raise ConfigError(f"model.backend=megatron scores at a temperature only, and the local engine's logprobs are "
                          f"cut to rollout.top_p={rollout.top_p:g}'s nucleus, so the trainer cannot take its own "
                          "like-for-like; set rollout.top_p=1, or rollout.engine=sglang (its logprobs skip the cut)")


def check_temperature(cfg: RunConfig, spec: Method) -> None:
    """Refuses, before any model loads, teachers that would score under another distribution than the one the
    student's logprobs are taken at (``rollout.policy_temperature``, docs/opd.md "One temperature"), so that the
    sampled-token advantage and the KL compare one temperature; the trainer takes every student logprob at it."""
    if not spec.teacher_term:
        return
    opd, rollout = cfg.opd, cfg.rollout
    temperature = policy_temperature(rollout.temperature)
    if temperature != 1.0 and not opd.match_sampling:
        raise ConfigError(f"opd.match_sampling=false scores the teachers at temperature 1, but the student's logprobs "
                          f"are taken at rollout.temperature={temperature:g}: set opd.match_sampling=true")
    top_p = reported_sampling("local", rollout.temperature, rollout.top_p)[1] if opd.match_sampling else 1.0
    if opd.teacher_engine == "sglang" and (temperature, top_p) != (1.0, 1.0):
        raise ConfigError(f"opd.teacher_engine=sglang scores at temperature 1 without a top-p cut, but the rollout "
                          f"samples at rollout.temperature={temperature:g} rollout.top_p={top_p:g}: roll out at 1 / "
                          "1, or use opd.teacher_engine=local")
    if opd.teacher_engine == "local" and cfg.model.backend == "megatron" and top_p < 1.0:
        raise ConfigError(f"model.backend=megatron teachers score at a temperature without a top-p cut, and "
                          f"opd.match_sampling asks for rollout.top_p={top_p:g}'s: set rollout.top_p=1")


def check_model_dirs(cfg: RunConfig, spec: Method) -> None:
    """Refuses, before any model loads, a student or local teacher directory whose weights cannot be read (a copy
    cut short, a damaged file, none there): transformers met them mid-way through loading, in a traceback."""
    dirs = {"model.path": cfg.model.path}
    if spec.teacher_term and cfg.opd.teacher_engine == "local":
        dirs |= {f"opd.teachers.{route}": path for route, path in spec.teachers(cfg.opd).items()}
    for setting, path in dirs.items():
        check_model_dir(setting, path)


def check_model_dir(setting: str, path: str) -> None:
    """Refuses the HF model directory `path` (given as `setting`) whose weights cannot be read (``weights_problem``)."""
    if problem := weights_problem(Path(path)):
        raise ModelError(f"{setting}={path}: {problem}; point it at a complete HF model directory (copy or export it "
                         "again)")


# The indexes of a sharded HF checkpoint: tensor name -> shard file, in "weight_map" (transformers, mbridge read them)
SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def weights_problem(directory: Path) -> str | None:
    """Why the HF model directory's weights cannot be read, or None. Reads each shard index and each safetensors
    file's header only: an index that is no JSON, has no weight_map or names a shard not there, a file cut short or
    whose header was changed fails it (a changed tensor byte does not: the format has no checksum). A path that is no
    directory is left to where it is loaded."""
    from safetensors import SafetensorError, safe_open

    if not directory.is_dir():
        return None
    if not (directory / HF_CONFIG).is_file():
        return f"no {HF_CONFIG} there"
    for index in SHARD_INDEXES:
        if (directory / index).is_file() and (problem := shard_index_problem(directory / index)):
            return problem
    files = sorted(directory.glob("*.safetensors"))
    if not files and not any(directory.glob("pytorch_model*.bin")):
        return "no weights there (no *.safetensors)"
    for file in files:
        try:
            with safe_open(file, "pt"):
                pass
        except (SafetensorError, OSError) as e:
            return f"{file.name} is not a readable safetensors file ({' '.join(str(e).split())})"
    return None


def shard_index_problem(index: Path) -> str | None:
    """Why a sharded checkpoint's index cannot be followed (transformers met each in a traceback mid-load), or None."""
    try:
        document = json.loads(index.read_text())
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return f"{index.name} is not a readable JSON index ({' '.join(str(e).split())})"
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(f, str) for f in weight_map.values()):
        return f"{index.name} has no weight_map (tensor name -> shard file)"
    missing = sorted({f for f in weight_map.values() if not (index.parent / f).is_file()})
    if len(missing) == 1:
        return f"{index.name} names a shard that is not there: {missing[0]}"
    if missing:
        return (f"{index.name} names {len(missing)} shards that are not there: {', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}")
    return None


def read_splits(data: DataConfig) -> Splits:
    for path in data.train + data.validation + data.eval:  # every file refused before any is read
        require_file(path, "data file", DataError)
    return Splits(*(load_split(files, data.strict) for files in (data.train, data.validation, data.eval)))
