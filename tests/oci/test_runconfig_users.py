"""runconfig: users resolved from an image's passwd and group files read as hostile input
(stacked layer trees, whiteouts, symlinks, sizes, malformed lines) and the OCI rules for
the command `dsec run` starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec_cli.backends.base import UserIds
from dsec_cli.core.errors import UsageError
from dsec_cli.oci import runconfig

PASSWD = b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n"
GROUP = b"root:x:0:\napp:x:1000:\ndev:x:1500:app\nops:x:1600:other,app\n"


def _layer(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


def test_names_numbers_and_groups(tmp_path: Path) -> None:
    layers = [_layer(tmp_path / "l", {"etc/passwd": PASSWD, "etc/group": GROUP})]
    app = runconfig.resolve_user("app", layers)
    assert app.ids == UserIds(1000, 1000, (1000, 1500, 1600)) and app.home == "/home/app"
    assert runconfig.resolve_user("1000", layers).ids == UserIds(1000, 1000, (1000, 1500, 1600))
    assert runconfig.resolve_user("app:dev", layers).ids == UserIds(1000, 1500, (1500,))
    assert runconfig.resolve_user("77:88", layers).ids == UserIds(77, 88, (88,))
    assert runconfig.resolve_user("77", layers).ids == UserIds(77, 0, (0,))
    for bad in ("nobody", "app:nogroup", "a:b:c", "", "x/y", "99999999999"):
        with pytest.raises(UsageError):
            runconfig.resolve_user(bad, layers)


def test_top_layer_wins_and_whiteouts_hide(tmp_path: Path) -> None:
    low = _layer(tmp_path / "low", {"etc/passwd": PASSWD})
    top = _layer(tmp_path / "top", {"etc/passwd": b"app:x:5:5::/a:/bin/sh\n"})
    assert runconfig.resolve_user("app", [top, low]).ids.uid == 5
    wh = tmp_path / "wh" / "etc"
    wh.mkdir(parents=True)
    os.mknod(wh / "passwd", 0o600 | 0o020000, os.makedev(0, 0))  # an overlay whiteout
    with pytest.raises(UsageError, match="not in the image's /etc/passwd"):
        runconfig.resolve_user("app", [tmp_path / "wh", low])


def test_hostile_files(tmp_path: Path) -> None:
    link = tmp_path / "link" / "etc"
    link.mkdir(parents=True)
    (link / "passwd").symlink_to("/etc/passwd")
    with pytest.raises(UsageError, match="symlink"):
        runconfig.resolve_user("root", [tmp_path / "link"])
    (tmp_path / "dirlink").mkdir()
    (tmp_path / "dirlink" / "etc").symlink_to("/etc")
    with pytest.raises(UsageError, match="symlink"):
        runconfig.resolve_user("0", [tmp_path / "dirlink"])
    fifo = tmp_path / "fifo" / "etc"
    fifo.mkdir(parents=True)
    os.mkfifo(fifo / "passwd")
    with pytest.raises(UsageError, match="not a regular file"):
        runconfig.resolve_user("root", [tmp_path / "fifo"])
    big = _layer(tmp_path / "big", {"etc/passwd": PASSWD + b"#" * runconfig.MAX_FILE})
    with pytest.raises(UsageError, match="more than"):
        runconfig.resolve_user("root", [big])
    grp = _layer(tmp_path / "grp", {"etc/passwd": PASSWD, "etc/group": b"dev:x:abc:app\n"})
    with pytest.raises(UsageError, match="/etc/group line 1 is malformed"):
        runconfig.resolve_user("app", [grp])


def test_command_rules() -> None:
    ep, cmd = ["/bin/sh", "-c"], ["echo hi"]
    assert runconfig.command(ep, cmd, None) == ["/bin/sh", "-c", "echo hi"]
    assert runconfig.command(ep, cmd, ["date"]) == ["/bin/sh", "-c", "date"]
    assert runconfig.command(None, cmd, None) == ["echo hi"]
    assert runconfig.command(None, None, ["ls"]) == ["ls"]
    assert runconfig.command(ep, cmd, None, "/bin/true") == ["/bin/true"]
    assert runconfig.command(ep, cmd, ["x"], "") == ["x"]
    assert runconfig.command(None, None, None) == []
    with pytest.raises(UsageError, match="oci.cmd"):
        runconfig.image_command({"oci.cmd": '{"not": "a list"}'})
