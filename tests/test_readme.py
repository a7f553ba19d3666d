"""The README's Python examples run as shown on a CPU machine (its shell commands are run by
CI itself or say which hardware they need)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_python_examples_run(capsys):
    blocks = python_blocks()
    assert blocks, "the README has no Python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})
    printed = capsys.readouterr().out
    assert printed.strip().endswith("length")  # the text, then its finish reason
