"""Where pagedlm keeps what it fetches and builds: one cache root for models, kernels and router embeddings."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$PAGEDLM_CACHE` if set, else `~/.cache/pagedlm` (not created here)."""
    env = os.environ.get("PAGEDLM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedlm"
