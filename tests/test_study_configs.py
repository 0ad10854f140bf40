"""Every shipped study resolves: each stage's config loads with its overrides, every {var} is substituted, each
comparison names a stage of the study, and the stage graph has no cycle."""

from pathlib import Path

import pytest

from megaopd.config import ConfigError, load_config, to_dict
from megaopd.launch.slurm import submission_order
from megaopd.run.study import (STAGE_LABELS, StudyConfig, dependencies, link_shared_stages, seed_studies,
                           stage_config)

ROOT = Path(__file__).resolve().parents[1]
STUDIES = sorted((ROOT / "configs" / "studies").rglob("*.yaml"))


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def test_every_kind_of_study_is_shipped():
    names = {p.stem for p in STUDIES}
    assert {"self_teacher", "two_domain", "four_domain", "external_teacher", "two_domain_qwen3"} <= names


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.stem)
def test_study_resolves(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    study = load_config(path, ["out=/tmp/study"], cls=StudyConfig)
    names = [s.name for s in study.stages]
    assert len(names) == len(set(names))
    for stage in study.stages:
        assert stage.role in STAGE_LABELS
        if stage.compare_with:
            assert stage.compare_with in names, f"{stage.name} compares with unknown {stage.compare_with}"
        cfg = stage_config(study, stage)
        assert not any("{" in v for v in _strings(to_dict(cfg))), f"{stage.name}: unresolved placeholder"
        assert cfg.run_dir == f"/tmp/study/{stage.name}"
        # what stops or tunes a stage reads the validation split, what the report judges the test split
        assert cfg.data.validation and not set(cfg.data.validation) & set(cfg.data.eval), stage.name
        for cover in cfg.train.stop.cover:  # a partner stage of the study, which runs first
            assert cfg.train.stop.rule == "plateau"
            assert Path(cover.run).name in dependencies(study)[stage.name], f"{stage.name} covers {cover.run}"
        if stage.role in ("opd_self", "opd_external", "opd_external_grpo", "multi_teacher_opd"):
            assert cfg.train.algorithm == "opd" and cfg.opd.teachers
        if stage.role == "multi_teacher_opd":
            experts = {s.domain for s in study.stages if s.role == "expert"}
            assert set(cfg.opd.teachers) == experts
    assert sorted(submission_order(study)) == sorted(names)


def test_compared_stages_cover_their_partners_which_run_first():
    """The two-domain study's covers, one line per comparison (through vars or inline): each partner's run
    directory makes it a dependency, so the covering stage starts after it."""
    study = load_config(ROOT / "configs/studies/two_domain.yaml", ["out=/o", "seeds=[]"], cls=StudyConfig)
    covers = {stage.name: [(Path(c.run).name, c.domain) for c in stage_config(study, stage).train.stop.cover]
              for stage in study.stages}
    assert {name: c for name, c in covers.items() if c} == {
        "opd_self_add": [("expert_add", "arith_add")], "opd_external_add": [("expert_add", "arith_add")],
        "opsa_add": [("opd_self_add", "arith_add"), ("opd_external_add", "arith_add")],
        "opsa_mix": [("multi_teacher", "mean")]}
    deps = dependencies(study)
    assert deps["opd_external_add"] == ["base", "teacher_sft", "expert_add"]
    assert deps["opsa_add"] == ["base", "opd_self_add", "opd_external_add"]
    assert deps["opsa_mix"] == ["base", "multi_teacher"]
    order = submission_order(study)
    assert order.index("opsa_add") > order.index("opd_external_add") > order.index("expert_add")


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.stem)
def test_every_control_shares_the_optimizer_settings_of_an_opd_stage_of_its_base_and_data(path, monkeypatch):
    """(g) compares a control with the OPD stages of its base and data (docs/opd.md, "The fair
    control"): it runs at the optimizer settings of one of them, else the report leaves it out; in a sweep
    (fair_control) each control covers every OPD stage of the grid, whichever rate wins."""
    monkeypatch.chdir(ROOT)
    study = load_config(path, ["out=/o", "seeds=[]"], cls=StudyConfig)
    cfgs = {stage.name: (stage, stage_config(study, stage)) for stage in study.stages}
    for stage, cfg in cfgs.values():
        if stage.role != "control":
            continue
        opds = [(s.name, c) for s, c in cfgs.values() if s.role.startswith(("opd", "multi_teacher")) and
                (c.model.path, c.data.train) == (cfg.model.path, cfg.data.train)]
        assert cfg.optim in [c.optim for _, c in opds], f"{stage.name}: {cfg.optim} is no OPD stage's"
        if path.stem == "fair_control":
            assert sorted(Path(c.run).name for c in cfg.train.stop.cover) == sorted(n for n, _ in opds)


