"""The exception tree of ckptkeeper.

Every error the library raises on purpose derives from :class:`CkptkeeperError`, so callers can
catch at whatever level they care about: all of ckptkeeper, every checkpoint problem, or one
precise failure. Messages name the problem *and* the fix.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CkptkeeperError",
    "ConfigurationError",
    "CorruptCheckpointError",
    "DiskFullError",
    "NewerFormatError",
    "SaveFolderInUseError",
    "StorageAccessError",
    "StorageError",
    "UnsafeCheckpointError",
]


class CkptkeeperError(Exception):
    """Base class of every error ckptkeeper raises on purpose."""


class ConfigurationError(CkptkeeperError, ValueError):
    """An invalid setting; the message names the field and the rule it broke."""


class CheckpointError(CkptkeeperError):
    """A problem with one checkpoint (finding, reading, verifying or writing it)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint where one was asked for."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint whose files do not match its commit record (missing, wrong size, wrong checksum)."""


class NewerFormatError(CorruptCheckpointError):
    """A checkpoint written by a newer ckptkeeper, in a format this one does not read.

    Intact as far as this version can tell (its commit record's own checksum holds), so it is not
    treated as damage: resume refuses to fall back past it, because the older checkpoint's run
    would save the same steps again and replace it. The fix is to upgrade ckptkeeper (or to move
    the checkpoint out of the save folder). A subclass of :class:`CorruptCheckpointError` so that
    code which skips checkpoints it cannot load skips this one too.
    """


class UnsafeCheckpointError(CorruptCheckpointError):
    """A checkpoint file that would execute code when loaded; it is refused, never executed."""


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed; the message names the step and, where known, the file."""


class StorageError(CkptkeeperError):
    """A storage backend could not do what was asked."""


class StorageAccessError(StorageError):
    """The save folder cannot be reached: missing bucket, rejected credentials, no permission."""


class DiskFullError(StorageError, OSError):
    """The target ran out of space; nothing already saved was touched."""


class SaveFolderInUseError(StorageError):
    """Another live run holds the save folder's writer lease; the message names it."""


class CheckpointMismatchError(ConfigurationError, CheckpointError):
    """An intact checkpoint that does not fit the state it is loaded into.

    Raised (with ``strict=True``, the default) before anything is changed, naming each key that is
    missing, unexpected or of another shape (with the checkpoint's and this model's shapes), and
    the fix. It is both a :class:`ConfigurationError` (the code built another model than the one
    saved) and a :class:`CheckpointError` (what loads used to raise for it), so existing handlers
    keep working; resuming does not fall back to an older checkpoint for it, since no checkpoint of
    that run would fit either.
    """
