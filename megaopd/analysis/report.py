"""The study report: held-out accuracy against training FLOPs, the paper's ratios, and whether each finding reproduces.

    megaopd report runs/study [runs/study_seed1 ...] [--out DIR] [--target-fraction 0.9] [--metric greedy|sampled]

Reads a study directory (``study.yaml`` plus one run directory per stage, see ``megaopd/run/study.py``) and writes
``report.md``, ``report.json`` (every number of the markdown) and PNG plots into ``<first study>/report/``. Several
study directories of the same layout are read as seeds (a study run with ``seeds`` is its ``seed_<s>/``): each is
analysed alone, then each headline number is shown as mean and min-max across them. Every comparison is computed
from the measured curves; nothing is asserted. Each number computed from held-out accuracy carries a bootstrap
interval (INTERVAL_RULE; per-prompt results in ``<stage>/evals/``, statistics in ``analysis/stats.py``), and each
finding's verdict is reproduced, not reproduced or inconclusive by where that interval lies.

This module renders (markdown, plots, report.json, the CLI); every number and verdict comes from
``megaopd/analysis/``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from megaopd.analysis import (BUDGET_RULE, FINDING_RULES, INTERVAL_RULE, LENGTH_RULE, LENGTH_WINDOW,  # noqa: E402
                              MATCH_TOLERANCE, SMALL_SHARE, SPLIT_RULE, TARGET_RULE, TOTALS, WALL_RULE, Stage,
                              analyse_seeds, budget_sensitivity, json_safe, pointer, reached, study_dirs,
                              wall_clock_across)
from megaopd.analysis.controls import CONTROL_RULE  # noqa: E402
from megaopd.analysis.findings import (BY_ID, control_attainment, control_flops_ratio, judged,  # noqa: E402
                                       needed, ratio)
from megaopd.analysis.runs import stop_text  # noqa: E402
from megaopd.analysis.stats import MAX_UNDEFINED, MIN_SEEDS, REPLICATES, UNMEASURED, interval_wording  # noqa: E402
from megaopd.accounting.flops import COMPONENTS  # noqa: E402
from megaopd.config import flag_in_range  # noqa: E402
from megaopd.teachers.check import weaker  # noqa: E402

TARGET_STYLES = (":", "-.", "--")

def _plot_accuracy(seeds: list[tuple[dict, list[Stage]]], domain: str, metric: str, x: str, path: Path,
                   targets: dict[str, float]) -> None:
    fig, ax = plt.subplots(figsize=(10, 5))
    for k, (label, value) in enumerate(targets.items()):
        ax.axhline(value, color="grey", ls=TARGET_STYLES[k % 3], lw=1, label=f"target: {label} {value:.3f}")
    colors, styles = {}, ["-", "--", ":", "-."]
    for k, (_, stages) in enumerate(seeds):
        for s in stages:
            fx, acc = s.curve(domain, metric, x)
            # 0 FLOPs has no place on a log axis; the bars are 1.96 standard errors over the eval's prompts.
            pts = [(f, a, 1.96 * se if se is not None else 0.0)
                   for f, a, se in zip(fx, acc, s.curve_se(domain, metric)) if f > 0]
            if not pts:
                continue
            color = colors.setdefault(s.name, f"C{len(colors) % 10}")
            f, a, err = zip(*pts)
            ax.errorbar(f, a, yerr=err, fmt=styles[k % 4], marker="o", ms=3, color=color, elinewidth=0.6, capsize=1.5,
                        label=f"{s.name} ({s.role})" if k == 0 else None)
    ax.set_xscale("log")
    ax.set_xlabel(f"cumulative training FLOPs (flops/total_{x}, log scale)")
    ax.set_ylabel(f"held-out accuracy ({metric}, fraction correct)")
    seed_note = f", {len(seeds)} seeds (line style = seed)" if len(seeds) > 1 else ""
    ax.set_title(f"Held-out accuracy vs training FLOPs: {domain}{seed_note}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # outside: curves fill the whole axes
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_controls(loaded: list[tuple[dict, list[Stage]]], seeds: list[dict], metric: str, x: str,
                   path: Path) -> bool:
    """(g): each control's curve (a stage labelled control) beside the curves of the OPD stages it controls, on the domain they
    are compared on, with each OPD stage's final accuracy (the first seed's) as the target; False if none."""
    pairs = seeds[0]["controls"] + seeds[0]["controls_set_aside"]
    panels = list(dict.fromkeys((c["control"], c["domain"]) for c in pairs))
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for ax, (control, domain) in zip(axes[0], panels):
        opds = [c for c in pairs if c["control"] == control]
        for k, c in enumerate([c for c in opds if c["teacher"] is not None]):
            ax.axhline(c["teacher"], color="grey", ls=TARGET_STYLES[k % 3], lw=1,
                       label=f"target: {c['opd']} final {c['teacher']:.3f}")
        colors = {}
        for k, (_, stages) in enumerate(loaded):
            by_name = {s.name: s for s in stages}
            for name in [control] + [c["opd"] for c in opds]:
                f, a = by_name[name].curve(domain, metric, x) if name in by_name else ([], [])
                pts = [(fi, ai) for fi, ai in zip(f, a) if fi > 0]  # 0 FLOPs has no place on a log axis
                if not pts:
                    continue
                role = "control" if name == control else "OPD" + ", not counted" * all(
                    c["pairing"]["set_aside"] for c in opds if c["opd"] == name)
                ax.plot(*zip(*pts), styles[k % 4], marker="o", ms=3, color=colors.setdefault(name, f"C{len(colors)}"),
                        label=f"{name} ({role})" if k == 0 else None)
        ax.set_xscale("log")
        ax.set_xlabel(f"cumulative training FLOPs (flops/total_{x}, log scale)")
        ax.set_ylabel(f"held-out accuracy ({metric}, {domain})")
        ax.set_title(f"{control} beside the OPD it controls: {domain}"
                     + (" (line style = seed)" if len(loaded) > 1 else ""))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_length(seeds: list[tuple[dict, list[Stage]]], path: Path) -> bool:
    fig, (by_step, by_flops) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors, drawn = {}, False
    for k, (_, stages) in enumerate(seeds):
        for s in stages:
            steps, fx, lengths = s.lengths()
            if not steps:
                continue
            drawn = True
            color = colors.setdefault(s.name, f"C{len(colors) % 10}")
            label = f"{s.name} ({s.role})" if k == 0 else None
            by_step.plot(steps, lengths, color=color, lw=1, label=label)
            by_flops.plot(fx, lengths, color=color, lw=1, label=label)
    by_step.set_xlabel("training step")
    by_flops.set_xlabel("cumulative stage FLOPs (flops/total_stage, log scale)")
    by_flops.set_xscale("log")
    for ax, title in ((by_step, "vs step"), (by_flops, "vs FLOPs")):
        ax.set_ylabel("mean sampled response length (tokens)")
        ax.set_title(f"Rollout response length {title}")
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def _f(v, fmt: str = ".3e") -> str:
    return "-" if v is None else format(v, fmt)


def _bounded(b: list | tuple | None, fmt: str = ".3g") -> str:
    """A check's number: itself when measured, "< hi" or "> lo" where a censored arm leaves one side open."""
    if b is None or b == [None, None] or b == (None, None):
        return "-"
    lo, hi = b
    if lo is not None and lo == hi:
        return format(lo, fmt)
    if lo is None:
        return f"< {hi:{fmt}}"
    return f"> {lo:{fmt}}" if hi is None else f"{lo:{fmt}}..{hi:{fmt}}"


