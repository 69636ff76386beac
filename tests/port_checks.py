"""Assertions the third-party port tests share (tests/test_ports.py, test_port_*.py) on a ladder
Report over a 2-layer tiny checkpoint."""


def assert_clean(report):
    """Exact or drift, with teacher forcing and the fp64 rung run over both layers."""
    assert report.verdict in ("exact", "drift"), report.summary()
    assert report.teacher_forcing == "run" and report.semantic_rung == "run", report.summary()
    assert [row["layer"] for row in report.local] == [0, 1]


def assert_found(report, tap, component):
    """Semantic, first at `tap` (its layer) and `component`; the Divergence."""
    d = report.first_divergence
    assert report.verdict == "semantic" and d is not None, report.summary()
    assert (d.tap, d.layer, d.component) == (tap, int(tap.split(".")[1]), component), report.summary()
    return d
