"""The README's snippets for the manager, Lightning, Hugging Face and the built-in Trainer run as
written, in a fresh process, and a second run of each resumes from the first one's checkpoints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"

# Section heading -> the folder its snippet saves into.
SNIPPETS = {
    "## Your own training loop: `CheckpointManager`": "runs/loop",
    "## PyTorch Lightning": "runs/lightning",
    "## Hugging Face `transformers.Trainer`": "runs/hf",
    "## The built-in Trainer (and `ckptkeeper train`)": "runs/exp1",
}


def _first_python_block(heading: str) -> str:
    text = README.read_text()
    start = text.index(heading + "\n")
    match = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert match is not None, heading
    return match.group(1)


def _steps(folder: Path) -> list[int]:
    return sorted(int(p.name[4:]) for p in folder.iterdir() if re.fullmatch(r"step\d+", p.name))


@pytest.mark.parametrize("heading", list(SNIPPETS), ids=["manager", "lightning", "hf", "trainer"])
def test_snippet_runs_and_a_second_run_resumes(tmp_path: Path, heading: str) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(_first_python_block(heading))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    first = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    folder = tmp_path / SNIPPETS[heading]
    saved = _steps(folder)
    assert saved and max(saved) > 0, saved
    again = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    # The second run found the first one's final checkpoint: nothing to train, nothing new saved.
    assert max(_steps(folder)) == max(saved)
