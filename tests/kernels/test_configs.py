"""The tile-config table (``quant_kernels.configs``): every launch site's config exists in both
modes, benchmark overrides are undone, unknown names fail clearly."""

from __future__ import annotations

import ast
import pathlib

import pytest
import quant_kernels
from quant_kernels import configs
from quant_kernels._common import interpreting

SRC = pathlib.Path(quant_kernels.__file__).parent
LAUNCH_OPTIONS = {"num_warps", "num_stages", "maxnreg"}


def _names(node: ast.expr, path: pathlib.Path) -> set[str]:
    """The config names an argument of ``config(...)`` or ``launch_config(...)`` can take: its
    string constants (also in conditional expressions), and for an f-string every table entry its
    literal prefix starts."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return _names(node.body, path) | _names(node.orelse, path)
    if isinstance(node, ast.JoinedStr) and isinstance(node.values[0], ast.Constant):
        prefix = node.values[0].value
        found = {name for name in configs.TABLE if name.startswith(prefix)}
        assert found, f"{path.name}: no config starts with {prefix!r}"
        return found
    raise AssertionError(f"{path.name}:{node.lineno}: unrecognised config name {ast.dump(node)}")


def _launch_site_names() -> set[str]:
    names = set()
    for path in sorted(SRC.glob("*.py")):
        if path.name == "configs.py":  # the lookup itself, by a variable name
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("config", "launch_config")):
                names |= _names(node.args[0], path)
    return names


def test_every_launch_site_config_exists_in_both_modes():
    names = _launch_site_names()
    assert len(names) >= 15, names  # the scan found the launch sites
    for name in sorted(names):
        assert name in configs.TABLE, name
        assert set(configs.TABLE[name]) == {"gpu", "interp"}, name
        gpu, interp = configs.TABLE[name]["gpu"], configs.TABLE[name]["interp"]
        assert set(gpu) - LAUNCH_OPTIONS == set(interp) - LAUNCH_OPTIONS, name
        assert not set(interp) & LAUNCH_OPTIONS, name
    assert names == set(configs.TABLE), "table entries no kernel launches with"


def test_config_is_a_copy_of_the_current_mode():
    cfg = configs.config("mxfp8")
    assert cfg == configs.TABLE["mxfp8"]["interp" if interpreting() else "gpu"]
    cfg["BM"] = -1
    assert configs.config("mxfp8")["BM"] != -1


def test_overridden_restores_on_exit():
    before = configs.TABLE["mxfp8"]["gpu"]
    new = {"BM": 16, "BK": 128, "num_warps": 2}
    with configs.overridden("mxfp8", new):
        assert configs.TABLE["mxfp8"]["gpu"] == new
        assert configs.TABLE["mxfp8"]["gpu"] is not new
        assert configs.config("mxfp8") == (configs.TABLE["mxfp8"]["interp"] if interpreting()
                                           else new)
    assert configs.TABLE["mxfp8"]["gpu"] is before


def test_overridden_restores_on_exception():
    before = configs.TABLE["nvfp4_col"]["gpu"]
    with pytest.raises(RuntimeError, match="sweep failed"):
        with configs.overridden("nvfp4_col", {"G": 2, "BK": 128, "num_warps": 4}):
            raise RuntimeError("sweep failed")
    assert configs.TABLE["nvfp4_col"]["gpu"] is before


def test_unknown_name_names_the_known_ones():
    with pytest.raises(KeyError, match=r"no tile config 'mxfp9'; known: amax, amax_partials, "):
        configs.config("mxfp9")
    with pytest.raises(KeyError, match=r"known: .*\bmxfp8_col\b"):
        with configs.overridden("mxfp9", {}):
            pass
    assert "mxfp9" not in configs.TABLE


def test_launch_config_is_the_config_and_its_launch_keywords(monkeypatch):
    """launch_config (built once per name and mode) is config's values with the keywords a
    launch passes, read-only, and it follows overridden in and out."""
    monkeypatch.setattr(configs, "interpreting", lambda: False)  # the "gpu" entries
    entry = configs.TABLE["mxfp8"]["gpu"]
    cfg, kw = configs.launch_config("mxfp8")
    assert dict(cfg) == entry
    # the table's tile sizes and launch options; host-side keys (lower case) stay out
    assert kw == {k: v for k, v in entry.items() if k.isupper() or k in LAUNCH_OPTIONS}
    assert "per_sm" in configs.TABLE["amax"]["gpu"]
    assert "per_sm" not in configs.launch_config("amax")[1]
    with pytest.raises(TypeError):
        cfg["BM"] = -1
    new = {"BM": 16, "BK": 128, "num_warps": 2}
    with configs.overridden("mxfp8", new):
        assert configs.launch_config("mxfp8") == (new, new)
    assert configs.launch_config("mxfp8") == (cfg, kw)
