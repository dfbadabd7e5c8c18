"""Coordinator: membership, failure detection, spare pool, recovery planning, control server."""
