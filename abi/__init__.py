"""The contracts between the layers, defined once (Linux's ``include/uapi``, ivpu's
``vpu_jsm_api.h``): nothing outside this package declares a layout.

- :mod:`abi.uapi`: user space and the driver: the device node's commands and structs,
  errno meanings, where the device tree lives.
- :mod:`abi.userq`: user space and the firmware: the user-mode ring, its packets, a
  LAUNCH's argument records, the doorbell page.
- :mod:`abi.mailbox`: the driver and the firmware: the mailbox, its messages, the
  descriptor channel.
- :mod:`abi.fwimage`: the firmware image format the driver loads and the boot ROM checks.
- :mod:`abi.kernel_lang`: the kernel language the runtime's front end emits and the
  firmware's checker accepts.

Every module imports only the standard library and its siblings, so any layer may import
any of them without pulling in another layer (tests/unit/test_layers.py holds them to it).
"""
