"""kvroute: a cache-aware router for fleets of vLLM servers (the service: everything with I/O)."""

__version__ = "0.1.0"
