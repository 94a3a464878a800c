"""accel-emu's benchmark harness: ``python -m bench`` (``make bench``).

Every figure is reported as a ratio against a baseline measured side by side in the same
run, because the machines are shared and noisy. Benchmarks start their own daemons and
baseline servers on a temporary root and always stop them.

Layout:

* ``bench.suite``: the benchmarks, ``BENCHMARKS`` (name, fn(env) -> list[Row]); add rows
  there.
* ``bench.core``: ``Row``, ``Env`` (temporary directory, shared daemon and echo fs, cleanup),
  ``interleave`` (alternating blocks of timed calls), the table and the JSON report.
* ``bench.procs``: starting and stopping ``accel-emud`` and the echo filesystem.
* ``bench.echo_fs``: the minimal pyfuse3 filesystem that is the FUSE round-trip floor.
* ``bench.profile_driver``: where a DEVICE_QUERY spends its time inside the driver.
* ``bench.profile_launch``: where the firmware's CPU goes per launch (its scheduler in
  this process).
"""
