"""reverse_digits task: prompt format, length distribution, and hand-computed rewards.

Digit d is token 4 + d; D(...) spells a digit string. Target of prompt "123" is
"321" (tgt, 3 tokens); r = 0.75 * pos + 0.25 * len (see the module docstring).
"""
import json
import random
import statistics

import pytest

from megarl.tasks import get_task
from megarl.tasks.reverse_digits import (BOS, EOS, MAX_PROMPT_LEN, SEP, make_prompt, prompt_rng, reward,
                                         write_jsonl)


def D(s: str) -> list[int]:
    return [4 + int(c) for c in s]


META = {"target": D("321")}  # prompt BOS 1 2 3 SEP


@pytest.mark.parametrize("response, expected", [
    # perfect: pos 3/3, len 1 - 0/3 -> 0.75 + 0.25
    (D("321") + [EOS], 1.0),
    # right digits but no EOS: pos 1, len 0 -> 0.75
    (D("321"), 0.75),
    # too long by 2: pos 3/max(5,3) = 0.6, len 1 - 2/3 = 1/3 -> 0.45 + 1/12
    (D("32100") + [EOS], 0.45 + 1 / 12),
    # far too long: pos 3/7, len max(0, 1 - 4/3) = 0 -> 0.75 * 3/7
    (D("3210000") + [EOS], 0.75 * 3 / 7),
    # too short, one wrong: pos 1/3, len 1 - 1/3 -> 0.25 + 1/6
    (D("39") + [EOS], 0.25 + 1 / 6),
    # empty output: pos 0/3, len 1 - 3/3 = 0
    ([EOS], 0.0),
    # nothing at all
    ([], 0.0),
    # tokens after the first EOS are ignored
    (D("321") + [EOS] + D("5") + [EOS], 1.0),
    # a non-digit token counts as a wrong position: pos 2/3, len 1 -> 0.5 + 0.25
    ([4 + 3, SEP, 4 + 1, EOS], 0.75),
])
def test_reward_hand_computed(response, expected):
    assert reward(response, META) == pytest.approx(expected, abs=1e-12)


def test_reward_rejects_empty_target():
    with pytest.raises(ValueError):
        reward([EOS], {"target": []})


def test_make_prompt_format():
    for i in range(200):
        prompt, meta = make_prompt(prompt_rng(0, i))
        assert prompt[0] == BOS and prompt[-1] == SEP
        digits = prompt[1:-1]
        assert 1 <= len(digits) <= 16 and all(4 <= t <= 13 for t in digits)
        assert meta["target"] == digits[::-1]
        assert len(prompt) <= MAX_PROMPT_LEN


def test_length_distribution_is_long_tailed():
    # n = 1 + floor(Exp(mean 3)) truncated at 16: mean ~3.5, ~10% have n >= 8
    rng = random.Random(123)
    lengths = [len(make_prompt(rng)[0]) - 2 for _ in range(20000)]
    assert 3.3 < statistics.mean(lengths) < 3.7
    assert 0.08 < sum(n >= 8 for n in lengths) / len(lengths) < 0.12
    assert max(lengths) == 16


def test_prompts_are_reproducible_per_index():
    assert make_prompt(prompt_rng(7, 42)) == make_prompt(prompt_rng(7, 42))
    assert make_prompt(prompt_rng(7, 42)) != make_prompt(prompt_rng(8, 42))


def test_write_jsonl(tmp_path):
    path = tmp_path / "rd.jsonl"
    write_jsonl(path, 5, seed=3)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 5
    assert rows[2]["prompt_ids"] == make_prompt(prompt_rng(3, 2))[0]
    assert len({r["id"] for r in rows}) == 5
    assert reward(rows[0]["meta"]["target"] + [EOS], rows[0]["meta"]) == 1.0


def test_task_registry():
    assert get_task("reverse_digits").reward is reward
