"""The backend's device kernels, written in the runtime's kernel language and launched on
runtime arrays (``runtime.DeviceArray`` / ``DeviceView``): no torch in here, so each is
tested against numpy on its own (tests/torch/test_device_kernels.py)."""
