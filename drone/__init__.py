"""The drone: a worker that runs work orders (an agent loop over a model provider, with tools)
and stops each one the instant its abort signal fires."""
