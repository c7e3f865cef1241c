"""``ftis-lab`` commands, one per module."""