def _interval(interval: list | None, fmt: str = ".3g", scale: float = 1.0) -> str:
    """ " [lo, hi]", an open end printed as such (an arm censored in the resamples that set it)."""
    if interval is None:
        return ""
    lo, hi = ("open" if v is None else format(v * scale, fmt) for v in interval[:2])
    return f" [{lo}, {hi}]"


def _pct(v: float | None) -> str:
    return "not measurable" if v is None else f"{100 * v:.1f}%"


def _ci(r: dict, path: tuple, fmt: str = ".3e", scale: float = 1.0) -> str:
    """ " [lo, hi]" after a number of the analysis when it has an interval (``_shared_interval``)."""
    return _shared_interval(r.get("intervals", {}).get(pointer(path)), fmt, scale)


def _shared_interval(interval: list | None, fmt: str = ".3e", scale: float = 1.0) -> str:
    """ " [lo, hi]" from [lo, hi] or [lo, hi, share defined] (and how often it is defined when not always); none
    where it is undefined in more than MAX_UNDEFINED of the resamples: the defined ones alone are no sample of it
    (a ratio whose arm missed the target in most of them would print a range that excludes that arm's bound)."""
    if interval is None:
        return ""
    defined = interval[2] if len(interval) > 2 else 1.0
    if defined < 1 - MAX_UNDEFINED:
        return f" (defined in {100 * defined:.0f}% of resamples: no interval)"
    return _interval(interval, fmt, scale) + (f" (defined in {100 * defined:.0f}% of resamples)" if defined < 1
                                              else "")


