"""The study analysis behind ``megaopd report``: every number and verdict, as functions on loaded run data and on
numbers; ``megaopd/analysis/report.py`` renders them (markdown, plots, report.json).

- ``runs``: a study directory's runs (``Stage``) and their bootstrap resample;
- ``curves``: FLOPs-to-target on smoothed curves and the E1-E7 numbers of one seed (``analyse``);
- ``findings``: the paper's findings as a table of rules, and their verdicts;
- ``controls``: which of a teacher-free control's OPD pairs the verdict of (g) reads (fair, sweeps, estimator);
- ``intervals``: bootstrap intervals over prompts and seeds (``analyse_seeds``);
- ``budget``: every finding again with each stage's run cut short (``budget_sensitivity``);
- ``stats``: the statistics on numbers underneath (percentile intervals, seed bootstrap, verdicts, interval wording);
- ``length_sweep``: the response-length sweep (``megaopd report --length-sweep``; not re-exported here).

One package of small modules rather than one module: together they are ~1,100 lines (over the ~400 of one module),
and each part has one purpose.
"""

from megaopd.analysis.budget import BUDGET_RULE, CUTS, budget_sensitivity, cut_stage
from megaopd.analysis.curves import (LENGTH_RULE, LENGTH_WINDOW, SPLIT_RULE, TARGET_RULE, TOTALS, WALL_RULE,
                                     accuracy_at, analyse, flops_to_target, smooth, split_vs_joint, wall_clock_across)
from megaopd.analysis.findings import (FINDING_RULES, FINDINGS, MATCH_TOLERANCE, SMALL_SHARE, Finding, findings,
                                       judge, reached)
from megaopd.analysis.intervals import (BOOTSTRAP_SEED, INTERVAL_RULE, aggregate, analyse_seeds, bootstrap, json_safe,
                                        pointer)
from megaopd.analysis.runs import Stage, load_study, study_dirs

__all__ = ["BOOTSTRAP_SEED", "BUDGET_RULE", "CUTS", "FINDINGS", "FINDING_RULES", "INTERVAL_RULE", "LENGTH_RULE",
           "LENGTH_WINDOW", "MATCH_TOLERANCE", "SMALL_SHARE", "SPLIT_RULE", "TARGET_RULE", "TOTALS", "WALL_RULE",
           "Finding", "Stage", "accuracy_at", "aggregate", "analyse", "analyse_seeds", "bootstrap",
           "budget_sensitivity", "cut_stage", "findings", "flops_to_target", "json_safe", "judge", "load_study",
           "pointer", "reached", "smooth", "split_vs_joint", "study_dirs", "wall_clock_across"]
