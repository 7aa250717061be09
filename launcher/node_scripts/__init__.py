"""Small programs the launcher sends to a node's Python (`python - ARGS <<EOF`).

They run ON the nodes, so they import nothing from the launcher; `source(name)` returns the text. All are
stdlib-only except `nccl_bw`, which times an all-reduce and needs the node's torch.
"""
from pathlib import Path


def source(name: str) -> str:
    return (Path(__file__).parent / f"{name}.py").read_text()
