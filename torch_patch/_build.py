"""setuptools hook: ships ``slurm_antman_torch_patch.pth`` at the top of site-packages.

A ``.pth`` file only runs if it sits directly in a site directory, which package data cannot do.
For a normal build, ``build_py`` copies it to the root of the build tree (the wheel's purelib). For an
editable install (PEP 660) setuptools builds into a throw-away folder and puts only its own finder in
the wheel; there the file goes straight into the unpacked editable wheel (``install_lib``), which is
where setuptools also writes its own ``__editable__`` .pth. Wired in pyproject.toml through
``[tool.setuptools.cmdclass]``.
"""

from __future__ import annotations

import os

from setuptools.command.build_py import build_py as _build_py

PTH_NAME = "slurm_antman_torch_patch.pth"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH_NAME)


class build_py(_build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(_SOURCE, os.path.join(self.build_lib, PTH_NAME), preserve_mode=False)
        if getattr(self, "editable_mode", False):
            wheel_root = self.distribution.get_command_obj("install").install_lib
            if wheel_root:
                os.makedirs(wheel_root, exist_ok=True)
                self.copy_file(_SOURCE, os.path.join(wheel_root, PTH_NAME), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH_NAME)]
