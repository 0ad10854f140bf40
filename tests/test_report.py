"""The study report: FLOPs-to-target and split-vs-joint on hand-computed curves, and a synthetic study directory
(every method the report compares) whose report.json must hold the hand-computed ratio, share and saving."""

from __future__ import annotations

import json

import pytest
import yaml

from megaopd.analysis import flops_to_target, smooth, split_vs_joint
from megaopd.analysis.report import main, write_report
from megaopd.analysis.stats import interval_wording


# ---- the pure functions ----

def test_smooth_is_a_trailing_mean_with_fewer_values_at_the_start():
    assert smooth([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert smooth([3.0, 0.0, 0.0, 3.0], 3) == [3.0, 1.5, 1.0, 1.0]


def test_flops_to_target_interpolates_between_the_crossing_evals():
    assert flops_to_target([0, 10, 20], [0.0, 0.5, 1.0], 0.75, window=1) == pytest.approx(15.0)
    # Smoothed [0, .5, 2/3, 1]: crosses 0.9 between 20 and 30, at 20 + (0.9 - 2/3) / (1/3) * 10 = 27.
    assert flops_to_target([0, 10, 20, 30], [0.0, 1.0, 1.0, 1.0], 0.9, window=3) == pytest.approx(27.0)
    assert flops_to_target([0, 10, 20, 30], [0.0, 1.0, 1.0, 1.0], 0.9, window=1) == pytest.approx(9.0)


def test_flops_to_target_first_eval_and_exact_hit():
    assert flops_to_target([5, 10], [0.8, 0.9], 0.7, window=3) == 5.0
    assert flops_to_target([0, 100, 200, 300], [0.2, 0.3, 0.4, 0.5], 0.5, window=1) == pytest.approx(300.0)


def test_smoothing_ignores_a_single_spike_and_never_reached_is_none():
    flops, acc = [0, 10, 20, 30], [0.0, 1.0, 0.0, 0.0]
    assert flops_to_target(flops, acc, 0.6, window=1) == pytest.approx(6.0)
    assert flops_to_target(flops, acc, 0.6, window=3) is None  # smoothed peak is 0.5
    assert flops_to_target([0, 1], [0.1, 0.2], 0.3) is None


def test_split_vs_joint_known_numbers():
    r = split_vs_joint([1000, 3000], [0, 50, 100, 200], [0.3, 0.5, 0.6, 0.7],
                       [0, 2000, 4000, 6000, 8000], [0.3, 0.4, 0.5, 0.6, 0.65], target=0.55, window=1)
    assert r["merge_flops_to_target"] == pytest.approx(75.0)
    assert r["joint_flops_to_target"] == pytest.approx(5000.0)
    assert r["split_flops"] == pytest.approx(4075.0)
    assert r["saving"] == pytest.approx(1 - 4075 / 5000)


def test_split_vs_joint_merge_not_reached():
    r = split_vs_joint([1000, 3000], [0, 50, 100], [0.3, 0.4, 0.45], [0, 10, 20], [0.3, 0.5, 0.6], target=0.55,
                       window=1)
    assert r["merge_flops_to_target"] is None and r["split_flops"] is None and r["saving"] is None
    assert r["merge_best_smoothed"] == pytest.approx(0.45)
    assert r["joint_flops_to_target"] == pytest.approx(15.0)


# ---- a synthetic study directory ----

def write_stage(root, name, algorithm, evals, final, lengths=(), components=None, config=None):
    """evals: [(stage FLOPs, {domain: accuracy})] at steps 0, 10, ...; lengths: one training line between evals;
    config: the config.yaml to write, if any."""
    run = root / name
    run.mkdir(parents=True)
    if config is not None:
        (run / "config.yaml").write_text(yaml.safe_dump(config))

    def flops(f):
        return {"flops/rollout": 0.0, "flops/old_logprob": 0.0, "flops/reference": 0.0, "flops/teacher": 0.0,
                "flops/train": float(f), **{f"flops/{k}": v for k, v in (components or {}).items()},
                "flops/total_stage": float(f),
                "flops/total_with_teachers": 2.0 * f, "flops/total_with_cold_start": 3.0 * f,
                "flops/total_external": 0.0}

    lines = []
    for i, (f, acc) in enumerate(evals):
        if 0 < i <= len(lengths):
            prev = evals[i - 1][0]
            lines.append({"step": 10 * i - 5, "rollout/response_length": lengths[i - 1], "rollout/reward": 0.5,
                          **flops((prev + f) / 2)})
        lines.append({"step": 10 * i, **{f"eval/{d}/accuracy_greedy": a for d, a in acc.items()}, **flops(f)})
    last = evals[-1][0]
    lines.append({"step": 10 * (len(evals) - 1), **{f"final/{d}/accuracy_greedy": a for d, a in final.items()},
                  **flops(last)})
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    summary = {"algorithm": algorithm, "steps": lines[-1]["step"],
               "final": {f"final/{d}/accuracy_greedy": a for d, a in final.items()}}
    (run / "summary.json").write_text(json.dumps(summary))


def mean_curve(flops, acc):
    return [(f, {"mean": a}) for f, a in zip(flops, acc)]


def on_data(*train: str) -> dict:
    """A config.yaml starting from the base and training on `train`: what pairs a control with its OPD stages."""
    return {"model": {"path": "study/base/final"}, "data": {"train": list(train)}}


def make_study(root, opd_self_scale=1.0, ext_that_wins=False, control=False):
    """Hand-computed with window 1; targets are the last point of the GRPO (joint) curve. E3: GRPO reaches its final
    0.5 at 300, opd_self at 15 x scale (ratio 20/scale).
    E1: opd_external never reaches 0.5 and its length doubles (GRPO's grows x1.2). E6: student 0.78 / 0.60 vs experts
    0.80 / 0.70 (prog_trace 0.1 below: not matched), share 200 / 4000 = 5%. E7: target 0.6, merge reaches it at 100,
    joint at 6000: split 4100, saving 1 - 4100/6000. ext_that_wins adds an external OPD that reaches 0.5 at 50 FLOPs
    (6x fewer than GRPO) with a flat length, so that (a) and (b) fail for one of two pairs. control adds a teacher-free
    stage on opd_self's and opd_ext's base and data (multi trains on both domains: not its pair) reaching 0.25, 0.35,
    0.45 at 100, 200, 300."""
    root.mkdir(parents=True)
    write_stage(root, "base", "sft", mean_curve([0, 100], [0.1, 0.2]), {"mean": 0.2})
    write_stage(root, "grpo", "grpo", mean_curve([0, 100, 200, 300], [0.2, 0.3, 0.4, 0.5]), {"mean": 0.5},
                lengths=[10, 11, 12], components={"rollout": 40.0})
    write_stage(root, "opd_self", "opd", mean_curve([0, 10 * opd_self_scale, 20 * opd_self_scale, 30 * opd_self_scale],
                                                    [0.2, 0.4, 0.6, 0.6]), {"mean": 0.55}, lengths=[10, 10, 10],
                config=on_data("add.jsonl"))
    write_stage(root, "opd_ext", "opd", mean_curve([0, 100, 200, 300, 400], [0.2, 0.25, 0.3, 0.35, 0.4]),
                {"mean": 0.4}, lengths=[10, 14, 18, 20], config=on_data("add.jsonl"))
    write_stage(root, "expert_add", "grpo", [(0, {"arith_add": 0.3, "mean": 0.3}),
                                             (1000, {"arith_add": 0.8, "mean": 0.8})],
                {"arith_add": 0.8, "mean": 0.8})
    write_stage(root, "expert_trace", "grpo", [(0, {"prog_trace": 0.3, "mean": 0.3}),
                                               (3000, {"prog_trace": 0.7, "mean": 0.7})],
                {"prog_trace": 0.7, "mean": 0.7})
    write_stage(root, "multi", "opd", mean_curve([0, 50, 100, 200], [0.3, 0.5, 0.6, 0.7]),
                {"arith_add": 0.78, "prog_trace": 0.6, "mean": 0.69}, config=on_data("add.jsonl", "trace.jsonl"))
    write_stage(root, "joint", "grpo", mean_curve([0, 2000, 4000, 6000], [0.3, 0.4, 0.5, 0.6]),
                {"arith_add": 0.62, "prog_trace": 0.58, "mean": 0.6})
    stages = [("base", "base", "", ""), ("grpo", "grpo", "", ""), ("opd_self", "opd_self", "grpo", ""),
              ("opd_ext", "opd_external", "grpo", ""), ("expert_add", "expert", "", "arith_add"),
              ("expert_trace", "expert", "", "prog_trace"), ("multi", "multi_teacher_opd", "", ""),
              ("joint", "joint_grpo", "", "")]
    if ext_that_wins:
        write_stage(root, "opd_ext2", "opd", mean_curve([0, 25, 50], [0.2, 0.4, 0.5]), {"mean": 0.5},
                    lengths=[10, 10])
        stages.append(("opd_ext2", "opd_external_grpo", "grpo", ""))
    if control:
        write_stage(root, "control", "fixed_advantage", mean_curve([0, 100, 200, 300], [0.2, 0.25, 0.35, 0.45]), {"mean": 0.45},
                    lengths=[10, 10, 10], config=on_data("add.jsonl"))
        stages.append(("control", "control", "", ""))
    study = {"out": str(root), "seed": 0, "stages": [{"name": n, "config": "x.yaml", "overrides": [], "role": m,
                                                      "compare_with": c, "domain": d} for n, m, c, d in stages]}
    (root / "study.yaml").write_text(yaml.safe_dump(study))
    return root


def test_a_control_recorded_under_its_old_name_reads_under_the_new_one(tmp_path):
    """A study directory written before the renames (its study.yaml's stages labelled under the key method, the
    control teacher_free;
    train.algorithm=opsa and an opsa: section in the run's config.yaml, opsa in its summary.json) still loads, as
    the new spelling, and reports: fixed_advantage and control in the stage table, still the control of the OPD
    stages of its base and data."""
    from megaopd.config import load_config

    root = make_study(tmp_path / "study", control=True)
    study = (root / "study.yaml").read_text()
    assert "role: control\n" in study and "role: grpo\n" in study
    (root / "study.yaml").write_text(study.replace("role: control\n", "method: teacher_free\n")
                                     .replace("role: grpo\n", "method: grpo\n"))
    run = root / "control"
    (run / "config.yaml").write_text(yaml.safe_dump({**on_data("add.jsonl"), "train": {"algorithm": "opsa"},
                                                     "opsa": {"fraction": 0.3, "scale": "none"}}))
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps(summary | {"algorithm": "opsa", "form": "opsa"}))
    cfg = load_config(run / "config.yaml")
    assert cfg.train.algorithm == "fixed_advantage" and cfg.fixed_advantage.fraction == 0.3
    report = write_report(root, target_fraction=0.5, window=1, length_window=1)
    seed = report["seeds"][0]
    assert seed["stages"]["control"]["algorithm"] == "fixed_advantage"
    assert seed["stages"]["control"]["role"] == "control"
    assert [(c["opd"], c["control"]) for c in seed["controls"]] == [("opd_self", "control"),
                                                                         ("opd_ext", "control")]
    assert "opsa" not in (root / "report" / "report.md").read_text()


def verdicts(report):
    return {f["id"]: f["verdict"] for f in report["findings"]}


def test_synthetic_study_numbers_and_findings(tmp_path):
    study = make_study(tmp_path / "study")
    report = write_report(study, target_fraction=0.5, window=1, length_window=1)
    out = study / "report"
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(report))
    for png in ("accuracy_mean.png", "accuracy_arith_add.png", "accuracy_prog_trace.png", "response_length.png"):
        assert (out / png).stat().st_size > 10_000
    seed = report["seeds"][0]
    e3 = next(c for c in seed["comparisons"] if c["opd"] == "opd_self")
    assert e3["targets"]["teacher"]["grpo_flops"] == pytest.approx(300.0)
    assert e3["targets"]["teacher"]["opd_flops"] == pytest.approx(15.0)
    assert e3["targets"]["teacher"]["ratio"] == pytest.approx(20.0)
    # Fraction target: base 0.2 + 0.5 x (0.5 - 0.2) = 0.35: GRPO at 150, OPD at 7.5.
    assert e3["targets"]["fraction"]["target"] == pytest.approx(0.35)
    assert e3["targets"]["fraction"]["ratio"] == pytest.approx(150 / 7.5)
    e1 = next(c for c in seed["comparisons"] if c["opd"] == "opd_ext")
    assert e1["targets"]["teacher"]["opd_flops"] is None
    assert e1["targets"]["teacher"]["opd_best_smoothed"] == pytest.approx(0.4)
    (mt,) = seed["multi_teacher"]
    assert mt["share"] == pytest.approx(0.05)
    assert mt["domains"]["prog_trace"]["gap"] == pytest.approx(-0.1)
    (sj,) = seed["split_vs_joint"]
    assert sj["split_flops"] == pytest.approx(4100.0) and sj["joint_flops_to_target"] == pytest.approx(6000.0)
    assert sj["saving"] == pytest.approx(1 - 4100 / 6000)
    assert seed["stages"]["grpo"]["totals"]["with_cold_start"] == pytest.approx(900.0)
    assert seed["stages"]["grpo"]["components"]["rollout"] == pytest.approx(40.0)
    assert seed["stages"]["opd_ext"]["length"] == {"first": 10.0, "last": 20.0}
    assert verdicts(report) == {"a": "reproduced", "b": "reproduced", "c": "reproduced", "d": "not reproduced",
                                "e": "reproduced", "f": "reproduced", "g1": "not measured in this study",
                                "g2": "not measured in this study"}
    md = (out / "report.md").read_text()
    assert "single seed" in md and "interpolate linearly in FLOPs" in md
    assert "GRPO/OPD 20 > 1: reproduced" in md and "5.0%" in md and "31.7%" in md
    assert "not reached (best smoothed 0.400)" in md
    assert "![accuracy_mean.png](accuracy_mean.png)" in md


