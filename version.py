"""The pack's version (pyproject.toml [project].version says the same; tests/test_packaging.py checks it)."""

__version__ = "0.1.0"
