"""The scaling model (nbaccel.lab.projection): its arithmetic against hand-computed cases."""

from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path

import pytest

from nbaccel.lab.projection import (
    PRESETS,
    Calibration,
    Interconnect,
    calibrate,
    curve,
    figure,
    project,
    whatif,
)

LINK = Interconnect("test link", bandwidth=10e9, latency=10e-6)


def test_a_ring_allreduce_costs_what_the_formula_says():
    assert LINK.allreduce_seconds(1e9, 1) == 0.0  # one worker talks to nobody
    # N = 2: 2 * 1/2 * 1 GB / 10 GB/s + 2 * 10 us
    assert math.isclose(LINK.allreduce_seconds(1e9, 2), 0.1 + 20e-6)
    # N = 8: 2 * 7/8 * 1 GB / 10 GB/s + 14 * 10 us
    assert math.isclose(LINK.allreduce_seconds(1e9, 8), 0.175 + 140e-6)


def test_a_measured_link_recovers_bandwidth_and_latency():
    for workers in (2, 4):
        small = LINK.allreduce_seconds(4, workers)  # 4 bytes: the latency term, almost alone
        large = LINK.allreduce_seconds(64e6, workers)
        got = Interconnect.measured(small, large, 64e6, workers)
        assert math.isclose(got.latency, LINK.latency, rel_tol=1e-3)
        assert math.isclose(got.bandwidth, LINK.bandwidth, rel_tol=1e-3)
    with pytest.raises(ValueError, match="use more bytes"):
        Interconnect.measured(1e-3, 1e-3, 1e6)


def test_one_worker_is_the_baseline():
    one = project(0.1, 1e9, 32, LINK, 1)
    assert one.step_seconds == 0.1 and one.efficiency == 1.0 and one.samples_per_s == 320.0


def test_overlap_hides_the_allreduce_behind_the_backward_pass():
    # compute 0.3 s, of which backward 0.2 s; the all-reduce of 1 GB on 2 workers takes 0.1 s
    hidden = project(0.3, 1e9, 32, Interconnect("no latency", 10e9, 0.0), 2, overlap=True)
    assert math.isclose(hidden.step_seconds, 0.3) and math.isclose(hidden.efficiency, 1.0)
    shown = project(0.3, 1e9, 32, Interconnect("no latency", 10e9, 0.0), 2, overlap=False)
    assert math.isclose(shown.step_seconds, 0.4) and math.isclose(shown.efficiency, 0.75)
    # an all-reduce longer than the backward pass shows what outlasts it: 0.5 - 0.2 s
    slow = project(0.3, 5e9, 32, Interconnect("no latency", 10e9, 0.0), 2, overlap=True)
    assert math.isclose(slow.step_seconds, 0.6)


def test_accumulation_sends_one_allreduce_per_window():
    link = Interconnect("no latency", 10e9, 0.0)
    one = project(0.1, 1e9, 32, link, 2, overlap=False, accumulation=1)
    four = project(0.1, 1e9, 32, link, 2, overlap=False, accumulation=4)
    assert math.isclose(four.step_seconds, 4 * 0.1 + 0.1)  # four micro-batches, one all-reduce
    assert math.isclose(one.efficiency, 0.5) and math.isclose(four.efficiency, 0.8)
    assert math.isclose(four.samples_per_s, 2 * 4 * 32 / 0.5)


def test_efficiency_falls_with_workers_on_a_slow_link_and_not_on_a_fast_one():
    slow = curve(0.05, 400e6, 32, PRESETS["100 Gb Ethernet"], overlap=False)
    fast = curve(0.05, 400e6, 32, PRESETS["NVLink 4 (H100)"], overlap=True)
    assert [p.workers for p in slow] == [1, 2, 4, 8, 16, 32, 64]
    assert all(a.efficiency > b.efficiency for a, b in itertools.pairwise(slow))
    assert fast[-1].efficiency > 0.99 > 0.5 > slow[-1].efficiency


def test_presets_carry_their_published_bandwidth_per_direction():
    per_direction = {
        "PCIe 4.0 x16": 31.5e9,
        "PCIe 5.0 x16": 63e9,
        "NVLink 3 (A100)": 300e9,
        "NVLink 4 (H100)": 450e9,
        "100 Gb Ethernet": 12.5e9,
        "InfiniBand NDR": 50e9,
    }
    assert {name: p.bandwidth for name, p in PRESETS.items()} == per_direction
    assert all(p.source and 0 < p.latency < 1e-3 for p in PRESETS.values())


