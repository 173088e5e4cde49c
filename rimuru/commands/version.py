"""`rimuru version`."""

from __future__ import annotations

import argparse
import platform


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--short", action="store_true", help="print only the package version")


def run(args: argparse.Namespace) -> int:
    import rimuru

    print(f"rimuru {rimuru.__version__}")
    if args.short:
        return 0
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu only"
    print(f"python {platform.python_version()}, torch {torch.__version__}, triton {triton_version}, device: {device}")
    return 0
