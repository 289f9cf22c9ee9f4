import pytest

from postrl.data import (
    DatasetError,
    PromptLoader,
    RLDataset,
    convert_gsm8k,
    generate_addition,
    generate_countdown,
    load_tokenizer,
    write_parquet,
)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_generators_deterministic_and_splits_disjoint():
    a1, a2 = generate_addition(50, seed=1), generate_addition(50, seed=1)
    assert a1 == a2
    test = generate_addition(50, seed=1, split="test")
    train_q = {r["prompt"][0]["content"] for r in generate_addition(500, seed=1)}
    assert not train_q & {r["prompt"][0]["content"] for r in test}
    for r in generate_countdown(20, seed=0):
        gt = r["reward_model"]["ground_truth"]
        assert eval(r["extra_info"]["solution"]) == gt["target"]  # the reference solves it


def test_dataset_tokenizes_with_chat_template(tmp_path, tok):
    p = write_parquet(generate_addition(10, seed=0), tmp_path / "a.parquet")
    ds = RLDataset([str(p)], tok, max_prompt_length=64)
    text = tok.decode(ds.prompt_ids[0])
    assert text.startswith("<|im_start|>user\nWhat is") and text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda r: r.pop("data_source"), "data_source"),
        (lambda r: r.update(prompt=[]), "prompt"),
        (lambda r: r.update(prompt=[{"role": "user", "content": "  "}]), "empty"),
        (lambda r: r.update(prompt=[{"role": "robot", "content": "x"}]), "role"),
        (lambda r: r.update(reward_model={"style": "rule"}), "ground_truth"),
        (lambda r: r.update(data_source=3), "data_source"),
    ],
)
def test_malformed_row_names_row_and_field(tmp_path, tok, mutate, field):
    rows = generate_addition(5, seed=0)
    mutate(rows[3])
    p = tmp_path / "bad.jsonl"
    import json

    p.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DatasetError) as e:
        RLDataset([str(p)], tok)
    assert "row 3" in str(e.value) and field in str(e.value)


def test_overlong_prompts_error_or_filter(tmp_path, tok):
    rows = generate_addition(6, seed=0)
    rows[2]["prompt"][0]["content"] = "x" * 500
    p = write_parquet(rows, tmp_path / "a.parquet")
    with pytest.raises(DatasetError, match="row 2.*max_prompt_length"):
        RLDataset([str(p)], tok, max_prompt_length=64)
    ds = RLDataset([str(p)], tok, max_prompt_length=64, truncation="filter")
    assert len(ds) == 5 and ds.num_filtered == 1


def test_loader_resume_is_exact(tmp_path, tok):
    p = write_parquet(generate_addition(30, seed=0), tmp_path / "a.parquet")
    ds = RLDataset([str(p)], tok)
    full = PromptLoader(ds, 4, seed=7)
    seen = [full.next_batch().non_tensor_batch["index"].tolist() for _ in range(12)]
    part = PromptLoader(ds, 4, seed=7)
    for _ in range(5):
        part.next_batch()
    resumed = PromptLoader(ds, 4, seed=7)
    resumed.load_state_dict(part.state_dict())
    assert [resumed.next_batch().non_tensor_batch["index"].tolist() for _ in range(7)] == seen[5:]
    # within an epoch no prompt repeats
    epoch0 = [i for b in seen[:7] for i in b]
    assert len(set(epoch0)) == len(epoch0) == 28


def test_gsm8k_converter(tmp_path):
    import json

    src = tmp_path / "g.jsonl"
    src.write_text(
        json.dumps({"question": "2 apples and 3 more?", "answer": "2+3=5\n#### 1,005"}) + "\n"
    )
    rows = convert_gsm8k(src)
    assert rows[0]["reward_model"]["ground_truth"] == "1005" and rows[0]["data_source"] == "gsm8k"
    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps({"answer": "x"}) + "\n")
    with pytest.raises(ValueError, match="row 0.*question"):
        convert_gsm8k(bad)


def test_a_draw_off_the_batch_grid_goes_on_into_the_next_epoch(tmp_path, tok):
    """Refills draw single prompts, so a batch can start off the grid of ``batch_size``: at the
    epoch's end it takes the epoch's rest and then the next epoch's first prompts (each row with
    its own epoch). From a position on the grid the trailing partial batch is skipped as before.
    (Regression: the rest was skipped there too — prompts of an epoch never trained.)"""
    p = write_parquet(generate_addition(16, seed=0), tmp_path / "a.parquet")
    ds = RLDataset([str(p)], tok)
    loader = PromptLoader(ds, 4, seed=7)
    order0, order1 = loader._order(0).tolist(), loader._order(1).tolist()
    drawn = [loader.next_batch() for _ in range(3)] + [loader.next_prompts(1)]  # 13 of 16
    cross = loader.next_batch()
    assert cross.non_tensor_batch["index"].tolist() == order0[13:] + order1[:1]
    assert cross.meta_info["epochs"] == [0, 0, 0, 1] and cross.meta_info["epoch"] == 1
    assert (loader.epoch, loader.position) == (1, 1)
    epoch0 = [i for b in drawn + [cross] for i in b.non_tensor_batch["index"].tolist()][:16]
    assert sorted(epoch0) == list(range(16))  # every prompt of epoch 0, once
    # on the grid: 18 prompts, batches of 4, the last 2 of each epoch skipped (drop-last)
    p18 = write_parquet(generate_addition(18, seed=0), tmp_path / "b.parquet")
    grid = PromptLoader(RLDataset([str(p18)], tok), 4, seed=7)
    for _ in range(4):
        grid.next_batch()
    nxt = grid.next_batch()
    assert nxt.meta_info["epochs"] == [1] * 4
    assert nxt.non_tensor_batch["index"].tolist() == grid._order(1).tolist()[:4]
    assert grid.dropped_per_epoch == 2
