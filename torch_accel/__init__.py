"""``import torch_accel``: PyTorch's out-of-tree ``accel`` backend on the emulated device."""
