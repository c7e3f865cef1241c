"""FTIS coordinator: hands out task leases, verifies, stores and relays signed rollout
bundles, and serves the operator's admin service. Never imports torch."""
