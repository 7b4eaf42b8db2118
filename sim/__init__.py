"""The simulator: SimPy processes, step rules, metrics and runs (what is modelled: docs/MODEL.md)."""

import models  # noqa: F401  (installs the finder of the compiled modules first: models._native)
