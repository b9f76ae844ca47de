"""The live view in an executed notebook: the panel survives as one image/png output."""

from __future__ import annotations

import base64

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.multiprocess

TRAIN = """
import torch
from torch.utils.data import DataLoader, TensorDataset
from nbaccel import Accelerator, Run, notebook_launcher

def train(epochs=6):
    accelerator = Accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 16, generator=g)
    data = TensorDataset(x, x[:, :1] * x[:, 1:2])
    loader = DataLoader(data, batch_size=16)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.total_steps = epochs * len(loader)
    for _ in range(epochs):
        for inputs, targets in loader:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            accelerator.log({"loss": loss})
    accelerator.print("done")
    accelerator.end_training()
    return loss.item()
"""


LAUNCH = "run = Run()\nloss = notebook_launcher(train, num_processes=2, run=run)"
CHECK = "len(run.series('loss')[0][0]), len(run.series('loss')[1][0]), sorted(run.results)"
HERE = "train(epochs=3)"  # the same loop in the kernel itself: one process, no launcher


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> list[list[dict]]:
    """One kernel runs both cases, as a learner's notebook would: a launch, then the loop in
    the kernel. Each cell's outputs, in order."""
    folder = tmp_path_factory.mktemp("notebook")
    source = [TRAIN, LAUNCH, CHECK, HERE]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in source])
    NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(folder)}},
    ).execute()
    return [cell.outputs for cell in notebook.cells]


def pngs(outputs: list[dict]) -> list[bytes]:
    return [
        base64.b64decode(o["data"]["image/png"])
        for o in outputs
        if o["output_type"] == "display_data" and "image/png" in o.get("data", {})
    ]


def test_a_launched_run_leaves_its_final_panel_in_the_notebook(executed):
    _, launched, checked, _ = executed
    images = pngs(launched)
    assert len(images) == 1 and images[0][:8] == b"\x89PNG\r\n\x1a\n"
    kinds = [o["output_type"] for o in launched]
    assert len(launched) <= 3, kinds  # progress line, panel, the workers' prints: no pile-up
    assert "[rank 0] done" in "".join(o.get("text", "") for o in launched)
    # 6 epochs of 64 steps, every one logged by both ranks
    assert checked[0]["data"]["text/plain"] == "(384, 384, [0, 1])"


def test_a_single_process_loop_gets_the_same_view(executed):
    *_, here = executed
    assert len(pngs(here)) == 1
