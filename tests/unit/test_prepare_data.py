"""`megarl prepare-data --format gsm8k`: GSM8K-style rows to {prompt, answer} rows the math reward checks."""
import json

import pytest

from megarl.cli import main
from megarl.data import PromptDataset
from megarl.rewards.math import math_reward

ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
     "answer": "He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "A shop sells 1,200 pens a day. How many in 2 days?",
     "answer": "1,200 * 2 = <<1200*2=2400>>2,400\n#### 2,400"},
]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_gsm8k_file_converts_and_loads(tmp_path, text_tokenizer, suffix, capsys):
    src = tmp_path / f"train{suffix}"
    if suffix == ".jsonl":
        src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(ROWS), src)
    out = tmp_path / "gsm8k.jsonl"
    assert main(["prepare-data", "--format", "gsm8k", "--input", str(src), "--output", str(out)]) == 0
    assert "wrote 2 rows" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["answer"] for r in rows] == ["7", "2400"]
    assert rows[0]["prompt"].startswith("Tom has 3 apples") and "\\boxed{N}" in rows[0]["prompt"]
    ds = PromptDataset(str(out), text_tokenizer, shuffle=False, max_prompt_len=1000)
    first = next(ds)
    assert first.answer == "7"
    assert math_reward("So he has \\boxed{7} apples.", first.answer) == 1.0
    assert math_reward("1,200 * 2 = 2400", next(ds).answer) == 1.0


def test_a_row_without_the_final_answer_is_named(tmp_path, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    assert main(["prepare-data", "--format", "gsm8k", "--input", str(src), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert f"{src}:1: the answer does not end in '#### N'" in capsys.readouterr().err


def test_the_instruction_is_printed_and_can_be_changed_or_left_out(tmp_path, capsys):
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "o.jsonl"
    assert main(["prepare-data", "--format", "gsm8k", "--input", str(src), "--output", str(out)]) == 0
    assert "appended to every prompt: 'Solve the problem step by step" in capsys.readouterr().out
    assert main(["prepare-data", "--format", "gsm8k", "--input", str(src), "--output", str(out),
                 "--no-instruction"]) == 0
    assert "appended nothing to the prompts" in capsys.readouterr().out
    assert json.loads(out.read_text().splitlines()[0])["prompt"] == ROWS[0]["question"]
    assert main(["prepare-data", "--format", "gsm8k", "--input", str(src), "--output", str(out),
                 "--instruction", "Answer: N at the end."]) == 0
    assert json.loads(out.read_text().splitlines()[0])["prompt"].endswith("\nAnswer: N at the end.")


def test_a_verl_parquet_is_pointed_at_the_data_keys(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "1+1?"}],
                                          "reward_model": {"ground_truth": "2", "style": "rule"}}]), src)
    assert main(["prepare-data", "--format", "gsm8k", "--input", str(src), "--output", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "data.answer_key=reward_model.ground_truth" in err and "needs no conversion" in err
