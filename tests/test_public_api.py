"""The curated public API, module docstrings, and the layering rules of ARCHITECTURE.md."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import ckptkeeper

SRC = Path(ckptkeeper.__file__).parent

PUBLIC = {
    "Callback", "CheckpointError", "CheckpointEvent", "CheckpointInfo", "CheckpointManager", "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointPolicyConfig", "CheckpointSaveError", "Checkpointer", "CheckpointerCallback", "CkptkeeperError",
    "CommitRecord", "ConfigurationError", "CorruptCheckpointError", "DiskFullError", "JsonStateful", "NewerFormatError",
    "RemovalStrategy", "RetentionRules",
    "SaveFolderInUseError", "SaveFolderLease", "SaveResult", "Stateful", "Storage", "StorageAccessError",
    "StorageError", "Trainer", "TrainingState",
    "UnsafeCheckpointError", "__version__", "state_digest", "storage_for",
}  # fmt: skip


def test_all_is_the_curated_list_and_resolves() -> None:
    assert set(ckptkeeper.__all__) == PUBLIC
    for name in ckptkeeper.__all__:
        assert getattr(ckptkeeper, name) is not None


def test_every_module_and_public_callable_is_documented() -> None:
    for mod in pkgutil.walk_packages([str(SRC)], prefix="ckptkeeper."):
        if mod.name.endswith("__main__"):  # importing it runs the command; read its docstring instead
            assert ast.get_docstring(ast.parse((SRC / "__main__.py").read_text()))
            continue
        m = importlib.import_module(mod.name)
        assert m.__doc__ and m.__doc__.strip(), f"{mod.name} has no module docstring"
    for name in ckptkeeper.__all__:
        obj = getattr(ckptkeeper, name)
        if callable(obj):
            assert obj.__doc__, f"{name} has no docstring"


def test_error_tree() -> None:
    for name in ckptkeeper.__all__:
        obj = getattr(ckptkeeper, name)
        if isinstance(obj, type) and issubclass(obj, Exception) and obj is not ckptkeeper.CkptkeeperError:
            assert issubclass(obj, ckptkeeper.CkptkeeperError), name


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def test_policy_is_pure() -> None:
    for path in (SRC / "policy").glob("*.py"):
        bad = {m for m in _imports(path) if m.split(".")[0] in {"torch", "os", "time", "io", "shutil", "pathlib"}}
        assert not bad, f"{path.name} imports {bad}"


def test_only_distributed_talks_to_torch_distributed_collectives() -> None:
    for path in SRC.rglob("*.py"):
        if "distributed" in path.parts:
            continue
        assert "torch.distributed" not in _imports(path) or path.parent.name in ("engine",), path
        text = path.read_text()
        for call in ("dist.broadcast", "dist.barrier", "dist.all_gather", "dist.new_group"):
            assert call not in text, f"{path} calls {call}; go through ckptkeeper.distributed"
