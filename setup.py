"""The package build's compiled parts (the rest of the build is declared in pyproject.toml).

Every C extension is optional: where a compiler or Python's headers are missing, the build
warns and carries on, and dsec runs the module's Python twin (`dsec node check --host` says
which are live). The in-sandbox agent is compiled too, statically, next to its source with
the tag of that source beside it, so a wheel ships it and an editable install finds it; where
it does not build, dsec compiles it into the data directory on first use.

The build's scratch (``build/``, ``*.egg-info``) goes to a temporary directory, not the source
tree: `pip install .` and `pip wheel .` leave the checkout as they found it.
"""

from __future__ import annotations

import atexit
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

AGENT_DIR = "dsec_cli/backends/sandbox_agent"
AGENT_SOURCE = f"{AGENT_DIR}/dsec-agent.c"
AGENT_TAG_FILE = ".dsec-agent.tag"  # as sandbox_agent.TAG_FILE reads it


def _extension(source: str) -> Extension:
    module = source.removesuffix(".c").replace("/", ".")
    return Extension(module, [source], optional=True,
                     extra_compile_args=["-O2", "-Wall"])


#: every ``_name.c`` in the package is an extension module of that name (core/compiled.py
#: lists them with what runs without each; tests/core/test_compiled.py checks both agree)
EXTENSIONS = [_extension(p) for p in sorted(glob.glob("dsec_cli/**/_*.c", recursive=True))]


class BuildCompiled(build_ext):
    """The optional extensions, then the static agent (also optional)."""

    def run(self) -> None:
        super().run()
        self._build_agent()

    def _agent_dir(self) -> str:
        # in place for an editable install (build_ext copies its modules there too)
        return AGENT_DIR if self.inplace or getattr(self, "editable_mode", False) \
            else os.path.join(self.build_lib, AGENT_DIR)

    def _build_agent(self) -> None:
        with open(AGENT_SOURCE, "rb") as f:
            tag = hashlib.sha256(f.read()).hexdigest()[:12]  # sandbox_agent.agent_tag()
        out = os.path.join(self._agent_dir(), "dsec-agent")
        stamp = os.path.join(self._agent_dir(), AGENT_TAG_FILE)
        if os.path.isfile(out) and os.path.isfile(stamp):
            with open(stamp) as f:
                if f.read().strip() == tag:
                    return
        os.makedirs(self._agent_dir(), exist_ok=True)
        cc = os.environ.get("CC", "gcc").split()
        cmd = [*cc, "-static", "-O2", "-Wall", "-o", out + ".tmp", AGENT_SOURCE]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as e:
            err = getattr(e, "stderr", None) or str(e)
            self.warn(f"the in-sandbox agent did not build ({err.strip()[-500:]}); dsec "
                      "compiles it into the data directory on first use")
            return
        os.replace(out + ".tmp", out)
        with open(stamp, "w") as f:
            f.write(tag + "\n")

    def get_outputs(self) -> list[str]:
        agent = [os.path.join(self._agent_dir(), n) for n in ("dsec-agent", AGENT_TAG_FILE)]
        return super().get_outputs() + [p for p in agent if os.path.isfile(p)]


_SCRATCH = tempfile.mkdtemp(prefix="dsec-build-")
atexit.register(shutil.rmtree, _SCRATCH, True)

setup(
    ext_modules=EXTENSIONS,
    cmdclass={"build_ext": BuildCompiled},
    options={"build": {"build_base": os.path.join(_SCRATCH, "build")},
             "egg_info": {"egg_base": _SCRATCH}},
)
