"""Test kit for backends and plugins: the backend contract suite, small test doubles and helpers.

Nothing here is used on a serving path. `core.testing.contract.BackendContractTests` is the suite every
backend runs against itself; `core.testing.fake` holds a deterministic in-memory backend used by the
core's own tests; `core.testing.wire` checks protocol streams; `core.testing.parsers` and
`core.testing.vision` hold helpers for tests of response parsers and vision processors;
`core.testing.recurrent_state` drives a scheduler with simulated recurrent states (slots, snapshots, forks).
"""
