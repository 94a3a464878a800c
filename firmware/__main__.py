"""``python -m firmware``: the firmware process entry point (started by the driver)."""

from firmware.main import main

raise SystemExit(main())
