"""``python -m onnx_light_ep``: same as the ``onnx-light`` console script."""

import sys

from .cli import main

sys.exit(main())