def _check_line(label: str, c: dict) -> str:
    defined = f" (defined in {100 * c['defined']:.0f}% of resamples)" if c.get("defined", 1.0) < 1 else ""
    censored = f" ({c['censored']})" if c.get("censored") else ""
    return (f"  - {label}: {c['detail']} {_bounded(c['bounds'])}{_interval(c['interval'])}{defined} "
            f"{c['op']} {c['threshold']:g}: {c['verdict']}{censored}")


def verdict_words(finding: dict) -> str:
    """A finding's verdict with how many seeds reproduce it, provisional under MIN_SEEDS seeds."""
    words = finding["verdict"]
    if finding["n_seeds"] > 1 and finding["verdict"] not in UNMEASURED:
        words += f" (reproduced in {finding['seeds_reproduced']} seeds)"
    if finding.get("provisional"):
        words += f" (provisional: {finding['n_seeds']} seed(s), a decisive verdict needs {MIN_SEEDS})"
    return words


def magnitude_line(finding: dict) -> str:
    """Our number beside the paper's: each check's value [interval] (the mean over seeds)."""
    ours = "; ".join(f"{label} {_bounded(c['bounds'])}{_interval(c['interval'])}"
                     for label, c in finding["checks"].items()) or "not measured"
    return f"  - magnitude: {ours}; the paper: {finding['paper']}"


def budget_line(budget: dict) -> str:
    """A finding's verdict (and check values) at each cut of BUDGET_RULE, and whether it depends on the budget."""
    cuts = " / ".join(f"{cut} {r['verdict']} ({', '.join(_bounded(v) for v in r['values'].values()) or '-'})"
                      for cut, r in budget["cuts"].items())
    dependent = (f"**budget-dependent** (changes at {budget['changes_at']})" if budget["budget_dependent"]
                 else "not budget-dependent")
    return f"  - budget, each stage cut at {cuts}: {dependent}"


def _wall(w: dict) -> list[str]:
    """A stage's wall-clock cells (WALL_RULE): s / step, train s, rollout wait share."""
    return [_f(w["step_seconds"], ".3g"), _f(w["train_seconds"], ".4g"),
            "-" if w["rollout_wait_share"] is None else f"{100 * w['rollout_wait_share']:.0f}%"]


def _spread(v: dict | None, fmt: str, scale: float = 1.0, unit: str = "") -> str:
    """mean (min-max, n) of a number over the seeds; - when no seed has it."""
    if v is None:
        return "-"
    mean, lo, hi = (f"{v[k] * scale:{fmt}}{unit}" for k in ("mean", "min", "max"))
    return f"{mean} ({lo}-{hi}, n={v['n']})"


def _target_cells(r: dict, path: tuple, t: dict, roles: tuple[str, str], ratio_of: tuple[str, str] = ()) -> str:
    """A comparison's cells for one target: the accuracy, each role's FLOPs to it (or how close it got) and their
    ratio (of `ratio_of`, default `roles`; a bound where one never reached it), each with its interval."""
    flops = " | ".join(f"{reached(t[f'{x}_flops'], t[f'{x}_best_smoothed'])}{_ci(r, path + (f'{x}_flops',))}"
                       for x in roles)
    num, den = ratio_of or roles
    return (f"| {t['target']:.3f}{_ci(r, path + ('target',), '.3f')} | {flops} | "
            f"{_bounded(ratio(needed(t, num), needed(t, den)), '.3g')}{_ci(r, path + ('ratio',), '.3g')} |")


def _matched(r: dict, c: dict, path: tuple, roles: tuple[str, str]) -> str:
    """Both stages' smoothed accuracy at the FLOPs both curves reach, with intervals."""
    m = c["matched"]
    return f"At matched FLOPs ({m['flops']:.3e}), smoothed accuracy: " + ", ".join(
        f"{c[x]} {_f(m[f'{x}_acc'], '.3f')}{_ci(r, path + (f'{x}_acc',), '.3f')}" for x in roles)


