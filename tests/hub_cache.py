"""A Hugging Face cache laid out on disk as `huggingface_hub` writes it, without a network:
`models--org--name/blobs/<sha256>`, `snapshots/<commit>/<file>` symlinks to the blobs, and
`refs/<branch or tag>` holding the commit."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_snapshot(cache: Path, repo_id: str, folder: Path, commit: str, refs: tuple[str, ...] = ("main",),
                 kind: str = "models") -> Path:
    """Put every file of `folder` into `cache` as commit `commit` of `repo_id`, named by `refs`."""
    repo = cache / f"{kind}--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for src in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / src.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def offline_cache(monkeypatch, cache: Path) -> None:
    """This process reads `cache` as its Hugging Face cache, offline (what HF_HUB_CACHE and
    HF_HUB_OFFLINE=1 set when huggingface_hub is imported)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
