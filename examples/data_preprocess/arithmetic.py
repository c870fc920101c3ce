"""Write the synthetic arithmetic task as verl-schema parquet files.

    python examples/data_preprocess/arithmetic.py --local_dir ~/data/arithmetic --train_size 5000 --test_size 500

Prints the train and test file paths (use them as data.train_files / data.val_files).
"""

from __future__ import annotations

import argparse
import os

from fusedrl.data.arithmetic import write_arithmetic_parquet


def main(argv: list[str] | None = None) -> tuple[str, str]:
    parser = argparse.ArgumentParser(description="Generate the synthetic arithmetic RL dataset (parquet).")
    parser.add_argument("--local_dir", default="~/data/arithmetic", help="output folder")
    parser.add_argument("--train_size", type=int, default=5000)
    parser.add_argument("--test_size", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min_digits", type=int, default=1)
    parser.add_argument("--max_digits", type=int, default=2)
    parser.add_argument("--ops", default="+-", help="operators to use, from '+-*' (default '+-')")
    args = parser.parse_args(argv)

    train_path, test_path = write_arithmetic_parquet(
        os.path.expanduser(args.local_dir),
        n_train=args.train_size,
        n_test=args.test_size,
        seed=args.seed,
        min_digits=args.min_digits,
        max_digits=args.max_digits,
        ops=tuple(args.ops),
    )
    print(train_path)
    print(test_path)
    return train_path, test_path


if __name__ == "__main__":
    main()