def _same_method_markdown(r: dict, fraction: float) -> list[str]:
    """Stages compared with their `compare_with` outside OPD vs GRPO (one method, another setting), each named with
    its K; nothing when the study has none."""
    if not r["stage_comparisons"]:
        return []
    md = ["", "#### Stage vs stage (same method, another setting): FLOPs to reach a target, on the reference's domain "
          "(the mean when it has none)", "",
          "| stage (K) | reference (K) | target | accuracy | reference FLOPs | stage FLOPs | reference/stage |",
          "|---" * 7 + "|"]
    for i, c in enumerate(r["stage_comparisons"]):
        k = {role: _f(v, "d") for role, v in c["max_staleness"].items()}
        for name, t in c["targets"].items():
            label = ("reference final" if name == "teacher"
                     else f"base + {fraction} x reference gain (base {c['base']:.3f})")
            path = ("stage_comparisons", i, "targets", name)
            md.append(f"| {c['stage']} ({k['stage']}) | {c['reference']} ({k['reference']}) | {label} "
                      + _target_cells(r, path, t, ("reference", "stage")))
    for i, c in enumerate(r["stage_comparisons"]):
        path = ("stage_comparisons", i)
        final = ", ".join(f"{c[role]} {_f(v, '.3f')}{_ci(r, path + ('final', role), '.3f')}"
                          for role, v in c["final"].items())
        md.append(f"\n{c['stage']} vs {c['reference']} on {c['domain']}: final accuracy (all test prompts) "
                  f"{final}.")
        if "matched" in c:
            p = path + ("matched",)
            md.append(_matched(r, c, p, ("reference", "stage")) + f", stage - reference "
                      f"{_f(c['matched']['gap'], '+.3f')}{_ci(r, p + ('gap',), '+.3f')}.")
    # The reference's final accuracy is its curve's last point: over equal budgets the stage reaches it by about the
    # same FLOPs or never, so that ratio is one-sided; the fraction target and the gap are two-sided.
    md.append("\nOver equal budgets the ratio to the reference's final accuracy is about >= 1 or undefined (its last "
              "point is the target): read the fraction target's ratio and the matched-FLOPs gap for a difference "
              "either way.")
    return md


def _control_table(r: dict, key: str, fraction: float) -> list[str]:
    """(g)'s rows for the pairs of r[key] (each target, then the matched-FLOPs accuracy); the set-aside ones say why
    the verdict leaves them out."""
    aside = key == "controls_set_aside"
    md = ["| OPD stage | control | domain | " + "not counted: why | " * aside + "target | accuracy | OPD FLOPs | "
          "control FLOPs | control/OPD |", "|---" * (8 + aside) + "|"]
    for i, c in enumerate(r[key]):
        why = f"{c['pairing']['set_aside']} | " if aside else ""
        for name, t in c["targets"].items():
            label = "OPD final" if name == "teacher" else f"base + {fraction} x OPD gain (base {c['base']:.3f})"
            md.append(f"| {c['opd']} | {c['control']} | {c['domain']} | {why}{label} "
                      + _target_cells(r, (key, i, "targets", name), t, ("opd", "control"), ("control", "opd")))
    return md + [f"\n{_matched(r, c, (key, i, 'matched'), ('opd', 'control'))} ({c['domain']})."
                 for i, c in enumerate(r[key]) if "matched" in c]


def _chosen(scores: list[dict], chosen: str) -> str:
    """A sweep arm's validation accuracies: the chosen stage's, then the others'."""
    def cell(v: dict) -> str:
        return f"{v['stage']} ({v['setting']}, {v['valid']:.3f})"

    others = ", ".join(cell(v) for v in scores if v["stage"] != chosen)
    return f"{cell(next(v for v in scores if v['stage'] == chosen))} won" + (f" over {others}" if others else "")


def _pairing_lines(c: dict) -> list[str]:
    """Why a pair is compared (CONTROL_RULE): its basis and setting, its estimator, and which rate won where each
    arm's best was chosen on validation."""
    p = c["pairing"]
    line = f"- {c['opd']} vs {c['control']}: {p['basis']}" + (f" ({p['setting']})" if p["setting"] else "")
    v = p["validation"]
    return [line + (f"; {p['estimator']}" if p["estimator"] else "")] + (
        [f"  - chosen on validation ({v['domain']}): control {_chosen(v['control'], c['control'])}; OPD "
         f"{_chosen(v['opd'], c['opd'])}"] if v else [])