def test_each_opd_stage_against_the_control_of_its_base_and_data(tmp_path):
    """(g1)/(g2), window 1: opd_self reaches its final 0.6 at 20 FLOPs, the control never (best 0.45 at 300 FLOPs):
    the control/OPD ratio is more than 300/20 = 15, a bound that settles (g2); opd_ext reaches its 0.4 at 400, the
    control at 250 (0.625): one pair fails, so the finding. multi trains on other data: no pair."""
    report = write_report(make_study(tmp_path / "study", control=True), target_fraction=0.5, window=1,
                          length_window=1)
    pairs = {(c["opd"], c["control"]): c for c in report["seeds"][0]["controls"]}
    assert list(pairs) == [("opd_self", "control"), ("opd_ext", "control")]
    own = pairs["opd_self", "control"]["targets"]
    assert own["teacher"]["target"] == pytest.approx(0.6) and own["teacher"]["opd_flops"] == pytest.approx(20.0)
    # Censored, not a sentinel: no ratio, the control's FLOPs bounded below by its last eval's.
    assert own["teacher"]["control_flops"] is None and own["teacher"]["ratio"] is None
    assert own["teacher"]["control_flops_more_than"] == pytest.approx(300.0)
    # base + 0.5 x OPD's gain = 0.4: OPD at 10, the control at 250 (between 0.35 at 200 and 0.45 at 300)
    assert own["fraction"]["target"] == pytest.approx(0.4) and own["fraction"]["ratio"] == pytest.approx(25.0)
    assert pairs["opd_ext", "control"]["targets"]["teacher"]["ratio"] == pytest.approx(250 / 400)
    g2 = next(f for f in report["findings"] if f["id"] == "g2")
    assert g2["checks"]["opd_self vs control"]["bounds"] == [pytest.approx(15.0), None]
    assert {label: c["verdict"] for label, c in g2["checks"].items()} == {
        "opd_self vs control": "reproduced", "opd_ext vs control": "not reproduced"}
    assert g2["verdict"] == "not reproduced"
    # (g1): the control's best 0.45 vs opd_self's 0.6 (never attained), vs opd_ext's 0.4 (attained).
    g1 = next(f for f in report["findings"] if f["id"] == "g1")
    assert g1["checks"]["opd_self vs control"]["value"] == pytest.approx(-0.15)
    assert {label: c["verdict"] for label, c in g1["checks"].items()} == {
        "opd_self vs control": "reproduced", "opd_ext vs control": "not reproduced"}
    out = tmp_path / "study" / "report"
    assert "controls.png" in report["plots"] and (out / "controls.png").stat().st_size > 10_000
    md = (out / "report.md").read_text()
    assert "| opd_self | control | mean | OPD final | 0.600 | 2.000e+01 | not reached (best smoothed 0.450) | > 15 |" \
        in md
    assert "control/OPD > 15 > 1: reproduced" in md


