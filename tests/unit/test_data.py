"""PromptDataset: sources, validation before the run, epochs, and resume."""
import importlib.util
import itertools
import json
import sys
import types

import pytest

from megarl.data import PromptDataset
from megarl.errors import ConfigError, InputError
from megarl.tasks.reverse_digits import make_prompt, prompt_rng, write_jsonl


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def take(ds, n):
    return list(itertools.islice(ds, n))


@pytest.fixture
def three(tmp_path):
    return write_lines(tmp_path / "p.jsonl", [
        json.dumps({"id": "a", "prompt_ids": [1, 4, 2], "meta": {"target": [4]}}),
        json.dumps({"prompt_ids": [1, 5, 6, 2]}),
        "",
        json.dumps({"id": 7, "prompt_ids": [1, 7, 2], "meta": {"k": 1}}),
    ])


def test_jsonl_ids_and_epochs(three):
    ds = PromptDataset(str(three), seed=0)
    items = take(ds, 9)
    ids = [p.prompt_id for p in items]
    # each epoch is a permutation of all prompts; ids are stable (given, else FILE:LINE)
    for e in range(3):
        assert sorted(ids[3 * e: 3 * e + 3]) == ["7", "a", "p.jsonl:2"]
    by_id = {p.prompt_id: p for p in items}
    assert by_id["a"].prompt_ids == [1, 4, 2] and by_id["a"].meta == {"target": [4]}
    assert by_id["p.jsonl:2"].meta == {}
    assert ds.size == 3


def test_shuffle_is_seeded(three):
    order = lambda seed: [p.prompt_id for p in take(PromptDataset(str(three), seed=seed), 30)]
    assert order(1) == order(1)
    assert order(1) != order(2)
    plain = [p.prompt_id for p in take(PromptDataset(str(three), shuffle=False), 6)]
    assert plain == ["a", "p.jsonl:2", "7"] * 2


def test_resume_continues_at_the_same_prompt(three):
    ds = PromptDataset(str(three), seed=5)
    take(ds, 4)  # into the second epoch
    state = json.loads(json.dumps(ds.state_dict()))  # must survive a JSON checkpoint
    expected = [p.prompt_id for p in take(ds, 7)]
    resumed = PromptDataset(str(three), seed=5)
    resumed.load_state_dict(state)
    assert [p.prompt_id for p in take(resumed, 7)] == expected


def test_resume_refuses_another_dataset(three):
    state = PromptDataset(str(three), seed=5).state_dict()
    with pytest.raises(ConfigError, match="seed"):
        PromptDataset(str(three), seed=6).load_state_dict(state)


def test_meta_is_copied_per_item(three):
    ds = PromptDataset(str(three), shuffle=False)
    first = next(ds)
    first.meta["target"].append(99)
    take(ds, 2)
    assert next(ds).meta == {"target": [4]}


def test_task_source_is_infinite_and_resumable():
    ds = PromptDataset("reverse_digits", seed=3, max_prompt_len=18)
    items = take(ds, 5)
    assert [p.prompt_id for p in items] == [f"reverse_digits/3/{i}" for i in range(5)]
    assert items[4].prompt_ids == make_prompt(prompt_rng(3, 4))[0]
    assert ds.size is None
    state = ds.state_dict()
    resumed = PromptDataset("reverse_digits", seed=3)
    resumed.load_state_dict(state)
    assert next(resumed).prompt_id == "reverse_digits/3/5" == next(ds).prompt_id


def test_task_longer_than_max_prompt_len():
    with pytest.raises(InputError, match="max_prompt_len=10"):
        PromptDataset("reverse_digits", max_prompt_len=10)


def test_jsonl_written_by_the_task(tmp_path):
    write_jsonl(tmp_path / "rd.jsonl", 4, seed=0)
    ds = PromptDataset(str(tmp_path / "rd.jsonl"), max_prompt_len=18, vocab_size=16)
    assert sorted(p.prompt_id for p in take(ds, 4)) == [f"reverse_digits/0/{i}" for i in range(4)]


@pytest.mark.parametrize("lines, match", [
    ([], r"p\.jsonl has no prompts"),
    (["", "  "], r"p\.jsonl has no prompts"),
    (['{"prompt_ids": [1, 2]}', '{"prompt_ids": [1, 2, 3, 4, 5]}'],
     r"p\.jsonl:2: prompt has 5 tokens, longer than max_prompt_len=4"),
    (['{"prompt_ids": [1, 2]}', '{"prompt_ids": [1, 2'], r"p\.jsonl:2: invalid JSON"),
    (['{"meta": {}}'], r"p\.jsonl:1: expected an object with 'prompt_ids'"),
    (['{"prompt_ids": []}'], r"p\.jsonl:1: 'prompt_ids' must be a non-empty list"),
    (['{"prompt_ids": [1, "x"]}'], r"p\.jsonl:1: 'prompt_ids' must be"),
    (['{"prompt_ids": [1], "meta": [1]}'], r"p\.jsonl:1: 'meta' must be an object"),
    (['{"prompt_ids": [1, 16]}'], r"p\.jsonl:1: token ids \[16\] outside the vocabulary"),
    (['{"id": "x", "prompt_ids": [1]}', '{"id": "x", "prompt_ids": [2]}'], r"p\.jsonl:2: duplicate id 'x'"),
])
def test_jsonl_validation(tmp_path, lines, match):
    path = write_lines(tmp_path / "p.jsonl", lines)
    with pytest.raises(InputError, match=match):
        PromptDataset(str(path), max_prompt_len=4, vocab_size=16)


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        PromptDataset(str(tmp_path / "nope.jsonl"))


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed")
def test_hf_without_datasets_package():
    with pytest.raises(ConfigError, match="pip install datasets"):
        PromptDataset("hf:someone/prompts")


def test_hf_source_with_a_stand_in_package(monkeypatch):
    # a stand-in for `datasets`: load_dataset returns rows, as a Dataset iterates
    calls = []

    def load_dataset(name, split):
        calls.append((name, split))
        return [{"prompt_ids": [1, 4, 2], "meta": {"target": [4]}}, {"prompt_ids": [1, 5, 2], "id": "x"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    ds = PromptDataset("hf:someone/prompts:test", shuffle=False)
    assert calls == [("someone/prompts", "test")]
    assert [p.prompt_id for p in take(ds, 2)] == ["someone/prompts:test:0", "x"]
    with pytest.raises(InputError, match="train row 0: prompt has 3 tokens"):
        PromptDataset("hf:someone/prompts", max_prompt_len=2)


def test_from_config(three):
    from megarl.config.schema import DataConfig

    task = PromptDataset.from_config(DataConfig(), seed=4)
    assert next(task).prompt_id == "reverse_digits/4/0"
    jsonl = PromptDataset.from_config(DataConfig(path=str(three), max_prompt_len=4))
    assert (jsonl.source, jsonl.size) == (str(three), 3)
    with pytest.raises(InputError, match="max_prompt_len=3"):
        PromptDataset.from_config(DataConfig(path=str(three), max_prompt_len=3))
    with pytest.raises(ConfigError, match="both set"):
        PromptDataset.from_config(DataConfig(path=str(three), hf_dataset="x/y"))
