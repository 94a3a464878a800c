"""Build the vendor kernel library (``make kernels``): torch_accel's kernels compiled
ahead of time into ``firmware/kernel-library``, which the firmware consults after its
state directory's JIT cache and before compiling (firmware/jit.py ``KernelCache``).

How: a daemon whose ``--jit-cache`` is a fresh directory runs the workloads below (one
training step of the MLP and of a LeNet-size CNN, float32) in this process; the kernels
they launched are then that directory's entries, which replace the library. Entries are
keyed exactly as the JIT cache's, so the library serves only a firmware of the same
identity (ISA, firmware JIT ABI, python/numba/llvmlite/numpy, host CPU): rebuild it after
changing any of those (docs/kernels.md, "The vendor kernel library").
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from firmware.jit import LIBRARY_DIR

#: the checkout the daemon runs from
REPO = Path(__file__).resolve().parents[1]


def workload() -> None:
    """One training step of the MLP and of the CNN on accel (the kernels to ship)."""
    import torch
    import torch.nn.functional as F

    import torch_accel  # noqa: F401 - registers the device

    dev = torch.device("accel")
    nn = torch.nn
    models = [
        (nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10)), (64, 784)),
        (nn.Sequential(nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                       nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                       nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
                       nn.Linear(84, 10)), (64, 1, 28, 28)),
    ]
    for model, shape in models:
        model = model.to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(*shape).to(dev), torch.randint(0, 10, (shape[0],)).to(dev)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        torch.accel.synchronize()


def build(dest: Path) -> int:
    """Run the workloads against a daemon with an empty kernel cache and install what it
    compiled as ``dest``; return the number of entries."""
    with tempfile.TemporaryDirectory(prefix="aemu-kernel-library-") as tmp:
        root, state, cache = (Path(tmp) / n for n in ("root", "state", "cache"))
        root.mkdir()
        env = dict(os.environ, PYTHONPATH=str(REPO), AEMU_KERNEL_LIBRARY=str(Path(tmp) / "none"))
        subprocess.run([sys.executable, "-m", "tools.accel_emud", "--root", str(root),
                        "--devices", "1", "--memory", "512M", "--state-dir", str(state),
                        "--jit-cache", str(cache)], check=True, cwd=REPO, env=env)
        try:
            os.environ["ACCEL_EMU_ROOT"] = str(root)  # torch_accel is not imported yet
            workload()
        finally:
            # --force: this process still holds its contexts (accel-emud stop refuses a
            # daemon in use otherwise)
            subprocess.run([sys.executable, "-m", "tools.accel_emud", "stop", "--force",
                            "--root", str(root)], cwd=REPO, env=env, check=True)
        shutil.rmtree(cache / ".locks", ignore_errors=True)
        entries = sum(1 for shard in cache.glob("??") for _ in shard.iterdir())
        staged = dest.with_name(f".{dest.name}.new")
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(cache, staged)
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(staged, dest)
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kernel_library", description=__doc__)
    parser.add_argument("--dest", type=Path, default=LIBRARY_DIR)
    parser.add_argument("--workload", action="store_true",
                        help="only run the workloads, against $ACCEL_EMU_ROOT")
    args = parser.parse_args()
    if args.workload:
        workload()
        return
    t0 = time.monotonic()
    n = build(args.dest)
    print(f"kernel library: {n} kernels in {args.dest} ({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
