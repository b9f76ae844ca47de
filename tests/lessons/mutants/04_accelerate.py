"""Plausible mistakes that lesson 4's checks must catch (tests/lessons/test_exercises.py)."""

_LAUNCH = (
    "# Check: one run of WORKERS processes, in bf16, that learned: its mean loss fell, its"
    " accuracy is"
)
_BYTES = (
    "# Check: section 15's arithmetic, measured: float32 weights and gradients, AdamW's two moments"
)
_HEADLINE = (
    "# Check: each feature ran on WORKERS processes in both libraries, and Accelerate's saved"
    " weights"
)
_HF_LAUNCH = "# Check: Accelerate's launcher ran one run of WORKERS processes, which learned"
_PANEL = (
    "# Check: nbaccel's launcher returned rank 0's report, and every rank's loss reached the panel"
)
_PRECISION = (
    "# Check: bf16 changed the arithmetic; fp16 did too on GPUs, with gradient scaling, and on the"
)
_ACCUMULATE = "# Check: inside accumulate(model), the optimizer stepped once every 2 batches"
_SAVED = "# Check: the saved weights load into a plain MLP, and load_state restored them exactly"
_CONFIG = "# Check: accelerate config wrote the answers"
_ACCELERATE_LAUNCH = (
    "# Check: accelerate launch ran one run of WORKERS processes, in the file's bf16, which learned"
)
MUTANTS = [
    # (the check cell's first line, exactly; code run before the check's source; the mistake)
    (
        _HF_LAUNCH,
        "float32 = {**float32, 'processes': 1, 'distributed_type': 'NO'}",
        "Accelerate's launcher without cpu=True on a CPU: each process trained alone",
    ),
    (
        _HF_LAUNCH,
        "float32 = {**float32, 'accuracy': 0.1}",
        "a launch that finished but learned nothing (chance accuracy on 10 digits)",
    ),
    (
        _PANEL,
        "run = Run()",
        "a launch whose ranks sent nothing to the live panel",
    ),
    (
        _PRECISION,
        "gaps = {**gaps, 'bf16': 0.0}",
        "bf16 that trained in float32 (no autocast)",
    ),
    (
        _PRECISION,
        "gaps = {**gaps, 'fp16': 0.0 if gaps['fp16'] else 1e-3}",
        "fp16 that did the opposite of what Accelerate does on this device",
    ),
    (
        _ACCUMULATE,
        "accumulated_run = {**accumulated_run,"
        " 'steps': accumulated_run['epochs'] * accumulated_run['batches']}",
        "the optimizer stepped on every batch: the loop body outside accumulate(model)",
    ),
    (
        _SAVED,
        "load_gap = 1e-3",
        "load_state restored other weights than the saved ones",
    ),
    (
        _SAVED,
        "plain_mlp = MLP(64, HIDDEN, 10)",
        "a plain MLP that never loaded the saved weights",
    ),
    (
        _CONFIG,
        "CONFIG = f'{OUT}/accelerate-fp16.yaml'",
        "a config file whose precision is not the answer given (fp16 for bf16)",
    ),
    (
        _ACCELERATE_LAUNCH,
        "accelerate_report = {**accelerate_report, 'processes': 1}",
        "accelerate launch's separate runs of one process (the script without --cpu on a CPU)",
    ),
    (
        _ACCELERATE_LAUNCH,
        "accelerate_report = {**accelerate_report, 'mixed_precision': 'no'}",
        "accelerate launch did not read the config file's precision",
    ),
    (
        _LAUNCH,
        "reports = [{**reports[0], 'processes': 1}] * 2",
        "two separate runs of one process each, not one run",
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
]

_PORT = "# Check: exercise 1 -- the port trains on Accelerate exactly what the plain loop trains"
_PORT_BODY = """\
    set_seed(0)
    accelerator = Accelerator()
    model = MLP(64, 32, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(load_digits("train"), batch_size=32)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, (images, labels) in zip(range(STEPS), loader):
        loss = F.cross_entropy(model(images), labels)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    weights = torch.cat(
        [p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()]
    )
    return weights, accelerator
"""
_YAML = "# Check: exercise 2 -- Accelerate reads the setup the colleague asked for"
_QUIZ = "# Check: exercise 3 -- the quiz: each answer's hash is the right answer's"
WRONG = [
    # (the exercise check's first line; the learner's cell as a learner could write it; the mistake)
    (
        _PORT,
        "def ported_loop(steps=30):\n    from nbaccel import Accelerator\n\n"
        + _PORT_BODY.replace("STEPS", "steps"),
        "nbaccel's Accelerator, not Hugging Face Accelerate's",
    ),
    (
        _PORT,
        'def ported_loop(steps=30):\n    return plain_loop(), "cpu"\n',
        "no port at all: plain_loop's weights and a device name",
    ),
    (
        _PORT,
        "def ported_loop(steps=30):\n    from accelerate import Accelerator\n\n"
        + _PORT_BODY.replace("STEPS", "steps - 1"),
        "a port that stops one step early (an off-by-one in the loop)",
    ),
    (
        _PORT,
        "def ported_loop(steps=30):\n"
        "    from accelerate import Accelerator\n\n"
        "    set_seed(0)\n"
        "    accelerator = Accelerator()\n"
        "    model = MLP(64, 32, 10)\n"
        "    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)\n"
        '    loader = DataLoader(load_digits("train"), batch_size=32)\n'
        "    for step, (images, labels) in zip(range(steps), loader):\n"
        "        loss = F.cross_entropy(model(images), labels)\n"
        "        loss.backward()\n"
        "        optimizer.step()\n"
        "        optimizer.zero_grad()\n"
        "    return torch.cat([p.detach().flatten() for p in model.parameters()]), accelerator\n",
        "an Accelerator made but never used: no prepare (on a CPU the weights still match)",
    ),
    (
        _YAML,
        "exercise_yaml = DEEPSPEED_YAML.replace('zero_stage: 2', 'zero_stage: 3')",
        "ZeRO 3 only: still bf16 on WORKERS processes, no accumulation",
    ),
    (
        _YAML,
        "exercise_yaml = (\n"
        "    DEEPSPEED_YAML.replace(f'num_processes: {WORKERS}', 'num_processes: 8')\n"
        "    .replace('mixed_precision: bf16', 'mixed_precision: fp16')\n"
        "    .replace('zero_stage: 2', 'zero_stage: 3')\n"
        ")\n",
        "the accumulation left at 1 (DeepSpeed's gradient_accumulation_steps)",
    ),
    (
        _YAML,
        "exercise_yaml = DEEPSPEED_YAML\n",
        "section 16's file unchanged",
    ),
    (
        _QUIZ,
        'answers = {1: 128, 2: "b", 3: 1, 4: "b"}',
        "question 1: the accumulation forgotten (32 x 4 processes, not x 2 batches a step)",
    ),
    (
        _QUIZ,
        'answers = {1: 256, 2: "b", 3: 4, 4: "b"}',
        "question 3: the optimizer steps on every batch (it steps once per 4)",
    ),
    (
        _QUIZ,
        'answers = {1: 256, 2: "a", 3: 1, 4: "b"}',
        "question 2: Accelerator() does not split the batches; prepare(loader) does",
    ),
]

# The quiz's answers are never in the notebook (its <details> says where to look): the test
# runs this source in place of the learner's cell.
SOLUTIONS = {_QUIZ: 'answers = {1: 256, 2: "b", 3: 1, 4: "b"}'}
