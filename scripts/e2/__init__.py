"""vLLM E2: a numbered patch series on a pinned vLLM release, and its build driver."""

import os

__version__ = "0.1.0"

# gitpython looks for git when it is imported and, without git on PATH, raises from the
# import itself: `e2 --help` would be a traceback. Quiet, the import succeeds and the
# verbs that need git refuse in one line (e2.gitops.require_git).
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
