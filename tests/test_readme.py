"""The README's Python examples run as shown on a CPU machine (its shell commands are run by
CI itself or say which hardware they need)."""

import json
import re
from pathlib import Path

import jsonschema

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_python_examples_run(capsys):
    blocks = python_blocks()
    assert blocks, "the README has no Python example"
    printed, structured = [], []
    for block in blocks:
        namespace = {}
        exec(compile(block, str(README), "exec"), namespace)
        out = capsys.readouterr().out
        printed.append(out)
        shown = re.findall(r"^# prints: (.*)$", block, re.M)  # what the README says it prints
        if shown:
            assert out.splitlines() == shown
        if "structured_outputs" in block:
            structured.append((out, namespace))
    assert "".join(printed).strip().endswith("length")  # the text, then its finish reason
    assert structured, "the README has no structured-output example"
    for out, namespace in structured:
        # the constrained text always closes: valid JSON that meets the example's schema
        jsonschema.validate(json.loads(out), namespace["schema"])
