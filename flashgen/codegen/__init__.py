"""Spec -> template context -> rendered CUDA source. Imports ``spec`` only."""

from . import decode, merge, prefill  # noqa: F401  (register the families)
from .family import EntryPoint, KernelFamily, family, ops, register
from .params import Param, ParamsLayout
from .render import TemplateError, include_dir, render_template, templates_dir

__all__ = [
    "EntryPoint", "KernelFamily", "family", "ops", "register", "Param", "ParamsLayout", "TemplateError",
    "include_dir", "render_template", "templates_dir",
]
