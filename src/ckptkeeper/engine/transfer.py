"""Copying checkpoints between stores: verified on the way, committed record-last at the destination.

A copy is a save without a model: every file is read once, its checksum checked against the
source's commit record, written to the destination, and the record is published last (local
disk: into ``.tmp-step{N}-{id}`` then renamed into place; object stores: announced by an intent
object, uploaded, then the record created create-only). A copy that fails leaves nothing
visible at the destination. OLMo-core checkpoints (no checksums) are copied file by file with
sizes checked, their marker last.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable

from ..errors import ConfigurationError, CorruptCheckpointError
from ..storage import Storage, storage_for
from ..storage.layout import COMMIT_RECORD, parse_step, scratch_name, step_dir_name
from ..storage.local import fsync_dir, translate_os_error
from . import discovery
from .deleter import clean_leftover, new_spool, write_intent
from .record import FileEntry, hash_file

__all__ = ["copy_checkpoint"]

log = logging.getLogger(__name__)


def _source_files(src: str) -> tuple[dict[str, FileEntry | int], bytes]:
    """(files to copy -> record entry, or just a size where there are no checksums; marker bytes)."""
    storage = storage_for(src)
    try:
        marker = storage.read_bytes(storage.join(src, COMMIT_RECORD))
    except FileNotFoundError:
        discovery.read_record(src)  # raises the precise "no complete checkpoint" error
        raise
    if not _is_olmo_marker(marker):
        record = discovery.verify(src, checksums=False)
        return dict(record.files), marker
    discovery.verify(src)  # OLMo-core: structure and sizes (there are no checksums to check)
    return {f.relpath: f.size for f in storage.walk(src) if f.relpath != COMMIT_RECORD}, marker


def _is_olmo_marker(data: bytes) -> bool:
    try:
        doc = json.loads(data[:4096])
    except ValueError:
        return False
    return isinstance(doc, dict) and set(doc) == {"ephemeral", "version"}


def copy_checkpoint(
    src: str, dst_folder: str, advance: Callable[[int], None] | None = None, spool_dir: str | None = None
) -> tuple[str, bool]:
    """Copy the checkpoint at ``src`` into the save folder ``dst_folder``; returns its new path, and
    whether anything was copied (False: an identical checkpoint was there already).

    The destination keeps the ``step{N}`` name. An identical checkpoint already there is left as it
    is; a different one (or anything else named ``step{N}``) is an error, never overwritten.
    """
    src = src.rstrip("/")
    step = parse_step(src.rsplit("/", 1)[-1])
    if step is None:
        raise ConfigurationError(f"{src} is not a checkpoint folder (step{{N}}); pass a step folder or a save folder")
    files, marker = _source_files(src)
    dst: Storage = storage_for(dst_folder)
    final = dst.join(dst_folder, step_dir_name(step))
    final_local = dst.local_path(final)
    if final_local is not None and os.path.islink(final_local):
        # A link to the source passed for a copy of it (found by an outside attack): a copy is a
        # folder of its own.
        raise ConfigurationError(
            f"{final} is a symbolic link (to {os.readlink(final_local)}), not a copy; remove the link and copy again"
        )
    if _same_folder(storage_for(src).local_path(src), final_local):
        # The same folder by another spelling (a linked save folder, "a" and "./a/") passed for a
        # copy of itself (found by an outside attack).
        raise ConfigurationError(
            f"{final} is {src} itself (the same folder by another path), not a copy; copy to another save folder"
        )
    if _exists(dst, final):
        try:
            same = dst.read_bytes(dst.join(final, COMMIT_RECORD)) == marker and discovery.inspect(final)[1] is None
        except FileNotFoundError:
            same = False
        if same:
            # The same record is not yet the same bytes: a damaged copy there (the very copy a
            # "restore it from a copy" may reach for) was reported as already held (found by an
            # outside attack). Checked whole, as a copy is once written.
            try:
                discovery.verify(final)
            except CorruptCheckpointError as exc:
                raise ConfigurationError(
                    f"{final} holds this checkpoint's record but its files do not verify ({exc}); remove it "
                    f"(ckptkeeper rm {final}) and copy again"
                ) from None
            log.info("%s already holds this checkpoint; left as it is", final)
            return final, False
        raise ConfigurationError(
            f"{final} already exists and differs from {src}; remove it first (ckptkeeper rm) or copy elsewhere"
        )
    src_storage = storage_for(src)
    src_local = src_storage.local_path(src)
    token = uuid.uuid4().hex[:8]
    dst_local = dst.local_path(dst_folder)
    work = os.path.join(dst_local, scratch_name("tmp", step, token)) if dst_local is not None else None
    spool = new_spool(spool_dir, "copy")
    try:
        if work is None:
            write_intent(dst, final, 0, sorted(files), token)
        for rel in sorted(files):
            entry = files[rel]
            if src_local is not None:
                here = os.path.join(src_local, rel)
            else:
                here = os.path.join(spool, rel.replace("/", "__"))
                src_storage.download(src_storage.join(src, rel), here)
            size, digest = hash_file(here, follow_links=False)
            want = entry if isinstance(entry, FileEntry) else FileEntry(entry, "")
            discovery.check_file(src, rel, want, size, digest if isinstance(entry, FileEntry) else None)
            if work is not None:
                target = os.path.join(work, rel)
                with translate_os_error(target):
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    shutil.copyfile(here, target)
                    with open(target, "rb+") as f:
                        os.fsync(f.fileno())
            else:
                dst.upload(here, dst.join(final, rel))
            if src_local is None:
                os.unlink(here)  # the spool holds one file at a time
            if advance is not None:
                advance(size)
        if work is not None:
            dst.write_bytes(os.path.join(work, COMMIT_RECORD), marker)
            os.rename(work, dst.local_path(final) or final)
            fsync_dir(dst_local or ".")
        else:
            dst.create_exclusive(dst.join(final, COMMIT_RECORD), marker)
    except BaseException:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            with contextlib.suppress(Exception):
                clean_leftover(dst, final)
        raise
    finally:
        shutil.rmtree(spool, ignore_errors=True)
    discovery.verify(final)
    return final, True


def _exists(storage: Storage, path: str) -> bool:
    local = storage.local_path(path)
    if local is not None:
        return os.path.lexists(local)
    return bool(storage.list_dir(path))


def _same_folder(a: str | None, b: str | None) -> bool:
    """Whether two local paths are one folder, however spelled (None: not local)."""
    return a is not None and b is not None and os.path.isdir(a) and os.path.isdir(b) and os.path.samefile(a, b)
