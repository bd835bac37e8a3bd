"""The package as users get it: the wheel carries the licence and py.typed, the version has one
source, and ``ckptkeeper --help`` does not import torch."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import ckptkeeper

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_has_license_py_typed_and_the_single_version(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path)]
    res = subprocess.run([*cmd, str(ROOT)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    [wheel] = tmp_path.glob("ckptkeeper-*.whl")
    assert wheel.name.startswith(f"ckptkeeper-{ckptkeeper.__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    assert "ckptkeeper/py.typed" in names
    assert any(n.endswith("licenses/LICENSE") for n in names)
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta and "Project-URL:" in meta and "Classifier:" in meta
    assert "Apache License" in (ROOT / "LICENSE").read_text()


def test_help_and_version_do_not_import_torch() -> None:
    code = (
        "import sys; from ckptkeeper.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\nprint('LIGHT')"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "LIGHT" in res.stdout, res.stderr
