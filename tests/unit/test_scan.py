"""Registration's directory listing: confinement, special files, limits."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from tierckpt.service.checkpoints.scan import scan
from tierckpt.service.errors import BadInput


def do_scan(path: Path | str, root: Path, max_files: int = 1000):  # type: ignore[no-untyped-def]
    return scan(str(path), [root], max_files=max_files, max_path_length=1024)


def make(root: Path, files: dict[str, bytes]) -> None:
    for relative, content in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(content)


def test_lists_nested_files_with_sizes_without_reading(tmp_path: Path) -> None:
    make(tmp_path / "c", {"a/b/x.bin": b"123", "empty": b"", "é.txt": b"e"})
    shard = do_scan(tmp_path / "c", tmp_path)
    assert [(f.path, f.size) for f in shard.files] == [("a/b/x.bin", 3), ("empty", 0), ("é.txt", 1)]
    assert shard.total_bytes == 4 and shard.directory == (tmp_path / "c").resolve()


def test_single_file_checkpoint(tmp_path: Path) -> None:
    make(tmp_path, {"model.pt": b"w"})
    shard = do_scan(tmp_path / "model.pt", tmp_path)
    assert shard.directory == tmp_path.resolve() and [f.path for f in shard.files] == ["model.pt"]


def test_symlink_inside_root_is_followed_but_not_outside(tmp_path: Path) -> None:
    root = tmp_path / "root"
    make(root, {"shared/blob": b"abc", "c/w": b"1"})
    (root / "c" / "link").symlink_to(root / "shared" / "blob")
    assert {f.path: f.size for f in do_scan(root / "c", root).files} == {"link": 3, "w": 1}

    make(tmp_path, {"secret": b"s"})
    (root / "c" / "evil").symlink_to(tmp_path / "secret")
    with pytest.raises(BadInput) as error:
        do_scan(root / "c", root)
    assert error.value.code == "symlink_outside_roots" and "evil" in error.value.message


def test_directory_symlink_escaping_the_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "ckpt").symlink_to(tmp_path)
    with pytest.raises(BadInput) as error:
        do_scan(root / "ckpt", root)
    assert error.value.code == "path_outside_roots"


@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_special_files_are_refused_by_name_without_opening(tmp_path: Path, kind: str) -> None:
    make(tmp_path / "c", {"w": b"1"})
    special = tmp_path / "c" / "special"
    with socket.socket(socket.AF_UNIX) as server:
        if kind == "fifo":
            os.mkfifo(special)
        else:
            server.bind(str(special))
        with pytest.raises(BadInput) as error:
            do_scan(tmp_path / "c", tmp_path)
    assert error.value.code == "special_file" and "special" in error.value.message


@pytest.mark.parametrize(
    ("path", "code"),
    [("relative", "path_not_absolute"), ("/nonexistent-root/x", "path_outside_roots")],
)
def test_path_errors(tmp_path: Path, path: str, code: str) -> None:
    with pytest.raises(BadInput) as error:
        do_scan(path, tmp_path)
    assert error.value.code == code


def test_limits_and_names(tmp_path: Path) -> None:
    make(tmp_path / "many", {f"f{i}": b"" for i in range(5)})
    with pytest.raises(BadInput, match="more than 3 files"):
        do_scan(tmp_path / "many", tmp_path, max_files=3)
    (tmp_path / "empty-dir").mkdir()
    with pytest.raises(BadInput, match="no files"):
        do_scan(tmp_path / "empty-dir", tmp_path)
    make(tmp_path / "odd", {"bad\nname": b"x"})
    with pytest.raises(BadInput, match="control character"):
        do_scan(tmp_path / "odd", tmp_path)
    with pytest.raises(BadInput, match="does not exist"):
        do_scan(tmp_path / "missing", tmp_path)