def test_vars_substitute_recursively_and_sweep_from_the_command_line():
    study = load_config(ROOT / "configs/studies/self_teacher.yaml",
                        ["out=/o", "vars.student=llama-tiny", "vars.domain=prog_trace"], cls=StudyConfig)
    cfg = stage_config(study, study.stages[0])
    assert cfg.model.path == "/o/models/llama-tiny" and cfg.data.train == ["/o/data/prog_trace/train.jsonl"]
    with pytest.raises(ValueError, match="cycle"):
        StudyConfig(vars={"a": "{b}", "b": "{a}"}).substitute("{a}")


def test_seeds_run_in_their_own_directories():
    study = load_config(ROOT / "configs/studies/two_domain.yaml", ["out=/o", "seeds=[0,1,2]"], cls=StudyConfig)
    per_seed = seed_studies(study)
    assert [(s.seed, s.out, s.seeds) for s in per_seed] == [(k, f"/o/seed_{k}", []) for k in range(3)]
    cfg = stage_config(per_seed[2], per_seed[2].stages[2])
    assert cfg.train.seed == 2 and cfg.run_dir == f"/o/seed_2/{per_seed[2].stages[2].name}"
    assert cfg.model.path == "/o/seed_2/base/final"
    single = load_config(ROOT / "configs/studies/two_domain.yaml", ["out=/o", "seeds=[]"], cls=StudyConfig)
    assert [s.out for s in seed_studies(single)] == ["/o"]
    with pytest.raises(ValueError, match="distinct"):
        seed_studies(StudyConfig(seeds=[1, 1]))


def test_a_shared_stage_is_linked_into_every_later_seed(tmp_path):
    study = load_config(ROOT / "configs/studies/two_domain.yaml", [f"out={tmp_path}", "seeds=[4,5,6]"],
                        cls=StudyConfig)
    assert [s.name for s in study.stages if s.shared] == ["teacher_sft"]
    link_shared_stages(study)
    first = tmp_path / "seed_4" / "teacher_sft"
    first.mkdir(parents=True)
    for s in (5, 6):
        link = tmp_path / f"seed_{s}" / "teacher_sft"
        assert link.is_symlink() and link.resolve() == first.resolve()
        assert not (tmp_path / f"seed_{s}" / "base").exists()  # per-seed stages are not linked
    link_shared_stages(study)  # again (a resumed study): the links stay as they are
    assert (tmp_path / "seed_5" / "teacher_sft").resolve() == first.resolve()
    study.stages[1].overrides.append("opd.teachers.x={out}/base/final")
    with pytest.raises(ConfigError, match=r"shared by all seeds.*\['base'\]"):
        link_shared_stages(study)


def test_the_shared_stage_starts_first(tmp_path, monkeypatch):
    """It gates a stage of every seed (the external teacher: both seeds' OPD from it), so it takes a worker before
    the seeds' own stages do; negative control: without the rule the seeds' cold starts take both workers first."""
    import megaopd.run.study as study_module

    study = load_config(ROOT / "configs/studies/two_domain.yaml", [f"out={tmp_path}", "seeds=[0,1]"],
                        cls=StudyConfig)
    monkeypatch.setattr(study_module, "build_assets", lambda one: None)
    started = []
    monkeypatch.setattr(study_module, "_run_side_by_side", lambda configs, needs, todo, *a: started.extend(todo))
    study_module.run_study(study)
    order = [f"{d.parent.name}/{d.name}" for d in started]
    assert order[:3] == ["seed_0/teacher_sft", "seed_0/base", "seed_1/base"], order
    assert len(order) == 2 * len(study.stages) - 1  # the shared stage once


def test_shipped_external_teacher_costs_five_times_the_student_per_token():
    from megaopd.models.embedded import build_model_config
    from megaopd.accounting.flops import ModelShape

    study = load_config(ROOT / "configs/studies/two_domain.yaml", ["out=/o"], cls=StudyConfig)
    cost = {k: ModelShape.from_hf_config(build_model_config(study.vars[k], 259, 258, 256)).matmul_params
            for k in ("student", "teacher")}
    assert cost["teacher"] / cost["student"] >= 5


