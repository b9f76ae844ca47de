"""One process on CUDA: placement, fp16 with the GradScaler, bf16, the live view's peak memory,
the time breakdown's events, and save_state/load_state; each against plain PyTorch on the same
GPU (the breakdown against CUDA's own events)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from nbaccel import Accelerator
from nbaccel.observe.channel import MEMORY, TIME_COMPUTE, TIME_LOOP
from nbaccel.observe.live.line import progress

from ..accelerator.test_multiprocess import make_data, make_model, resume
from .common import GPU, exact_float32, fit, gap

pytestmark = GPU

#: One process, same GPU, same kernels in the same order: the Accelerator adds no arithmetic.
SAME_GPU_TOLERANCE = 1e-6


def test_prepare_puts_model_optimizer_state_and_batches_on_the_gpu():
    exact_float32()
    accelerator = Accelerator(live=False)
    assert accelerator.device == torch.device("cuda", 0)
    assert accelerator.distributed_type == "NO" and accelerator.backend is None
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(make_data(), batch_size=16)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    assert {p.device for p in model.parameters()} == {accelerator.device}
    x, y = next(iter(loader))
    assert x.device == y.device == accelerator.device
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    assert states and all(t.device == accelerator.device for t in states if t.dim() > 0)
    accelerator.end_training()


def test_one_process_on_cuda_matches_plain_pytorch_on_the_gpu():
    exact_float32()
    accelerator = Accelerator(live=False)
    got = fit(accelerator, batch_size=16)
    accelerator.end_training()
    expected = fit(None, batch_size=16, device="cuda")
    assert gap(got, expected) <= SAME_GPU_TOLERANCE


def test_fp16_with_the_gradscaler_on_cuda_matches_torch_amp():
    exact_float32()
    accelerator = Accelerator(mixed_precision="fp16", live=False)
    assert accelerator.scaler is not None and accelerator.scaler._device == "cuda"
    got = fit(accelerator, batch_size=16)
    accelerator.end_training()
    expected = fit(None, batch_size=16, device="cuda", mode="fp16")
    assert gap(got, expected) <= SAME_GPU_TOLERANCE
    # and fp16 did something: the weights are not fp32's (nor the initial ones)
    assert gap(got, fit(None, batch_size=16, device="cuda")) > 0


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_an_inf_or_nan_gradient_skips_the_fp16_step_and_the_scheduler(bad):
    accelerator = Accelerator(mixed_precision="fp16", live=False)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    def weights() -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}

    def one_step(x: torch.Tensor) -> None:
        # a mean: a sum of 4 outputs times the scale (65536) would overflow fp16's 65504
        accelerator.backward(model(x).mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    before = weights()
    x = torch.ones(4, 8, device=accelerator.device)
    x[0, 0] = bad
    one_step(x)
    assert accelerator.optimizer_step_was_skipped
    assert all(torch.equal(before[k], v) for k, v in weights().items())
    assert scheduler.get_last_lr() == [0.1]  # not advanced
    assert accelerator.scaler.get_scale() == 32768.0  # halved from 65536
    one_step(torch.ones(4, 8, device=accelerator.device))  # a finite step goes through
    assert not accelerator.optimizer_step_was_skipped
    assert not all(torch.equal(before[k], v) for k, v in weights().items())
    assert scheduler.get_last_lr() == [0.05]
    accelerator.end_training()


def test_bf16_autocast_runs_the_forward_in_bf16_and_returns_float32():
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    exact_float32()
    accelerator = Accelerator(mixed_precision="bf16", live=False)
    model = accelerator.prepare(make_model())
    inner = []
    model[0].register_forward_hook(lambda module, args, out: inner.append(out.dtype))
    x = torch.randn(16, 8, device=accelerator.device)
    out = model(x)
    assert inner == [torch.bfloat16] and out.dtype == torch.float32
    assert accelerator.scaler is None  # bf16 needs no loss scaling
    accelerator.end_training()
    got = fit(Accelerator(mixed_precision="bf16", live=False), batch_size=16)
    expected = fit(None, batch_size=16, device="cuda", mode="bf16")
    assert gap(got, expected) <= SAME_GPU_TOLERANCE


def test_the_live_view_shows_the_peak_gpu_memory():
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    accelerator = Accelerator(live=False)
    model = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 1))  # 16 MiB of weights
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    for _ in range(3):  # weights, gradients and Adam's two moments: at least 64 MiB
        loss = model(torch.randn(64, 2048, device=accelerator.device)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss})
    accelerator.end_training()  # records the last counters
    peak = torch.cuda.max_memory_allocated(accelerator.device) / 2**20
    shown = accelerator.run.latest(MEMORY)
    assert list(shown) == [0]
    assert 64 <= shown[0] <= peak, (shown, peak)
    assert f"GPU peak {shown[0]:,.0f} MiB" in progress(accelerator.run)


class Spin(nn.Module):
    """A forward that keeps the GPU busy for ``cycles`` clock cycles (its launch returns at
    once): host clocks around it would time almost nothing."""

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.cycles, self.weight = cycles, nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(self.cycles)
        return x * self.weight


def spin_loop(cycles: int, steps: int) -> tuple[Accelerator, float]:
    """``steps`` training steps of ``Spin(cycles)`` through an Accelerator; it, and the loop's
    GPU seconds by CUDA's own events around it (one reference for the whole loop: the GPU's
    clock rises while it runs, so a spin timed before the loop can take twice as long as one
    inside it, as a first GPU run showed)."""
    accelerator = Accelerator(live=False)
    model = Spin(cycles)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.ones(1, device=accelerator.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        accelerator.backward(model(x).sum())
        optimizer.step()
        optimizer.zero_grad()
    end.record()
    torch.cuda.synchronize()
    return accelerator, start.elapsed_time(end) / 1000


def test_the_breakdown_times_the_gpus_work_by_its_events():
    """The loop is almost all spinning on the GPU, timed apart by CUDA's own events."""
    accelerator, on_gpu = spin_loop(20_000_000, 5)  # 10 to 60 ms a forward, by the clock
    # the steps' kinds drawn by the seeded generator time the third step's forward; it stands
    # for the two before it, and the two after count at its length (``StepEvents.tail``)
    counters = accelerator._meter.times.counters()
    # host clocks would give microseconds (the launches); the events give the spinning
    assert counters[TIME_COMPUTE] >= 0.9 * on_gpu, (counters, on_gpu)
    assert counters[TIME_COMPUTE] <= counters[TIME_LOOP]