def test_seeds_give_mean_and_spread_and_a_split_verdict(tmp_path):
    # Seed 1's opd_self is 100x slower: ratio 0.2, so (c) holds in one seed only.
    dirs = [make_study(tmp_path / "s0"), make_study(tmp_path / "s1", opd_self_scale=100.0)]
    out = tmp_path / "rep"
    assert main([str(d) for d in dirs] + ["--out", str(out), "--target-fraction", "0.5", "--window", "1",
                                          "--length-window", "1"]) == 0
    report = json.loads((out / "report.json").read_text())
    spread = report["spread"]["FLOPs ratio GRPO/OPD, opd_self vs grpo (teacher target)"]
    # No per-prompt results: the interval is the seeds' bootstrap alone (means of 0.2 and 20 drawn with replacement).
    assert spread.pop("interval") == pytest.approx([0.2, 20.0])
    # A ratio's mean is geometric, as the finding pools it: 0.2 and 20 are 5x each way from 1, not a mean of 10.1.
    assert spread == pytest.approx({"mean": 2.0, "min": 0.2, "max": 20.0, "n": 2})
    c = next(f for f in report["findings"] if f["id"] == "c")
    assert c["checks"]["opd_self vs grpo (GRPO final)"]["value"] == pytest.approx(spread["mean"])
    # Its interval [0.2, 20] straddles 1.
    assert c["verdict"] == "inconclusive" and c["seeds_reproduced"] == "1 of 2"
    assert verdicts(report)["e"] == "reproduced"
    md = (out / "report.md").read_text()
    assert "single seed" not in md
    assert "- FLOPs ratio GRPO/OPD, opd_self vs grpo (teacher target): 2 [0.2, 20] (min 0.2, max 20, defined in 2 of " \
           "2 seeds)" in md
    # The interval is named for what it is: two seeds give three seed draws, little more than their range.
    assert report["rules"]["interval"] == interval_wording(2) and f"Intervals: a {interval_wording(2)}." in md


