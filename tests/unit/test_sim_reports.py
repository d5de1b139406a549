"""The simulator's report: rows, the yardstick (rule, leaders, bound) and the table marking."""

from __future__ import annotations

import pytest

from migpilot.sim import reports, simulating

KINDS = ("1g.10gb", "4g.40gb", "7g.80gb")


def _result(
    policy: str,
    ratio: float,
    *,
    scheduled: int = 10,
    never: tuple[str, ...] = (),
    p99: float = 5.0,
    mode: simulating.Replay = simulating.Replay.INFLATE,
) -> simulating.Result:
    return simulating.Result(
        policy=policy,
        mode=mode,
        pods_total=12,
        pods_scheduled=scheduled,
        pods_rejected=0,
        allocation_ratio=ratio,
        pending_s=(0.0, p99),
        reconfigurations=0,
        instances_destroyed=0,
        planner_seconds=0.0,
        planner_calls=0,
        placements_refused=0,
        end=1.0,
        ratio_over_time=((0.0, 0.0),),
        outcomes=(),
        request_kinds=KINDS,
        requests_never_served=never,
    )


def test_the_best_serving_every_request_and_the_best_of_all_are_named() -> None:
    results = [
        _result("migpilot", 0.97),
        _result("hami-template", 0.985, never=("4g.40gb",)),
        _result("nos", 0.95),
        _result("static-best", 1.0, never=("1g.10gb", "4g.40gb")),
    ]
    doc = reports.document(results, mode=simulating.Replay.INFLATE, bound=1.0)
    assert doc["upper_bound"] == 1.0
    assert doc["request_kinds"] == list(KINDS)
    assert doc["best_serving_every_request"] == {"policies": ["migpilot"], "figure": 0.97}
    assert doc["best_of_all"] == {"policies": ["static-best"], "figure": 1.0}
    assert doc["rule_met"] is True
    assert [r["serves_every_request"] for r in doc["results"]] == [True, False, True, False]
    assert [r["share_of_bound"] for r in doc["results"]] == [0.97, 0.985, 0.95, 1.0]
    assert all(tuple(r) == reports.KEYS for r in doc["results"])
    assert tuple(doc) == tuple(reports.Document.__annotations__)


@pytest.mark.parametrize(
    ("mine", "nos", "bound", "met"),
    [
        (0.97, 0.95, 1.0, True),  # exactly 97 % of the bound, above nos
        (0.969, 0.95, 1.0, False),  # below 97 % of the bound
        (0.96, 0.96, 0.98, True),  # a tie with a policy serving every request is enough
        (0.97, 0.971, 1.0, False),  # below a policy serving every request
    ],
)
def test_inflate_rule(mine: float, nos: float, bound: float, met: bool) -> None:
    results = [
        _result("migpilot", mine),
        _result("nos", nos),
        _result("static-best", 1.0, never=("1g.10gb",)),  # above, but leaves a kind unserved
    ]
    assert reports.rule_met(results, mode=simulating.Replay.INFLATE, bound=bound) is met


def test_ties_name_every_leader_and_without_migpilot_the_rule_is_not_judged() -> None:
    results = [_result("nos", 0.9), _result("hami-placement", 0.9)]
    doc = reports.document(results, mode=simulating.Replay.INFLATE, bound=None)
    assert doc["best_of_all"] == {"policies": ["nos", "hami-placement"], "figure": 0.9}
    assert doc["upper_bound"] is None and doc["rule_met"] is None
    assert doc["results"][0]["share_of_bound"] is None
    nobody = reports.document(
        [_result("static", 0.1, never=("4g.40gb",))], mode=simulating.Replay.INFLATE, bound=1.0
    )
    assert nobody["best_serving_every_request"] is None


@pytest.mark.parametrize(
    ("scheduled", "p99", "met"),
    [((10, 9), (5.0, 6.0), True), ((9, 10), (5.0, 6.0), False), ((10, 9), (7.0, 6.0), False)],
)
def test_faithful_rule_most_pods_and_lowest_p99(
    scheduled: tuple[int, int], p99: tuple[float, float], met: bool
) -> None:
    faithful = simulating.Replay.FAITHFUL
    results = [
        _result("migpilot", 0.3, scheduled=scheduled[0], p99=p99[0], mode=faithful),
        _result("nos", 0.3, scheduled=scheduled[1], p99=p99[1], mode=faithful),
    ]
    doc = reports.document(results, mode=faithful, bound=None)
    assert doc["rule_met"] is met
    assert doc["rule"] == reports.RULES[faithful]
    assert doc["best_serving_every_request"] is not None
    assert doc["results"][0]["share_of_bound"] is None


def test_the_table_marks_policies_that_left_a_kind_unserved_and_the_summary_says_who_leads() -> (
    None
):
    results = [
        _result("migpilot", 0.97),
        _result("hami-template", 0.985, never=("4g.40gb",), p99=26.0),
    ]
    doc = reports.document(results, mode=simulating.Replay.INFLATE, bound=1.0)
    cells = reports.table(doc["results"])
    assert [c[0] for c in cells] == ["migpilot", "hami-template" + reports.MARK]
    lines = reports.summary(doc)
    assert lines[:2] == [
        "* never ran a pod asking for (a kind of request the cluster can serve):",
        "  hami-template: 4g.40gb",
    ]
    assert "  best serving every kind of request: migpilot 97.0% (97.0% of the bound)" in lines
    assert "  best of all: hami-template* 98.5% (98.5% of the bound)" in lines
    assert lines[-1] == "  migpilot met the rule on this run: yes"
    assert " ".join(lines).count("at least 97% of the LP upper bound") == 1
    assert all(len(line) <= 100 for line in lines)
