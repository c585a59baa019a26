"""The conftest fixtures that add the CPU to quant-dynamo's lowering devices change them for one
test only, and never the package's own set."""

from __future__ import annotations

import pytest

capture = pytest.importorskip("quant_dynamo.capture", reason="lowering needs quant-dynamo")
PACKAGE_SETS = {"KERNEL_DEVICES": capture.KERNEL_DEVICES, "OPS_DEVICES": capture.OPS_DEVICES}


@pytest.mark.parametrize("fixture, name", [("cpu_kernel_device", "KERNEL_DEVICES"),
                                           ("cpu_ops_device", "OPS_DEVICES")])
def test_the_fixture_adds_the_cpu_to_a_new_set(request, fixture, name):
    request.getfixturevalue(fixture)
    assert getattr(capture, name) == PACKAGE_SETS[name] | {"cpu"}
    assert "cpu" not in PACKAGE_SETS[name]  # the package's set object is left as it was


@pytest.mark.parametrize("name", ["KERNEL_DEVICES", "OPS_DEVICES"])
def test_without_the_fixture_the_package_set_is_back(name):
    assert getattr(capture, name) is PACKAGE_SETS[name] == {"cuda"}