def _set_aside_checks(c: dict) -> list[str]:
    """(g1) and (g2) of a set-aside pair as the verdict would read them (from its bounds: no interval)."""
    lines = []
    for fid, measure in (("g1", control_attainment), ("g2", control_flops_ratio)):
        rule = BY_ID[fid]
        lines += [f"  - ({fid}) {k.detail} {_bounded(k.bounds)} {rule.op} {rule.threshold:g}: "
                  f"{judged(k.bounds, rule.op, rule.threshold, None)['verdict']} if counted"
                  + (f" ({k.censored})" if k.censored else "") for k in measure({"controls": [c]})]
    return [f"- {c['opd']} vs {c['control']}, not counted ({c['pairing']['set_aside']}):"] + (
        lines or ["  - no (g) check: OPD has no curve on the domain or gained nothing over its first eval"])


def _control_markdown(r: dict, fraction: float) -> list[str]:
    """(g): each OPD stage against its control (same base, same training data, no teacher): the pairs
    the verdict reads, why each is compared, then the pairs set aside (CONTROL_RULE) with their (g) numbers."""
    md = ["", "#### OPD vs its control, OPD without the teacher (g): FLOPs to reach OPD's accuracy", ""]
    aside = r["controls_set_aside"]
    if not r["controls"] and not aside:
        return md + ["- no control stage with an OPD stage of its base and training data in this study"]
    if r["controls"]:
        md += _control_table(r, "controls", fraction)
        md += ["", "Why each pair the verdict reads is compared (the control's pairs: conventions):", ""]
        md += [line for c in r["controls"] for line in _pairing_lines(c)]
    else:
        md.append("- no pair the verdict reads: every pair is set aside (below)")
    if aside:
        md += ["", "##### (g) of the pairs set aside: shown, not in the verdict", ""]
        md += _control_table(r, "controls_set_aside", fraction) + [""]
        md += [line for c in aside for line in _set_aside_checks(c)]
    return md


def _teacher_markdown(r: dict) -> list[str]:
    """Each external teacher's check (megaopd/teachers/check.py): the teachers and the student they start from on
    the stage's validation prompts, at its token cap and sampling settings."""
    md = ["#### Teachers checked before OPD: validation accuracy, greedy and sampled, at the stage's token cap "
          "(megaopd/teachers/check.py)", "",
          "| OPD stage | model | role | domains | prompts | greedy | sampled | mean length | truncated |",
          "|---" * 9 + "|"]
    for stage, check in r.get("teacher_checks", {}).items():
        below = weaker(check)
        trained = ", ".join(d for d in check["student"]["greedy"]["accuracy"] if d != "mean")
        models = [("student", check["student"], trained)] + [
            (f"teacher {route}" + (" (below student)" if route in below else ""), t, ", ".join(t["domains"]))
            for route, t in check["teachers"].items()]
        for role, m, domains in models:
            g, s = m["greedy"], m["sampled"]
            md.append(f"| {stage} | `{'/'.join(Path(m['path']).parts[-2:])}` | {role} | {domains} | {m['prompts']} | "
                      f"{g['accuracy']['mean']:.3f} | {s['accuracy']['mean']:.3f} | {g['length']:.1f} / "
                      f"{s['length']:.1f} | {_pct(g['truncated'])} / {_pct(s['truncated'])} |")
    if len(md) == 4:
        return []
    return md + ["", "Token cap, temperature, top-p: " + "; ".join(
        f"{stage} {c['max_new_tokens']}, {c['temperature']:g}, {c['top_p']:g}"
        for stage, c in r["teacher_checks"].items()) + ". Length and truncated share: greedy / sampled.", ""]


