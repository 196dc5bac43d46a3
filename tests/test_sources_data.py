"""The bundled prompt data and its loader (weightsync.data).

Contracts: the bundled file holds 64 arithmetic prompts whose answers are right; the loader
cycles from an offset; prompt files in weightsync's format and in the reference system's chat
format (``prompt`` messages, ``label``) normalize to ``{"prompt", "answer"}``; a bad line is
refused with its line number; ``math_reward`` scores the first number of a completion.
"""

from __future__ import annotations

import json
import re

import pytest

from weightsync.data import BUNDLED, load_prompts, math_reward, read_prompt_file


def test_bundled_prompts_have_correct_answers():
    records = read_prompt_file(BUNDLED)
    assert len(records) == 64
    words = {"plus": "+", "minus": "-", "times": "*"}
    for r in records:
        m = re.search(r"(\d+) (\+|-|\*|plus|minus|times) (\d+)", r["prompt"])
        assert m is not None, r
        a, op, b = int(m.group(1)), words.get(m.group(2), m.group(2)), int(m.group(3))
        assert int(r["answer"]) == {"+": a + b, "-": a - b, "*": a * b}[op], r


def test_load_prompts_cycles_from_offset():
    all_ = load_prompts()
    assert load_prompts(3, offset=62) == [all_[62], all_[63], all_[0]]
    assert len(load_prompts(100)) == 100


def test_chat_format_and_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q?"}],
                                "label": 3}) + "\n\n" + json.dumps({"prompt": "x", "answer": "1"}) + "\n")
    assert read_prompt_file(path) == [{"prompt": "q?", "answer": "3"}, {"prompt": "x", "answer": "1"}]
    path.write_text(json.dumps({"answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:1: needs a non-empty 'prompt'"):
        read_prompt_file(path)
    path.write_text("")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompt_file(path)


@pytest.mark.parametrize(("answer", "text", "want"), [
    ("42", " 42 is the answer", 1.0), ("42", "I think 41", 0.0), ("-3", "= -3.0", 1.0), ("7", "no idea", 0.0),
])
def test_math_reward(answer, text, want):
    assert math_reward(answer, text) == want
