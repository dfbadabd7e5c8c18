"""Moved to control/messages.py; this shim keeps coordinator/ importable until its refactor lands."""
from ..control.messages import *  # noqa: F401,F403
