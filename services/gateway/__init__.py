"""The gateway: validates, applies chat templates, tokenizes, routes to workers, detokenizes,
parses tool calls and reports usage. It never imports torch."""