def test_one_of_two_pairs_failing_means_not_reproduced(tmp_path):
    report = write_report(make_study(tmp_path / "study", ext_that_wins=True), window=1, length_window=1)
    v = verdicts(report)
    assert v["a"] == "not reproduced" and v["b"] == "not reproduced" and v["c"] == "reproduced"
    e2 = next(c for c in report["seeds"][0]["comparisons"] if c["opd"] == "opd_ext2")
    assert e2["targets"]["teacher"]["ratio"] == pytest.approx(6.0)


def test_stages_without_a_role_are_not_measured(tmp_path):
    study = make_study(tmp_path / "study")
    doc = yaml.safe_load((study / "study.yaml").read_text())
    for s in doc["stages"]:
        del s["role"]
    (study / "study.yaml").write_text(yaml.safe_dump(doc))
    report = write_report(study)
    assert set(verdicts(report).values()) == {"not measured in this study"}
    assert report["seeds"][0]["stages"]["grpo"]["role"] == "other"


def test_targets_come_from_the_smoothed_curves_not_the_final_eval(tmp_path):
    # With window 3 joint GRPO's smoothed curve is [0.3, 0.35, 0.4, 0.5]: the E7 target is its last point, 0.5
    # (the final eval, 0.6, is on other prompts), which joint GRPO reaches at its last eval.
    study = make_study(tmp_path / "study")
    report = write_report(study, window=3)
    (sj,) = report["seeds"][0]["split_vs_joint"]
    assert sj["target"] == pytest.approx(0.5) and sj["joint_flops_to_target"] == pytest.approx(6000.0)
    e3 = next(c for c in report["seeds"][0]["comparisons"] if c["opd"] == "opd_self")
    assert e3["teacher"] == pytest.approx(0.4)  # GRPO's smoothed curve ends at (0.3 + 0.4 + 0.5) / 3


# ---- intervals and three-way verdicts from per-prompt results (known answers) ----

N = 1000  # held-out prompts per domain


def correct(k: int, flip_to_wrong: int = 0, flip_to_right: int = 0) -> list[int]:
    """k of N prompts right (the first k), then `flip_to_wrong` of those wrong and `flip_to_right` others right."""
    v = [1] * k + [0] * (N - k)
    for i in range(flip_to_wrong):
        v[i] = 0
    for i in range(flip_to_right):
        v[k + i] = 1
    return v


def write_records(run, step_vectors: dict):
    """evals/<step or final>.json as the evaluator writes them: {step | "final": {domain: [reward per prompt]}}."""
    (run / "evals").mkdir()
    for step, by_domain in step_vectors.items():
        final = step == "final"
        record = {"step": 0 if final else step, "final": final,
                  "prompts": {d: {"n": len(v), "sha1": f"{d}-{len(v)}"} for d, v in by_domain.items()},
                  "reward": {"greedy": by_domain}}
        (run / "evals" / ("final.json" if final else f"step_{step:06d}.json")).write_text(json.dumps(record))


def make_e6_study(root, trace_student: list[int]):
    """Experts 0.5 on each domain; the student matches arith_add (80 prompts swapped: gap 0) and has
    `trace_student` on prog_trace. Only (d) and (e) are measured."""
    root.mkdir(parents=True)
    expert = correct(500)
    students = {"arith_add": correct(500, 40, 40), "prog_trace": trace_student}
    for name, domain in (("expert_add", "arith_add"), ("expert_trace", "prog_trace")):
        write_stage(root, name, "grpo", [(0, {domain: 0.3, "mean": 0.3}), (1000, {domain: 0.5, "mean": 0.5})],
                    {domain: 0.5, "mean": 0.5})
        write_records(root / name, {"final": {domain: expert}})
    final = {d: sum(v) / N for d, v in students.items()}
    write_stage(root, "multi", "opd", mean_curve([0, 100], [0.3, 0.4]), {**final, "mean": sum(final.values()) / 2})
    write_records(root / "multi", {"final": students})
    stages = [("expert_add", "expert", "arith_add"), ("expert_trace", "expert", "prog_trace"),
              ("multi", "multi_teacher_opd", "")]
    study = {"out": str(root), "seed": 0, "stages": [{"name": n, "config": "x.yaml", "overrides": [], "role": m,
                                                      "domain": d} for n, m, d in stages]}
    (root / "study.yaml").write_text(yaml.safe_dump(study))
    return root


def checks(report, finding):
    return next(f for f in report["findings"] if f["id"] == finding)["checks"]


