"""The emulated device: one firmware process per physical device.

The driver (``kmod_emul``) boots it from a verified image and talks to it only through
the mailbox defined in :mod:`abi.mailbox`. It owns queue scheduling, the copy and compute
engines and low-level recovery; killing it is a device crash, restarting it a reset. User
space never imports this package.
"""
