"""A tensor whose storage was shrunk under it (``untyped_storage().resize_()``, as FSDP2 does to
the parameters it has unsharded) claims more memory than it has. Saves read each tensor's bytes
straight from its memory, so such a tensor crashed the process (storage resized to 0) or was
written with bytes from past its end that verify then vouched for (resized to half). Every save
and load must refuse it with an error naming the tensor, and change nothing; so must
``state_digest``, which reads every value too.

The cases run in child processes: the failure this guards against is a crash."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_HOWS = ("sync", "again", "async", "load", "load extra", "digest")

_CASES = r"""
import json, os, sys, torch
from ckptkeeper import Checkpointer, CkptkeeperError, TrainingState, state_digest
frac, root, writer = float(sys.argv[1]), sys.argv[2], sys.argv[3]

class Buf:
    def __init__(self, t): self.t = t
    def state_dict(self): return {"t": self.t}
    def load_state_dict(self, sd): self.t = sd["t"]

def case(how, folder):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    st = TrainingState(model, opt)
    ck = Checkpointer(writer=writer)
    ck.save(folder, 1, st)
    if how == "again":
        ck.save(folder, 2, st)  # a second save of the same tensors, as a periodic save is
    w = model[0].weight
    full = w.untyped_storage().nbytes()
    w.untyped_storage().resize_(int(full * frac))
    error, other, before = "", None, None
    try:
        if how in ("sync", "again"):
            ck.save(folder, 3, st)
        elif how == "async":
            ck.save_async(folder, 3, st)[1].result()
        elif how == "digest":
            state_digest(model, opt)  # reads every value too: hashed past the end, or crashed
        elif how == "load extra":
            other = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
            ck.save(folder, 2, TrainingState(other, extra={"b": Buf(torch.arange(1 << 16, dtype=torch.float32))}))
            buf = Buf(torch.zeros(1 << 16))
            buf.t.untyped_storage().resize_(int(buf.t.untyped_storage().nbytes() * frac))
            with torch.no_grad():
                other[1].weight.add_(1.0)
            before = state_digest(other[1])
            try:
                ck.load(os.path.join(folder, "step2"), TrainingState(other, extra={"b": buf}))
            finally:
                ck.remove(os.path.join(folder, "step2"))
        else:
            other = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
            other[0].weight.untyped_storage().resize_(int(full * frac))
            before = state_digest(other[1])
            ck.load(os.path.join(folder, "step1"), TrainingState(other))
    except CkptkeeperError as exc:
        error = f"{type(exc).__name__}: {exc}"
    steps = [s for s, _ in ck.find_checkpoints(folder)]
    ck.close()
    return {"how": how, "error": error, "steps": steps,
            "untouched": other is None or state_digest(other[1]) == before}

for how in sys.argv[4:]:
    print("starting", how, flush=True)  # a crash is reported with the case it happened in
    print(json.dumps(case(how, os.path.join(root, how.replace(" ", "_")))), flush=True)
"""


@pytest.mark.parametrize("frac", [0.0, 0.5])
@pytest.mark.parametrize("writer", ["auto", "dcp"])
def test_a_tensor_whose_memory_was_shrunk_under_it_is_refused_by_name(tmp_path: Path, frac: float, writer: str) -> None:
    # One child process runs the five cases one after another (saves, a save again, async, a
    # load into the model and into an extra): a torch import per case cost the suite half a
    # minute, and a crash still names the case it happened in.
    res = subprocess.run([sys.executable, "-c", _CASES, str(frac), str(tmp_path), writer, *_HOWS],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 0, f"the process died ({res.returncode}) in {lines[-1:]}: {res.stderr[-1500:]}"
    outs = [json.loads(line) for line in lines if line.startswith("{")]
    assert [o["how"] for o in outs] == list(_HOWS), lines
    for out in outs:
        how = out["how"]
        assert ("extra.b.t" if how == "load extra" else "0.weight") in out["error"] and "storage" in out["error"], out
        assert out["untouched"], out
        assert out["steps"] == ([1, 2] if how == "again" else [1]), out
