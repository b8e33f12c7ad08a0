"""Where the tests find the C++ example engine's drivers: the path an
environment variable names (scripts/python sets them), else the host build's;
without either the comparison is skipped, never passed."""
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def binary(env, name):
    given = os.environ.get(env)
    if given:
        assert pathlib.Path(given).is_file(), f"{env}={given} does not exist"
        return given
    built = ROOT / "build" / "host" / "examples" / name
    if not built.is_file():
        pytest.skip(f"no {name}: build the host preset (scripts/python does) or set {env}")
    return str(built)
