"""Leaf service: the CUDA toolchain (nvcc probe, arch) and ninja builds."""

from .ninja_build import (CUBIN, RESOURCE_LOG, SOURCE, CompileError, nvcc_flags, run_ninja, write_build_ninja,
                          write_source)
from .toolchain import Nvcc, ToolchainError, choose_arch, device_arch, find_nvcc, normalize_arch, nvcc_identity

__all__ = [
    "CUBIN", "RESOURCE_LOG", "SOURCE", "CompileError", "nvcc_flags", "run_ninja", "write_build_ninja",
    "write_source", "Nvcc",
    "ToolchainError", "choose_arch", "device_arch", "find_nvcc", "normalize_arch", "nvcc_identity",
]
