"""MERIT in a swarm (issue 16): conflict-aware branches and a one-shot merge."""
