"""Run a command and write its wall seconds and CPU seconds (user + system of it and every descendant it
waited for, from getrusage(RUSAGE_CHILDREN): exact, unlike a sampling benchmark) to a JSON file.

Usage: rusage.py OUT.json -- command [args...]   (exits with the command's status)
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        raise SystemExit(__doc__)
    out, command = Path(sys.argv[1]), sys.argv[3:]
    t0 = time.perf_counter()
    rc = subprocess.call(command)
    wall = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "user_s": usage.ru_utime,
                               "sys_s": usage.ru_stime, "returncode": rc}) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
