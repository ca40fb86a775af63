"""Files deeppool keeps for itself (cached profiles, background checkpoints): written for this user
only, and read back only when no other user could have written them."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_privately(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write `path` with `write` atomically (a fresh temp file renamed over it, so readers never see
    half a file), readable by this user only; a missing folder is made for this user only."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0o600
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def open_own(path: Path) -> BinaryIO:
    """`path` opened for reading; PermissionError where another user owns it or may write it (checked
    on the opened file, so it cannot be swapped after the check)."""
    file = open(path, "rb")  # noqa: SIM115 - returned open
    found = os.fstat(file.fileno())
    if found.st_uid != os.geteuid() or found.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        file.close()
        raise PermissionError(
            f"{path} is owned by uid {found.st_uid} with mode {stat.filemode(found.st_mode)}: only files "
            "of this user that no other user may write are trusted"
        )
    return file
