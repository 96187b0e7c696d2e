"""One live process per disk-tier folder: a claim is an exclusive `flock` on a file in the
folder, held while the claim's descriptor is open, so the kernel lets it go when the
process exits, however it exits (a SIGKILLed worker's folder is free for its restart).
`first_free` takes the first of `<folder>`, `<folder>.1`, `<folder>.2`, ... that no live
process holds (each live worker of one identity then has a folder, and a budget, of its
own)."""

from __future__ import annotations

import fcntl
import itertools
import os
from dataclasses import dataclass
from pathlib import Path

CLAIM_FILE = ".claim"


@dataclass
class FolderClaim:
    folder: Path
    fd: int

    @classmethod
    def first_free(cls, folder: Path) -> FolderClaim:
        for n in itertools.count():
            candidate = folder if n == 0 else folder.with_name(f"{folder.name}.{n}")
            candidate.mkdir(parents=True, exist_ok=True)
            fd = os.open(candidate / CLAIM_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return cls(candidate, fd)
        raise AssertionError("unreachable")

    def release(self) -> None:
        os.close(self.fd)  # (closing the descriptor releases the lock)
