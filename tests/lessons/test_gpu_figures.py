"""The GPU run's figures as lessons 3 and 5 quote them (``nbaccel.lessons.gpu_figures``): found
from the repository, labelled with the GPU, and None when no GPU run is recorded."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from nbaccel.lessons import gpu_figures, gpu_results

MACHINE = {"gpu": "NVIDIA Test GPU 80GB", "driver": "999.1", "cuda": "13.0", "torch": "2.11.0",
           "date": "2026-12-02T03:00:00+00:00", "gpus": 2, "python": "3.12.0"}  # fmt: skip
AMP = {
    "machine": MACHINE,
    "smoke": False,
    "models": {
        "lesson3-bench": {
            "fp32": {"samples_per_s": 1000.0, "iqr": [990.0, 1010.0], "peak_mib": 800.0},
            "bf16": {"samples_per_s": 4000.0, "iqr": [3900.0, 4100.0], "peak_mib": 500.0},
            "fp16": {"samples_per_s": 5000.0, "iqr": [4900.0, 5100.0], "peak_mib": None},
        }
    },
    "model_info": {"lesson3-bench": {"description": "lesson 3 benchmark: MLP(64, 4096, 10)"}},
}
PROJECTION = {
    "machine": MACHINE,
    "smoke": False,
    "model": "lesson 5: MLP(64, 1024, 10), batch 32",
    "calibrated": {
        "compute_seconds": 0.001,
        "gradient_bytes": 4_000_000,
        "batch_size": 32,
        "samples_per_s_one_gpu": 32_000.0,
    },
    "projected": {
        "NVLink 4 (H100)": [
            {"workers": 1, "samples_per_s": 32_000.0, "efficiency": 1.0},
            {"workers": 2, "samples_per_s": 60_000.0, "efficiency": 0.9375},
        ]
    },
    "calibrate_2_gpus": {"ddp": 0.002, "batch_size": 32, "workers": 2, "compute": 0.001},
}


@pytest.fixture
def results(tmp_path, monkeypatch):
    """A repository root in tmp_path, the only place the helpers search."""
    folder = tmp_path / "benchmarks" / "results"
    folder.mkdir(parents=True)
    monkeypatch.setattr(gpu_figures, "search_roots", lambda: [tmp_path])
    return folder


def write(folder: Path, name: str, data: dict) -> None:
    (folder / f"gpu-{name}.json").write_text(json.dumps(data))


def test_with_no_gpu_run_recorded_there_is_none_and_one_line_says_so(results):
    assert gpu_results("amp") is None and gpu_results("projection") is None
    line = gpu_figures.none_recorded("amp")
    assert "\n" not in line and "No GPU run has been recorded yet" in line
    assert "make gpu-check" in line


def test_a_smoke_run_or_a_run_without_a_gpu_is_no_gpu_figure(results):
    write(results, "amp", {**AMP, "smoke": True})
    assert gpu_results("amp") is None
    write(results, "amp", {**AMP, "machine": {**MACHINE, "gpus": 0}})
    assert gpu_results("amp") is None


def test_the_amp_table_quotes_the_figures_labelled_with_the_gpu(results):
    write(results, "amp", AMP)
    found = gpu_results("amp")
    assert found == AMP
    assert gpu_figures.amp_speedups(found, "lesson3-bench") == {"fp32": 1.0, "bf16": 4.0,
                                                                "fp16": 5.0}  # fmt: skip
    table = gpu_figures.amp_markdown(found)
    for part in ("NVIDIA Test GPU 80GB", "driver 999.1", "CUDA 13.0", "torch 2.11.0",
                 "2026-12-02", "not on this machine"):  # fmt: skip
        assert part in table, part
    row = next(line for line in table.splitlines() if line.startswith("| lesson 3 benchmark"))
    assert "1,000 (x1.00)" in row and "4,000 (x4.00)" in row and "5,000 (x5.00)" in row
    assert row.endswith("| 800 | 500 | - |")


def test_the_projection_reference_points_are_the_measured_ones(results):
    write(results, "projection", PROJECTION)
    ref = gpu_figures.projection_reference(gpu_results("projection"))
    assert ref["measured"] == {1: 32_000.0, 2: 32_000.0}  # 2 x 32 samples in 2 ms
    assert ref["compute_seconds"] == 0.001 and ref["batch_size"] == 32
    assert ref["gpu"].startswith("NVIDIA Test GPU 80GB (driver 999.1")
    table = gpu_figures.projection_markdown(gpu_results("projection"))
    assert "Measured on NVIDIA Test GPU 80GB" in table and "2 GPUs: 32,000 samples/s" in table
    assert "| NVLink 4 (H100) | 32,000, 1.00 | 60,000, 0.94 |" in table


def test_one_gpu_gives_one_reference_point_and_the_figure_names_the_gpu(results):
    pytest.importorskip("matplotlib")
    write(results, "projection", {**PROJECTION, "calibrate_2_gpus": None})
    found = gpu_results("projection")
    assert gpu_figures.projection_reference(found)["measured"] == {1: 32_000.0}
    fig = gpu_figures.projection_figure(found)
    labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert "measured on NVIDIA Test GPU 80GB" in labels and "measured here" not in labels
    assert "NVIDIA Test GPU 80GB" in fig.texts[0].get_text()  # the suptitle


def test_the_results_are_found_from_a_folder_below_the_repository(tmp_path, monkeypatch):
    folder = tmp_path / "benchmarks" / "results"
    folder.mkdir(parents=True)
    write(folder, "amp", AMP)
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")
    assert gpu_figures.results_path("amp") == folder / "gpu-amp.json"


def test_the_helpers_read_what_benchmarks_gpu_writes(results):
    """The schema is benchmarks/gpu.py's: its CPU smoke parts, relabelled as a GPU run."""
    torch = pytest.importorskip("torch")
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"
    spec = importlib.util.spec_from_file_location("nbaccel_benchmarks_gpu", path)
    gpu = importlib.util.module_from_spec(spec)
    before = list(sys.path)
    try:
        spec.loader.exec_module(gpu)  # by its path: "gpu" is also the name of tests/gpu/
    finally:
        sys.path[:] = before  # gpu.py puts benchmarks/ first, for its imports
    cpu = torch.device("cpu")
    for name, part in (("amp", gpu.amp_part), ("projection", gpu.projection_part)):
        write(results, name, {"machine": MACHINE, "smoke": False, **part(cpu, 2, True)})
    amp = gpu_results("amp")
    table = gpu_figures.amp_markdown(amp)
    assert len([line for line in table.splitlines() if line.startswith("| lesson")]) == 4
    assert gpu_figures.amp_speedups(amp, "lesson3-bench")["fp32"] == 1.0
    projection = gpu_results("projection")
    ref = gpu_figures.projection_reference(projection)
    assert set(ref["measured"]) == {1}  # calibrate needs 2 GPUs; none on a CPU
    assert "| NVLink 4 (H100) |" in gpu_figures.projection_markdown(projection)
