"""vLLM E2: a numbered patch series on a pinned vLLM release, and its build driver."""

__version__ = "0.1.0"
