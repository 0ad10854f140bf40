"""The report says what its intervals are and what its verdicts rest on: the interval's name for n seeds, and a
number undefined in more than MAX_UNDEFINED of the resamples gets no verdict from the ones where it exists (the
two-seed report's wording: tests/test_report.py::test_seeds_give_mean_and_spread_and_a_split_verdict)."""

from __future__ import annotations

import pytest

from megaopd.analysis.report import write_report
from megaopd.analysis.stats import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, interval_wording, verdict
from tests.test_report import checks, make_e3_curves


def test_interval_wording_names_the_seed_level_resample():
    assert "one seed" in interval_wording(1) and "training noise is not in it" in interval_wording(1)
    two, three = interval_wording(2), interval_wording(3)
    assert "3 distinct draws" in two and "little more than the range of the two seeds" in two
    assert "10 distinct draws" in three and "range" not in three


@pytest.mark.parametrize("defined, expected", [(1.0, REPRODUCED), (0.95, REPRODUCED), (0.94, INCONCLUSIVE)])
def test_a_number_undefined_in_more_than_5_percent_of_resamples_has_no_verdict(defined, expected):
    assert verdict((2.0, 3.0), ">", 1.0, 2.5, defined) == expected
    assert verdict((0.2, 0.5), ">", 1.0, 0.3, defined) == (NOT_REPRODUCED if expected == REPRODUCED else expected)


def test_a_ratio_undefined_in_some_resamples_is_inconclusive_with_its_share(tmp_path):
    """E3 on curves: OPD's first eval misses GRPO's final accuracy by 2 of 1000 paired prompts, so in about
    e^-2 = 14% of the resamples it already reaches it (no FLOPs to compare: the check is undefined). Every defined
    resample has the ratio far above 1; the verdict rests on them alone only if they are >= 95%."""
    root = tmp_path / "study"
    make_e3_curves(root, [498, 600, 600, 600])
    report = write_report(root, window=1, replicates=300)
    (c,) = checks(report, "c").values()
    assert 0.75 < c["defined"] < 0.95
    assert c["interval"][0] > 1 and c["verdict"] == INCONCLUSIVE
    md = (root / "report" / "report.md").read_text()
    assert f"(defined in {100 * c['defined']:.0f}% of resamples)" in md
    # The E3 table prints the ratio's share and no range: the defined resamples alone are no sample of it.
    (row,) = [line for line in md.splitlines() if line.startswith("| opd_self (opd_self) | grpo |")
              and "| GRPO final |" in line]
    assert row.endswith(f"| 1.53e+03 (defined in {100 * c['defined']:.0f}% of resamples: no interval) |"), row
    # So does the headline number, the same ratio.
    assert (f"- FLOPs ratio GRPO/OPD, opd_self vs grpo (teacher target): 1530 (defined in {100 * c['defined']:.0f}% "
            "of resamples: no interval)") in md
