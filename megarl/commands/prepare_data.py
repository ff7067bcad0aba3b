"""`megarl prepare-data`: convert a public dataset file into megarl's row format ({"id", "prompt", "answer"}).

Formats:
- ``gsm8k``: rows ``{"question", "answer"}`` whose answer ends in ``#### N``
  (the GSM8K files, JSONL or Parquet). The prompt is the question plus an
  instruction to put the final answer in ``\\boxed{}`` (``--instruction TEXT``
  for another, ``--no-instruction`` for none; the command prints which); the
  answer is N (thousands separators removed), which the ``math`` and
  ``math_strict`` rewards compare with.

A verl-style Parquet file (``prompt`` as a chat message list,
``reward_model.ground_truth``) needs no conversion: the run reads it with
``data.prompt_key=prompt data.answer_key=reward_model.ground_truth``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from megarl.data import read_rows
from megarl.errors import InputError

INSTRUCTION = "Solve the problem step by step, then give the final answer as \\boxed{N}."
_FINAL = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


VERL_HINT = ("a verl-style file (a 'prompt' message list and 'reward_model.ground_truth') needs no conversion: "
             "train on it directly with data.prompt_key=prompt data.answer_key=reward_model.ground_truth")


def gsm8k_row(row: dict, where: str, instruction: str = INSTRUCTION) -> dict:
    question, solution = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not isinstance(solution, str):
        hint = f"; {VERL_HINT}" if "reward_model" in row or "prompt" in row else ""
        raise InputError(f"{where}: a gsm8k row needs string fields 'question' and 'answer' (it has "
                         f"{sorted(row)}){hint}")
    m = _FINAL.search(solution)
    if not m:
        raise InputError(f"{where}: the answer does not end in '#### N': {solution[-80:]!r}")
    prompt = f"{question.strip()}\n{instruction}" if instruction else question.strip()
    return {"prompt": prompt, "answer": m.group(1).replace(",", "")}


FORMATS = {"gsm8k": gsm8k_row}


def convert(fmt: str, src: str, dst: str, instruction: str = INSTRUCTION) -> int:
    """Write ``dst`` (JSONL) from ``src``, ``instruction`` appended to every prompt ("" for none); returns the
    number of rows."""
    to_row = FORMATS[fmt]
    n = 0
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    with open(dst, "w", encoding="utf-8") as f:
        for where, default_id, row in read_rows(src):
            out = {"id": str(row.get("id", default_id)), **to_row(row, where, instruction)}
            f.write(json.dumps(out, ensure_ascii=False) + "\n")
            n += 1
    if n == 0:
        raise InputError(f"{src} has no rows")
    return n


def register(sub) -> None:
    p = sub.add_parser("prepare-data", help="convert a public dataset file into megarl's {prompt, answer} rows")
    p.add_argument("--format", required=True, choices=sorted(FORMATS), help="the input's format")
    p.add_argument("--input", required=True, help=".jsonl or .parquet file (or hf:NAME[:SPLIT])")
    p.add_argument("--output", required=True, help="JSONL file to write")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--instruction", default=INSTRUCTION,
                       help=f"text appended to every prompt on a line of its own (default: {INSTRUCTION!r})")
    group.add_argument("--no-instruction", action="store_true", help="append nothing to the prompts")
    p.set_defaults(func=run)


def run(args) -> int:
    instruction = "" if args.no_instruction else args.instruction
    n = convert(args.format, args.input, args.output, instruction)
    print(f"wrote {n} rows to {args.output}")
    print(f"appended to every prompt: {instruction!r}" if instruction else "appended nothing to the prompts")
    return 0
