"""One strong-to-weak OPD step in a process of its own, so that its peak RSS is the step's alone (run by
tests/test_real_qwen.py):

    python tests/strong_to_weak_worker.py OUT.json local|audit|sglang key=value ...

``local``: one trainer step; ``audit``: the same step under megaopd.run.flop_audit (every phase counted); ``sglang``: one
step with the teacher on a CPU SGLang server the trainer launches (tests/test_sglang.py's settings), then the batches
the server scored scored again by the local teacher the same config builds. OUT.json: the memory plan the trainer
checked (its table, its phases' totals, the budget), the peak RSS of the step and the RSS before any model was
loaded, the step's metrics or the audit, the served teacher's gap to the local one (sglang), and the teacher's and
student's FLOPs per token.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def rss() -> int:
    """This process's peak resident set so far, in bytes: VmHWM, its own address space's high-water mark since it
    started. Not getrusage's ru_maxrss, which Linux carries over from the parent at fork and keeps across exec: under
    a pytest process of 8 GB it read 8.2 GB before any model was loaded."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


def recording(router) -> list[tuple]:
    """Each (batch, args, kwargs, view) of the served teacher's top-k calls in the step (opd.form=topk)."""
    calls, teacher = [], router.teachers["*"]
    served = teacher.topk_logprobs

    def record(batch, *args, **kwargs):
        view = served(batch, *args, **kwargs)
        calls.append((batch, args, kwargs, view))
        return view
    teacher.topk_logprobs = record
    return calls


def gap_to_local_teacher(cfg, calls: list[tuple]) -> dict:
    """|served - local| over the response tokens of the same batches, scored by the teacher opd.teacher_engine=local
    builds from this config (HF, opd.teacher_dtype): the realised tokens' logprobs and the top-K logprobs (sorted,
    so that near-ties ordered otherwise by the two engines' kernels compare equal)."""
    from megaopd.teachers.router import local_teachers

    teacher = local_teachers(cfg.model, cfg.train.logit_chunk_rows, cfg.opd.teacher_dtype)("*", cfg.opd.teachers["*"])
    realised, topk = [], []
    for batch, args, kwargs, served in calls:
        mine, where = teacher.topk_logprobs(batch, *args, **kwargs), batch.response_mask.bool()
        realised.append((served["realised"] - mine["realised"])[where].abs())
        topk.append((served["topk"] - mine["topk"])[where].abs().flatten())
    realised, topk = torch.cat(realised), torch.cat(topk)
    return {"tokens": realised.numel(), "realised_max": float(realised.max()), "realised_mean": float(realised.mean()),
            "topk_max": float(topk.max()), "topk_mean": float(topk.mean())}


def main() -> None:
    out, mode, overrides = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    from megaopd.config import load_config
    from megaopd.accounting.flops import ModelShape, forward_flops
    from megaopd.run.plan import check_run
    from megaopd.run.trainer import Trainer

    cfg = load_config(None, overrides)
    if mode == "sglang":
        from test_sglang import server_config

        cfg.rollout.sglang = server_config()
    baseline = rss()
    plan = check_run(cfg)  # what the trainer checks before its first step (plan.memory_gib: the budget)
    result = {"plan": {"table": plan.table(), "totals": plan.totals(), "budget": plan.budget,
                       "teacher_recompute": plan.teacher_recompute, "chunk_rows": plan.chunk_rows}}
    calls = []
    if mode == "audit":
        from megaopd.run.flop_audit import audit_step

        result["audit"] = {c: dataclasses.asdict(a) for c, a in audit_step(cfg).items()}
    else:
        trainer = Trainer(cfg)
        if mode == "sglang":
            calls = recording(trainer.teachers)
        try:
            result["step"] = trainer.step_fn(1)
        finally:
            trainer.close()
    peak = rss()  # the step's: the local teacher below is the test's, not the run's
    if calls:
        resolved = trainer.cfg  # train.logit_chunk_rows resolved (0 in the file: chosen by the memory plan)
        del trainer  # the student and its Adam state make room for the local teacher
        gc.collect()
        result["teacher_gap"] = gap_to_local_teacher(resolved, calls)
    shapes = {}
    for role, path in (("student", cfg.model.path), ("teacher", cfg.opd.teachers["*"])):
        shapes[role] = ModelShape.from_hf_config(json.loads((Path(path) / "config.json").read_text()))
    per_token = {role: forward_flops(shape, 1) for role, shape in shapes.items()}  # one position: 2 x N_mm + attn
    result |= {"peak_rss": peak, "baseline_rss": baseline, "forward_flops_per_token": per_token,
               "matmul_params": {role: shape.matmul_params for role, shape in shapes.items()}}
    out.write_text(json.dumps(result, indent=1, default=float))


if __name__ == "__main__":
    main()
