"""The response-length sweep: how E3's GRPO/OPD FLOP ratio moves with the length of the worked solutions.

    megaopd report --length-sweep runs/length/v0 runs/length/v1 runs/length/v2 --out runs/length/report

Each directory is one point of ``configs/studies/length_sweep.sh`` (a self-teacher study whose solutions are worded
at one length; a point run with ``seeds`` counts as its seeds). Per point: the opd_self stage's GRPO/OPD FLOPs to
the GRPO checkpoint's final accuracy with its bootstrap interval (``intervals``, INTERVAL_RULE), against the
GRPO checkpoint's mean greedy response length on the final eval. Writes ``length_sweep.json``, ``length_sweep.md``
and ``ratio_vs_length.png``; the growth of the ratio is the longest point's over the shortest point's, with the
interval of that quotient: replicate b of one point divides replicate b of the other, and since the points share
their held-out problems (only the wording differs) and the resamples come from the same fixed seed, that pairs
them by problem.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from megaopd.analysis.curves import LENGTH_WINDOW, TARGET_RULE  # noqa: E402
from megaopd.analysis.findings import TARGETS, point  # noqa: E402
from megaopd.analysis.intervals import (BOOTSTRAP_SEED, INTERVAL_RULE, analyse_seeds, json_safe,  # noqa: E402
                                        pointer)
from megaopd.analysis.runs import study_dirs  # noqa: E402
from megaopd.analysis.stats import NOT_MEASURED, REPLICATES, percentile_interval, seed_bootstrap, verdict  # noqa: E402


def sweep_point(path: str | Path, target_fraction: float, metric: str, window: int, length_window: int,
                replicates: int) -> dict:
    """One sweep point: the E3 ratio (mean over seeds), its interval and replicates, and the response length."""
    dirs = study_dirs([path])
    loaded, seeds, reps, _, _ = analyse_seeds(dirs, metric, target_fraction, window, "stage", length_window,
                                              replicates)
    ratios, lengths, per_seed, step_costs = [], [], [], []
    for (_, stages), r, rep in zip(loaded, seeds, reps):
        c = next((c for c in r["comparisons"] if c["role"] == "opd_self"), None)
        if c is None or "teacher" not in c["targets"]:  # a point still running (or not a length_sweep.yaml study)
            return {"dir": str(path), "incomplete": f"{r['study_dir']}: no finished opd_self stage with its GRPO stage"}
        # Finding (c)'s check on GRPO's final accuracy: a seed whose OPD never reached it has a bound, not a ratio.
        k = next(k for k, f in enumerate(r["findings"]) if f["id"] == "c")
        label = f"{c['opd']} vs {c['grpo']} ({TARGETS['teacher']})"
        check = r["findings"][k]["checks"].get(label, {"value": None})
        ratios.append(check["value"])
        grpo, opd = (next(s for s in stages if s.name == c[role]) for role in ("grpo", "opd"))
        step_costs.append(_per_step(grpo) / _per_step(opd))
        lengths.append(grpo.final.get(f"final/{c['domain'] if c['domain'] != 'mean' else grpo.domains(metric)[0]}"
                                      "/response_length"))
        per_seed.append([point(b) for b in rep.get(pointer(("findings", k, "checks", label, "bounds")), [])]
                        or [check["value"]])
    rng = np.random.default_rng([BOOTSTRAP_SEED, len(dirs), 1])
    reps = per_seed[0] if len(per_seed) == 1 else seed_bootstrap(per_seed, rng, replicates)
    # A seed whose OPD never reached the target leaves the point without a ratio (the others are no sample of it).
    return {"dir": str(path), "seeds": len(dirs), "response_length": float(np.mean([v for v in lengths if v])),
            "ratio": float(np.mean(ratios)) if None not in ratios else None, "seed_ratios": ratios,
            "step_cost_ratio": float(np.mean(step_costs)),
            "interval": list(percentile_interval(reps) or [None, None]), "_replicates": reps}


def _per_step(stage) -> float:
    """A stage's FLOPs per training step (counted, not estimated: no interval)."""
    return stage.total() / max(stage.final.get("step", 0), 1)


