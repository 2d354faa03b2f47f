"""Root layers the backend tests run on: Debian's busybox-static as a minimal tree (what the
layer cache hands a backend)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def busybox_layer(dest: Path) -> Path:
    """A minimal root layer from Debian's busybox-static (what the layer cache will hand us)."""
    (dest / "bin").mkdir(parents=True)
    shutil.copy2("/bin/busybox", dest / "bin" / "busybox")
    applets = subprocess.run(["/bin/busybox", "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    for a in applets:
        if a != "busybox":
            os.symlink("busybox", dest / "bin" / a)
    for d in ("etc", "root", "tmp", "data/keep"):
        (dest / d).mkdir(parents=True)
    (dest / "etc" / "hello").write_text("hello from the base layer\n")
    (dest / "data" / "keep" / "old").write_text("old\n")
    return dest
