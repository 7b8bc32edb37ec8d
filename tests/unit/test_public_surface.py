"""The package-level names the README imports resolve to the classes they name."""

from __future__ import annotations

import importlib

import pytest

import statebackend
import statebackend.spark


@pytest.mark.parametrize("package", [statebackend, statebackend.spark])
def test_every_exported_name_resolves_to_its_defining_object(package):
    for name in package.__all__:
        value = getattr(package, name)
        home = importlib.import_module(value.__module__)
        assert getattr(home, name) is value, name


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        statebackend.spark.no_such_name  # noqa: B018
