"""Nothing in Tandem deserialises pickle: every hop is protobuf, KV bytes are raw buffers,
weights are safetensors. This scans the source for every way pickle gets in."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "common", "kernels", "bench")
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal"}
# Calls that unpickle unless told otherwise.
UNSAFE_CALLS = {"load", "loads"}


def python_files() -> list[Path]:
    files = [f for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py")]
    return [f for f in files if "/pb/" not in f.as_posix()]


def violations(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods = [(node.module or "").split(".")[0]]
        else:
            mods = []
        found += [f"imports {m}" for m in mods if m in FORBIDDEN_MODULES]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
            if owner == "torch" and node.func.attr in UNSAFE_CALLS:
                if keywords.get("weights_only") != "True":
                    found.append(f"torch.{node.func.attr} without weights_only=True")
            if owner in ("np", "numpy") and node.func.attr == "load":
                if keywords.get("allow_pickle", "False") != "False":
                    found.append("numpy.load with allow_pickle")
            if node.func.attr in ("send", "recv") and owner in ("conn", "parent", "child"):
                found.append(f"multiprocessing Connection.{node.func.attr} (pickles)")
    return [f"{path.relative_to(root)}:{v}" for v in found]


def test_no_source_file_can_unpickle():
    files = python_files()
    assert len(files) > 50  # the scan really covers the code base
    problems = [v for f in files for v in violations(f)]
    assert not problems, problems


def test_the_scan_catches_each_way_in(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle\nfrom dill import loads\nimport torch, numpy as np\n"
        "torch.load('x')\nnp.load('y', allow_pickle=True)\nconn.recv()\n"
    )
    found = violations(bad, root=tmp_path)
    assert len(found) == 5, found
