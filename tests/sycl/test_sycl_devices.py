"""communicators()'s default devices on the machines it cannot meet here, with stand-in dpctl devices: an
Intel GPU node under Level Zero's composite hierarchy (each card partitions into its tiles), the same under
the flat hierarchy the Intel reference runs (each tile a GPU that does not partition), and a CPU-only host."""
import pytest

from xelink.sycl import api


class _Device:
    def __init__(self, name, gpu, parts=None, tiles_only=False):
        self.name, self.is_gpu, self.is_cpu, self.parts = name, gpu, not gpu, parts
        self.tiles_only = tiles_only  # a GPU: partitions by affinity domain only (equal splits refused)
        self.asked = []

    def create_sub_devices(self, partition):
        self.asked.append(partition)
        if self.parts is None or (self.tiles_only and partition != "next_partitionable"):
            raise RuntimeError("Sub-devices were not created.")
        return [f"{self.name}.{i}" for i in range(self.parts)]


class _Dpctl:
    def __init__(self, devices):
        self.devices = devices

    def get_devices(self):
        return list(self.devices)


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    monkeypatch.setattr(api, "_sub_devices", {})


def test_composite_gpus_give_every_card_s_tiles():
    cards = [_Device(f"max{i}", True, parts=2, tiles_only=True) for i in range(3)]
    got = api._default_devices(_Dpctl([_Device("cpu", False, parts=8)] + cards))
    assert got == ["max0.0", "max0.1", "max1.0", "max1.1", "max2.0", "max2.1"]
    assert all(c.asked == ["next_partitionable"] for c in cards)  # never one compute unit a rank


def test_flat_gpus_are_one_entry_each():
    stacks = [_Device(f"stack{i}", True) for i in range(12)]
    assert api._default_devices(_Dpctl(stacks)) == stacks
    again = api._default_devices(_Dpctl(stacks))  # partitioned (and refused) once per device
    assert again == stacks and all(len(s.asked) == 1 for s in stacks)


def test_a_cpu_host_splits_its_device_into_compute_units():
    cpu = _Device("cpu", False, parts=2)
    assert api._default_devices(_Dpctl([cpu])) == ["cpu.0", "cpu.1"] and cpu.asked == [1]
    with pytest.raises(ValueError, match=r"communicators: lone cannot be partitioned"):
        api._default_devices(_Dpctl([_Device("lone", False)]))
    with pytest.raises(ValueError, match=r"communicators: dpctl sees no GPU or CPU device"):
        api._default_devices(_Dpctl([]))
