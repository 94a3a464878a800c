"""GET_VERSION and DEVICE_QUERY on a real mount: what they answer, and their bad inputs."""

from __future__ import annotations

import pytest
from rawdev import assert_unharmed
from refusals import Bad, generic, refuse

from abi import uapi


def test_version_and_query(daemon, dev):
    v = dev.call(uapi.ACCEL_CMD_GET_VERSION, uapi.accel_version())
    assert (v.abi_major, v.abi_minor) == (uapi.ACCEL_ABI_MAJOR, uapi.ACCEL_ABI_MINOR)
    assert uapi.cstr(v.driver_version) == daemon.attr(0, "driver_version")
    info = dev.query()
    assert info.index == 0
    assert uapi.cstr(info.uuid) == daemon.attr(0, "uuid")
    assert uapi.cstr(info.serial) == daemon.attr(0, "serial")
    assert info.memory_total == 256 << 20
    assert uapi.DeviceState(info.state) == uapi.DeviceState.OPERATIONAL
    assert info.capabilities & uapi.Cap.NOOP


def _version(env):
    return uapi.accel_version()


def _reserved_2(env):
    arg = uapi.accel_version()
    arg.reserved[2] = 7
    return arg


GET_VERSION_BAD = [*generic(uapi.ACCEL_CMD_GET_VERSION, _version, context=False),
                   Bad("reserved[2]", "EINVAL", _reserved_2)]


@pytest.mark.command("ACCEL_CMD_GET_VERSION")
@pytest.mark.parametrize("bad", GET_VERSION_BAD, ids=str)
def test_get_version_bad_inputs(env, bad):
    refuse(env, uapi.ACCEL_CMD_GET_VERSION, bad)
    v = env.dev.call(uapi.ACCEL_CMD_GET_VERSION, uapi.accel_version())
    assert (v.abi_major, v.abi_minor) == (uapi.ACCEL_ABI_MAJOR, uapi.ACCEL_ABI_MINOR)
    assert_unharmed(env.dev, env.bystander)


def _info(env):
    return uapi.accel_device_info()


DEVICE_QUERY_BAD = generic(uapi.ACCEL_CMD_DEVICE_QUERY, _info, context=False)


@pytest.mark.command("ACCEL_CMD_DEVICE_QUERY")
@pytest.mark.parametrize("bad", DEVICE_QUERY_BAD, ids=str)
def test_device_query_bad_inputs(env, bad):
    refuse(env, uapi.ACCEL_CMD_DEVICE_QUERY, bad)
    assert uapi.cstr(env.dev.query().uuid) == env.daemon.attr(0, "uuid")
    assert_unharmed(env.dev, env.bystander)