def _seed_markdown(r: dict, fraction: float) -> list[str]:
    md = ["#### OPD vs GRPO (E1-E3): FLOPs to reach a target, on the GRPO stage's domain (the mean when it has none)",
          "", "| OPD stage | GRPO stage | teacher/student FLOPs per token | target | accuracy | GRPO FLOPs | OPD FLOPs "
          "| GRPO/OPD |", "|---" * 8 + "|"]
    if not r["comparisons"]:
        md = md[:2] + ["- no opd stage with compare_with in this study"]
    md = _teacher_markdown(r) + md
    for i, c in enumerate(r["comparisons"]):
        for name, t in c["targets"].items():
            label = "GRPO final" if name == "teacher" else f"base + {fraction} x GRPO gain (base {c['base']:.3f})"
            md.append(f"| {c['opd']} ({c['role']}) | {c['grpo']} | {_f(c['teacher_cost_ratio'], '.2f')}x | {label} "
                      + _target_cells(r, ("comparisons", i, "targets", name), t, ("grpo", "opd")))
    md += [f"\n{_matched(r, c, ('comparisons', i, 'matched'), ('grpo', 'opd'))}."
           for i, c in enumerate(r["comparisons"]) if "matched" in c]
    md += _same_method_markdown(r, fraction)
    md += ["", "#### Multi-teacher OPD (E6)", ""]
    for i, m in enumerate(r["multi_teacher"]):
        md.append(f"- {m['stage']}: distillation {_f(m['distill_flops'])} FLOPs / specialists "
                  f"{_f(m['specialist_flops'])} = {_pct(m['share'])} (paper: 5.2% / 8.0%); specialists up to their "
                  f"own final accuracy {_f(m['specialist_flops_to_final'])}: {_pct(m['share_experts_to_final'])}")
        for d, v in m["domains"].items():
            path = ("multi_teacher", i, "domains", d)
            md.append(f"  - {d}: student {_f(v['student_acc'], '.3f')}{_ci(r, path + ('student_acc',), '.3f')} vs "
                      f"expert {v['expert']} {_f(v['expert_acc'], '.3f')}{_ci(r, path + ('expert_acc',), '.3f')} "
                      f"(gap {_f(v['gap'], '+.3f')}{_ci(r, path + ('gap',), '+.3f')})")
    if not r["multi_teacher"]:
        md.append("- no multi_teacher_opd stage in this study")
    md += ["", "#### Split-then-merge vs joint GRPO (E7)", ""]
    for i, s in enumerate(r["split_vs_joint"]):
        path = ("split_vs_joint", i)
        md.append(f"- target {s['target']:.3f}{_ci(r, path + ('target',), '.3f')} ({s['joint']} final mean accuracy, "
                  f"last smoothed eval); experts {s['experts_flops']:.3e} + {s['merge']} "
                  f"{reached(s['merge_flops_to_target'], s['merge_best_smoothed'])} = split "
                  f"{_f(s['split_flops'])}{_ci(r, path + ('split_flops',))}; joint "
                  f"{reached(s['joint_flops_to_target'], s['joint_best_smoothed'])}"
                  f"{_ci(r, path + ('joint_flops_to_target',))}; saving 1 - split/joint = {_pct(s['saving'])}"
                  f"{_ci(r, path + ('saving',), '.1f', 100)} (paper: 42.0%); experts up to their own final "
                  f"accuracy {_f(s['experts_flops_experts_to_final'])}: split "
                  f"{_f(s['split_flops_experts_to_final'])}, saving {_pct(s['saving_experts_to_final'])}"
                  f"{_ci(r, path + ('saving_experts_to_final',), '.1f', 100)}")
    if not r["split_vs_joint"]:
        md.append("- no joint_grpo stage (with a multi_teacher_opd stage) in this study")
    md += _control_markdown(r, fraction)
    md += ["", "#### FLOPs ledger, wall-clock and response length per stage", "",
           "| stage | role | steps | stopped | final mean acc | stage | + teachers | + cold start | external | "
           + " | ".join(COMPONENTS) + " | length first | length last | K | s / step | train s | rollout wait |",
           "|---" * (15 + len(COMPONENTS)) + "|"]
    for name, s in r["stages"].items():
        form = f" {s['form']}" if s.get("form") and s["form"] != s["algorithm"] else ""  # the OPD form, labelled
        md.append(f"| {name} | {s['role']}{form} | {s['steps']} | {stop_text(s['stop'])} | "
                  f"{_f(s['final_mean_acc'], '.3f')}"
                  f"{_ci(r, ('stages', name, 'final_mean_acc'), '.3f')} | "
                  + " | ".join(_f(s["totals"][k]) for k in TOTALS) + " | "
                  + " | ".join(_f(s["components"][c]) for c in COMPONENTS)
                  + f" | {_f(s['length']['first'], '.1f')} | {_f(s['length']['last'], '.1f')} | "
                  + " | ".join([_f(s["max_staleness"], "d")] + _wall(s["wall_clock"])) + " |")
    return md


