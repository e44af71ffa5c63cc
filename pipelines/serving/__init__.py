"""Serving glue for Ray Serve: the OpenAI wire format, the thread that drives a decoding engine, and
the replica's Prometheus metrics. The Serve application itself is `pipelines/serve.py`."""
