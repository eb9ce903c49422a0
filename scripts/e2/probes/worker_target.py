"""The target GPU of the capacity worker: vLLM's CUDA platform at a compute
capability, on the CPU, and the attention backend vLLM's selection picks there.

Runs inside the vLLM venv beside capacity_worker.py, which imports it as a
top-level module (the script's folder is on sys.path; the venv has no e2
package): stdlib and vllm imports only.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any


class ProbeInputError(Exception):
    """Bad input the driver reports as a user error (exit status 2)."""

    def __init__(self, message: str, **extra: Any):
        super().__init__(message)
        self.extra = extra


# Compiled parts of the CUDA engine image that the CPU wheel lacks but whose
# presence vLLM's selection code checks: the CUDA platform's op library (imported
# at module level) and the FlashAttention 2/3 extensions; FA4 is Python files the
# image ships (``_vllm_fa4_cutedsl_C`` in cmake/external_projects/vllm_flash_attn.cmake).
IMAGE_EXTENSIONS = ("vllm._C_stable_libtorch", "vllm.vllm_flash_attn._vllm_fa2_C",
                    "vllm.vllm_flash_attn._vllm_fa3_C")


def parse_capability(text: str) -> tuple[int, int]:
    try:
        major, minor = (int(x) for x in text.split("."))
    except ValueError:
        raise ProbeInputError(f"--capability {text}: expected MAJOR.MINOR, "
                              "e.g. 8.6") from None
    return major, minor


def load_model_classes(archs: list[str]) -> None:
    """Import the model's module on the CPU platform: on a CUDA platform its
    imports call compiled CUDA ops that the CPU wheel does not have."""
    from vllm.model_executor.models import ModelRegistry

    for arch in archs:
        ModelRegistry._try_load_model_cls(arch)


def emulate_cuda(capability: str) -> Any:
    """Make vLLM's CUDA platform, at ``capability``, the current platform.

    Every loaded vLLM module that bound the CPU platform is pointed at it too, so
    all of vLLM sees one platform, as on a CUDA host. Only the device query is
    replaced; every choice below it (backend priorities, FA version, kernel block
    sizes) is vLLM's own code reading that capability.
    """
    import types

    major, minor = parse_capability(capability)
    for name in IMAGE_EXTENSIONS:
        sys.modules.setdefault(name, types.ModuleType(name))
    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability

    target = DeviceCapability(major, minor)

    class TargetCudaPlatform(CudaPlatformBase):
        # The target host has a GPU for every rank of the run (set per run).
        num_gpus = 1

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return target

        @classmethod
        def device_count(cls) -> int:
            return cls.num_gpus

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return f"CUDA device of compute capability {capability} (planned on the CPU)"

    platform = TargetCudaPlatform()
    previous = platforms.current_platform
    platforms._current_platform = platform
    platforms.current_platform = platform
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.") and getattr(module, "current_platform", None) is previous:
            # a vLLM module's own binding, which ModuleType does not declare
            module.current_platform = platform  # type: ignore[attr-defined]
    # Attention backends loaded with the model ran their platform branches on the
    # CPU platform (fa_utils imports its CUDA kernels only on CUDA): run them again.
    for name in [n for n in sys.modules if n.startswith("vllm.v1.attention.backends.")]:
        importlib.reload(sys.modules[name])
    import vllm.vllm_flash_attn.flash_attn_interface as fa_interface

    fa_interface.FA4_AVAILABLE, fa_interface.FA4_UNAVAILABLE_REASON = True, None
    # The target's image has Triton, so vLLM picks its model runner as there
    # (VllmConfig.use_v2_model_runner): the runner's block tables are part of
    # what the planner budgets.
    import vllm.config.vllm as config_module

    config_module.HAS_TRITON = True
    return platform


def select_backend(vllm_config: Any) -> tuple[Any, dict]:
    """The attention backend a decoder attention layer of this model gets at boot,
    with the candidates and why the others were rejected."""
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.selector import AttentionSelectorConfig, get_attn_backend

    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    head_size = model_config.get_head_size()
    with set_current_vllm_config(vllm_config):
        # Attention.__init__ passes the default dtype, which is the model's.
        backend = get_attn_backend(head_size, model_config.dtype, cache_config.cache_dtype)
        selector = AttentionSelectorConfig(
            head_size=head_size, dtype=model_config.dtype,
            kv_cache_dtype=cache_config.cache_dtype, block_size=None,
            use_batch_invariant=False)
        valid, rejected = current_platform.get_valid_backends(
            current_platform.get_device_capability(), selector)
        sizes = backend.get_supported_kernel_block_sizes()
        preferred = backend.get_preferred_block_size(cache_config.DEFAULT_BLOCK_SIZE)
    chosen = next((c for c in valid if c.backend_class is backend), None)
    # A package the engine image has but this venv lacks would hide a backend of
    # higher priority and change the choice: refuse rather than record a wrong one.
    missing = {b.name: r for b, (priority, r) in rejected.items()
               if chosen is not None and priority < chosen.priority
               and any(x.startswith(("ImportError", "ModuleNotFoundError", "OSError"))
                       for x in r)}
    if missing:
        raise RuntimeError(f"backends of higher priority than {backend.get_name()} could "
                           f"not be imported here: {missing}")
    capability = current_platform.get_device_capability()
    return backend, {
        "name": backend.get_name(),
        "class": f"{backend.__module__}.{backend.__qualname__}",
        "capability": f"{capability.major}.{capability.minor}",
        "kernel_block_sizes": [f"MultipleOf({s.base})" if isinstance(s, MultipleOf)
                               else s for s in sizes],
        "preferred_block_size": preferred,
        "candidates": [c.backend.name for c in sorted(valid, key=lambda c: c.priority)],
        "rejected": {b.name: r for b, (_, r) in rejected.items()},
    }
