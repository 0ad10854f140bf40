"""Whether a run (a study's stage) is finished: the one rule every caller that decides to train or to skip applies.

A run is finished for a step cap when its exported model (``final/config.json``) and its ``summary.json`` exist,
both written only at its end, and it ended under that cap (``summary["stop"]["cap"]``): a larger ``train.steps``
trains on from its latest checkpoint. The callers: ``trainer.train`` (the run itself, also under torchrun and as a
stage of ``megaopd study``), and the launchers that decide at submission which stages need a job (``megaopd submit``
and its report job, ``launchers/nemo_run_study.py``), each with the stage's config as its job loads it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from megaopd.accounting.flops import HF_CONFIG
from megaopd.accounting.ledger import SUMMARY

log = logging.getLogger(__name__)
FINAL_DIR = "final"  # the exported HF model directory, with the ledger beside the weights


def finished_summary(run_dir: str | Path, steps: int) -> dict | None:
    """The summary of the run in `run_dir` if it ended under the step cap `steps`, else None (it has not ended, or
    ended under another cap, or its summary was cut short: then the run ends again from its last checkpoint)."""
    run_dir = Path(run_dir)
    if not ((run_dir / FINAL_DIR / HF_CONFIG).exists() and (run_dir / SUMMARY).exists()):
        return None
    try:
        summary = json.loads((run_dir / SUMMARY).read_text())
    except ValueError:  # written before summaries were renamed into place, and cut short
        log.warning("%s is not JSON (a write interrupted): the run ends again from its last checkpoint",
                    run_dir / SUMMARY)
        return None
    return summary if summary.get("stop", {}).get("cap") == steps else None


def write_summary(run_dir: Path, summary: dict) -> None:
    """summary.json, written beside and renamed into place: a kill never leaves half of one."""
    tmp = run_dir / f".tmp_{SUMMARY}"
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(run_dir / SUMMARY)
