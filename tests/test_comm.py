"""A communicator's resources: attached once, found again, released last-first when it is freed."""
import pytest

import xelink
from xelink.errors import XelinkError


class _Res:
    def __init__(self, name, log, how="free"):
        self.name, self.log = name, log
        setattr(self, how, lambda: log.append(name))


def test_resources_are_released_in_reverse_order_of_attachment():
    world = xelink.init()
    try:
        comm = world.split(0)
        log = []
        a = comm.attach("a", _Res("a", log))
        assert comm.resource("a") is a and comm.resource("missing") is None
        made = comm.resource("b", lambda: _Res("b", log, how="close"))  # made once, on first use
        assert comm.resource("b", lambda: pytest.fail("made twice")) is made
        comm.attach("c", object())  # nothing to release: kept until the end, then dropped
        with pytest.raises(XelinkError, match=r"attach: w\.\d+c0 already has a resource 'a'"):
            comm.attach("a", _Res("a2", log))
        assert comm.detach("c") is not None and comm.resource("c") is None
        comm.free()
        assert log == ["b", "a"]
        with pytest.raises(XelinkError, match="attach: the communicator was freed"):
            comm.attach("d", object())
    finally:
        xelink.finalize()


def test_package_index_names_a_rank_outside_every_package():
    world = xelink.init()
    try:
        assert world.package_index(0) == (0, 0)
        with pytest.raises(ValueError, match=r"package_index: rank 5 is in no package of w"):
            world.package_index(5)
    finally:
        xelink.finalize()
