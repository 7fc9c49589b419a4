"""The public surfaces: each turns its wire format into the gateway's own request
(protocol.py) and the request's events back into its replies.

- http_app.py: the HTTP edge (uvicorn + Starlette) and what its surfaces share;
- openai_api.py (+ openai_models.py, its request bodies): OpenAI chat completions and completions,
  their replies built by openai_replies.py for this surface and the gRPC one alike;
- replies.py: a request's events gathered into whole choices, for every unary reply;
- responses_api.py (+ response_store.py): OpenAI's Responses API;
- messages_api.py: Anthropic's Messages API;
- grpc_api.py: the tandem.v1.Inference gRPC service (and, through Envoy, REST).
"""
