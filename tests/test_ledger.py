"""The ledger's three totals, with upstream runs carried once, and its agreement with real token counts."""

import pytest

from megaopd.accounting.ledger import Ledger


def _finished(tmp_path, name, counts_as, flops, upstream=()):
    ledger = Ledger(name, counts_as)
    ledger.add("train", flops)
    for role, model_dir in upstream:
        ledger.add_upstream(role, model_dir)
    out = tmp_path / name
    out.mkdir()
    ledger.save(out)
    return out


def test_totals_count_each_upstream_run_once(tmp_path):
    base = _finished(tmp_path, "base", "cold_start", 10.0)
    expert = _finished(tmp_path, "expert", "training", 100.0, [("init", base)])
    external = _finished(tmp_path, "external", "external", 1000.0)
    opd = Ledger("opd")
    opd.add("rollout", 1.0)
    opd.add("teacher", 2.0)
    opd.add("train", 3.0)
    opd.add_upstream("init", base)  # the student starts from the same base the expert did
    opd.add_upstream("teacher:math", expert)
    opd.add_upstream("teacher:code", external)
    totals = opd.totals()
    assert totals["stage"] == 6.0
    assert totals["with_teachers"] == 106.0
    assert totals["with_cold_start"] == 116.0  # base counted once though reached twice
    assert totals["external"] == 1000.0


def test_model_without_ledger_adds_nothing(tmp_path):
    ledger = Ledger("x")
    ledger.add_upstream("init", tmp_path)  # e.g. a downloaded HF model
    assert ledger.upstream == [] and ledger.totals()["with_cold_start"] == 0.0


def test_state_round_trip_and_errors():
    a = Ledger("a")
    a.add("old_logprob", 5)
    b = Ledger("b")
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    with pytest.raises(KeyError, match="unknown ledger component"):
        a.add("eval", 1)
    with pytest.raises(ValueError, match="counts_as"):
        Ledger("c", "free")
