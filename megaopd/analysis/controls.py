"""Which of a teacher-free control's OPD comparisons (g) counts as evidence (CONTROL_RULE): the pairs of one base
and training data (``curves.controlled``) sorted into the ones the verdict reads and the ones the report shows
beside them, set aside with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from megaopd.analysis.runs import Stage

SAMPLED = "sampled"  # the OPD form whose estimator the control shares: one sampled token's advantage
SAME, SHARED_RATE, BEST, UNFAIR = ("same optimizer settings", "one rate of a sweep of both arms",
                                   "each arm's best on validation", "unfair")
CONTROL_RULE = ("the control's pairs (g): a control and an OPD stage of its base and training data count only with "
                "the same optimizer settings (config.yaml's optim); a pair whose settings differ is unfair, shown and "
                "left out of the verdict. Where both arms (the controls, and the OPD stages of one method and form) "
                "ran over the same grid of optimizer settings (a sweep: the settings that differ within an arm are "
                "the swept ones), each shared setting's pair is shown and left out, and the verdict reads each arm's "
                "best, the stage of the highest validation accuracy on the compared domain (final_valid/, else the "
                "last valid/ eval; never the test split; a tie to the earlier stage). Where a base and data have a "
                "sampled-token OPD stage (the control's estimator), the other forms' pairs are shown and left out; "
                "where none has, the pairs count, marked: the control then removes the teacher and the dense signal "
                "together.")


def _group(items: list, key: Callable[..., Hashable]) -> list[list]:
    """`items` grouped by `key`, groups and members in order of first appearance."""
    out: dict = {}
    for item in items:
        out.setdefault(key(item), []).append(item)
    return list(out.values())


def _value(v) -> str:
    return format(v, "g") if isinstance(v, float) else str(v)


def _frozen(optim: dict) -> str:
    return repr(sorted(optim.items()))


def _swept(stages: list[Stage]) -> list[str]:
    """The optimizer settings that differ among `stages`."""
    keys = sorted({k for s in stages for k in s.optim})
    return [k for k in keys if len({_value(s.optim.get(k)) for s in stages}) > 1]


def _setting(stage: Stage, keys: list[str]) -> str:
    return ", ".join(f"{k} {_value(stage.optim.get(k))}" for k in keys)


def _differ(control: Stage, opd: Stage) -> str:
    """e.g. "lr 3e-05 vs 0.0001" (the control's, then OPD's)."""
    return ", ".join(f"{k} {_value(control.optim.get(k))} vs {_value(opd.optim.get(k))}"
                     for k in _swept([control, opd]))


def _pairing(basis: str, setting: str, estimator: str, set_aside: str = "", validation: dict | None = None) -> dict:
    return {"basis": basis, "setting": setting, "estimator": estimator, "set_aside": set_aside,
            "validation": validation or {}}


def _best(stages: list[Stage], domain: str, keys: list[str]) -> tuple[Stage | None, list[dict]]:
    """The stage of the highest validation accuracy on `domain` (None if one has none), and every stage's."""
    scores = [{"stage": s.name, "setting": _setting(s, keys), "valid": s.valid_acc(domain)} for s in stages]
    if any(v["valid"] is None for v in scores):
        return None, scores
    return max(stages, key=lambda s: s.valid_acc(domain)), scores


def _arm(pairs: list[tuple[Stage, Stage]], estimator: str) -> list[tuple[Stage, Stage, dict]]:
    """One OPD arm (one method and form) against the controls of its base and data: fair pairs counted, unfair
    ones set aside; over a sweep of both arms on one grid, each arm's best counted and every shared rate shown."""
    controls = list({c.name: c for c, _ in pairs}.values())
    opds = list({o.name: o for _, o in pairs}.values())
    grids = [{_frozen(s.optim) for s in arm} for arm in (controls, opds)]
    if max(map(len, grids)) == 1 or grids[0] != grids[1]:
        return [(c, o, _pairing(SAME, "", estimator) if c.optim == o.optim else
                 _pairing(UNFAIR, _differ(c, o), estimator, f"unfair: {_differ(c, o)}")) for c, o in pairs]
    keys = _swept(controls + opds)
    domain = controls[0].domain or opds[0].domain or "mean"  # compare_control's
    (best_c, by_c), (best_o, by_o) = _best(controls, domain, keys), _best(opds, domain, keys)
    out = []
    if best_c is not None and best_o is not None:
        out.append((best_c, best_o, _pairing(BEST, f"control {_setting(best_c, keys)}, OPD {_setting(best_o, keys)}",
                                             estimator, validation={"domain": domain, "control": by_c,
                                                                    "opd": by_o})))
    why = "the verdict reads each arm's best" if out else "no validation accuracy to choose each arm's best by"
    out += [(c, o, _pairing(SHARED_RATE, _setting(c, keys), estimator,
                            f"one rate of the sweep ({_setting(c, keys)}): {why}"))
            for c, o in pairs if c.optim == o.optim and not (c is best_c and o is best_o)]
    return out


def control_pairs(candidates: list[tuple[Stage, Stage]]) -> list[tuple[Stage, Stage, dict]]:
    """(control, OPD stage, pairing) for every candidate pair (one base and training data, `curves.controlled`)
    by CONTROL_RULE, that arm's best pair first; the pairing's `set_aside` is "" where the verdict reads the pair,
    else why not."""
    out = []
    for same_data in _group(candidates, lambda p: (p[0].starts_from, p[0].trains_on)):
        has_sampled = any(o.opd_form == SAMPLED for _, o in same_data)
        for arm in _group(same_data, lambda p: (p[1].role, p[1].opd_form)):
            form = arm[0][1].opd_form or "unknown"
            if form == SAMPLED:
                out += _arm(arm, "sampled-token OPD, the control's estimator: the pair differs in the teacher")
            elif has_sampled:
                other = f"other estimator ({form}): the control's partner is the sampled-token OPD"
                out += [(c, o, _pairing(SAME if c.optim == o.optim else UNFAIR, _differ(c, o), other, other))
                        for c, o in arm]
            else:
                out += _arm(arm, f"{form} OPD: no sampled-token OPD on this base and data, so the control removes "
                                 "the teacher and the dense signal together")
    return out
