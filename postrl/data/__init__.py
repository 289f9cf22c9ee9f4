"""Datasets in verl's parquet schema, synthetic tasks and converters."""

from postrl.data.dataset import DatasetError, PromptLoader, RLDataset, load_tokenizer, validate_row
from postrl.data.tasks import (
    TASKS,
    convert_gsm8k,
    generate_addition,
    generate_countdown,
    preference_pairs,
    read_rows,
    sft_rows_from_rl_rows,
    write_parquet,
)

__all__ = [
    "TASKS",
    "DatasetError",
    "PromptLoader",
    "RLDataset",
    "convert_gsm8k",
    "generate_addition",
    "generate_countdown",
    "load_tokenizer",
    "preference_pairs",
    "read_rows",
    "sft_rows_from_rl_rows",
    "validate_row",
    "write_parquet",
]
