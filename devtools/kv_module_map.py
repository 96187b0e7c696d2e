"""The module map of the peers' KV movement at any commit, counted by one rule:
`python -m devtools.kv_module_map [-v] [REV ...]` (default HEAD; `.` is the working tree).

What counts: every file whose job is moving KV between workers (the same-host pull, UCX,
the transfers between different layouts, the hand-off that orders them, the connector on
each side), plus the functions and classes inside shared files that exist only for it
(the worker's transfer methods, the RPC handlers, the client calls, the plan's load types
and their wire code). Whichever of them a commit has is counted, so commits from before
and after a function moved between files are measured alike. Lines are physical lines
(docstrings, comments and blank lines included); a symbol's lines run from its first
decorator to its last line.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

FILES = (
    "common/kv_rank_messages.py",
    "common/kv_shared_memory.py",
    "services/scheduler/cancelled_receives.py",
    "services/scheduler/handoff.py",
    "services/scheduler/kv_peer_connector.py",
    "services/scheduler/peer_loads.py",
    "services/worker/kv_layout_transfer.py",
    "services/worker/kv_peer_connector.py",
    "services/worker/kv_progress_watch.py",
    "services/worker/kv_pull.py",
    "services/worker/kv_shared.py",
    "services/worker/kv_transfer.py",
    "services/worker/staging.py",
    "services/worker/parallel/kv_message_io.py",
    "services/worker/parallel/kv_ranks.py",
    "services/worker/parallel/peer_kv.py",
)
SYMBOLS = {
    "services/worker/worker.py": (
        "TransferResult", "Worker._report_progress", "Worker._start_kv_movement",
        "Worker._peer_connector", "Worker._geometry", "Worker._rank_pools",
        "Worker._layer_written", "Worker._copy_on_tensor_thread", "Worker.cancel_transfers",
        "Worker.wait_for_step", "Worker.send_kv", "Worker._gather", "Worker.receive_kv",
        "Worker._scatter", "Worker.pull_kv", "Worker._check_blocks",
    ),
    "services/worker/server.py": (
        "kv_source_from_pb", "_kv_attributes", "WorkerServicer.SendKv",
        "WorkerServicer._send_kv", "WorkerServicer.ReceiveKv", "WorkerServicer._receive_kv",
        "WorkerServicer._await_kv", "WorkerServicer._loads_done",
    ),
    "services/scheduler/worker_client.py": ("WorkerClient.send_kv", "WorkerClient.receive_kv"),
    "services/scheduler/worker_types.py": (
        "KvPullRefusedError", "KvTransferResult", "KvPullSource", "WorkerInfo.can_pull_from",
        "WorkerConnection.send_kv", "WorkerConnection.receive_kv",
    ),
    "common/step_plan.py": ("KvSource", "KvLoad"),
    "common/step_plan_pb.py": ("_kv_load_pb", "kv_source_from_pb", "_kv_load_from"),
    "common/step_result.py": ("KvLoadDone",),
    "common/step_result_pb.py": ("kv_load_done_pb",),
    "services/scheduler/step_plan.py": ("PoolStepPlan.only_awaits_kv",),
}  # fmt: skip


def _show(rev: str, path: str) -> str | None:
    if rev == ".":
        return Path(path).read_text() if Path(path).exists() else None
    done = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def _symbol_lines(source: str, names: tuple[str, ...]) -> dict[str, int]:
    found: dict[str, int] = {}

    def visit(body, prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = prefix + node.name
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if name in names:
                    found[name] = node.end_lineno - first + 1
                if isinstance(node, ast.ClassDef):
                    visit(node.body, name + ".")

    visit(ast.parse(source).body, "")
    return found


def module_map(rev: str) -> dict:
    files = {}
    for path in FILES:
        source = _show(rev, path)
        if source is not None:
            files[path] = len(source.splitlines())
    symbols = {}
    for path, names in SYMBOLS.items():
        source = _show(rev, path)
        if source is not None:
            for name, lines in _symbol_lines(source, names).items():
                symbols[f"{path}:{name}"] = lines
    return {
        "rev": rev,
        "files": files,
        "symbols": symbols,
        "num_files": len(files),
        "file_lines": sum(files.values()),
        "symbol_lines": sum(symbols.values()),
        "lines": sum(files.values()) + sum(symbols.values()),
    }


def main(argv: list[str]) -> None:
    verbose = "-v" in argv
    for rev in [a for a in argv if a != "-v"] or ["HEAD"]:
        m = module_map(rev)
        print(f"{rev}: {m['num_files']} files, {m['file_lines']} lines; "
              f"{len(m['symbols'])} symbols in shared files, {m['symbol_lines']} lines; "
              f"{m['lines']} in all")  # fmt: skip
        if verbose:
            for name, lines in {**m["files"], **m["symbols"]}.items():
                print(f"  {lines:5} {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
