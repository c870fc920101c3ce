"""Download a MATH dataset from the Hugging Face hub and write it as verl-schema parquet files.

    pip install datasets math-verify
    python examples/data_preprocess/math_dataset.py --local_dir ~/data/math

By default the train split comes from ``DigitalLearningGmbH/MATH-lighteval`` (7500 competition problems)
and the test split from ``HuggingFaceH4/MATH-500`` (the usual 500-problem evaluation subset); pass
``--test_dataset DigitalLearningGmbH/MATH-lighteval`` for the full 5000-problem test split. Prints the
train and test paths (use them as data.train_files / data.val_files). Each row looks like::

    {"data_source": "DigitalLearningGmbH/MATH-lighteval",
     "prompt": [{"role": "user", "content": "<problem> <instruction to box the final answer>"}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "\\frac{1}{2}"},
     "extra_info": {"split": "train", "index": 0, "level": "Level 3", "type": "Algebra"}}

``data_source`` selects the built-in MATH reward (fusedrl.rewards.math_boxed, needs ``math-verify``): 1.0
when the response's last ``\\boxed{...}`` is equivalent to the ground truth. The ground truth is the
dataset's ``answer`` column where it has one, else the last ``\\boxed{...}`` of the reference solution.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Mapping
from typing import Any

TRAIN_DATASET = "DigitalLearningGmbH/MATH-lighteval"
TEST_DATASET = "HuggingFaceH4/MATH-500"
INSTRUCTION = "Reason step by step, and put your final answer within \\boxed{}."


def ground_truth(example: Mapping[str, Any]) -> str:
    """The reference answer of one record: its ``answer`` field, or the solution's last box."""
    from fusedrl.rewards.math_boxed import last_boxed

    answer = example.get("answer")
    if answer is not None and str(answer).strip():
        return str(answer).strip()
    boxed = last_boxed(str(example.get("solution", "")))
    if boxed is None:
        raise ValueError(f"MATH record has neither an answer nor a \\boxed{{}} solution: {example!r:.200}")
    return boxed.strip()


def make_rows(examples: Iterable[Mapping[str, Any]], split: str, data_source: str) -> list[dict[str, Any]]:
    """MATH records (``problem``, ``solution`` and/or ``answer``) to verl-schema rows."""
    rows = []
    for index, example in enumerate(examples):
        problem = str(example["problem"]).strip()
        rows.append(
            {
                "data_source": data_source,
                "prompt": [{"role": "user", "content": f"{problem} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": ground_truth(example)},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "level": str(example.get("level", "")),
                    "type": str(example.get("type", example.get("subject", ""))),
                },
            }
        )
    return rows


def write_parquet(rows: list[dict[str, Any]], path: str) -> str:
    import pandas as pd

    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


def main(argv: list[str] | None = None) -> tuple[str, str]:
    parser = argparse.ArgumentParser(description="A MATH dataset to verl-schema parquet (train + test).")
    parser.add_argument("--local_dir", default="~/data/math", help="output folder")
    parser.add_argument("--dataset", default=TRAIN_DATASET, help="hub dataset id of the train split")
    parser.add_argument("--test_dataset", default=TEST_DATASET, help="hub dataset id of the test split")
    parser.add_argument("--train_size", type=int, default=None, help="keep only the first N train problems")
    parser.add_argument("--test_size", type=int, default=None, help="keep only the first N test problems")
    args = parser.parse_args(argv)

    import datasets  # imported here so the module imports (and its helpers work) without `datasets`

    out_dir = os.path.expanduser(args.local_dir)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for split, name, limit in (
        ("train", args.dataset, args.train_size),
        ("test", args.test_dataset, args.test_size),
    ):
        records = datasets.load_dataset(name, split=split)
        if limit is not None:
            records = records.select(range(min(limit, len(records))))
        paths.append(
            write_parquet(make_rows(records, split, name), os.path.join(out_dir, f"{split}.parquet"))
        )
        print(paths[-1])
    return paths[0], paths[1]


if __name__ == "__main__":
    main()