def test_imported_models_take_vars(tmp_path, monkeypatch):
    """real_external.yaml imports its teacher by {teacher}: the names reach import-model substituted, and each is a
    packaged model (vars.teacher picks the 1.5B)."""
    from megaopd.models import model_import
    from megaopd.models.packaged_models import PACKAGED
    from megaopd.run.study import build_assets

    imported = []
    monkeypatch.setattr(model_import, "import_model", lambda name, gguf, out: imported.append(name))
    monkeypatch.setattr("megaopd.data.word_problems.build_word_problems", lambda *a: None)
    study = load_config(ROOT / "configs/studies/real_external.yaml",
                        [f"out={tmp_path}", "vars.teacher=qwen2.5-coder-1.5b-instruct"], cls=StudyConfig)
    build_assets(study)
    assert imported == ["smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"] and set(imported) <= set(PACKAGED)


def test_the_old_stage_key_and_label_read_as_role_and_control_with_a_deprecation_line(tmp_path, caplog):
    """A stage's `method:` key and its label teacher_free (the spellings before this release) load as `role:` and
    control, one deprecation line for each spelling (however many stages use it) naming the new one."""
    import logging

    import yaml

    def load(stages):
        (tmp_path / "study.yaml").write_text(yaml.safe_dump({"out": str(tmp_path), "stages": stages}))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megaopd.config"):
            return load_config(tmp_path / "study.yaml", cls=StudyConfig)

    new = load([{"name": "a", "role": "control"}, {"name": "b", "role": "grpo"}])
    assert caplog.records == []
    old = load([{"name": "a", "method": "teacher_free"}, {"name": "b", "method": "grpo"}])
    assert old == new and [s.role for s in old.stages] == ["control", "grpo"]
    assert [r.getMessage() for r in caplog.records] == [
        "config key 'stages.method' is deprecated, renamed 'stages.role': write 'stages.role' (the old name is read "
        "for one release)",
        "stages.role=teacher_free is deprecated, renamed stages.role=control: write stages.role=control (the old name "
        "is read for one release)"]
    assert load([{"name": "a", "role": "teacher_free"}]).stages[0].role == "control" and len(caplog.records) == 1


# A study's number outside the range its code reads it in, refused at load (check_range / check_at_least): threads=0
# and workers=0 were a ValueError traceback, threads past 2**31 and an asset count or word_problem_digits below 0,
# a verbosity past its domain's or a difficulty below 1 tracebacks while the assets were built, and a negative row
# count cut the held-out rows short without a word; seed=-1 was refused as train.seed once the assets were built.
STUDY_OUT_OF_RANGE = [
    "threads=0", "threads=4294967296", "workers=0", "seed=-1", "seed=4294967296", "seeds=[0, -1]",
    "assets.train_rows=-1", "assets.heldout_rows=-5", "assets.validation_rows=-1", "assets.heldout_percent=-5",
    "assets.heldout_percent=150", "assets.seed=-1", "assets.seed=99999999999999999999999",
    "assets.word_problem_digits=-1", "assets.difficulty.arith_add=-2", "assets.difficulty.letter_count=0",
    "assets.verbosity.letter_count=1", "assets.verbosity.arith_add=3", "assets.verbosity.arith_add=long",
]


@pytest.mark.parametrize("override", STUDY_OUT_OF_RANGE)
def test_a_study_number_out_of_its_range_is_refused_at_load_in_one_line(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as refused:
        load_config(ROOT / "configs/studies/self_teacher.yaml", [override], cls=StudyConfig)
    line = str(refused.value)
    assert line.startswith(f"{key} must ") and ", got " in line and "; set " in line and "\n" not in line, line


@pytest.mark.parametrize("setting", ["difficulty", "verbosity"])
def test_a_misspelt_domain_of_an_assets_mapping_is_refused_with_the_closest(setting):
    """assets.difficulty.arith_ad=3 was ignored: the sweep point ran at the default difficulty without a word."""
    with pytest.raises(ConfigError, match=rf"^assets\.{setting}: 'arith_ad' is not one of .*did you mean 'arith_add'\?$"):
        load_config(ROOT / "configs/studies/self_teacher.yaml", [f"assets.{setting}.arith_ad=1"], cls=StudyConfig)
