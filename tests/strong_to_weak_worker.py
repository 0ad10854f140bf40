"""One strong-to-weak OPD step in a process of its own, so that its peak RSS is the step's alone (run by
tests/test_real_qwen.py):

    python tests/strong_to_weak_worker.py OUT.json local|audit|sglang key=value ...

``local``: one trainer step; ``audit``: the same step under megaopd.flop_audit (every phase counted); ``sglang``: one
step with the teacher on a CPU SGLang server the trainer launches (tests/test_sglang.py's settings). OUT.json: the
memory plan the trainer checked (its table, its phases' totals, the budget), the peak RSS and the RSS before any model
was loaded, the step's metrics or the audit, and the teacher's and student's FLOPs per token.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def rss() -> int:
    """This process's peak resident set so far, in bytes: VmHWM, its own address space's high-water mark since it
    started. Not getrusage's ru_maxrss, which Linux carries over from the parent at fork and keeps across exec: under
    a pytest process of 8 GB it read 8.2 GB before any model was loaded."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024


def main() -> None:
    out, mode, overrides = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    from megaopd.config import load_config
    from megaopd.flops import ModelShape, forward_flops
    from megaopd.plan import check_run
    from megaopd.trainer import Trainer

    cfg = load_config(None, overrides)
    if mode == "sglang":
        from test_sglang import server_config

        cfg.rollout.sglang = server_config()
    baseline = rss()
    plan = check_run(cfg)  # what the trainer checks before its first step (plan.memory_gib: the budget)
    result = {"plan": {"table": plan.table(), "totals": plan.totals(), "budget": plan.budget,
                       "teacher_recompute": plan.teacher_recompute, "chunk_rows": plan.chunk_rows}}
    if mode == "audit":
        from megaopd.flop_audit import audit_step

        result["audit"] = {c: dataclasses.asdict(a) for c, a in audit_step(cfg).items()}
    else:
        trainer = Trainer(cfg)
        try:
            result["step"] = trainer.step_fn(1)
        finally:
            trainer.close()
    shapes = {}
    for role, path in (("student", cfg.model.path), ("teacher", cfg.opd.teachers["*"])):
        shapes[role] = ModelShape.from_hf_config(json.loads((Path(path) / "config.json").read_text()))
    per_token = {role: forward_flops(shape, 1) for role, shape in shapes.items()}  # one position: 2 x N_mm + attn
    result |= {"peak_rss": rss(), "baseline_rss": baseline, "forward_flops_per_token": per_token,
               "matmul_params": {role: shape.matmul_params for role, shape in shapes.items()}}
    out.write_text(json.dumps(result, indent=1, default=float))


if __name__ == "__main__":
    main()
