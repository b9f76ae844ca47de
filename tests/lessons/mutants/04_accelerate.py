"""Plausible mistakes that lesson 4's checks must catch (tests/lessons/test_exercises.py)."""

_LAUNCH = (
    "# Check: one run of WORKERS processes, in bf16, that learned: its mean loss fell, its"
    " accuracy is"
)
_BYTES = (
    "# Check: section 10's arithmetic, measured: float32 weights and gradients, AdamW's two moments"
)
_HEADLINE = (
    "# Check: each feature ran on WORKERS processes in both libraries, and Accelerate's saved"
    " weights"
)
_FIXED = (
    "# Check: accelerate launch ran one run of WORKERS processes, in the config file's bf16, and"
)
MUTANTS = [
    # (the check cell's first line, exactly; code run before the check's source; the mistake)
    (
        _LAUNCH,
        "reports = [{**reports[0], 'processes': 1}] * 2",
        "two separate runs of one process each (accelerate launch's CPU pitfall), not one run",
    ),
    (
        _LAUNCH,
        "reports = [{**reports[0], 'accuracy': 0.1}]",
        "a launch that exited 0 but learned nothing (chance accuracy on 10 digits)",
    ),
    (
        _LAUNCH,
        "reports = [{**reports[0], 'mean_losses': [0.3, 0.5, 0.9]}]",
        "a run whose mean loss rose: it diverged",
    ),
    (
        _BYTES,
        "held = {**held, \"AdamW's two moments\": held['weights']}",
        "an optimizer with one state tensor per parameter (SGD with momentum), not AdamW's two",
    ),
    (
        _BYTES,
        "held = {k: v // 2 for k, v in held.items()}",
        "weights, gradients and moments kept in 16 bits, which autocast does not do",
    ),
    (
        _HEADLINE,
        "headline_gaps = {**headline_gaps, 'bf16, accumulate 2': 3e-3}",
        "Accelerate's accumulation window ended on other micro-batches than nbaccel's",
    ),
    (
        _HEADLINE,
        "headline_runs = {**headline_runs, ('bf16, accumulate 2', 'accelerate'): Run()}",
        "Accelerate's side recorded nothing for the live panel (no LiveTracker in log_with)",
    ),
    (
        _FIXED,
        "fixed = [{**fixed[0], 'processes': 1}]",
        "the fix left out: accelerate launch ran processes that each trained alone",
    ),
    (
        _FIXED,
        "fixed = [{**fixed[0], 'mixed_precision': 'no'}]",
        "accelerate launch did not read the config file's precision",
    ),
    (
        "# Check: the quiz",
        "answers = {**answers, 3: 4}",
        "question 3: the optimizer steps on every micro-batch (it steps once per 4)",
    ),
    (
        "# Check: exercise 1 -- the port trains exactly what the plain loop trains",
        "ported_loop = lambda steps=30: (plain_loop('cpu', steps=steps - 1), torch.device('cpu'))",
        "a port that stops one step early (an off-by-one in the loop)",
    ),
    (
        "# Check: exercise 2 -- Accelerate reads the setup the colleague asked for",
        "exercise_yaml = DEEPSPEED_YAML.replace('zero_stage: 2', 'zero_stage: 3')",
        "ZeRO 3 only: still bf16 on WORKERS processes, no accumulation",
    ),
]
