"""A vLLM stand-in: engine model, tiered cache, HTTP/ZMQ server, fleet, offline simulator."""
