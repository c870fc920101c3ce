"""Synthetic integer-arithmetic prompts in the verl parquet schema.

Each problem is ``a <op> b`` with small non-negative operands; the answer is an integer (possibly negative
for ``-``). Rows look like::

    {"data_source": "arithmetic",
     "prompt": [{"role": "user", "content": "What is 23 + 45? Answer with the number."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "68"},
     "extra_info": {"split": "train", "index": 0, "a": 23, "b": 45, "op": "+"}}

Problems are drawn without replacement from one seeded random stream, so the first ``n`` problems for a
seed never depend on how many more are drawn after them. `write_arithmetic_parquet` uses that to give the
train split the first problems and the test split the following ones: the two splits never share a prompt,
and the train split equals ``make_arithmetic_rows(n_train, seed)``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence

DATA_SOURCE = "arithmetic"
SUPPORTED_OPS = ("+", "-", "*")
PROMPT_TEMPLATE = "What is {a} {op} {b}? Answer with the number."


def _operand_range(digits: int) -> tuple[int, int]:
    """Inclusive range of integers with exactly ``digits`` decimal digits (0 counts as one digit)."""
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return low, 10**digits - 1


def _check_args(min_digits: int, max_digits: int, ops: Sequence[str]) -> None:
    if not (isinstance(min_digits, int) and isinstance(max_digits, int)) or min_digits < 1:
        raise ValueError(f"min_digits must be an integer >= 1, got {min_digits!r}")
    if max_digits < min_digits:
        raise ValueError(f"max_digits ({max_digits}) must be >= min_digits ({min_digits})")
    if not ops:
        raise ValueError(f"ops must name at least one of {SUPPORTED_OPS}")
    bad = [op for op in ops if op not in SUPPORTED_OPS]
    if bad:
        raise ValueError(f"unsupported ops {bad}; choose from {SUPPORTED_OPS}")


def _num_distinct_problems(min_digits: int, max_digits: int, ops: Sequence[str]) -> int:
    low, _ = _operand_range(min_digits)
    _, high = _operand_range(max_digits)
    return (high - low + 1) ** 2 * len(set(ops))


def _solve(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


def _problem_stream(seed: int, min_digits: int, max_digits: int, ops: Sequence[str]) -> Iterator[tuple]:
    """Distinct ``(a, op, b)`` triples in a fixed order for ``seed``; each operand's digit count is uniform."""
    rng = random.Random(seed)
    ops = tuple(dict.fromkeys(ops))  # de-duplicate, keep order
    seen: set[tuple[int, str, int]] = set()
    while True:
        da = rng.randint(min_digits, max_digits)
        db = rng.randint(min_digits, max_digits)
        a = rng.randint(*_operand_range(da))
        b = rng.randint(*_operand_range(db))
        op = ops[rng.randrange(len(ops))]
        key = (a, op, b)
        if key not in seen:
            seen.add(key)
            yield key


def _draw_problems(n: int, seed: int, min_digits: int, max_digits: int, ops: Sequence[str]) -> list[tuple]:
    _check_args(min_digits, max_digits, ops)
    if n < 0:
        raise ValueError(f"number of rows must be >= 0, got {n}")
    space = _num_distinct_problems(min_digits, max_digits, ops)
    if n > space:
        raise ValueError(
            f"asked for {n} distinct problems but only {space} exist with digits {min_digits}..{max_digits} "
            f"and ops {tuple(ops)}; increase max_digits or add ops"
        )
    stream = _problem_stream(seed, min_digits, max_digits, ops)
    return [next(stream) for _ in range(n)]


def _to_row(problem: tuple[int, str, int], split: str, index: int) -> dict:
    a, op, b = problem
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": PROMPT_TEMPLATE.format(a=a, op=op, b=b)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(_solve(a, op, b))},
        "extra_info": {"split": split, "index": index, "a": a, "b": b, "op": op},
    }


def make_arithmetic_rows(
    n: int,
    seed: int,
    min_digits: int = 1,
    max_digits: int = 2,
    ops: Sequence[str] = ("+", "-"),
    split: str = "train",
) -> list[dict]:
    """``n`` distinct arithmetic problems as verl-schema rows; the same arguments give the same rows."""
    problems = _draw_problems(n, seed, min_digits, max_digits, ops)
    return [_to_row(p, split, i) for i, p in enumerate(problems)]


def write_arithmetic_parquet(
    out_dir: str | os.PathLike,
    n_train: int,
    n_test: int,
    seed: int,
    min_digits: int = 1,
    max_digits: int = 2,
    ops: Sequence[str] = ("+", "-"),
) -> tuple[str, str]:
    """Write ``train.parquet`` and ``test.parquet`` (disjoint prompts) to ``out_dir``; return their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    problems = _draw_problems(n_train + n_test, seed, min_digits, max_digits, ops)
    splits = {
        "train": [_to_row(p, "train", i) for i, p in enumerate(problems[:n_train])],
        "test": [_to_row(p, "test", i) for i, p in enumerate(problems[n_train:])],
    }
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for split, rows in splits.items():
        path = os.path.join(out_dir, f"{split}.parquet")
        # An explicit schema keeps the column types stable even for an empty split.
        pq.write_table(pa.Table.from_pylist(rows, schema=_parquet_schema()), path)
        paths.append(path)
    return paths[0], paths[1]


def _parquet_schema():
    """Column types of the written files (built lazily: importing this module needs no pyarrow)."""
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(message)),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            (
                "extra_info",
                pa.struct(
                    [
                        ("split", pa.string()),
                        ("index", pa.int64()),
                        ("a", pa.int64()),
                        ("b", pa.int64()),
                        ("op", pa.string()),
                    ]
                ),
            ),
        ]
    )