@pytest.mark.parametrize("trace_student, trace_verdict, overall", [
    # 50 of the expert's right answers lost: gap -0.05 exactly, at the tolerance: the interval must straddle it.
    (correct(500, 50), "inconclusive", "inconclusive"),
    # 200 lost: gap -0.2, far below the tolerance whatever the resample.
    (correct(500, 200), "not reproduced", "not reproduced"),
    # 20 lost: gap -0.02 with 1000 prompts: within the tolerance in every resample that matters.
    (correct(500, 20), "reproduced", "reproduced"),
])
def test_gap_intervals_and_three_way_verdict(tmp_path, trace_student, trace_verdict, overall):
    report = write_report(make_e6_study(tmp_path / "study", trace_student), replicates=400)
    d = checks(report, "d")
    add, trace = d["multi arith_add"], d["multi prog_trace"]
    # The paired resample: 40 prompts lost, 40 gained, SE of the gap sqrt(80 / N) / sqrt(N) = 0.0089.
    assert add["value"] == pytest.approx(0.0) and add["verdict"] == "reproduced"
    assert -0.03 < add["interval"][0] < -0.01 and 0.01 < add["interval"][1] < 0.03
    lost = N - sum(trace_student) - 500
    se = (lost / N) ** 0.5 / N ** 0.5 * (1 - lost / N) ** 0.5  # a gap of -lost/N from `lost` paired -1s
    lo, hi = trace["interval"]
    assert lo < trace["value"] < hi and (hi - lo) / 2 == pytest.approx(1.96 * se, rel=0.25)
    assert trace["verdict"] == trace_verdict and verdicts(report)["d"] == overall
    # FLOPs do not move with the prompts: (e) has no interval and a two-way verdict.
    assert checks(report, "e")["multi"]["interval"] is None and verdicts(report)["e"] == "reproduced"
    assert verdicts(report)["a"] == "not measured in this study"
    md = (tmp_path / "study" / "report" / "report.md").read_text()
    assert f"{trace_verdict}" in md and "percentile bootstrap" in md


def make_e3_curves(root, opd_acc: list[int]):
    """E3 with per-prompt results: GRPO climbs 0.2 -> 0.5 over 300 FLOPs; OPD has `opd_acc` of N right at 0, 10,
    20 and 30 FLOPs (the first k prompts right: the two stages' results are paired)."""
    root.mkdir()
    for name, flops, acc in (("grpo", [0, 100, 200, 300], [200, 300, 400, 500]),
                             ("opd_self", [0, 10, 20, 30], opd_acc)):
        write_stage(root, name, "x", mean_curve(flops, [a / N for a in acc]), {"mean": acc[-1] / N},
                    lengths=[10, 10, 10])
        write_records(root / name, {**{10 * i: {"arith_add": correct(a)} for i, a in enumerate(acc)},
                                    "final": {"arith_add": correct(acc[-1])}})
    study = {"out": str(root), "seed": 0, "stages": [
        {"name": "grpo", "config": "x.yaml", "role": "grpo"},
        {"name": "opd_self", "config": "x.yaml", "role": "opd_self", "compare_with": "grpo"}]}
    (root / "study.yaml").write_text(yaml.safe_dump(study))


def test_curve_intervals_standard_errors_and_a_reproducible_report(tmp_path):
    """E3 on curves with per-prompt results: GRPO climbs 0.2 -> 0.5 over 300 FLOPs, OPD reaches 0.6 by 30 FLOPs:
    the ratio's interval is far above 1 (reproduced), every curve point has its standard error, and the same
    directory gives a byte-identical report.json."""
    root = tmp_path / "study"
    make_e3_curves(root, [200, 450, 600, 600])
    report = write_report(root, window=1, replicates=300)
    c = checks(report, "c")["opd_self vs grpo (GRPO final)"]
    assert c["value"] == pytest.approx(300 / (10 + 10 / 3))  # OPD crosses 0.5 a third of the way from 10 to 20
    lo, hi = c["interval"]
    assert 1 < lo < c["value"] < hi and c["verdict"] == "reproduced"
    seed = report["seeds"][0]
    points = seed["curves"]["grpo"]["mean"]
    assert [p[:2] for p in points] == [[0.0, 0.2], [100.0, 0.3], [200.0, 0.4], [300.0, 0.5]]
    assert points[-1][2] == pytest.approx((0.25 / (N - 1)) ** 0.5)  # sqrt(sample variance / n) at p = 0.5
    first = (root / "report" / "report.json").read_bytes()
    write_report(root, window=1, replicates=300)
    assert (root / "report" / "report.json").read_bytes() == first


def make_length_point(root, length: float, opd_flops_to_target: float):
    """A self-teacher sweep point: GRPO climbs 0.2 -> 0.5 over 300 FLOPs (crossing its final 0.5 at 300) with
    responses of `length` tokens; OPD climbs linearly to 0.6 and crosses 0.5 at `opd_flops_to_target`."""
    root.mkdir(parents=True)
    x = opd_flops_to_target / 0.75  # OPD: 0.2, 0.4, 0.6 at 0, x/2, x: crosses 0.5 at 0.75 x
    opd_acc = [200, 400, 600]
    curves = (("grpo", [0, 100, 200, 300], [200, 300, 400, 500]), ("opd_self", [0, x / 2, x], opd_acc))
    for name, flops, acc in curves:
        write_stage(root, name, "x", mean_curve(flops, [a / N for a in acc]), {"arith_add": acc[-1] / N,
                                                                            "mean": acc[-1] / N})
        write_records(root / name, {**{10 * i: {"arith_add": correct(a)} for i, a in enumerate(acc)},
                                    "final": {"arith_add": correct(acc[-1])}})
    lines = (root / "grpo" / "metrics.jsonl").read_text().splitlines()
    final = json.loads(lines[-1]) | {"final/arith_add/response_length": length}
    (root / "grpo" / "metrics.jsonl").write_text("\n".join(lines[:-1] + [json.dumps(final)]) + "\n")
    study = {"out": str(root), "seed": 0, "stages": [
        {"name": "grpo", "config": "x.yaml", "role": "grpo"},
        {"name": "opd_self", "config": "x.yaml", "role": "opd_self", "compare_with": "grpo"}]}
    (root / "study.yaml").write_text(yaml.safe_dump(study))
    return root


