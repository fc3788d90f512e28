"""The OpenAI-compatible HTTP API of the gateway (``--http-port``).

``protocol`` reads OpenAI request bodies into the gateway's one request type
(``GenerateRequest``); ``responses`` writes OpenAI's answers; ``app`` holds the routes;
``server`` runs them with uvicorn on the gateway's event loop. Every request goes through the
same admission as ``Generate`` (``GenerationServicer.admit``): one queue, one validation, one
set of limits, and the same mapping of errors (``splitserve.common.errors.http_error_for``).
"""
