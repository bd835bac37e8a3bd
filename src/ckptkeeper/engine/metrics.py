"""One structured event per save, load and removal: to the Python logger, and as JSON lines.

Every event is logged on the ``ckptkeeper.metrics`` logger (INFO) with the fields attached to the
record as ``record.ckptkeeper_event`` (a dict), so log handlers can forward them as they are.
With ``CKPTKEEPER_METRICS=FILE`` each event is also appended to FILE as one JSON line (a
TensorBoard feeder is in ``examples/metrics_to_tensorboard.py``).

Fields: ``event`` (save | load | remove), ``time_unix``, ``path``, ``step``, ``bytes``, ``files``,
``blocked_s`` (seconds the caller waited), ``durable_s`` (seconds until committed, saves),
``seconds`` (loads and removals), ``gb_s`` (bytes / seconds / 1e9), ``retries`` (storage request
retries during the operation, where the client reports them), plus ``ephemeral`` and ``async``
for saves, and for loads ``reader`` (how tensors were read: ``fast`` single-process reader,
``pieces`` per-piece reader at any world size, ranged reads in place on object stores, ``dcp``
DCP's reader, ``download`` a local copy first) and ``fetched`` (bytes this process read from an
object store; 0 on local disks).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

__all__ = ["METRICS_ENV", "emit"]

METRICS_ENV = "CKPTKEEPER_METRICS"
log = logging.getLogger("ckptkeeper.metrics")
_LOCK = threading.Lock()


def emit(event: str, **fields: Any) -> dict[str, Any]:
    """Record one event; returns it. Writing the metrics file never fails the operation it describes."""
    doc: dict[str, Any] = {"event": event, "time_unix": time.time(), **fields}
    seconds = fields.get("durable_s", fields.get("seconds"))
    if "gb_s" not in doc and isinstance(seconds, (int, float)) and isinstance(fields.get("bytes"), int):
        doc["gb_s"] = fields["bytes"] / seconds / 1e9 if seconds > 0 else None
    log.info("%s %s", event, json.dumps(doc, default=str), extra={"ckptkeeper_event": doc})
    target = os.environ.get(METRICS_ENV)
    if target:
        line = json.dumps(doc, default=str) + "\n"
        try:
            with _LOCK, open(target, "a", encoding="utf-8") as f:
                f.write(line)
        except OSError as exc:
            log.warning("cannot append to %s=%s (%s); metrics go to the log only", METRICS_ENV, target, exc)
    return doc