def test_length_sweep_ratio_grows_with_length(tmp_path):
    # OPD reaches GRPO's final accuracy at 30, 15 and 5 FLOPs as responses grow 20 -> 60 -> 150 tokens: the ratio
    # grows 300/30 = 10 -> 300/5 = 60, x6, with an interval far above 1.
    points = [make_length_point(tmp_path / f"v{k}", length, f)
              for k, (length, f) in enumerate([(20.0, 30.0), (60.0, 15.0), (150.0, 5.0)])]
    out = tmp_path / "sweep"
    assert main([str(p) for p in points] + ["--length-sweep", "--out", str(out), "--window", "1",
                                            "--replicates", "200"]) == 0
    sweep = json.loads((out / "length_sweep.json").read_text())
    assert [p["response_length"] for p in sweep["points"]] == [20.0, 60.0, 150.0]
    assert [p["ratio"] for p in sweep["points"]] == pytest.approx([10.0, 20.0, 60.0])
    # Per training step: GRPO 300 FLOPs / 30 steps over OPD's 4/3 x its target / 20 steps.
    assert [p["step_cost_ratio"] for p in sweep["points"]] == pytest.approx([5.0, 10.0, 30.0])
    assert sweep["growth"] == pytest.approx(6.0) and sweep["grows"] == "reproduced"
    lo, hi = sweep["growth_interval"]
    assert 1 < lo <= sweep["growth"] + 1e-9 and sweep["growth"] - 1e-9 <= hi
    assert (out / "ratio_vs_length.png").stat().st_size > 10_000
    assert "the ratio grows with response length" in (out / "length_sweep.md").read_text()
    assert "per training step GRPO/OPD costs x6 as much" in sweep["conclusion"]


