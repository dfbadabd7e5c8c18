"""Moved to control/messages.py; this shim keeps coordinator/ importable until its refactor lands."""
from ..control.messages import Endpoint, assign  # noqa: F401
