"""tandem's services: one process each. Generated protobuf code lives in gen/ (`make proto`)."""

import os
import sys

_GEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gen")
if not os.path.isdir(os.path.join(_GEN, "tandem")):
    raise ImportError(f"generated gRPC code is missing from {_GEN}: run `make proto`")
if _GEN not in sys.path:
    sys.path.insert(0, _GEN)
