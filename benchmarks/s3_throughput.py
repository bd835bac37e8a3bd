"""Upload and download throughput to a local S3 server: ckptkeeper's S3 backend beside boto3.

Starts ``moto_server`` on 127.0.0.1, writes the same random files for both sides, and measures,
interleaved and repeated (medians reported), in one run:

- ours: the checkpointer's way of moving a checkpoint's files (``S3Storage.upload``/``download``,
  files in parallel, 8 MiB parts, 10 parts in flight per file);
- boto3: ``upload_fileobj`` / ``download_fileobj`` with boto3's default transfer settings, one
  file after another (what a training script usually writes).

Usage: ``python benchmarks/s3_throughput.py [--repeats 3] [--json]``. Absolute numbers depend on
moto (a Python server) and this machine; compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.servers import MotoServer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    server = MotoServer()
    try:
        env = {
            "AWS_ENDPOINT_URL": server.url,
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        os.environ.update(env)
        import boto3

        from ckptkeeper.storage import storage_for

        client = boto3.client("s3")
        client.create_bucket(Bucket="bench")
        ours = storage_for("s3://bench/x")
        results: dict[str, dict[str, float]] = {}
        with tempfile.TemporaryDirectory() as tmp:
            shapes = {"1 x 160 MiB": [160], "4 x 32 MiB": [32, 32, 32, 32]}
            for label, sizes in shapes.items():
                files = []
                for i, mib in enumerate(sizes):
                    p = Path(tmp) / f"{label.replace(' ', '')}-{i}.bin"
                    p.write_bytes(os.urandom(mib << 20))
                    files.append(p)
                total = sum(p.stat().st_size for p in files)
                times: dict[str, list[float]] = {"ours_up": [], "boto_up": [], "ours_down": [], "boto_down": []}
                for r in range(args.repeats):
                    t = time.perf_counter()
                    with ThreadPoolExecutor(max_workers=8) as pool:
                        list(pool.map(lambda p, r=r: ours.upload(str(p), f"s3://bench/ours/{r}/{p.name}"), files))
                    times["ours_up"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    for p in files:
                        with open(p, "rb") as f:
                            client.upload_fileobj(f, "bench", f"boto/{r}/{p.name}")
                    times["boto_up"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    with ThreadPoolExecutor(max_workers=8) as pool:
                        list(
                            pool.map(
                                lambda p, r=r: ours.download(f"s3://bench/ours/{r}/{p.name}", str(p) + ".ours"), files
                            )
                        )
                    times["ours_down"].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    for p in files:
                        with open(str(p) + ".boto", "wb") as f:
                            client.download_fileobj("bench", f"boto/{r}/{p.name}", f)
                    times["boto_down"].append(time.perf_counter() - t)
                    for p in files:
                        assert Path(str(p) + ".ours").read_bytes() == p.read_bytes()
                med = {k: statistics.median(v) for k, v in times.items()}
                results[label] = {
                    "bytes": total,
                    **{f"{k}_s": v for k, v in med.items()},
                    "upload_ratio": med["boto_up"] / med["ours_up"],
                    "download_ratio": med["boto_down"] / med["ours_down"],
                }
        if args.json:
            print(json.dumps(results, indent=1))
        else:
            head = ["ours up", "boto3 up", "ratio", "ours down", "boto3 down", "ratio"]
            print(f"{'files':<14}" + "".join(f"{h:>12}" for h in head))
            for label, r in results.items():
                mb = r["bytes"] / 1e6
                cells = [
                    f"{mb / r['ours_up_s']:.0f} MB/s",
                    f"{mb / r['boto_up_s']:.0f} MB/s",
                    f"{r['upload_ratio']:.2f}x",
                    f"{mb / r['ours_down_s']:.0f} MB/s",
                    f"{mb / r['boto_down_s']:.0f} MB/s",
                    f"{r['download_ratio']:.2f}x",
                ]
                print(f"{label:<14}" + "".join(f"{c:>12}" for c in cells))
            print("ratio = ours / boto3 throughput (>= 0.8 is the target); medians of", args.repeats)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
