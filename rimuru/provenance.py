"""Provenance stamped on every measured number: git commit, device, date, command."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from functools import cache


@cache
def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        commit = out.stdout.strip() or "unknown"
        # pipeline outputs being rewritten do not make the code dirty
        status = ["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                  ":(top,exclude)results", ":(top,exclude)figures"]
        dirty = subprocess.run(status, capture_output=True, text=True, timeout=5,
                               cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("RIMURU_COMMIT", "unknown")


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def provenance() -> dict[str, str]:
    return {
        "device": device_name(),
        "commit": os.environ.get("RIMURU_COMMIT") or git_commit(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(shlex.quote(a) for a in sys.argv),
    }
