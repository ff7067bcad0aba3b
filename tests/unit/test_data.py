"""PromptDataset: text rows through a real HF tokenizer and its chat template, validation, epochs, resume."""
import itertools
import json

import pytest
from conftest import chat_prompt, digits, run_tokenizer

from megarl.config.schema import DataConfig
from megarl.data import PromptDataset, get_dotted
from megarl.errors import ConfigError, InputError
from megarl.tasks.reverse_digits import write_jsonl


def write_lines(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def take(ds, n):
    return list(itertools.islice(ds, n))


@pytest.fixture
def three(tmp_path):
    return write_lines(tmp_path / "p.jsonl", [
        {"id": "a", "prompt": "12", "answer": "21", "level": 3},
        {"prompt": [{"role": "user", "content": "345"}], "answer": "543"},
        "",
        {"id": 7, "prompt_ids": [1, 7, 2], "answer": "x"},
    ])


def test_text_chat_and_pretokenized_rows(three, demo_tokenizer):
    ds = PromptDataset(str(three), demo_tokenizer, shuffle=False)
    a, b, c = take(ds, 3)
    # a string becomes one user message of the chat template; what the ids decode to is the rendering
    assert a.prompt_ids == chat_prompt("12")
    assert demo_tokenizer.decode_prompt(a.prompt_ids) == demo_tokenizer.render("12") == \
        "<|im_start|>user\n12<|im_end|>\n<|im_start|>assistant\n"
    assert (a.prompt_id, a.answer, a.row) == ("a", "21", {"id": "a", "prompt": "12", "answer": "21", "level": 3})
    assert b.prompt_ids == chat_prompt("345") and b.prompt_id == "p.jsonl:2" and b.answer == "543"
    assert c.prompt_ids == [1, 7, 2] and c.prompt_id == "7"
    assert ds.size == 3


def test_chat_template_kwargs_reach_the_template(tmp_path, demo_tokenizer_dir):
    # a template that shows a kwarg, as Qwen3's enable_thinking does
    from transformers import AutoTokenizer

    tok_dir = tmp_path / "tok"
    hf = AutoTokenizer.from_pretrained(str(demo_tokenizer_dir))
    hf.chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                        "{% if flag is defined and flag %}{{ '\n' }}{% endif %}")
    hf.save_pretrained(str(tok_dir))
    with_flag = run_tokenizer(tok_dir, chat_template_kwargs={"flag": True})
    without = run_tokenizer(tok_dir)
    assert with_flag.render("12") == "12\n" and without.render("12") == "12"


def test_apply_chat_template_modes(three, demo_tokenizer_dir):
    off = run_tokenizer(demo_tokenizer_dir, apply_chat_template=False)
    assert off.render("12") == "12"
    ds = PromptDataset(str(write_lines(three.parent / "s.jsonl", [{"prompt": "12", "answer": "21"}])), off)
    assert next(ds).prompt_ids == digits("12")
    with pytest.raises(InputError, match="list of chat messages but no chat template"):
        PromptDataset(str(three), off)


def test_nested_keys_as_in_verl_parquet(tmp_path, demo_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "user", "content": "12"}], "data_source": "digits",
             "reward_model": {"style": "rule", "ground_truth": "21"}, "extra_info": {"index": 0}}]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    ds = PromptDataset(str(path), demo_tokenizer, answer_key="reward_model.ground_truth")
    p = next(ds)
    assert p.prompt_ids == chat_prompt("12") and p.answer == "21"
    assert p.row["data_source"] == "digits" and p.row["extra_info"] == {"index": 0}
    assert get_dotted({"a.b": 1, "a": {"b": 2}}, "a.b") == 1  # a literal dotted key wins


def test_hf_datasets_source_from_a_local_directory(tmp_path, demo_tokenizer):
    data = tmp_path / "ds"
    data.mkdir()
    write_lines(data / "test.jsonl", [{"prompt": "12", "answer": "21"}, {"prompt": "3", "answer": "3"}])
    ds = PromptDataset(f"hf:{data}:test", demo_tokenizer, shuffle=False)
    assert [p.prompt_ids for p in take(ds, 2)] == [chat_prompt("12"), chat_prompt("3")]
    assert next(ds).prompt_id == f"hf:{data}:test:0"


def test_overlong_prompts_are_filtered_with_a_count(tmp_path, demo_tokenizer, caplog):
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "1", "answer": "1"}, {"prompt": "123456", "answer": "x"}])
    # "1" renders to 9 tokens, "123456" to 14 (8 template tokens)
    ds = PromptDataset(str(path), demo_tokenizer, max_prompt_len=12)
    assert ds.size == 1 and ds.n_filtered == 1
    assert "1 of 2 prompts are longer than data.max_prompt_len=12" in caplog.text
    with pytest.raises(InputError, match=r"p\.jsonl:2: prompt has 14 tokens, longer than data.max_prompt_len=12"):
        PromptDataset(str(path), demo_tokenizer, max_prompt_len=12, on_overlong="error")
    with pytest.raises(InputError, match=r"every prompt of .* \(2\) is longer than data.max_prompt_len=5 tokens "
                                         r"\(the longest has 14\)"):
        PromptDataset(str(path), demo_tokenizer, max_prompt_len=5)


