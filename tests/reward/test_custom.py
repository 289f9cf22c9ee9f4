"""Loading a user's reward function from a .py file by path."""

from __future__ import annotations

import pytest

from postrl.reward import CustomRewardError, load_custom_reward_fn


def test_load_and_call(tmp_path):
    f = tmp_path / "r.py"
    f.write_text(
        "def compute_score(ds, s, gt, extra_info=None):\n    return float(s == gt)\nX = 3\n"
    )
    fn = load_custom_reward_fn(f, "compute_score")
    assert fn("d", "a", "a") == 1.0 and fn("d", "a", "b") == 0.0
    assert load_custom_reward_fn(str(f)) is fn  # cached; default name is compute_score


def test_missing_file_names_path(tmp_path):
    with pytest.raises(CustomRewardError, match=r"not found .*nope\.py.*name='compute_score'"):
        load_custom_reward_fn(tmp_path / "nope.py")


def test_missing_name_lists_callables(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("def score_a(*a):\n    return 1.0\n")
    with pytest.raises(CustomRewardError, match=r"defines no 'compute_score'.*score_a"):
        load_custom_reward_fn(f)


def test_not_callable(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("compute_score = 3\n")
    with pytest.raises(CustomRewardError, match="is a int, not a function"):
        load_custom_reward_fn(f)


def test_import_error_is_wrapped(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("raise RuntimeError('bad module')\n")
    with pytest.raises(CustomRewardError, match=r"importing .* failed .*RuntimeError: bad module"):
        load_custom_reward_fn(f)


def test_worker_side_imports_stay_light():
    """Spawned reward workers import postrl.reward._worker: it must not pull torch in."""
    import subprocess
    import sys

    code = (
        "import sys, postrl.reward, postrl.reward._worker, postrl.reward.registry;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