def test_bad_input_says_what_was_wrong():
    with pytest.raises(ValueError, match="must be positive"):
        project(0.0, 1e6, 32, LINK, 2)
    with pytest.raises(ValueError, match="at least 2 workers"):
        Interconnect.measured(1e-4, 1e-2, 1e6, workers=1)


RECORDED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "projection-cpu.json"


def recorded_calibrations() -> dict[str, Calibration]:
    """The calibrations ``benchmarks/projection.py`` measured and committed, per model width."""
    recorded = json.loads(RECORDED.read_text())
    calibrations = {}
    for width, r in recorded["widths"].items():
        nbytes = round(r["gradient_mb"] * 1e6)
        link = Interconnect.measured(r["allreduce_small"], r["allreduce_large"], nbytes, 2)
        fields = ("compute", "ddp", "allreduce_small", "allreduce_large")
        calibrations[width] = Calibration(
            **{k: r[k] for k in fields}, gradient_bytes=nbytes, batch_size=32, workers=2, link=link
        )
    return calibrations


@pytest.mark.parametrize("width", ["512", "1024", "2048"])
def test_the_projection_of_the_recorded_two_worker_steps_is_within_35_percent(width):
    """The model against what 2 gloo workers measured on this machine (committed by
    benchmarks/projection.py, with the load it ran under): a step of the model alone (the
    compute), a DDP step, and all-reduces of 4 bytes and of the gradients' size, from which
    the loopback link is measured. The no-overlap projection must match the DDP step within
    35%; it errs low (-8% to -17% on the recorded medians), since it leaves out DDP's own work
    (hooks, copies into buckets). Overlap is not credited on a CPU: gloo's all-reduce runs on the
    cores the backward pass uses (the overlap projection erred about -41% there).

    The measurement itself is timing, so it is checked by the benchmark, never here: on a
    loaded 2-core box its error moves by tens of percent."""
    calibration = recorded_calibrations()[width]  # the medians of 3 repeats, each measured
    share = calibration.allreduce_large / calibration.ddp
    assert share > 0.1, f"the all-reduce is only {share:.0%} of the step: too small to check"
    error = calibration.error(overlap=False)
    assert abs(error) < 0.35, f"projection {error:+.0%} off the measured DDP step"


@pytest.mark.multiprocess
def test_calibrate_measures_two_workers_and_their_link():
    """calibrate() on 2 real workers: what it returns, not how fast it was (see above)."""
    calibration = calibrate(hidden=1024, timeout=300)
    print(calibration)
    assert calibration.workers == 2 and calibration.batch_size == 32
    assert calibration.gradient_bytes == 4 * (4 * 1024 * 1024 + 4 * 1024)  # 4 square layers
    times = [calibration.compute, calibration.ddp, calibration.allreduce_small]
    assert all(math.isfinite(t) and t > 0 for t in [*times, calibration.allreduce_large])
    link = calibration.link  # 17 MB take milliseconds where 4 bytes take microseconds
    assert link.bandwidth > 0 and link.latency > 0 and link.source == "measured"
    assert math.isfinite(calibration.error(overlap=False))


def test_the_figure_labels_every_curve_a_projection_and_the_measurements_as_such():
    fig = figure(0.01, 4e6, 32, [PRESETS["PCIe 4.0 x16"], LINK], measured={1: 3200.0, 2: 5000.0})
    speed_ax, eff_ax = fig.axes
    for ax in (speed_ax, eff_ax):
        labels = [line.get_label() for line in ax.lines]
        assert labels == ["projection: PCIe 4.0 x16", "projection: test link", "measured here"]
    points = eff_ax.lines[-1]
    # efficiency of a measurement: its samples/s over N x the projection's one worker (3200/s)
    assert list(points.get_xdata()) == [1, 2]
    assert list(points.get_ydata()) == pytest.approx([1.0, 5000 / 6400])
    assert "projections (dashed) unless marked measured" in fig.texts[0].get_text()


