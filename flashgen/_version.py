"""The package version, in a module of its own so that any part of flashgen can read it without importing the
package (no import circle through ``flashgen/__init__.py``)."""

__version__ = "0.1.0"
