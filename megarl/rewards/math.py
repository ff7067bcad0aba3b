"""Math answer equivalence with math-verify (``parse`` + ``verify``) on the response's final answer.

Reward 1.0 when the response's final answer is mathematically equal to the
ground truth (``\\frac{1}{2}`` equals ``0.5``), else 0.0. The final answer is,
in this order:

- the content of the **last** ``\\boxed{}`` (or ``\\fbox{}``): a model that
  corrects itself boxes the correction last, and math-verify on the whole text
  would read two boxes as the set of both (equal to neither). A response cut
  off inside its last box has no final answer (0.0);
- else the number after the **last** ``####`` (GSM8K's format; thousands
  separators dropped), whatever text follows it; a line after ``####`` that
  does not start with a number is parsed as math;
- else whatever math-verify finds in the whole response (a plain final number).

``math_strict`` (:func:`math_strict_reward`) takes only an answer the response
marks as final: the last ``\\boxed{}``, else the number after the last
``####``, else what follows the last ``Answer:`` on its line (DAPO's format);
a response with none of them scores 0.0. The lenient fallback above scores
"48 in April and 24 in May, 72 in total." as the answer 72; the strict reward
does not, as GSM8K's and DAPO's reference rewards do not.

The ground truth is read the same way when it holds a box or ``####`` (a
GSM8K solution), else as LaTeX (``2\\sqrt{3}``, ``\\frac{\\pi}{2}``: bare LaTeX
is what math datasets store). A ground truth math-verify cannot parse raises:
that is bad data, and a failed sample shows up in the service's stats where a
silent 0.0 would not.
"""
from __future__ import annotations

import re
from typing import Any

from math_verify import parse, verify

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = "####"
# a number at the start of the text after ####: optional dollar sign, sign, digits with thousands separators
_LEADING_NUMBER = re.compile(r"\s*\\?\$?\s*(-?\d[\d,]*(?:\.\d+)?|-?\.\d+)")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` of ``text`` (braces balanced); None when there
    is no box, "" when the last box is never closed (a response cut off inside it)."""
    starts = list(_BOX.finditer(text))
    if not starts:
        return None
    begin = starts[-1].end()
    depth = 1
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
    return ""


def after_hashes(text: str) -> str | None:
    """The answer after the last ``####`` (its leading number, separators dropped, else its line); None without
    ``####``."""
    if _HASHES not in text:
        return None
    rest = text.rsplit(_HASHES, 1)[1]
    m = _LEADING_NUMBER.match(rest)
    if m:
        return m.group(1).replace(",", "")
    return rest.strip().split("\n", 1)[0]


_ANSWER_LINE = re.compile(r"Answer\s*:")


def after_answer_colon(text: str) -> str | None:
    """The rest of the line after the last ``Answer:`` (DAPO's format), a trailing period dropped; None without."""
    starts = list(_ANSWER_LINE.finditer(text))
    if not starts:
        return None
    line = text[starts[-1].end():].split("\n", 1)[0].strip()
    return line[:-1].rstrip() if line.endswith(".") else line


def marked_answer(text: str) -> list | None:
    """The final answer ``text`` marks as such (a box, ``####``), parsed; None when it marks none."""
    box = last_boxed(text)
    if box is not None:
        return parse("\\boxed{" + box + "}") if box.strip() else []
    hashed = after_hashes(text)
    if hashed is not None:
        return parse("\\boxed{" + hashed + "}") if hashed.strip() else []
    return None


def final_answer(text: str) -> list:
    """What math-verify parses as the final answer of ``text`` (module docstring); [] when there is none."""
    marked = marked_answer(text)
    return parse(text) if marked is None else marked


def strict_final_answer(text: str) -> list:
    """The final answer of ``text`` for :func:`math_strict_reward`: a box, ``####`` or ``Answer:``, else []."""
    marked = marked_answer(text)
    if marked is not None:
        return marked
    line = after_answer_colon(text)
    return parse("\\boxed{" + line + "}") if line else []


def parse_ground_truth(answer: Any) -> list:
    text = str(answer)
    if last_boxed(text) is not None or _HASHES in text or "$" in text:
        return final_answer(text)
    return parse("\\boxed{" + text + "}")  # bare LaTeX: without delimiters math-verify reads only its first number


def math_reward(response: str, answer: Any, **_: Any) -> float:
    return _score(final_answer(response), answer)


def math_strict_reward(response: str, answer: Any, **_: Any) -> float:
    """1.0 when the answer the response marks as final (module docstring) equals the ground truth, else 0.0."""
    return _score(strict_final_answer(response), answer)


def _score(pred: list, answer: Any) -> float:
    if answer is None or str(answer).strip() == "":
        raise ValueError("math reward needs the ground truth (data.answer_key) of every row")
    gold = parse_ground_truth(answer)
    if all(isinstance(g, str) for g in gold):  # no expression, at most the text math-verify gave up on
        raise ValueError(f"math-verify cannot parse the ground truth {answer!r}")
    if not pred:
        return 0.0
    # verify(gold, pred) is not symmetric: the ground truth goes first
    return 1.0 if verify(gold, pred) else 0.0
