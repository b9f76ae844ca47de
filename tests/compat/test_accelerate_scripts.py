"""Accelerate's own test scripts against nbaccel, with only their imports changed (issue 32).

``accelerate_scripts.py`` says how the scripts are read, rewritten and run. Here: the 63 cases
are still the ones the installed scripts hold, the rewrite touches import lines only, and every
case in EXPECTED_TO_PASS passes. A case that starts to pass joins the list in one line; the
status of all 63 is ``python -m tests.compat.accelerate_scripts``.
"""

from __future__ import annotations

import ast

import pytest

from . import accelerate_scripts as compat

pytest.importorskip(
    "accelerate.test_utils.scripts",
    reason="accelerate is a test dependency: pip install -e '.[test]'",
)

pytestmark = pytest.mark.multiprocess

# ../shared/ACCELERATE-CASES.md: the cases Accelerate 1.15 passes on 2 CPU processes.
ALL_CASES = [
    "test_sync::main_prelude",
    "test_sync::test_dataloader_break",
    "test_sync::test_distributed_sync",
    "test_sync::test_distributed_sync_multiple_fwd",
    *(
        f"test_sync::{f}[split={s},dispatch={d},sync_each={e}]"
        for f in ("test_gradient_accumulation", "test_gradient_accumulation_with_opt_and_scheduler")
        for s in (0, 1)
        for d in (0, 1)
        for e in (0, 1)
    ),
    "test_ops::test_gather",
    "test_ops::test_gather_object",
    "test_ops::test_gather_non_contiguous",
    "test_ops::test_broadcast",
    "test_ops::test_pad_across_processes",
    "test_ops::test_reduce_sum",
    "test_ops::test_reduce_mean",
    "test_ops::test_reduce_max",
    "test_ops::test_op_checker",
    "test_ops::test_copy_tensor_to_devices",
    "test_distributed_data_loop::main_prelude",
    "test_distributed_data_loop::test_default_ensures_even_batch_sizes",
    "test_distributed_data_loop::test_can_disable_even_batches",
    "test_distributed_data_loop::test_join_raises_warning_for_non_ddp_distributed",
    "test_distributed_data_loop::test_pickle_accelerator",
    "test_distributed_data_loop::test_data_loader[shuffle=False]",
    "test_distributed_data_loop::test_data_loader[shuffle=True]",
    "test_distributed_data_loop::test_data_loader[batch_sampler]",
    "test_distributed_data_loop::test_data_loader[sampler=BatchSampler]",
    "test_script::main_prelude",
    "test_script::init_state_check",
    "test_script::process_execution_check",
    "test_script::test_split_between_processes_list",
    "test_script::test_split_between_processes_nested_dict",
    "test_script::test_split_between_processes_tensor",
    "test_script::test_split_between_processes_evenly",
    "test_script::rng_sync_check",
    "test_script::dl_preparation_check",
    "test_script::central_dl_preparation_check",
    "test_script::custom_sampler_check",
    "test_script::check_seedable_sampler",
    "test_script::check_seedable_sampler_with_data_seed",
    "test_script::check_seedable_sampler_in_batch_sampler_shard",
    "test_script::training_check[seedable=False]",
    "test_script::training_check[seedable=True]",
    "test_script::test_trigger",
    "test_script::test_reinstantiated_state",
    "test_notebook::test_can_initialize",
    "test_notebook::test_clean_cuda_fork",
    "test_notebook::test_static_rdzv_backend",
    "test_notebook::test_c10d_rdzv_backend",
    "test_notebook::test_fault_tolerant",
    "test_notebook::test_monitoring",
]

# The cases that pass against nbaccel today. When one more passes, add it here: every case but
# those in CANNOT_PASS, each with its reason (the README's compatibility table gives them too).
CANNOT_PASS = {
    # Accelerate's own helper accelerate.test_utils.are_the_same_tensors (not an import of the
    # script, so it stays Accelerate's) reads Accelerate's AcceleratorState singleton, which
    # only Accelerate's Accelerator creates.
    "test_script::rng_sync_check",
    "test_script::training_check[seedable=False]",
    "test_script::training_check[seedable=True]",
    # passes a fork-context multiprocessing Queue as an argument: it cannot travel by value to
    # workers that are not forks of the caller (ACCELERATE-CASES.md counts it as by design)
    "test_notebook::test_fault_tolerant",
}
EXPECTED_TO_PASS = set(ALL_CASES) - CANNOT_PASS

SCRIPTS = list(dict.fromkeys(case.split("::")[0] for case in ALL_CASES))


def test_the_installed_scripts_hold_the_63_cases():
    assert len(ALL_CASES) == 63
    assert [case.id for case in compat.discover()] == ALL_CASES
    assert set(ALL_CASES) >= CANNOT_PASS
    assert len(EXPECTED_TO_PASS) >= 55  # issue 32: at most 8 of the 63 may fail


@pytest.mark.parametrize("script", SCRIPTS)
def test_only_import_lines_change(script):
    source = compat.read_script(script)
    rewritten, mappings = compat.rewrite_imports(source)
    import_lines = {
        line
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("accelerate")
        for line in range(node.lineno, node.end_lineno + 1)
    }
    before, after = source.splitlines(), rewritten.splitlines()
    assert len(after) == len(before), "line numbers must stay those of the installed script"
    changed = {n for n, (b, a) in enumerate(zip(before, after, strict=True), 1) if b != a}
    assert changed <= import_lines
    homes = {m.name: m.home for m in mappings}
    assert homes.get("Accelerator", "nbaccel") == "nbaccel"
    assert homes.get("RegressionModel", "accelerate.test_utils") == "accelerate.test_utils"
    assert any(home.startswith("nbaccel") for home in homes.values())


def test_a_name_nbaccel_lacks_stays_accelerates():
    source = (
        "from accelerate.utils import (\n    gather,\n    is_cuda_available as cuda,\n)\nx = 1\n"
    )
    rewritten, _ = compat.rewrite_imports(source)
    assert rewritten == (
        "from nbaccel.utils import gather; from accelerate.utils import is_cuda_available as cuda"
        "\n\n\n\nx = 1\n"
    )


@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", SCRIPTS)
def test_expected_cases_pass(script):
    cases = [c for c in compat.discover() if c.script == script and c.id in EXPECTED_TO_PASS]
    assert cases, f"every script has cases that pass: {script}"
    outcomes = compat.run_cases(cases)
    failed = [o for o in outcomes if not o.passed]
    assert not failed, "cases expected to pass failed:\n" + compat.table(failed)