def write_length_sweep(paths: list[str | Path], out: str | Path, target_fraction: float = 0.9,
                       metric: str = "greedy", window: int = 3, length_window: int = LENGTH_WINDOW,
                       replicates: int = REPLICATES) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    measured = [sweep_point(p, target_fraction, metric, window, length_window, replicates) for p in paths]
    incomplete = [p for p in measured if "incomplete" in p]
    points = sorted((p for p in measured if "incomplete" not in p), key=lambda p: p["response_length"])
    growth, interval, call = None, None, NOT_MEASURED
    conclusion = f"{len(points)} finished point(s): the growth with length needs two"
    if len(points) >= 2:
        short, long = points[0], points[-1]
        quotients = [b / a if a and b is not None and a is not None else None
                     for a, b in zip(short["_replicates"], long["_replicates"])]
        growth = long["ratio"] / short["ratio"] if short["ratio"] and long["ratio"] is not None else None
        interval = percentile_interval(quotients)
        call = verdict(interval, ">", 1.0, growth)
        cost_growth = long["step_cost_ratio"] / short["step_cost_ratio"]
        conclusion = (f"GRPO/OPD FLOP ratio at {long['response_length']:.0f} vs {short['response_length']:.0f} "
                      f"tokens: x{_num(growth)} [{_num(interval[0] if interval else None)}, "
                      f"{_num(interval[1] if interval else None)}]: "
                      + {"reproduced": "the ratio grows with response length",
                         "not reproduced": "the ratio does not grow with response length",
                         "inconclusive": "inconclusive (the interval straddles 1)"}.get(call, call)
                      + f"; per training step GRPO/OPD costs x{cost_growth:.3g} as much at the longer length")
    for p in points:
        del p["_replicates"]
    result = json_safe({"points": points, "incomplete": incomplete, "growth": growth,
                        "growth_interval": list(interval) if interval else None,
                        "grows": call, "conclusion": conclusion, "target_fraction": target_fraction,
                        "metric": metric, "rules": {"flops_to_target": TARGET_RULE, "intervals": INTERVAL_RULE}})
    (out / "length_sweep.json").write_text(json.dumps(result, indent=1))
    _plot(points, out / "ratio_vs_length.png")
    md = ["# Response-length sweep: GRPO/OPD FLOPs to the self-GRPO checkpoint's accuracy (E3)", "",
          f"- ratio: GRPO FLOPs / OPD FLOPs to the GRPO checkpoint's final smoothed accuracy ({TARGET_RULE})",
          "- response length: the GRPO checkpoint's mean greedy response length on the final eval (tokens)",
          "- per step: GRPO's over OPD's FLOPs per training step (counted, so no interval): the ratio's cost side; "
          "the rest is how many steps each needs to reach the target",
          f"- {INTERVAL_RULE} replicates = {replicates}.", "",
          "| directory | seeds | response length | GRPO/OPD | interval | GRPO/OPD per step |", "|---" * 6 + "|"]
    md += [f"| `{p['dir']}` | {p['seeds']} | {p['response_length']:.1f} | {_num(p['ratio'])} | "
           f"[{_num(p['interval'][0])}, {_num(p['interval'][1])}] | {_num(p['step_cost_ratio'])} |" for p in points]
    md += [f"| `{p['dir']}` | not finished: {p['incomplete']} | | | | |" for p in incomplete]
    md += ["", f"**{conclusion}**", "", "![ratio_vs_length.png](ratio_vs_length.png)"]
    (out / "length_sweep.md").write_text("\n".join(md) + "\n")
    return result


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def _plot(points: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if not points:
        ax.text(0.5, 0.5, "no finished sweep point", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
    shown = [p for p in points if p["ratio"] and None not in p["interval"]]
    never = [p for p in points if p not in shown]  # a ratio of 0 (OPD never reached the target): off a log axis
    positive = [v for p in points for v in (p["ratio"], *p["interval"], p["step_cost_ratio"])
                if v and not math.isinf(v)]
    floor = min(positive) / 3
    if shown:
        x, y = [p["response_length"] for p in shown], [p["ratio"] for p in shown]
        # An interval end at 0 or inf (a target never reached in some resamples) is clipped to the axes.
        lo = [p["ratio"] - max(p["interval"][0], floor) for p in shown]
        hi = [p["interval"][1] - p["ratio"] if not math.isinf(p["interval"][1]) else 10 * p["ratio"] for p in shown]
        ax.errorbar(x, y, yerr=[lo, hi], fmt="o", capsize=4, color="C0",
                    label="GRPO/OPD FLOPs to the checkpoint's accuracy (95% bootstrap)")
        for p in shown:
            ax.annotate(f"{p['ratio']:.1f}x", (p["response_length"], p["ratio"]), textcoords="offset points",
                        xytext=(6, 6), fontsize=9)
    for k, p in enumerate(never):
        top = p["interval"][1] if p["interval"][1] and not math.isinf(p["interval"][1]) else floor
        ax.vlines(p["response_length"], floor, top, color="C0", lw=1)
        ax.plot(p["response_length"], floor, "v", color="C0", ms=8,
                label=None if k else "OPD never reached it (ratio 0; line: interval's upper end)")
    ax.plot([p["response_length"] for p in points], [p["step_cost_ratio"] for p in points], "s--", color="C1",
            label="GRPO/OPD FLOPs per training step (counted)")
    ax.axhline(1.0, color="grey", lw=1, ls=":", label="equal FLOPs")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(bottom=min(floor / 1.5, 0.8))  # the equal-FLOPs line stays in view
    ax.set_xlabel("mean response length of the GRPO checkpoint (tokens, log scale)")
    ax.set_ylabel("GRPO / OPD FLOPs")
    ax.margins(x=0.15)
    ax.set_title("E3 (self-GRPO teacher): FLOP ratio vs response length (log-log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
