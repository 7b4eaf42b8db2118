"""The simulator: SimPy processes, metrics and runs (see the README)."""

import models  # noqa: F401  (installs the finder of the compiled modules first: models._native)