def test_the_breakdown_estimates_the_gpus_work_from_a_sample_of_its_spans():
    """Each step times one interval with two events (``cuda_events.StepEvents``), and the
    breakdown says its totals are estimates; its estimate of the spinning is within 15% of
    CUDA's own events around the loop (the GPU's clock may move between the samples)."""
    accelerator, on_gpu = spin_loop(2_000_000, 200)  # about 1 ms a forward
    counters = accelerator._meter.times.counters()
    assert "compute" in accelerator._meter.times._events.estimated  # said in the counters, once
    assert counters[TIME_COMPUTE] == pytest.approx(on_gpu, rel=0.15), (counters, on_gpu)


def test_save_state_then_load_state_on_cuda_continues_bit_identically(tmp_path):
    # Dropout draws from CUDA's generator: load_state must restore it too
    assert resume(str(tmp_path / "ckpt")) is True
    accelerator = Accelerator(live=False)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.randn(4, 8, device=accelerator.device)).sum())
    optimizer.step()
    accelerator.save_state(str(tmp_path / "again"))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    accelerator.load_state(str(tmp_path / "again"))
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert {p.device for p in model.parameters()} == {accelerator.device}
    states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    assert all(t.device == accelerator.device for t in states if t.dim() > 0)
    accelerator.end_training()