def test_teacher_cost_is_read_from_relative_model_paths_wherever_the_report_runs(tmp_path, monkeypatch):
    """A study started with a relative `out` records relative model paths: the report finds them from the run
    directory's own location, not from the directory the report happens to run in."""
    from megaopd.models.embedded import build_model_config
    from megaopd.accounting.flops import ModelShape

    started = tmp_path / "checkout"
    study = make_study(started / "runs" / "s")
    shapes = {}
    for preset in ("qwen3-tiny", "qwen3-base"):
        model = started / "runs" / "s" / "models" / preset
        model.mkdir(parents=True)
        config = build_model_config(preset, 259, 258, 256)
        config.save_pretrained(model)
        shapes[preset] = ModelShape.from_hf_config(config).matmul_params
    (study / "opd_ext" / "config.yaml").write_text(yaml.safe_dump({
        "run_dir": "runs/s/opd_ext", "model": {"path": "runs/s/models/qwen3-tiny"},
        "opd": {"teachers": {"*": "runs/s/models/qwen3-base"}}}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    report = write_report([str(study)], tmp_path / "report")
    (ext,) = [c for c in report["seeds"][0]["comparisons"] if c["opd"] == "opd_ext"]
    assert ext["teacher_cost_ratio"] == pytest.approx(shapes["qwen3-base"] / shapes["qwen3-tiny"])


def time_stage(run, step_seconds, waits=None, max_staleness=None):
    """Adds perf/step_seconds (and perf/rollout_wait_seconds) to a stage's training lines, in order, and a config.yaml
    with rollout.max_staleness."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    training = [m for m in lines if "rollout/response_length" in m]
    assert len(training) == len(step_seconds)
    for k, m in enumerate(training):
        m["perf/step_seconds"] = step_seconds[k]
        if waits is not None:
            m["perf/rollout_wait_seconds"] = waits[k]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    if max_staleness is not None:
        (run / "config.yaml").write_text(yaml.safe_dump({"rollout": {"max_staleness": max_staleness}}))


def test_wall_clock_per_stage_from_the_perf_keys_and_a_dash_without_them(tmp_path):
    """grpo at K=1 timed in both seeds (seed 0: 2+4+6 s, waits 1+1+1; seed 1: 4+8+12 s, waits 2+2+3); opd_self
    logged step seconds but no waits (a run from before they were logged); base has no perf keys and no config."""
    dirs = [make_study(tmp_path / "s0"), make_study(tmp_path / "s1")]
    time_stage(dirs[0] / "grpo", [2.0, 4.0, 6.0], [1.0, 1.0, 1.0], max_staleness=1)
    time_stage(dirs[1] / "grpo", [4.0, 8.0, 12.0], [2.0, 2.0, 3.0], max_staleness=1)
    time_stage(dirs[0] / "opd_self", [1.0, 2.0, 3.0], max_staleness=0)
    report = write_report(dirs, tmp_path / "rep", window=1, length_window=1, replicates=0)
    stages = [r["stages"] for r in report["seeds"]]
    assert stages[0]["grpo"]["wall_clock"] == pytest.approx(
        {"steps_timed": 3, "step_seconds": 4.0, "train_seconds": 12.0, "rollout_wait_share": 0.25})
    assert stages[1]["grpo"]["wall_clock"]["rollout_wait_share"] == pytest.approx(7 / 24)
    assert stages[0]["grpo"]["max_staleness"] == 1 and stages[0]["opd_self"]["max_staleness"] == 0
    assert stages[0]["opd_self"]["wall_clock"] == {"steps_timed": 3, "step_seconds": 2.0, "train_seconds": 6.0,
                                                   "rollout_wait_share": None}
    assert stages[0]["base"]["max_staleness"] is None
    assert stages[0]["base"]["wall_clock"] == {"steps_timed": 0, "step_seconds": None, "train_seconds": None,
                                               "rollout_wait_share": None}
    across = report["wall_clock"]
    assert across["grpo"]["max_staleness"] == [1]
    assert across["grpo"]["step_seconds"] == pytest.approx({"mean": 6.0, "min": 4.0, "max": 8.0, "n": 2})
    assert across["grpo"]["rollout_wait_share"]["mean"] == pytest.approx((0.25 + 7 / 24) / 2)
    assert across["opd_self"]["step_seconds"]["n"] == 1 and across["opd_self"]["rollout_wait_share"] is None
    assert across["base"]["step_seconds"] is None
    md = (tmp_path / "rep" / "report.md").read_text()
    across_md = md.split("## Wall-clock per stage across seeds")[1].split("## Plots")[0]
    rows = {line.split(" | ")[0]: line for line in across_md.splitlines() if line.startswith("| ")}
    assert rows["| grpo"].endswith("| 1 | 6 (4-8, n=2) | 18 (12-24, n=2) | 27% (25%-29%, n=2) |")
    assert rows["| base"].endswith("| - | - | - | - |")
    seed0 = md.split("## Study 1")[1].split("## Study 2")[0]
    grpo_row = next(line for line in seed0.splitlines() if line.startswith("| grpo | grpo |"))
    assert grpo_row.endswith("| 1 | 4 | 12 | 25% |")
    opd_row = next(line for line in seed0.splitlines() if line.startswith("| opd_self | opd_self |"))
    assert opd_row.endswith("| 0 | 2 | 6 | - |")


def budget_study(root):
    """An expert that reaches its 0.8 at step 10 and stays there, a multi-teacher student that gets to 0.8 only at
    its final step 30, and a joint GRPO stage still climbing. Window 1: (d) is 0.3 below at 50% of the runs, 0.1
    below at 75%, matched at 100% (budget-dependent, changing at 100%); (e)'s share is 1% at every cut (not)."""
    root.mkdir(parents=True)
    write_stage(root, "expert_add", "grpo", [(f, {"arith_add": a, "mean": a}) for f, a in
                                             ((0, 0.3), (1000, 0.8), (2000, 0.8), (3000, 0.8))],
                {"arith_add": 0.8, "mean": 0.8})
    write_stage(root, "multi", "opd", [(f, {"arith_add": a, "mean": a}) for f, a in
                                       ((0, 0.3), (10, 0.5), (20, 0.7), (30, 0.8))], {"arith_add": 0.8, "mean": 0.8})
    write_stage(root, "joint", "grpo", mean_curve([0, 2000, 4000, 6000], [0.3, 0.4, 0.5, 0.6]), {"mean": 0.6})
    stages = [("expert_add", "expert", "arith_add"), ("multi", "multi_teacher_opd", ""), ("joint", "joint_grpo", "")]
    study = {"out": str(root), "stages": [{"name": n, "config": "x.yaml", "role": m, "domain": d}
                                          for n, m, d in stages]}
    (root / "study.yaml").write_text(yaml.safe_dump(study))
    return root


def test_budget_sensitivity_flags_the_finding_that_flips_under_a_shorter_budget(tmp_path):
    from megaopd.analysis import cut_stage, load_study

    report = write_report(budget_study(tmp_path / "study"), window=1, length_window=1)
    by_id = {f["id"]: f for f in report["findings"]}
    d, e = by_id["d"]["budget"], by_id["e"]["budget"]
    assert [c["verdict"] for c in d["cuts"].values()] == ["not reproduced", "not reproduced", "reproduced"]
    assert [c["values"]["multi arith_add"] for c in d["cuts"].values()] == [pytest.approx([v, v])
                                                                            for v in (-0.3, -0.1, 0.0)]
    assert d["budget_dependent"] and d["changes_at"] == "100%"
    assert not e["budget_dependent"] and e["changes_at"] is None
    assert [c["values"]["multi"] for c in e["cuts"].values()] == [pytest.approx([0.01, 0.01])] * 3
    md = (tmp_path / "study" / "report" / "report.md").read_text()
    assert "**budget-dependent** (changes at 100%)" in md and "not budget-dependent" in md
    # A cut ends the stage at its last eval within the share of its steps: its FLOPs and "final" are that eval's.
    (_, stages) = load_study(tmp_path / "study")
    half = cut_stage(next(s for s in stages if s.name == "multi"), 0.5)
    assert half.total() == 10 and half.final_acc("arith_add", "greedy") == 0.5 and half.lines[-1]["step"] == 10


def test_specialists_cost_both_ways(tmp_path):
    """The expert's whole run (3000 FLOPs) and the expert up to its own final accuracy (1000, window 1): the share
    of (e) and the split FLOPs of (f), the merge reaching joint's 0.6 at 15."""
    seed = write_report(budget_study(tmp_path / "study"), window=1, length_window=1, replicates=0)["seeds"][0]
    (mt,) = seed["multi_teacher"]
    assert mt["specialist_flops"] == 3000 and mt["specialist_flops_to_final"] == pytest.approx(1000)
    assert mt["share_experts_to_final"] == pytest.approx(30 / 1000)
    (sj,) = seed["split_vs_joint"]
    assert sj["split_flops"] == pytest.approx(3015) and sj["split_flops_experts_to_final"] == pytest.approx(1015)
    assert sj["saving_experts_to_final"] == pytest.approx(1 - 1015 / 6000)


def make_k_study(root, k1: list[list[int]], role: str = "expert"):
    """The same expert (or OPD stage: `role`) at K=0 and K=1 (compare_with: the K=0 one), evals at 0, 100, 200, 300
    FLOPs on arith_add's N prompts (per-prompt results, paired): K=0 right on 200, 300, 400, 500 of them; K=1 on
    `k1`'s vectors."""
    root.mkdir()
    k0 = [correct(a) for a in (200, 300, 400, 500)]
    for name, vectors, k in (("expert_k0", k0, 0), ("expert_k1", k1, 1)):
        acc = [sum(v) / N for v in vectors]
        write_stage(root, name, "grpo" if role == "expert" else "opd",
                    [(100 * i, {"arith_add": a, "mean": a}) for i, a in enumerate(acc)],
                    {"arith_add": acc[-1], "mean": acc[-1]})
        write_records(root / name, {**{10 * i: {"arith_add": v} for i, v in enumerate(vectors)},
                                    "final": {"arith_add": vectors[-1]}})
        (root / name / "config.yaml").write_text(yaml.safe_dump({"rollout": {"max_staleness": k}}))
    study = {"out": str(root), "seed": 0, "stages": [
        {"name": "expert_k0", "config": "x.yaml", "role": role, "domain": "arith_add"},
        {"name": "expert_k1", "config": "x.yaml", "role": role, "domain": "arith_add",
         "compare_with": "expert_k0"}]}
    (root / "study.yaml").write_text(yaml.safe_dump(study))
    return root


def test_an_opd_stage_against_another_opd_stage_is_one_method_at_another_setting(tmp_path):
    """OPD at K=1 against OPD at K=0 (configs/studies/async_opd.yaml): a stage-vs-stage pair, never OPD vs GRPO,
    so no finding reads it."""
    report = write_report(make_k_study(tmp_path / "opd", [correct(a, 40, 40) for a in (200, 300, 400, 500)],
                                       role="opd_external"), window=1, replicates=20)
    (c,) = report["seeds"][0]["stage_comparisons"]
    assert report["seeds"][0]["comparisons"] == [] and (c["stage"], c["reference"]) == ("expert_k1", "expert_k0")
    assert c["max_staleness"] == {"stage": 1, "reference": 0}


def test_stage_vs_stage_of_one_method_at_another_staleness(tmp_path):
    """K=1 with K=0's accuracy at every eval (40 prompts swapped each time): FLOPs ratio 1, gap 0, intervals
    around them. The control: a K=1 expert that climbs twice as fast reaches K=0's final 0.5 at 150 FLOPs (ratio
    2, interval above 1) and leads by 0.1 at matched FLOPs. Neither pair is an OPD comparison or a finding."""
    same = write_report(make_k_study(tmp_path / "same", [correct(a, 40, 40) for a in (200, 300, 400, 500)]),
                        window=1, replicates=100)
    (c,) = same["seeds"][0]["stage_comparisons"]
    assert same["seeds"][0]["comparisons"] == [] and set(verdicts(same).values()) == {"not measured in this study"}
    assert (c["stage"], c["reference"], c["domain"]) == ("expert_k1", "expert_k0", "arith_add")
    assert c["max_staleness"] == {"stage": 1, "reference": 0} and c["final"] == {"stage": 0.5, "reference": 0.5}
    t = c["targets"]["teacher"]
    assert t["target"] == 0.5 and t["reference_flops"] == t["stage_flops"] == pytest.approx(300.0)
    assert t["ratio"] == pytest.approx(1.0) and c["matched"]["gap"] == pytest.approx(0.0)
    intervals = same["seeds"][0]["intervals"]
    lo, hi = intervals["/stage_comparisons/0/targets/fraction/ratio"]
    assert lo < 1 < hi
    # K=0's final accuracy is its last point, so K=1 reaches it no later (ratio >= 1) or never (undefined): at equal
    # budgets that ratio is one-sided, the fraction target and the matched gap are two-sided.
    lo, hi, defined = intervals["/stage_comparisons/0/targets/teacher/ratio"]
    assert lo == 1 < hi and 0.2 < defined < 0.8
    lo, hi = intervals["/stage_comparisons/0/matched/gap"]
    assert -0.03 < lo < 0 < hi < 0.03  # 80 of 1000 prompts differ: SE of the paired gap ~0.009
    assert same["spread"]["FLOPs ratio expert_k0/expert_k1 (fraction target)"]["mean"] == pytest.approx(1.0)
    assert same["spread"]["accuracy at matched FLOPs, expert_k1 - expert_k0"]["interval"] == [lo, hi]
    final = same["spread"]["final accuracy, expert_k1 - expert_k0"]
    assert final["mean"] == pytest.approx(0.0) and final["interval"][0] < 0 < final["interval"][1]
    md = (tmp_path / "same" / "report" / "report.md").read_text()
    assert "#### Stage vs stage (same method, another setting)" in md
    assert "| expert_k1 (1) | expert_k0 (0) | reference final | 0.500 [" in md and "+0.000 [-0.0" in md

    faster = write_report(make_k_study(tmp_path / "faster", [correct(a) for a in (200, 400, 600, 600)]),
                          window=1, replicates=100)
    (c,) = faster["seeds"][0]["stage_comparisons"]
    assert c["targets"]["teacher"]["stage_flops"] == pytest.approx(150.0)
    assert c["targets"]["teacher"]["ratio"] == pytest.approx(2.0) and c["matched"]["gap"] == pytest.approx(0.1)
    assert faster["spread"]["final accuracy, expert_k1 - expert_k0"]["mean"] == pytest.approx(0.1)
    lo, hi = faster["seeds"][0]["intervals"]["/stage_comparisons/0/targets/teacher/ratio"][:2]
    assert 1 < lo <= 2 <= hi


def test_a_report_from_runs_whose_every_optional_number_is_missing(tmp_path):
    """One seed, no per-prompt results, no multi-teacher stage, no rollout lengths, an expert with no curve on its
    own domain, and no arm reaching its target (OPD and the control stop short; GRPO's final accuracy is below
    its own start): a report all the same, each missing number printed as such, nothing as 0 or inf."""
    root = tmp_path / "study"
    root.mkdir()
    write_stage(root, "grpo", "grpo", mean_curve([0, 100, 200], [0.3, 0.2, 0.25]), {"mean": 0.25})
    write_stage(root, "opd_ext", "opd", mean_curve([0, 50], [0.1, 0.15]), {"mean": 0.15}, config=on_data("a.jsonl"))
    write_stage(root, "expert_add", "grpo", mean_curve([0, 100], [0.3, 0.35]), {"mean": 0.35})
    write_stage(root, "control", "fixed_advantage", mean_curve([0, 10], [0.1, 0.1]), {"mean": 0.1}, config=on_data("a.jsonl"))
    stages = [("grpo", "grpo", "", ""), ("opd_ext", "opd_external", "grpo", ""),
              ("expert_add", "expert", "", "arith_add"), ("control", "control", "", "")]
    study = {"out": str(root), "seed": 0, "stages": [{"name": n, "config": "x.yaml", "overrides": [], "role": m,
                                                      "compare_with": c, "domain": d} for n, m, c, d in stages]}
    (root / "study.yaml").write_text(yaml.safe_dump(study))
    report = write_report(root)
    text = (root / "report" / "report.json").read_text()
    assert '"inf"' not in text and '"-inf"' not in text and "NaN" not in text and "Infinity" not in text
    v = verdicts(report)
    assert v["d"] == v["e"] == v["f"] == v["b"] == "not measured in this study"
    md = (root / "report" / "report.md").read_text()
    assert "not reached (best smoothed 0.125)" in md and "no multi_teacher_opd stage in this study" in md
    # The control stopped (10 FLOPs) before OPD's FLOPs to its accuracy (50): neither part of (g) is decided.
    assert v["g1"] == v["g2"] == "inconclusive (censored)"
    assert all(f["provisional"] is (f["verdict"] in ("reproduced", "not reproduced")) for f in report["findings"])
