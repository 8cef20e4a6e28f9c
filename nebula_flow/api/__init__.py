"""The OpenAI-compatible HTTP gateway: ``/v1/completions``, ``/v1/chat/completions`` (streamed as
server-sent events or not), ``/v1/models``, ``/health`` and ``/metrics``, in front of a broker.

The gateway is a client of the bus like any other (``nebula_flow.client.AsyncClient``): it never
touches the broker's state, and several gateways may share one broker. ``request`` turns an
OpenAI body into what the client sends (or a 400 in OpenAI's error shape); ``response`` builds
OpenAI's objects from the client's chunks and completion; ``app`` is the ASGI application
(Starlette, served by uvicorn); ``telemetry`` holds the Prometheus histograms; ``tools`` shapes tool calling on structured
outputs, ``reasoning`` a reasoning model's thinking apart from its answer; ``http_client``
speaks the API with ``AsyncClient``'s interface (what `bench --via api` and `replay --api` use).
"""
