"""Download GSM8K from the Hugging Face hub and write it as verl-schema parquet files.

    pip install datasets
    python examples/data_preprocess/gsm8k.py --local_dir ~/data/gsm8k

Writes ``train.parquet`` (7473 problems) and ``test.parquet`` (1319 problems) and prints their paths (use
them as data.train_files / data.val_files). Each row looks like::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "<question> <instruction to answer after ####>"}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, "question": "...", "answer": "<reference solution>"}}

``data_source`` selects the built-in GSM8K reward (fusedrl.rewards.gsm8k): 1.0 when the number after the
response's last ``####`` equals the ground truth.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Mapping
from typing import Any

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = (
    "Solve the problem step by step. On the last line, write the final answer as a plain number after "
    '"####", for example: #### 42'
)


def reference_answer(solution: str) -> str:
    """The number after the ``####`` of a GSM8K reference solution, with thousands separators removed."""
    head, marker, tail = solution.rpartition("####")
    if not marker or not tail.strip():
        raise ValueError(f"GSM8K solution has no '#### <answer>' line: {solution[-80:]!r}")
    return tail.strip().replace(",", "")


def make_rows(examples: Iterable[Mapping[str, Any]], split: str) -> list[dict[str, Any]]:
    """GSM8K records (``question``, ``answer``) to verl-schema rows."""
    rows = []
    for index, example in enumerate(examples):
        question = str(example["question"]).strip()
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": reference_answer(str(example["answer"]))},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "question": question,
                    "answer": str(example["answer"]),
                },
            }
        )
    return rows


def write_parquet(rows: list[dict[str, Any]], path: str) -> str:
    import pandas as pd

    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


def main(argv: list[str] | None = None) -> tuple[str, str]:
    parser = argparse.ArgumentParser(
        description="GSM8K (openai/gsm8k, config 'main') to verl-schema parquet."
    )
    parser.add_argument("--local_dir", default="~/data/gsm8k", help="output folder")
    parser.add_argument("--dataset", default=DATA_SOURCE, help="hub dataset id or a local copy of it")
    parser.add_argument("--train_size", type=int, default=None, help="keep only the first N train problems")
    parser.add_argument("--test_size", type=int, default=None, help="keep only the first N test problems")
    args = parser.parse_args(argv)

    import datasets  # imported here so the module imports (and its helpers work) without `datasets`

    raw = datasets.load_dataset(args.dataset, "main")
    out_dir = os.path.expanduser(args.local_dir)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for split, limit in (("train", args.train_size), ("test", args.test_size)):
        records = raw[split]
        if limit is not None:
            records = records.select(range(min(limit, len(records))))
        paths.append(write_parquet(make_rows(records, split), os.path.join(out_dir, f"{split}.parquet")))
        print(paths[-1])
    return paths[0], paths[1]


if __name__ == "__main__":
    main()