def test_the_whatif_panel_redraws_from_its_controls(monkeypatch):
    import nbaccel.env
    import nbaccel.lab.projection.view as projection  # whatif draws through the view's figure

    drawn = []
    real = projection.figure
    monkeypatch.setattr(projection, "figure", lambda *a: drawn.append(a) or real(*a))
    monkeypatch.setattr(nbaccel.env, "in_notebook", lambda: True)
    loopback = Interconnect("loopback", 1e9, 100e-6)
    panel = whatif(0.02, 4e6, 32, measured={1: 1600.0, 2: 2400.0}, loopback=loopback)
    controls = {c.description: c for c in panel.children[:-1]}
    compute, nbytes, batch, links, measured, counts, overlap, accumulation = drawn[-1]
    assert (compute, nbytes, batch, measured) == (0.02, 4e6, 32, {1: 1600.0, 2: 2400.0})
    assert [link.name for link in links] == ["loopback"] and counts[-1] == 64

    controls["interconnect"].value = "NVLink 4 (H100)"
    controls["model size x"].value = 10.0
    controls["compute faster x"].value = 100.0
    controls["accumulation"].value = 4
    controls["overlap (DDP buckets)"].value = False
    controls["workers up to"].value = 8
    compute, nbytes, batch, links, measured, counts, overlap, accumulation = drawn[-1]
    assert compute == pytest.approx(0.02 * 10 / 100) and nbytes == pytest.approx(4e7)
    assert [link.name for link in links] == ["NVLink 4 (H100)", "loopback"]
    assert measured is None  # the measurements are of the model as it is, not 10x of it
    assert (counts, overlap, accumulation) == ((1, 2, 4, 8), False, 4)


def test_without_a_notebook_the_whatif_panel_is_one_static_figure(monkeypatch):
    import nbaccel.lab.projection.view as projection  # whatif draws through the view's figure

    drawn = []
    real = projection.figure
    monkeypatch.setattr(projection, "figure", lambda *a: drawn.append(a) or real(*a))
    assert whatif(0.02, 4e6, 32, loopback=Interconnect("loopback", 1e9, 100e-6)) is None
    (links,) = [a[3] for a in drawn]
    assert [link.name for link in links] == ["loopback", *PRESETS]


def test_without_ipywidgets_the_whatif_panel_is_one_static_figure(monkeypatch):
    import nbaccel.env
    import nbaccel.lab.projection.view as projection  # whatif draws through the view's figure

    drawn = []
    real = projection.figure
    monkeypatch.setattr(projection, "figure", lambda *a: drawn.append(a) or real(*a))
    monkeypatch.setattr(nbaccel.env, "in_notebook", lambda: True)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import ipywidgets: ImportError
    assert whatif(0.02, 4e6, 32) is None
    assert [[link.name for link in a[3]] for a in drawn] == [list(PRESETS)]


def test_a_link_that_cannot_overlap_is_charged_the_whole_allreduce():
    cpu = Interconnect("gloo on a busy CPU", 10e9, 0.0, overlaps=False)
    assert math.isclose(project(0.3, 1e9, 32, cpu, 2, overlap=True).step_seconds, 0.4)
    assert Interconnect.measured(1e-4, 1e-2, 1e6, overlaps=False).overlaps is False


def test_a_fitted_link_recovers_bandwidth_and_latency_from_several_sizes():
    sizes = [1e5, 3e5, 1e6, 4e6, 16e6]
    for workers in (2, 4):
        exact = [LINK.allreduce_seconds(n, workers) for n in sizes]
        got = Interconnect.fit(sizes, exact, workers, overlaps=False)
        assert math.isclose(got.latency, LINK.latency, rel_tol=1e-6)
        assert math.isclose(got.bandwidth, LINK.bandwidth, rel_tol=1e-6)
        assert got.overlaps is False
    # 10% noise on each time, alternating in sign: the fit stays within about that of the truth
    noisy = [t * (1.1 if i % 2 else 0.9) for i, t in enumerate(exact)]
    got = Interconnect.fit(sizes, noisy, 4)
    assert 0.8 < got.bandwidth / LINK.bandwidth < 1.25
    with pytest.raises(ValueError, match="at least 2 sizes"):
        Interconnect.fit([1e6, 1e6], [1e-3, 1e-3])
    with pytest.raises(ValueError, match="no bandwidth"):
        Interconnect.fit([1e5, 1e6], [2e-3, 1e-3])
