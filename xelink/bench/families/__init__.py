"""The benchmark families of the suite, one module each, run as ``xelink bench <family>``.

Every module has ``add_arguments(parser)`` (its own options; the suite adds the output options) and
``run(ctx) -> rows`` (``ctx`` a ``xelink.bench.suite.Context``; collective: every rank calls it). The
suite's table (``xelink.bench.suite.FAMILIES``) names each family's module, what it needs and its plot.
"""

__all__: list[str] = []
