"""Test kit for backends and plugins: the backend contract suite and small test doubles.

Nothing here is used on a serving path. `core.testing.contract.BackendContractTests` is the suite every
backend runs against itself; `core.testing.fake` holds a deterministic in-memory backend used by the
core's own tests.
"""
