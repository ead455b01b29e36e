"""``specc.atomic.atomic_folder``: all or nothing, an earlier folder replaced, usual permissions."""

from __future__ import annotations

import os
import stat

import pytest

from specc.atomic import atomic_folder


def test_success_replaces_earlier_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with atomic_folder(out) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.tmp-")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "new.txt").write_text("new")
        assert (out / "old.txt").exists()  # nothing visible before the block ends
    assert sorted(p.name for p in out.rglob("*")) == ["new.txt", "sub"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp or old folder left
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    assert stat.S_IMODE((out / "sub" / "new.txt").stat().st_mode) == 0o666 & ~umask


def test_failure_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_folder(out) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (out / "keep.txt").read_text() == "keep"
