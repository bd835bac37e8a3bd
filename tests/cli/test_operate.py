"""The operations commands through the ``ckptkeeper`` entry point: ls --verify, inspect, verify,
rm, prune, cp and export, on local disk and S3, plus --version and -q/-v placement.

The commands that import torch (every one that reads a checkpoint) run ``main()`` in this process
(``run_cli``): a fresh interpreter would spend seconds importing torch for each. ``--version``,
``--help`` and ``rm`` import no torch and still run as real processes of the console script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptkeeper import Checkpointer
from ckptkeeper.cli import main

from ..helpers import run_cli
from ..helpers import small_state as _state


def ck(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "ckptkeeper"
    return subprocess.run([str(exe), *args], capture_output=True, text=True, cwd=cwd, input=stdin, timeout=240)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    ckpt = Checkpointer()
    st = _state()
    for step in (10, 20, 30, 40, 50):
        ckpt.save(str(tmp_path / "run"), step, st, train_state={"global_step": step}, ephemeral=step == 50)
    return tmp_path / "run"


def test_version_and_verbosity_flags_before_or_after_the_command(tmp_path: Path, folder: Path) -> None:
    out = ck("--version", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("ckptkeeper ")
    for args in (["-q", "ls", str(folder)], ["ls", str(folder), "-q"], ["ls", "-v", str(folder)]):
        res = run_cli(*args, cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        assert "step" in res.stdout
    assert run_cli("-q", "-v", "ls", str(folder), cwd=tmp_path).returncode == 2


def test_every_command_has_help_that_lists_its_flags(tmp_path: Path) -> None:
    for cmd, flags in {
        "ls": ["--json", "--verify"], "inspect": ["--json"], "verify": ["--json"], "rm": ["--yes"],
        "prune": ["--keep-last", "--keep-every", "--keep-steps", "--dry-run", "--yes"], "cp": [],
        "export": ["--format", "safetensors", "torch", "--dtype", "bfloat16", "--include-optimizer"],
    }.items():  # fmt: skip
        res = ck(cmd, "--help", cwd=tmp_path)
        assert res.returncode == 0
        for flag in flags:
            assert flag in res.stdout, (cmd, flag)


def test_verify_passes_then_fails_after_a_flipped_byte(tmp_path: Path, folder: Path) -> None:
    ok = run_cli("verify", str(folder), cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("OK") == 5
    data = folder / "step30" / "model_and_optim" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    bad = run_cli("verify", str(folder), cwd=tmp_path)
    assert bad.returncode == 1
    assert "FAILED" in bad.stdout and "step30" in bad.stdout and bad.stdout.count("OK") == 4
    assert run_cli("verify", str(folder / "step40"), cwd=tmp_path).returncode == 0
    assert main(["ls", str(folder), "--verify", "--json"]) == 1


def test_verify_takes_a_checkpoint_copied_to_a_folder_of_another_name(tmp_path: Path, folder: Path) -> None:
    # It said "no checkpoints here": only step{N} folders were taken as checkpoints.
    import shutil

    copy = tmp_path / "kept" / "best-model"
    shutil.copytree(folder / "step20", copy)
    res = run_cli("verify", str(copy) + "/", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    (row,) = json.loads(res.stdout)
    assert row["ok"] and row["step"] == 20 and row["path"] == str(copy)
    (copy / "model_and_optim" / "__0_0.distcp").write_bytes(b"x")
    bad = run_cli("verify", str(copy), cwd=tmp_path)
    assert bad.returncode == 1 and "FAILED" in bad.stdout and "__0_0.distcp" in bad.stdout
    # Every row has the same keys, passed or failed (a failed one had no "note").
    rows = json.loads(run_cli("verify", str(copy), str(tmp_path / "nowhere"), "--json", cwd=tmp_path).stdout)
    assert [sorted(r) for r in rows] == [sorted(row)] * 2 and not rows[0]["ok"] and not rows[1]["ok"]
    # A folder of such copies is still no save folder.
    assert "no checkpoints here" in run_cli("verify", str(tmp_path / "kept"), cwd=tmp_path).stdout


def test_rm_removes_the_step_folder(tmp_path: Path, folder: Path) -> None:
    res = ck("rm", str(folder / "step20"), "--yes", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert not (folder / "step20").exists()
    # The metrics event (a line of JSON) is for -v and CKPTKEEPER_METRICS, not for every console.
    assert "ckptkeeper.metrics" not in res.stderr and "removed" in res.stderr + res.stdout, res.stderr
    loud = ck("-v", "rm", str(folder / "step10"), "--yes", cwd=tmp_path)
    assert loud.returncode == 0 and 'ckptkeeper.metrics: remove {"event": "remove"' in loud.stderr, loud.stderr
    assert not [p for p in folder.iterdir() if p.name.startswith(".trash-")]
    # Without --yes and without a terminal to ask on, it refuses and removes nothing.
    refused = ck("rm", str(folder / "step30"), cwd=tmp_path, stdin="")
    assert refused.returncode == 1 and (folder / "step30").exists()
    assert "--yes" in refused.stderr
    missing = ck("rm", str(folder / "step99"), "--yes", cwd=tmp_path)
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    (folder / "step98").write_text("a file")
    a_file = ck("rm", str(folder / "step98"), "--yes", cwd=tmp_path)
    assert a_file.returncode == 1 and "is not a folder" in a_file.stderr and (folder / "step98").exists()


def test_prune_dry_run_deletes_nothing_then_prunes_by_the_rules(tmp_path: Path, folder: Path) -> None:
    before = sorted(os.listdir(folder))
    dry = run_cli("prune", str(folder), "--keep-last", "1", "--keep-steps", "20", "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert sorted(os.listdir(folder)) == before
    assert "would remove step 10" in dry.stdout and "would remove step 40" in dry.stdout
    assert "keep    step 50 (newest" in dry.stdout and "keep    step 20 (listed)" in dry.stdout
    res = run_cli("prune", str(folder), "--keep-every", "20", "--yes", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(os.listdir(folder)) == ["step20", "step40", "step50"]  # 50: the newest always stays
    none = run_cli("prune", str(folder), "--yes", cwd=tmp_path)
    assert none.returncode == 2 and "--keep-last" in none.stderr  # bad arguments (the README's exit codes)


def test_inspect_shows_record_trainer_state_and_tensors(tmp_path: Path, folder: Path) -> None:
    res = run_cli("inspect", str(folder / "step30"), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["record"]["step"] == 30 and info["record"]["format"] == "ckptkeeper"
    assert info["train_state"]["train_state"]["global_step"] == 30 or info["train_state"].get("global_step") == 30
    by_name = {t["name"]: t for t in info["tensors"]}
    assert by_name["model.0.weight"] == {"name": "model.0.weight", "shape": [8, 4], "dtype": "float32", "bytes": 128}
    assert "optim.state.0.weight.exp_avg" in by_name
    assert info["total_tensor_bytes"] == sum(t["bytes"] for t in info["tensors"] if t["bytes"])
    table = run_cli("inspect", str(folder / "step30"), cwd=tmp_path)
    assert table.returncode == 0 and "model.0.weight" in table.stdout
    assert "'global_step': 30" in table.stdout  # the user's trainer state, not just "dict"


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_export_to_safetensors_equals_the_checkpoint_model(tmp_path: Path, folder: Path, dtype: str | None) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    res = run_cli("export", str(folder / "step30"), str(out), *(["--dtype", dtype] if dtype else []), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    got = load_file(str(out))
    want = _state().model.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        expected = v.to(getattr(torch, dtype)) if dtype else v
        assert torch.equal(got[k], expected), k
    opt = tmp_path / "all.pt"
    assert main(["export", str(folder / "step30"), str(opt), "--format", "torch", "--include-optimizer"]) == 0
    everything = torch.load(opt, weights_only=True)
    assert "model.0.weight" in everything and "optim.state.0.weight.exp_avg" in everything


def test_cp_local_to_s3_to_local_round_trip_verifies(tmp_path: Path, folder: Path, s3_root: str) -> None:
    env_ok = run_cli("cp", str(folder), s3_root, cwd=tmp_path)
    assert env_ok.returncode == 0, env_ok.stderr
    assert env_ok.stdout.count("verified") == 5
    back = tmp_path / "back"
    res = run_cli("cp", f"{s3_root}/step30", str(back), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(os.listdir(back)) == ["step30"]
    assert (back / "step30" / ".metadata.json").read_bytes() == (folder / "step30" / ".metadata.json").read_bytes()
    dst = _state(5)
    Checkpointer().load(str(back / "step30"), dst)
    from ckptkeeper import state_digest

    src = _state()
    assert state_digest(dst.model, dst.optimizer) == state_digest(src.model, src.optimizer)
    again = run_cli("cp", f"{s3_root}/step30", str(back), cwd=tmp_path)  # identical: left as it is
    assert again.returncode == 0
    # ... and said so (it printed "copied" before, found by a newcomer).
    assert "nothing copied" in again.stdout, again.stdout
    assert not again.stdout.startswith("copied"), again.stdout
    assert run_cli("verify", s3_root, cwd=tmp_path).returncode == 0


def test_paths_that_look_like_rich_markup_are_shown_as_they_are(tmp_path: Path) -> None:
    # Found by an outside attack: a folder named "a[/]b" crashed ls and inspect (MarkupError).
    st = _state()
    odd = tmp_path / "a[/]b [bold]x"
    Checkpointer().save(str(odd), 5, st, train_state={"[red]k": "[/]v"})
    listed = run_cli("ls", str(odd), cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "a[/]b" in listed.stdout and "[bold]x" in listed.stdout  # the title may wrap between them
    shown = run_cli("inspect", str(odd / "step5"), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "a[/]b [bold]x" in shown.stdout and "'[red]k': '[/]v'" in shown.stdout
    # Nor as emoji codes or terminal controls, and a trailing backslash stays one (an outside attack).
    odder = tmp_path / "r:fire:\x1b[2J\\"
    Checkpointer().save(str(odder), 5, st)
    for args in (["ls", str(odder)], ["inspect", str(odder / "step5")]):
        out = run_cli(*args, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert "\x1b" not in out.stdout and "r:fire:" in out.stdout and "\\x1b[2J\\" in out.stdout, out.stdout


def test_words_from_a_checkpoint_cannot_drive_the_terminal_or_forge_a_line(tmp_path: Path) -> None:
    # Found by an outside attack: verify and the one-line errors printed a tensor's name raw, so a
    # name holding escapes or a newline retitled the terminal or printed a forged "OK" line.
    from torch import nn

    from ckptkeeper import TrainingState

    from ..helpers import forge

    model = nn.Module()
    name = "\x1b]0;PWNED\x07t\x1b[31m\nOK      run/step1: 9 KiB, sizes and checksums match\n\u202e"
    model.register_parameter(name, nn.Parameter(torch.ones(64)))
    Checkpointer().save(str(tmp_path / "run"), 1, TrainingState(model))
    data = tmp_path / "run" / "step1" / "model_and_optim" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    forge(tmp_path / "run" / "step1", "model_and_optim/__0_0.distcp", bytes(raw))  # the file checksum matches
    for args in (["verify", "run"], ["cp", "run/step1", "copy"]):
        out = run_cli(*args, cwd=tmp_path)
        assert out.returncode == 1, (args, out.stdout, out.stderr)
        text = out.stdout + out.stderr
        assert "\x1b" not in text and "\u202e" not in text and "PWNED" in text, text
        assert not [line for line in text.splitlines() if line.startswith("OK")], text


def test_cp_onto_a_damaged_copy_of_the_same_checkpoint_says_so(tmp_path: Path, folder: Path) -> None:
    # Found by an outside attack: it printed "already holds ... nothing copied" and exited 0.
    assert main(["cp", str(folder / "step30"), str(tmp_path / "dst")]) == 0
    data = tmp_path / "dst" / "step30" / "model_and_optim" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    again = run_cli("cp", str(folder / "step30"), str(tmp_path / "dst"), cwd=tmp_path)
    assert again.returncode == 1 and "do not verify" in again.stderr and "ckptkeeper rm" in again.stderr
    assert data.read_bytes() == bytes(raw)  # refused: nothing overwritten
    # A link to the source is no copy of it either (an outside attack: "already holds", exit 0).
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "step30").symlink_to(folder / "step30")
    linked = run_cli("cp", str(folder / "step30"), str(tmp_path / "links"), cwd=tmp_path)
    assert linked.returncode == 1 and "symbolic link" in linked.stderr
    # Nor is the source folder itself, however it is spelled.
    (tmp_path / "alias").symlink_to(folder)
    for dst in (str(tmp_path / "alias"), str(folder) + "/./", f"file://{folder}"):
        same = run_cli("cp", str(folder / "step30"), dst, cwd=tmp_path)
        assert same.returncode == 1 and "itself" in same.stderr, (dst, same.stdout, same.stderr)


def test_cp_of_a_corrupt_checkpoint_fails_and_leaves_nothing(tmp_path: Path, folder: Path) -> None:
    data = folder / "step30" / "model_and_optim" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 1
    data.write_bytes(bytes(raw))
    assert main(["cp", str(folder / "step30"), str(tmp_path / "dst")]) == 1
    assert not (tmp_path / "dst").exists() or os.listdir(tmp_path / "dst") == []


def test_the_commands_on_an_olmo_core_save_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import hashlib
    import shutil

    data = Path(__file__).resolve().parents[1] / "data" / "olmo_core"
    expected = json.loads((data / "expected.json").read_text())["checkpoints"]["step2"]["tensors"]
    run = tmp_path / "olmo"
    shutil.copytree(data / "run", run)
    capsys.readouterr()
    assert main(["ls", str(run), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["complete"], r["format"], r["ephemeral"]) for r in rows] == [
        (1, True, "olmo-core", False), (2, True, "olmo-core", True)
    ]  # fmt: skip
    assert "malformed" not in json.dumps(rows) and "delete" not in json.dumps(rows)
    assert main(["verify", str(run)]) == 0
    assert "no checksums" in capsys.readouterr().out
    assert main(["inspect", str(run / "step2"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["record"]["format"] == "olmo-core" and info["train_state"]["global_step"] == 2
    assert {t["name"] for t in info["tensors"]} >= {n for n in expected if n.startswith("model.")}
    out = tmp_path / "olmo.safetensors"
    assert main(["export", str(run / "step2"), str(out)]) == 0
    from safetensors.torch import load_file

    for name, t in load_file(str(out)).items():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert hashlib.sha256(raw).hexdigest() == expected[f"model.{name}"]["sha256"], name
    assert main(["cp", str(run / "step2"), str(tmp_path / "copy")]) == 0
    assert main(["verify", str(tmp_path / "copy" / "step2")]) == 0
    assert main(["rm", str(run / "step1"), "--yes"]) == 1  # not ckptkeeper's: never deleted
    assert (run / "step1").is_dir()


# ---------------------------------------------------------------- found by an outside attack (2026-12-01)


def test_export_never_replaces_something_that_is_not_a_new_or_regular_file(tmp_path: Path, folder: Path) -> None:
    fifo = tmp_path / "f.fifo"
    os.mkfifo(fifo)
    (tmp_path / "adir").mkdir()
    data = folder / "step30" / "model_and_optim" / "__0_0.distcp"
    before = data.read_bytes()
    for out in (str(fifo), str(tmp_path / "adir"), str(data), "", "s3://bucket/out.st"):
        assert main(["export", str(folder / "step30"), out]) == 1, out
    assert fifo.is_fifo() and data.read_bytes() == before
    out = tmp_path / "ok.safetensors"
    assert main(["export", str(folder / "step30"), str(out)]) == 0
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_rm_keeps_files_the_checkpoint_does_not_list(tmp_path: Path, folder: Path) -> None:
    (folder / "step10" / "NOTES.txt").write_text("precious")
    assert main(["rm", str(folder / "step10"), "--yes"]) == 0
    assert (folder / "step10" / "NOTES.txt").read_text() == "precious"
    assert sorted(p.name for p in (folder / "step10").iterdir()) == ["NOTES.txt"]
    assert 10 not in [s for s, _ in Checkpointer().find_checkpoints(str(folder))]


def test_prune_and_rm_leave_olmo_core_checkpoints_and_inspect_errors_are_one_line(
    tmp_path: Path, folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    data = Path(__file__).resolve().parents[1] / "data" / "olmo_core" / "run"
    for step in ("step1", "step2"):
        shutil.copytree(data / step, folder / step)
    assert main(["prune", str(folder), "--keep-last", "1", "--yes"]) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["step1", "step2", "step50"]
    assert main(["cp", str(folder / "step2"), "memory://olmo-copy"]) == 0
    assert main(["rm", "memory://olmo-copy/step2", "--yes"]) == 1
    capsys.readouterr()
    (folder / "step7").mkdir()
    for path in (folder / "step7", folder, folder / "step50" / "model_and_optim"):
        assert main(["inspect", str(path)]) == 1, path
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 3


def test_cp_carries_on_past_a_corrupt_checkpoint_and_cleans_its_own_leftovers(tmp_path: Path, folder: Path) -> None:
    data = folder / "step20" / "model_and_optim" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 1
    data.write_bytes(bytes(raw))
    dst = tmp_path / "dst"
    (dst / ".tmp-step30-deadbeef" / "model_and_optim").mkdir(parents=True)  # a killed earlier copy
    assert main(["cp", str(folder), str(dst)]) == 1
    assert sorted(p.name for p in dst.iterdir()) == ["step10", "step30", "step40", "step50"]


def test_prune_keeps_the_best_by_metric_and_the_young(tmp_path: Path) -> None:
    from torch import nn

    from ckptkeeper import CheckpointManager, CheckpointPolicyConfig

    folder = str(tmp_path / "run")
    mgr = CheckpointManager(folder, model=nn.Linear(2, 2), config=CheckpointPolicyConfig(save_interval=None))
    mgr.restore()
    for step, loss in ((1, 0.5), (2, 0.2), (3, 0.9), (4, 0.7)):
        mgr.save(step, metrics={"val_loss": loss}, wait=True)
    mgr.close()
    out = run_cli("prune", folder, "--keep-best", "1", "--metric", "val_loss", "--yes", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    left = sorted(p.name for p in Path(folder).iterdir() if p.name.startswith("step"))
    assert left == ["step2", "step4"]  # the best, and the newest
    young = run_cli("prune", folder, "--keep-younger-than", "1h", "--dry-run", cwd=tmp_path)
    assert young.returncode == 0 and "nothing to remove" in young.stdout
    # Flags that do not go together are bad arguments: exit 2, as the README says (they exited 1).
    bad = run_cli("prune", folder, "--keep-best", "1", cwd=tmp_path)
    assert bad.returncode == 2 and "--metric" in bad.stderr
    assert sorted(p.name for p in Path(folder).iterdir() if p.name.startswith("step")) == left
