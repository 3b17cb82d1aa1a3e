"""Root pytest configuration: the nbval sanitizer by absolute path, so `pytest --nbval labs/` works
from the repo root or anywhere else."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent


def pytest_configure(config):
    if hasattr(config.option, "nbval_sanitize_with") and not config.option.nbval_sanitize_with:
        config.option.nbval_sanitize_with = str(ROOT / "nbval_sanitize.cfg")