def write_report(study_dir: str | Path | list, out_dir: str | Path | None = None, target_fraction: float = 0.9,
                 metric: str = "greedy", window: int = 3, x: str = "stage", length_window: int = LENGTH_WINDOW,
                 replicates: int = REPLICATES) -> dict:
    """Analyse one study directory (or several: seeds), write report.md, report.json and PNGs; return the json."""
    dirs = study_dirs(study_dir if isinstance(study_dir, (list, tuple)) else [study_dir])
    out = Path(out_dir) if out_dir is not None else dirs[0] / "report"
    out.mkdir(parents=True, exist_ok=True)
    loaded, seeds, _, spread, overall = analyse_seeds(dirs, metric, target_fraction, window, x, length_window,
                                                      replicates)
    for f, budget in zip(overall, budget_sensitivity(dirs, loaded, metric, target_fraction, window, x,
                                                     length_window)):
        f["budget"] = budget
    domains = sorted({d for _, stages in loaded for s in stages for d in s.domains(metric)})
    plots = []
    # The first seed's targets on the mean plot: where each curve has to get to.
    targets = {f"{c['grpo']} final": c["teacher"] for c in seeds[0]["comparisons"] if c["teacher"] is not None}
    targets |= {f"{s['joint']} final": s["target"] for s in seeds[0]["split_vs_joint"]}
    for domain in ["mean"] + domains:
        _plot_accuracy(loaded, domain, metric, x, out / f"accuracy_{domain}.png", targets if domain == "mean" else {})
        plots.append(f"accuracy_{domain}.png")
    if _plot_length(loaded, out / "response_length.png"):
        plots.append("response_length.png")
    if _plot_controls(loaded, seeds, metric, x, out / "controls.png"):
        plots.append("controls.png")
    wall = wall_clock_across(seeds)
    report = json_safe({
        "x_axis": f"flops/total_{x}", "metric": metric, "target_fraction": target_fraction, "window": window,
        "length_window": length_window, "replicates": replicates,
        "rules": {"flops_to_target": TARGET_RULE, "length": LENGTH_RULE, "findings": FINDING_RULES,
                  "intervals": INTERVAL_RULE, "interval": interval_wording(len(seeds)), "budget": BUDGET_RULE,
                  "match_tolerance": MATCH_TOLERANCE, "small_share": SMALL_SHARE, "wall_clock": WALL_RULE,
                  "controls": CONTROL_RULE},
        "single_seed": len(seeds) == 1, "findings": overall, "spread": spread, "wall_clock": wall, "seeds": seeds,
        "plots": plots})
    (out / "report.json").write_text(json.dumps(report, indent=1))

    md = ["# megaopd report: held-out accuracy vs training FLOPs", "",
          "Studies: " + ", ".join(f"`{d}`" for d in dirs) + (" (single seed)" if len(dirs) == 1 else
                                                             f" ({len(dirs)} seeds)"), "",
          "## Conventions", "",
          f"- x axis: `flops/total_{x}`, cumulative model FLOPs (1 MAC = 2 FLOPs, backward = 2x forward, causal "
          "attention halved, LM head where logits are used, R-1 decode forwards per response, real token counts: "
          "megaopd/accounting/flops.py); E6 shares and E7 totals always use stage FLOPs "
          "(`flops/total_stage`); the ledger table gives all totals. Teacher/student cost: FLOPs per token, 2 x "
          "matmul parameters of each (attention's length terms aside).",
          f"- accuracy: `accuracy_{metric}` on the test split; curves are the periodic evals on a fixed subset of it "
          "(error bars: 1.96 standard errors over its prompts), targets and per-domain comparisons use the final eval "
          "on all test prompts. Points at 0 FLOPs are off the log axis.",
          f"- {TARGET_RULE} window = {window}.",
          f"- response length first/last: {LENGTH_RULE}, length_window = {length_window}.",
          f"- {WALL_RULE}. Seconds are this machine's under its load at the time, beside FLOPs that are not.",
          f"- {INTERVAL_RULE} replicates = {replicates}; intervals are printed in brackets after their number.",
          f"- findings: {FINDING_RULES} Tolerance {MATCH_TOLERANCE}; small share <= {SMALL_SHARE}.",
          f"- {BUDGET_RULE} Why each stage stopped (and which budgets it had to cover): the ledger tables "
          "(docs/budgets.md).",
          f"- {SPLIT_RULE}", f"- {CONTROL_RULE}", "",
          "## Findings of the paper, checked against this study", ""]
    if len(seeds) == 1:
        md += ["One seed: these intervals resample the test prompts only. Training noise (another seed, or another "
               "machine's floating point) is not in them and can move a verdict; run the study with "
               "`seeds=[0, 1, 2]` (its report bootstraps over the seeds too) for verdicts that hold across runs.", ""]
    else:
        md += [f"Intervals: a {interval_wording(len(seeds))}.", ""]
    for f in overall:
        md.append(f"- ({f['id']}) {f['claim']}: **{f['verdict']}**" + verdict_words(f).removeprefix(f["verdict"]))
        md += ([_check_line(label, c) for label, c in f["checks"].items()]
               + [magnitude_line(f), budget_line(f["budget"])])
    md += ["", "## Headline numbers" + (" (single seed)" if len(seeds) == 1 else
                                        " across seeds (mean [interval], min-max; the mean of FLOPs ratios and shares "
                                        "is geometric, as in the findings)"), ""]
    # A ratio is undefined in a seed whose stage never reaches the target: no mean without every seed.
    md += [f"- {k}: " + (f"{v['mean']:.4g}{_shared_interval(v['interval'], '.4g')}" if v["mean"] is not None
                         else "no mean (not measured or censored in some seeds)")
           + (f" (min {v['min']:.4g}, max {v['max']:.4g}, defined in {v['n']} of {len(seeds)} seeds)"
              if len(seeds) > 1 else "")
           for k, v in spread.items()] or ["- none measured"]
    if len(seeds) > 1:
        md += ["", "## Wall-clock per stage across seeds (mean (min-max, n))", "",
               "| stage | K | s / step | train s | rollout wait |", "|---|---|---|---|---|"]
        md += [f"| {name} | {', '.join(_f(k, 'd') for k in w['max_staleness'])} | "
               f"{_spread(w['step_seconds'], '.3g')} | {_spread(w['train_seconds'], '.4g')} | "
               f"{_spread(w['rollout_wait_share'], '.0f', 100, '%')} |"
               for name, w in wall.items()]
    md += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    for k, r in enumerate(seeds):
        seed = f" (seed {r['seed']})" if r["seed"] is not None else ""
        md += ["", f"## Study {k + 1}{seed}: `{r['study_dir']}`", "", "### Findings", ""]
        for f in r["findings"]:
            md.append(f"- ({f['id']}) **{f['verdict']}**")
            md += [_check_line(label, c) for label, c in f["checks"].items()]
        md += [""] + _seed_markdown(r, target_fraction)
    (out / "report.md").write_text("\n".join(md) + "\n")
    return report


