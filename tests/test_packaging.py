"""The package's metadata applies without deprecation banners: ``project.license`` is an SPDX
string (a TOML table makes setuptools print a multi-line deprecation notice on every install)."""

import os
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_metadata_applies_without_a_license_banner():
    pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    here = os.getcwd()
    os.chdir(ROOT)  # the readme and package paths are relative to the project
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    finally:
        os.chdir(here)
    banners = [str(w.message).splitlines()[0] for w in caught if "license" in str(w.message).lower()]
    assert not banners, banners
    assert dist.metadata.license_expression == "Apache-2.0"
