"""Per torch release: the reported API mode, and a silent import (no warning, no log record)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

#: docs/torch-versions.md §1: the mode of each release of the compat matrix.
EXPECTED_MODE = {
    "2.9.1": "none",
    "2.10.0": "repr",
    "2.11.0": "opaque_value_base",
    "2.13.0": "opaque_value",
    "2.14.1": "custom_class",
    "2.15.0": "custom_class",
}
EXPECT = os.environ.get("QUANT_EXPECT_TORCH")

_CHILD = r"""
import json, logging, warnings
import torch  # torch's own import-time warnings (e.g. a missing NumPy) are not ours

records = []

class Keep(logging.Handler):
    def emit(self, record):
        records.append(f"{record.name}: {record.getMessage()}")

logging.getLogger().addHandler(Keep(level=logging.WARNING))
logging.getLogger().setLevel(logging.WARNING)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import quant_dynamo
    status = quant_dynamo.status()
print(json.dumps({
    "status": status,
    "warnings": [str(w.message) for w in caught],
    "logs": records,
}))
"""


def _import_in_child() -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def child() -> dict:
    return _import_in_child()


def test_running_torch_is_the_expected_release():
    if EXPECT is None:
        pytest.skip("QUANT_EXPECT_TORCH is not set (only the compat nox session sets it)")
    assert torch.__version__.split("+")[0] == EXPECT


def test_reported_mode(child):
    if EXPECT is None:
        pytest.skip("QUANT_EXPECT_TORCH is not set (only the compat nox session sets it)")
    assert child["status"]["mode"] == EXPECTED_MODE[EXPECT]
    registered = set(child["status"]["registered"])
    four = {"Float8CurrentScalingQuantizer", "MXFP8Quantizer", "Float8BlockQuantizer",
            "NVFP4Quantizer"}
    assert registered == (set() if EXPECTED_MODE[EXPECT] == "none" else four)


def test_import_is_silent(child):
    assert child["warnings"] == []
    assert child["logs"] == []


def test_opaque_base_alias_never_imported_on_custom_class_torch():
    if child_mode() != "custom_class":
        pytest.skip("torch._opaque_base only warns on torch >= 2.14 (mode 'custom_class')")
    code = "import sys, quant_dynamo; print('torch._opaque_base' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def child_mode() -> str:
    from quant_core.torch_compat import opaque_api_generation

    return opaque_api_generation()


_COMPILE_CHILD = r"""
import json, logging
import torch, quant_dynamo
from quant_core import MXFP8Quantizer

records = []

class Keep(logging.Handler):
    def emit(self, record):
        records.append(f"{record.name}: {record.getMessage()}")

logging.getLogger("torch._library").addHandler(Keep(level=logging.WARNING))
x = torch.randn(32, 64)
f = torch.compile(lambda x, q: quant_dynamo.qdq(x, q), backend="aot_eager", fullgraph=True)
ok = torch.equal(f(x, MXFP8Quantizer()), quant_dynamo.qdq(x, MXFP8Quantizer()))
print(json.dumps({"ok": ok, "logs": records}))
"""


def test_compiling_logs_no_deprecation_on_custom_class_torch():
    """2.14+ logs a warning for each use of the old names; quant-dynamo uses only the new API."""
    if child_mode() != "custom_class":
        pytest.skip("the old opaque names log deprecations only on torch >= 2.14")
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_CHILD], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"]
    assert [r for r in result["logs"] if "deprecated" in r] == []
