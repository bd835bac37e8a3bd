"""How much a file write costs in memory the host has taken back: a probe of the machine, not of ckptkeeper.

Why it exists: on a virtual machine whose balloon device reports free pages to the host (Linux
``virtio_balloon`` with free page reporting, as on the development machine), memory the guest
freed a moment ago may have been handed back, and the next writer to touch it (a save copying
tensors into the page cache, a load filling new tensors) pays the host's page faults as kernel
time. Whatever ran before a timed region then changes its result: in ``ckptkeeper bench`` the
many-tensor save runs right after DCP's long many-tensor round in every other repeat, and its
writes took several times longer there. This script shows the effect in isolation, with plain
``pwritev`` calls.

It writes ``--mib`` MiB to a file (fsync'd, then deleted) in two conditions, ``--rounds`` times each:

- ``fresh``: after touching and freeing ``--churn-mib`` MiB of anonymous memory, then waiting
  ``--wait`` seconds (time for the guest to report the freed pages);
- ``reused``: at once after the previous write's file was deleted (its page-cache pages are free
  and still backed);
- and prints one JSON object: the median wall and kernel (system) seconds of each, and their ratio.

Run: ``python benchmarks/page_cost.py [--mib 256] [--churn-mib 2048] [--wait 5] [--rounds 3]``.
On bare metal (or without free page reporting) both conditions cost about the same.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import statistics
import tempfile
import time
from typing import Any

_CHUNK = 4 << 20


def _write(path: str, mib: int, chunk: memoryview) -> tuple[float, float]:
    """(wall, system) seconds to write ``mib`` MiB to ``path`` and fsync it."""
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        for i in range(max(1, (mib << 20) // _CHUNK)):
            os.pwritev(fd, [chunk], i * _CHUNK)
        os.fsync(fd)
    finally:
        os.close(fd)
    wall = time.perf_counter() - t0
    return wall, resource.getrusage(resource.RUSAGE_SELF).ru_stime - r0.ru_stime


def _churn(mib: int) -> None:
    """Touch ``mib`` MiB of anonymous memory page by page, then give it back."""
    m = mmap.mmap(-1, mib << 20)
    try:
        for at in range(0, mib << 20, mmap.PAGESIZE):
            m[at] = 1
    finally:
        m.close()


def measure(mib: int, churn_mib: int, wait: float, rounds: int, folder: str | None = None) -> dict[str, Any]:
    """Run the probe (see the module's docstring); returns the report."""
    chunk = memoryview(bytearray(os.urandom(_CHUNK)))
    runs: dict[str, list[tuple[float, float]]] = {"fresh": [], "reused": []}
    with tempfile.TemporaryDirectory(prefix="ckptkeeper-page-cost-", dir=folder) as d:
        path = os.path.join(d, "probe")
        for _ in range(rounds):
            _churn(churn_mib)
            time.sleep(wait)
            if hasattr(os, "sync"):
                os.sync()
            runs["fresh"].append(_write(path, mib, chunk))
            os.unlink(path)
            runs["reused"].append(_write(path, mib, chunk))
            os.unlink(path)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(s for _, s in v)) for k, v in runs.items()}
    return {
        "mib": mib,
        "churn_mib": churn_mib,
        "wait_s": wait,
        "rounds": rounds,
        "fresh_wall_s": round(med["fresh"][0], 4),
        "fresh_system_s": round(med["fresh"][1], 4),
        "reused_wall_s": round(med["reused"][0], 4),
        "reused_system_s": round(med["reused"][1], 4),
        "fresh_vs_reused_wall": round(med["fresh"][0] / max(med["reused"][0], 1e-9), 2),
        "fresh_vs_reused_system": round(med["fresh"][1] / max(med["reused"][1], 1e-9), 2),
    }


def main(argv: list[str] | None = None) -> int:
    """Command line: print the report as JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB written per measurement (default 256)")
    ap.add_argument("--churn-mib", type=int, default=2048, help="MiB touched and freed first (default 2048)")
    ap.add_argument("--wait", type=float, default=5.0, help="seconds to wait after freeing (default 5)")
    ap.add_argument("--rounds", type=int, default=3, help="measurements per condition (default 3)")
    ap.add_argument("--folder", default=None, help="where to write (default: the system temp folder)")
    args = ap.parse_args(argv)
    if args.mib < 1 or args.churn_mib < 1 or args.wait < 0 or args.rounds < 1:
        ap.error("--mib, --churn-mib and --rounds must be at least 1, --wait at least 0")
    print(json.dumps(measure(args.mib, args.churn_mib, args.wait, args.rounds, args.folder)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
