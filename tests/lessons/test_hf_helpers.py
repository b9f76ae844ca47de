"""nbaccel.lessons.hf: Accelerate's interactive ``accelerate config`` answered from a cell, and
the steps its CPU paths need, checked apart from lesson 4 that uses them."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("pexpect")

from accelerate.commands.config.config_args import ClusterConfig

from nbaccel.lessons import hf

# accelerate config's questions on a machine without GPUs, for one machine with 2 processes
# (accelerate 1.15: a multi-GPU machine is asked for its GPU ids and NUMA, a multi-CPU one not)
MULTI_GPU = [
    ("In which compute environment are you running?", "This machine"),
    ("Which type of machine are you using?", "multi-GPU"),
    ("How many different machines will you use", "1"),
    ("Should distributed operations be checked", "no"),
    ("Do you wish to optimize your script with torch dynamo?", "no"),
    ("Do you want to use DeepSpeed?", "no"),
    ("Do you want to use FullyShardedDataParallel?", "no"),
    ("Do you want to use Megatron-LM", "no"),
    ("How many GPU(s) should be used for distributed training?", "2"),
    ("What GPU(s) (by id) should be used", "all"),
    ("Would you like to enable numa efficiency?", "no"),
    ("Do you wish to use mixed precision?", "bf16"),
]
needs_no_gpu = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or __import__("torch").cuda.is_available(),
    reason="the questions above are a machine without GPUs' (with one, others are asked)",
)


@needs_no_gpu
@pytest.mark.process
def test_the_answers_typed_into_accelerate_config_are_the_files(tmp_path):
    path = tmp_path / "config.yaml"
    asked = hf.answer_accelerate_config(MULTI_GPU, path)
    config = ClusterConfig.from_yaml_file(path)
    assert (config.distributed_type, config.num_processes, config.mixed_precision) == (
        "MULTI_GPU",
        2,
        "bf16",
    )
    assert [reply for _, reply in asked] == [reply for _, reply in MULTI_GPU]
    for (shown, _), (question, _) in zip(asked, MULTI_GPU, strict=True):
        assert question in shown, "each question as Accelerate printed it, in full"
    # a menu's option past the first, chosen by its text: the menu moved to it
    assert config.distributed_type != "NO" and config.mixed_precision != "no"


@needs_no_gpu
@pytest.mark.process
def test_a_question_the_answers_skip_is_named(tmp_path):
    skipped = [pair for pair in MULTI_GPU if not pair[0].startswith("Do you want to use DeepSpeed")]
    with pytest.raises(hf.ConfigAnswerError, match=r"asked 'Do you want to use DeepSpeed\?"):
        hf.answer_accelerate_config(skipped, tmp_path / "config.yaml")
    assert not (tmp_path / "config.yaml").exists()


@pytest.mark.process
def test_an_option_a_menu_does_not_offer_is_refused_with_the_options(tmp_path):
    answers = [*MULTI_GPU[:1], ("Which type of machine are you using?", "multi-GPUs")]
    with pytest.raises(hf.ConfigAnswerError, match=r"offers \[.*'multi-GPU'.*\], not 'multi-GPUs'"):
        hf.answer_accelerate_config(answers, tmp_path / "config.yaml")


@pytest.mark.process
def test_answers_that_stop_early_name_the_next_question(tmp_path):
    with pytest.raises(hf.ConfigAnswerError, match=r"How many different machines.* after the last"):
        hf.answer_accelerate_config(MULTI_GPU[:2], tmp_path / "config.yaml")


@needs_no_gpu
@pytest.mark.process
def test_accelerate_config_failing_on_an_answer_shows_its_error(tmp_path):
    # Accelerate refuses a multi-GPU machine with one GPU and stops, before its next question
    one_gpu = [*MULTI_GPU[:8], ("How many GPU(s) should be used for distributed training?", "1")]
    with pytest.raises(hf.ConfigAnswerError, match=r"(?s)ended before 'the end'.*only using 1 GPU"):
        hf.answer_accelerate_config(one_gpu, tmp_path / "config.yaml")


def test_the_last_line_of_a_prompt_is_its_question_without_the_menus_rule():
    assert hf._last_line("\r-----Which type of machine are you using?\r") == (
        "Which type of machine are you using?"
    )
    assert hf._last_line("no\r\n\x1b[?25hDo you? [yes/NO]: ") == "Do you? [yes/NO]:"


def test_any_question_matches_a_field_or_a_menu_but_not_an_escape_code():
    assert hf.ANY_QUESTION.search("How many? [1]: ")
    assert hf.ANY_QUESTION.search("Please select a choice using the arrow or number keys")
    assert not hf.ANY_QUESTION.search("\x1b[?25h")  # the cursor shown again, before a prompt
    found = hf.ANY_QUESTION.search("\x1b[?25hHow many? [1]: ")
    assert found and found.group() == "[1]: "


def test_the_transformers_handoff_is_skipped_inside_only(monkeypatch):
    from accelerate.utils import DeepSpeedPlugin

    handoff = DeepSpeedPlugin.set_deepspeed_weakref
    with pytest.raises(ZeroDivisionError), hf._no_transformers_handoff():
        assert DeepSpeedPlugin.set_deepspeed_weakref is not handoff
        assert DeepSpeedPlugin.set_deepspeed_weakref(object()) is None
        1 / 0  # noqa: B018  # restored even when the block fails
    assert DeepSpeedPlugin.set_deepspeed_weakref is handoff


def test_preloading_names_deepspeeds_device_only_without_a_gpu(monkeypatch):
    import torch

    for name in ("DS_ACCELERATOR", "PYTORCH_NVML_BASED_CUDA_CHECK"):  # DeepSpeed's import sets
        monkeypatch.setenv(name, "unset below, restored after")  # the second
        monkeypatch.delenv(name)  # recorded: monkeypatch removes what the preload sets
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    hf.preload_for_notebook_launcher()
    assert "DS_ACCELERATOR" not in os.environ, "with a GPU the kernel touches nothing of it"
    assert "torch._dynamo" in __import__("sys").modules
    if importlib.util.find_spec("deepspeed") is None:
        return
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    hf.preload_for_notebook_launcher()
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    assert "deepspeed" in __import__("sys").modules
