"""Observability: Prometheus metrics (:mod:`.metrics`), the read-only status page
(:mod:`.status`) and the HTTP listener that serves both (:mod:`.http`)."""