def finding_line(finding: dict) -> str:
    """One printed line per finding: its verdict, then each check's number [interval] against its threshold, its
    magnitude beside the paper's, and its budget line."""
    checks = "; ".join(f"{label} {_bounded(c['bounds'])}{_interval(c['interval'])} {c['op']} {c['threshold']:g}"
                       for label, c in finding["checks"].items())
    return (f"({finding['id']}) {verdict_words(finding)}: {finding['claim']}" + (f": {checks}" if checks else "")
            + f"\n  the paper: {finding['paper']}\n" + budget_line(finding["budget"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megaopd report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("study_dirs", nargs="+", help="study directories; several = seeds of the same study")
    parser.add_argument("--out", default=None, help="default: <first study>/report")
    parser.add_argument("--target-fraction", type=flag_in_range(0, 1, kind=float, low_open=True), default=0.9,
                        help="of GRPO's gain over the base")
    parser.add_argument("--metric", choices=("greedy", "sampled"), default="greedy")
    parser.add_argument("--window", type=flag_in_range(1), default=3, help="evals in the trailing moving average")
    parser.add_argument("--x", choices=("stage", "with_teachers", "with_cold_start"), default="stage",
                        help="the FLOPs total on the x axis and in E1-E3")
    parser.add_argument("--length-window", type=flag_in_range(1), default=LENGTH_WINDOW,
                        help="training steps averaged at each end for the response length")
    parser.add_argument("--replicates", type=flag_in_range(0, means="0: no intervals"), default=REPLICATES,
                        help="bootstrap replicates (0: no intervals)")
    parser.add_argument("--length-sweep", action="store_true",
                        help="the directories are the points of a response-length sweep (length_sweep.sh): plot the "
                             "GRPO/OPD FLOP ratio against response length")
    args = parser.parse_args(argv)
    if args.length_sweep:
        from megaopd.analysis.length_sweep import write_length_sweep

        out = Path(args.out) if args.out else Path(args.study_dirs[0]).parent / "report"
        sweep = write_length_sweep(args.study_dirs, out, args.target_fraction, args.metric, args.window,
                                   args.length_window, args.replicates)
        print(f"wrote {out / 'length_sweep.md'}\n{sweep['conclusion']}")
        return 0
    report = write_report(args.study_dirs, args.out, args.target_fraction, args.metric, args.window, args.x,
                          args.length_window, args.replicates)
    out = Path(args.out) if args.out else study_dirs(args.study_dirs)[0] / "report"
    print(f"wrote {out / 'report.md'}")
    for f in report["findings"]:
        print(finding_line(f))
    return 0
