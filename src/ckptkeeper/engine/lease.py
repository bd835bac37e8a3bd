"""One writer per save folder: a lease object that a second run finds and refuses to ignore.

Two training runs on one save folder would resume from each other's checkpoints and overwrite
each other's steps. The lease (``<save_folder>/.ckptkeeper-lease.json``) is created create-only
(``O_EXCL``-style link on local disks, ``If-None-Match``/``ifGenerationMatch=0`` on object stores),
says who holds it (owner id, host, pid) and until when, and is renewed in the background while
training runs. A run that finds it held stops at start with an error naming the holder. A lease
whose holder is gone (its expiry passed, or its process no longer exists on this host) is taken
over with a warning, so a crashed run never locks its own resume out.

This is a guard against accidents, not a consensus protocol: two runs that start within the same
instant on a store without conditional deletes could both take over one stale lease.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from ..errors import ConfigurationError, CorruptCheckpointError, SaveFolderInUseError
from ..storage import Storage, storage_for
from ..storage.layout import LEASE_FILE
from .deleter import _alive, _start_time
from .record import loads_bounded

__all__ = ["DEFAULT_TTL_S", "SaveFolderLease", "lease_ttl_from_env"]

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 300.0
"""Seconds a lease lasts without renewal (``CKPTKEEPER_LEASE_TTL``); renewed every quarter of it."""


def lease_ttl_from_env() -> float:
    """The lease lifetime from ``CKPTKEEPER_LEASE_TTL`` (seconds), default 300."""
    raw = os.environ.get("CKPTKEEPER_LEASE_TTL")
    if not raw:
        return DEFAULT_TTL_S
    try:
        ttl = float(raw)
    except ValueError:
        ttl = -1.0
    if not 1.0 <= ttl <= 86400.0 * 7:
        raise ConfigurationError(f"CKPTKEEPER_LEASE_TTL must be a number of seconds from 1 to 604800, got {raw!r}")
    return ttl


class SaveFolderLease:
    """The writer lease of one save folder. Use :meth:`acquire` / :meth:`release`, or ``with``."""

    def __init__(self, save_folder: str, ttl_s: float | None = None) -> None:
        self.save_folder = save_folder
        self.ttl_s = lease_ttl_from_env() if ttl_s is None else float(ttl_s)
        if self.ttl_s <= 0:
            raise ConfigurationError(f"'ttl_s' must be positive, got {ttl_s}")
        self.storage: Storage = storage_for(save_folder)
        self.path = self.storage.join(save_folder, LEASE_FILE)
        self.owner = uuid.uuid4().hex
        self.held = False
        self.lost = False
        """True once a renewal found the lease held by someone else (this run should stop)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ content

    def _doc(self) -> bytes:
        now = time.time()
        return json.dumps(
            {
                "format": "ckptkeeper-lease",
                "owner": self.owner,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started": _start_time(os.getpid()),
                "renewed_unix": now,
                "expires_unix": now + self.ttl_s,
            }
        ).encode()

    def _read(self) -> dict[str, Any] | None:
        try:
            doc = loads_bounded(self.storage.read_bytes(self.path), self.path, max_bytes=1 << 16, max_depth=4)
        except FileNotFoundError:
            return None
        except CorruptCheckpointError:
            return {}
        except OSError as exc:  # a folder or a FIFO where the lease should be
            raise ConfigurationError(
                f"{self.path} exists but cannot be read as a lease ({exc.strerror}); remove it, it is not ckptkeeper's"
            ) from None
        return doc if isinstance(doc, dict) else {}

    @staticmethod
    def describe(doc: dict[str, Any]) -> str:
        """Who holds a lease, in words."""
        expires = doc.get("expires_unix")
        left = f", expires in {expires - time.time():.0f}s" if isinstance(expires, (int, float)) else ""
        return (
            f"pid {doc.get('pid', '?')} on host {doc.get('host', '?')} (owner {str(doc.get('owner', '?'))[:8]}{left})"
        )

    def _gone(self, doc: dict[str, Any]) -> bool:
        expires = doc.get("expires_unix")
        if not isinstance(expires, (int, float)) or time.time() > expires:
            return True
        pid = doc.get("pid")
        if doc.get("host") == socket.gethostname() and isinstance(pid, int):
            started = doc.get("started")
            return not _alive(pid, started if isinstance(started, str) else None)
        return False

    # ------------------------------------------------------------------ life cycle

    def acquire(self) -> None:
        """Take the lease; SaveFolderInUseError names the holder when another live run has it."""
        for _ in range(2):
            try:
                self.storage.create_exclusive(self.path, self._doc())
                self.held = True
                return
            except FileExistsError:
                pass
            doc = self._read()
            if doc is None:
                continue  # released in between: try again
            if doc.get("owner") == self.owner:
                self.held = True
                return
            if not self._gone(doc):
                raise SaveFolderInUseError(
                    f"save folder {self.save_folder} is in use by another run: {self.describe(doc)}. Stop that run "
                    f"or use another save folder; a lease whose holder is gone is taken over automatically "
                    f"(after {self.ttl_s:.0f}s without renewal, or at once when its process on this host has exited)"
                )
            log.warning(
                "taking over the lease of save folder %s from %s, which is gone", self.save_folder, self.describe(doc)
            )
            self.storage.remove_file(self.path)
        raise SaveFolderInUseError(
            f"save folder {self.save_folder}: another run took the lease at the same moment; stop one of them"
        )

    def renew(self) -> bool:
        """Extend the lease; False (and ``lost``) when someone else holds it now."""
        doc = self._read()
        if doc is None or doc.get("owner") != self.owner:
            if not self.lost:
                log.error(
                    "lost the lease of save folder %s%s; this run must stop saving there",
                    self.save_folder,
                    f" to {self.describe(doc)}" if doc else "",
                )
            self.lost = True
            return False
        self.storage.write_bytes(self.path, self._doc())
        return True

    def start_renewing(self) -> None:
        """Renew in a background thread every quarter of the lifetime until :meth:`release`."""
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(self.ttl_s / 4):
                try:
                    if not self.renew():
                        return
                except Exception:
                    log.exception("renewing the lease of %s failed; will retry", self.save_folder)

        self._thread = threading.Thread(target=loop, name="ckptkeeper-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and delete the lease if this run still holds it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if not self.held:
            return
        self.held = False
        try:
            doc = self._read()
            if doc is not None and doc.get("owner") == self.owner:
                self.storage.remove_file(self.path)
        except Exception:
            log.exception("could not release the lease of %s (it expires by itself)", self.save_folder)

    def __enter__(self) -> SaveFolderLease:
        self.acquire()
        self.start_renewing()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
