"""Import-only stand-in for torchvision, put on PYTHONPATH by ``e2 probe`` only when
the venv has none (``e2 env`` removes it from CPU venvs).

vLLM's Qwen3.5 module imports Qwen2-VL image helpers from transformers, which
import torchvision at module level. The probe only reads class methods of the
model class and never runs vision code, so any name resolves to an inert
placeholder; calling into one is a bug and would show up as a wrong value.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence

__version__ = "0+e2probe.stub"


class _Placeholder:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, item: str) -> _Placeholder:
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self._name}.{item}")

    def __call__(self, *args: object, **kwargs: object) -> _Placeholder:
        return _Placeholder(f"{self._name}()")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)  # lets module-level subclasses of a stub class be defined

    def __repr__(self) -> str:
        return f"<torchvision stub {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, item: str) -> _Placeholder:
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self.__name__}.{item}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _StubModule
