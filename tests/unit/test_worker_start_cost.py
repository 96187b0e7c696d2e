"""Building the model for loading must not pull in heavy machinery it never uses: on the
meta device `nn.Embedding`'s random init went through `torch._refs`, which imported
`torch._dynamo` (about 4 s of every worker start on this box, ~2/3 of a tiny model's)."""

from __future__ import annotations

import subprocess
import sys


def test_loading_a_model_does_not_import_torch_dynamo(tiny_llama_dir):
    code = (
        "import sys, torch\n"
        "from services.worker.models.weight_loader import load_model\n"
        f"load_model({str(tiny_llama_dir)!r}, torch.float32)\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout
