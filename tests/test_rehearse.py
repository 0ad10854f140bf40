"""megaopd rehearse: the real layout's checks (no cluster), the stand-in study and launch file, the message
without root, and (multinode, slow) one stage of the 2-domain cluster study rehearsed on a local cluster."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megaopd.config import load_config
from megaopd.launch import rehearse
from megaopd.launch.slurm import absolute_study, load_launch
from megaopd.run.study import StudyConfig

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "configs/studies/cluster/two_domain_qwen3.yaml"
LAUNCH = ROOT / "configs/cluster/launch_2node.yaml"


def cluster_study(*overrides: str) -> StudyConfig:
    study = load_config(STUDY, list(overrides), cls=StudyConfig)
    for stage in study.stages:
        stage.config = str(ROOT / stage.config)
    return absolute_study(study)


def test_without_root_it_says_what_to_run(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert rehearse.main([str(STUDY), "--launch", str(LAUNCH)]) == 2
    err = capsys.readouterr().err
    assert "needs root" in err and "sudo" in err and f"megaopd submit {STUDY} --launch {LAUNCH} --dry-run" in err


@pytest.mark.parametrize("flag, value", [("--name", "rehearse2"), ("--name", "2nodes"), ("--subnet", "10.300.0")])
def test_a_bad_cluster_name_or_subnet_is_one_line_before_anything_starts(monkeypatch, capsys, flag, value):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert rehearse.main([str(STUDY), "--launch", str(LAUNCH), flag, value]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"megaopd: config error: {flag[2:]}={value!r}: ")


def test_the_shipped_layout_passes_and_layout_mistakes_are_caught(tmp_path):
    assert rehearse.layout_problems(cluster_study(), load_launch(LAUNCH)) == []
    bad_tp = load_launch(LAUNCH, ["overrides=[model.backend=megatron, model.megatron.tp=3]"])
    problems = rehearse.layout_problems(cluster_study(), bad_tp)
    assert "stage expert_math (2 node(s) x 8 GPU(s)): tp=3 x pp=1 does not divide the 16 GPUs" in problems
    # A readable model whose heads do not split over TP (12 GPUs, TP 3 fits them, 16 heads do not split).
    model = tmp_path / "Qwen3-1.7B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 16, "num_key_value_heads": 8,
                                                   "num_hidden_layers": 28}))
    odd = load_launch(LAUNCH, ["gpus_per_node=6", "sglang_tp=2",
                               "overrides=[model.backend=megatron, model.megatron.tp=3]"])
    problems = rehearse.layout_problems(cluster_study(f"vars.student={model}"), odd)
    assert any(p.startswith("stage expert_math") and "16 attention heads / 8 KV heads do not split over tp=3" in p
               for p in problems), problems
    # Not readable here (the cluster's /models): the published shape that the directory is named after.
    problems = rehearse.layout_problems(cluster_study(), odd)
    assert any(p.startswith("stage expert_math") and "model.path=/models/Qwen3-1.7B: 16 attention heads / 8 KV "
               "heads do not split over tp=3" in p for p in problems), problems
    assert any("model.path=/models/Qwen3-8B: 32 attention heads / 8 KV heads" in p for p in problems), problems
    assert rehearse.published_shape("/models/Qwen3-8B-Base") == rehearse.REAL_SHAPES["qwen3-8b"]
    assert rehearse.published_shape("/models/Llama-3.1-8B-Instruct").layers == 32
    assert rehearse.published_shape("/models/qwen3-8bx") is None and rehearse.published_shape("/models/m") is None
    unknown_key = load_launch(LAUNCH, ["overrides=[model.backend=megatron, model.megatron.tpp=2]"])
    (problem,) = rehearse.layout_problems(cluster_study(), unknown_key)
    assert problem.startswith("the study does not render") and "tpp" in problem


def test_stand_ins_keep_the_layout_and_swap_models_data_and_site(tmp_path):
    study = cluster_study()
    models, data = rehearse.stand_ins(study)
    assert models == {"/models/Qwen3-1.7B": "qwen3-tiny", "/models/Qwen3-8B": "qwen3-small"}
    assert data["/data/rl/math/train.jsonl"] == ("math", "arith_add", "train")
    assert data["/data/rl/code/test.jsonl"] == ("code", "prog_trace", "test")
    rehearse.write_standin_data(study, tmp_path / "out")
    from megaopd.data.rows import load_rows

    rows, _ = load_rows(tmp_path / "out" / "standin" / "code" / "train.jsonl")
    assert len(rows) == 200 and {(r.data_source, r.domain) for r in rows} == {("prog_trace", "code")}
    assert data["/data/rl/code/validation.jsonl"] == ("code", "prog_trace", "validation")
    held = {split: {r.extra_info["key"] for r in load_rows(tmp_path / "out" / "standin" / "code" / f"{split}.jsonl")[0]}
            for split in ("validation", "test")}
    assert len(held["validation"]) == len(held["test"]) == 20 and not held["validation"] & held["test"]
    small = absolute_study(rehearse.rehearsal_study(study, tmp_path / "out", 2, None))
    launch = rehearse.rehearsal_launch(small, load_launch(LAUNCH), 2, "/sglang/bin/python")
    from megaopd.launch.slurm import plan

    planned = plan(small, launch)
    assert rehearse.cluster_nodes(planned) == 5  # multi_teacher's
    jobs = {job.name: job.script for job in planned}
    # The real node layout: 2 trainer nodes + 1 rollout node; OPD + 1 per teacher (multi_teacher: 2 teachers).
    for name, nodes in (("expert_math", 3), ("opd_self_math", 4), ("multi_teacher", 5), ("joint_grpo", 3)):
        assert f"#SBATCH --nodes={nodes}\n" in jobs[name], name
        assert "TRAIN_NODES=2\n" in jobs[name] and "GPUS_PER_NODE=2\n" in jobs[name]
        assert "TRAINER_MODULE=megaopd.models.megatron.cpu_launch\n" in jobs[name]
        assert "model.megatron.tp=2" in jobs[name] and "model.device=cpu" in jobs[name]
    assert f"model.path={small.out}/models/qwen3-tiny" in jobs["expert_math"]
    assert f"opd.teachers.*={small.out}/models/qwen3-small" in jobs["opd_external_math"]
    assert f"data.train=[{small.out}/standin/math/train.jsonl, {small.out}/standin/code/train.jsonl]" in jobs[
        "multi_teacher"]
    assert "--partition" not in jobs["expert_math"] and "CONTAINER_IMAGE=''" in jobs["expert_math"]
    assert "CPU_BIND=''" in jobs["expert_math"] and "--cpus-per-task=1" in jobs["expert_math"]
    assert rehearse.not_rehearsed(load_launch(LAUNCH)) == ["container_image=/shared/megaopd-gpu.sqsh", "cpu_bind=none",
                                                           "partition=gpu"]
    # DP shrinks, TP and PP stay: TP 4 over 2 nodes needs 2 GPUs each, TP 2 x PP 2 over 3 nodes 4 each.
    assert rehearse.rehearsal_gpus(2, 8, 4, 1, cap=1) == 2 and rehearse.rehearsal_gpus(3, 8, 2, 2, cap=2) == 4
    assert rehearse.rehearsal_gpus(2, 8, 2, 1, cap=2) == 2  # the shipped layout: TP 2, DP 2


@pytest.mark.multinode
@pytest.mark.slow
@pytest.mark.timeout(1200)  # 159 s alone, 600+ beside the other xdist worker on a loaded machine
def test_one_stage_rehearses_on_a_local_cluster(tmp_path, capsys):
    """expert_math of the 2-domain cluster study with the shipped 2-trainer-node launch file: 2 trainer nodes
    (Megatron TP2 x DP2 over gloo), an SGLang CPU rollout server on the third node, 2 steps, weights verified."""
    if os.geteuid() != 0:
        pytest.skip("megaopd rehearse needs root")
    python = os.environ.get("MEGAOPD_SGLANG_PYTHON", "")
    if not python:
        pytest.skip("no SGLang environment: set MEGAOPD_SGLANG_PYTHON (make test builds .venv-sglang)")
    # Its own cluster name and subnet: the CI cluster (mns, 10.77.0) stays up beside it.
    assert rehearse.main([str(STUDY), "--launch", str(LAUNCH), "--stages", "expert_math", "--state",
                          str(tmp_path / "state"), "--name", "mrht", "--subnet", "10.78.9"]) == 0
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if line.startswith("expert_math ")]
    assert "COMPLETED" in row and "nodes: node1 node2" in row and "ranks/node: node1:2 node2:2" in row
    assert "servers: rollout:node3(qwen3-tiny) " in row and "steps: 2" in row and "verified weights: 0,1,2" in row
    assert "megaopd rehearse: passed" in out
    assert not (tmp_path / "state" / "cluster").exists()  # torn down
