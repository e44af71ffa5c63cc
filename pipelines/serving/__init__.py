"""Serving glue for Ray Serve: the HTTP surface (api.py), the OpenAI wire format, the thread that
drives a decoding engine, and the replica's Prometheus metrics. The Serve application itself is
`pipelines/serve.py`."""
