"""Folders written atomically: build in a temporary folder beside the destination, then
one rename (an earlier folder there is replaced), so a reader never sees half a result
and a crash leaves only a ``.NAME.tmp-*`` folder behind. Used by ``specc compile``
(artifacts) and ``specc extract`` (hidden-state shards)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_folder"]


@contextmanager
def atomic_folder(out: Path) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``out``; when the block ends without an
    exception, give it the usual permissions (the process umask, as ``mkdir`` / ``open``
    would) and rename it to ``out``, replacing an earlier folder there; on an exception
    delete it and re-raise. ``out.parent`` must exist (callers check it first, with
    errors naming their option)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        _make_readable(tmp)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _make_readable(root: Path) -> None:
    """mkdtemp makes a 0700 folder (and some writers 0600 files)."""
    umask = os.umask(0)
    os.umask(umask)
    for p in [root, *root.rglob("*")]:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)
