"""Leaf service: the CUDA driver (load cubins, look up entry points, launch). Imported lazily: it needs
cuda-python, and only code that runs kernels needs it."""

from .driver import CudaError, Function, Module, ensure_context

__all__ = ["CudaError", "Function", "Module", "ensure_context"]