def test_shuffle_is_seeded(three, demo_tokenizer):
    def order(seed):
        return [p.prompt_id for p in take(PromptDataset(str(three), demo_tokenizer, seed=seed), 30)]

    assert order(1) == order(1)
    assert order(1) != order(2)
    plain = [p.prompt_id for p in take(PromptDataset(str(three), demo_tokenizer, shuffle=False), 6)]
    assert plain == ["a", "p.jsonl:2", "7"] * 2


def test_resume_continues_at_the_same_prompt(three, demo_tokenizer):
    ds = PromptDataset(str(three), demo_tokenizer, seed=5)
    take(ds, 4)  # into the second epoch
    state = json.loads(json.dumps(ds.state_dict()))  # must survive a JSON checkpoint
    expected = [p.prompt_id for p in take(ds, 7)]
    resumed = PromptDataset(str(three), demo_tokenizer, seed=5)
    resumed.load_state_dict(state)
    assert [p.prompt_id for p in take(resumed, 7)] == expected
    with pytest.raises(ConfigError, match="seed"):
        PromptDataset(str(three), demo_tokenizer, seed=6).load_state_dict(state)


def test_rows_are_copied_per_item(three, demo_tokenizer):
    ds = PromptDataset(str(three), demo_tokenizer, shuffle=False)
    first = next(ds)
    first.row["level"] = 99
    take(ds, 2)
    assert next(ds).row["level"] == 3


def test_jsonl_written_by_the_task(tmp_path, demo_tokenizer):
    write_jsonl(tmp_path / "rd.jsonl", 4, seed=0)
    ds = PromptDataset(str(tmp_path / "rd.jsonl"), demo_tokenizer, max_prompt_len=24, vocab_size=18)
    items = take(ds, 4)
    assert sorted(p.prompt_id for p in items) == [f"reverse_digits/0/{i}" for i in range(4)]
    for p in items:
        text = demo_tokenizer.decode_prompt(p.prompt_ids)
        assert p.answer == text.split("\n")[1].split("<")[0][::-1]


@pytest.mark.parametrize("rows, match", [
    ([], r"p\.jsonl is empty"),
    (["", "  "], r"p\.jsonl is empty"),
    (['{"prompt": "1", "answer": "1"}', '{"prompt": "1'], r"p\.jsonl:2: invalid JSON"),
    (['{"question": "1", "answer": "1"}'], r"p\.jsonl:1: no field 'prompt' \(data.prompt_key\)"),
    (['{"prompt": "1"}'], r"p\.jsonl:1: no field 'answer' \(data.answer_key\)"),
    (['{"prompt": 5, "answer": "1"}'], r"p\.jsonl:1: field 'prompt' must be a string or a list of chat messages"),
    (['{"prompt": [{"content": "1"}], "answer": "1"}'], r"p\.jsonl:1: message 0 must be an object with 'role'"),
    (['{"prompt": [{"role": "user"}], "answer": "1"}'], r"p\.jsonl:1: message 0 must be an object with 'role'"),
    (['{"prompt": [], "answer": "1"}'], r"p\.jsonl:1: a chat prompt must be a non-empty list"),
    (['[1, 2]'], r"p\.jsonl:1: each line must be a JSON object"),
    (['{"prompt_ids": [], "answer": "1"}'], r"p\.jsonl:1: 'prompt_ids' must be a non-empty list"),
    (['{"prompt_ids": [1, 18], "answer": "1"}'], r"p\.jsonl:1: token ids \[18\] outside the vocabulary"),
    (['{"id": "x", "prompt": "1", "answer": "1"}', '{"id": "x", "prompt": "2", "answer": "2"}'],
     r"p\.jsonl:2: duplicate id 'x'"),
    (['{"prompt": "1", "answer": "1"}', '{"prompt": "2", "answer": null}'],
     r"p\.jsonl:2: field 'answer' \(data.answer_key\) is null"),
])
def test_bad_rows_name_file_line_and_key(tmp_path, demo_tokenizer, rows, match):
    path = write_lines(tmp_path / "p.jsonl", rows)
    with pytest.raises(InputError, match=match):
        PromptDataset(str(path), demo_tokenizer, vocab_size=18)


def test_missing_file_and_empty_path(tmp_path, demo_tokenizer):
    with pytest.raises(InputError, match="does not exist"):
        PromptDataset(str(tmp_path / "nope.jsonl"), demo_tokenizer)
    with pytest.raises(ConfigError, match="data.path is empty"):
        PromptDataset.from_config(DataConfig(), demo_tokenizer)


def test_no_answer_key(tmp_path, demo_tokenizer):
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "12"}])
    assert next(PromptDataset(str(path), demo_tokenizer, answer_key="")).answer is None


def test_from_config(three, demo_tokenizer):
    ds = PromptDataset.from_config(DataConfig(path=str(three), max_prompt_len=10), demo_tokenizer)
    assert (ds.source, ds.size, ds.n_filtered) == (str(three), 2, 1)  # "345" renders to 11 tokens
    ev = PromptDataset.from_config(DataConfig(path=str(three)), demo_tokenizer, path=str(three), shuffle=False)
    assert [p.prompt_id for p in ev.prompts()] == ["a", "p.jsonl:2", "7"]
