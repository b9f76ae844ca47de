"""Plausible mistakes that lesson 3's checks must catch (tests/lessons/test_exercises.py)."""

_FP16 = "runs['fp16']"
MUTANTS = [
    # (the check cell's first line, exactly; code run before the check's source; the mistake)
    (
        "# Check: from one seed and the same batches, float32, bf16 and fp16 all learned the"
        " digits with",
        f"runs = {{**runs, 'fp16': {{**{_FP16}, 'changed': [True] * len({_FP16}['changed'])}}}}",
        "the fp16 loop calls optimizer.step() instead of scaler.step(optimizer): the overflowing"
        " steps changed the weights",
    ),
    (
        "# Check: from one seed and the same batches, float32, bf16 and fp16 all learned the"
        " digits with",
        f"runs = {{**runs, 'fp16': {{**{_FP16}, 'changed': [True] * len({_FP16}['changed']),"
        f" 'scales': [({_FP16}['scales'][0][0],) * 2] * len({_FP16}['scales'])}}}}",
        "an fp16 run in which no step overflowed (lesson 3's old check: a halving with 0 skipped"
        " steps passed)",
    ),
]

_EX1 = (
    "# Check: exercise 1 -- the smallest scales that keep g = 1e-9 nonzero and normal in float16,"
)
_EX1_CELL = (
    "# Exercise 1: define scale_nonzero, scale_normal and largest_gradient"
    " (the answers to (a), (b), (c))\n"
)
_EX2 = (
    "# Check: exercise 2 -- the bfloat16 weight lost every update, the float32 one kept them all,"
)
_EX2_CELL = "# Exercise 2: define w_bf16, w_fp32 (after 100 updates of 1/256) and smallest_x\n"
_EX3 = (
    "# Check: exercise 3 -- from 2^10, with no overflow, the scale doubles after every 3 clean"
    " steps"
)
_EX3_CELL = "# Exercise 3: define scales (the 7 scales read before each of 7 fp16_step calls)\n"
_EX3_SETUP = """set_seed(0)
model = MLP(64, HIDDEN, 10)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
inputs, labels = load_digits("train")[:BATCH]
"""
_NEXT_BF16 = """one_bf16 = torch.tensor(1.0, dtype=torch.bfloat16)
smallest_x = torch.nextafter(torch.tensor(2**-8, dtype=torch.bfloat16), one_bf16)
"""

WRONG = [
    # (the exercise's check, first line; the learner's whole cell; the mistake)
    (
        _EX1,
        _EX1_CELL
        + """g = 1e-9
scale_nonzero = next(2**k for k in range(64) if g * 2**k >= 2**-24)
scale_normal = next(2**k for k in range(64) if g * 2**k >= FP16.smallest_normal)
largest_gradient = FP16.max / scale_normal
""",
        "(a) asks g * S to reach the smallest subnormal, 2^-24 (S = 64): float16 already rounds"
        " anything above 2^-25 up to it, so S = 32 keeps g nonzero",
    ),
    (
        _EX1,
        _EX1_CELL
        + """import math

g = 1e-9
scale_nonzero = 32
scale_normal = 2 ** math.floor(math.log2(FP16.smallest_normal / g))
largest_gradient = FP16.max / scale_normal
""",
        "(b) rounds log2 down instead of up: g * 2^15 is still a subnormal float16 number",
    ),
    (
        _EX1,
        _EX1_CELL
        + """scale_nonzero, scale_normal = 32, 2**16
largest_gradient = FP16.max
""",
        "(c) float16's max itself, not divided by S: scaled, that gradient overflows",
    ),
    (
        _EX1,
        _EX1_CELL
        + """scale_nonzero, scale_normal = 32, 2**16
largest_gradient = 2**16 / scale_normal
""",
        "(c) 2^16 / S = 1: float16's largest number is 65504, and 1 * 2^16 overflows",
    ),
    (
        _EX2,
        _EX2_CELL
        + """w_fp32 = torch.tensor(1.0)
for _ in range(100):
    w_fp32 += 2**-8
w_bf16 = w_fp32.to(torch.bfloat16)
"""
        + _NEXT_BF16,
        "the updates added in float32 and the result stored in bfloat16 once, at the end: that"
        " is a master weight, and the bfloat16 weight never lost an update",
    ),
    (
        _EX2,
        _EX2_CELL
        + """w_bf16, w_fp32 = torch.tensor(1.0, dtype=torch.bfloat16), torch.tensor(1.0)
for _ in range(100):
    w_bf16 += 2**-8
    w_fp32 += 2**-8
smallest_x = torch.finfo(torch.bfloat16).eps
""",
        "bfloat16's eps, 2^-7, as the smallest x: 1 + eps > 1, but smaller x above 2^-8 work too",
    ),
    (
        _EX2,
        _EX2_CELL
        + """w_bf16, w_fp32 = torch.tensor(1.0, dtype=torch.bfloat16), torch.tensor(1.0)
for _ in range(100):
    w_bf16 += 2**-8
    w_fp32 += 2**-8
smallest_x = torch.tensor(2**-8, dtype=torch.bfloat16)
""",
        "half of eps, 2^-8, as the smallest x: 1 + 2^-8 is a tie, and it rounds to the even"
        " neighbour, 1",
    ),
    (
        _EX2,
        _EX2_CELL
        + """w_bf16 = torch.tensor(1.0, dtype=torch.bfloat16)
w_fp32 = torch.tensor(1.0, dtype=torch.float16)
for _ in range(100):
    w_bf16 += 2**-8
    w_fp32 += 2**-8
"""
        + _NEXT_BF16,
        "the master weight kept in float16, not float32 (its value is right here, its dtype not)",
    ),
    (
        _EX3,
        _EX3_CELL
        + _EX3_SETUP
        + """scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
scales = []
for _ in range(7):
    fp16_step(model, optimizer, scaler, inputs, labels)
    scales.append(scaler.get_scale())
""",
        "the scale read after each step instead of before it",
    ),
    (
        _EX3,
        _EX3_CELL
        + _EX3_SETUP
        + """scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
scales = []
for _ in range(7):
    scales.append(scaler.get_scale())
    fp16_step(model, optimizer, scaler, inputs, labels)
""",
        "growth_interval left at its default, 2000: the scale never grows in 7 steps",
    ),
    (
        _EX3,
        _EX3_CELL + "scales = [2.0**10 * 2**t for t in range(7)]\n",
        "a guess that the scale doubles after every clean step (growth_interval 1, not 3)",
    ),
]
