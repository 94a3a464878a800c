"""Command-line programs: ``accel-emud`` (the daemon), ``accel-smi`` and ``accel-diag``."""
