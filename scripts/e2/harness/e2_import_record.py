"""e2_import_record: what a pytest run imported, for ``e2 test kit``.

Loaded with ``-p e2_import_record`` and ``E2_IMPORT_RECORD=<file>``. When the
session ends it writes that file (JSON): every installed distribution a loaded
module came from, with its version, and every loaded module file under pytest's
rootdir (the test files, conftests and the test helpers they import). The kit
carries exactly those, so what it runs elsewhere is what ran here.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from pathlib import Path

import pytest

RECORD = "E2_IMPORT_RECORD"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    target = os.environ.get(RECORD)
    if not target:
        return
    root = session.config.rootpath.resolve()
    by_package = importlib.metadata.packages_distributions()
    distributions: dict[str, str] = {}
    files: set[str] = set()
    for name, module in list(sys.modules.items()):
        for distribution in by_package.get(name.partition(".")[0], ()):
            distributions[distribution] = importlib.metadata.version(distribution)
        # some extension modules name a bare file, relative to nothing
        origin = getattr(module, "__file__", None)
        if origin and Path(origin).is_absolute() and Path(origin).is_file():
            path = Path(origin).resolve()
            if path.is_relative_to(root):
                files.add(str(path.relative_to(root)))
    Path(target).write_text(json.dumps(
        {"distributions": dict(sorted(distributions.items())), "files": sorted(files),
         "exitstatus": int(exitstatus)}, indent=1))
