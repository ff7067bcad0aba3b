"""reverse_digits task: row format, length distribution, and hand-computed rewards on decoded text.

Answer of prompt "123" is "321"; r = 0.75 * pos + 0.25 * len (see the module docstring),
len counts only when the response ended on a stop token (finish_reason "stop").
"""
import json
import random
import statistics

import pytest

from megarl.tasks import main
from megarl.tasks.reverse_digits import OPTIONS, make_row, reward, write_jsonl


@pytest.mark.parametrize("response, finish, expected", [
    # perfect: pos 3/3, len 1 - 0/3 -> 0.75 + 0.25
    ("321", "stop", 1.0),
    # right digits but it ran out of tokens: pos 1, len 0 -> 0.75
    ("321", "length", 0.75),
    # too long by 2: pos 3/max(5,3) = 0.6, len 1 - 2/3 = 1/3 -> 0.45 + 1/12
    ("32100", "stop", 0.45 + 1 / 12),
    # far too long: pos 3/7, len max(0, 1 - 4/3) = 0 -> 0.75 * 3/7
    ("3210000", "stop", 0.75 * 3 / 7),
    # too short, one wrong: pos 1/3, len 1 - 1/3 -> 0.25 + 1/6
    ("39", "stop", 0.25 + 1 / 6),
    # empty answer: pos 0/3, len 1 - 3/3 = 0
    ("", "stop", 0.0),
    # a non-digit character counts as a wrong position: pos 2/3, len 1 -> 0.5 + 0.25
    ("3\n1", "stop", 0.75),
])
def test_reward_hand_computed(response, finish, expected):
    assert reward(response, "321", finish_reason=finish) == pytest.approx(expected, abs=1e-12)


def test_reward_rejects_empty_answer():
    with pytest.raises(ValueError):
        reward("1", "")


def test_row_format():
    for i in range(200):
        row = make_row(random.Random(i))
        assert row["prompt"].isdigit() and 1 <= len(row["prompt"]) <= 16
        assert row["answer"] == row["prompt"][::-1]


def test_length_distribution_is_long_tailed():
    # n = 1 + floor(Exp(mean 3)) truncated at 16: mean ~3.5, ~10% have n >= 8
    rng = random.Random(123)
    lengths = [len(make_row(rng)["prompt"]) for _ in range(20000)]
    assert 3.3 < statistics.mean(lengths) < 3.7
    assert 0.08 < sum(n >= 8 for n in lengths) / len(lengths) < 0.12
    assert max(lengths) == 16


def test_write_jsonl_is_reproducible_per_index(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", 5, seed=3)
    write_jsonl(tmp_path / "b.jsonl", 3, seed=3)
    a = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert a[:3] == b and len({r["id"] for r in a}) == 5
    assert reward(a[0]["answer"], a[0]["answer"]) == 1.0


def test_length_parameters_shape_the_distribution():
    # n = 1 + floor(Exp(mean 1)) redrawn until n <= 4: P(n = 1) = (1 - e^-1) / (1 - e^-4) = 0.6439
    rng = random.Random(7)
    lengths = [len(make_row(rng, mean_extra=1.0, max_digits=4)["prompt"]) for _ in range(20000)]
    assert max(lengths) == 4
    assert 0.63 < lengths.count(1) / len(lengths) < 0.66


@pytest.mark.parametrize("mean_extra, max_digits", [(0.0, 8), (1.0, 0)])
def test_length_parameters_are_checked(mean_extra, max_digits):
    with pytest.raises(ValueError, match="mean_extra > 0 and max_digits >= 1"):
        make_row(random.Random(0), mean_extra=mean_extra, max_digits=max_digits)


def test_cli_writes_the_length_parameters(tmp_path):
    out = tmp_path / "rows.jsonl"
    main("reverse_digits", make_row, "test", [str(out), "--n", "50", "--seed", "2", "--mean-extra", "1.5",
                                               "--max-digits", "3"], options=OPTIONS)
    write_jsonl(tmp_path / "same.jsonl", 50, seed=2, mean_extra=1.5, max_digits=3)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert out.read_text() == (tmp_path / "same.jsonl").read_text()
    assert max(len(r["prompt"]) for r in rows) == 3 and rows[0]["id"] == "reverse_digits/2/0"
