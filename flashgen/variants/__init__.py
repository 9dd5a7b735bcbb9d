"""Shipped attention variants (``flashgen.variants.examples``)."""

from .examples import EXAMPLES

__all__ = ["EXAMPLES"]
