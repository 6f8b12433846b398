"""Continuous batching: several requests share one context, each in its own sequence (slot).

engine: the engine thread and its forward passes (the why of its exactness is there);
slots: which slot a request gets and what of its cache it keeps; output: what a drawn token does
to its request; requests: the Request, its Events and the Slot."""
from .engine import BatchEngine
from .requests import Event, QueueFull, Request

__all__ = ["BatchEngine", "Request", "QueueFull", "Event"]
