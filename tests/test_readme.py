"""The README's library example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_opens_with_the_two_commands() -> None:
    text = README.read_text()
    first_block = re.search(r"```sh\n(.*?)```", text, re.S)
    assert first_block is not None and text.index(first_block.group(0)) < 200
    lines = [ln.split("#")[0].strip() for ln in first_block.group(1).splitlines()]
    assert lines == ["make demo", "make test"]


def test_library_example_runs_and_moves_the_data() -> None:
    block = re.search(r"## Using the library\n\n```python\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    scope: dict[str, object] = {}
    exec(compile(block.group(1), str(README), "exec"), scope)  # the README's own code
    c = scope["c"]
    assert c.closed  # type: ignore[attr-defined]
    assert c.state.completed == {"d2h": 1, "h2d": 1}  # type: ignore[attr-defined]
    assert isinstance(scope["dev"], torch.Tensor) and scope["dev"].numel() == 64  # type: ignore[attr-defined]
