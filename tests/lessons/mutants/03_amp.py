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
    (
        "# Check: exercise 1 -- the smallest scales that keep g = 1e-9 nonzero and normal in"
        " float16,",
        "scale_nonzero, scale_normal, largest_gradient = 32, 2**15, 65504 / 2**15",
        "(b) one power of two too small: g * 2^15 is still a subnormal float16 number",
    ),
    (
        "# Check: exercise 2 -- the bfloat16 weight lost every update, the float32 one kept them"
        " all,",
        "w_bf16, w_fp32 = torch.tensor(1.0, dtype=torch.bfloat16), torch.tensor(1 + 100 / 256)\n"
        "smallest_x = torch.finfo(torch.bfloat16).eps",
        "bfloat16's eps, 2^-7, as the smallest x: 1 + eps > 1, but smaller x above 2^-8 work too",
    ),
    (
        "# Check: exercise 3 -- from 2^10, with no overflow, the scale doubles after every 3 clean"
        " steps",
        "scales = [2.0**10, 2.0**10, 2.0**11, 2.0**11, 2.0**11, 2.0**12, 2.0**12]",
        "the scale read after each step instead of before it",
    ),
]
