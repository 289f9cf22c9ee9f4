"""``make quickstart``: tiny model → addition data → a batch (extended to SFT + GRPO as the trainer lands)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run-dir", default="runs/quickstart")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    log = logging.getLogger("quickstart")
    run = Path(args.run_dir)
    from postrl.data import (
        PromptLoader,
        RLDataset,
        generate_addition,
        load_tokenizer,
        write_parquet,
    )
    from postrl.testing import make_model

    model_dir = make_model(run / "tiny-model", preset="tiny", arch="qwen2", seed=0)
    log.info("1/3 tiny model written to %s", model_dir)
    train = write_parquet(generate_addition(2000, seed=0, split="train"), run / "data/addition_train.parquet")
    test = write_parquet(generate_addition(200, seed=0, split="test"), run / "data/addition_test.parquet")
    log.info("2/3 addition data: %s, %s", train, test)
    tok = load_tokenizer(model_dir)
    loader = PromptLoader(RLDataset([str(train)], tok, max_prompt_length=64), batch_size=4, seed=0)
    batch = loader.next_batch()
    log.info("3/3 first batch: %s", batch)
    for ids, gt in zip(batch.non_tensor_batch["raw_prompt_ids"], batch.non_tensor_batch["ground_truth"]):
        sys.stdout.write(f"  {tok.decode(ids)!r} -> {gt}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
