"""Command-line entry point ``onnx-light`` (also ``python -m onnx_light_ep``).

Subcommands:

- ``info``: print the package version, the path of the loaded native library,
  the onnxruntime version and the execution-provider devices ORT offers once
  the library is registered.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def _cmd_info(args: argparse.Namespace) -> int:
    from . import EP_NAME, __version__, get_library_path
    from . import _registration

    path = get_library_path()
    print(f"onnx_light_ep {__version__}")
    print(f"library: {path}")
    try:
        ort = _registration._import_ort()
    except RuntimeError as e:
        print(f"onnxruntime: {e}", file=sys.stderr)
        return 1
    print(f"onnxruntime {ort.__version__} ({ort.__file__})")
    try:
        _registration._ensure_ep_library(ort, path)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    devices = ort.get_ep_devices()
    print("EP devices:")
    for d in devices:
        hw = d.device
        print(
            f"  {d.ep_name} ({d.ep_vendor}): {hw.type} vendor={hw.vendor!r} "
            f"vendor_id={hw.vendor_id} device_id={hw.device_id} metadata={dict(d.ep_metadata)}"
        )
    if not any(d.ep_name == EP_NAME for d in devices):
        print(f"error: onnxruntime offers no device for {EP_NAME}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onnx-light",
        description="onnx-light-ep: persistent KV cache ops and execution provider for ONNX Runtime.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    info = sub.add_parser(
        "info", help="print the native library path, the onnxruntime version and the EP devices"
    )
    info.set_defaults(func=_cmd_info)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
