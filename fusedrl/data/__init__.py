"""Prompt data: verl-schema parquet datasets, collation into `RolloutBatch`, synthetic tasks."""

from fusedrl.data.arithmetic import make_arithmetic_rows, write_arithmetic_parquet
from fusedrl.data.dataset import DataError, PromptLoader, RLDataset, collate

__all__ = [
    "DataError",
    "PromptLoader",
    "RLDataset",
    "collate",
    "make_arithmetic_rows",
    "write_arithmetic_parquet",
]
